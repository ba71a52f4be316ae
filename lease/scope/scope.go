// Package scope normalizes the repo-relative path and table claims of
// fenceline leases and decides when two claims overlap.
//
// # Claims
//
// A Claim is what a lease claims repo-wide. Its path part is one of: a set
// of repo-relative paths (KindPaths), every path (KindWholeRepo), or nothing
// (KindNone). Independently of the path part it may claim Postgres tables,
// "schema.table" or "schema.*". Two claims overlap when their path parts
// overlap or their table parts overlap. A whole-repo claim overlaps every
// claim that has at least one path and every other whole-repo claim, but not
// the empty path part of a KindNone claim.
//
// A Claim built by New is in normal form: paths normalized, sorted
// (byte-wise), deduplicated, and none lying under another claimed path (the
// ancestor covers it); tables normalized, sorted, deduplicated, and none
// covered by a "schema.*" of the same claim. Paths and Tables are never nil
// and always encode as JSON arrays. Validate checks that a claim obtained
// elsewhere (for example decoded from a lease record) is in normal form.
//
// # Paths
//
// A path is repo-relative and '/'-separated. NormalizePath cleans it with
// path.Clean semantics ("." and ".." elements, duplicate and trailing
// slashes) and rejects, never clamps, anything that names the repository
// root, is absolute, escapes the root, contains a NUL byte or a backslash,
// is not valid UTF-8 (claims travel as JSON), or starts with the git
// directory ".git" (compared case-insensitively; the git dir is never
// claimable). Two paths overlap when they are equal or one is an ancestor of
// the other by whole components: "services/bill" does not overlap
// "services/billing".
//
// Case is kept as given and paths compare case-sensitively. On a
// case-insensitive filesystem (macOS and Windows defaults) "Src" and "src"
// are the same directory but different claims, so two leases could claim the
// same directory under different spellings. The file-write guard resolves
// real paths before it checks a write, but lease overlap is decided on the
// claimed spelling: operators should always claim paths in the repository's
// canonical case (the case git records in the index).
//
// # Tables
//
// A table is "schema.table" or "schema.*"; a bare relation name has no
// schema and is rejected. Identifiers follow Postgres rules: an unquoted
// identifier is folded to lower case (ASCII letters only, as Postgres does
// for UTF-8 databases) and may contain letters, digits, '_' and '$' (not
// first); a double-quoted identifier keeps its case and may contain any
// character but NUL (whitespace too, as in Postgres), with "" standing
// for one quote.
// Identifiers longer than 63 bytes (Postgres truncates them) are rejected.
//
// The normal form spells each identifier the one way that denotes it: bare
// when it needs no quotes (lower-case ASCII letters, digits, '_', '$' and
// non-ASCII characters, not starting with a digit or '$'), double-quoted
// otherwise. So `"users"` and `USERS` both normalize to `users`, while
// `"Users"` stays `"Users"` and a table literally named * is `"*"`, distinct
// from the wildcard. JoinTable builds the normal form from raw identifiers,
// such as those a SQL parser reports.
package scope

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// Kind is the kind of a claim's path part.
type Kind string

// The kinds of a claim's path part.
const (
	KindPaths     Kind = "paths"
	KindWholeRepo Kind = "whole-repo"
	KindNone      Kind = "none"
)

// wholeRepoItem names a whole-repo claim in Overlap and String.
const wholeRepoItem = "whole-repo"

// Claim is what a lease claims repo-wide. JSON:
// {"kind":"paths","paths":["a","b/c"],"tables":["public.users"]}.
// Paths and Tables are always present in JSON as arrays (never null),
// sorted and deduplicated. Decoding null or missing arrays leaves nil
// slices, which behave as empty.
type Claim struct {
	Kind   Kind     `json:"kind"`
	Paths  []string `json:"paths"`
	Tables []string `json:"tables"`
}

// New builds a claim in normal form from user input (--scope, --whole-repo
// and --table flags). With neither paths nor wholeRepo the claim's kind is
// KindNone. Paths that lie under another given path are dropped, as are
// tables covered by a "schema.*" of the same claim.
func New(paths []string, wholeRepo bool, tables []string) (Claim, error) {
	if wholeRepo && len(paths) > 0 {
		return Claim{}, errors.New("--whole-repo and --scope are exclusive; give one or the other")
	}
	c := Claim{Kind: KindNone, Paths: []string{}, Tables: []string{}}
	if wholeRepo {
		c.Kind = KindWholeRepo
	}
	if len(paths) > 0 {
		c.Kind = KindPaths
		set := make(map[string]bool, len(paths))
		for _, p := range paths {
			n, err := NormalizePath(p)
			if err != nil {
				return Claim{}, fmt.Errorf("invalid --scope: %w", err)
			}
			set[n] = true
		}
		for p := range set {
			if ancestorIn(p, set) == "" {
				c.Paths = append(c.Paths, p)
			}
		}
		sort.Strings(c.Paths)
	}
	set := make(map[string]bool, len(tables))
	for _, t := range tables {
		n, err := NormalizeTable(t)
		if err != nil {
			return Claim{}, fmt.Errorf("invalid --table: %w", err)
		}
		set[n] = true
	}
	for t := range set {
		if coveringWildcardIn(t, set) == "" {
			c.Tables = append(c.Tables, t)
		}
	}
	sort.Strings(c.Tables)
	return c, nil
}

