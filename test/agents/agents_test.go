//go:build integration

package agents

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/fenceline/fenceline/internal/testutil"
	"golang.org/x/sys/unix"
)

// noLandlockEnv makes the test binary a wrapper that execs its arguments
// with landlock_create_ruleset failing ENOSYS (a kernel without Landlock):
// the guard-off run's fenceline then runs the agent unguarded.
const noLandlockEnv = "AGENTS_E2E_NO_LANDLOCK"

func TestMain(m *testing.M) {
	if os.Getenv(noLandlockEnv) == "1" && len(os.Args) > 1 {
		execWithoutLandlock(os.Args[1:])
	}
	code := testutil.Run(m)
	if flBin != "" {
		os.RemoveAll(filepath.Dir(flBin)) // the built fenceline, the wrapper, copied CLIs
	}
	os.Exit(code)
}

// execWithoutLandlock installs a seccomp filter answering the Landlock
// calls with ENOSYS and execs argv; it never returns.
func execWithoutLandlock(argv []string) {
	runtime.LockOSThread()
	const enosys = 38
	arch := uint32(unix.AUDIT_ARCH_X86_64)
	if runtime.GOARCH == "arm64" {
		arch = unix.AUDIT_ARCH_AARCH64
	}
	// The Landlock calls have the same numbers on every architecture.
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 4}, // arch
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: arch, Jt: 1, Jf: 0},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | enosys}, // a foreign ABI: nothing
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0},                 // nr
		{Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, K: unix.SYS_LANDLOCK_CREATE_RULESET, Jt: 0, Jf: 2},
		{Code: unix.BPF_JMP | unix.BPF_JGT | unix.BPF_K, K: unix.SYS_LANDLOCK_RESTRICT_SELF, Jt: 1, Jf: 0},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | enosys},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		fmt.Fprintln(os.Stderr, "no_new_privs:", err)
		os.Exit(126)
	}
	if _, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(unsafe.Pointer(&prog))); errno != 0 {
		fmt.Fprintln(os.Stderr, "seccomp:", errno)
		os.Exit(126)
	}
	env := []string{}
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, noLandlockEnv+"=") {
			env = append(env, e)
		}
	}
	err := syscall.Exec(argv[0], argv, env)
	fmt.Fprintln(os.Stderr, "exec:", err)
	os.Exit(127)
}

// mode is how an agent is run: under "fenceline run", in a pod
// ("fenceline sidecar" + "fenceline agent"), or under "fenceline run" on a
// kernel without Landlock (--allow-unguarded: the guard is off).
type mode string

const (
	modeRun       mode = "run"
	modePod       mode = "pod"
	modeUnguarded mode = "guard-off"
)

// verdict is one of issue 21's six steps for one agent.
type verdict struct {
	Step string
	OK   bool
	Why  string
}

// story is one agent's run: what the model saw and fenceline did.
type story struct {
	w       *world
	agent   string
	mode    mode
	code    int
	logs    string // run's stderr, or the sidecar's and the wrapper's
	stdout  string
	results []string
	// agentCode is the status the CLI exited with (-1: unknown).
	agentCode int
}

