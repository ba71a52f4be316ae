// Package pgproxy is fenceline's Postgres wire fence: a proxy between an
// agent and its Postgres server that lets reads through and lands a write only
// while the agent's lease is live, only on tables in the lease's table scope,
// and only with a fence token that Postgres itself checks in the same
// transaction.
//
// # Startup
//
// SSLRequest is answered 'S' and TLS terminated with Config.TLS, or 'N'
// (fenceline run and sidecar set Config.TLS from --pg-tls-cert/--pg-tls-key,
// or a self-signed certificate made at start, SelfSignedTLS, so that
// sslmode=require works locally and prefer does not fall back to plaintext);
// GSSENCRequest is answered 'N'. CancelRequest is forwarded to the upstream
// when it names the backend of a live session (BackendKeyData is relayed
// unchanged). The StartupMessage is forwarded with
// default_transaction_read_only=on added (after "options", so it wins; the
// client is told "off"). Authentication messages are relayed untouched —
// trust, cleartext, MD5, SCRAM-SHA-256 — except that SCRAM-SHA-256-PLUS is
// struck from the server's offer: channel binding would bind to the proxy's
// TLS connection, not the server's. Replication connections are refused.
//
// # Reads
//
// Every session is read-only by default, so every implicit transaction is
// READ ONLY in Postgres itself: a SELECT that calls a function that writes
// (a user function, a view over one) fails with SQLSTATE 25006. A read that
// calls nextval or setval on sequences it names by constants (how ORMs
// fetch ids) is the exception: under a live lease, outside a transaction
// block, it is a write of those sequences, judged as nextval in a writable
// transaction is (below), and the proxy makes its transaction writable. The
// proxy owns that default: SET of default_transaction_read_only,
// transaction_read_only (to off), session characteristics, role,
// session_replication_role or fenceline.*, and any direct set_config() call,
// are refused (not RESET ROLE, SET ROLE NONE or RESET SESSION
// AUTHORIZATION: they only return to the role the session connected as;
// nor SET TRANSACTION READ WRITE in a transaction the proxy made writable);
// a change made behind its back (a function calling set_config)
// shows up as a ParameterStatus, which the proxy answers by setting the
// default again before the next unit. Units are serialized: the proxy
// forwards a unit (a Query, a FunctionCall, or extended-protocol messages up
// to Sync) only once the previous one is answered, so it always knows the
// transaction state a unit starts in. Reads whose text is on the whitelist
// (SELECT without INTO or locking, read CTEs only, VALUES, TABLE, SHOW,
// FETCH, EXPLAIN without ANALYZE, COPY TO STDOUT) go through byte for byte.
//
// # Session state the fence relies on
//
// The proxy keeps what it needs to know of the session from what Postgres
// reports (ParameterStatus), not from what it guesses statements do:
//
//   - default_transaction_read_only: reported "off" (a function called
//     set_config behind the proxy's back) makes the proxy set it on again
//     before the next unit. Inside one unit, a statement after a COMMIT or
//     ROLLBACK starts a transaction whose default the proxy cannot know:
//     unless the proxy makes that transaction writable itself, it puts
//     "SET transaction_read_only = on" (simple) or its prepared
//     fenceline_ro (extended) at its start, so transaction control inside
//     a multi-statement Query or a pipeline never opens a writable
//     transaction the fence did not classify.
//
//   - The client's own read-only default (SET default_transaction_read_only
//     = on, SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY; undone by
//     RESET, RESET ALL, DISCARD ALL, SET default_transaction_read_only =
//     off, SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE, and by
//     the ROLLBACK of the block that set it; for the two that switch it off
//     Postgres gets "SET default_transaction_read_only = on" instead, so its
//     own default, the proxy's, stays on and the client gets the tag SET,
//     as direct): while on, the proxy makes no transaction writable unless the
//     client asks (BEGIN READ WRITE), so Postgres refuses a write with
//     25006 as it would direct. BEGIN READ ONLY and SET TRANSACTION READ
//     ONLY need nothing: Postgres keeps them.
//
//   - standard_conforming_strings and client_encoding, which change how
//     Postgres parses a text. The classifier parses as Postgres does with
//     standard_conforming_strings on and UTF-8 text; a text without a
//     backslash and without bytes >= 0x80 parses the same under every
//     setting. A text that has them is refused, reads included (reason
//     "unsure-parse"), when the reported settings differ (scs off; a
//     client_encoding other than UTF8 or SQL_ASCII) or are not known (a
//     Parse or Query that follows an Execute with no ReadyForQuery
//     between: Postgres reports changes only then).
//
//   - server_encoding, which changes which name an identifier is: a
//     server in another encoding than UTF8 cuts long names at 63 bytes of
//     its own and may fold unquoted non-ASCII letters by its locale. There
//     an identifier, statement or portal name not in ASCII that is
//     unquoted or may be over 63 bytes (cutElsewhere) is refused the same
//     way. Names Postgres returns come in the client's encoding: under a
//     claim naming anything not in ASCII, a client not in UTF8 gets its
//     writes refused (notASCIIClaim) unless nothing is converted (SQL_ASCII
//     on either side); SQL_ASCII counts as an unsafe client
//     encoding in a database that is in neither UTF8 nor SQL_ASCII.
//
//   - search_path, which Postgres 15 does not report: learned
//     (current_schemas) when a write names a table without a schema, and
//     pinned for that write's transaction (Known limits).
//
//   - Prepared statements and portals, as the server holds them (names.go):
//     PREPARE and Parse share one namespace, cursors (DECLARE, CLOSE) and
//     Bind's portals another, as on the server; EXECUTE, Bind, Execute,
//     FETCH and MOVE are judged as what the name holds (EXECUTE with the
//     calls of its arguments, which run in its transaction; a statement
//     with its parameters' types, named in PREPARE or given by oid in a
//     Parse, whose input functions and domain checks run when a value is
//     bound). The client loop
//     changes its copy as it forwards each message (a segment's later
//     messages see its earlier ones); a change whose message the server
//     refused (a Parse, PREPARE or Bind of a name that exists) or skipped
//     (after an error, up to Sync) is undone when the next unit begins,
//     everything before it answered (TestNamesFollowTheServer). Code the
//     proxy does not parse may prepare statements too: each name's
//     prepare_time is learnt once, and after a unit that may run such code
//     it is compared with the server's when the next unit begins; a name
//     prepared again is an opaque write (TestNamesChangedByCode). Such
//     code runs while Postgres analyzes a Parse or PREPARE (a literal's
//     type input, a domain's check) or plans a Bind (folded immutable
//     functions) too: those count, and in a writable unit their calls are
//     judged in the message's place — a Parse's functions and operators
//     among them, whose parameter types its literals are coerced to, and a
//     Bind of a write as that write, for the defaults planning it folds
//     (TestAnalysisRunsWhatItCoercesAndFolds), and a Describe of a
//     prepared statement as its Parse, since Postgres analyzes it again
//     when its path or dependencies changed (TestDescribeAnalyzesAgain);
//     a Parse or Bind of a text the proxy is unsure of is refused in its
//     place in any unit. Where code may open a connection of
//     its own (dblink, a foreign server), so in any unit: what it writes
//     there no read-only transaction stops and no refused Execute after it
//     rolls back (TestAnalysisThroughAConnectionOfItsOwn); with
//     --pg-allow-opaque a Bind planned with no Execute, in a unit begun
//     read-only, is refused all the same. A name the client set after the last
//     such code of its unit, or by it, is learnt, not compared, unless the
//     server refused it (TestAnalysisThatPreparesAgainIsNoted,
//     TestAnalysisOfRefusedOrColumnTypedStatements).
//
//   - The proxy's catalog lookups run in the client's session: their text
//     names pg_catalog's operators, functions and types (qualify.go), and
//     they run with search_path pg_catalog, so nothing the client's path
//     holds stands in for them or runs inside them
//     (TestLookupInABlockIgnoresOperatorsInThePath,
//     TestOwnQueriesRunNoOperatorOfThePath); with the planner's defaults
//     and no JIT compilation, so neither the client's settings nor a
//     large catalog make each take seconds (TestCatalogLookupPlannerDefaults,
//     TestCatalogLookupsCompileNothing). In the client's block they run in
//     a savepoint of the proxy's own, rolled back after them, which leaves
//     every setting as the client had it.
//
//   - The proxy's own prepared statements and portals (fenceline_rw,
//     fenceline_tok, fenceline_sp, ...) run unjudged, as its own text. No
//     client message (Parse, Bind, Describe, Execute, Close) and no SQL
//     (PREPARE, EXECUTE, DEALLOCATE, DECLARE, FETCH, MOVE, CLOSE) may name
//     one: each is refused as fence tampering, audited. Before, a client
//     that closed fenceline_tok and prepared its own text under the name,
//     in the pipeline of a write, had that text run in its next writable
//     transaction (TestOwnStatementNamesAreNotTheClients), and EXECUTE
//     fenceline_rw made a read-only transaction writable
//     (TestOwnNamesInSQLAreRefused). After a unit that may run code the
//     proxy does not parse, which can DEALLOCATE and PREPARE them too, each
//     is prepared again, its Close first, before its next use.
//
// The classifier's cache folds literals only where the exact text cannot
// change the answer (plain decimal numbers with nothing glued to them;
// strings of printable ASCII without backslashes; newlines between
// constants kept); fold keys cannot equal a query text.
//
// # Writes
//
// Statements are classified with the real Postgres parser (pg_query),
// cached by text. Anything not provably read-only is a write; its target
// relations must each be in the lease's table claim. An unqualified name is
// checked against every schema of the session's effective search path
// (current_schemas(false), learned on first need and forgotten whenever
// anything may change it); one outside the claim refuses the write. Writes
// whose targets cannot be named (DO, CALL, EXECUTE of an unknown statement,
// GRANT, unparsable text) are refused unless Config.AllowOpaque. A call of a
// large-object function (lo_* but lo_get, lo_close, lo_tell, lo_lseek;
// lowrite) is such a write: Postgres 15 lets them write in a read-only
// transaction.
//
// An authorized write's transaction is made writable and carries the token,
// in the same message as the write:
//
//	simple:   Query("SET transaction_read_only = off;
//	                 SET LOCAL fenceline.token = '<token>'; <client text>")
//	extended: Bind/Execute fenceline_rw, Bind/Execute fenceline_tok($token),
//	          then the client's Parse/Bind/Execute ... Sync
//
// (and where the writes that follow name tables without a schema, the
// token and the pinned search path in one statement, fenceline_toksp, in
// place of fenceline_tok)
// before anything in that transaction takes a snapshot. A client BEGIN under a
// live lease makes the whole block writable with the token set (so a read
// followed by a write in one block works); a block begun without a live lease
// stays read-only and writes in it are refused. The proxy drops the answers to
// its own messages, so the client sees exactly what Postgres would have sent
// for its own (error positions are mapped back to the client's text).
//
// A refused write is replaced by a DO block that raises SQLSTATE 42501 naming
// the lease, its fence and the reason (the CONTEXT line Postgres adds for the
// block is dropped from the ErrorResponse), so Postgres itself fails the statement:
// a refused write inside a block leaves it failed; an implicit transaction
// rolls back; in the extended protocol the rest up to Sync is skipped. Each
// refusal is logged and recorded with Config.Audit.
//
// DROP ... IF EXISTS whose every target is outside the claim, alone in a
// Query outside a block under a live lease, is forwarded in the
// transaction the proxy made writable, followed by a guard of the proxy's
// in the same transaction: a DO block that raises the refusal when
// txid_current_if_assigned() is not null, i.e. the DROP wrote (it found
// what it names). A DROP of nothing gets Postgres's notices and tag, as
// direct; one that finds something is rolled back by Postgres and audited
// when the proxy sees the guard's error. No lookup, so no race with a
// concurrent CREATE. SET TRANSACTION READ WRITE in a transaction the proxy
// made writable changes nothing and passes; elsewhere it is refused.
//
// # The storage-side fence
//
// Install ("fenceline pg install") creates schema fenceline with the signing
// secret (readable only by the installing role), an epoch per fenced table (a
// sequence, fenceline.epoch_<relid>, listed in table fenceline.epoch) and a
// statement trigger on each table (INSERT, UPDATE, DELETE, TRUNCATE; COPY
// FROM and MERGE fire them too). The token is
// "v5:" fence ":" hex(lease) ":" session ":," (hex(schema) "." (hex(table) |
// "*") ",")+ ":" hex(sha256(k || sha256(k || payload))) (see MakeToken),
// where session is the number of the server connection it was made for (see
// Trust) and k is the lease's grant key: the lease service derives it from
// the database's secret for that lease, fence and tables and gives it to the
// lease's acquirer alone; the trigger derives it again from the token and
// compares in constant time. The proxy never holds the secret, so a runner
// can sign only the fence and tables it was granted. A write is refused
// with SQLSTATE 40001 when the token is missing, malformed or forged (also:
// not granted), 40001 when it is bound to another connection, 42501
// when its tables do not cover the table, and 40001 when its fence is below
// the table's epoch; a higher fence raises the epoch.
//
// The trigger runs as the writing role and, in the common case, evaluates one
// expression of pg_catalog functions with no query: the token is the one the
// session already proved genuine and its own (the hash of the token equals
// the session's currval of sequence fenceline.verified, which only the
// installing role's SECURITY DEFINER function fenceline.fence_slow_gate can
// set, after checking the MAC and the binding), it claims the table, and its fence equals the table's epoch
// before and after passing the table's gate (reading its gate sequence,
// which holds that in ROW EXCLUSIVE mode until the transaction ends).
// Everything else — the first write of a session or of a new token, a new
// lease's first write to a table, every refusal — goes to fence_slow_gate. A
// new lease's first write locks the gate in SHARE ROW EXCLUSIVE mode (ALTER
// SEQUENCE), so it waits for every open transaction that wrote the table
// under an older fence, and keeps new ones out, then raises the epoch. It
// waits at most the session's lock_timeout (raiseLockTimeout, 2 s, when the
// session set none): a transaction that holds the gate and stays open would
// otherwise stall the new lease, and every writer queued behind its raise,
// for as long as it liked. The raise is then refused with SQLSTATE 55P03
// (lock_not_available), naming the lease, its fence, the table and the
// gate; the client retries (TestGateHolderCannotStallAnotherLease). Epochs
// are read with pg_sequence_last_value, not through a snapshot, so the check
// is the same under every isolation level; an epoch never goes down, not even
// when the raising transaction rolls back. A zombie whose proxy still
// believes in its lease therefore cannot write a table that a newer holder
// has written.
//
// What the gate costs and where it shows: a ROW EXCLUSIVE relation lock takes
// Postgres's per-backend fast path while the transaction's relation locks fit
// its slots (16 in PostgreSQL 15: a fenced table with one index takes four —
// table, index, epoch, gate — plus one for fenceline.verified, so pgbench's
// tpcb-like fits exactly); beyond that, locks go through the shared lock
// table, as the advisory lock this replaced always did. A raise is DDL (ALTER
// SEQUENCE ... OWNED BY NONE, which changes nothing): event triggers on
// ddl_command_start/end fire for it, once per lease and table. Anything that
// reads the gate, such as a query on pg_sequences, holds it until its
// transaction ends and so delays a raise as a writer would: through the
// proxy such reads are refused (see What no lease allows); straight to
// Postgres (a role no proxy stands before) they delay a raise by its bound.
//
// The trigger comes in two kinds with one slow path. TriggerC is
// fenceline.fence_check_c from pgproxy/cfence: the fast-path checks in C
// (their Postgres CPU per fenced statement: BenchmarkStorageFence and
// scripts/bench-pg.sh, in docs/benchmarks.md), handing everything else to
// fence_slow_gate through SPI. It needs a superuser to install and the
// library built against the server's headers ("make -C pgproxy/cfence
// install"). TriggerPLpgSQL (fenceline.fence_check
// and fence_fast) runs on every Postgres, managed services included;
// Postgres sets up its expressions again in every transaction, which costs
// more per fenced statement there (the same benchmarks). Install's default, TriggerAuto
// ("fenceline pg install --trigger auto"), takes C when the server loads
// the library and plpgsql otherwise, and reports why not C. The
// storage-fence tests (zombie, forged and swapped tokens, session mark,
// epoch raise, DISCARD, fence_slow_gate's EXECUTE privilege) run against both;
// the protocol tests use the plpgsql one.
//
// # What a write really writes
//
// A statement may write tables it does not name. The proxy judges the
// tables it really writes (reach.go): before a unit that writes, it learns
// from the catalogs what each target reaches — its partitions and
// inheritance children (pg_inherits; not with ONLY), the referencing
// tables of foreign keys whose ON DELETE/UPDATE action is CASCADE, SET NULL
// or SET DEFAULT (pg_constraint; every referencing table for TRUNCATE ...
// CASCADE), the base tables of an updatable view (pg_depend of its
// _RETURN rule), the table that owns a sequence one of its defaults
// advances (pg_depend of the default, then of the sequence; not further
// from that table), and so on from each — and each reached table must be in
// the claim. What it cannot follow makes the write opaque (refused unless
// Config.AllowOpaque): a reached table with rules (pg_rewrite), user
// triggers (pg_trigger, not internal, not the fence's), defaults, checks
// or row security policies that call a function or operator created after
// initdb, indexes whose expressions or predicates call one, columns of a
// type that runs one (below), or a foreign table (relkind f). A statement that calls a function or
// operator created after initdb (any of that name: pg_proc, pg_operator,
// oid >= 16384), a builtin that runs SQL text (query_to_xml, ts_stat ...),
// or reads a view or policy-bearing table that calls one, is an opaque
// write when it runs in a writable transaction (one the proxy made
// writable, or will: a write or BEGIN in the same implicit transaction);
// outside one Postgres refuses the function's writes (25006), as direct. A
// call of dblink's functions is an opaque write anywhere: it writes over a
// connection of its own, which neither passes the proxy nor inherits the
// read-only transaction. So does a read of a foreign table (of any wrapper
// but file_fdw) or of a view, materialized view or parent over one: its
// server runs the query over a connection of the wrapper's, writable
// (postgres_fdw in Postgres 15 does not pass READ ONLY on), and a foreign
// table over a view that calls a writing function writes. And in a
// database where code has such a way out (the dblink extension, or a
// foreign server with tables), a user function, view or type called from
// any read is judged as in a writable transaction. The proxy learns both
// per database (foreignSQL: one query, cached for catalogTTL, forgotten
// with DDL); a read that names no relation and calls nothing never asks.
//
// DDL is judged by every relation it changes, not only the one it names
// first: an ALTER TABLE command's relations (ATTACH/DETACH PARTITION,
// INHERIT, NO INHERIT, a foreign key's referenced table, which gets the
// key's triggers) are targets as CREATE TABLE's INHERITS, PARTITION OF and
// REFERENCES are; SET SCHEMA writes the relation into its new schema;
// CASCADE on ALTER TABLE, ALTER TYPE or RENAME ATTRIBUTE changes what
// depends on it (other tables' foreign keys and views, tables typed by the
// type) and is opaque; ALTER SEQUENCE reaches the tables that own the
// sequence or take defaults from it. An index whose expressions or
// predicate call user code, and extended statistics whose expressions do,
// make a write of them (REINDEX INDEX; ANALYZE of the table) opaque.
// Autovacuum runs the same expressions later, as the table's owner: they
// are judged where they are made (CREATE INDEX or CREATE STATISTICS naming
// a user function is opaque).
//
// Which side judges: the proxy judges every route above before the write
// runs, fenced tables or not. The storage trigger is the second line, on
// fenced tables: it fires for foreign-key actions (Postgres runs them as
// statements on the referencing table), for every table TRUNCATE
// truncates, and for whatever user code writes in a transaction the
// proxy made writable (with AllowOpaque). It does not fire for a child's
// rows written through its partitioned or inherited parent (Postgres
// fires only the named table's statement triggers): those are the proxy's
// to judge alone. Nor for a subscription's apply, which runs with
// session_replication_role = replica (CREATE SUBSCRIPTION is opaque, and
// superuser-only in Postgres 15).
//
// A type created after initdb runs user code when its input, output, send,
// receive or typmod functions, a range's canonical or subtype_diff, a
// domain's default (pg_depend of the type) or CHECK (of its constraints),
// or a cast from or to it (pg_cast) is a function created after initdb;
// so does a domain, array, composite type or range made of one. In a
// writable transaction a statement that names such a type (a cast, a
// typed literal) or reads a relation with a column of one is opaque, and
// so is a write to a table with one. nextval and setval in a writable
// transaction write the sequence they name by a constant: it belongs to
// the tables that own it (serial, identity: pg_depend auto/internal) or
// take defaults from it (pg_depend of pg_attrdef), and each must be in
// the claim; a sequence no table uses is nobody's and passes; one not
// named by a constant is opaque. Such statements are not shared by the
// classifier's literal-shape cache (the constant decides), and a sequence
// named without its schema is looked up again each time (the search path
// decides; TestSequenceBySearchPath).
//
// Lookups are one query of the proxy's own per unit (two when it also
// learns functions and views), only for what is not cached: the cache is
// per proxy and database, kept for catalogTTL (1 s), forgotten whenever
// DDL passes the proxy and again when that DDL's transaction ends (a
// lookup that began before is not cached after); what a transaction that
// ran DDL learns is its own and not cached. Sessions that need the same
// answer at the same moment share one lookup: the others wait for it (up
// to 2 s) and take its answer. A read in a
// writable block whose calls and relations are all cached as harmless
// still goes through byte for byte. A write after DDL that may change what
// it reaches (a trigger, rule, policy, view, function, or a table that
// inherits or references another; not DROP without CASCADE, indexes, or a
// plain new table) in the same Query or pipeline, to a table that existed
// before it, is refused unless Config.AllowOpaque (the lookups ran before
// the DDL): send it on its own. DDL sent straight to Postgres, or through
// another lease's proxy, is seen within catalogTTL. Where the proxy may
// not send a query of its own (a failed block; a transaction a Flush left
// open), it judges with what it has cached, however old, and refuses a
// write whose reach it does not know.
//
// Route by route (tests in indirect_test.go; W is
// TestWritesByIndirection, each case in the simple and the extended
// protocol):
//
//	route                                  judged by                  test
//	UPDATE/DELETE/MERGE/INSERT/COPY FROM   proxy: pg_inherits         W/partition child, W/partition child delete,
//	  on a partitioned or inherited          (ONLY honoured)            W/inheritance child, W/merge into parent;
//	  parent                                                            TestIndirectWritesInsideTheClaim (claim
//	                                                                    covers the tree; UPDATE ONLY)
//	ALTER TABLE, VACUUM, ANALYZE, CLUSTER, proxy: targets and          (classifier corpus; reach as above)
//	  REINDEX on a parent                    their descendants
//	FK ON DELETE/UPDATE CASCADE,           proxy: pg_constraint;      W/cascade delete, W/cascade update,
//	  SET NULL, SET DEFAULT                  storage too, for fenced    W/set null, W/cascade into nobody's table,
//	                                         referencing tables         W/writable cte;
//	                                                                    TestIndirectWritesInsideTheClaim
//	TRUNCATE ... CASCADE                   proxy; storage too         W/truncate cascade
//	rules (DO ALSO / INSTEAD)              proxy: opaque              W/rule
//	user triggers on a written table       proxy: opaque              W/user trigger
//	defaults, checks, policies calling     proxy: opaque              W/default calling a function
//	  user functions
//	updatable views; INSTEAD OF triggers   proxy: base tables;        W/updatable view
//	                                         triggers, rules opaque
//	foreign tables (postgres_fdw)          proxy: opaque              W/foreign table
//	user function or operator called by    proxy: opaque in a         W/function from a read
//	  a statement                            writable transaction;
//	                                         Postgres outside one
//	view or policy calling a user          proxy: opaque in a         W/view calling a function, from a read
//	  function, read                         writable transaction
//	dblink_* (a connection of its own)     proxy: opaque anywhere     W/dblink from a read,
//	                                                                    W/dblink from a read in a block
//	DDL, then a write, in one Query        proxy: write refused       TestDDLThenWriteInOneQuery
//	DROP ... CASCADE                       proxy: opaque              (classifier corpus)
//	lo_* large objects                     proxy: opaque (by name)    TestLargeObjectsAreWrites
//	SELECT ... FOR UPDATE/SHARE            a lock; judged as a write  (classifier corpus)
//	                                         of what it locks
//	a user type named (x::t, CAST, t 'x')  proxy: opaque in a         W/cast to a domain with a user check,
//	  whose I/O, casts, domain checks or     writable transaction       W/CAST to a domain with a user check,
//	  defaults call user functions                                      W/typed literal of a domain with a
//	                                                                      user check, W/user cast of a named type
//	a column of such a type, read or       proxy: opaque (writable    W/user cast of a column read,
//	  written                                transaction; writes)       W/user cast on assignment,
//	                                                                    W/domain check on write
//	index expressions, partial-index       proxy: opaque              W/index expression,
//	  predicates calling user code                                      W/partial index predicate
//	user operators in defaults, checks     proxy: opaque              W/check calling a user operator
//	nextval, setval                        proxy in a writable        W/nextval of a sequence B's table owns,
//	                                         transaction: the tables    W/setval of a sequence B's table owns,
//	                                         owning or defaulting       W/nextval of a sequence B's default takes,
//	                                         from the sequence; not     W/nextval of a sequence named by an
//	                                         a constant: opaque;          expression; TestIndirectWritesInsideTheClaim
//	                                         Postgres outside one
//	a default calling nextval on a         proxy: the owner is        W/default advancing B's sequence
//	  sequence another table owns            reached (pg_depend)
//	CREATE EVENT TRIGGER, EXECUTE, COPY    proxy: opaque              W/create event trigger, W/execute of a
//	  FROM PROGRAM                                                      prepared statement, W/copy from program
//	EXPLAIN ANALYZE of a write             proxy: as the write        W/explain analyze of a write
//	DECLARE CURSOR, CREATE TABLE AS over   proxy: opaque in a         W/cursor over a user function,
//	  a user function                        writable transaction       W/temp table as a user function
//	publications, COMMENT, SECURITY LABEL  proxy: named targets or    (classifier corpus)
//	                                         opaque
//	ALTER TABLE ... ATTACH/DETACH          proxy: every relation      W/attach B's table as a partition,
//	  PARTITION, INHERIT, NO INHERIT,        named is a target          W/detach B's partition only,
//	  ADD FOREIGN KEY ... REFERENCES                                    W/inherit from B's table,
//	                                                                    W/foreign key onto B's table
//	CASCADE on ALTER TABLE, ALTER TYPE,    proxy: opaque              W/drop a constraint B's foreign key needs,
//	  RENAME ATTRIBUTE                                                  W/alter a type B's table is typed by,
//	                                                                    W/rename an attribute of a type B's
//	                                                                      table is typed by
//	ALTER ... SET SCHEMA                   proxy: the new name        W/move a table into B's schema
//	ALTER SEQUENCE                         proxy: owners and default  W/alter a sequence B's default takes,
//	                                         takers (pg_depend)         W/setval of a sequence B's default takes
//	REINDEX INDEX of an expression index;  proxy: opaque              W/reindex an expression index,
//	  REINDEX SCHEMA                                                    W/reindex a schema with an expression index
//	CREATE SCHEMA elements naming another  proxy: targets; GRANT      W/create a schema with a foreign key onto
//	  schema's tables                        elements opaque            B's table
//	ANALYZE of extended statistics on      proxy: opaque              W/analyze statistics on an expression
//	  user code
//	REFRESH MATERIALIZED VIEW, generated   proxy: opaque              W/refresh a materialized view,
//	  columns calling user code                                         W/generated column
//	INSTEAD OF triggers                    proxy: opaque              W/instead of trigger on a view
//	a read of a foreign table (or a view   proxy: opaque anywhere     W/foreign table read
//	  or parent over one)
//	a user function from a read where      proxy: opaque anywhere     W/a function calling dblink, from a read,
//	  dblink or a foreign server exists                                 W/a function reading a foreign table,
//	                                                                      from a read; TestUserFunctionReadOnly
//	autovacuum running index and           proxy, at CREATE INDEX /   W/create an index on a user function ...,
//	  statistics expressions                 CREATE STATISTICS          W/create statistics on a user function ...
//	subscriptions (logical apply)          proxy: opaque (superuser)  —
//	pg_advisory_*, LISTEN/NOTIFY           not writes: pass           (classifier corpus)
//
// # What no lease allows
//
// Some statements act on the fence or on other agents' sessions rather than
// on tables; the proxy refuses them whatever the lease, reads included, with
// SQLSTATE 42501 naming the lease, its owner, its fence and the reason, and
// audits each (reason fence-tamper, or other-session for a signal):
//
//	what                                       test
//	a name in schema fenceline, in any         TestFenceSchemaRefused, TestFenceGuard
//	  spelling the parser or a regclass,
//	  regproc or setting name reads (quoted,
//	  any case, Unicode escapes, 'fenceline.x',
//	  to_regclass, current_setting, SHOW);
//	  search_path holding it (SET, set_config,
//	  ALTER ROLE/DATABASE SET, startup
//	  parameters)
//	pg_sequence_last_value of anything but a   TestFenceSchemaRefused, TestFenceGuard
//	  sequence named by a constant (an oid,
//	  an expression), and pg_sequences: they
//	  read (and hold) the fence's gates
//	pg_cancel_backend, pg_terminate_backend,   TestSignalAnotherLeaseRefused, TestFenceGuard
//	  pg_log_backend_memory_contexts of any
//	  backend but the agent's own: a pid (a
//	  constant, or a Bind's parameter) that
//	  BackendKeyData gave a session of this
//	  proxy, or pg_backend_pid()
//	the same functions, and                    TestSignalAnotherLeaseRefused/fast-path
//	  pg_sequence_last_value, by fast-path
//	  FunctionCall
//	a DO block or function body (code the      TestFenceGuard
//	  proxy does not parse) that mentions any
//	  of the above
//	a CancelRequest for a backend this proxy   TestSignalAnotherLeaseRefused
//	  did not open (dropped)
//
// A string constant naming fenceline.x is refused wherever it stands (an
// inserted text 'fenceline.x ...' too): the proxy cannot tell where a string
// becomes a name. Texts that mention the schema are never classified by
// their literal shape. Code that builds the names at run time (EXECUTE of a
// string made by a function) is past the proxy's sight: it runs only with
// Config.AllowOpaque, and the storage-side bound on the raise still holds.
//
// # Sequence
//
//	client              pgproxy                             Postgres
//	  | StartupMessage     |                                    |
//	  |------------------->| + default_transaction_read_only=on |
//	  |                    |----------------------------------->|
//	  |<========== authentication relayed untouched ===========>|
//	  | Query(SELECT ..)   | whitelisted read: byte for byte    |
//	  |------------------->|----------------------------------->| (read-only txn)
//	  |<-------------------|<------------- rows, ReadyForQuery -|
//	  | Query(UPDATE t ..) | Fence() ok, t in scope             |
//	  |------------------->| once per connection:               |
//	  |                    | Query(SET transaction_read_only=off;
//	  |                    |   SELECT fenceline.bind_session()) |
//	  |                    |----------------------------------->| session number
//	  |                    |<------------ n (dropped), Z -------| (its currval)
//	  |                    | Query(SET transaction_read_only=off;
//	  |                    |   SET LOCAL fenceline.token=..; UPDATE t ..)
//	  |                    |----------------------------------->| trigger checks
//	  |                    |<-- SET, SET (dropped), UPDATE 1, Z-| token vs epoch
//	  |<-- UPDATE 1, Z ----|                                    |
//	  | Query(DELETE u ..) | u outside scope / lease lost       |
//	  |------------------->| Query(DO .. RAISE 42501 ..)        |
//	  |                    |----------------------------------->|
//	  |<-- ErrorResponse --|<--------------- ErrorResponse, Z --| + audit event
//
// # Bad input
//
// Messages over Config.MaxMessageSize, bad lengths, unknown message types,
// protocol versions other than 3 and malformed startup packets get a FATAL
// ErrorResponse and the connection is closed. Whenever a session ends, the
// proxy fails an open COPY FROM STDIN with CopyFail and sends Terminate, so
// the backend rolls back and exits. A client that vanishes (its connection
// ends without Terminate) while a statement runs has that statement
// cancelled first: Postgres alone would not notice until it finished.
//
// # I/O
//
// After startup a plain session (TCP or Unix socket) leaves Go's poller:
// its sockets are duplicated and their net.Conns closed, and its two loops
// (the client loop, which judges and forwards the client's messages, and
// the relay, which forwards the server's) run as tasks of one event loop
// the proxy's plain sessions share, one locked thread in epoll
// (internal/evloop, loop_linux.go). A goroutine per direction costs
// 1.3–1.7 times PgBouncer's CPU per transaction; a loop costs about what
// PgBouncer does (docs/benchmarks.md). What would block that thread runs
// on a goroutine while the task waits: recording an audit event, a cancel
// request on a new connection, a wait for another session's catalog
// lookup, parsing a text over 4 KiB; writing the proxy's log (a goroutine
// writes it from a bounded queue, which drops and counts what does not fit
// while the log's writer is stalled: logq.go); a task that has run 1 ms
// lets the others go first, and the lease's fence is read without waiting
// on the bus connection's lock (leasebus.Holder.FenceNoWait). The proxy
// raises GOMAXPROCS by one for the loop's thread unless
// the GOMAXPROCS environment variable is set. TLS sessions, and every
// session off Linux, run on two goroutines.
//
// # Trust
//
// The agent is taken to be hostile: it may read whatever its role may, open
// connections straight to Postgres, send any SQL through the proxy, and
// read the token inside a transaction the proxy made writable
// (current_setting shows it). It cannot make a token: the MAC needs the
// secret, which only the installing role reads. And a token it reads is
// worth nothing elsewhere: it is bound to the server connection the proxy
// made it for, by that connection's session number, a value of sequence
// fenceline.session that only the SECURITY DEFINER function
// fenceline.bind_session() draws (nextval: never the same twice, not even
// across a restart) and that Postgres keeps as that connection's own
// currval, which no role but the installing one may read or set. The
// proxy draws one per server connection, between transactions, before the
// first token it makes for it (one round trip: BenchmarkBindSession), and
// again after a DISCARD. fence_slow_gate
// refuses a token whose session number is not the connection's currval
// (40001, "bound to another connection", naming lease and fence) before it
// marks the token verified; the fast path trusts only the session's own
// mark, so it is bound too, at no cost (BenchmarkStorageFence is
// unchanged). Session numbers rather than the backend's pid: pids are
// reused, and the backend's start time, which would tell a reused pid
// apart, shows in pg_stat_activity only to roles with pg_read_all_stats,
// which a managed service's installing role may lack.
//
// On the connection it was made for, the token works only while the proxy
// forwards work under a live lease, which it checks for every unit. Once
// the lease is not live (Fence fails: lost, revoked, expired, or unknown
// because the bus cannot be reached):
//
//   - writes are refused;
//   - a transaction the proxy made writable refuses every statement but
//     ROLLBACK, reads included (one may call a function that writes, and
//     the transaction still carries the token), and COMMIT (it would land
//     what the transaction wrote before); a COPY FROM STDIN in it is failed
//     (CopyFail) rather than ended;
//   - a statement that the proxy sent under the live lease in such a
//     transaction and that still runs is cancelled (a CancelRequest for
//     its backend): at once when the lease source's Lost channel closes
//     (*leasebus.Holder), and at the proxy's next check, every
//     Config.LeaseCheckInterval (100 ms), whenever the source stops
//     reporting the lease live (a Holder is Unknown first, from a revoke's
//     notice until the service confirms it), and again at every check while
//     it runs.
//
// So the bound: no write with a lease's token lands, on any connection,
// later than one LeaseCheckInterval (plus a cancel's delivery, a few
// milliseconds) after the proxy's lease source first reports the lease
// not live. When a holder learns of a revoke is its own bound
// (leasebus). TestRevokedLeaseStopsItsConnection logs how long after
// "lease revoke" returned, and after a polled lease source reported the
// loss, a running write was cancelled. Only a COMMIT already sent lands:
// its writes were made under the lease.
//
// The proxy does not also fence itself off at storage (raise its tables'
// epochs past its fence) when its lease is lost: it has no connection of
// its own to raise them with (authentication is the client's, relayed), a
// raise waits for the very transactions it would stop (they hold the
// gate), and with the bound above nothing of the lease's can land after
// it. A proxy that cannot act (its process or host frozen) is the zombie
// the epochs stop: a regrant's first write waits for its open transactions,
// then refuses its fence.
//
// # Known limits
//
// Text the parser rejects is forwarded, so that Postgres answers its own
// syntax error as direct. The parser knows Postgres 17's grammar, and a
// server before 17 accepts some text it rejects (a keyword of 17 as an
// alias): such a Parse's analysis, or a Bind's planning, runs unjudged,
// and in a writable unit what it writes commits unless an Execute of it
// follows (refused, it rolls the transaction back). A guard after such a
// Parse that fails the transaction only when the server accepted it would
// close this (not built).
//
// The planner folds an immutable
// function called on constants inside a relation's index expressions,
// partition key or CHECK constraints (with constraint_exclusion), and
// partition pruning compares with the key's operator class, when it plans
// a read of the relation: the relation's call ('r') does not show them,
// so in a writable unit, or where code may open a connection of its own,
// such a function made before the lease (the proxy refuses creating one;
// an operator class takes a superuser) runs unjudged.
//
// Whether a call is builtin (catalog.seenBuiltin) is remembered across
// units until DDL through this proxy; after DDL through another fence it can
// be stale, and a statement name that code then prepares again, while
// Postgres analyzes or runs a call thought builtin, is not doubted; nor,
// where code may open a connection of its own, is a Parse's analysis or a
// Bind's planning of such a call judged outside a writable unit.
//
// Fences from one lease bus are unique, so the trigger compares fences only;
// a database fenced for two lease buses compares fences of both. After a dump
// and restore, run "fenceline pg install" again (epochs are keyed by table
// oid). DISCARD SEQUENCES forgets the session's mark but not the setting that
// says it is there: through the proxy, which resets that setting after any
// DISCARD, the next fenced write just takes the slow path again; a session
// straight to Postgres must RESET fenceline.verified itself. DISCARD
// SEQUENCES and DISCARD ALL also forget the connection's session number:
// the proxy draws a new one before its next token, between transactions;
// a token it must make inside a transaction block (COMMIT AND CHAIN after a
// DISCARD in the block) or inside an extended-protocol transaction left
// open across a Flush carries session 0, which Postgres refuses. A session
// that verified a token of the previous version (v3) before "pg install"
// upgraded the fence keeps it on the fast path until the session ends:
// bound to that session all the same.
//
// A COMMIT refused because the lease was lost leaves the block failed, as
// any refused statement does: the client ends it with ROLLBACK. PREPARE
// TRANSACTION is refused in a transaction the proxy made writable: a
// prepared transaction outlives its connection, and COMMIT PREPARED from
// anywhere would land its writes after the lease. Refusals at the storage
// side name lease and fence (the token has no owner) and are not audited on
// the bus (Postgres has none); the proxy's are. The binding, like the
// session mark, needs each of the proxy's server connections to stay one
// backend: a pooler between the proxy and Postgres must pool by session,
// not by transaction.
//
// Each fenced table a transaction writes holds two relation locks more (its
// epoch and gate sequences), and the fence one (fenceline.verified):
// pgbench's tpcb-like transaction, four fenced tables and their indexes,
// holds 16, all of Postgres 15's per-backend fast-path slots. A transaction
// that writes more fenced tables takes the rest through the shared lock
// table, which costs more under concurrency.
//
// Large-object functions called from inside another function (a user
// function, or SQL text run by query_to_xml) are not seen by the
// classifier, and Postgres 15 lets them write in a read-only transaction:
// large objects are not fenced at storage (pg_largeobject takes no
// trigger). A client's read-only default set from inside a function is not
// seen either (Postgres reports no change: its own default is already on);
// the client then gets a write its lease allows that it asked not to.
//
// User code the proxy does not see can still write in a transaction made
// writable: an event trigger's function, fired by DDL that passes (only a
// superuser can create one); a cast between two builtin types or an
// operator class (superuser only: CREATE CAST needs to own one of the
// types). Types with input or output functions of their own need C, which an
// unprivileged role cannot use; an extension's are judged as any user
// type's. COPY ... FROM PROGRAM needs superuser or
// pg_execute_server_program (and is opaque to the proxy). An INSERT into
// an inheritance parent (which writes the parent alone) and SELECT ... FOR
// UPDATE on a parent are judged with the parent's children all the same.
// Fenced tables check the token there (fence and table scope), unfenced
// tables do not. Outside a writable transaction, a user function that
// writes large objects, or opens a connection by a route the proxy does
// not know (an untrusted language, a third-party extension), is a read to
// the proxy. Functions are judged by name, whatever their schema and
// signature: a user function named like a builtin (count, lower) makes
// every call of that name opaque in writable transactions. A write that
// reaches tables by a route the proxy follows is judged whole: a claim
// that lacks one partition refuses every write through the parent (write
// the partitions by name, or use ONLY). A lookup inside a block runs in the
// block: a Query that holds SET TRANSACTION ISOLATION LEVEL and a statement
// the proxy must look up for fails ("must be called before any query");
// send SET TRANSACTION on its own, or with BEGIN. Fast-path FunctionCall is
// allowed only in a block made writable under a live lease, and, being a
// call of any function by its oid, only with Config.AllowOpaque. search_path resolution trusts the schemas that exist when
// the proxy looks; another session creating a shadowing schema later is caught
// only on fenced tables. search_path is not reported by Postgres 15, and a
// function the classifier cannot see into may change it: so a transaction
// with a write naming a table without a schema gets the path the proxy
// checked the name with (SET LOCAL search_path, once per transaction,
// before the write or the Bind that plans it, and again after a ROLLBACK
// TO or a COMMIT/ROLLBACK AND CHAIN, which undo it:
// TestPinSurvivesRollbackTo; the client's SHOW search_path in that transaction shows
// the schemas as quoted names). A function that changes the path inside
// a writable block, after that, is the block's (above); a statement that
// must run alone (CREATE INDEX CONCURRENTLY on an unqualified table)
// resolves with the session's path.
//
// A write that must run outside a transaction block (VACUUM, CREATE INDEX
// CONCURRENTLY, REINDEX ... CONCURRENTLY, REINDEX SCHEMA, CLUSTER without a
// table, DETACH PARTITION CONCURRENTLY, CREATE/DROP DATABASE, subscriptions)
// is forwarded alone, without the token: when the lease allows it (and the
// client's own default is not read-only) the proxy switches the session's
// read-only default off for it with a query of its own and on again before
// the next unit; otherwise it runs in the read-only default and Postgres
// refuses what writes. A function such a statement runs (an index
// expression marked IMMUTABLE that writes) runs writable too: unfenced
// tables do not check a token. COPY FROM STDIN with the extended protocol
// relies on Postgres ignoring Sync during COPY.
//
// Extended-protocol messages are held until Sync or Flush, so the proxy can
// decide the unit as a whole (whether to make its transaction writable must
// be known before its first Parse). A client that pauses for 20 ms after a
// prefix that runs nothing (Parse, Describe, Close, and Binds of statements
// that are reads) has that prefix forwarded as if it had sent Flush, so a
// statement_timeout fires during the pause as it would direct (pgx's suite
// checks this). Its implicit transaction starts read-only; reads that
// follow run in it; a write or transaction control that follows first has
// it ended by a Sync of the proxy's own and starts in a transaction the
// proxy decides, where the proxy binds the prefix's portals again (a
// transaction's end drops them). If Postgres refused the prefix, the proxy
// drops the client's messages up to its Sync and forwards that Sync alone,
// as Postgres would have skipped them. (The prefix and what follows then
// run in two transactions, not one: the prefix's snapshots only served its
// parse analysis and planning.) A pause inside a transaction the client
// itself left open with Flush forwards the prefix the same way, but the
// proxy never ends that transaction (it may hold writes the client's later
// error must roll back): a write in it is decided as after any Flush. The
// Bind of a write is held until the unit is complete: a statement_timeout
// that direct would fire between it and its Execute fires later.
//
// SHOW default_transaction_read_only answers the client's own value (a
// one-row SELECT: its tag is "SELECT 1"); a statement prepared for it keeps
// the value of when it was prepared, and current_setting and pg_settings
// show Postgres's own (on).
//
// # pgx suite exceptions
//
// scripts/pgx-suite.sh runs pgx v5's own tests straight to Postgres and
// through the fence (a live lease on public.*, --pg-allow-opaque). These
// pass direct and fail through the fence; every other test has the same
// result both ways:
//
//   - TestLoadTypeSameNameInDifferentSchemas: creates schemas pgx_a and pgx_b, outside the lease's claim (public.*): policy.
//   - TestCheckIdleConn: terminates the pool's connections with pg_terminate_backend(n) FROM unnest($1::int[]): a pid the fence cannot read may be another agent's session (see What no lease allows): policy.
//   - TestPoolAcquireChecksIdleConns: the same statement: policy.
package pgproxy
