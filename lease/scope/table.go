package scope

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxIdentLen is the longest Postgres identifier in bytes (NAMEDATALEN-1);
// Postgres truncates longer ones.
const maxIdentLen = 63

// NormalizeTable returns the normal form of a table claim, "schema.table"
// or "schema.*". Unquoted identifiers are folded to lower case; quoted ones
// keep their case and stay quoted only when they need quotes (see the
// package comment). It rejects, with an error naming t, a name without a
// schema, with empty or more than two parts, a "*" schema, NUL bytes,
// whitespace outside double quotes, and malformed or over-long
// identifiers. A quoted identifier may hold whitespace, as in Postgres
// (schema_one."table two").
func NormalizeTable(t string) (string, error) {
	switch {
	case t == "":
		return "", fmt.Errorf("table %q is empty; write schema.table, e.g. public.users", t)
	case strings.IndexByte(t, 0) >= 0:
		return "", fmt.Errorf("table %q contains a NUL byte; remove it", t)
	case !utf8.ValidString(t):
		return "", fmt.Errorf("table %q is not valid UTF-8; name it in UTF-8", t)
	}
	var parts []ident
	for i := 0; ; {
		id, next, err := parseIdent(t, i)
		if err != nil {
			return "", err
		}
		parts = append(parts, id)
		if next == len(t) {
			break
		}
		if t[next] != '.' {
			return "", fmt.Errorf("table %q has text after a closing quote; separate identifiers with '.'", t)
		}
		i = next + 1
		if i == len(t) {
			return "", fmt.Errorf("table %q ends with '.'; write schema.table or schema.*", t)
		}
	}
	for _, id := range parts {
		if id.name == "" {
			return "", fmt.Errorf("table %q has an empty identifier; write schema.table, e.g. public.users", t)
		}
	}
	switch {
	case len(parts) == 1:
		return "", fmt.Errorf("table %q has no schema; write schema.table, e.g. public.%s", t, t)
	case len(parts) > 2:
		return "", fmt.Errorf("table %q has more than two parts; write schema.table, e.g. public.users", t)
	}
	for k, id := range parts {
		if !id.quoted && id.name == "*" {
			if k == 0 {
				return "", fmt.Errorf("table %q has * as schema; name the schema, e.g. public.*", t)
			}
			continue
		}
		if !id.quoted && strings.IndexFunc(id.name, unicode.IsSpace) >= 0 {
			return "", fmt.Errorf("table %q contains whitespace outside quotes; write schema.table without spaces, e.g. public.users, or double-quote a name that has them", t)
		}
		if !id.quoted && !validUnquoted(id.name) {
			return "", fmt.Errorf("table %q: %q is not a valid unquoted identifier; use letters, digits, _ and $, or double-quote it", t, id.name)
		}
		if len(id.name) > maxIdentLen {
			return "", fmt.Errorf("table %q: identifier %q is longer than %d bytes, which Postgres truncates; use the real name", t, id.name, maxIdentLen)
		}
	}
	schema, rel := parts[0].name, parts[1].name
	if parts[1].quoted || rel != "*" {
		rel = quoteIdent(rel)
	}
	return quoteIdent(schema) + "." + rel, nil
}

// SplitTable splits a table claim into its raw (unquoted, case-exact)
// schema and relation names, as Postgres's catalogs spell them; wildcard
// says the claim is "schema.*" (rel is then "*"), not a table literally
// named *. It errors as NormalizeTable does.
func SplitTable(t string) (schema, rel string, wildcard bool, err error) {
	n, err := NormalizeTable(t)
	if err != nil {
		return "", "", false, err
	}
	s, next, err := parseIdent(n, 0)
	if err != nil {
		return "", "", false, err
	}
	r, _, err := parseIdent(n, next+1)
	if err != nil {
		return "", "", false, err
	}
	return s.name, r.name, !r.quoted && r.name == "*", nil
}

