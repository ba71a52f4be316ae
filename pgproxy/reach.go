package pgproxy

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pgq "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// What a statement really writes. A write names its targets, but Postgres
// may write others for it: the descendants of a partitioned or inherited
// table (their statement triggers do not fire), the referencing tables of
// foreign keys with ON DELETE/UPDATE CASCADE, SET NULL or SET DEFAULT
// (and, for TRUNCATE ... CASCADE, of every foreign key), the base tables of
// an updatable view, the owner of a sequence a default advances, the
// tables that own or take defaults from a sequence written (ALTER
// SEQUENCE). Those the proxy learns from the catalogs and judges as if
// named. What it cannot follow — rules, user triggers, defaults, checks
// and policies calling user functions or operators, indexes (and an index
// itself) whose expressions or predicates call them, extended statistics
// that call them, columns of types that run user code, foreign tables —
// makes the write opaque. A function or operator a user defined, called by
// a statement that runs in a writable transaction, may write any table:
// that statement is opaque too, as is one that names a type that runs
// user code (a cast, a typed literal) or reads a column of one; nextval
// and setval are judged by the tables that own or default from the
// sequence. A call of dblink's functions, and a read of a foreign table,
// is opaque anywhere: they write over a connection of their own, past the
// proxy; where the database has such a connection route (foreignSet), a
// user function called from any read is judged as in a writable
// transaction.
//
// Lookups are cached per database for catalogTTL, and forgotten whenever
// DDL passes the proxy (and again when the transaction that ran it ends).

// catalogTTL bounds how long the proxy trusts what it learned of a table
// or function; DDL sent straight to Postgres (not through this proxy) is
// seen within it.
const catalogTTL = time.Second

// firstUserOID is FirstNormalObjectId: objects with lower oids come with
// Postgres (initdb); higher ones were created since (extensions included).
const firstUserOID = 16384

// catalog caches what the proxy learned from Postgres's catalogs.
type catalog struct {
	mu    sync.Mutex
	rels  map[relKey]*reach // guarded by mu
	calls map[callKey]callInfo
	// seenBuiltin holds the calls a lookup found no user code behind,
	// kept across TTL, cleared by DDL the proxy sees (invalidate; guarded
	// by mu): a read whose calls are all here is not made a checked write
	// (see mayCheckWrites), so it needs no lookup, and does not make the
	// proxy doubt its names (noteCode). Stale after DDL through another
	// fence, a read still runs read-only; a name's doubt is then missed.
	seenBuiltin map[callKey]bool
	// dbs holds each database's *dbSlot (a session keeps its own
	// database's, see session.slot): its foreignSet, what a read may not
	// name, read without the lock on every read (see readsForeign). Never
	// behind mu: a session may first ask for its slot with mu held
	// (cachedCatalog's connectsVia; a review found it deadlocked there).
	dbs sync.Map
	// builtinEpoch counts the times seenBuiltin was emptied (by DDL, or
	// full): a session's note that its last calls were all in it
	// (allSeenBuiltin) holds while it stays the same.
	builtinEpoch atomic.Uint64
	// relFlights and callFlights are the lookups under way, each shared
	// with the sessions that need the same relation or call meanwhile
	// (learnRels, learnCalls); gen counts the invalidations, so a lookup
	// that began before one is not cached, nor shared, after it. Guarded
	// by mu.
	relFlights  map[relKey]*flight[*reach]
	callFlights map[callKey]*flight[callInfo]
	gen         uint64
	// waits counts the flights of other sessions waited for, shared the
	// answers taken from them.
	waits, shared atomic.Int64
	// texts holds lookups' texts as qualified (qualified), guarded by mu.
	texts map[string]string
	// lookupHook, set by tests before the proxy serves, runs before each
	// lookup's query with what it looks up.
	lookupHook func(names []string)
}

// flight is one session's lookup of a relation or a call, which other
// sessions that need it at the same moment wait for instead of looking it
// up too: when a cached answer's catalogTTL lapses, every session writing
// that table needs it again at once, and each lookup is a recursive
// catalog query run inside its client's transaction, which holds its row
// locks meanwhile (under pgbench's tpcb-like load, a herd of about 25
// such queries each second: docs/benchmarks.md).
type flight[V any] struct {
	gen  uint64 // the catalog's invalidations when it began
	done chan struct{}
	got  V    // set before done is closed
	ok   bool // got is the answer (the lookup did not fail)
}

// board sorts names for a lookup: those this session looks up (mine), with
// the flights it opened for them (own; none for a name shareable refuses),
// and the flights of other sessions' lookups of the rest (theirs).
func board[K comparable, V any](c *catalog, flights map[K]*flight[V], names []string, keyOf func(string) K, shareable func(string) bool) (mine []string, own, theirs map[string]*flight[V]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range names {
		if !shareable(n) {
			mine = append(mine, n)
			continue
		}
		k := keyOf(n)
		if f := flights[k]; f != nil {
			if theirs == nil {
				theirs = map[string]*flight[V]{}
			}
			theirs[n] = f
			continue
		}
		f := &flight[V]{gen: c.gen, done: make(chan struct{})}
		flights[k] = f
		if own == nil {
			own = map[string]*flight[V]{}
		}
		own[n] = f
		mine = append(mine, n)
	}
	return mine, own, theirs
}

// land ends the flights of own with the answers in got (none for a name
// got lacks: its lookup failed). The caller holds c.mu.
func land[K comparable, V any](flights map[K]*flight[V], own map[string]*flight[V], keyOf func(string) K, got map[string]V) {
	for n, f := range own {
		f.got, f.ok = got[n]
		if k := keyOf(n); flights[k] == f {
			delete(flights, k)
		}
		close(f.done)
	}
}

// await waits (up to flightWait) for another session's lookup f and
// returns its answer, unless it failed or DDL passed since it began.
func await[V any](s *session, c *catalog, f *flight[V]) (got V, ok bool) {
	c.waits.Add(1)
	if s.waitChan(f.done, flightWait) && f.ok && c.generation() == f.gen {
		c.shared.Add(1)
		return f.got, true
	}
	return got, false
}

// flightWait bounds how long a session waits for another's lookup before
// it looks the relation up itself.
const flightWait = 2 * time.Second

// foreignSet is the names (pg_class.relname) of the relations whose read
// runs a query on a server of its own: foreign tables (of any wrapper but
// file_fdw, which reads files), and the views, materialized views and
// partitioned or inherited tables over them. A foreign table's remote
// query runs on a connection of the wrapper's, past the proxy and outside
// the read-only transaction (postgres_fdw in Postgres 15 opens its remote
// transactions read-write): a foreign table over a view that calls a
// writing function writes, from a plain SELECT.
type foreignSet struct {
	names map[string]bool // by relname: what an unqualified name may be
	qual  map[string]bool // by quoteRel(schema, relname)
	// connects: the database has a way for code to open a connection of
	// its own (the dblink extension, or a foreign table of a wrapper that
	// connects): a read-only transaction then binds only the agent's own
	// connection, and a user function called from any read may write
	// through another. (The names, for refusals.)
	connects string
	at       time.Time
}

// foreignSQL finds the relations of a foreignSet.
const foreignSQL = `WITH RECURSIVE f(oid) AS (
  SELECT ft.ftrelid FROM pg_catalog.pg_foreign_table ft
    JOIN pg_catalog.pg_foreign_server sv ON sv.oid = ft.ftserver
    JOIN pg_catalog.pg_foreign_data_wrapper w ON w.oid = sv.srvfdw
    WHERE w.fdwname <> 'file_fdw'
  UNION SELECT x.oid FROM f, LATERAL (
    SELECT rw.ev_class FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_rewrite rw ON rw.oid = d.objid
      WHERE d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid = f.oid
        AND d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass
    UNION ALL SELECT i.inhparent FROM pg_catalog.pg_inherits i WHERE i.inhrelid = f.oid) x(oid)
)
SELECT DISTINCT 'r', c.relname::pg_catalog.text FROM f JOIN pg_catalog.pg_class c ON c.oid = f.oid
UNION ALL SELECT DISTINCT 'q', '"' || pg_catalog.replace(n.nspname, '"', '""') || '"."' || pg_catalog.replace(c.relname, '"', '""') || '"'
  FROM f JOIN pg_catalog.pg_class c ON c.oid = f.oid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
UNION ALL SELECT 'c', 'extension ' || e.extname FROM pg_catalog.pg_extension e WHERE e.extname = 'dblink'
UNION ALL SELECT 'c', 'foreign server ' || sv.srvname FROM pg_catalog.pg_foreign_server sv
  JOIN pg_catalog.pg_foreign_data_wrapper w ON w.oid = sv.srvfdw
  WHERE w.fdwname <> 'file_fdw' AND EXISTS (SELECT 1 FROM pg_catalog.pg_foreign_table ft WHERE ft.ftserver = sv.oid)`