// runStory runs agent through the whole script in one run.
func runStory(t *testing.T, agent string, md mode) *story {
	t.Helper()
	w := newWorld(t)
	// The agent is the CLI itself; a shell in front of it only tells the
	// test the status the CLI exited with, to compare with fenceline's.
	argv := append([]string{"/bin/sh", "-c", `"$0" "$@"; s=$?; echo "agents-e2e: the agent exited $s" >&2; exit $s`}, w.agentArgv(t, agent)...)
	// The model's API key is the sidecar's alone: the agent holds a
	// placeholder, the egress proxy adds the key (issue 31).
	w.model.Key = modelKey
	fences := []string{"--git-upstream", w.upstream,
		"--pg-upstream", w.pg.Addr(), "--table", "billing.invoices",
		"--inject-header-file", w.modelHost() + "=" + w.keyFile(t), "--egress-ca", w.caFile,
		"--egress-resolve", w.modelHost() + "=127.0.0.1:" + w.modelPt,
		"--egress-resolve", forbidden + ":443=127.0.0.1:" + w.modelPt}
	claim := []string{"--scope", "services/billing", "--workspace", "exclusive"}
	env := w.agentEnv("OPENAI_API_KEY=placeholder", "ANTHROPIC_API_KEY=placeholder")
	s := &story{w: w, agent: agent, mode: md}
	const bound = 4 * time.Minute
	start := time.Now()
	switch md {
	case modeRun, modeUnguarded:
		args := append([]string{w.fl, "--nats", w.busURL, "run", "--checkout", w.co, "--ttl", "2m"}, w.stateFlags(agent)...)
		args = append(args, claim...)
		args = append(args, fences...)
		if md == modeUnguarded {
			args = append(args, "--allow-unguarded")
		}
		args = append(append(args, "--"), argv...)
		if md == modeUnguarded {
			args = append([]string{wrapperBin(t)}, args...)
			env = append(env, noLandlockEnv+"=1")
		}
		logs := &testutil.SyncBuffer{}
		w.model.Hooks = map[string]func(context.Context) error{"revoke": w.revokeHook(logs, "LEASE LOST")}
		p := w.start(w.co, env, logs, args...)
		s.code = p.wait(t, bound)
		s.logs, s.stdout = p.errOut.String(), p.out.String()
	case modePod:
		sargs := append([]string{w.fl, "--nats", w.busURL, "sidecar", "--repo", w.repoKey(), "--ttl", "2m",
			"--state-dir", filepath.Join(w.base, "sidecar")}, claim...)
		sargs = append(sargs, fences...)
		logs := &testutil.SyncBuffer{}
		sc := w.start(w.base, env, logs, sargs...)
		if err := waitFor(t.Context(), 30*time.Second, func() error {
			if !strings.Contains(sc.out.String(), "agent environment:") {
				return fmt.Errorf("the sidecar has no lease yet\nstdout:\n%s\nstderr:\n%s", sc.out, sc.errOut)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`admin: (http://\S+)`).FindStringSubmatch(sc.out.String())
		if m == nil {
			t.Fatalf("no admin URL from the sidecar:\n%s", sc.out)
		}
		w.model.Hooks = map[string]func(context.Context) error{"revoke": w.revokeHook(logs, `"state":"lost"`)}
		aargs := append([]string{w.fl, "agent", "--log-format", "text", "--sidecar", m[1], "--checkout", w.co,
			"--allow-host", w.modelHost()}, w.stateFlags(agent)...)
		aargs = append(append(aargs, "--"), argv...)
		a := w.start(w.co, env, logs, aargs...)
		s.code = a.wait(t, bound)
		syscall.Kill(sc.cmd.Process.Pid, syscall.SIGTERM)
		sc.wait(t, time.Minute)
		s.logs = "sidecar:\n" + sc.out.String() + sc.errOut.String() + "\nagent wrapper:\n" + a.errOut.String()
		t.Logf("pod logs:\n%s", s.logs)
		s.stdout = a.out.String()
	}
	s.results = w.model.Results()
	s.agentCode = -1
	if m := regexp.MustCompile(`agents-e2e: the agent exited (\d+)`).FindStringSubmatch(s.logs); m != nil {
		s.agentCode, _ = strconv.Atoi(m[1])
	}
	t.Logf("%s (%s) took %s, %d model requests", agent, md, time.Since(start).Round(time.Millisecond), w.model.Requests())
	return s
}

// marker is the value of "STEP key=value" in out.
func marker(out, key string) string {
	i := strings.Index(out, "STEP "+key+"=")
	if i < 0 {
		return ""
	}
	return strings.Fields(out[i+len("STEP "+key+"="):])[0]
}

// gist keeps the lines of a tool result that matter to a verdict.
func gist(out string) string {
	var keep []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "STEP ") || strings.Contains(l, "denied") || strings.Contains(l, "fenceline") ||
			strings.Contains(l, "403") || strings.Contains(l, "rror") || strings.Contains(l, "fatal") {
			keep = append(keep, strings.TrimSpace(l))
		}
	}
	return strings.Join(keep, " | ")
}

