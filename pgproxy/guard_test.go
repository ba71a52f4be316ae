package pgproxy

import (
	"slices"
	"testing"
)

// TestFenceGuard: what fenceGuard refuses whatever the lease, and what it
// lets through, statement by statement.
func TestFenceGuard(t *testing.T) {
	for _, tc := range []struct {
		sql     string
		refused bool
		signals []int32
	}{
		{"SELECT pg_sequence_last_value('fenceline.gate_1')", true, nil},
		{"SELECT pg_sequence_last_value('mydb.fenceline.gate_1')", true, nil},
		{`SELECT pg_sequence_last_value('"fenceline"."gate_1"')`, true, nil},
		{`SELECT pg_sequence_last_value('"FENCELINE".gate_1')`, false, nil}, // another schema
		{"SELECT 'fenceline.gate_1'::regclass", true, nil},
		{"SELECT last_value FROM U&\"fencel\\0069ne\".gate_1", true, nil},
		{"SELECT pg_sequence_last_value(16400)", true, nil},
		{"SELECT pg_sequence_last_value('public.s')", false, nil},
		{"SELECT pg_sequence_last_value('s')", false, nil},
		{"SELECT pg_sequence_last_value('GATE_16400')", true, nil},
		{"SELECT pg_sequence_last_value('gate_x')", false, nil},
		{"SELECT * FROM pg_sequences", true, nil},
		{"SELECT * FROM public.pg_sequences", false, nil},
		{"SELECT fenceline.fence_fast('a', 'b', 'c', 'd')", true, nil},
		{"SELECT 1::fenceline.t", true, nil},
		{"SELECT 1 OPERATOR(fenceline.=) 1", true, nil},
		{"DROP FUNCTION fenceline.bind_session()", true, nil},
		{"COMMENT ON TABLE fenceline.epoch IS 'x'", true, nil},
		{"CREATE TRIGGER t BEFORE INSERT ON public.t FOR EACH STATEMENT EXECUTE FUNCTION fenceline.fence_check()", true, nil},
		{"SET search_path = fenceline", true, nil},
		{"SET search_path = '$user', public", false, nil},
		{"SELECT set_config('search_path', 'public, fenceline', false)", true, nil},
		{"ALTER ROLE agent SET search_path = fenceline", true, nil},
		{"SHOW fenceline.token", true, nil},
		{"DO $$BEGIN PERFORM pg_sequence_last_value(16400); END$$", true, nil},
		{"CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN pg_sequence_last_value('fence' || 'line.gate_1'); END$$", true, nil},
		{"CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$", false, nil},
		{"CREATE FUNCTION f() RETURNS bigint LANGUAGE sql BEGIN ATOMIC SELECT pg_sequence_last_value(16400); END", true, nil},
		{"SELECT 'fenceline keeps agents apart'", false, nil},
		{"SELECT pg_terminate_backend(42)", false, []int32{42}},
		{"SELECT pg_cancel_backend('42'::int4)", false, []int32{42}},
		{"SELECT pg_cancel_backend(pg_backend_pid())", false, nil},
		{"SELECT pg_cancel_backend(pid) FROM pg_stat_activity", true, nil},
		{"SELECT pg_terminate_backend(41 + 1)", true, nil},
		{"SELECT pg_terminate_backend($1::int)", false, nil},
		{"SELECT pg_terminate_backend(n) FROM unnest($1::int[]) n", true, nil},
	} {
		t.Run(tc.sql, func(t *testing.T) {
			cls := Classify(tc.sql)
			if len(cls.Stmts) != 1 {
				t.Fatalf("%d statements (%s)", len(cls.Stmts), cls.ParseError)
			}
			st := cls.Stmts[0]
			if got := st.Forbidden != ""; got != tc.refused {
				t.Errorf("refused %v (%q), want %v", got, st.Forbidden, tc.refused)
			}
			if tc.refused && st.Class != ClassWrite {
				t.Errorf("class %v, want write (never the read fast path)", st.Class)
			}
			if !slices.Equal(st.Signals, tc.signals) {
				t.Errorf("signals %v, want %v", st.Signals, tc.signals)
			}
		})
	}
}

// TestFenceGuardNotByShape: texts that differ in constants only share a
// classification, but not when the constant decides: a name of the fence,
// an oid where a name was, another pid.
func TestFenceGuardNotByShape(t *testing.T) {
	c := NewClassifier(0)
	for _, p := range [][2]string{
		{"SELECT pg_sequence_last_value('public.s')", "SELECT pg_sequence_last_value('fenceline.gate_1')"},
		{"SELECT pg_sequence_last_value('public.s')", "SELECT pg_sequence_last_value(16400)"},
		{"SELECT count(*) FROM public.t WHERE note = 'x'", "SELECT count(*) FROM public.t WHERE note = 'fenceline.token'"},
	} {
		if st := c.Classify(p[0]).Stmts[0]; st.Forbidden != "" {
			t.Fatalf("%s: refused: %s", p[0], st.Forbidden)
		}
		if st := c.Classify(p[1]).Stmts[0]; st.Forbidden == "" {
			t.Errorf("%s, after %s: not refused", p[1], p[0])
		}
	}
	c.Classify("SELECT pg_terminate_backend(1)")
	if got := c.Classify("SELECT pg_terminate_backend(2)").Stmts[0].Signals; !slices.Equal(got, []int32{2}) {
		t.Errorf("pg_terminate_backend(2) after (1): signals %v, want [2]", got)
	}
}