// JoinTable returns the normal form of the table with the raw (unquoted,
// case-exact) schema and relation names, as a SQL parser reports them. It
// errors when the result would not be a valid normalized table, for example
// for empty names or names with whitespace.
func JoinTable(schema, relation string) (string, error) {
	t := quoteIdent(schema) + "." + quoteIdent(relation)
	if plainIdent(schema) && plainIdent(relation) {
		return t, nil // what NormalizeTable(t) returns: the proxy asks on every write
	}
	return NormalizeTable(t) // the error naming what is wrong
}

// plainIdent reports whether NormalizeTable takes the raw name spelled by
// quoteIdent as it is: not empty, not too long, valid UTF-8 without NUL.
func plainIdent(name string) bool {
	if name == "" || len(name) > maxIdentLen || !utf8.ValidString(name) {
		return false
	}
	return strings.IndexByte(name, 0) < 0
}

// TablesOverlap reports whether two normalized tables overlap: they are
// equal, or one is "s.*" and the other is in schema s.
func TablesOverlap(a, b string) bool {
	if a == b {
		return true
	}
	sa, ra, oka := splitTable(a)
	sb, rb, okb := splitTable(b)
	return oka && okb && sa == sb && (ra == "*" || rb == "*")
}

// ident is one parsed identifier: its name with quoting removed and, for
// unquoted ones, case folded.
type ident struct {
	name   string
	quoted bool
}

// parseIdent parses the identifier of t starting at byte i and returns it
// with the index just past it.
func parseIdent(t string, i int) (ident, int, error) {
	if i < len(t) && t[i] == '"' {
		var b strings.Builder
		for j := i + 1; j < len(t); j++ {
			if t[j] != '"' {
				b.WriteByte(t[j])
				continue
			}
			if j+1 < len(t) && t[j+1] == '"' {
				b.WriteByte('"')
				j++
				continue
			}
			return ident{name: b.String(), quoted: true}, j + 1, nil
		}
		return ident{}, 0, fmt.Errorf("table %q has an unterminated quoted identifier; close it with \"", t)
	}
	j := i
	for j < len(t) && t[j] != '.' && t[j] != '"' {
		j++
	}
	if j < len(t) && t[j] == '"' {
		return ident{}, 0, fmt.Errorf("table %q has a quote inside an identifier; quote the whole identifier, e.g. public.\"MyTable\"", t)
	}
	return ident{name: foldASCII(t[i:j])}, j, nil
}

// foldASCII lower-cases ASCII letters only, as Postgres folds unquoted
// identifiers in a UTF-8 database.
func foldASCII(s string) string {
	return strings.Map(func(r rune) rune {
		if 'A' <= r && r <= 'Z' {
			return r + ('a' - 'A')
		}
		return r
	}, s)
}

// validUnquoted reports whether s is a valid unquoted Postgres identifier
// (any case): it starts with a letter, '_' or a non-ASCII character and
// continues with those, digits and '$'.
func validUnquoted(s string) bool {
	if strings.IndexFunc(s, unicode.IsSpace) >= 0 {
		return false // (non-ASCII whitespace: quoted, so it shows)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 0x80, c == '_', 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case i > 0 && (c == '$' || '0' <= c && c <= '9'):
		default:
			return false
		}
	}
	return s != ""
}

// quoteIdent spells the raw identifier name in normal form: bare when it is
// a valid unquoted identifier that folding leaves unchanged, else quoted.
func quoteIdent(name string) string {
	if validUnquoted(name) && foldASCII(name) == name {
		return name
	}
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}

// splitTable splits a normalized table into its schema and relation as
// spelled (quotes kept). ok is false when t is not of that shape.
func splitTable(t string) (schema, rel string, ok bool) {
	end := 0
	if strings.HasPrefix(t, `"`) {
		end = 1
		for end < len(t) {
			if t[end] == '"' {
				if end+1 < len(t) && t[end+1] == '"' {
					end += 2
					continue
				}
				break
			}
			end++
		}
		end++ // past the closing quote
	} else {
		end = strings.IndexByte(t, '.')
	}
	if end <= 0 || end >= len(t) || t[end] != '.' {
		return "", "", false
	}
	return t[:end], t[end+1:], true
}