// plannerDefaultsSQL sets the planner's settings (Query Tuning: the
// enable_* switches, costs, plan_cache_mode, ...; and parallel query,
// forced (force_parallel_mode, Postgres 16's debug_parallel_query) or per
// gather) back to the session's defaults for the rest of
// the transaction, switches JIT compilation off, and returns no row. Only
// settings any user may set. The proxy's catalog queries run in the
// client's session: a client that switched enable_seqscan off (Postgres's
// own regression tests do) made each take seconds instead of milliseconds.
// And a lookup is one large query whose estimated cost passes
// jit_above_cost's default once the database has a few hundred relations:
// compiled for every run, it took 200–300 ms where it runs in 10–20
// without (Postgres's regression database; docs/tests.md).
//
// Its operators are pg_catalog's by name, as a lookup's (qualifyCatalogSQL,
// checked by TestCatalogLookupsAreQualified): an operator of the same name
// in a schema the client put before pg_catalog ran its code inside this
// query, where the proxy does not look for code (it could prepare the
// proxy's own statement names again: TestOwnQueriesRunNoOperatorOfThePath).
const plannerDefaultsSQL = `SELECT 1 FROM (SELECT pg_catalog.count(pg_catalog.set_config(x.name, x.value, true)) AS n FROM (
  SELECT s.name, s.reset_val FROM pg_catalog.pg_settings s WHERE s.context OPERATOR(pg_catalog.=) 'user'
    AND s.name OPERATOR(pg_catalog.<>) 'jit'
    AND (s.setting OPERATOR(pg_catalog.<>) s.reset_val OR (s.setting IS NULL) OPERATOR(pg_catalog.<>) (s.reset_val IS NULL))
    AND (pg_catalog.starts_with(s.category, 'Query Tuning')
      OR s.name OPERATOR(pg_catalog.=) ANY (ARRAY['force_parallel_mode', 'debug_parallel_query', 'max_parallel_workers_per_gather']::pg_catalog.text[]))
  UNION ALL SELECT 'jit', 'off') x(name, value)) y
  WHERE y.n OPERATOR(pg_catalog.<) 0`

// catalogQuery runs q, a catalog lookup of the proxy's own, with every
// name it calls in pg_catalog (qualifyCatalogSQL), search_path pg_catalog
// (pinPathSQL), and the planner's default settings without JIT
// (plannerDefaultsSQL). Those are set for the transaction; in the client's
// transaction block the lookup runs in a savepoint of the proxy's own,
// rolled back after it (lookupSavepoint), which puts every setting back as
// the client had it, its SET LOCAL ones too. A lookup the server refuses
// there (the client's lock_timeout, say) is rolled back too, so the
// client's block is as it was and its write is refused with the fence's
// reason (lookupFailed), not left failed with the proxy's savepoint on
// top (TestFailedLookupInABlock).
//
// pre, statements of the proxy's own naming no operator, run before the
// path is pinned.
func (s *session) catalogQuery(q string, pre ...string) ([][]string, error) {
	qq, err := s.p.catalog.qualified(q)
	if err != nil {
		return nil, &queryError{sql: q, err: err}
	}
	stmts := append(append(make([]string, 0, len(pre)+5), pre...), pinPathSQL, plannerDefaultsSQL, qq)
	if s.txStatus == 'I' {
		return s.internalQuery(stmts...)
	}
	// The savepoint on its own first: a failure after it is known to
	// have the proxy's savepoint to roll back to, not a client's of the
	// same name.
	if _, err := s.internalQuery("SAVEPOINT " + lookupSavepoint); err != nil {
		return nil, err
	}
	undo := []string{"ROLLBACK TO SAVEPOINT " + lookupSavepoint, "RELEASE SAVEPOINT " + lookupSavepoint}
	rows, err := s.internalQuery(append(stmts, undo...)...)
	var qe *queryError
	if errors.As(err, &qe) {
		if _, uerr := s.internalQuery(undo...); uerr != nil && !errors.As(uerr, &qe) {
			return nil, uerr // the client's cancel, or the session's end: the caller's to see
		}
	}
	return rows, err
}

// lookupSavepoint is the savepoint a lookup in the client's block runs in.
// A client's savepoint of the same name is older, so each of the proxy's
// statements names the proxy's own (the innermost of that name).
const lookupSavepoint = "fenceline_lookup"

// qualified returns qualifyCatalogSQL(q), remembered: lookups repeat their
// texts (the same names, the same relations).
func (c *catalog) qualified(q string) (string, error) {
	c.mu.Lock()
	out, ok := c.texts[q]
	c.mu.Unlock()
	if ok {
		return out, nil
	}
	out, err := qualifyCatalogSQL(q)
	if err != nil {
		return "", err
	}
	c.mu.Lock()
	if len(c.texts) >= 256 {
		clear(c.texts)
	}
	c.texts[q] = out
	c.mu.Unlock()
	return out, nil
}

// pinPathSQL makes pg_catalog the only schema a lookup's operators resolve
// in, for the rest of its transaction. Its oid and regclass comparisons
// (p.oid >= 16384, d.classid = '...'::regclass) have no exact match in
// pg_catalog, so an operator of that name and those exact types in a
// schema of the session's path would be taken instead (CVE-2018-1058's
// pattern): a lookup that then took a user function for a builtin let a
// write calling it through (TestLookupIgnoresOperatorsInThePath).
const pinPathSQL = "SELECT 1 FROM pg_catalog.set_config('search_path', 'pg_catalog', true) x WHERE x IS NULL"

func newCatalog() *catalog {
	return &catalog{rels: map[relKey]*reach{}, calls: map[callKey]callInfo{}, seenBuiltin: map[callKey]bool{}, relFlights: map[relKey]*flight[*reach]{}, callFlights: map[callKey]*flight[callInfo]{}, texts: map[string]string{}}
}

type relKey struct {
	db, rel      string // rel: quoted "schema"."name"
	truncCascade bool
	only         bool // ONLY: not the target's own descendants
}

type callKey struct {
	db   string
	call string // 'f' or 'o', then the name
}

type callInfo struct {
	user bool // a function or operator of that name was created after initdb
	// owners: for a sequence ('q'), the tables ("schema.name") that own it
	// or take defaults from it.
	owners [][2]string
	at     time.Time
}

// reach is what writing one relation writes: the relation itself first,
// then what Postgres writes for it (none: no such relation).
type reach struct {
	rels []reached
	at   time.Time
}

type reached struct {
	schema, name string
	via          string // how it is reached: "" for the target itself
	opaque       string // why the proxy cannot tell what writing it writes
}

// invalidate forgets everything: DDL passed.
// generation is how often the cache was invalidated.
func (c *catalog) generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

func (c *catalog) invalidate() {
	c.mu.Lock()
	clear(c.rels)
	clear(c.calls)
	// What was builtin may not be after DDL (a column of a user type
	// added, an overload made): the names' doubt relies on it too.
	clear(c.seenBuiltin)
	c.builtinEpoch.Add(1)
	c.gen++
	c.dbs.Range(func(_, d any) bool {
		d.(*dbSlot).foreign.Store(nil)
		return true
	})
	c.mu.Unlock()
}

// dbSlot is what the catalog holds for one database that sessions read
// without its lock.
type dbSlot struct {
	foreign atomic.Pointer[foreignSet]
}

// slot is database db's dbSlot, made on first need; it takes no lock of
// the catalog's.
func (c *catalog) slot(db string) *dbSlot {
	if d, ok := c.dbs.Load(db); ok {
		return d.(*dbSlot)
	}
	d, _ := c.dbs.LoadOrStore(db, &dbSlot{})
	return d.(*dbSlot)
}

// slot is the session's database's dbSlot.
func (s *session) slot() *dbSlot {
	if s.dbSlot == nil {
		s.dbSlot = s.p.catalog.slot(s.database)
	}
	return s.dbSlot
}

// readsRelations: st reads relations by name (a foreign one may be among
// them).
func readsRelations(st *Statement) bool {
	for _, c := range st.Calls {
		if c.Kind == 'r' {
			return true
		}
	}
	return false
}