// ancestorIn returns a strict ancestor of the normalized path p that is in
// set, or "" if there is none.
func ancestorIn(p string, set map[string]bool) string {
	for i := len(p) - 1; i > 0; i-- {
		if p[i] == '/' && set[p[:i]] {
			return p[:i]
		}
	}
	return ""
}

// coveringWildcardIn returns the "schema.*" in set that covers the
// normalized table t, or "" if there is none or t is itself a wildcard.
func coveringWildcardIn(t string, set map[string]bool) string {
	schema, rel, ok := splitTable(t)
	if !ok || rel == "*" {
		return ""
	}
	if w := schema + ".*"; set[w] {
		return w
	}
	return ""
}

// PathsOverlap reports whether two normalized paths overlap: they are equal
// or one is an ancestor of the other by whole components.
func PathsOverlap(a, b string) bool {
	return a == b || isUnder(a, b) || isUnder(b, a)
}

// isUnder reports whether p lies strictly under the directory dir.
func isUnder(p, dir string) bool {
	return len(p) > len(dir) && p[len(dir)] == '/' && strings.HasPrefix(p, dir)
}

// Overlaps reports whether c and o overlap: their path parts overlap or
// their table parts overlap. It is symmetric.
func (c Claim) Overlaps(o Claim) bool {
	if c.Kind == KindWholeRepo && (o.Kind == KindWholeRepo || len(o.Paths) > 0) ||
		o.Kind == KindWholeRepo && len(c.Paths) > 0 {
		return true
	}
	if c.Kind != KindWholeRepo && o.Kind != KindWholeRepo {
		for _, a := range c.Paths {
			for _, b := range o.Paths {
				if PathsOverlap(a, b) {
					return true
				}
			}
		}
	}
	for _, a := range c.Tables {
		for _, b := range o.Tables {
			if TablesOverlap(a, b) {
				return true
			}
		}
	}
	return false
}

// Overlap lists the overlapping items of c and o for people, each as
// "<item of c> ⟷ <item of o>", paths first, then tables; "whole-repo"
// stands for a whole-repo claim. It is empty (nil) when they do not overlap.
func (c Claim) Overlap(o Claim) []string {
	var out []string
	pair := func(a, b string) { out = append(out, a+" ⟷ "+b) }
	switch {
	case c.Kind == KindWholeRepo && o.Kind == KindWholeRepo:
		pair(wholeRepoItem, wholeRepoItem)
	case c.Kind == KindWholeRepo:
		for _, b := range o.Paths {
			pair(wholeRepoItem, b)
		}
	case o.Kind == KindWholeRepo:
		for _, a := range c.Paths {
			pair(a, wholeRepoItem)
		}
	default:
		for _, a := range c.Paths {
			for _, b := range o.Paths {
				if PathsOverlap(a, b) {
					pair(a, b)
				}
			}
		}
	}
	for _, a := range c.Tables {
		for _, b := range o.Tables {
			if TablesOverlap(a, b) {
				pair(a, b)
			}
		}
	}
	return out
}

// ContainsPath reports whether the normalized path p is inside c: c is
// whole-repo, or p equals or lies under one of c.Paths. It is false for a

// Equal reports whether c and o claim the same (both in normal form).
func (c Claim) Equal(o Claim) bool {
	return c.Kind == o.Kind && slicesEqual(c.Paths, o.Paths) && slicesEqual(c.Tables, o.Tables)
}

