package demo

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/gitsafe"
	"github.com/fenceline/fenceline/shard"
)

// demoRun is one "fenceline run" (or shard commit) of the shard story,
// in-process against the demo bus.
type demoRun struct {
	name        string
	out, errOut syncBuffer
	done        chan int
	code        int
}

// syncBuffer is a bytes.Buffer safe for a writer and a poller: a run
// writes it while the story (or a test) reads it.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// demoShards is the shard part of the story: real worktrees, real agents
// under the file-write guard.
type demoShards struct {
	*demo
	url, dir, ctl, co string
	unguarded         bool
	wg                sync.WaitGroup
	runs              []*demoRun
}

// start runs "fenceline <args>" for name in the background.
func (s *demoShards) start(ctx context.Context, name string, args ...string) *demoRun {
	r := &demoRun{name: name, done: make(chan int, 1)}
	full := append([]string{"--nats", s.url, "--creds", s.creds}, args...)
	if i := indexOf(full, "--"); i > 0 {
		extra := []string{"--agent", name, "--state-dir", filepath.Join(s.dir, "state", name), "--allow-write", s.ctl}
		if s.unguarded {
			extra = append(extra, "--allow-unguarded")
		}
		full = append(full[:i:i], append(extra, full[i:]...)...)
	}
	s.runs = append(s.runs, r)
	s.wg.Go(func() {
		r.done <- s.cfg.Command(ctx, full, &r.out, &r.errOut)
	})
	return r
}

func indexOf(ss []string, s string) int {
	for i, x := range ss {
		if x == s {
			return i
		}
	}
	return -1
}

// wait returns the run's exit status.
func (r *demoRun) wait(ctx context.Context) (int, error) {
	select {
	case code := <-r.done:
		r.code = code
		r.done <- code
		return code, nil
	case <-ctx.Done():
		return 0, fmt.Errorf("%s did not finish: %w\n%s", r.name, ctx.Err(), r.errOut.String())
	}
}

// awaitFile waits until a file the agents write into the control dir exists.
func (s *demoShards) awaitFile(ctx context.Context, r *demoRun, name string) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := os.Stat(filepath.Join(s.ctl, name)); err == nil {
			return nil
		}
		select {
		case code := <-r.done:
			r.done <- code
			return fail("%s ended (exit %d) before %s:\n%s", r.name, code, name, r.errOut.String())
		case <-ctx.Done():
			return fail("%s: no %s: %v\n%s", r.name, name, ctx.Err(), r.errOut.String())
		case <-tick.C:
		}
	}
}

// awaitText waits until a run's stderr says want.
func (s *demoShards) awaitText(ctx context.Context, r *demoRun, want string) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !strings.Contains(r.errOut.String(), want) {
		select {
		case <-ctx.Done():
			return fail("%s should say %q: %v\n%s", r.name, want, ctx.Err(), r.errOut.String())
		case <-tick.C:
		}
	}
	return nil
}

func (s *demoShards) stop(name string) error {
	return os.WriteFile(filepath.Join(s.ctl, "stop-"+name), nil, 0o644)
}

// agent is an agent's script: do its work, say ready, wait for stop.
func (s *demoShards) agent(name, work string) string {
	return fmt.Sprintf("%s\ntouch %s/ready-%s\nwhile [ ! -e %s/stop-%s ]; do sleep 0.02; done", work, s.ctl, name, s.ctl, name)
}

var demoPlacedRE = regexp.MustCompile(`attempt (att_[a-z0-9]+) in (shard-\d+) \(([^)]*)\)`)

// placement is what a run said about where it went.
func placement(r *demoRun) (attempt, shardID, how string) {
	m := demoPlacedRE.FindStringSubmatch(r.errOut.String())
	if m == nil {
		return "", "", ""
	}
	return m[1], m[2], m[3]
}