// judge decides the six steps from what the agent reported to the model
// and what landed where.
func (s *story) judge(t *testing.T) []verdict {
	t.Helper()
	w, r := s.w, s.results
	// res is the gist of step i's tool result: its STEP markers and the
	// lines that say why (the whole result is logged when a step fails).
	res := func(i int) string { return gist(r[i]) }
	var vs []verdict
	add := func(step string, why ...string) {
		var bad []string
		for _, y := range why {
			if y != "" {
				bad = append(bad, y)
			}
		}
		vs = append(vs, verdict{Step: step, OK: len(bad) == 0, Why: strings.Join(bad, "; ")})
	}
	want := func(cond bool, msg string, args ...any) string {
		if cond {
			return ""
		}
		return fmt.Sprintf(msg, args...)
	}
	invoice, _ := os.ReadFile(filepath.Join(w.co, "services/billing/invoice.go"))
	rates, _ := os.ReadFile(filepath.Join(w.co, "libs/tax/rates.go"))

	add("1 in-claim edit lands",
		want(marker(res(0), "edit") == "landed", "the agent saw %q", res(0)),
		want(strings.Contains(string(invoice), "edited by the agent"), "invoice.go: %q", invoice))
	add("2 out-of-claim write refused, agent carries on",
		want(marker(res(1), "outside") == "refused" && strings.Contains(res(1), "Permission denied"), "the agent saw %q", res(1)),
		want(string(rates) == "package tax\n", "libs/tax/rates.go: %q", rates),
		want(res(2) != "", "the agent did not go on"))
	up := w.upstreamSubject(t)
	add("3 in-scope push lands, out-of-scope push refused with fenceline's reason",
		want(marker(res(2), "push") == "landed", "in-scope push: the agent saw %q", res(2)),
		want(marker(res(3), "outpush") == "refused" && strings.Contains(res(3), "libs/tax/rates.go is outside lease"), "out-of-scope push: the agent saw %q", res(3)),
		want(up == "agent: in scope", "upstream main is %q, want the in-scope commit", up))
	claimed, unclaimed := w.pgCount(t, "billing.invoices"), w.pgCount(t, "ledger.entries")
	add("4 psql: claimed table lands, unclaimed refused",
		want(marker(res(4), "pgclaimed") == "landed" && claimed == 1, "claimed: the agent saw %q, %d rows", res(4), claimed),
		want(marker(res(5), "pgunclaimed") == "refused" && unclaimed == 0 && strings.Contains(res(5), "ledger.entries"), "unclaimed: the agent saw %q, %d rows", res(5), unclaimed))
	add("5 after a revoke: write and push refused, reads work, run exits with the agent's status",
		want(marker(res(7), "prepared") == "ok", "before the revoke: the agent saw %q", res(7)),
		want(marker(res(8), "lostwrite") == "refused" && strings.Contains(res(8), "Permission denied"), "write after the revoke: the agent saw %q", res(8)),
		want(!strings.Contains(string(invoice), "after the revoke"), "the write after the revoke landed"),
		want(marker(res(8), "lostpush") == "refused" && strings.Contains(res(8), "lost"), "push after the revoke: the agent saw %q", res(8)),
		want(up == "agent: in scope", "upstream main is %q after the revoke", up),
		want(marker(res(8), "lostread") == "ok", "reads after the revoke: the agent saw %q", res(8)),
		want(s.w.model.Finished(), "the agent did not come back for its final turn"),
		want(s.agentCode >= 0 && s.code == s.agentCode, "exit %d, the agent's %d", s.code, s.agentCode),
		want(s.mode == modePod || strings.Contains(s.logs, "LEASE LOST"), "run did not report the loss"))
	id := ""
	if m := leaseIDRE.FindStringSubmatch(s.logs); m != nil {
		id = m[1]
	}
	n := w.netRefusals(t, id, forbidden)
	add("6 curl to a host off the allowlist refused and audited",
		want(marker(res(6), "curl") == "refused" && strings.Contains(res(6), "403"), "the agent saw %q", res(6)),
		want(n >= 1, "%d audited net refusals of %s for lease %s", n, forbidden, id))
	seen := strings.Contains(s.stdout+s.logs+strings.Join(r, "\n"), modelKey)
	add("7 the model's API key is the sidecar's: every request carried it, the agent never saw it",
		want(w.model.Requests() > 0 && w.model.BadKeys() == 0, "%d of %d model requests came without the key", w.model.BadKeys(), w.model.Requests()),
		want(!seen, "the key appears in the agent's output, a tool result or fenceline's logs"))
	return vs
}

