// Authorization: each statement's write decided against the lease, its
// claim and the transaction it runs in, and a refusal turned into SQL that
// makes Postgres itself raise the error.

package pgproxy

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	pgq "github.com/pganalyze/pg_query_go/v6"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// classify classifies a query text as Postgres will parse it. The
// classifier parses as Postgres does with standard_conforming_strings on
// and the text in UTF-8; a text is parsed the same under every setting
// unless it holds a backslash (an escape in a string when
// standard_conforming_strings is off) or a byte >= 0x80 (in SJIS, BIG5,
// GBK, UHC, GB18030 and JOHAB a backslash may end a multibyte character,
// and Postgres converts the text before it parses it). Such a text is
// refused, reads included, when the session's settings (as Postgres last
// reported them) or unknown settings (changed may be true: a statement
// ran since they were reported) could make Postgres parse it otherwise.
//
// A session on the event loop parses a text longer than classifyInline on
// a goroutine while its task waits: parsing costs about 5 µs a byte of
// short statements, and a client's megabyte of SQL must not hold every
// other session on the loop for seconds.
func (s *session) classify(sql string, changed bool) *Classification {
	var why string
	if (changed || s.scsOff.Load()) && strings.IndexByte(sql, '\\') >= 0 {
		why = "the text has a backslash and standard_conforming_strings is off"
		if changed {
			why = "the text has a backslash and an earlier statement of this pipeline may have changed standard_conforming_strings"
		}
	} else if changed || s.encUnsafe.Load() {
		for i := 0; i < len(sql); i++ {
			if sql[i] >= 0x80 {
				why = "the text has non-ASCII bytes and the client encoding is not UTF8"
				if changed {
					why = "the text has non-ASCII bytes and an earlier statement of this pipeline may have changed client_encoding"
				}
				break
			}
		}
	}
	if why == "" && s.srvEncCuts.Load() {
		why = cutElsewhere(sql)
	}
	if why == "" {
		if len(sql) > classifyInline && s.lp != nil {
			var c *Classification
			s.blocking(func() {
				s.p.parsingAside.Add(1)
				defer s.p.parsingAside.Add(-1)
				c = s.p.classifier.Classify(sql)
			})
			return c
		}
		return s.p.classifier.Classify(sql)
	}
	return &Classification{Class: ClassWrite, Stmts: []Statement{{Class: ClassWrite, Opaque: true, Unsure: why,
		Start: 0, End: len(sql), Tag: "UnsureParse"}}}
}

// notASCIIClaim: a claimed name is not in ASCII. Postgres sends the names
// it returns (the search path, the tables a write reaches, a sequence's
// owners) in the client's encoding; read as UTF8, a name's bytes in
// another encoding can be another name not in ASCII, and so match such a
// claim, but never an ASCII one (found by a review: under LATIN1, the
// schema "Ã©" came back as the bytes of "é" and passed a claim of "é.*").
func notASCIIClaim(tables []string) bool {
	for _, t := range tables {
		if !isASCII([]byte(t)) {
			return true
		}
	}
	return false
}

// maxNameLen is the longest name Postgres keeps whole (NAMEDATALEN - 1):
// it cuts identifiers, statement and portal names to it.
const maxNameLen = 63

