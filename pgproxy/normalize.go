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
		case c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v':
			// A run with a newline keeps it: two string constants with
			// only a newline between them are one constant.
			ws := byte(' ')
			for i < len(sql) && (sql[i] == ' ' || sql[i] == '\t' || sql[i] == '\n' || sql[i] == '\r' || sql[i] == '\f' || sql[i] == '\v') {
				if sql[i] == '\n' || sql[i] == '\r' {
					ws = '\n'
				}
				i++
			}
			b = append(b, ws)
		case c == '\'':
			j := i + 1
			for {
				if j >= len(sql) {
					return b, false
				}
				if sql[j] == '\\' || sql[j] >= 0x80 || sql[j] < ' ' && sql[j] != '\t' && sql[j] != '\n' && sql[j] != '\r' {
					// A backslash (an escape when standard_conforming_strings
					// is off), a byte of a multibyte character (which may be
					// invalid) or a control byte: the exact text decides.
					return b, false
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
				return b, false // E'...', U&'...', B'...', X'...'
			}
			b = append(b, '?')
			i = j + 1
		case c >= '0' && c <= '9':
			if i > 0 && isWordByte(sql[i-1]) {
				b = append(b, c) // part of an identifier or $1
				i++
				continue
			}
			// A plain decimal constant: digits, a fraction, an exponent.
			// Anything else glued to it (1into, 0x1F, 1_000, 1.2.3) may
			// change how the statement parses: the exact text decides.
			j := i
			digits := func() {
				for j < len(sql) && sql[j] >= '0' && sql[j] <= '9' {
					j++
				}
			}
			digits()
			if j < len(sql) && sql[j] == '.' {
				j++
				digits()
			}
			if j < len(sql) && (sql[j] == 'e' || sql[j] == 'E') {
				j++
				if j < len(sql) && (sql[j] == '+' || sql[j] == '-') {
					j++
				}
				if j >= len(sql) || sql[j] < '0' || sql[j] > '9' {
					return b, false
				}
				digits()
			}
			if j < len(sql) && (isWordByte(sql[j]) || sql[j] == '.' || sql[j] >= 0x80) {
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
				switch first {
				case "select", "insert", "update", "delete", "with", "values", "table":
				default:
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

func isWordByte(c byte) bool {
	return c == '_' || c == '$' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}
