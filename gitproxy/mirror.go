// The mirror: the object stores a push builds on, and the per-upstream
// mirror fetched when the pushed history reaches objects they lack.

package gitproxy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"time"
)

func (p *Proxy) baseGitDirs(ps *push) []string {
	dirs := append([]string(nil), p.cfg.ObjectDirs...)
	if m := p.mirrorDir(ps); m != "" {
		dirs = append(dirs, m)
	}
	return dirs
}

// bases are the object stores a push builds on, opened once per push (each
// store loads its pack indexes on first use) and again after the mirror
// was fetched.
func (p *Proxy) bases(ps *push) layered {
	if ps.bases == nil {
		ps.bases = baseStores(p.baseGitDirs(ps))
	}
	return ps.bases
}

// mirrorDir is where the upstream repository of ps is mirrored, or "".
func (p *Proxy) mirrorDir(ps *push) string {
	if p.cfg.MirrorDir == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(p.upstream.String() + ps.repoPath))
	return filepath.Join(p.cfg.MirrorDir, hex.EncodeToString(sum[:8])+".git")
}

// refreshMirror fetches every ref of the upstream repository into its
// mirror, creating the mirror on first use.
func (p *Proxy) refreshMirror(ctx context.Context, ps *push) error {
	dir := p.mirrorDir(ps)
	if dir == "" {
		return errors.New("no mirror configured")
	}
	mu, _ := p.mirrorMu.LoadOrStore(dir, &sync.Mutex{})
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()
	if _, err := os.Stat(filepath.Join(dir, "objects")); err != nil {
		if _, err := p.git.run(ctx, dir, "init", "--quiet", "--bare", dir); err != nil {
			return err
		}
	}
	args := []string{}
	for k, vs := range p.cfg.UpstreamHeader {
		for _, v := range vs {
			args = append(args, "-c", "http.extraHeader="+k+": "+v)
		}
	}
	if p.cfg.UpstreamCAFile != "" {
		args = append(args, "-c", "http.sslCAInfo="+p.cfg.UpstreamCAFile)
	}
	// The credential goes to the repository's smart-HTTP endpoints only:
	// git follows no redirect with it (http.extraHeader would go along).
	args = append(args, "-c", "http.followRedirects=false")
	u := *p.upstream
	u.Path = ps.repoPath
	args = append(args, "fetch", "--quiet", "--no-tags", "--prune", u.String(), "+refs/*:refs/*")
	start := time.Now()
	_, err := p.git.run(ctx, dir, args...)
	ps.bases = nil // the mirror has new packs: reopen the stores
	p.log.Debug("mirror fetched", "mirror", dir, "took", time.Since(start), "err", err)
	return err
}