// report logs one line per step, as scripts/agents-e2e.sh prints them.
func (s *story) report(t *testing.T, vs []verdict) {
	for _, v := range vs {
		res := "PASS"
		if !v.OK {
			res = "FAIL"
		}
		line := fmt.Sprintf("AGENT-E2E %-4s %-6s %-9s %s", res, s.agent, s.mode, v.Step)
		if !v.OK {
			line += ": " + v.Why
		}
		t.Log(line)
		fmt.Fprintln(os.Stderr, line)
	}
}

func (s *story) mustPass(t *testing.T) {
	t.Helper()
	vs := s.judge(t)
	s.report(t, vs)
	for _, v := range vs {
		if !v.OK {
			t.Errorf("%s (%s): step %s failed: %s", s.agent, s.mode, v.Step, v.Why)
		}
	}
	if t.Failed() {
		t.Logf("fenceline logs:\n%s\nagent stdout:\n%s", s.logs, s.stdout)
		for i, r := range s.results {
			t.Logf("tool result %d (%s):\n%s", i, s.w.model.Steps[i].Name, r)
		}
	}
}

// TestCodexUnderRun: Codex CLI, unmodified, its sandbox and approvals
// off, through the whole story under "fenceline run".
func TestCodexUnderRun(t *testing.T) {
	runStory(t, "codex", modeRun).mustPass(t)
}

// TestClaudeUnderRun: Claude Code, unmodified, permissions skipped (as
// nobody), through the whole story under "fenceline run".
func TestClaudeUnderRun(t *testing.T) {
	runStory(t, "claude", modeRun).mustPass(t)
}

// TestCodexInPod: the same story with "fenceline sidecar" and "fenceline
// agent" wrapping codex exec, two processes as a pod's two containers.
func TestCodexInPod(t *testing.T) {
	runStory(t, "codex", modePod).mustPass(t)
}

// TestGuardOffFails: the same Codex run with fenceline's file guard off
// (a kernel without Landlock, --allow-unguarded) fails the story's
// file-write steps: what held in the other runs was fenceline's guard,
// not the agent's own sandbox (which every run turns off).
func TestGuardOffFails(t *testing.T) {
	s := runStory(t, "codex", modeUnguarded)
	vs := s.judge(t)
	s.report(t, vs)
	failed := map[string]bool{}
	for _, v := range vs {
		failed[v.Step[:1]] = !v.OK
	}
	if !failed["2"] {
		t.Errorf("with the guard off, step 2 passed: the agents' own sandboxes held, not fenceline's guard: %+v", vs)
	}
	if !strings.Contains(s.logs, "UNGUARDED") {
		t.Errorf("fenceline did not say it ran unguarded:\n%s", s.logs)
	}
	rates, _ := os.ReadFile(filepath.Join(s.w.co, "libs/tax/rates.go"))
	if !strings.Contains(string(rates), "the agent was here") {
		t.Errorf("unguarded, the out-of-claim write did not land: %q", rates)
	}
}
