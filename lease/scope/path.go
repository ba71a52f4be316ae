package scope

import (
	"fmt"
	"path"
	"strings"
	"unicode/utf8"
)

// NormalizePath returns the normal form of a repo-relative path claim:
// '/'-separated and cleaned with path.Clean semantics, case kept. It
// rejects, with an error naming p, a path that is empty or names the
// repository root, is absolute, escapes the root after cleaning, contains a
// NUL byte or a backslash, is not valid UTF-8, or lies in the git directory.
func NormalizePath(p string) (string, error) {
	switch {
	case p == "":
		return "", fmt.Errorf("path %q is empty; name a directory or file below the repository root, or use --whole-repo to claim everything", p)
	case strings.IndexByte(p, 0) >= 0:
		return "", fmt.Errorf("path %q contains a NUL byte; remove it", p)
	case strings.IndexByte(p, '\\') >= 0:
		return "", fmt.Errorf("path %q contains a backslash; use / separators", p)
	case !utf8.ValidString(p):
		return "", fmt.Errorf("path %q is not valid UTF-8; name it in UTF-8", p)
	case p[0] == '/':
		return "", fmt.Errorf("path %q is absolute; give it relative to the repository root", p)
	}
	c := path.Clean(p)
	switch {
	case c == ".":
		return "", fmt.Errorf("path %q names the repository root; a path claim must name something below it, use --whole-repo to claim everything", p)
	case c == ".." || strings.HasPrefix(c, "../"):
		return "", fmt.Errorf("path %q escapes the repository root; name a path inside the repository", p)
	}
	first, _, _ := strings.Cut(c, "/")
	if strings.EqualFold(first, ".git") {
		return "", fmt.Errorf("path %q is in the git directory, which is never claimable; name a path in the working tree", p)
	}
	return c, nil
}
