package pgproxy

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"

	pgq "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// What no agent may do through the proxy, lease or not, because it acts on
// the fence or on another agent's sessions rather than on tables:
//
//   - Name the fence's schema or its objects, in any statement and any
//     spelling the parser resolves (quoted, any case, Unicode escapes; a
//     string constant that names one, as regclass, to_regclass,
//     pg_sequence_last_value or current_setting read it; a search_path
//     that holds it). Reading a table's gate sequence holds the gate to the
//     end of the transaction, and another lease's epoch raise waits for
//     every holder (fence_slow_gate bounds that wait; this keeps agents
//     from holding it at all).
//   - Read sequences it does not name: pg_sequence_last_value of an oid or
//     an expression, and pg_sequences (which reads every sequence), hold
//     the gates as well.
//   - Signal a backend that is not the session's own: pg_cancel_backend,
//     pg_terminate_backend and pg_log_backend_memory_contexts of a pid
//     that is not a constant (or pg_backend_pid()) are refused here; a
//     constant is judged by the session (session.judgeSignals), which knows
//     its backend's pid.
//   - Hide any of these in code the proxy does not parse (the body of a DO
//     block or of a function in a language other than SQL): refused when
//     the body mentions them. Code that builds the names at run time is
//     past the proxy's sight; it runs only with --pg-allow-opaque.

// signalFuncs signal the backend whose pid is their first argument.
var signalFuncs = map[string]bool{"pg_cancel_backend": true, "pg_terminate_backend": true, "pg_log_backend_memory_contexts": true}

// hiddenWords are what the body of a DO block or a function may not mention.
var hiddenWords = []string{Schema, "pg_sequence_last_value", "pg_sequences", "pg_cancel_backend", "pg_terminate_backend", "pg_log_backend_memory_contexts"}

// fenceGuard walks statement n for what the proxy refuses whatever the
// lease (forbidden: why), and collects the constant pids n signals and the
// parameters ($n) that carry the pids it signals.
// constDependent: the verdict depends on a constant's value or kind (n
// names a sequence to pg_sequence_last_value, or signals a pid), so the
// classification is not shared by texts of the same literal shape.
func fenceGuard(n *pgq.Node) (forbidden string, signals []int32, params []int, constDependent bool) {
	var g guardWalk
	walk(n.ProtoReflect(), g.node)
	return g.forbidden, g.signals, g.params, g.constDependent
}

// guardWalk is what fenceGuard found so far (see fenceGuard).
type guardWalk struct {
	forbidden      string
	signals        []int32
	params         []int
	constDependent bool
}

// why records the first reason to refuse.
func (g *guardWalk) why(s string) {
	if g.forbidden == "" {
		g.forbidden = s
	}
}

// named refuses a qualified name in the fence's schema: "it <verb> <name>".
func (g *guardWalk) named(verb string, names []string) {
	if qualifiedBy(names, Schema) {
		g.why(fmt.Sprintf("it %s %s, %s", verb, strings.Join(names, "."), fenceObjects))
	}
}