func slicesEqual(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// KindNone claim.
func (c Claim) ContainsPath(p string) bool {
	if c.Kind == KindWholeRepo {
		return true
	}
	for _, q := range c.Paths {
		if p == q || isUnder(p, q) {
			return true
		}
	}
	return false
}

// ContainsTable reports whether the normalized table t ("schema.table" or
// "schema.*") is inside c: a claimed table equals it or a claimed "schema.*"
// covers it.
func (c Claim) ContainsTable(t string) bool {
	schema, _, ok := splitTable(t)
	for _, ct := range c.Tables {
		if ct == t {
			return true
		}
		if s, rel, cok := splitTable(ct); ok && cok && rel == "*" && s == schema {
			return true
		}
	}
	return false
}

// IsZero reports whether c claims nothing at all: no paths, not whole-repo
// and no tables. The zero Claim is zero.
func (c Claim) IsZero() bool {
	return (c.Kind == KindNone || c.Kind == "") && len(c.Paths) == 0 && len(c.Tables) == 0
}

// String formats c for people: "[services/billing libs/tax]", "whole-repo"
// or "none", followed by " tables=[public.users]" when c claims tables.
func (c Claim) String() string {
	var s string
	switch {
	case c.Kind == KindWholeRepo:
		s = wholeRepoItem
	case len(c.Paths) > 0:
		s = "[" + strings.Join(c.Paths, " ") + "]"
	default:
		s = string(KindNone)
	}
	if len(c.Tables) > 0 {
		s += " tables=[" + strings.Join(c.Tables, " ") + "]"
	}
	return s
}

// Validate checks that c, built elsewhere (for example decoded from JSON),
// is in the normal form New produces: a known kind; paths present only for
// KindPaths, at least one of them, each normalized, sorted, unique and none
// under another; tables normalized, sorted, unique and none covered by a
// "schema.*" of the claim. A nil Paths or Tables counts as empty.
func (c Claim) Validate() error {
	switch c.Kind {
	case KindPaths:
		if len(c.Paths) == 0 {
			return errors.New("claim of kind paths lists no paths; use kind none to claim no paths")
		}
	case KindWholeRepo, KindNone:
		if len(c.Paths) > 0 {
			return fmt.Errorf("claim of kind %s lists paths %q; only kind paths may list paths", c.Kind, c.Paths)
		}
	default:
		return fmt.Errorf("claim kind %q is unknown; use paths, whole-repo or none", c.Kind)
	}
	set := make(map[string]bool, len(c.Paths))
	for i, p := range c.Paths {
		n, err := NormalizePath(p)
		if err != nil {
			return fmt.Errorf("invalid claim path: %w", err)
		}
		if n != p {
			return fmt.Errorf("claim path %q is not in normal form; write it as %q", p, n)
		}
		if i > 0 && c.Paths[i-1] >= p {
			return fmt.Errorf("claim paths are not sorted and unique: %q comes after %q", p, c.Paths[i-1])
		}
		set[p] = true
	}
	for _, p := range c.Paths {
		if a := ancestorIn(p, set); a != "" {
			return fmt.Errorf("claim path %q lies under claimed path %q; drop it", p, a)
		}
	}
	tset := make(map[string]bool, len(c.Tables))
	for i, t := range c.Tables {
		n, err := NormalizeTable(t)
		if err != nil {
			return fmt.Errorf("invalid claim table: %w", err)
		}
		if n != t {
			return fmt.Errorf("claim table %q is not in normal form; write it as %q", t, n)
		}
		if i > 0 && c.Tables[i-1] >= t {
			return fmt.Errorf("claim tables are not sorted and unique: %q comes after %q", t, c.Tables[i-1])
		}
		tset[t] = true
	}
	for _, t := range c.Tables {
		if w := coveringWildcardIn(t, tset); w != "" {
			return fmt.Errorf("claim table %q is covered by claimed %q; drop it", t, w)
		}
	}
	return nil
}

// MarshalJSON encodes c with paths and tables always as arrays, never null.
// It writes the JSON itself: claims are in every lease record and audit
// event, and reflection here showed in the lease bus's profile.
func (c Claim) MarshalJSON() ([]byte, error) {
	n := 32 + len(c.Kind)
	for _, p := range c.Paths {
		n += len(p) + 3
	}
	for _, t := range c.Tables {
		n += len(t) + 3
	}
	return c.AppendJSON(make([]byte, 0, n)), nil
}

// AppendJSON appends c's JSON to b, byte for byte what json.Marshal writes
// for c (hand-written encoders of records that embed a claim call it).
func (c Claim) AppendJSON(b []byte) []byte {
	b = append(b, `{"kind":`...)
	b = appendJSONString(b, string(c.Kind))
	b = appendJSONArray(append(b, `,"paths":`...), c.Paths)
	b = appendJSONArray(append(b, `,"tables":`...), c.Tables)
	return append(b, '}')
}

// plainJSON reports whether s is printable ASCII that JSON (HTML-safe, as
// Marshal writes it) keeps as it is.
func plainJSON(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20, c >= 0x7f, c == '"', c == '\\', c == '<', c == '>', c == '&':
			return false
		}
	}
	return true
}

func appendJSONArray(b []byte, ss []string) []byte {
	b = append(b, '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s)
	}
	return append(b, ']')
}

// appendJSONString appends s as a JSON string the way json.Marshal's output
// ends up: invalid UTF-8 becomes U+FFFD (normalized claims are valid
// UTF-8), and <, >, &, U+2028 and U+2029 are escaped as Marshal's
// HTML-safe compaction would escape them.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	if plainJSON(s) { // the common case: nothing to escape
		return append(append(b, s...), '"')
	}
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b = append(b, '\\', byte(r))
		case r == '\n':
			b = append(b, '\\', 'n')
		case r == '\r':
			b = append(b, '\\', 'r')
		case r == '\t':
			b = append(b, '\\', 't')
		case r < 0x20, r == '<', r == '>', r == '&':
			b = append(b, '\\', 'u', '0', '0', hex[r>>4], hex[r&0xf])
		case r == '\u2028' || r == '\u2029':
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
		default:
			b = utf8.AppendRune(b, r)
		}
	}
	return append(b, '"')
}