// cutElsewhere says why sql, for a server whose encoding is not UTF8, names
// something the server may read as another name than the parser does, or
// "". Postgres cuts an identifier longer than maxNameLen bytes in the
// server's encoding, at a character's boundary (SQL_ASCII at any byte);
// the parser cuts it in UTF8. 40 'é' are 80 bytes in UTF8, cut to 31, and
// 40 in LATIN1, kept whole: the fence would judge one name while the
// server wrote another (TestIdentifiersCutByTheServersEncoding). A
// character takes at most 4 bytes in any server encoding and an ASCII one
// takes 1, so an identifier is cut by neither when its ASCII characters
// and 4 for each other come to maxNameLen or less. An unquoted one is
// folded to lower case too, which in a single-byte encoding folds letters
// not in ASCII by the database's locale (ÉCOLE is école in LATIN1 under a
// French locale), where the parser folds only ASCII: such a name must be
// quoted. A U& identifier's escapes may each be a character not in
// ASCII: one of more than 15 characters between its quotes is refused.
// Only texts with a byte >= 0x80 or an '&' are scanned.
func cutElsewhere(sql string) string {
	// A U& identifier spells its characters in ASCII escapes, so a text
	// with an '&' is scanned too.
	plain := true
	for i := 0; i < len(sql) && plain; i++ {
		plain = sql[i] < 0x80 && sql[i] != '&'
	}
	if plain {
		return ""
	}
	res, err := pgq.Scan(sql)
	if err != nil {
		return "the text does not scan, and the server's encoding is not UTF8: " + err.Error()
	}
	for _, tok := range res.Tokens {
		if tok.Token != pgq.Token_IDENT && tok.Token != pgq.Token_UIDENT || tok.Start < 0 || int(tok.End) > len(sql) || tok.Start > tok.End {
			continue
		}
		name := sql[tok.Start:tok.End]
		if tok.Token == pgq.Token_UIDENT && 4*len(name) > maxNameLen+4*len(`U&""`) {
			// Each character of its text may be an escape of one not in
			// ASCII (4 bytes at most).
			return fmt.Sprintf("the name %s, spelled in Unicode escapes, is long enough that the server, whose encoding is not UTF8, may cut it at %d bytes elsewhere than fenceline does: use a shorter name, or a database in UTF8", name, maxNameLen)
		}
		if mayBeCut(name) {
			return fmt.Sprintf("the name %s, not in ASCII, is long enough that the server, whose encoding is not UTF8, may cut it at %d bytes elsewhere than fenceline does: use a name of at most %d bytes counting 4 for each character not in ASCII, or a database in UTF8", name, maxNameLen, maxNameLen)
		}
		if name[0] != '"' && tok.Token == pgq.Token_IDENT && !isASCII([]byte(name)) {
			return "the name " + name + " is not quoted and not in ASCII: the server, whose encoding is not UTF8, may fold its case otherwise than fenceline does (a single-byte encoding folds by the database's locale); quote it, or use a database in UTF8"
		}
	}
	return ""
}

// mayBeCut: name (an identifier, a statement or portal name) is not in
// ASCII and may be longer than maxNameLen bytes in some server encoding
// (see cutElsewhere).
func mayBeCut(name string) bool {
	n, ascii := 0, true
	for _, r := range name {
		if r < 0x80 {
			n++
		} else {
			n, ascii = n+4, false
		}
	}
	return !ascii && n > maxNameLen
}

// authorizeWrite decides a write statement (nil for reads): the lease and
// table scope, then the transaction it runs in — a block begun without the
// lease is read-only, and an implicit transaction that began with reads
// was not made writable. hint says how to send the write instead.
func (s *session) authorizeWrite(st *Statement, li leaseInfo, searchPath []string, hint string) *refusal {
	if st.Class != ClassWrite {
		return nil
	}
	if r := s.authorize(st, li, searchPath); r != nil {
		return r
	}
	if (s.sim.clientRO || s.clientRO) && !s.sim.blockRW && !s.sim.groupRW {
		return nil // read-only as the client asked: Postgres refuses it, as direct
	}
	if s.sim.inBlock && !s.sim.blockRW {
		return &refusal{code: ReasonReadOnlyTxn, reason: "the transaction block began while the lease was not held, so it is read-only",
			hint: "ROLLBACK, then BEGIN again while the lease is held"}
	}
	if !s.sim.inBlock && !s.sim.groupRW && st.Tx != TxOutside {
		return &refusal{code: ReasonReadOnlyTxn, reason: "this transaction began with reads before the write could be authorized", hint: hint}
	}
	return nil
}

// authorizeInTxn refuses what may not run in a transaction the proxy made
// writable: anything but ROLLBACK once the lease is not live (the
// transaction's token would still let a function that writes through, and
// COMMIT would land what it wrote before), and PREPARE TRANSACTION, whose
// writes would outlive the connection and the lease.
func (s *session) authorizeInTxn(st *Statement, li leaseInfo) *refusal {
	if !s.sim.blockRW && !s.sim.groupRW {
		return nil
	}
	if st.PrepareTx {
		return &refusal{code: ReasonFenceTamper, reason: "PREPARE TRANSACTION would keep this transaction's writes past its connection and its lease",
			hint: "COMMIT or ROLLBACK instead"}
	}
	if li.live() || st.Rollback || s.txStatus == 'E' {
		return nil // in a failed block, Postgres refuses all and COMMIT rolls back
	}
	why := "no lease"
	if li.err != nil {
		why = li.err.Error()
	}
	return &refusal{code: lease.LeaseReason(li.err), reason: "lease lost while this transaction was writable: " + why,
		hint: "ROLLBACK: nothing this transaction wrote may commit; reads work outside it"}
}