// node judges one node of the statement's parse tree.
func (g *guardWalk) node(m protoreflect.Message) {
	switch v := m.Interface().(type) {
	case *pgq.RangeVar:
		if v.Schemaname == Schema {
			g.why(fmt.Sprintf("it names %s.%s, %s", Schema, v.Relname, fenceObjects))
		}
		if v.Schemaname == "" || v.Schemaname == "pg_catalog" {
			if v.Relname == "pg_sequences" {
				g.why("it reads pg_sequences, which reads every sequence the role may see and holds each to the transaction's end, the fence's gates included: that stalls every other lease's epoch raise (name the sequence instead: pg_sequence_last_value('schema.seq'))")
			}
		}
	case *pgq.FuncCall:
		g.funcCall(v)
	case *pgq.TypeName:
		g.named("names type", strs(v.Names))
	case *pgq.A_Expr:
		g.named("calls operator", strs(v.Name))
	case *pgq.ColumnRef:
		if names := strs(v.Fields); len(names) >= 3 && names[len(names)-3] == Schema {
			g.why(fmt.Sprintf("it names %s, %s", strings.Join(names, "."), fenceObjects))
		}
	case *pgq.ObjectWithArgs:
		g.named("names", strs(v.Objname))
	case *pgq.CreateTrigStmt:
		g.named("names", strs(v.Funcname))
	case *pgq.CreateEventTrigStmt:
		g.named("names", strs(v.Funcname))
	case *pgq.List:
		if names := strs(v.Items); len(names) == len(v.Items) && qualifiedBy(names, Schema) {
			g.why(fmt.Sprintf("it names %s, %s", strings.Join(names, "."), fenceObjects))
		}
	case *pgq.A_Const:
		if sv := v.GetSval(); sv != nil && namesFence(sv.Sval) {
			g.why(fmt.Sprintf("it names %q, %s", truncate(sv.Sval, 80), fenceObjects))
		}
	case *pgq.VariableSetStmt:
		if strings.EqualFold(v.Name, "search_path") {
			for _, a := range v.Args {
				if pathHasFence(constString(a)) {
					g.why("it puts the fenceline schema on search_path, " + fenceObjects)
				}
			}
		}
	case *pgq.VariableShowStmt:
		if strings.HasPrefix(strings.ToLower(v.Name), Schema+".") {
			g.why(fmt.Sprintf("it shows %s, a setting that carries the fence", v.Name))
		}
	case *pgq.DefElem:
		if v.Defname == "as" {
			g.body(v)
		}
	}
}

// funcCall judges a function call: one of the fence's functions, a read
// of a sequence not named by a constant, a signal to a backend, or a
// search_path set to hold the fence's schema.
func (g *guardWalk) funcCall(v *pgq.FuncCall) {
	names := strs(v.Funcname)
	if len(names) == 0 {
		return
	}
	if qualifiedBy(names, Schema) {
		g.why(fmt.Sprintf("it calls %s, %s", strings.Join(names, "."), fenceObjects))
		return
	}
	name := names[len(names)-1]
	switch {
	case name == "pg_sequence_last_value":
		g.constDependent = true
		switch c := seqConst(v.Args); {
		case c == "":
			g.why("it calls pg_sequence_last_value on a sequence it does not name by a constant: it may read (and hold to the transaction's end) a fence gate, which stalls another lease's epoch raise")
		case fenceSequenceName(c):
			g.why(fmt.Sprintf("it calls pg_sequence_last_value on %q, unqualified, a name of the fence's sequences: with a search_path set at run time it reads (and holds) a fence gate, which stalls another lease's epoch raise", c))
		}
	case signalFuncs[name]:
		g.constDependent = true
		pid, param, own, ok := pidArg(v.Args)
		switch {
		case !ok:
			g.why(fmt.Sprintf("it calls %s on a backend it does not name by a constant or a parameter: it may signal another agent's session", name))
		case param > 0:
			g.params = append(g.params, param)
		case !own:
			g.signals = append(g.signals, pid)
		}
	case name == "set_config" && len(v.Args) >= 2 && strings.EqualFold(constString(v.Args[0]), "search_path") &&
		pathHasFence(constString(v.Args[1])):
		g.why("it puts the fenceline schema on search_path, " + fenceObjects)
	}
}

// body refuses the body of a DO block or a function (the AS of v), code
// the proxy does not parse, when it mentions one of hiddenWords.
func (g *guardWalk) body(v *pgq.DefElem) {
	walk(v.ProtoReflect(), func(m protoreflect.Message) {
		if s, ok := m.Interface().(*pgq.String); ok {
			for _, w := range hiddenWords {
				if containsFold(s.Sval, w) {
					g.why(fmt.Sprintf("its body, code the proxy does not parse, mentions %s, which the proxy refuses in statements it reads (the fence's schema, unnamed sequences, signals to other backends)", w))
					return
				}
			}
		}
	})
}