// foreignSetFor is the foreignSet to judge with, and whether it is fresh
// (learned within catalogTTL). In a transaction that ran DDL it is the
// unit's own, never fresh: learned again for every unit. In a block whose
// snapshot is old (snapshotOld) it is the unit's own once the unit learned
// one; until then the cache's, learned under fresh snapshots.
func (s *session) foreignSetFor() (fs *foreignSet, fresh bool) {
	fs, own := s.foreignSet()
	switch {
	case fs == nil:
		return nil, false
	case own:
		return fs, !s.ddlPending
	}
	return fs, time.Since(fs.at) < catalogTTL
}

// foreignSet is foreignSetFor's set, without asking the clock, and whether
// it is the unit's own.
func (s *session) foreignSet() (fs *foreignSet, own bool) {
	if s.ddlPending {
		return s.unit.foreign, true
	}
	if s.unit.foreign != nil && s.sim.snapOld == 2 {
		return s.unit.foreign, true
	}
	return s.slot().foreign.Load(), false
}

// readsForeign: st names a relation of the foreignSet (nil: none known).
func readsForeign(st *Statement, fs *foreignSet) string {
	if fs == nil || len(fs.names) == 0 {
		return ""
	}
	for _, c := range st.Calls {
		if c.Kind != 'r' || !fs.names[c.Name] {
			continue
		}
		if c.Schema == "" || c.Schema == "pg_temp" || fs.qual[quoteRel(c.Schema, c.Name)] {
			return c.Shown // (an unqualified name may resolve to it)
		}
	}
	return ""
}

// foreignToJudge: the fast path may not forward st as it is: it calls or
// reads something and the foreignSet is stale, or st reads one of its
// relations, or the database has a connection route and st calls what
// the cache does not know as builtin. A read that calls and names nothing
// costs nothing here; one that does, a load and a lookup in a map of
// usually no names.
func (s *session) foreignToJudge(st *Statement) bool {
	if len(st.Calls) == 0 {
		return false
	}
	fs, fresh := s.foreignSetFor()
	return !fresh || readsForeign(st, fs) != "" || fs.connects != "" && !s.callsKnownHarmless(st)
}

// connectsVia is the database's route to a connection of its own (see
// foreignSet), "" when it has none or the proxy does not know.
func (s *session) connectsVia() string {
	if fs, _ := s.foreignSet(); fs != nil {
		return fs.connects
	}
	return ""
}

// learnForeign learns the database's foreignSet when a statement of the
// unit reads relations and the set is missing or stale. Without a lookup
// (see learnCatalog) the set stays as it is: a relation that became
// foreign since is read unjudged, until the next unit that may look up.
func (s *session) learnForeign(stmts []*Statement, lookup bool) error {
	if !lookup {
		return nil
	}
	if _, fresh := s.foreignSetFor(); fresh {
		return nil
	}
	need := false
	for _, st := range stmts {
		if st != nil && len(st.Calls) > 0 {
			need = true
			break
		}
	}
	if !need {
		return nil
	}
	rows, err := s.catalogQuery(foreignSQL)
	if err != nil {
		return s.lookupFailed(err)
	}
	fs := &foreignSet{names: map[string]bool{}, qual: map[string]bool{}, at: time.Now()}
	var via []string
	for _, row := range rows {
		switch {
		case len(row) != 2:
		case row[0] == "r":
			fs.names[row[1]] = true
		case row[0] == "q":
			fs.qual[row[1]] = true
		case row[0] == "c":
			via = append(via, row[1])
		}
	}
	fs.connects = strings.Join(via, ", ")
	old := false
	if !s.ddlPending {
		if old, err = s.snapshotOld(); err != nil {
			return s.lookupFailed(err)
		}
	}
	if !s.ddlPending && !old {
		s.slot().foreign.Store(fs)
	} else {
		s.unit.foreign = fs
	}
	return nil
}

// unitCatalog is what the proxy knows for the unit being decided: filled by
// learnCatalog before the unit is authorized.
type unitCatalog struct {
	rels   map[relKey]*reach
	calls  map[callKey]bool
	owners map[callKey][][2]string // a sequence's tables (see callInfo)
	// ddl: a statement of the unit before this one is DDL, which may change
	// what a later one reaches (the lookups ran before the unit).
	ddl bool
	// foreign: the foreignSet learned for this unit in a transaction that
	// ran DDL (its own, not cached).
	foreign *foreignSet
}

