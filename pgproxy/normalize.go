package pgproxy

import "strings"

// literalKey returns the text of a single SELECT/INSERT/UPDATE/DELETE/
// WITH/VALUES/TABLE statement with its string and numeric literals replaced
// by '?', so statements that differ only in constants (pgbench's
// "... WHERE aid = 4711") share one classification. The class and targets of
// these statement kinds never depend on a constant's value. It returns ""
// when the text is anything else or the scan is unsure (several statements,
// dollar quoting, escape strings, Unicode escapes, backslashes): the caller
// then classifies the exact text.
func literalKey(sql string) string {
	b, ok := appendLiteralKey(make([]byte, 0, len(sql)), sql)
	if !ok {
		return ""
	}
	return string(b)
}

// appendLiteralKey appends literalKey(sql) to b; ok is false where
// literalKey returns "". It lets the classifier look the key up without
// allocating.
func appendLiteralKey(b []byte, sql string) (_ []byte, ok bool) {
	first := ""
	i := 0
	for i < len(sql) {
		c := sql[i]
		switch {
		case isSpace(c):
			var ws byte
			ws, i = spaceRun(sql, i)
			b = append(b, ws)
		case c == '\'':
			j, ok := stringEnd(sql, i)
			if !ok {
				return b, false
			}
			b = append(b, '?')
			i = j
		case c >= '0' && c <= '9':
			if i > 0 && isWordByte(sql[i-1]) {
				b = append(b, c) // part of an identifier or $1
				i++
				continue
			}
			j, ok := numberEnd(sql, i)
			if !ok {
				return b, false
			}
			b = append(b, '?')
			i = j
		case c == '"':
			j := strings.IndexByte(sql[i+1:], '"')
			if j < 0 {
				return b, false
			}
			b = append(b, sql[i:i+j+2]...)
			i += j + 2
		case c == '$' && (i == 0 || !isWordByte(sql[i-1])) && i+1 < len(sql) && !(sql[i+1] >= '0' && sql[i+1] <= '9'):
			return b, false // dollar quoting
		case c == ';':
			if strings.TrimSpace(sql[i+1:]) != "" {
				return b, false
			}
			i = len(sql)
		case c == '-' && i+1 < len(sql) && sql[i+1] == '-', c == '/' && i+1 < len(sql) && sql[i+1] == '*':
			return b, false // comments: let the parser see them
		case c == '\\' || c >= 0x80:
			return b, false
		case isWordByte(c):
			j := i
			for j < len(sql) && isWordByte(sql[j]) {
				j++
			}
			w := sql[i:j]
			if first == "" {
				first = strings.ToLower(w)
				if !keyedStatement(first) {
					return b, false
				}
			}
			if (w == "U" || w == "u") && j < len(sql) && sql[j] == '&' {
				return b, false
			}
			b = append(b, w...)
			i = j
		default:
			b = append(b, c)
			i++
		}
	}
	if first == "" {
		return b, false
	}
	return b, true
}

// keyedStatement: statements beginning with word (lower case) share a
// classification with texts of the same literal shape.
func keyedStatement(word string) bool {
	switch word {
	case "select", "insert", "update", "delete", "with", "values", "table":
		return true
	}
	return false
}

// spaceRun is the whitespace run at sql[i] as one byte of the key, and
// where it ends. A run with a newline keeps it: two string constants with
// only a newline between them are one constant.
func spaceRun(sql string, i int) (byte, int) {
	ws := byte(' ')
	for i < len(sql) && isSpace(sql[i]) {
		if sql[i] == '\n' || sql[i] == '\r' {
			ws = '\n'
		}
		i++
	}
	return ws, i
}

// stringEnd is where the string constant at sql[i] (its opening quote)
// ends, after its closing quote; ok is false where the exact text must
// decide.
func stringEnd(sql string, i int) (_ int, ok bool) {
	j := i + 1
	for {
		if j >= len(sql) {
			return j, false
		}
		if sql[j] == '\\' || sql[j] >= 0x80 || sql[j] < ' ' && sql[j] != '\t' && sql[j] != '\n' && sql[j] != '\r' {
			// A backslash (an escape when standard_conforming_strings
			// is off), a byte of a multibyte character (which may be
			// invalid) or a control byte: the exact text decides.
			return j, false
		}
		if sql[j] == '\'' {
			if j+1 < len(sql) && sql[j+1] == '\'' {
				j += 2
				continue
			}
			break
		}
		j++
	}
	if i > 0 && isWordByte(sql[i-1]) {
		return j, false // E'...', U&'...', B'...', X'...'
	}
	return j + 1, true
}

// numberEnd is where the plain decimal constant at sql[i] ends: digits, a
// fraction, an exponent. Anything else glued to it (1into, 0x1F, 1_000,
// 1.2.3) may change how the statement parses: ok is false, the exact text
// decides.
func numberEnd(sql string, i int) (_ int, ok bool) {
	j := skipDigits(sql, i)
	if j < len(sql) && sql[j] == '.' {
		j = skipDigits(sql, j+1)
	}
	if j < len(sql) && (sql[j] == 'e' || sql[j] == 'E') {
		j++
		if j < len(sql) && (sql[j] == '+' || sql[j] == '-') {
			j++
		}
		if j >= len(sql) || sql[j] < '0' || sql[j] > '9' {
			return j, false
		}
		j = skipDigits(sql, j)
	}
	if j < len(sql) && (isWordByte(sql[j]) || sql[j] == '.' || sql[j] >= 0x80) {
		return j, false
	}
	return j, true
}

func skipDigits(sql string, j int) int {
	for j < len(sql) && sql[j] >= '0' && sql[j] <= '9' {
		j++
	}
	return j
}

func isWordByte(c byte) bool {
	return c == '_' || c == '$' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}