// fenceObjects ends every refusal of a name of the fence.
const fenceObjects = "in schema fenceline, which holds the storage fence (its secret, epochs and gates) and which no agent reads or writes: reading a table's gate holds it, and stalls another lease's writes"

// strs is the String values of nodes, in order; it stops at the first node
// that is not a String (A_Star, say).
func strs(nodes []*pgq.Node) []string {
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		s, ok := n.Node.(*pgq.Node_String_)
		if !ok {
			break
		}
		out = append(out, s.String_.Sval)
	}
	return out
}

// qualifiedBy: names is a qualified name (schema.name or
// catalog.schema.name) in schema.
func qualifiedBy(names []string, schema string) bool {
	return len(names) >= 2 && len(names) <= 3 && names[len(names)-2] == schema
}

// constString is the value of a string constant n (possibly cast), or "".
func constString(n *pgq.Node) string {
	if tc := n.GetTypeCast(); tc != nil {
		n = tc.Arg
	}
	if c := n.GetAConst(); c != nil && c.GetSval() != nil {
		return c.GetSval().GetSval()
	}
	return ""
}

// seqConst is the sequence a call's first argument names by a string
// constant (cast or not), or "" when it is anything else (an oid, an
// expression).
func seqConst(args []*pgq.Node) string {
	if len(args) == 0 {
		return ""
	}
	return constString(args[0])
}

// pidArg reads the pid a signalling call's first argument names: a
// constant (integer or string, cast or not), a parameter ($n, cast or not:
// param is n), or pg_backend_pid() (own).
func pidArg(args []*pgq.Node) (pid int32, param int, own, ok bool) {
	if len(args) == 0 {
		return 0, 0, false, false
	}
	a := args[0]
	if tc := a.GetTypeCast(); tc != nil {
		a = tc.Arg
	}
	if f := a.GetFuncCall(); f != nil && len(f.Args) == 0 {
		names := strs(f.Funcname)
		if len(names) == len(f.Funcname) && names[len(names)-1] == "pg_backend_pid" && (len(names) == 1 || len(names) == 2 && names[0] == "pg_catalog") {
			return 0, 0, true, true
		}
	}
	if p := a.GetParamRef(); p != nil && p.Number > 0 {
		return 0, int(p.Number), false, true
	}
	c := a.GetAConst()
	if c == nil {
		return 0, 0, false, false
	}
	if iv := c.GetIval(); iv != nil {
		return iv.Ival, 0, false, true
	}
	if sv := c.GetSval(); sv != nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(sv.Sval), 10, 32); err == nil {
			return int32(n), 0, false, true
		}
	}
	return 0, 0, false, false
}

// bindPID is the pid parameter n (1-based) of a Bind carries, from the
// rest of its body after the portal and statement names: text digits, or
// a binary int4 or int8. ok is false when it carries none that reads so.
func bindPID(rest []byte, n int) (pid int64, ok bool) {
	u16 := func() (int, bool) {
		if len(rest) < 2 {
			return 0, false
		}
		v := int(int16(binary.BigEndian.Uint16(rest)))
		rest = rest[2:]
		return v, true
	}
	nf, ok := u16()
	if !ok || nf < 0 || len(rest) < 2*nf {
		return 0, false
	}
	formats := rest[:2*nf]
	rest = rest[2*nf:]
	np, ok := u16()
	if !ok || n > np {
		return 0, false
	}
	for i := 1; i <= np; i++ {
		if len(rest) < 4 {
			return 0, false
		}
		l := int(int32(binary.BigEndian.Uint32(rest)))
		rest = rest[4:]
		if l < 0 || l > len(rest) {
			return 0, false // NULL, or short
		}
		if i < n {
			rest = rest[l:]
			continue
		}
		v := rest[:l]
		format := 0
		switch {
		case nf == 1:
			format = int(binary.BigEndian.Uint16(formats))
		case nf >= i:
			format = int(binary.BigEndian.Uint16(formats[2*(i-1):]))
		}
		if format == 0 {
			p, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
			return p, err == nil
		}
		switch len(v) {
		case 4:
			return int64(int32(binary.BigEndian.Uint32(v))), true
		case 8:
			return int64(binary.BigEndian.Uint64(v)), true
		}
		return 0, false
	}
	return 0, false
}