// refusal is why a write does not go through.
type refusal struct {
	code   string // the audit event's reason: one of the Reason constants
	reason string
	hint   string
}

// Audit reason codes of refused writes (the git fence's vocabulary where
// the two meet).
const (
	ReasonFenceTamper  = "fence-tamper"           // a statement that would switch the fence off, or writes its schema
	ReasonLeaseLost    = lease.ReasonLeaseLost    // the lease is lost or was never held
	ReasonLeaseUnknown = lease.ReasonLeaseUnknown // the bus cannot be reached: fail closed
	ReasonUnnamedTable = "unnamed-table"          // the tables a write touches cannot be named
	ReasonOutsideLease = lease.ReasonOutsideLease // a table outside the lease's table scope
	ReasonReadOnlyTxn  = "read-only-transaction"  // the transaction was not made writable under the lease
	ReasonUnsureParse  = "unsure-parse"           // Postgres may parse the text otherwise than the classifier
	ReasonOtherSession = "other-session"          // a statement that signals a backend not the session's own
)

// authorize decides one write statement against the lease.
func (s *session) authorize(st *Statement, li leaseInfo, searchPath []string) *refusal {
	if st.Unsure != "" {
		return &refusal{code: ReasonUnsureParse, reason: "Postgres may parse this text otherwise than fenceline did: " + st.Unsure,
			hint: "fenceline refuses it whatever the lease: send it with standard_conforming_strings on and client_encoding UTF8, or after a Sync"}
	}
	if st.TxRW && (s.sim.blockRW || s.sim.groupRW) && li.live() {
		return nil // READ WRITE in a transaction the proxy made writable: as it is
	}
	if st.Forbidden != "" {
		code := ReasonFenceTamper
		if st.Tag == signalTag {
			code = ReasonOtherSession
		}
		return &refusal{code: code, reason: "statement refused whatever the lease: " + st.Forbidden,
			hint: "fenceline refuses this statement whatever the lease"}
	}
	if !li.live() {
		why := "no lease"
		if li.err != nil {
			why = li.err.Error()
		}
		return &refusal{code: lease.LeaseReason(li.err), reason: "lease not held: " + why,
			hint: "reads still work; writes need a live lease: acquire a new lease and reconnect through its sidecar"}
	}
	if !s.namesAlike.Load() && notASCIIClaim(li.tables) {
		return &refusal{code: ReasonUnsureParse, reason: "the lease claims names not in ASCII and the client encoding is not UTF8: the names Postgres sends back (the search path, the tables a write reaches) come in the client's encoding, which fenceline cannot read against the claim",
			hint: "connect with client_encoding UTF8"}
	}
	if st.Opaque || st.WriteCheck {
		// (A checked write's tables are known only after it ran: a
		// policy on opaque writes decides it.)
		if r := s.policyRefusal(policy.ActionSQLOpaque, ""); r != nil {
			return r
		}
	}
	if st.Opaque && !s.p.cfg.AllowOpaque {
		what := st.Tag
		if st.Tag == "ParseError" {
			what = "text the parser rejected"
		}
		reason := fmt.Sprintf("cannot tell which tables %s writes; when in doubt fenceline refuses", what)
		if st.OpaqueWhy != "" {
			reason = fmt.Sprintf("cannot tell which tables %s writes: %s", what, st.OpaqueWhy)
		}
		return &refusal{code: ReasonUnnamedTable, reason: reason,
			hint: "writes whose tables cannot be named pass only when the fence runs with --pg-allow-opaque (fenceline run/sidecar; Config.AllowOpaque), under a live lease; otherwise write with INSERT/UPDATE/DELETE/MERGE/COPY on tables the lease claims"}
	}
	for _, t := range st.Targets {
		if r := s.checkTarget(t, li, searchPath); r != nil {
			return r
		}
		if st.Opaque {
			continue // (allowed as opaque: nothing more to follow)
		}
		if r := s.checkReach(st, t, li, searchPath); r != nil {
			return r
		}
	}
	return nil
}

