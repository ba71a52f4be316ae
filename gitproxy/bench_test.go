package gitproxy

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// BenchmarkPush pushes a commit that rewrites 100 files of a 2,000-file
// tree, directly to git http-backend and through the fence (in-process),
// side by side: compare the two ns/op.
func BenchmarkPush(b *testing.B) {
	bus := bustest.Start(b)
	srv, err := gitserver.Start(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Close() })
	l := bus.Acquire(b, leasebus.AcquireRequest{Repo: testRepo, Scope: bustest.Claim(b, "*"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(300e9)}, leasebus.HoldOptions{})
	work := filepath.Join(b.TempDir(), "work")
	mustGit(b, "", "init", "--quiet", "--initial-branch=main", work)
	files := make([]string, 0, 4000)
	for i := range 2000 {
		files = append(files, fmt.Sprintf("pkg%02d/file%04d.txt", i%40, i), fmt.Sprintf("%d\n%0512d\n", i, i))
	}
	writeCommit(b, work, files...)
	p, err := New(Config{Upstream: srv.URL, Lease: l, Repo: testRepo, Bus: bus.Client, Audit: bus.Auditor,
		ObjectDirs: []string{filepath.Join(work, ".git")}, TempDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	fence := serve(b, p)
	for _, mode := range []struct{ name, base string }{{"direct", srv.URL}, {"fenced", fence}} {
		b.Run(mode.name, func(b *testing.B) {
			name := "bench-" + mode.name + ".git"
			if _, err := srv.NewRepo(name); err != nil {
				b.Fatal(err)
			}
			url := mode.base + "/" + name
			mustGit(b, work, "push", "--quiet", url, "main")
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				change := make([]string, 0, 200)
				for k := range 100 {
					change = append(change, fmt.Sprintf("pkg%02d/file%04d.txt", k%40, (i*100+k)%2000), fmt.Sprintf("%s %d %d\n", mode.name, i, k))
				}
				writeCommit(b, work, change...)
				b.StartTimer()
				mustGit(b, work, "push", "--quiet", url, "main")
			}
		})
	}
}

// writeCommit writes (path, content) pairs in work and commits them.
func writeCommit(b testing.TB, work string, files ...string) {
	b.Helper()
	for i := 0; i+1 < len(files); i += 2 {
		writeFile(b, work, files[i], files[i+1])
	}
	mustGit(b, work, "add", "-A")
	mustGit(b, work, "commit", "--quiet", "-m", "bench")
}