// namesFence reports whether s, read as regclass, regproc, to_regclass or a
// setting name would read it, names something in the fenceline schema: a
// qualified name whose schema (the first of two parts, the second of
// three) is fenceline, unquoted in any case or quoted exactly, with
// whitespace around the parts.
func namesFence(s string) bool {
	parts := splitQualified(s)
	return len(parts) >= 2 && (parts[0] == Schema || len(parts) >= 3 && parts[1] == Schema)
}

// fenceSequenceName: s is an unqualified name the fence gives its
// sequences (gate_<oid>, epoch_<oid>, verified, session).
func fenceSequenceName(s string) bool {
	parts := splitQualified(s)
	if len(parts) != 1 {
		return false
	}
	n := parts[0]
	if n == "verified" || n == "session" {
		return true
	}
	for _, p := range []string{"gate_", "epoch_"} {
		if d, ok := strings.CutPrefix(n, p); ok && d != "" && strings.Trim(d, "0123456789") == "" {
			return true
		}
	}
	return false
}

// pathHasFence reports whether a search_path value (a list of schema
// names) holds fenceline.
func pathHasFence(s string) bool {
	for _, p := range strings.Split(s, ",") {
		if parts := splitQualified(p); len(parts) == 1 && parts[0] == Schema {
			return true
		}
	}
	return false
}

// splitQualified splits a dotted name as Postgres's identifier parser does
// (double quotes keep case and dots, "" is a quote; unquoted parts are
// folded to lower case, İ to i as a Turkish locale may; whitespace around
// parts is skipped). For the guard's comparisons only. What follows
// a part that is not a dot ends the name (a regprocedure's argument list,
// say): the parts so far are returned.
func splitQualified(s string) []string {
	var parts []string
	i := 0
	for {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		var b strings.Builder
		if i < len(s) && s[i] == '"' {
			i++
			for {
				if i >= len(s) {
					return nil
				}
				if s[i] == '"' {
					if i+1 < len(s) && s[i+1] == '"' {
						b.WriteByte('"')
						i += 2
						continue
					}
					i++
					break
				}
				b.WriteByte(s[i])
				i++
			}
		} else {
			for i < len(s) && s[i] != '.' && !isSpace(s[i]) && s[i] != '(' && s[i] != '"' {
				c := s[i]
				if 'A' <= c && c <= 'Z' {
					c += 'a' - 'A'
				}
				if c == 0xC4 && i+1 < len(s) && s[i+1] == 0xB0 {
					// İ: a database in a single-byte encoding folds an
					// unquoted one by its locale, and a Turkish locale
					// folds it to i, so 'FENCELİNE.epoch'::regclass is
					// fenceline's (found by a review). Elsewhere it stays
					// İ: taken for i here, a name is only refused.
					c = 'i'
					i++
				}
				b.WriteByte(c)
				i++
			}
		}
		parts = append(parts, b.String())
		for i < len(s) && isSpace(s[i]) {
			i++
		}
		if i >= len(s) || s[i] != '.' {
			return parts
		}
		i++
	}
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// containsFold reports whether s contains sub (ASCII, any case) without
// allocating.
func containsFold(s, sub string) bool {
	n := len(sub)
	if n == 0 {
		return true
	}
	c0 := sub[0] | 0x20
	for i := 0; i+n <= len(s); i++ {
		if s[i]|0x20 == c0 && strings.EqualFold(s[i:i+n], sub) {
			return true
		}
	}
	return false
}