// quoteRel is "schema"."name".
func quoteRel(schema, name string) string {
	q := func(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
	return q(schema) + "." + q(name)
}

// sqlText is s as a SQL expression of type text that reads the same under
// every standard_conforming_strings and client_encoding.
func sqlText(s string) string {
	return "pg_catalog.convert_from(pg_catalog.decode('" + hex.EncodeToString([]byte(s)) + "', 'hex'), 'UTF8')"
}

// userCode is the SQL condition "an object created after initdb": a
// pg_depend row d that refers to a function or operator with an oid of
// firstUserOID or more.
var userCode = `d.refclassid IN ('pg_catalog.pg_proc'::pg_catalog.regclass, 'pg_catalog.pg_operator'::pg_catalog.regclass) AND d.refobjid >= ` + fmt.Sprint(firstUserOID)

// userCodeOrOpclass is userCode, or d refers to an operator class whose
// support functions or operators are a user's: an index or partition key
// with it runs them to compare and route every row written.
var userCodeOrOpclass = `(` + userCode + ` OR d.refclassid = 'pg_catalog.pg_opclass'::pg_catalog.regclass AND EXISTS (
  SELECT 1 FROM pg_catalog.pg_opclass oc WHERE oc.oid = d.refobjid AND (
    EXISTS (SELECT 1 FROM pg_catalog.pg_amproc ap WHERE ap.amprocfamily = oc.opcfamily AND ap.amproc >= ` + fmt.Sprint(firstUserOID) + `)
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_amop ao JOIN pg_catalog.pg_operator o ON o.oid = ao.amopopr
      WHERE ao.amopfamily = oc.opcfamily AND (o.oid >= ` + fmt.Sprint(firstUserOID) + ` OR o.oprcode::pg_catalog.oid >= ` + fmt.Sprint(firstUserOID) + `)))))`

// userTypesSQL is CTEs te (which user type is part of which) and, recursive,
// ut(oid): the types created after
// initdb that run a function or operator created after initdb when a
// value of them is read, written, cast or checked — their input, output,
// send, receive or typmod functions, a range's canonical or subtype_diff
// function, a domain's default (pg_depend of the type), a domain's CHECK
// (pg_depend of its constraints), a cast from or to them (pg_cast: an
// unprivileged role can create one only with a type of its own on one
// side) — and every type made of one: a domain over it, an array of it, a
// composite type (a table's row type too) with an attribute of it, a
// range of it, a multirange of such a range. Usually empty: cheap to
// learn, and a type that came with Postgres is never in it.
func userTypesSQL() string {
	user := fmt.Sprint(firstUserOID)
	return `te(part, whole) AS MATERIALIZED (
  SELECT t.typbasetype, t.oid FROM pg_catalog.pg_type t WHERE t.oid >= ` + user + ` AND t.typbasetype >= ` + user + `
  UNION ALL SELECT t.typelem, t.oid FROM pg_catalog.pg_type t WHERE t.oid >= ` + user + ` AND t.typelem >= ` + user + `
  UNION ALL SELECT a.atttypid, c.reltype FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
    WHERE a.atttypid >= ` + user + ` AND a.attnum > 0 AND NOT a.attisdropped AND c.reltype <> 0
  UNION ALL SELECT r.rngsubtype, r.rngtypid FROM pg_catalog.pg_range r WHERE r.rngsubtype >= ` + user + `
  UNION ALL SELECT r.rngtypid, r.rngmultitypid FROM pg_catalog.pg_range r WHERE r.rngtypid >= ` + user + `
), ut(oid) AS (
  SELECT d.objid FROM pg_catalog.pg_depend d WHERE d.classid = 'pg_catalog.pg_type'::pg_catalog.regclass AND d.objid >= ` + user + ` AND ` + userCode + `
  UNION SELECT k.contypid FROM pg_catalog.pg_constraint k JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_constraint'::pg_catalog.regclass AND d.objid = k.oid
    WHERE k.contypid >= ` + user + ` AND ` + userCode + `
  UNION SELECT ca.castsource FROM pg_catalog.pg_cast ca WHERE ca.castfunc >= ` + user + ` AND ca.castsource >= ` + user + `
  UNION SELECT ca.casttarget FROM pg_catalog.pg_cast ca WHERE ca.castfunc >= ` + user + ` AND ca.casttarget >= ` + user + `
  UNION SELECT te.whole FROM ut JOIN te ON te.part = ut.oid
)`
}

// reachSQL finds, for each relation in rels (quoted names), every relation
// a write to it writes, and why the proxy cannot follow some.
func reachSQL(rels []string, truncCascade, only bool) string {
	arr := make([]string, len(rels))
	for i, r := range rels {
		arr[i] = sqlText(r)
	}
	allFK := "false"
	if truncCascade {
		allFK = "true"
	}
	notOnly := "true"
	if only {
		notOnly = "w.via <> '' OR e.via <> 'partition or inheritance child'"
	}
	return `WITH RECURSIVE e(src, dst, via) AS (
  SELECT inhparent, inhrelid, 'partition or inheritance child' FROM pg_catalog.pg_inherits
  UNION ALL SELECT confrelid, conrelid, 'foreign key action' FROM pg_catalog.pg_constraint
    WHERE contype = 'f' AND (` + allFK + ` OR confdeltype IN ('c', 'n', 'd') OR confupdtype IN ('c', 'n', 'd'))
  UNION ALL SELECT rw.ev_class, d.refobjid, 'base of view' FROM pg_catalog.pg_rewrite rw
    JOIN pg_catalog.pg_class v ON v.oid = rw.ev_class AND v.relkind = 'v'
    JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass AND d.objid = rw.oid
      AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid <> rw.ev_class
    WHERE rw.rulename = '_RETURN'
  UNION ALL SELECT ad.adrelid, d2.refobjid, 'sequence owner' FROM pg_catalog.pg_attrdef ad
    JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND d.objid = ad.oid
      AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
    JOIN pg_catalog.pg_depend d2 ON d2.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d2.objid = d.refobjid
      AND d2.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d2.refobjsubid > 0 AND d2.deptype IN ('a', 'i')
    WHERE d2.refobjid <> ad.adrelid
  UNION ALL SELECT d.objid, d.refobjid, 'sequence user' FROM pg_catalog.pg_depend d
    JOIN pg_catalog.pg_class sq ON sq.oid = d.objid AND sq.relkind = 'S'
    WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
      AND d.refobjsubid > 0 AND d.deptype IN ('a', 'i')
  UNION ALL SELECT d.refobjid, ad.adrelid, 'sequence user' FROM pg_catalog.pg_depend d
    JOIN pg_catalog.pg_attrdef ad ON ad.oid = d.objid
    JOIN pg_catalog.pg_class sq ON sq.oid = d.refobjid AND sq.relkind = 'S'
    WHERE d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
), w(root, oid, via, src) AS (
  SELECT r.n, pg_catalog.to_regclass(r.n)::pg_catalog.oid, '', 0::pg_catalog.oid
    FROM pg_catalog.unnest(ARRAY[` + strings.Join(arr, ", ") + `]::pg_catalog.text[]) AS r(n)
    WHERE pg_catalog.to_regclass(r.n) IS NOT NULL
  UNION SELECT w.root, e.dst, e.via, w.oid FROM w JOIN e ON e.src = w.oid WHERE (` + notOnly + `) AND w.via NOT IN ('sequence owner', 'sequence user')
), ` + userTypesSQL() + `
SELECT w.root, n.nspname, c.relname, w.via, COALESCE(sn.nspname || '.' || s.relname, ''),
  CASE WHEN w.via IN ('sequence owner', 'sequence user') THEN '' ELSE COALESCE(pg_catalog.concat_ws('; ',
    CASE WHEN c.relkind = 'f' THEN 'it is a foreign table, written on another server' END,
    CASE WHEN c.relkind IN ('i', 'I') AND EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
         WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objid = c.oid AND ` + userCodeOrOpclass + `)
      THEN 'it is an index whose expressions or predicate call user functions or operators, which may write other tables' END,
    CASE WHEN (c.relkind = 'p' OR c.relispartition) AND EXISTS (SELECT 1 FROM pg_catalog.pg_partition_ancestors(c.oid) pa
         JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objid = pa.relid::pg_catalog.oid AND d.objsubid = 0
         WHERE ` + userCodeOrOpclass + `)
      THEN 'its partition key (or a partitioned ancestor''s) calls user functions or operators (or an operator class of a user''s), which every row written runs and which may write other tables' END,
    (SELECT 'its extended statistics (' || pg_catalog.string_agg(x.stxname::pg_catalog.text, ', ') || ') call user functions or operators in their expressions, which ANALYZE runs and which may write other tables'
       FROM pg_catalog.pg_statistic_ext x WHERE x.stxrelid = c.oid AND EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
         WHERE d.classid = 'pg_catalog.pg_statistic_ext'::pg_catalog.regclass AND d.objid = x.oid AND ` + userCode + `)
       HAVING pg_catalog.count(*) > 0),
    (SELECT 'its rules (' || pg_catalog.string_agg(r.rulename::pg_catalog.text, ', ') || ') may write other tables'
       FROM pg_catalog.pg_rewrite r WHERE r.ev_class = c.oid AND r.rulename <> '_RETURN' HAVING pg_catalog.count(*) > 0),
    (SELECT 'its triggers (' || pg_catalog.string_agg(t.tgname::pg_catalog.text, ', ') || ') may write other tables'
       FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal
         AND NOT (t.tgname = '` + triggerName + `' AND (SELECT p.pronamespace FROM pg_catalog.pg_proc p WHERE p.oid = t.tgfoid) =
           (SELECT ns.oid FROM pg_catalog.pg_namespace ns WHERE ns.nspname = '` + Schema + `'))
       HAVING pg_catalog.count(*) > 0),
    (SELECT 'its indexes (' || pg_catalog.string_agg(i.indexrelid::pg_catalog.regclass::pg_catalog.text, ', ') || ') call user functions or operators in their expressions or predicates, which may write other tables'
       FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
         WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objid = i.indexrelid AND ` + userCodeOrOpclass + `)
       HAVING pg_catalog.count(*) > 0),
    (SELECT 'the types of its columns (' || pg_catalog.string_agg(a.attname::pg_catalog.text || ' ' || pg_catalog.format_type(a.atttypid, NULL), ', ') || ') run user functions (input or output, a cast, a domain check or default), which may write other tables'
       FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.atttypid IN (SELECT ut.oid FROM ut)
       HAVING pg_catalog.count(*) > 0),
    (SELECT 'its defaults, checks or policies call user functions or operators, which may write other tables' WHERE EXISTS (
       SELECT 1 FROM pg_catalog.pg_depend d WHERE ` + userCode + ` AND (
         d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND d.objid IN (SELECT a.oid FROM pg_catalog.pg_attrdef a WHERE a.adrelid = c.oid)
         OR d.classid = 'pg_catalog.pg_constraint'::pg_catalog.regclass AND d.objid IN (SELECT k.oid FROM pg_catalog.pg_constraint k WHERE k.conrelid = c.oid)
         OR d.classid = 'pg_catalog.pg_policy'::pg_catalog.regclass AND d.objid IN (SELECT p.oid FROM pg_catalog.pg_policy p WHERE p.polrelid = c.oid))))
  ), '') END
FROM w JOIN pg_catalog.pg_class c ON c.oid = w.oid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_class s ON s.oid = w.src LEFT JOIN pg_catalog.pg_namespace sn ON sn.oid = s.relnamespace`
}

// seqsSetting holds, for a lookup, the oid of the sequence each name
// nextval or setval takes means on the session's path (seqsByPathSQL), as
// JSON; local to the lookup's transaction (or its savepoint in the
// client's block: catalogQuery).
const seqsSetting = "fenceline.lookup_seqs"

// seqsByPathSQL notes in seqsSetting what the session's path makes of each
// sequence name in calls ('q'), qualified or not (Postgres reads the name:
// '"a.b"' is one name); "" when there is none. It runs before the lookup
// pins the path, and names no operator.
func seqsByPathSQL(calls []string) string {
	var names []string
	for _, c := range calls {
		if c[0] == 'q' && c != "q?" {
			names = append(names, sqlText(c[1:]))
		}
	}
	if len(names) == 0 {
		return ""
	}
	return `SELECT 1 FROM pg_catalog.set_config('` + seqsSetting + `', (SELECT pg_catalog.json_object_agg(q.n, pg_catalog.to_regclass(q.n)::pg_catalog.oid)
  FROM pg_catalog.unnest(ARRAY[` + strings.Join(names, ", ") + `]::pg_catalog.text[]) AS q(n))::pg_catalog.text, true) x WHERE x IS NULL`
}

// callsSQL returns, of the names in calls (a kind letter and a name), the
// tables that own a sequence nextval or setval names ('q'), and those that
// may run user code: a function or operator created after initdb
// carries the name ('f', 'o'), or a relation of that name is a view whose
// definition (or a view's it reads, and so on), or a relation whose row
// security policies, call a function or operator created after initdb
// ('r').
func callsSQL(calls []string) string {
	// The sequence a name without its schema means is the session's
	// path's: the lookup runs with pg_catalog alone (pinPathSQL), after
	// seqsByPathSQL noted what the path made of each name.
	seq := `(pg_catalog.current_setting('` + seqsSetting + `')::pg_catalog.json ->> q.n)::pg_catalog.oid`
	lists := map[byte][]string{}
	for _, c := range calls {
		lists[c[0]] = append(lists[c[0]], sqlText(c[1:]))
	}
	arr := func(k byte) string {
		return "ARRAY[" + strings.Join(lists[k], ", ") + "]::pg_catalog.text[]"
	}
	// Names compared as names (as the parser has them: cut to 63 bytes),
	// so that the catalogs' indexes on them serve the lookup.
	names := func(k byte) string {
		return "ARRAY[" + strings.Join(lists[k], ", ") + "]::pg_catalog.name[]"
	}
	user := fmt.Sprint(firstUserOID)
	return `WITH RECURSIVE v(root, oid) AS (
  SELECT c.relname::pg_catalog.text, c.oid FROM pg_catalog.pg_class c WHERE c.relname = ANY (` + names('r') + `)
  UNION SELECT v.root, d.refobjid FROM v JOIN pg_catalog.pg_rewrite rw ON rw.ev_class = v.oid
    JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass AND d.objid = rw.oid
      AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid <> v.oid
), ` + userTypesSQL() + `, qs(n, oid) AS (
  SELECT q.n, ` + seq + ` FROM pg_catalog.unnest(` + arr('q') + `) AS q(n) WHERE q.n <> '?'
)
SELECT DISTINCT 'r' || v.root, '', '' FROM v JOIN pg_catalog.pg_attribute a ON a.attrelid = v.oid AND a.attnum > 0 AND NOT a.attisdropped
  WHERE a.atttypid IN (SELECT ut.oid FROM ut)
UNION SELECT DISTINCT 'r' || v.root, '', '' FROM v JOIN pg_catalog.pg_class rc ON rc.oid = v.oid WHERE rc.reltype IN (SELECT ut.oid FROM ut)
UNION SELECT DISTINCT 't' || t.typname, '', '' FROM pg_catalog.pg_type t WHERE t.typname = ANY (` + names('t') + `)
  AND t.oid IN (SELECT ut.oid FROM ut)
UNION SELECT 'y' || y.n, '', '' FROM pg_catalog.unnest(` + arr('y') + `) AS y(n)
  WHERE y.n::pg_catalog.oid IN (SELECT ut.oid FROM ut) OR NOT EXISTS (SELECT FROM pg_catalog.pg_type t WHERE t.oid = y.n::pg_catalog.oid)
UNION SELECT DISTINCT 'r' || v.root, '', '' FROM v JOIN pg_catalog.pg_depend d
  ON d.refclassid IN ('pg_catalog.pg_proc'::pg_catalog.regclass, 'pg_catalog.pg_operator'::pg_catalog.regclass) AND d.refobjid >= ` + user + `
  AND (d.classid = 'pg_catalog.pg_rewrite'::pg_catalog.regclass AND d.objid IN (SELECT rw.oid FROM pg_catalog.pg_rewrite rw WHERE rw.ev_class = v.oid)
    OR d.classid = 'pg_catalog.pg_policy'::pg_catalog.regclass AND d.objid IN (SELECT p.oid FROM pg_catalog.pg_policy p WHERE p.polrelid = v.oid))
UNION SELECT DISTINCT 'f' || p.proname, '', '' FROM pg_catalog.pg_proc p WHERE p.oid >= ` + user + `
  AND p.proname = ANY (` + names('f') + `)
UNION SELECT DISTINCT 'o' || o.oprname, '', '' FROM pg_catalog.pg_operator o WHERE o.oid >= ` + user + `
  AND o.oprname = ANY (` + names('o') + `)
UNION SELECT 'q' || qs.n, tn.nspname, tc.relname FROM qs
  JOIN pg_catalog.pg_depend d ON d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.objid = qs.oid
    AND d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjsubid > 0 AND d.deptype IN ('a', 'i')
  JOIN pg_catalog.pg_class tc ON tc.oid = d.refobjid JOIN pg_catalog.pg_namespace tn ON tn.oid = tc.relnamespace
UNION SELECT 'q' || qs.n, tn.nspname, tc.relname FROM qs
  JOIN pg_catalog.pg_depend d ON d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass AND d.refobjid = qs.oid
    AND d.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass
  JOIN pg_catalog.pg_attrdef ad ON ad.oid = d.objid
  JOIN pg_catalog.pg_class tc ON tc.oid = ad.adrelid JOIN pg_catalog.pg_namespace tn ON tn.oid = tc.relnamespace`
}

// runsSQL are builtin functions that run SQL text (or read relations,
// which may be views calling functions) given as an argument: a user
// function called from them is not in the statement's text.
var runsSQL = map[string]bool{
	"query_to_xml": true, "query_to_xmlschema": true, "query_to_xml_and_xmlschema": true,
	"table_to_xml": true, "table_to_xmlschema": true, "table_to_xml_and_xmlschema": true,
	"schema_to_xml": true, "schema_to_xmlschema": true, "schema_to_xml_and_xmlschema": true,
	"database_to_xml": true, "database_to_xmlschema": true, "database_to_xml_and_xmlschema": true,
	"cursor_to_xml": true, "ts_stat": true, "ts_rewrite": true,
}

// otherConnection reports whether a function of this name opens a
// connection of its own (dblink's), whose writes pass neither the proxy
// nor the read-only transaction it runs in.
func otherConnection(name string) bool { return strings.HasPrefix(name, "dblink") }

// callKeyOf is the cache key of c in database db.
func callKeyOf(db string, c Call) callKey {
	return callKey{db: db, call: c.Key}
}

// relCandidates appends to buf the relations a target may name: its
// schema's, or one in each schema of the search path (as checkTarget
// judges them).
func relCandidates(buf []string, t Target, searchPath []string) []string {
	if t.Name == "" || t.Name == "*" {
		return buf
	}
	if t.Schema != "" {
		if t.rel != "" {
			return append(buf, t.rel)
		}
		return append(buf, quoteRel(t.Schema, t.Name))
	}
	if t.Temp {
		return append(buf, quoteRel("pg_temp", t.Name))
	}
	for _, sp := range searchPath {
		buf = append(buf, quoteRel(sp, t.Name))
	}
	return buf
}

// learnCatalog learns what the unit's statements reach and call, from the
// cache or, for what it lacks, from Postgres (queries of the proxy's own:
// one for the tables, one more for TRUNCATE ... CASCADE or ONLY targets,
// one for the calls). writable says whether the unit runs in a writable
// transaction; lookup whether the proxy may send queries of its own now (a
// failed block, or a transaction left open without Sync, would be
// disturbed): without, what is not cached stays unknown, and authorize
// refuses it.
func (s *session) learnCatalog(stmts []*Statement, writable, lookup bool) error {
	s.unit.reset()
	if err := s.learnForeign(stmts, lookup); err != nil {
		return err
	}
	now := time.Now()
	private := s.ddlPending // the transaction ran DDL: what it sees is its own (temp schemas are the session's)
	needRels, needCalls := s.cachedCatalog(stmts, writable, lookup, private, now)
	if !lookup || len(needRels[0])+len(needRels[1])+len(needRels[2])+len(needRels[3])+len(needCalls) == 0 {
		return nil
	}
	// What a lookup under an old snapshot learns is the unit's alone; the
	// cache, learned under fresh ones, it may still take (above).
	own := private
	if !own {
		old, err := s.snapshotOld()
		if err != nil {
			return s.lookupFailed(err)
		}
		own = old
	}
	for i, rels := range needRels {
		if len(rels) == 0 {
			continue
		}
		if err := s.learnRels(rels, i, own, now); err != nil {
			return s.lookupFailed(err)
		}
	}
	if len(needCalls) > 0 {
		if err := s.learnCalls(needCalls, own, now); err != nil {
			return s.lookupFailed(err)
		}
	}
	return nil
}

// snapshotOld reports whether the lookups of the client's block read the
// catalogs under a snapshot older than the catalog its writes run with: a
// REPEATABLE READ or SERIALIZABLE block reads every catalog row as of its
// first statement, while Postgres runs each write with the catalog as it
// is (a foreign key, trigger or rule another session committed since
// acts). Such a lookup may miss what it should find; what it learns is
// neither cached nor shared with other sessions' lookups
// (TestOldSnapshotLookupsAreNotShared). Asked once per block.
func (s *session) snapshotOld() (bool, error) {
	if s.txStatus == 'I' {
		return false, nil // the lookup's own transaction: a fresh snapshot
	}
	if s.sim.snapOld == 0 {
		rows, err := s.internalQuery("SELECT pg_catalog.current_setting('transaction_isolation')")
		if err != nil {
			return false, err
		}
		s.sim.snapOld = 2
		if len(rows) == 1 && len(rows[0]) == 1 && (rows[0][0] == "read committed" || rows[0][0] == "read uncommitted") {
			s.sim.snapOld = 1 // (read uncommitted is read committed in Postgres)
		}
	}
	return s.sim.snapOld == 2, nil
}

// reset forgets what the unit before learned.
func (u *unitCatalog) reset() {
	if u.rels == nil {
		u.rels, u.calls, u.owners = map[relKey]*reach{}, map[callKey]bool{}, map[callKey][][2]string{}
	}
	clear(u.rels)
	clear(u.calls)
	clear(u.owners)
	u.ddl = false
	u.foreign = nil
}

// cachedCatalog fills the unit's view (s.unit) with what the cache knows of
// the tables stmts write and the functions they call (the calls only where
// they may write: in a writable transaction, through another connection,
// or in a write), and returns what it lacks: the relations by lookup group
// (TRUNCATE ... CASCADE: 2, ONLY: 1) and the calls. private: the
// transaction ran DDL, so the cache is not for it; lookup: the proxy may
// look up now, so a cache entry older than catalogTTL is not used.
func (s *session) cachedCatalog(stmts []*Statement, writable, lookup, private bool, now time.Time) (needRels [4][]string, needCalls []string) {
	cat := s.p.catalog
	cat.mu.Lock()
	defer cat.mu.Unlock()
	for _, st := range stmts {
		if st == nil {
			continue
		}
		if st.Class == ClassWrite && !st.Opaque {
			s.cachedRels(st, lookup, private, now, &needRels)
		}
		if !writable && !st.Analyzed && s.connectsVia() == "" && st.Class != ClassWrite && !callsOtherConnection(st) {
			continue
		}
		needCalls = s.cachedCalls(st, lookup, private, now, needCalls)
	}
	return needRels, needCalls
}

// cachedRels is cachedCatalog's look at the relations st writes (each
// candidate of an unqualified name on the search path); what the cache
// lacks is added to need. The caller holds the catalog's lock.
func (s *session) cachedRels(st *Statement, lookup, private bool, now time.Time, need *[4][]string) {
	u, cat, db := &s.unit, s.p.catalog, s.database
	for _, t := range st.Targets {
		var buf [1]string
		for _, r := range relCandidates(buf[:0], t, s.searchPath) {
			k := relKey{db: db, rel: r, truncCascade: st.TruncCascade, only: t.Only}
			if _, ok := u.rels[k]; ok {
				continue
			}
			if c, ok := cat.rels[k]; ok && !private && (!lookup || now.Sub(c.at) < catalogTTL) && !strings.HasPrefix(r, `"pg_temp`) {
				u.rels[k] = c
				continue
			}
			u.rels[k] = nil
			need[relGroup(k)] = append(need[relGroup(k)], r)
		}
	}
}

// cachedCalls is cachedCatalog's look at the calls of st: one the cache
// lacks (or, when the proxy may look up, one resolved on the search path)
// counts as user-defined until learned, and is returned appended to need.
// The caller holds the catalog's lock.
func (s *session) cachedCalls(st *Statement, lookup, private bool, now time.Time, need []string) []string {
	u, cat, db := &s.unit, s.p.catalog, s.database
	for _, c := range st.Calls {
		k := callKeyOf(db, c)
		if _, ok := u.calls[k]; ok {
			continue
		}
		if ci, ok := cat.calls[k]; ok && !private && (!lookup || now.Sub(ci.at) < catalogTTL && !onSearchPath(c)) {
			u.calls[k] = ci.user
			if ci.owners != nil {
				u.owners[k] = ci.owners
			}
			continue
		}
		u.calls[k] = true // unknown until learned: as if user-defined
		need = append(need, k.call)
	}
	return need
}

// learnRels looks up what the relations of lookup group i reach (see
// cachedCatalog) and records it for the unit and, unless private, in the
// cache. Unless private, a relation another session is looking up at the
// moment is not looked up again: this one waits for that lookup (up to
// flightWait) and takes its answer, as it would have taken it from the
// cache a moment later. The error is the lookup's (see lookupFailed).
func (s *session) learnRels(rels []string, i int, private bool, now time.Time) error {
	cat := s.p.catalog
	keyOf := func(r string) relKey {
		return relKey{db: s.database, rel: r, truncCascade: i&2 != 0, only: i&1 != 0}
	}
	if private {
		return s.lookupRels(rels, i, true, now, keyOf, nil)
	}
	shareable := func(r string) bool { return !strings.HasPrefix(r, `"pg_temp`) } // the session's own schema
	mine, own, theirs := board(cat, cat.relFlights, rels, keyOf, shareable)
	if len(mine) > 0 {
		if err := s.lookupRels(mine, i, false, now, keyOf, own); err != nil {
			return err
		}
	}
	var late []string
	for r, f := range theirs {
		if rc, ok := await(s, cat, f); ok {
			s.unit.rels[keyOf(r)] = rc
			continue
		}
		late = append(late, r)
	}
	if len(late) == 0 {
		return nil
	}
	return s.lookupRels(late, i, false, now, keyOf, nil)
}

// lookupRels runs learnRels's query for rels and records what it learned
// for the unit and, unless private or the cache was invalidated since the
// lookup began, in the cache; each flight of own gets its relation's
// answer (none when the lookup failed), and ends.
func (s *session) lookupRels(rels []string, i int, private bool, now time.Time, keyOf func(string) relKey, own map[string]*flight[*reach]) error {
	u, cat := &s.unit, s.p.catalog
	gen := cat.generation()
	got := map[string]*reach{}
	defer func() {
		cat.mu.Lock()
		land(cat.relFlights, own, keyOf, got)
		cat.mu.Unlock()
	}()
	if cat.lookupHook != nil {
		s.blocking(func() { cat.lookupHook(rels) })
	}
	rows, err := s.catalogQuery(reachSQL(rels, i&2 != 0, i&1 != 0))
	if err != nil {
		return err
	}
	for _, r := range rels {
		got[r] = &reach{at: now}
	}
	for _, row := range rows {
		if len(row) != 6 || got[row[0]] == nil {
			continue
		}
		rc := reachedOf(row)
		if rc.via == "" {
			got[row[0]].rels = append([]reached{rc}, got[row[0]].rels...)
		} else {
			got[row[0]].rels = append(got[row[0]].rels, rc)
		}
	}
	cat.mu.Lock()
	for r, rc := range got {
		k := keyOf(r)
		u.rels[k] = rc
		if !private && !strings.HasPrefix(r, `"pg_temp`) && cat.gen == gen {
			cat.rels[k] = rc
		}
	}
	cat.mu.Unlock()
	return nil
}

// reachedOf reads a row of reachSQL's answer: the relation reached, and
// how (none for the relation itself).
func reachedOf(row []string) reached {
	via := ""
	switch row[3] {
	case "":
	case "foreign key action":
		via = "its foreign key acts on writes to " + row[4]
	case "base of view":
		via = "base table of view " + row[4]
	case "sequence owner":
		via = "it owns a sequence a default of " + row[4] + " advances"
	case "sequence user":
		via = "it owns sequence " + row[4] + " or a default of it takes values from it"
	default:
		via = row[3] + " of " + row[4]
	}
	return reached{schema: row[1], name: row[2], via: via, opaque: row[5]}
}

// learnCalls looks up whether the calls are user-defined (and a
// sequence's tables) and records it for the unit and, unless private, in
// the cache; unless private, a call another session is looking up at the
// moment is taken from that lookup, as learnRels does. The error is the
// lookup's (see lookupFailed).
func (s *session) learnCalls(needCalls []string, private bool, now time.Time) error {
	cat := s.p.catalog
	keyOf := func(c string) callKey { return callKey{db: s.database, call: c} }
	if private {
		return s.lookupCalls(needCalls, true, now, nil)
	}
	mine, own, theirs := board(cat, cat.callFlights, needCalls, keyOf, func(string) bool { return true })
	if len(mine) > 0 {
		if err := s.lookupCalls(mine, false, now, own); err != nil {
			return err
		}
	}
	var late []string
	for c, f := range theirs {
		if ci, ok := await(s, cat, f); ok {
			k := keyOf(c)
			s.unit.calls[k] = ci.user
			if ci.owners != nil {
				s.unit.owners[k] = ci.owners
			}
			continue
		}
		late = append(late, c)
	}
	if len(late) == 0 {
		return nil
	}
	return s.lookupCalls(late, false, now, nil)
}

// lookupCalls runs learnCalls's query for calls and records what it
// learned for the unit and, unless private or the cache was invalidated
// since the lookup began, in the cache; each flight of own gets its
// call's answer (none when the lookup failed), and ends.
func (s *session) lookupCalls(calls []string, private bool, now time.Time, own map[string]*flight[callInfo]) error {
	u, cat, db := &s.unit, s.p.catalog, s.database
	keyOf := func(c string) callKey { return callKey{db: db, call: c} }
	gen := cat.generation()
	got := map[string]callInfo{}
	defer func() {
		cat.mu.Lock()
		land(cat.callFlights, own, keyOf, got)
		cat.mu.Unlock()
	}()
	if cat.lookupHook != nil {
		s.blocking(func() { cat.lookupHook(calls) })
	}
	var pre []string
	if q := seqsByPathSQL(calls); q != "" {
		pre = append(pre, q)
	}
	rows, err := s.catalogQuery(callsSQL(calls), pre...)
	if err != nil {
		return err
	}
	user, owners := map[string]bool{}, map[string][][2]string{}
	for _, row := range rows {
		switch {
		case len(row) != 3:
		case row[2] != "":
			owners[row[0]] = append(owners[row[0]], [2]string{row[1], row[2]})
		default:
			user[row[0]] = true
		}
	}
	cat.mu.Lock()
	for _, c := range calls {
		k := keyOf(c)
		ci := callInfo{user: user[c] || c == "q?", owners: owners[c], at: now}
		got[c] = ci
		u.calls[k] = ci.user
		if ci.owners != nil {
			u.owners[k] = ci.owners
		}
		if !private && cat.gen == gen { // no DDL passed since the lookup began
			cat.calls[k] = ci
			if !user[c] && c[0] != 'q' {
				if len(cat.seenBuiltin) >= 1<<16 {
					clear(cat.seenBuiltin)
					cat.builtinEpoch.Add(1)
				}
				cat.seenBuiltin[k] = true
			}
		}
	}
	cat.mu.Unlock()
	return nil
}

// lookupFailed: Postgres refused a lookup of the proxy's own (a
// statement_timeout, say). What it did not learn stays unknown, so the
// writes that need it are refused; the session goes on. Other errors (the
// connection) end it.
func (s *session) lookupFailed(err error) error {
	var qe *queryError
	if errors.As(err, &qe) {
		s.p.log.Warn("catalog lookup failed; writes that need it are refused", "user", s.user, "err", err)
		return nil
	}
	return err
}

func relGroup(k relKey) int {
	g := 0
	if k.truncCascade {
		g |= 2
	}
	if k.only {
		g |= 1
	}
	return g
}

// callsKnownHarmless reports whether every call of st is cached, fresh,
// as builtin (so a read calling them may take the fast path in a writable
// transaction).
func (s *session) callsKnownHarmless(st *Statement) bool {
	if s.ddlPending {
		return false
	}
	cat, now := s.p.catalog, time.Now()
	cat.mu.Lock()
	defer cat.mu.Unlock()
	for _, c := range st.Calls {
		ci, ok := cat.calls[callKeyOf(s.database, c)]
		if !ok || ci.user || now.Sub(ci.at) >= catalogTTL || c.Kind == 'f' && (runsSQL[c.Name] || otherConnection(c.Name)) || c.Kind == 'q' && (ci.owners != nil || onSearchPath(c)) {
			return false
		}
	}
	return true
}

func callsOtherConnection(st *Statement) bool {
	for _, c := range st.Calls {
		if c.Kind == 'f' && otherConnection(c.Name) {
			return true
		}
	}
	return false
}

// judgeCalls returns st as the proxy must judge it: a statement that calls
// a user-defined function or operator (or one of the builtins that run SQL
// text) where that can write — in a writable transaction, or dblink's
// anywhere — is an opaque write, naming the call.
func (s *session) judgeCalls(st *Statement, writable bool) *Statement {
	if st == nil || st.Forbidden != "" || st.Unsure != "" {
		return st
	}
	if len(st.Signals) > 0 || len(st.SignalParams) > 0 {
		if cp := s.judgeSignals(st, nil); cp != nil {
			return cp
		}
	}
	if len(st.Calls) == 0 {
		return st
	}
	if readsRelations(st) {
		fs, _ := s.foreignSet()
		if name := readsForeign(st, fs); name != "" {
			cp := *st
			cp.Class, cp.Opaque, cp.OpaqueWhy = ClassWrite, true, "it reads "+name+", a foreign table (or a view or parent of one), whose server runs the query over a connection of its own, past the proxy and writable"
			return &cp
		}
	}
	// Where code may open a connection of its own, a read-only
	// transaction does not stop user code from writing: it is judged as
	// in a writable one.
	connects := ""
	if !writable {
		connects = s.connectsVia()
	}
	for _, c := range st.Calls {
		other := c.Kind == 'f' && otherConnection(c.Name)
		if !writable && !other && connects == "" {
			continue
		}
		if st.WriteCheck && c.Kind != 'q' && !other && !(c.Kind == 'f' && runsSQL[c.Name]) {
			continue // judged by what it writes (checkedWrite)
		}
		user, known := s.unit.calls[callKeyOf(s.database, c)]
		if c.Kind == 'q' && writable {
			if why := s.judgeSequence(c); why != "" {
				cp := *st
				cp.Class, cp.Opaque, cp.OpaqueWhy = ClassWrite, true, why
				return &cp
			}
			continue
		}
		if other || c.Kind == 'f' && runsSQL[c.Name] || user || !known {
			why := "it calls " + c.Shown + ", a function a user defined, which may write any table"
			switch {
			case other:
				why = "it calls " + c.Shown + ", which writes over a connection of its own, past the proxy"
			case c.Kind == 'f' && runsSQL[c.Name]:
				why = "it calls " + c.Shown + ", which runs SQL the proxy does not see"
			case c.Kind == 'o':
				why = "it calls " + c.Shown + ", an operator a user defined, whose function may write any table"
			case c.Kind == 'r':
				why = "it reads " + c.Shown + ", a view (or a table with policies, or columns of types) that calls functions a user defined, which may write any table"
			case c.Kind == 't':
				why = "it names " + c.Shown + ", whose input, output, casts or domain checks call functions a user defined, which may write any table"
			case c.Kind == 'y':
				why = "its " + c.Shown + " (given by oid) has an input function or domain checks that call functions a user defined, which may write any table"
			}
			if connects != "" && !other {
				why += ", through a connection of its own (the database has " + connects + "), past the read-only transaction"
			}
			cp := *st
			cp.Class, cp.Opaque, cp.OpaqueWhy = ClassWrite, true, why
			return &cp
		}
	}
	return st
}

// signalTag is the Tag of a statement judgeSignals refused.
const signalTag = "Signal"

// judgeSignals refuses a statement that signals (cancels, terminates) a
// backend other than the agent's own: a pid that is not one Postgres gave
// a connection of this proxy (BackendKeyData) may be another agent's
// session, of the same database role, which Postgres lets it signal.
// bind is the rest of the Bind that carries the statement's parameters
// (after its two names), nil where none does: then a pid in a parameter
// is refused. nil: every pid is the agent's own.
func (s *session) judgeSignals(st *Statement, bind []byte) *Statement {
	refuse := func(why string) *Statement {
		cp := *st
		cp.Class = ClassWrite
		cp.Forbidden = why
		cp.Tag = signalTag
		return &cp
	}
	for _, pid := range st.Signals {
		if pid <= 0 || !s.ownBackend(uint32(pid)) {
			return refuse(fmt.Sprintf("it signals backend %d, which is not one of this agent's sessions (this one is %d): it may be another agent's session", pid, s.key.pid))
		}
	}
	for _, n := range st.SignalParams {
		pid, ok := bindPID(bind, n)
		switch {
		case bind == nil:
			return refuse(fmt.Sprintf("it signals the backend parameter $%d names, which the proxy does not see here: it may be another agent's session", n))
		case !ok || pid <= 0 || pid > 1<<31-1 || !s.ownBackend(uint32(pid)):
			return refuse(fmt.Sprintf("it signals backend %d (parameter $%d), which is not one of this agent's sessions (this one is %d): it may be another agent's session", pid, n, s.key.pid))
		}
	}
	return nil
}

// ownBackend: pid is this session's backend or another's of this proxy
// (the same agent: one proxy serves one agent).
func (s *session) ownBackend(pid uint32) bool {
	return pid == s.key.pid || s.p.ownPID(pid)
}

// onSearchPath: c names a sequence without its schema, which the search
// path of the moment resolves: what the cache learned under another is
// not used (it is looked up again).
func onSearchPath(c Call) bool {
	return c.Kind == 'q' && !strings.Contains(c.Name, ".")
}

// judgeSequence: nextval or setval of a sequence writes the sequence,
// which belongs to the tables that own it (serial, identity) or take
// defaults from it: each must be in the lease's claim. A sequence no table
// uses belongs to no lease's tables and is not judged; one the proxy cannot
// tell (not a constant) is opaque.
func (s *session) judgeSequence(c Call) string {
	k := callKeyOf(s.database, c)
	if c.Name == "?" {
		return "it calls " + c.Shown + " on a sequence it does not name by a constant, which may belong to any table"
	}
	// A sequence's call the lookup has not learned (or that failed) is
	// there as unknown (cachedCalls); a learned one is never user code.
	if unknown, there := s.unit.calls[k]; !there || unknown {
		return "it calls " + c.Shown + " on sequence " + c.Name + ", whose tables the proxy could not learn"
	}
	owners := s.unit.owners[k]
	if len(owners) == 0 {
		return ""
	}
	li := s.lease()
	for _, o := range owners {
		if isTempSchema(o[0]) {
			continue
		}
		full, err := joinTable(o[0], o[1])
		if err != nil || !li.claim.ContainsTable(full) {
			return fmt.Sprintf("it calls %s on sequence %s, which belongs to table %s.%s, outside the lease's table scope %v", c.Shown, c.Name, o[0], o[1], li.tables)
		}
	}
	return ""
}

// unitWritable reports whether the statements of a unit run in a writable
// transaction: one the proxy made so, or will (a write, or BEGIN, in a
// new implicit transaction). A unit may hold several transactions (a
// COMMIT or ROLLBACK in it, then more statements): it is writable when any
// of them is, so a call after a COMMIT is judged as in the writable
// transaction the proxy makes for it, not as in the read-only one before.
func (s *session) unitWritable(stmts []*Statement) bool {
	if s.sim.blockRW || s.sim.groupRW {
		return true
	}
	if !s.sim.inBlock && groupWrites(stmts, s.clientRO) {
		return true
	}
	for i, st := range stmts {
		// (the client's read-only default as it may be by then: off)
		if st != nil && (st.Tx == TxEnd || st.Tx == TxChain) && groupWrites(stmts[i+1:], false) {
			return true
		}
	}
	return false
}

// reachRunsCode: a write of st reaches a relation that runs user code
// (its defaults, checks, triggers, partition key ...; see reachSQL) or
// one the proxy could not learn, as checkReach refuses it; nil when
// opaque writes are allowed. Planning the write runs some of that code
// already (a default folded), so a write's Bind is refused for it even
// where its Execute would be refused for something else first.
func (s *session) reachRunsCode(st *Statement, searchPath []string) *refusal {
	for _, t := range st.Targets {
		if t.Temp || isTempSchema(t.Schema) {
			continue
		}
		if r := s.reachOpaque(st, t, searchPath); r != nil {
			return r
		}
	}
	return nil
}

// reachOpaque is checkReach's first half: what writing t reaches is known,
// and none of it runs what the proxy cannot follow.
func (s *session) reachOpaque(st *Statement, t Target, searchPath []string) *refusal {
	var buf [1]string
	for _, r := range relCandidates(buf[:0], t, searchPath) {
		rc, ok := s.unit.rels[relKey{db: s.database, rel: r, truncCascade: st.TruncCascade, only: t.Only}]
		if !ok || rc == nil {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot learn which tables a write to %s reaches (partitions, foreign key actions, rules, triggers)", t),
				hint: "send the write in its own query, outside a failed transaction"}
		}
		if s.p.cfg.AllowOpaque {
			continue
		}
		if s.unit.ddl && len(rc.rels) > 0 {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("DDL earlier in this query may change which tables a write to %s reaches", t),
				hint: "send the write in a query of its own, after the DDL"}
		}
		for _, x := range rc.rels {
			if x.opaque != "" {
				where := "table " + x.schema + "." + x.name
				if x.via != "" {
					where += " (" + x.via + ")"
				}
				return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot tell which tables a write to %s writes: %s: %s", t, where, x.opaque),
					hint: "writes whose tables cannot be named pass only when the fence runs with --pg-allow-opaque, under a live lease"}
			}
		}
	}
	return nil
}

