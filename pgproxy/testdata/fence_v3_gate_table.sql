-- The per-table SQL of the fence before tokens were bound to their connection
-- (commit e6960be: fenceTable's text, with the gate), verbatim, for
-- TestInstallUpgradesGateFence, which fills in the Go format verbs: 1 trigger
-- name, 2 table as a literal, 3 table, 4 relid, 5 epoch sequence, 6 hex(schema),
-- 7 hex(table), 8 trigger function, 9 gate sequence, 10 the gate's first setval.
-- Do not edit.
INSERT INTO fenceline.epoch (relid, relname) VALUES (%[4]d, %[2]s) ON CONFLICT (relid) DO NOTHING;
CREATE SEQUENCE IF NOT EXISTS %[5]s AS bigint MINVALUE 0;
REVOKE ALL ON SEQUENCE %[5]s FROM PUBLIC;
GRANT SELECT ON SEQUENCE %[5]s TO PUBLIC;
SELECT setval('%[5]s', greatest(coalesce(pg_sequence_last_value('%[5]s'), 0), ep.fence), true)
	FROM fenceline.epoch ep WHERE ep.relid = %[4]d;
CREATE SEQUENCE IF NOT EXISTS %[9]s AS bigint MINVALUE 1;
REVOKE ALL ON SEQUENCE %[9]s FROM PUBLIC;
GRANT SELECT ON SEQUENCE %[9]s TO PUBLIC;
%[10]s
UPDATE fenceline.epoch SET seq = '%[5]s', gate = '%[9]s' WHERE relid = %[4]d;
DROP TRIGGER IF EXISTS %[1]s ON %[3]s;
CREATE TRIGGER %[1]s BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %[3]s
	FOR EACH STATEMENT EXECUTE FUNCTION %[8]s('%[5]s', ',%[6]s.*,', ',%[6]s.%[7]s,', '%[9]s');