func (s *session) checkTarget(t Target, li leaseInfo, searchPath []string) *refusal {
	if t.Temp || isTempSchema(t.Schema) {
		return nil // session-private
	}
	var cands []string
	if t.Schema != "" {
		cands = []string{t.Schema}
	} else {
		if searchPath == nil {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot resolve unqualified %q: search_path changed earlier in this query", t.Name),
				hint: "schema-qualify the table, or send the write as its own query"}
		}
		for _, sp := range searchPath {
			if isTempSchema(sp) || sp == "pg_catalog" {
				continue
			}
			cands = append(cands, sp)
		}
		if len(cands) == 0 {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("unqualified %q resolves to no schema the lease can claim", t.Name),
				hint: "schema-qualify the table"}
		}
	}
	for _, sch := range cands {
		if sch == Schema {
			return &refusal{code: ReasonFenceTamper, reason: "the fenceline schema holds the fence; nobody writes it through the proxy"}
		}
		name, err := joinTable(sch, t.Name)
		if err != nil {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot name table %s.%s: %v", sch, t.Name, err)}
		}
		if !li.claim.ContainsTable(name) {
			why := fmt.Sprintf("table %s is outside the lease's table scope %v", name, li.tables)
			if t.Schema == "" {
				why = fmt.Sprintf("unqualified %q may resolve to %s (search_path %s), outside the lease's table scope %v",
					t.Name, name, strings.Join(searchPath, ", "), li.tables)
			}
			return &refusal{code: ReasonOutsideLease, reason: why, hint: "acquire a lease that claims the table (--table schema.table or schema.*)"}
		}
		if r := s.policyRefusal(policy.ActionSQLWrite, name); r != nil {
			return r
		}
	}
	return nil
}

// joinTable is scope.JoinTable, with name "*" (a whole schema) giving
// "schema.*".
func joinTable(schema, name string) (string, error) {
	if name != "*" {
		return scope.JoinTable(schema, name)
	}
	n, err := scope.JoinTable(schema, "x")
	if err != nil {
		return "", err
	}
	return n[:len(n)-1] + "*", nil
}

func isTempSchema(s string) bool {
	return s == "pg_temp" || strings.HasPrefix(s, "pg_temp_")
}

// refuse records the refusal (log and audit) and returns SQL that makes the
// server itself raise the error, so the transaction state stays the one
// Postgres would have: a failed block stays failed, an implicit one rolls back.
func (s *session) refuse(r *refusal, st *Statement, li leaseInfo, text string) string {
	msg, detail := s.record(r, st, li, text)
	return refuseSQL(msg, detail, r.hint)
}

// record logs and audits a refusal and returns the message and detail the
// client is told.
func (s *session) record(r *refusal, st *Statement, li leaseInfo, text string) (msg, detail string) {
	owner := li.owner.String()
	msg, detail = refusalText(r, st, li)
	s.p.log.Warn("write refused", "lease", li.id, "owner", owner, "fence", li.fence, "reason", r.reason,
		"statement", st.Tag, "user", s.user)
	if s.p.cfg.Audit != nil {
		ev := lease.AuditEvent{
			Time: time.Now().UTC(), Type: lease.EventDenied, Boundary: lease.BoundaryPostgres,
			Repo: li.repo, LeaseID: li.id, Owner: li.owner, Scope: li.claim, Fence: li.fence,
			Reason: r.code, Message: fmt.Sprintf("postgres %s refused: %s; statement: %s", st.Tag, r.reason, truncate(text, 200)),
		}
		s.blocking(func() {
			ctx, cancel := context.WithTimeout(s.p.ctx, s.p.cfg.AuditTimeout)
			defer cancel()
			if err := s.p.cfg.Audit.Record(ctx, ev); err != nil {
				s.p.log.Error("audit event for a refused write not recorded", "lease", li.id, "err", err)
			}
		})
	}
	return msg, detail
}

