//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"testing"
)

// BenchmarkWriteOpenProtected is BenchmarkWriteOpen with the writable set
// a security team's policy makes (attempt.ProtectPaths): the leased
// directory split into its 200 files and sibling directories because one
// protected path sits in it, so the opened file is granted by a rule of
// its own among hundreds. Its guarded-µs/open beside BenchmarkWriteOpen's
// shows what protecting a path costs a write-open.
func BenchmarkWriteOpenProtected(b *testing.B) {
	helper := guardHelper(b)
	const opens = 20000
	w := newWorktree(b)
	p := w.policy()
	var writable []string
	for i := range 200 {
		f := filepath.Join(w.leased, fmt.Sprintf("f%03d.txt", i))
		if err := os.WriteFile(f, []byte("data"), 0o644); err != nil {
			b.Fatal(err)
		}
		writable = append(writable, f)
	}
	for i := range 20 {
		d := filepath.Join(w.leased, fmt.Sprintf("d%02d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			b.Fatal(err)
		}
		writable = append(writable, d)
	}
	if err := os.MkdirAll(filepath.Join(w.leased, ".github", "workflows"), 0o755); err != nil { // protected: not granted
		b.Fatal(err)
	}
	file := filepath.Join(w.leased, "mine.txt")
	p.Writable = append(writable, file)
	var guardedLoop, plainLoop, guarded, plain time.Duration
	for range b.N {
		d, loop := timeLoop(b, nil, helper, file, opens)
		plain, plainLoop = plain+d, plainLoop+loop
		d, loop = timeLoop(b, &p, helper, file, opens)
		guarded, guardedLoop = guarded+d, guardedLoop+loop
	}
	report(b, guarded, plain)
	b.ReportMetric(float64(plainLoop)/float64(b.N*opens)/1e3, "plain-µs/open")
	b.ReportMetric(float64(guardedLoop)/float64(b.N*opens)/1e3, "guarded-µs/open")
	b.ReportMetric(float64(guardedLoop-plainLoop)/float64(b.N*opens)/1e3, "overhead-µs/open")
}
