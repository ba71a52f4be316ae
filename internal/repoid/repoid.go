// Package repoid is the one name of a repository that everything in
// fenceline uses for it: leases and their conflicts, run, sidecar, shard
// pools, the git hook, the UI and the audit. Two spellings of the same
// repository must name the same lease space, or a lease taken under one
// does not bind a push made under the other.
//
// The identity of a network remote is host/path: scheme, credentials, a
// default port, a trailing ".git" and slashes dropped, the host
// lower-cased, so
//
//	https://github.com/acme/payments.git
//	https://bot:token@GitHub.com/acme/payments
//	git@github.com:acme/payments.git
//	ssh://git@github.com:22/acme/payments
//	github.com/acme/payments
//
// are all github.com/acme/payments. A local checkout stands for its
// origin: its remote.origin.url's identity, else (no origin) the real path
// of its top directory. A local remote (a path or file:// URL) is its
// cleaned absolute path without ".git".
package repoid

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/fenceline/fenceline/internal/gitsafe"
)

// scpLike matches git's scp-like remote syntax, [user@]host:path.
var scpLike = regexp.MustCompile(`^(?:[^@/]+@)?([^:/]+):(.+)$`)

// hostPort matches an identity whose host has a port, host:port/path, as
// FromRemote writes it (git would read it as scp-like host:path, but a
// repository path that is a number is not one anybody names).
var hostPort = regexp.MustCompile(`^[^@/:]+:[0-9]+(/|$)`)

// defaultPorts are dropped from a remote's host: the same server either way.
var defaultPorts = map[string]string{"http": "80", "https": "443", "ssh": "22", "git": "9418", "git+ssh": "22", "ssh+git": "22"}

// FromRemote turns a git remote URL into a repository identity: host/path
// for network remotes, the cleaned absolute path (relative to base) for
// local ones.
func FromRemote(raw, base string) string {
	s := strings.TrimSpace(raw)
	var host, p string
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && strings.Contains(s, "://") {
		if u.Scheme == "file" {
			p = u.Path
		} else {
			host = strings.ToLower(u.Hostname())
			if port := u.Port(); port != "" && port != defaultPorts[strings.ToLower(u.Scheme)] {
				host += ":" + port
			}
			p = u.Path
		}
	} else if m := scpLike.FindStringSubmatch(s); m != nil && !strings.Contains(s, "://") {
		host, p = strings.ToLower(m[1]), m[2]
	} else {
		p = s
	}
	if host == "" {
		if !filepath.IsAbs(p) {
			p = filepath.Join(base, p)
		}
		p = filepath.Clean(p)
	}
	p = strings.TrimRight(p, "/")
	p = strings.TrimRight(strings.TrimSuffix(p, ".git"), "/")
	if host == "" {
		return p
	}
	return host + "/" + strings.TrimLeft(p, "/")
}

// Normalize is the identity of a repository named as typed, without
// looking at the disk: a URL or scp-like remote as FromRemote makes it, an
// absolute path cleaned, and an identity (host/org/repo) with its host
// lower-cased and a trailing ".git" and slashes dropped. It is idempotent:
// host:port/path is an identity with a port, not an scp-like remote.
func Normalize(s string) string {
	s = strings.TrimSpace(s)
	switch {
	case s == "":
		return ""
	case strings.Contains(s, "://"), scpLike.MatchString(s) && !hostPort.MatchString(s), filepath.IsAbs(s):
		return FromRemote(s, "/")
	}
	host, p, _ := strings.Cut(s, "/")
	p = strings.TrimRight(p, "/")
	p = strings.TrimRight(strings.TrimSuffix(p, ".git"), "/")
	if p == "" {
		return strings.ToLower(host)
	}
	return strings.ToLower(host) + "/" + p
}

// Resolve is the identity of a repository named on a command line: a
// directory that exists is a local checkout and stands for its origin
// (FromDir); anything else is a URL, a remote or an identity (Normalize).
func Resolve(ctx context.Context, s string) (string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return "", nil
	}
	if !strings.Contains(s, "://") {
		if fi, err := os.Stat(s); err == nil && fi.IsDir() {
			return FromDir(ctx, s)
		}
	}
	return Normalize(s), nil
}

// FromDir is the identity of the local checkout at dir: its origin's,
// else the real path of its top directory (of dir itself when it is no
// checkout). git runs through gitsafe: a checkout's configuration names no
// program that runs.
func FromDir(ctx context.Context, dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return "", fmt.Errorf("repository %s: %w", dir, err)
	}
	g := gitsafe.Git{Dir: abs}
	top, err := g.Output(ctx, "rev-parse", "--show-toplevel")
	if err != nil {
		return abs, nil // a plain directory: its path is the repo
	}
	if t, err := filepath.EvalSymlinks(strings.TrimSpace(top)); err == nil {
		abs = t
	}
	origin, err := g.Output(ctx, "config", "--get", "remote.origin.url")
	if err != nil || strings.TrimSpace(origin) == "" {
		return abs, nil
	}
	return FromRemote(origin, abs), nil
}

// Key is the subject token for a repo: the first 12 bytes of the SHA-256
// of its identity, in hex. Repo identities contain dots and slashes, which
// NATS subjects reserve. (leasebus.RepoKey; the shard records' keys.)
func Key(repo string) string {
	h := sha256.Sum256([]byte(repo))
	return hex.EncodeToString(h[:12])
}