// refusalText is the message and detail a refusal tells the client.
func refusalText(r *refusal, st *Statement, li leaseInfo) (msg, detail string) {
	msg = fmt.Sprintf("fenceline: write refused for lease %s (fence %d): %s", orNone(li.id), li.fence, r.reason)
	detail = fmt.Sprintf("lease %s, owner %s, fence %d; statement %s", orNone(li.id), orNone(li.owner.String()), li.fence, st.Tag)
	return msg, detail
}

// dropGuard decides a DROP ... IF EXISTS whose targets are all outside the
// claim (r says so): direct, Postgres answers a notice for each that does
// not exist, and so does the proxy — it forwards the DROP in a transaction
// it made writable, followed by a guard in the same transaction that
// raises r when the DROP wrote anything (the transaction got an xid: it
// dropped something that existed, or came to exist after any look the
// proxy could take), so Postgres rolls it back. No race: the guard sees
// what the DROP did. Only a Query of this one statement outside a block,
// under a live lease, where the proxy made the transaction writable
// (groupRW); everywhere else the refusal stands.
func (s *session) dropGuard(st *Statement, r *refusal, li leaseInfo, n int) bool {
	if r == nil || r.code != ReasonOutsideLease || !st.MissingOK || n != 1 || s.sim.inBlock || !s.sim.groupRW || !li.live() {
		return false
	}
	if st.Opaque && !s.p.cfg.AllowOpaque {
		return false
	}
	for _, t := range st.Targets {
		if s.checkTarget(t, li, s.searchPath) == nil {
			return false // a claimed target would write: the guard would refuse it
		}
	}
	return true
}