// checkReach judges what writing t reaches beyond t itself: each relation
// must be in the claim, and none may write what the proxy cannot follow.
func (s *session) checkReach(st *Statement, t Target, li leaseInfo, searchPath []string) *refusal {
	if r := s.reachOpaque(st, t, searchPath); r != nil {
		return r
	}
	var buf [1]string
	for _, r := range relCandidates(buf[:0], t, searchPath) {
		rc := s.unit.rels[relKey{db: s.database, rel: r, truncCascade: st.TruncCascade, only: t.Only}]
		for _, x := range rc.rels {
			name := x.schema + "." + x.name
			if x.via == "" || isTempSchema(x.schema) {
				continue // the target itself: checkTarget judged it
			}
			full, err := joinTable(x.schema, x.name)
			if err != nil || !li.claim.ContainsTable(full) {
				return &refusal{code: ReasonOutsideLease,
					reason: fmt.Sprintf("a write to %s also writes table %s (%s), outside the lease's table scope %v", t, name, x.via, li.tables),
					hint:   "acquire a lease that claims every table the write reaches (--table schema.table or schema.*), or write the tables inside the claim by name (UPDATE ONLY, DELETE FROM ONLY)"}
			}
		}
	}
	return nil
}

// isDDL: a write that may change the catalogs (everything but DML and COPY).
func isDDL(st *Statement) bool {
	if st.Class != ClassWrite {
		return false
	}
	switch strings.SplitN(st.Tag, "(", 2)[0] {
	case "InsertStmt", "UpdateStmt", "DeleteStmt", "MergeStmt", "CopyStmt", "SelectStmt", "TransactionStmt", "VariableSetStmt":
		return st.Opaque // (an opaque one may run anything)
	}
	return true
}