func (d *demo) shardStory(ctx context.Context, dir, url string) (err error) {
	d.section("9. A pool of worktree shards")
	s := &demoShards{demo: d, url: url, dir: filepath.Join(dir, "shards"), ctl: filepath.Join(dir, "shards", "ctl")}
	if _, gerr := fsguard.Available(); gerr != nil {
		s.unguarded = true
		fmt.Fprintf(d.out, "(no Landlock here: the agents run with --allow-unguarded; %v)\n", gerr)
	}
	if err := os.MkdirAll(s.ctl, 0o755); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer func() {
		for _, r := range s.runs {
			s.stop(r.name)
		}
		if err != nil {
			cancel() // SIGTERM to what still runs
		}
		s.wg.Wait()
		cancel()
	}()

	s.co = filepath.Join(s.dir, "payments")
	for _, f := range []string{"services/billing/invoice.go", "services/ledger/ledger.go", "libs/tax/rates.go", "README.md"} {
		p := filepath.Join(s.co, filepath.FromSlash(f))
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte("// "+f+"\n"), 0o644); err != nil {
			return err
		}
	}
	for _, args := range [][]string{{"init", "-q", "-b", "main"}, {"add", "-A"}, {"-c", "user.name=demo", "-c", "user.email=demo@localhost", "commit", "-q", "-m", "seed"}} {
		if _, err := (gitsafe.Git{Dir: s.co}).Output(ctx, args...); err != nil {
			return err
		}
	}
	var out syncBuffer
	if code := d.cfg.Command(ctx, []string{"--nats", url, "--creds", d.creds, "shard", "pool", "--checkout", s.co, "--size", "2", "--max-sharers", "3"}, &out, &out); code != 0 {
		return fail("shard pool should be declared: exit %d\n%s", code, out.String())
	}
	fmt.Fprintf(d.out, "fenceline shard pool --checkout %s --size 2 --max-sharers 3\n", s.co)
	fmt.Fprintln(d.out, "  (shards are repositories of their own in payments.shards/, borrowing the checkout's objects, made by the first attempt placed in each)")

	fmt.Fprintln(d.out, "three agents with path leases start at once:")
	sharers := map[string]string{"agent-billing": "services/billing", "agent-ledger": "services/ledger", "agent-tax": "libs/tax"}
	names := []string{"agent-billing", "agent-ledger", "agent-tax"}
	byName := map[string]*demoRun{}
	for _, n := range names {
		byName[n] = s.start(runCtx, n, "run", "--checkout", s.co, "--scope", sharers[n], "--",
			"sh", "-c", s.agent(n, "echo '// work of "+n+"' >> "+sharers[n]+"/new.go"))
	}
	for _, n := range names {
		if err := s.awaitFile(ctx, byName[n], "ready-"+n); err != nil {
			return err
		}
	}
	seen := map[string]bool{}
	for _, n := range names {
		att, sh, how := placement(byName[n])
		seen[sh] = true
		fmt.Fprintf(d.out, "  %-13s [%s] -> %s (%s), attempt %s\n", n, sharers[n], sh, how, att)
	}
	if len(seen) != 1 {
		return fail("the three disjoint path leases should share one shard, got %v", seen)
	}
	fmt.Fprintln(d.out, "  disjoint claims share one shard; the other stays empty for exclusive work.")

	fmt.Fprintln(d.out, "agent-build (exclusive: no claim) takes the empty shard and commits there;")
	build := s.start(runCtx, "agent-build", "run", "--checkout", s.co, "--",
		"sh", "-c", s.agent("agent-build", "echo built > build.log && git add -A && git -c user.name=build -c user.email=build@localhost commit -qm build"))
	if err := s.awaitFile(ctx, build, "ready-agent-build"); err != nil {
		return err
	}
	_, buildShard, _ := placement(build)
	fmt.Fprintf(d.out, "  agent-build -> %s\n", buildShard)
	fmt.Fprintln(d.out, "agent-refactor (exclusive) asks with --wait 20s: no shard is free, so it queues ...")
	refactor := s.start(runCtx, "agent-refactor", "run", "--checkout", s.co, "--wait", "20s", "--",
		"sh", "-c", "ls -A | tr '\\n' ' ' > "+s.ctl+"/refactor-saw")
	if err := s.awaitText(ctx, refactor, "waiting up to"); err != nil {
		return err
	}
	if strings.Contains(refactor.errOut.String(), "acquired") {
		return fail("agent-refactor should wait while every shard is busy:\n%s", refactor.errOut.String())
	}
	t0 := time.Now()
	s.stop("agent-build")
	if code, err := build.wait(ctx); err != nil || code != 0 {
		return fail("agent-build should succeed: exit %d, %v\n%s", code, err, build.errOut.String())
	}
	if code, err := refactor.wait(ctx); err != nil || code != 0 {
		return fail("agent-refactor should run once agent-build is done: exit %d, %v\n%s", code, err, refactor.errOut.String())
	}
	kept := regexp.MustCompile(`refs/fenceline/attempts/att_[a-z0-9]+`).FindString(build.errOut.String())
	_, refShard, refHow := placement(refactor)
	saw, _ := os.ReadFile(filepath.Join(s.ctl, "refactor-saw"))
	fmt.Fprintf(d.out, "  agent-build ends; %s is cleaned (its commit kept as %s) and released\n", buildShard, kept)
	fmt.Fprintf(d.out, "  agent-refactor -> %s (%s) %.1fs later; it sees only the base: %s\n", refShard, refHow, time.Since(t0).Seconds(), strings.TrimSpace(string(saw)))
	if refShard != buildShard || kept == "" || strings.Contains(string(saw), "build.log") {
		return fail("agent-refactor should get agent-build's shard cleaned (saw %q, kept %q)", saw, kept)
	}

	sharedShard := ""
	for sh := range seen {
		sharedShard = sh
	}
	fmt.Fprintf(d.out, "the coordinator commits the path leases' work in %s while they keep working:\n", sharedShard)
	fmt.Fprintf(d.out, "  fenceline shard commit --checkout %s --shard %s --serialized -- git commit ...\n", s.co, sharedShard)
	commit := s.start(runCtx, "coordinator", "shard", "commit", "--checkout", s.co, "--shard", sharedShard, "--serialized", "--",
		"sh", "-c", "git add -A && git -c user.name=coordinator -c user.email=c@localhost commit -qm 'agents work' && git show --stat --format=%s HEAD | grep -c new.go")
	if code, err := commit.wait(ctx); err != nil || code != 0 {
		return fail("the coordinator's serialized commit should succeed: exit %d, %v\n%s", code, err, commit.errOut.String())
	}
	if n := strings.TrimSpace(commit.out.String()); n != "3" {
		return fail("the coordinator's commit should hold the three agents' files, holds %s", n)
	}
	fmt.Fprintf(d.out, "  committed the 3 agents' files on fenceline/%s (git dir writable, worktree files read-only to it)\n", sharedShard)
	for _, n := range names {
		s.stop(n)
		if code, err := byName[n].wait(ctx); err != nil || code != 0 {
			return fail("%s should succeed: exit %d, %v", n, code, err)
		}
	}
	out = syncBuffer{}
	if code := d.cfg.Command(ctx, []string{"--nats", url, "--creds", d.creds, "shard", "list", "--repo", s.co}, &out, &out); code != 0 {
		return fail("shard list: exit %d\n%s", code, out.String())
	}
	fmt.Fprintln(d.out, "fenceline shard list:")
	for _, l := range strings.Split(strings.TrimRight(out.String(), "\n"), "\n") {
		fmt.Fprintln(d.out, "  "+l)
	}
	if c := strings.Count(out.String(), string(shard.StatusSucceeded)); c != 6 {
		return fail("six attempts should have succeeded, shard list shows %d", c)
	}
	return nil
}
