//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The benchmarks run each workload side by side, guarded and unguarded, in
// the same iteration, and report both wall times and their ratio (the
// floor: guarded/unguarded <= 1.3). scripts/bench-fsguard.sh runs them.

// BenchmarkCreateFiles: a static binary creates and writes 20,000 small
// files in its leased directory.
func BenchmarkCreateFiles(b *testing.B) {
	helper := guardHelper(b)
	const files = 20000
	w := newWorktree(b)
	p := w.policy()
	var guarded, plain time.Duration
	for i := range b.N {
		dir := filepath.Join(w.leased, fmt.Sprintf("g%d", i))
		for _, d := range []string{dir, dir + "-plain"} {
			if err := os.Mkdir(d, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		// Alternate which goes first: the file system's state (journal,
		// writeback) favours neither.
		if i%2 == 0 {
			plain += timeRun(b, nil, helper, "create", dir+"-plain", strconv.Itoa(files))
			guarded += timeRun(b, &p, helper, "create", dir, strconv.Itoa(files))
		} else {
			guarded += timeRun(b, &p, helper, "create", dir, strconv.Itoa(files))
			plain += timeRun(b, nil, helper, "create", dir+"-plain", strconv.Itoa(files))
		}
		for _, d := range []string{dir, dir + "-plain"} {
			if err := os.RemoveAll(d); err != nil {
				b.Fatal(err)
			}
		}
	}
	report(b, guarded, plain)
	b.ReportMetric(float64(guarded-plain)/float64(b.N*files)/1e3, "overhead-µs/file")
}

// BenchmarkWriteOpen: open an existing leased file for writing and close
// it, 20,000 times; the difference is the guard's cost per write-open (one
// seccomp round trip to the supervisor plus Landlock's check).
func BenchmarkWriteOpen(b *testing.B) {
	helper := guardHelper(b)
	const opens = 20000
	w := newWorktree(b)
	p := w.policy()
	file := filepath.Join(w.leased, "mine.txt")
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

// BenchmarkGitCheckout: the real git switches a 5,000-file tree between two
// commits in an exclusive workspace (its whole tree and git dir writable).
func BenchmarkGitCheckout(b *testing.B) {
	const files = 5000
	w := newWorktree(b)
	git := func(args ...string) {
		cmd := exec.Command("git", args...)
		cmd.Dir = w.root
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	writeTree := func(gen string) {
		for i := range files {
			d := filepath.Join(w.root, "src", strconv.Itoa(i%50))
			os.MkdirAll(d, 0o755)
			if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%d.txt", i)), []byte(strings.Repeat(gen+" line\n", 20)), 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	git("init", "-q", "-b", "main")
	writeTree("one")
	git("add", "-A")
	git("-c", "user.name=b", "-c", "user.email=b@example.com", "commit", "-qm", "one")
	git("tag", "one")
	writeTree("two")
	git("-c", "user.name=b", "-c", "user.email=b@example.com", "commit", "-qam", "two")
	git("tag", "two")
	git("checkout", "-q", "--detach", "one")
	p := w.policy()
	p.Writable = []string{w.root}
	p.GitDirWritable = true
	var guarded, plain time.Duration
	for range b.N {
		plain += timeRunDir(b, nil, w.root, "git", "checkout", "-q", "two")
		guarded += timeRunDir(b, &p, w.root, "git", "checkout", "-q", "one")
		plain += timeRunDir(b, nil, w.root, "git", "checkout", "-q", "two")
		guarded += timeRunDir(b, &p, w.root, "git", "checkout", "-q", "one")
	}
	report(b, guarded, plain)
}

func report(b *testing.B, guarded, plain time.Duration) {
	b.ReportMetric(guarded.Seconds()/float64(b.N), "guarded-s")
	b.ReportMetric(plain.Seconds()/float64(b.N), "unguarded-s")
	b.ReportMetric(float64(guarded)/float64(plain), "ratio")
}

func timeRun(b *testing.B, p *Policy, name string, args ...string) time.Duration {
	return timeRunDir(b, p, "/", name, args...)
}

// timeRunDir runs the command to completion (whole tree settled when
// guarded) and returns its wall time; p == nil runs it unguarded.
func timeRunDir(b *testing.B, p *Policy, dir, name string, args ...string) time.Duration {
	b.Helper()
	syscall.Sync() // start each run with no writeback of the previous one pending
	start := time.Now()
	var out string
	var code int
	if p == nil {
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		o, err := cmd.CombinedOutput()
		out = string(o)
		if err != nil {
			code = -1
		}
	} else {
		r := runGuarded(b, *p, &testGate{}, dir, name, args...)
		out, code = r.out, r.code
	}
	d := time.Since(start)
	if code != 0 {
		b.Fatalf("%s %v (guarded=%v): exit %d %s", name, args, p != nil, code, out)
	}
	return d
}

// timeLoop runs the helper's openloop and returns wall time and the time
// the loop itself measured.
func timeLoop(b *testing.B, p *Policy, helper, file string, n int) (time.Duration, time.Duration) {
	b.Helper()
	start := time.Now()
	var out string
	if p == nil {
		o, err := exec.Command(helper, "openloop", file, strconv.Itoa(n)).CombinedOutput()
		if err != nil {
			b.Fatalf("openloop: %v %s", err, o)
		}
		out = string(o)
	} else {
		r := runGuarded(b, *p, &testGate{}, "/", helper, "openloop", file, strconv.Itoa(n))
		if r.code != 0 {
			b.Fatalf("guarded openloop: exit %d %s", r.code, r.out)
		}
		out = r.out
	}
	wall := time.Since(start)
	ns, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		b.Fatalf("openloop output %q: %v", out, err)
	}
	return wall, time.Duration(ns)
}