// changesReach: DDL that may change what a write to a table that exists
// already reaches (a trigger, rule, policy, child, foreign key, view, or a
// function's body). Not: DROP without CASCADE, indexes, VACUUM and the
// like, sequences, comments, and a new table that inherits nothing and
// references nothing.
func changesReach(st *Statement, n *pgq.Node) bool {
	switch x := n.Node.(type) {
	case *pgq.Node_DropStmt, *pgq.Node_IndexStmt, *pgq.Node_VacuumStmt, *pgq.Node_ClusterStmt,
		*pgq.Node_ReindexStmt, *pgq.Node_CreateSeqStmt, *pgq.Node_AlterSeqStmt, *pgq.Node_CommentStmt,
		*pgq.Node_TruncateStmt:
		return st.Opaque // (DROP ... CASCADE)
	case *pgq.Node_CreateStmt:
		if len(x.CreateStmt.InhRelations) > 0 || x.CreateStmt.Partbound != nil {
			return true
		}
		fk := false
		walk(n.ProtoReflect(), func(m protoreflect.Message) {
			if c, ok := m.Interface().(*pgq.Constraint); ok && c.Contype == pgq.ConstrType_CONSTR_FOREIGN {
				fk = true
			}
		})
		return fk
	}
	return true
}

// passedDDL notes that st, a statement being forwarded, is DDL: the
// catalog cache is forgotten now and again when its transaction ends
// (beginUnit), and the rest of the unit is judged knowing it.
func (s *session) passedDDL(st *Statement) {
	if !isDDL(st) {
		return
	}
	s.p.catalog.invalidate()
	s.ddlPending = true
	if st.ChangesReach {
		s.unit.ddl = true
	}
}