// dropGuardSQL is the guard dropGuard puts after the DROP, on one line (a
// refusal's CONTEXT, dropped like refuseSQL's).
func dropGuardSQL(msg, detail, hint string) string {
	q := func(s string) string { return "$fl_m$" + strings.ReplaceAll(s, "$", "") + "$fl_m$" }
	return "DO $fl_do$BEGIN IF pg_catalog.txid_current_if_assigned() IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = " +
		q(msg) + ", DETAIL = " + q(detail) + ", HINT = " + q(hint) + "; END IF; END$fl_do$"
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// refuseSQL is a DO block raising SQLSTATE 42501 with msg.
func refuseSQL(msg, detail, hint string) string {
	q := func(s string) string { return "$fl_m$" + strings.ReplaceAll(s, "$", "") + "$fl_m$" }
	return "DO $fl_do$BEGIN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = " + q(msg) +
		", DETAIL = " + q(detail) + ", HINT = " + q(hint) + "; END$fl_do$"
}

// needSearchPath learns search_path when a write in stmts names a table
// without a schema and the proxy does not know it, and may ask now (lookup:
// not in a failed block, where the query failed and ended the session, nor
// in a pipeline without its Sync). Unlearnt, such a write is refused.
func (s *session) needSearchPath(stmts []*Statement, lookup bool) error {
	if s.searchPath != nil || !lookup {
		return nil
	}
	need := false
	for _, st := range stmts {
		if st == nil || st.Class != ClassWrite {
			continue
		}
		for _, t := range st.Targets {
			if t.Schema == "" && !t.Temp {
				need = true
			}
		}
	}
	if !need {
		return nil
	}
	// The schemas unqualified names resolve in, as Postgres sees them now:
	// search_path with $user expanded and schemas that do not exist left out.
	// Each in UTF8, as hex: Postgres sends names in the client's encoding.
	rows, err := s.internalQuery("SELECT pg_catalog.encode(pg_catalog.convert_to(n, 'UTF8'), 'hex') FROM pg_catalog.unnest(pg_catalog.current_schemas(false)) n")
	if err != nil {
		return err
	}
	path := make([]string, 0, len(rows))
	for _, r := range rows {
		if len(r) != 1 {
			continue
		}
		b, err := hex.DecodeString(r[0])
		if err != nil {
			return fmt.Errorf("%w: search path schema %q is not hex", ErrProtocol, r[0])
		}
		path = append(path, string(b))
	}
	s.searchPath = path
	return nil
}

func parseSearchPath(v string) []string {
	out := []string{}
	for _, part := range strings.Split(v, ",") {
		part = strings.TrimSpace(part)
		if strings.HasPrefix(part, `"`) && strings.HasSuffix(part, `"`) && len(part) >= 2 {
			part = strings.ReplaceAll(part[1:len(part)-1], `""`, `"`)
		} else {
			part = strings.ToLower(part)
		}
		if part != "" {
			out = append(out, part)
		}
	}
	return out
}

// unqualified reports whether st writes a table named without a schema.
func unqualified(st *Statement) bool {
	if st == nil || st.Class != ClassWrite || st.Tx == TxOutside {
		return false
	}
	for _, t := range st.Targets {
		if t.Schema == "" && !t.Temp {
			return true
		}
	}
	return false
}

// pinnedPath is the search path the proxy checked unqualified names with,
// as a search_path value: each schema quoted (” for none).
func (s *session) pinnedPath() string { return s.pathList(false) }

// pinnedPathHex is pinnedPath's UTF8 text in hex, which the proxy's own
// statements decode (spSQL, tokSpSQL): what reaches Postgres is the same
// whatever the client's encoding.
func (s *session) pinnedPathHex() string {
	return hex.EncodeToString([]byte(s.pinnedPath()))
}

// pinnedPathSQL is pinnedPath as the list of a SET statement, every
// schema not in ASCII spelled in Unicode escapes (U&"\+0000E9"), so the
// text is ASCII and reads the same in any client encoding.
func (s *session) pinnedPathSQL() string { return s.pathList(true) }

// pathList writes the search path's schemas quoted, those not in ASCII in
// Unicode escapes when escaped.
func (s *session) pathList(escaped bool) string {
	if len(s.searchPath) == 0 {
		return "''"
	}
	var b strings.Builder
	for i, sch := range s.searchPath {
		if i > 0 {
			b.WriteString(", ")
		}
		if !escaped || isASCII([]byte(sch)) {
			b.WriteString(`"` + strings.ReplaceAll(sch, `"`, `""`) + `"`)
			continue
		}
		b.WriteString(`U&"`)
		for _, r := range sch {
			switch {
			case r == '"':
				b.WriteString(`""`)
			case r == '\\':
				b.WriteString(`\\`)
			case r < 0x80:
				b.WriteRune(r)
			default:
				fmt.Fprintf(&b, `\+%06X`, r)
			}
		}
		b.WriteString(`"`)
	}
	return b.String()
}

func spIfKnown(sp, cur []string) []string {
	if sp == nil {
		return nil
	}
	return cur
}

// sequenceWrite: a read that advances or sets sequences it names by
// constants (SELECT nextval('s'), how ORMs fetch ids) writes them. Outside
// a transaction block and under a live lease it is a write, so the proxy
// makes its transaction writable and it runs as direct, judged by what it
// writes: each sequence's tables, and every function it calls, as in a
// writable block (judgeCalls, judgeSequence). Without a live lease, or in
// a block (writable or not, the block decided), it stays a read: Postgres
// refuses its write in a read-only transaction, as before.
func (s *session) sequenceWrite(st *Statement) *Statement {
	if st == nil || st.Class != ClassRead || s.sim.inBlock || s.pendingSync || !advancesSequence(st) {
		return st
	}
	if !s.lease().live() {
		return st
	}
	cp := *st
	cp.Class = ClassWrite
	return &cp
}

// advancesSequence: st calls nextval or setval on a sequence it names by a
// constant (one it does not name, "?", judgeSequence refuses: left a read).
func advancesSequence(st *Statement) bool {
	named := false
	for _, c := range st.Calls {
		if c.Kind == 'q' {
			if c.Name == "?" {
				return false
			}
			named = true
		}
	}
	return named
}

// callsToJudge: a query the fast path would forward calls functions or
// operators that may write where the proxy does not look: in a transaction
// made writable, or dblink's anywhere (see judgeCalls).
func (s *session) callsToJudge(cls *Classification) bool {
	for i := range cls.Stmts {
		st := &cls.Stmts[i]
		if len(st.Calls) == 0 {
			continue
		}
		if s.foreignToJudge(st) || callsOtherConnection(st) || (s.sim.blockRW || s.sim.groupRW) && !s.callsKnownHarmless(st) {
			return true
		}
	}
	return false
}

// classifyInline: see classify.
const classifyInline = 4 << 10
