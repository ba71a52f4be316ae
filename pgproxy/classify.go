package pgproxy

import (
	"fmt"
	"strings"
	"sync"

	pgq "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Class is what a statement may do, as far as the fence is concerned.
type Class uint8

const (
	// ClassRead is a statement on the read whitelist: a SELECT (or VALUES,
	// TABLE, SHOW, FETCH, EXPLAIN without ANALYZE, a cursor over a read) with
	// no INTO, no locking clause and only read CTEs. It still runs where
	// Postgres forbids writes, because a function it calls may try to write.
	ClassRead Class = iota + 1
	// ClassControl changes no table: transaction control, savepoints,
	// LISTEN/NOTIFY, SET of an ordinary setting, DEALLOCATE, CLOSE.
	ClassControl
	// ClassWrite is everything else: it lands only under a live lease and
	// only on tables in the lease's scope.
	ClassWrite
)

func (c Class) String() string {
	switch c {
	case ClassRead:
		return "read"
	case ClassControl:
		return "control"
	case ClassWrite:
		return "write"
	}
	return fmt.Sprintf("class(%d)", uint8(c))
}

// TxEffect is what a statement does to the transaction it runs in.
type TxEffect uint8

const (
	TxNone    TxEffect = iota
	TxBegin            // BEGIN / START TRANSACTION without an access mode
	TxBeginRO          // BEGIN READ ONLY
	TxBeginRW          // BEGIN READ WRITE (a write: it asks for a writable transaction)
	TxEnd              // COMMIT, ROLLBACK, END, ABORT, PREPARE TRANSACTION
	TxChain            // COMMIT/ROLLBACK AND CHAIN: ends and opens a like block
	TxInBlock          // SAVEPOINT, RELEASE, ROLLBACK TO: inside a block only
	TxOutside          // statements that refuse to run inside a transaction block
)

// Target is a relation (or, with Name "*", a whole schema) a write changes.
// Schema is empty for an unqualified name; the session resolves it.
type Target struct {
	Schema string
	Name   string
	Temp   bool   // CREATE TEMP ...: session-private
	Only   bool   // ONLY: not the table's partitions or inheritance children
	rel    string // "schema"."name" when Schema is set (made once: see relCandidates)
}

func (t Target) String() string {
	if t.Schema == "" {
		return t.Name
	}
	return t.Schema + "." + t.Name
}

// Statement is the classification of one statement of a query string.
type Statement struct {
	Class   Class
	Tx      TxEffect
	Targets []Target
	// Opaque: a write whose targets cannot be named from the text (DO,
	// CALL, EXECUTE of an unknown statement, GRANT, ...).
	Opaque bool
	// OpaqueWhy, when set, says why the statement is opaque (it calls a
	// function a user defined: see session.judgeCalls).
	OpaqueWhy string
	// Forbidden, when set, refuses the statement whatever the lease says:
	// it would switch off the fence itself.
	Forbidden string
	// Unsure, when set, refuses the text whatever the lease says: Postgres
	// may parse it otherwise than the classifier did (see
	// session.classify).
	Unsure string
	// ClientRO is what the statement does to the client's own read-only
	// default: +1 sets it on (SET default_transaction_read_only = on, SET
	// SESSION CHARACTERISTICS AS TRANSACTION READ ONLY), -1 resets it
	// (RESET, SET ... TO DEFAULT, RESET ALL, DISCARD ALL).
	ClientRO int8
	// ClientRW: the statement switches the client's own read-only default
	// off (SET default_transaction_read_only = off, SET SESSION
	// CHARACTERISTICS AS TRANSACTION READ WRITE); ClientRO is -1. Postgres's
	// default is the proxy's: it gets clientRWSQL instead, which keeps it on
	// and answers with the same tag.
	ClientRW bool
	// TxRW: SET TRANSACTION READ WRITE (or SET transaction_read_only =
	// off), refused (Forbidden) unless the transaction it runs in is one
	// the proxy made writable, where it changes nothing.
	TxRW bool
	// ShowDefaultRO: SHOW default_transaction_read_only, whose answer the
	// proxy gives (Postgres's own is always on: the proxy's).
	ShowDefaultRO bool
	// Session: it may change how later names resolve (search_path) or the
	// session's settings; the proxy forgets what it knew.
	Session bool
	// ParseCalls are the calls of Calls Postgres may run while it only
	// analyzes the statement (parseCalls).
	ParseCalls []Call
	// Analyzed: the calls a Parse's analysis or a Bind's planning may run
	// (analysisCalls), not a statement run: learnt in any unit, so that
	// builtins are known for the names' doubt (noteCodeInSegment).
	Analyzed bool
	// Rollback: ROLLBACK or ABORT (with or without AND CHAIN).
	Rollback bool
	// RollbackTo: ROLLBACK TO SAVEPOINT, which undoes the settings made
	// since the savepoint, the proxy's pinned search_path among them.
	RollbackTo bool
	// PrepareTx: PREPARE TRANSACTION, which keeps the transaction's writes
	// past its connection.
	PrepareTx bool
	// MissingOK: DROP ... IF EXISTS (of tables, views, sequences,
	// indexes, foreign tables or schemas).
	MissingOK bool
	// WriteCheck: a read that calls user code (functions, operators,
	// views or types that call them) the proxy runs as a write, judged by
	// what it wrote: a check after it, in the same transaction, refuses
	// (and so rolls back) any write to a table outside the lease's claim
	// (see session.checkedWrite). Set by the session, never the classifier.
	WriteCheck bool
	// Prepare/Execute/Deallocate name SQL-level prepared statements.
	Prepare, Execute, Deallocate string
	// Declare names the cursor a DECLARE makes (the statement is its
	// query's); Portal the portal a FETCH or MOVE runs, or a CLOSE
	// (ClosePortal) closes ("": CLOSE ALL). Cursors and the protocol's
	// portals share one namespace on the server.
	Declare, Portal string
	ClosePortal     bool
	// Inner is the prepared statement's classification (PREPARE only).
	Inner *Statement
	// Calls are the functions and operators the statement calls by name
	// (see calledNames): one a user defined can write what the statement
	// does not name (see session.judgeCalls).
	Calls []Call
	// TruncCascade: TRUNCATE ... CASCADE, which empties every table whose
	// foreign keys reference a target, whatever their actions.
	TruncCascade bool
	// ChangesReach: DDL that may change what a later write to an existing
	// table reaches (see changesReach).
	ChangesReach bool
	// Signals are the constant pids the statement signals
	// (pg_cancel_backend, pg_terminate_backend, ...): the session refuses
	// any but its own backend's (see fenceGuard, session.judgeSignals).
	Signals []int32
	// SignalParams are the parameters ($n) that carry pids the statement
	// signals: judged at Bind, refused where no Bind carries them.
	SignalParams []int
	// constDependent: the classification depends on a constant's value
	// (see fenceGuard); it is not shared by texts of the same shape.
	constDependent bool
	// Start and End are byte offsets of the statement in the query text.
	Start, End int
	// Tag is the statement's node type, for logs and the corpus test.
	Tag string
}

// Classification is the result for a whole query string.
type Classification struct {
	Stmts []Statement
	// Class is the strongest class of the statements (write > control > read);
	// ClassControl for an empty string.
	Class Class
	// ParseError is set when the parser rejected the text; the string is
	// then one opaque write.
	ParseError string
}

// Classifier classifies query strings with the Postgres parser and caches
// results by text. It is safe for concurrent use. The zero value is not
// usable; use NewClassifier.
type Classifier struct {
	mu    sync.RWMutex
	cache map[string]*Classification // guarded by mu
	max   int
}

// NewClassifier returns a classifier caching up to max distinct texts
// (default 10000 when max <= 0). When full, the cache is cleared.
func NewClassifier(max int) *Classifier {
	if max <= 0 {
		max = 10000
	}
	return &Classifier{cache: make(map[string]*Classification), max: max}
}

// maxCachedText bounds the length of texts kept in the cache.
const maxCachedText = 64 << 10

// Classify returns the classification of sql. The result is shared: do not
// modify it.
func (c *Classifier) Classify(sql string) *Classification {
	c.mu.RLock()
	r, ok := c.cache[sql]
	c.mu.RUnlock()
	if ok {
		return r
	}
	// Keys of literal shapes start with a NUL byte, which no query text
	// holds (the protocol ends texts with one): a text never finds the
	// classification of another text that happens to equal its shape.
	var kbuf [512]byte
	kbuf[0] = 0
	kb, keyed := appendLiteralKey(kbuf[:1], sql)
	// A text that mentions the fence's schema, in a string constant say,
	// is judged by its constants (fenceGuard): never by its shape.
	keyed = keyed && !containsFold(sql, Schema)
	if keyed {
		c.mu.RLock()
		r, ok = c.cache[string(kb)] // no allocation for a lookup
		c.mu.RUnlock()
		if ok && len(r.Stmts) == 1 {
			if r.Stmts[0].End == len(sql) {
				return r
			}
			// Same statement, other constants: only the offsets differ.
			cp := &classificationOf1{c: *r, st: [1]Statement{r.Stmts[0]}}
			cp.st[0].Start, cp.st[0].End = 0, len(sql)
			cp.c.Stmts = cp.st[:]
			return &cp.c
		}
	}
	r = classify(sql)
	if keyed && len(r.Stmts) == 1 && r.ParseError == "" && r.Stmts[0].Start == 0 && !namesSequence(&r.Stmts[0]) && !r.Stmts[0].constDependent {
		sql = string(kb) // remember it for every text with this shape
	}
	if len(sql) <= maxCachedText {
		c.mu.Lock()
		if len(c.cache) >= c.max {
			clear(c.cache)
		}
		c.cache[sql] = r
		c.mu.Unlock()
	}
	return r
}

// namesSequence: st calls nextval or setval on a sequence a constant names
// (a Call of kind 'q'): its classification depends on that constant, and is
// not shared by texts that differ in constants only.
func namesSequence(st *Statement) bool {
	for _, c := range st.Calls {
		if c.Kind == 'q' && c.Name != "?" {
			return true
		}
	}
	return false
}

// classificationOf1 is a one-statement Classification in one allocation.
type classificationOf1 struct {
	c  Classification
	st [1]Statement
}

// Classify classifies sql without a cache.
func Classify(sql string) *Classification { return classify(sql) }

func classify(sql string) *Classification {
	res, err := pgq.Parse(sql)
	if err != nil {
		return &Classification{
			Class:      ClassWrite,
			ParseError: err.Error(),
			Stmts: []Statement{{Class: ClassWrite, Opaque: true, Start: 0, End: len(sql), Tag: "ParseError",
				Forbidden: ""}},
		}
	}
	out := &Classification{Class: ClassControl}
	if len(res.Stmts) > 0 {
		out.Class = ClassRead
	}
	for _, raw := range res.Stmts {
		st := classifyNode(raw.Stmt)
		st.Start = int(raw.StmtLocation)
		if raw.StmtLen == 0 {
			st.End = len(sql)
		} else {
			st.End = int(raw.StmtLocation + raw.StmtLen)
		}
		if st.End > len(sql) {
			st.End = len(sql)
		}
		if st.Class > out.Class {
			out.Class = st.Class
		}
		out.Stmts = append(out.Stmts, st)
	}
	return out
}

func nodeTag(n *pgq.Node) string {
	if n == nil || n.Node == nil {
		return "Empty"
	}
	name := fmt.Sprintf("%T", n.Node)
	name = strings.TrimPrefix(name, "*pg_query.Node_")
	return name
}

func classifyNode(n *pgq.Node) Statement {
	st := classifyNode1(n)
	st.Tag = nodeTag(n)
	if st.Calls == nil {
		st.Calls = calledNames(n)
	}
	if tr := n.GetTruncateStmt(); tr != nil && tr.Behavior == pgq.DropBehavior_DROP_CASCADE {
		st.TruncCascade = true
	}
	// A direct set_config call changes session settings (search_path,
	// default_transaction_read_only) from inside an expression: never a read.
	// Nor is a call of a large-object function: Postgres lets most of them
	// write in a read-only transaction.
	if st.Class == ClassRead {
		switch setCfg, lo := callsWritingFunction(n); {
		case setCfg:
			st = Statement{Class: ClassWrite, Opaque: true, Session: true, Tag: st.Tag}
		case lo:
			st = Statement{Class: ClassWrite, Opaque: true, Tag: st.Tag + "(large object)"}
		}
	}
	if d := n.GetDropStmt(); d != nil && d.Behavior == pgq.DropBehavior_DROP_CASCADE {
		// DROP ... CASCADE drops what depends on the objects too (views,
		// foreign keys and defaults of other tables): not named in the text.
		st.Opaque = true
	}
	st.ChangesReach = st.Class == ClassWrite && changesReach(&st, n)
	why, signals, params, constDep := fenceGuard(n)
	st.Signals, st.SignalParams, st.constDependent = signals, params, constDep
	if why != "" && st.Forbidden == "" {
		st.Class, st.Forbidden = ClassWrite, why
	}
	if name := st.ownName(); name != "" && st.Forbidden == "" {
		st.Class, st.Forbidden = ClassWrite, "prepared statements and portals named "+ownPrefix+"... are the fence's own, which it runs unjudged: "+name
	}
	st.ParseCalls = parseCalls(st.Calls)
	return st
}

// parseCalls returns the calls of calls Postgres may run while it only
// analyzes the statement (a Parse): the relations it names, whose columns'
// types' input runs for a literal coerced to one, and the types not in
// pg_catalog it names. Made once per text (the classification is cached),
// so a Parse on the proxy's path allocates nothing for it.
func parseCalls(calls []Call) []Call {
	n := 0
	for _, c := range calls {
		if c.parseRuns() {
			n++
		}
	}
	switch n {
	case 0:
		return nil
	case len(calls):
		return calls
	}
	out := make([]Call, 0, n)
	for _, c := range calls {
		if c.parseRuns() {
			out = append(out, c)
		}
	}
	return out
}

// jsonSyntaxFunction is the function a server older than the parser's
// grammar calls for n, one of its SQL/JSON syntax nodes (calledNames).
func jsonSyntaxFunction(n any) string {
	switch v := n.(type) {
	case *pgq.JsonScalarExpr:
		return "json_scalar"
	case *pgq.JsonSerializeExpr:
		return "json_serialize"
	case *pgq.JsonParseExpr:
		return "json"
	case *pgq.JsonObjectConstructor:
		return "json_object"
	case *pgq.JsonArrayConstructor, *pgq.JsonArrayQueryConstructor:
		return "json_array"
	case *pgq.JsonObjectAgg:
		return "json_objectagg"
	case *pgq.JsonArrayAgg:
		return "json_arrayagg"
	case *pgq.JsonTable:
		return "json_table"
	case *pgq.JsonFuncExpr:
		switch v.Op {
		case pgq.JsonExprOp_JSON_EXISTS_OP:
			return "json_exists"
		case pgq.JsonExprOp_JSON_QUERY_OP:
			return "json_query"
		}
		return "json_value"
	}
	return ""
}

// parseRuns: analyzing a statement with c may run code c names (parseCalls).
func (c Call) parseRuns() bool { return c.Kind == 'r' || c.Kind == 't' && !c.builtinType() }

// ownName is the name of the proxy's own (see ownPrefix) that st's SQL
// names as a prepared statement or a portal, or "".
func (st *Statement) ownName() string {
	for _, n := range []string{st.Prepare, st.Execute, st.Deallocate, st.Declare, st.Portal} {
		if strings.HasPrefix(n, ownPrefix) {
			return n
		}
	}
	return ""
}

func write(targets ...Target) Statement {
	return Statement{Class: ClassWrite, Targets: targets}
}

func opaque() Statement { return Statement{Class: ClassWrite, Opaque: true} }

func target(rv *pgq.RangeVar) Target {
	if rv == nil {
		return Target{}
	}
	t := Target{Schema: rv.Schemaname, Name: rv.Relname, Temp: rv.Relpersistence == "t", Only: !rv.Inh}
	if t.Temp && t.Schema == "" {
		t.Schema = "pg_temp"
	}
	if t.Schema != "" && t.Name != "" {
		t.rel = quoteRel(t.Schema, t.Name)
	}
	return t
}

func classifyNode1(n *pgq.Node) Statement {
	switch x := n.Node.(type) {
	case *pgq.Node_SelectStmt:
		return classifySelect(n, x.SelectStmt)
	case *pgq.Node_InsertStmt, *pgq.Node_UpdateStmt, *pgq.Node_DeleteStmt, *pgq.Node_MergeStmt:
		return write(dmlTargets(n)...)
	case *pgq.Node_VariableShowStmt:
		return Statement{Class: ClassRead, ShowDefaultRO: strings.EqualFold(x.VariableShowStmt.Name, "default_transaction_read_only")}
	case *pgq.Node_FetchStmt:
		return Statement{Class: ClassRead, Portal: x.FetchStmt.Portalname}
	case *pgq.Node_DeclareCursorStmt:
		inner := classifyNode(x.DeclareCursorStmt.Query)
		inner.Tx = TxNone
		inner.Declare = x.DeclareCursorStmt.Portalname
		return inner
	case *pgq.Node_ExplainStmt:
		return classifyExplain(x.ExplainStmt)
	case *pgq.Node_CopyStmt:
		return classifyCopy(x.CopyStmt)
	case *pgq.Node_TransactionStmt:
		return classifyTx(x.TransactionStmt)
	case *pgq.Node_VariableSetStmt:
		return classifySet(x.VariableSetStmt)
	case *pgq.Node_ClosePortalStmt:
		return Statement{Class: ClassControl, ClosePortal: true, Portal: x.ClosePortalStmt.Portalname} // "": CLOSE ALL
	case *pgq.Node_ListenStmt, *pgq.Node_UnlistenStmt, *pgq.Node_NotifyStmt, *pgq.Node_ConstraintsSetStmt:
		return Statement{Class: ClassControl}
	case *pgq.Node_DeallocateStmt:
		return Statement{Class: ClassControl, Deallocate: x.DeallocateStmt.Name, Session: x.DeallocateStmt.Name == ""}
	case *pgq.Node_DiscardStmt:
		s := Statement{Class: ClassControl, Session: true, Tx: TxOutside}
		if x.DiscardStmt.Target == pgq.DiscardMode_DISCARD_ALL {
			s.ClientRO = -1
		}
		return s
	case *pgq.Node_PrepareStmt:
		inner := classifyNode(x.PrepareStmt.Query)
		// Its parameters' types run their input functions and domain
		// checks when an EXECUTE or Bind gives values: calls of what runs.
		for _, a := range x.PrepareStmt.Argtypes {
			inner.Calls = mergeCalls(inner.Calls, calledNames(a))
		}
		return Statement{Class: ClassControl, Prepare: x.PrepareStmt.Name, Inner: &inner}
	case *pgq.Node_ExecuteStmt:
		return Statement{Class: ClassWrite, Opaque: true, Execute: x.ExecuteStmt.Name}
	}
	return classifyDDL(n)
}

// classifyExplain: EXPLAIN runs its statement only with ANALYZE.
func classifyExplain(e *pgq.ExplainStmt) Statement {
	for _, o := range e.Options {
		if d := o.GetDefElem(); d != nil && d.Defname == "analyze" && defBool(d, true) {
			inner := classifyNode(e.Query)
			inner.Tx = TxNone
			return inner
		}
	}
	return Statement{Class: ClassRead}
}

// classifyCopy: COPY FROM writes its table (a PROGRAM runs opaque code),
// COPY TO a file writes on the server, COPY (query) TO runs the query.
func classifyCopy(c *pgq.CopyStmt) Statement {
	if c.IsFrom {
		s := write(target(c.Relation))
		if c.IsProgram {
			s.Opaque = true
		}
		return s
	}
	if c.Filename != "" || c.IsProgram {
		return opaque() // writes a file on the server
	}
	if c.Query != nil {
		inner := classifyNode(c.Query)
		inner.Tx = TxNone
		return inner
	}
	return Statement{Class: ClassRead}
}

// classifyDDL classifies what classifyNode1 does not: statements that
// change the schema, roles, databases and the server. Every relation one
// names is a target; one that names none, or whose effect reaches past
// what it names, is opaque.
func classifyDDL(n *pgq.Node) Statement {
	switch x := n.Node.(type) {
	case *pgq.Node_CreateTableAsStmt:
		st := write(target(x.CreateTableAsStmt.Into.GetRel()))
		if ex := x.CreateTableAsStmt.GetQuery().GetExecuteStmt(); ex != nil {
			// It runs a prepared statement, which its text does not show.
			st.Opaque, st.OpaqueWhy = true, "CREATE TABLE ... AS EXECUTE runs prepared statement "+ex.Name+", which its text does not show"
			if strings.HasPrefix(ex.Name, ownPrefix) {
				st.Forbidden = "prepared statements and portals named " + ownPrefix + "... are the fence's own, which it runs unjudged: " + ex.Name
			}
		}
		return st
	case *pgq.Node_VacuumStmt:
		s := writeNamed(n)
		if x.VacuumStmt.IsVacuumcmd {
			s.Tx = TxOutside
		}
		return s
	case *pgq.Node_IndexStmt:
		s := write(target(x.IndexStmt.Relation))
		if x.IndexStmt.Concurrent {
			s.Tx = TxOutside
		}
		return s
	case *pgq.Node_AlterTableStmt:
		return classifyAlterTable(x.AlterTableStmt)
	case *pgq.Node_DropStmt:
		return classifyDrop(x.DropStmt)
	case *pgq.Node_RenameStmt:
		s := writeNamed(n)
		if x.RenameStmt.Behavior == pgq.DropBehavior_DROP_CASCADE {
			s.Opaque, s.OpaqueWhy = true, cascadeWhy // (ALTER TYPE ... RENAME ATTRIBUTE ... CASCADE)
		}
		return s
	case *pgq.Node_AlterObjectSchemaStmt:
		s := writeNamed(n)
		if rv := x.AlterObjectSchemaStmt.Relation; rv != nil {
			// The relation is written into its new schema, as if created
			// there.
			s.Targets = append(s.Targets, target(&pgq.RangeVar{Schemaname: x.AlterObjectSchemaStmt.Newschema, Relname: rv.Relname, Inh: true}))
		}
		return s
	case *pgq.Node_ReindexStmt:
		return classifyReindex(n, x.ReindexStmt)
	case *pgq.Node_ClusterStmt:
		s := write(rangeVars(n)...)
		if x.ClusterStmt.Relation == nil {
			s.Opaque, s.Tx = true, TxOutside // every clustered table: alone
		}
		return s
	case *pgq.Node_CreateSubscriptionStmt, *pgq.Node_AlterSubscriptionStmt, *pgq.Node_DropSubscriptionStmt,
		*pgq.Node_CreateTableSpaceStmt, *pgq.Node_DropTableSpaceStmt:
		s := opaque()
		s.Tx = TxOutside // (some forms may run in a block; alone they all work)
		return s
	case *pgq.Node_CreateSchemaStmt:
		return classifyCreateSchema(x.CreateSchemaStmt)
	case *pgq.Node_DoStmt, *pgq.Node_CallStmt, *pgq.Node_LoadStmt, *pgq.Node_CheckPointStmt,
		*pgq.Node_GrantStmt, *pgq.Node_GrantRoleStmt, *pgq.Node_CreateRoleStmt, *pgq.Node_AlterRoleStmt,
		*pgq.Node_AlterRoleSetStmt, *pgq.Node_DropRoleStmt, *pgq.Node_CreateExtensionStmt,
		*pgq.Node_AlterExtensionStmt, *pgq.Node_AlterDefaultPrivilegesStmt, *pgq.Node_AlterSystemStmt,
		*pgq.Node_CreatedbStmt, *pgq.Node_DropdbStmt, *pgq.Node_AlterDatabaseStmt, *pgq.Node_AlterDatabaseSetStmt,
		*pgq.Node_ReassignOwnedStmt, *pgq.Node_DropOwnedStmt:
		s := opaque()
		switch n.Node.(type) {
		case *pgq.Node_AlterSystemStmt, *pgq.Node_CreatedbStmt, *pgq.Node_DropdbStmt:
			s.Tx = TxOutside
		case *pgq.Node_AlterRoleSetStmt, *pgq.Node_AlterDatabaseSetStmt:
			s.Session = true
		}
		return s
	}
	// Other DDL: every relation it names is a target; none named means we
	// cannot tell what it changes.
	return writeNamed(n)
}

// writeNamed is a write of every relation n names, opaque when it names
// none.
func writeNamed(n *pgq.Node) Statement {
	s := write(rangeVars(n)...)
	if len(s.Targets) == 0 {
		s.Opaque = true
	}
	return s
}

// classifyAlterTable: ALTER TABLE writes the table and every relation its
// commands name; CASCADE makes it opaque, and a change of when triggers
// fire is forbidden.
func classifyAlterTable(a *pgq.AlterTableStmt) Statement {
	// Every relation a command names is changed too: a table attached
	// or detached as a partition, a parent inherited or left, a table
	// a foreign key references (it gets the key's triggers).
	s := write(target(a.Relation))
	s.Targets = dedup(append(s.Targets, rangeVars(&pgq.Node{Node: &pgq.Node_List{List: &pgq.List{Items: a.Cmds}}})...))
	for _, c := range a.Cmds {
		if ac := c.GetAlterTableCmd(); ac != nil {
			if ac.Behavior == pgq.DropBehavior_DROP_CASCADE {
				// CASCADE changes what depends on it, whoever's it is:
				// other tables' foreign keys and views (DROP COLUMN,
				// DROP CONSTRAINT), the tables typed by a type (ALTER
				// TYPE ... CASCADE, CREATE TABLE ... OF).
				s.Opaque, s.OpaqueWhy = true, cascadeWhy
			}
			if ac.Subtype >= pgq.AlterTableType_AT_EnableTrig && ac.Subtype <= pgq.AlterTableType_AT_DisableTrigUser {
				s.Forbidden = "it changes when triggers fire, and the storage-side fence is a trigger"
			}
			if ac.Subtype == pgq.AlterTableType_AT_DetachPartition && ac.Def.GetPartitionCmd().GetConcurrent() {
				s.Tx = TxOutside
			}
		}
	}
	return s
}

// classifyReindex: REINDEX writes what it names; a schema's is opaque, and
// CONCURRENTLY, SCHEMA, SYSTEM and DATABASE run outside a transaction.
func classifyReindex(n *pgq.Node, r *pgq.ReindexStmt) Statement {
	s := write(rangeVars(n)...)
	if r.Kind == pgq.ReindexObjectType_REINDEX_OBJECT_SCHEMA && r.Name != "" {
		// Every index of the schema is rebuilt, running the user code
		// of its expressions and predicates, which the proxy does not
		// look up for a whole schema.
		s.Targets = []Target{{Schema: r.Name, Name: "*"}}
		s.Opaque, s.OpaqueWhy = true, "REINDEX SCHEMA rebuilds every index of the schema, running whatever user code their expressions call; reindex the tables by name"
	}
	if len(s.Targets) == 0 {
		s.Opaque = true
	}
	if hasOption(r.Params, "concurrently") || r.Kind == pgq.ReindexObjectType_REINDEX_OBJECT_SCHEMA ||
		r.Kind == pgq.ReindexObjectType_REINDEX_OBJECT_SYSTEM || r.Kind == pgq.ReindexObjectType_REINDEX_OBJECT_DATABASE {
		s.Tx = TxOutside
	}
	return s
}

// classifyCreateSchema: CREATE SCHEMA writes the whole new schema, and the
// relations of other schemas its elements name.
func classifyCreateSchema(cs *pgq.CreateSchemaStmt) Statement {
	s := write(Target{Schema: cs.Schemaname, Name: "*"})
	if cs.Schemaname == "" {
		s.Opaque = true
	}
	// Its elements create objects in the new schema (Postgres checks),
	// but may name relations of others: a foreign key's referenced
	// table gets its triggers. A GRANT element is opaque as GRANT is.
	for _, e := range cs.SchemaElts {
		if e.GetGrantStmt() != nil {
			s.Opaque = true
		}
		for _, t := range rangeVars(e) {
			if t.Schema != "" && t.Schema != cs.Schemaname {
				s.Targets = append(s.Targets, t)
			}
		}
	}
	s.Targets = dedup(s.Targets)
	return s
}

// cascadeWhy is why a change with CASCADE is opaque.
const cascadeWhy = "with CASCADE it also changes what depends on it (other tables' foreign keys, views, tables typed by it), whoever's they are"

// hasOption reports whether options (DefElems) set name, true.
func hasOption(options []*pgq.Node, name string) bool {
	for _, o := range options {
		if d := o.GetDefElem(); d != nil && d.Defname == name && defBool(d, true) {
			return true
		}
	}
	return false
}

func defBool(d *pgq.DefElem, dflt bool) bool {
	if d.Arg == nil {
		return dflt
	}
	switch a := d.Arg.Node.(type) {
	case *pgq.Node_Boolean:
		return a.Boolean.Boolval
	case *pgq.Node_String_:
		switch strings.ToLower(a.String_.Sval) {
		case "false", "off", "no", "0":
			return false
		}
		return true
	case *pgq.Node_Integer:
		return a.Integer.Ival != 0
	case *pgq.Node_AConst:
		if iv := a.AConst.GetIval(); iv != nil {
			return iv.Ival != 0
		}
		if bv := a.AConst.GetBoolval(); bv != nil {
			return bv.Boolval
		}
		if sv := a.AConst.GetSval(); sv != nil {
			switch strings.ToLower(sv.Sval) {
			case "false", "off", "no", "0":
				return false
			}
		}
	}
	return true
}

// classifySelect: a read when no SELECT anywhere in it has INTO or a locking
// clause and no data-modifying statement hides in a CTE.
func classifySelect(n *pgq.Node, s *pgq.SelectStmt) Statement {
	if s.IntoClause != nil {
		return write(target(s.IntoClause.Rel))
	}
	locking, dml := false, false
	walk(n.ProtoReflect(), func(m protoreflect.Message) {
		switch v := m.Interface().(type) {
		case *pgq.SelectStmt:
			if len(v.LockingClause) > 0 || v.IntoClause != nil {
				locking = true
			}
		case *pgq.InsertStmt, *pgq.UpdateStmt, *pgq.DeleteStmt, *pgq.MergeStmt:
			dml = true
		}
	})
	if dml {
		return write(dmlTargets(n)...)
	}
	if locking {
		// SELECT ... FOR UPDATE/SHARE locks rows: a write on what it reads.
		return write(rangeVars(n)...)
	}
	return Statement{Class: ClassRead}
}

func classifyTx(t *pgq.TransactionStmt) Statement {
	s := Statement{Class: ClassControl}
	switch t.Kind {
	case pgq.TransactionStmtKind_TRANS_STMT_BEGIN, pgq.TransactionStmtKind_TRANS_STMT_START:
		s.Tx = TxBegin
		for _, o := range t.Options {
			if d := o.GetDefElem(); d != nil && d.Defname == "transaction_read_only" {
				if defBool(d, true) {
					s.Tx = TxBeginRO
				} else {
					s.Tx = TxBeginRW
					s.Class = ClassWrite
				}
			}
		}
	case pgq.TransactionStmtKind_TRANS_STMT_COMMIT, pgq.TransactionStmtKind_TRANS_STMT_ROLLBACK:
		s.Tx = TxEnd
		if t.Chain {
			s.Tx = TxChain
		}
		s.Rollback = t.Kind == pgq.TransactionStmtKind_TRANS_STMT_ROLLBACK
	case pgq.TransactionStmtKind_TRANS_STMT_PREPARE:
		s.Tx = TxEnd
		s.PrepareTx = true
	case pgq.TransactionStmtKind_TRANS_STMT_COMMIT_PREPARED, pgq.TransactionStmtKind_TRANS_STMT_ROLLBACK_PREPARED:
		// Finishes a prepared transaction: it commits that transaction's writes.
		s = opaque()
		s.Tx = TxOutside
	default:
		s.Tx = TxInBlock
		s.RollbackTo = t.Kind == pgq.TransactionStmtKind_TRANS_STMT_ROLLBACK_TO
	}
	return s
}

// guardedSettings are settings that would switch the fence off.
var guardedSettings = map[string]string{
	"default_transaction_read_only": "fenceline keeps sessions read-only by default",
	"transaction_read_only":         "fenceline decides which transactions may write",
	"session_replication_role":      "it disables triggers, and the storage-side fence is a trigger",
	"role":                          "fenceline authorizes writes for the session's own role",
	"session_authorization":         "fenceline authorizes writes for the session's own role",
	"session characteristics":       "fenceline keeps sessions read-only by default",
}

func classifySet(v *pgq.VariableSetStmt) Statement {
	s := Statement{Class: ClassControl}
	name := strings.ToLower(v.Name)
	if v.Kind == pgq.VariableSetKind_VAR_RESET_ALL {
		s.Session, s.ClientRO = true, -1
		return s
	}
	if name == "search_path" {
		s.Session = true
	}
	if strings.HasPrefix(name, "fenceline.") {
		s.Class, s.Forbidden = ClassWrite, "fenceline.* settings carry the fence and only the proxy sets them"
		return s
	}
	if name == "transaction" || name == "session characteristics" {
		// SET TRANSACTION / SET SESSION CHARACTERISTICS AS TRANSACTION ...:
		// read-only and isolation levels are fine, READ WRITE is not ours to give.
		for _, a := range v.Args {
			if d := a.GetDefElem(); d != nil && d.Defname == "transaction_read_only" {
				switch {
				case !defBool(d, true) && name == "session characteristics" && len(v.Args) == 1:
					s.ClientRO, s.ClientRW = -1, true // the client's own default, as below
				case !defBool(d, true):
					s.Class, s.Forbidden = ClassWrite, guardedSettings["transaction_read_only"]
					s.TxRW = name == "transaction"
				case name == "session characteristics":
					s.ClientRO = 1
				}
			}
		}
		return s
	}
	if ownRole(name, v) {
		// Back to the session's own role: what it connected as, which the
		// proxy let in (a role's reset value comes only from the startup).
		s.Session = true // names may resolve otherwise ($user in search_path)
		return s
	}
	if why, ok := guardedSettings[name]; ok {
		if (name == "transaction_read_only" || name == "default_transaction_read_only") &&
			v.Kind == pgq.VariableSetKind_VAR_SET_VALUE && len(v.Args) == 1 && setValueTrue(v.Args[0]) {
			if name == "default_transaction_read_only" && !v.IsLocal {
				s.ClientRO = 1
			}
			return s // switching read-only on is always fine
		}
		if name == "default_transaction_read_only" && !v.IsLocal && v.Kind == pgq.VariableSetKind_VAR_SET_VALUE &&
			len(v.Args) == 1 && setValueFalse(v.Args[0]) {
			s.ClientRO, s.ClientRW = -1, true // the client's own default, off as it is at startup
			return s
		}
		if name == "default_transaction_read_only" && (v.Kind == pgq.VariableSetKind_VAR_RESET || v.Kind == pgq.VariableSetKind_VAR_SET_DEFAULT) {
			if !v.IsLocal {
				s.ClientRO = -1
			}
			return s // resets to the proxy's startup value (on)
		}
		s.Class, s.Forbidden = ClassWrite, why
		s.TxRW = name == "transaction_read_only" && v.Kind == pgq.VariableSetKind_VAR_SET_VALUE && len(v.Args) == 1 && setValueFalse(v.Args[0])
	}
	return s
}

// ownRole: RESET ROLE, SET ROLE NONE (Postgres takes the value none in any
// quoting as NONE), RESET SESSION AUTHORIZATION or SET SESSION
// AUTHORIZATION DEFAULT, and their generic spellings (SET role TO
// DEFAULT): each only returns to the session's own role.
func ownRole(name string, v *pgq.VariableSetStmt) bool {
	if name != "role" && name != "session_authorization" {
		return false
	}
	switch v.Kind {
	case pgq.VariableSetKind_VAR_RESET, pgq.VariableSetKind_VAR_SET_DEFAULT:
		return true
	case pgq.VariableSetKind_VAR_SET_VALUE:
		if name != "role" || len(v.Args) != 1 {
			return false
		}
		c := v.Args[0].GetAConst()
		return c != nil && c.GetSval() != nil && c.GetSval().Sval == "none"
	}
	return false
}

// setValueFalse: n is false in one of Postgres's usual spellings (not
// every prefix Postgres takes: anything else stays refused).
func setValueFalse(n *pgq.Node) bool {
	c := n.GetAConst()
	if c == nil {
		return false
	}
	if sv := c.GetSval(); sv != nil {
		switch strings.ToLower(sv.Sval) {
		case "off", "false", "no", "0", "f", "n":
			return true
		}
	}
	if iv := c.GetIval(); iv != nil {
		return iv.Ival == 0
	}
	if bv := c.GetBoolval(); bv != nil {
		return !bv.Boolval
	}
	return false
}

func setValueTrue(n *pgq.Node) bool {
	c := n.GetAConst()
	if c == nil {
		return false
	}
	if sv := c.GetSval(); sv != nil {
		switch strings.ToLower(sv.Sval) {
		case "on", "true", "yes", "1", "t", "y":
			return true
		}
	}
	if iv := c.GetIval(); iv != nil {
		return iv.Ival == 1
	}
	if bv := c.GetBoolval(); bv != nil {
		return bv.Boolval
	}
	return false
}

func classifyDrop(d *pgq.DropStmt) Statement {
	switch d.RemoveType {
	case pgq.ObjectType_OBJECT_TABLE, pgq.ObjectType_OBJECT_VIEW, pgq.ObjectType_OBJECT_MATVIEW,
		pgq.ObjectType_OBJECT_INDEX, pgq.ObjectType_OBJECT_SEQUENCE, pgq.ObjectType_OBJECT_FOREIGN_TABLE:
		s := Statement{Class: ClassWrite}
		for _, o := range d.Objects {
			l := o.GetList()
			if l == nil {
				return opaque()
			}
			var parts []string
			for _, it := range l.Items {
				parts = append(parts, it.GetString_().GetSval())
			}
			switch len(parts) {
			case 1:
				s.Targets = append(s.Targets, Target{Name: parts[0]})
			case 2:
				s.Targets = append(s.Targets, Target{Schema: parts[0], Name: parts[1]})
			case 3:
				s.Targets = append(s.Targets, Target{Schema: parts[1], Name: parts[2]})
			default:
				return opaque()
			}
		}
		if d.Concurrent {
			s.Tx = TxOutside
		}
		s.MissingOK = d.MissingOk
		return s
	case pgq.ObjectType_OBJECT_SCHEMA:
		s := Statement{Class: ClassWrite, MissingOK: d.MissingOk}
		for _, o := range d.Objects {
			s.Targets = append(s.Targets, Target{Schema: o.GetString_().GetSval(), Name: "*"})
		}
		return s
	case pgq.ObjectType_OBJECT_TRIGGER:
		s := opaque()
		for _, o := range d.Objects {
			if l := o.GetList(); l != nil && len(l.Items) > 0 {
				if l.Items[len(l.Items)-1].GetString_().GetSval() == triggerName {
					s.Forbidden = "it drops the storage-side fence"
				}
			}
		}
		return s
	}
	return opaque()
}

// dmlTargets returns the relations that INSERT/UPDATE/DELETE/MERGE
// statements anywhere in n modify.
func dmlTargets(n *pgq.Node) []Target {
	var ts []Target
	walk(n.ProtoReflect(), func(m protoreflect.Message) {
		switch v := m.Interface().(type) {
		case *pgq.InsertStmt:
			ts = append(ts, target(v.Relation))
		case *pgq.UpdateStmt:
			ts = append(ts, target(v.Relation))
		case *pgq.DeleteStmt:
			ts = append(ts, target(v.Relation))
		case *pgq.MergeStmt:
			ts = append(ts, target(v.Relation))
		case *pgq.SelectStmt:
			if v.IntoClause != nil {
				ts = append(ts, target(v.IntoClause.Rel))
			}
		}
	})
	return dedup(ts)
}

// rangeVars returns every relation named anywhere in n (but not the
// aliases a locking clause names: FOR UPDATE OF a).
func rangeVars(n *pgq.Node) []Target {
	var ts []Target
	walk(n.ProtoReflect(), func(m protoreflect.Message) {
		switch v := m.Interface().(type) {
		case *pgq.RangeVar:
			ts = append(ts, target(v))
		case *pgq.LockingClause:
			v.LockedRels = nil // (a private copy: parse trees are not shared before caching)
		}
	})
	return dedup(ts)
}

func dedup(ts []Target) []Target {
	out := ts[:0]
	seen := map[Target]bool{}
	for _, t := range ts {
		if t.Name == "" || seen[t] {
			continue
		}
		seen[t] = true
		out = append(out, t)
	}
	return out
}

// callsWritingFunction reports whether n calls set_config or a
// large-object function (any lo_* function but the ones that only read or
// position a descriptor, and lowrite) by name.
func callsWritingFunction(n *pgq.Node) (setConfig, largeObject bool) {
	walk(n.ProtoReflect(), func(m protoreflect.Message) {
		if f, ok := m.Interface().(*pgq.FuncCall); ok && len(f.Funcname) > 0 {
			name := strings.ToLower(f.Funcname[len(f.Funcname)-1].GetString_().GetSval())
			switch {
			case name == "set_config":
				setConfig = true
			case name == "lowrite" || strings.HasPrefix(name, "lo_") && !loReads[name]:
				largeObject = true
			}
		}
	})
	return setConfig, largeObject
}

// Call is a function or operator a statement calls by name, or a relation
// it reads (a view may call functions).
type Call struct {
	Name string // as Postgres looks it up (pg_proc.proname, pg_operator.oprname, pg_class.relname, pg_type.typname)
	Kind byte   // 'f' function, 'o' operator, 'r' relation read, 't' type named, 'y' type a Parse gives by oid (Name: the oid), 'q' sequence advanced or set
	// Shown is the name as written (schema-qualified when it was), for
	// refusals.
	Shown string
	// Key is Kind and Name, the catalog cache's key (made once, here).
	Key string
	// Schema is a relation's or type's schema as written ('r', 't'; ""
	// when unqualified).
	Schema string
}

// builtinType: c names a type in pg_catalog (int, text, pg_catalog.oid):
// one initdb made, whose input, output and casts are builtins (a user
// cannot create objects in pg_catalog).
func (c Call) builtinType() bool { return c.Kind == 't' && c.Schema == "pg_catalog" }

// calledNames returns the functions and operators n calls by name, and
// the relations and types it names (a cast, a typed literal, a column
// definition), each once.
func calledNames(n *pgq.Node) []Call {
	var cs []Call
	seen := map[Call]bool{}
	add := func(c Call) {
		k := Call{Name: c.Name, Kind: c.Kind, Schema: c.Schema}
		if c.Name != "" && !seen[k] {
			seen[k] = true
			c.Key = string(c.Kind) + c.Name
			cs = append(cs, c)
		}
	}
	qualified := func(l []*pgq.Node) (last, shown string) {
		parts := make([]string, 0, len(l))
		for _, p := range l {
			parts = append(parts, p.GetString_().GetSval())
		}
		if len(parts) == 0 {
			return "", ""
		}
		return parts[len(parts)-1], strings.Join(parts, ".")
	}
	walk(n.ProtoReflect(), func(m protoreflect.Message) {
		switch v := m.Interface().(type) {
		case *pgq.FuncCall:
			name, shown := qualified(v.Funcname)
			add(Call{Name: name, Kind: 'f', Shown: shown})
			if (name == "nextval" || name == "setval") && (len(v.Funcname) == 1 || shown == "pg_catalog."+name) {
				add(Call{Name: sequenceArg(v.Args), Kind: 'q', Shown: shown})
			}
		case *pgq.A_Expr:
			switch v.Kind {
			case pgq.A_Expr_Kind_AEXPR_BETWEEN, pgq.A_Expr_Kind_AEXPR_NOT_BETWEEN,
				pgq.A_Expr_Kind_AEXPR_BETWEEN_SYM, pgq.A_Expr_Kind_AEXPR_NOT_BETWEEN_SYM:
				// Postgres runs >= and <= (found by name), not an
				// operator named BETWEEN.
				add(Call{Name: ">=", Kind: 'o', Shown: "operator >= (of BETWEEN)"})
				add(Call{Name: "<=", Kind: 'o', Shown: "operator <= (of BETWEEN)"})
			default:
				name, shown := qualified(v.Name)
				add(Call{Name: name, Kind: 'o', Shown: "operator " + shown})
			}
		case *pgq.SubLink:
			// x op ANY/ALL (SELECT ...), x IN (SELECT ...) (=), row
			// comparisons: an operator found by name.
			if v.SubLinkType == pgq.SubLinkType_ANY_SUBLINK || v.SubLinkType == pgq.SubLinkType_ALL_SUBLINK || v.SubLinkType == pgq.SubLinkType_ROWCOMPARE_SUBLINK {
				if len(v.OperName) == 0 {
					add(Call{Name: "=", Kind: 'o', Shown: "operator = (of IN)"})
				} else {
					name, shown := qualified(v.OperName)
					add(Call{Name: name, Kind: 'o', Shown: "operator " + shown})
				}
			}
		case *pgq.JsonScalarExpr, *pgq.JsonSerializeExpr, *pgq.JsonParseExpr, *pgq.JsonObjectConstructor, *pgq.JsonArrayConstructor,
			*pgq.JsonArrayQueryConstructor, *pgq.JsonObjectAgg, *pgq.JsonArrayAgg, *pgq.JsonFuncExpr, *pgq.JsonTable:
			// The parser knows Postgres 17's grammar, where these are
			// syntax; a server before 17 (16: before JSON(), JSON_SCALAR,
			// ...) parses the same text as a call of a function of that
			// name, found on the search path: a user's, if one is there.
			name := jsonSyntaxFunction(v)
			add(Call{Name: name, Kind: 'f', Shown: name + " (a function call on servers before Postgres 17)"})
		case *pgq.MergeSupportFunc:
			// MERGE_ACTION() of Postgres 17's grammar: a call of a
			// function so named on a server before it.
			add(Call{Name: "merge_action", Kind: 'f', Shown: "merge_action (a function call on servers before Postgres 17)"})
		case *pgq.CaseExpr:
			if v.Arg != nil { // CASE x WHEN y: x = y
				add(Call{Name: "=", Kind: 'o', Shown: "operator = (of CASE x WHEN)"})
			}
		case *pgq.JoinExpr:
			if len(v.UsingClause) > 0 || v.IsNatural { // the columns' =
				add(Call{Name: "=", Kind: 'o', Shown: "operator = (of JOIN USING)"})
			}
		case *pgq.SortBy:
			if len(v.UseOp) > 0 { // ORDER BY x USING op
				name, shown := qualified(v.UseOp)
				add(Call{Name: name, Kind: 'o', Shown: "operator " + shown})
			}
		case *pgq.RangeVar:
			add(Call{Name: v.Relname, Kind: 'r', Shown: Target{Schema: v.Schemaname, Name: v.Relname}.String(), Schema: v.Schemaname})
		case *pgq.TypeName:
			if v.PctType {
				break // (%TYPE names a column, in DDL)
			}
			name, shown := qualified(v.Names)
			schema := ""
			if len(v.Names) == 2 {
				schema = v.Names[0].GetString_().GetSval()
			}
			add(Call{Name: name, Kind: 't', Shown: "type " + shown, Schema: schema})
		}
	})
	return cs
}

// sequenceArg is the sequence a nextval or setval call names: its first
// argument, a string constant (or one cast to regclass), as regclass would
// read it; "?" when it is not one (the proxy cannot tell the sequence).
func sequenceArg(args []*pgq.Node) string {
	if len(args) == 0 {
		return "?"
	}
	a := args[0]
	if tc := a.GetTypeCast(); tc != nil {
		a = tc.Arg
	}
	if c := a.GetAConst(); c != nil && c.GetSval() != nil {
		if v := c.GetSval().GetSval(); v != "" {
			return v
		}
	}
	return "?"
}

// loReads are the large-object functions that write nothing (lo_open may
// open for writing: it is a write).
var loReads = map[string]bool{"lo_get": true, "lo_close": true, "lo_tell": true, "lo_tell64": true,
	"lo_lseek": true, "lo_lseek64": true}

// walk calls f for m and every message below it.
func walk(m protoreflect.Message, f func(protoreflect.Message)) {
	if !m.IsValid() {
		return
	}
	f(m)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			l := v.List()
			for i := 0; i < l.Len(); i++ {
				walk(l.Get(i).Message(), f)
			}
		case fd.IsMap():
		case fd.Message() != nil:
			walk(v.Message(), f)
		}
		return true
	})
}
