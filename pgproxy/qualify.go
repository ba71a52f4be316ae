package pgproxy

import (
	"errors"
	"fmt"

	pgq "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// qualifyCatalogSQL returns q, a catalog lookup of the proxy's own, with
// every operator, function and type it names schema-qualified with
// pg_catalog, so that nothing the session's search path holds can stand in
// for them. An operator of the same name and the exact argument types in a
// schema of the path is taken before pg_catalog's when pg_catalog's needs
// a cast (CVE-2018-1058's pattern: `p.oid >= 16384` compares oid with
// int4), and a lookup blinded so took a user function for a builtin. Set
// as search_path, pg_catalog alone covers a lookup in a transaction of its
// own (pinPathSQL); in the client's transaction block a setting would
// outlive the lookup, so the text itself names the schema.
//
// It parses q, qualifies the names in the tree and deparses it, then
// parses the result again and checks it (qualifiedOnly): a form the
// deparser would print without its schema (x IN (list), CASE x WHEN) is
// an error, never a lookup run with the path's operators.
func qualifyCatalogSQL(q string) (string, error) {
	tree, err := pgq.Parse(q)
	if err != nil {
		return "", fmt.Errorf("catalog lookup does not parse: %w", err)
	}
	var bad string
	walk(tree.ProtoReflect(), func(m protoreflect.Message) {
		switch v := m.Interface().(type) {
		case *pgq.A_Expr:
			switch v.Kind {
			case pgq.A_Expr_Kind_AEXPR_OP, pgq.A_Expr_Kind_AEXPR_OP_ANY, pgq.A_Expr_Kind_AEXPR_OP_ALL, pgq.A_Expr_Kind_AEXPR_IN:
			default: // LIKE, BETWEEN, NULLIF, IS DISTINCT FROM, ...: printed without the schema
				bad = "operator " + nameString(v.Name) + " in a form written without its schema (" + v.Kind.String() + ")"
			}
			if l := v.Rexpr.GetList(); v.Kind == pgq.A_Expr_Kind_AEXPR_IN && l != nil {
				// x IN (a, b) is x = ANY (ARRAY[a, b]), NOT IN x <> ALL:
				// the deparser prints IN without its operator's schema.
				v.Kind = pgq.A_Expr_Kind_AEXPR_OP_ANY
				if nameString(v.Name) == "<>" {
					v.Kind = pgq.A_Expr_Kind_AEXPR_OP_ALL
				}
				v.Rexpr = &pgq.Node{Node: &pgq.Node_AArrayExpr{AArrayExpr: &pgq.A_ArrayExpr{Elements: l.Items, Location: -1}}}
			}
			v.Name = inCatalog(v.Name)
		case *pgq.SubLink:
			if v.SubLinkType == pgq.SubLinkType_ANY_SUBLINK || v.SubLinkType == pgq.SubLinkType_ALL_SUBLINK {
				if len(v.OperName) == 0 { // x IN (SELECT ...)
					v.OperName = []*pgq.Node{pgq.MakeStrNode("=")}
				}
				v.OperName = inCatalog(v.OperName)
			}
		case *pgq.FuncCall:
			v.Funcname = inCatalog(v.Funcname)
		case *pgq.TypeName:
			v.Names = inCatalog(v.Names)
		}
	})
	if bad != "" {
		return "", fmt.Errorf("%w: %s", errUnqualified, bad)
	}
	out, err := pgq.Deparse(tree)
	if err != nil {
		return "", fmt.Errorf("catalog lookup does not deparse: %w", err)
	}
	if err := qualifiedOnly(out); err != nil {
		return "", err
	}
	return out, nil
}

// inCatalog returns name with pg_catalog before it when it has no schema.
func inCatalog(name []*pgq.Node) []*pgq.Node {
	if len(name) != 1 {
		return name
	}
	return []*pgq.Node{pgq.MakeStrNode("pg_catalog"), name[0]}
}

// errUnqualified: a catalog lookup would resolve a name by the session's
// search path.
var errUnqualified = errors.New("catalog lookup names an operator, function or type without its schema")

// qualifiedOnly checks that q names every operator, function and type with
// its schema, and uses no form whose operator Postgres looks up by the
// path whatever the text says (CASE x WHEN, JOIN USING, or what the
// deparser prints without the schema: x IN (list), NULLIF, LIKE).
func qualifiedOnly(q string) error {
	tree, err := pgq.Parse(q)
	if err != nil {
		return fmt.Errorf("qualified catalog lookup does not parse: %w", err)
	}
	var bad string
	walk(tree.ProtoReflect(), func(m protoreflect.Message) {
		if bad != "" {
			return
		}
		switch v := m.Interface().(type) {
		case *pgq.A_Expr:
			switch {
			case !inCatalogOnly(v.Name):
				bad = "operator " + nameString(v.Name)
			case v.Kind == pgq.A_Expr_Kind_AEXPR_IN || v.Kind == pgq.A_Expr_Kind_AEXPR_BETWEEN || v.Kind == pgq.A_Expr_Kind_AEXPR_NOT_BETWEEN ||
				v.Kind == pgq.A_Expr_Kind_AEXPR_BETWEEN_SYM || v.Kind == pgq.A_Expr_Kind_AEXPR_NOT_BETWEEN_SYM:
				bad = "IN or BETWEEN (use OPERATOR(pg_catalog.=) ANY, or two comparisons)"
			}
		case *pgq.SubLink:
			if (v.SubLinkType == pgq.SubLinkType_ANY_SUBLINK || v.SubLinkType == pgq.SubLinkType_ALL_SUBLINK) && !inCatalogOnly(v.OperName) {
				bad = "IN or ANY (SELECT ...) with operator " + nameString(v.OperName)
			}
		case *pgq.FuncCall:
			if !inCatalogOnly(v.Funcname) {
				bad = "function " + nameString(v.Funcname)
			}
		case *pgq.TypeName:
			if !inCatalogOnly(v.Names) {
				bad = "type " + nameString(v.Names)
			}
		case *pgq.JoinExpr:
			if len(v.UsingClause) > 0 || v.IsNatural {
				bad = "JOIN USING or NATURAL JOIN (use ON x OPERATOR(pg_catalog.=) y)"
			}
		case *pgq.CaseExpr:
			if v.Arg != nil {
				bad = "CASE x WHEN (use CASE WHEN x OPERATOR(pg_catalog.=) ...)"
			}
		}
	})
	if bad != "" {
		return fmt.Errorf("%w: %s", errUnqualified, bad)
	}
	return nil
}

// inCatalogOnly: name is pg_catalog's.
func inCatalogOnly(name []*pgq.Node) bool {
	return len(name) == 2 && name[0].GetString_().GetSval() == "pg_catalog"
}

func nameString(l []*pgq.Node) string {
	s := ""
	for i, n := range l {
		if i > 0 {
			s += "."
		}
		s += n.GetString_().GetSval()
	}
	if s == "" {
		return "(none)"
	}
	return s
}
