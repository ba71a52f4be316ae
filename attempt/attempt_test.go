package attempt

import (
	"bufio"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// newRepo makes a git checkout with in/seed, out/seed and README.md
// committed, and origin as its remote when set.
func newRepo(t *testing.T, origin string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	for p, c := range map[string]string{"in/seed": "seed\n", "out/seed": "seed\n", "README.md": "payments\n"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git(t, dir, "init", "--quiet", "--initial-branch=main")
	git(t, dir, "add", "-A")
	git(t, dir, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "--quiet", "-m", "seed")
	if origin != "" {
		git(t, dir, "remote", "add", "origin", origin)
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	return real
}

func git(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func TestFindCheckout(t *testing.T) {
	ctx := context.Background()
	repo := newRepo(t, "https://bot:s3cret@github.com/acme/payments.git")
	plain := t.TempDir()
	file := filepath.Join(plain, "file")
	os.WriteFile(file, nil, 0o644)
	wt := filepath.Join(t.TempDir(), "wt")
	git(t, repo, "worktree", "add", "--quiet", wt)
	wtReal, _ := filepath.EvalSymlinks(wt)
	link := filepath.Join(t.TempDir(), "link")
	os.Symlink(repo, link)

	for _, tc := range []struct {
		name, path string
		want       Checkout
		invalid    string // what the error says; "" when it resolves
	}{
		{"checkout with origin", repo, Checkout{Root: repo, Repo: "github.com/acme/payments", Origin: "https://bot:s3cret@github.com/acme/payments.git", GitDirs: []string{filepath.Join(repo, ".git")}}, ""},
		{"through a symlink", link, Checkout{Root: repo, Repo: "github.com/acme/payments", Origin: "https://bot:s3cret@github.com/acme/payments.git", GitDirs: []string{filepath.Join(repo, ".git")}}, ""},
		{"worktree: its git dir, then the common one", wtReal, Checkout{Root: wtReal, Repo: "github.com/acme/payments", Origin: "https://bot:s3cret@github.com/acme/payments.git", GitDirs: []string{filepath.Join(repo, ".git", "worktrees", "wt"), filepath.Join(repo, ".git")}}, ""},
		{"plain directory: its path is the repo", plain, Checkout{Root: plain, Repo: plain}, ""},
		{"inside a checkout", filepath.Join(repo, "in"), Checkout{}, "pass its top directory"},
		{"missing", filepath.Join(plain, "nope"), Checkout{}, "no such file"},
		{"a file", file, Checkout{}, "is not a directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			co, err := FindCheckout(ctx, tc.path)
			if tc.invalid != "" {
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.invalid) {
					t.Fatalf("FindCheckout(%s) = %v, want an ErrInvalid saying %q", tc.path, err, tc.invalid)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if co.Root != tc.want.Root || co.Repo != tc.want.Repo || co.Origin != tc.want.Origin || !slices.Equal(co.GitDirs, tc.want.GitDirs) {
				t.Errorf("FindCheckout(%s) = %+v, want %+v", tc.path, *co, tc.want)
			}
		})
	}
}

// TestFindCheckoutRunsNoTrap: resolving a checkout (git rev-parse, git
// config in it) seeded with every trap an earlier attempt could plant runs
// none of them.
func TestFindCheckoutRunsNoTrap(t *testing.T) {
	co := newRepo(t, "https://example.com/acme/payments.git")
	marker := filepath.Join(t.TempDir(), "ran")
	if err := gittrap.Plant(filepath.Join(co, ".git"), co, filepath.Join(t.TempDir(), "traps"), marker); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(co, "README.md"), []byte("dirty\n"), 0o644)
	c, err := FindCheckout(context.Background(), co)
	if err != nil {
		t.Fatal(err)
	}
	if c.Repo != "example.com/acme/payments" || len(c.GitDirs) != 1 {
		t.Errorf("FindCheckout = %+v", c)
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("FindCheckout ran the repository's programs:\n%s", ran)
	}
}

// claim builds a claim of paths ("*": whole-repo).
func claim(t *testing.T, paths ...string) scope.Claim { return bustest.Claim(t, paths...) }

// TestPolicy is the guard a lease gives, by workspace mode and claim.
func TestPolicy(t *testing.T) {
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	gitDir := filepath.Join(repo, ".git")
	os.Symlink(filepath.Join(repo, "out"), filepath.Join(repo, "alias"))
	os.Symlink(t.TempDir(), filepath.Join(repo, "away"))
	sepDir := filepath.Join(t.TempDir(), "sep")
	git(t, t.TempDir(), "init", "--quiet", "--separate-git-dir="+filepath.Join(sepDir, "meta"), sepDir)
	sep, err := FindCheckout(context.Background(), sepDir)
	if err != nil {
		t.Fatal(err)
	}
	plainDir := t.TempDir()
	plain, _ := FindCheckout(context.Background(), plainDir)
	cache := t.TempDir()

	shared, exclusive := lease.WorkspaceShared, lease.WorkspaceExclusive
	none := scope.Claim{Kind: scope.KindNone}
	for _, tc := range []struct {
		name     string
		co       *Checkout
		mode     lease.WorkspaceMode
		claim    scope.Claim
		extra    []string
		writable []string
		gitDir   bool // GitDirWritable
		shim     bool // GitShim
		created  []string
		err      string
	}{
		{name: "shared, paths: the paths, git dir read-only, shim", co: co, mode: shared, claim: claim(t, "in"),
			writable: []string{filepath.Join(repo, "in")}, shim: true},
		{name: "exclusive, paths: the paths and the git dir", co: co, mode: exclusive, claim: claim(t, "in", "out"),
			writable: []string{filepath.Join(repo, "in"), filepath.Join(repo, "out")}, gitDir: true},
		{name: "exclusive, whole repo: the checkout", co: co, mode: exclusive, claim: claim(t, "*"),
			writable: []string{repo}, gitDir: true},
		{name: "exclusive, no claim: the checkout", co: co, mode: exclusive, claim: none,
			writable: []string{repo}, gitDir: true},
		{name: "extra paths come after the claim", co: co, mode: shared, claim: claim(t, "in"), extra: []string{cache},
			writable: []string{filepath.Join(repo, "in"), cache}, shim: true},
		{name: "a missing claim is created", co: co, mode: shared, claim: claim(t, "new/dir"),
			writable: []string{filepath.Join(repo, "new", "dir")}, shim: true, created: []string{"new/dir"}},
		{name: "a plain directory has no git dir", co: plain, mode: exclusive, claim: claim(t, "*"),
			writable: []string{plainDir}},
		{name: "shared needs a path claim", co: co, mode: shared, claim: claim(t, "*"), err: "a shared workspace needs a path claim"},
		{name: "shared never claims a git dir in the worktree", co: sep, mode: shared, claim: claim(t, "meta/hooks"), err: "a shared workspace never writes it"},
		{name: "a claim through a symlink in the checkout", co: co, mode: shared, claim: claim(t, "alias/x"), err: "so claim out instead"},
		{name: "a claim through a symlink out of it", co: co, mode: exclusive, claim: claim(t, "away"), err: "outside the checkout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := lease.Lease{LeaseID: "lease_t", WorkspaceMode: tc.mode, Scope: tc.claim}
			p, created, err := Policy(tc.co, l, tc.extra)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Policy = %v, want an error saying %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(p.Writable, tc.writable) || p.GitDirWritable != tc.gitDir || p.GitShim != tc.shim || !slices.Equal(created, tc.created) {
				t.Errorf("Policy = writable %v, git dir %v, shim %v, created %v; want %v, %v, %v, %v",
					p.Writable, p.GitDirWritable, p.GitShim, created, tc.writable, tc.gitDir, tc.shim, tc.created)
			}
			if p.Root != tc.co.Root || !slices.Equal(p.GitDirs, tc.co.GitDirs) || p.Lease.LeaseID != "lease_t" {
				t.Errorf("Policy root %s, git dirs %v, lease %s", p.Root, p.GitDirs, p.Lease.LeaseID)
			}
			for _, c := range tc.created {
				if fi, err := os.Stat(filepath.Join(tc.co.Root, c)); err != nil || !fi.IsDir() {
					t.Errorf("created claim %s: %v", c, err)
				}
			}
		})
	}
	if _, err := os.Lstat(filepath.Join(gitDir, "hooks")); err != nil {
		t.Errorf("the git dir's hooks: %v", err)
	}
}

// TestHiddenPaths: the agent reads the git CA certificate its env names
// in the sidecar's state dir, but not the CA key nor anything else of
// fenceline's state dir; a state dir that does not exist yet is hidden by
// its topmost missing ancestor.
func TestHiddenPaths(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no", "state", "fenceline")
	if got, want := HiddenPaths(nil, missing), []string{filepath.Dir(filepath.Dir(missing))}; !slices.Equal(got, want) {
		t.Errorf("hidden with no state dir: %v, want %v", got, want)
	}

	state := filepath.Join(t.TempDir(), "fenceline")
	sc := filepath.Join(state, "sidecar", "lease_mine")
	files := map[string]string{
		filepath.Join(state, "leases", "lease_other.json"): "credential",
		filepath.Join(sc, "ca", "ca.pem"):                  "certificate",
		filepath.Join(sc, "ca", "ca-key.pem"):              "key",
		filepath.Join(sc, "tmp", "pack"):                   "pack",
		filepath.Join(state, "sidecar", "lease_b", "x"):    "other sidecar",
	}
	var script []string
	for p, c := range files {
		os.MkdirAll(filepath.Dir(p), 0o700)
		if err := os.WriteFile(p, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
		script = append(script, "cat "+p+" 2>/dev/null || echo hidden; echo")
	}
	env := []string{"GIT_CONFIG_KEY_0=http.https://git.internal/.sslCAInfo", "GIT_CONFIG_VALUE_0=" + filepath.Join(sc, "ca", "ca.pem")}
	cmd := exec.Command("sh", "-c", strings.Join(script, "\n"))
	var out strings.Builder
	cmd.Stdout = &out
	pr, err := fsguard.Start(context.Background(), fsguard.Policy{Hidden: HiddenPaths(env, state, sc)}, nil, nil, cmd)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pr.Wait(); err != nil {
		t.Fatal(err)
	}
	got := strings.Fields(out.String())
	slices.Sort(got)
	if want := []string{"certificate", "hidden", "hidden", "hidden", "hidden"}; !slices.Equal(got, want) {
		t.Errorf("the agent read %v, want %v", got, want)
	}
}

func TestEnv(t *testing.T) {
	base := []string{"HOME=/home/dev", "SECRET=x", "GIT_OPTIONAL_LOCKS=1", "FENCELINE_LEASE_ID=lease_old",
		"FENCELINE_GIT_UPSTREAM_HEADER=Authorization: Bearer t", "FENCELINE_ADMIN_TOKEN=t", "FENCELINE_UI_TOKEN=t"}
	route := func(env []string) []string { return append(env, "HTTPS_PROXY=http://127.0.0.1:1") }
	got := Env(base, []string{"SECRET"}, route, "lease_new")
	want := []string{"HOME=/home/dev", "GIT_OPTIONAL_LOCKS=1", "HTTPS_PROXY=http://127.0.0.1:1", "FENCELINE_LEASE_ID=lease_new"}
	if !slices.Equal(got, want) {
		t.Errorf("Env = %v, want %v", got, want)
	}
	if base[1] != "SECRET=x" || len(base) != 7 {
		t.Errorf("Env changed its base: %v", base)
	}
	if got := Env(nil, nil, nil, ""); len(got) != 0 {
		t.Errorf("Env without a lease = %v", got)
	}
}

func TestInputs(t *testing.T) {
	if ps, err := Ports("--allow-connect", []string{"443", " 5432 "}); err != nil || !slices.Equal(ps, []uint16{443, 5432}) {
		t.Errorf("Ports = %v, %v", ps, err)
	}
	for _, bad := range []string{"0", "65536", "http", ""} {
		if _, err := Ports("--allow-connect", []string{bad}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "--allow-connect") {
			t.Errorf("Ports(%q) = %v, want an ErrInvalid naming the flag", bad, err)
		}
	}
	if got := ConnectPorts([]uint16{443, 80}, []uint16{80, 9000}); !slices.Equal(got, []uint16{80, 443, 9000}) {
		t.Errorf("ConnectPorts = %v", got)
	}
	// The ports of local services the agent must not take: loopback hosts
	// of host:port addresses, URLs and NATS URL lists; remote ones and
	// Unix socket paths are not this host's ports.
	if got := LocalPorts("127.0.0.1:5432", "http://localhost:8080/repo.git", "nats://127.0.0.1:4222,nats://[::1]:4223",
		"db.internal:5432", "/run/postgresql", "", "https://git.example.com/x.git"); !slices.Equal(got, []uint16{4222, 4223, 5432, 8080}) {
		t.Errorf("LocalPorts = %v, want [4222 4223 5432 8080]", got)
	}
	if got := sidecarPorts("http://127.0.0.1:9090"); !slices.Equal(got, []uint16{9090}) {
		t.Errorf("sidecarPorts = %v, want [9090]", got)
	}
	dir := t.TempDir()
	if ps, err := RealPaths("--allow-write", []string{dir}); err != nil || len(ps) != 1 {
		t.Errorf("RealPaths = %v, %v", ps, err)
	}
	for _, bad := range []string{filepath.Join(dir, "nope"), "/"} {
		if _, err := RealPaths("--allow-write", []string{bad}); !errors.Is(err, ErrInvalid) {
			t.Errorf("RealPaths(%s) = %v, want ErrInvalid", bad, err)
		}
	}
}

// lines collects Say's lines.
type lines struct {
	mu sync.Mutex
	l  []string
}

func (s *lines) say(line string) { s.mu.Lock(); s.l = append(s.l, line); s.mu.Unlock() }
func (s *lines) text() string    { s.mu.Lock(); defer s.mu.Unlock(); return strings.Join(s.l, "\n") }

// runSpec is a spec for an attempt on a real bus under lease l.
func runSpec(t *testing.T, b *bustest.Bus, co *Checkout, l *bustest.Lease, argv ...string) (Spec, *lines) {
	t.Helper()
	said := &lines{}
	return Spec{
		Argv: argv, Checkout: co, Holder: l.Holder, Audit: b.Auditor, FencelineStateDir: t.TempDir(),
		Sidecar:   sidecar.Config{Lease: l.Holder, Bus: b.Client, Audit: b.Auditor, StateDir: filepath.Join(t.TempDir(), "sidecar")},
		KillGrace: 5 * time.Second, Stdout: io.Discard, Stderr: io.Discard, Say: said.say,
	}, said
}

// TestRunConfines: a real attempt on a real bus under the real guard
// writes its claim (with GIT_OPTIONAL_LOCKS=0 in its environment), is
// refused outside it and out of the git dir, and its exit status is the
// result; the lease is still held when Run returns.
func TestRunConfines(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared, TTL: lease.Duration(10 * time.Second)}, leasebus.HoldOptions{})
	t.Setenv("GIT_OPTIONAL_LOCKS", "1") // the guard's 0 wins: read-only git never refreshes the index
	script := `echo "locks=$GIT_OPTIONAL_LOCKS" > in/mine; echo no > out/theirs; echo no > .git/planted; exit 3`
	spec, said := runSpec(t, b, co, l, "sh", "-c", script)
	res, err := Run(context.Background(), spec)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Started || res.Code != 3 || res.StoppedOnLost {
		t.Errorf("Run = %+v, want started, exit 3", res)
	}
	if b, err := os.ReadFile(filepath.Join(repo, "in", "mine")); err != nil || string(b) != "locks=0\n" {
		t.Errorf("the claim's write: %q, %v", b, err)
	}
	for _, p := range []string{"out/theirs", ".git/planted"} {
		if _, err := os.Lstat(filepath.Join(repo, p)); err == nil {
			t.Errorf("%s was written outside the claim", p)
		}
	}
	if !strings.Contains(said.text(), "file guard: the agent writes in in "+repo) {
		t.Errorf("Run said:\n%s", said.text())
	}
	if st, _ := l.State(); st != lease.Held {
		t.Errorf("after Run the lease is %s, want still held (releasing it is the caller's)", st)
	}
}

// TestRunStopsOnLost: with StopOnLost, an operator's revoke stops the
// agent (SIGTERM to its processes) and the result says so.
func TestRunStopsOnLost(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	co, err := FindCheckout(context.Background(), newRepo(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared, TTL: lease.Duration(10 * time.Second)}, leasebus.HoldOptions{})
	spec, said := runSpec(t, b, co, l, "sh", "-c", "echo ready; exec sleep 60")
	spec.StopOnLost = true
	out, w := io.Pipe()
	spec.Stdout = w
	type ran struct {
		res Result
		err error
	}
	done := make(chan ran, 1)
	go func() {
		res, err := Run(context.Background(), spec)
		w.Close()
		done <- ran{res, err}
	}()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the agent said %q, %v", line, err)
	}
	go io.Copy(io.Discard, out)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.Operator.Revoke(ctx, l.Record.LeaseID, "test: stop the agent"); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !r.res.StoppedOnLost || r.res.Code != 128+15 {
		t.Errorf("Run = %+v, want stopped on lost with 143 (SIGTERM)", r.res)
	}
	if !strings.Contains(said.text(), "LEASE LOST") {
		t.Errorf("Run said:\n%s", said.text())
	}
}

// TestRunRefusalsSayTheirCause: a call refused while the lease holds (a
// chmod outside the claim, a connect to a loopback port not allowed; a
// connect elsewhere is captured into the egress proxy) is reported as refused for what it was, never
// as a write refused after a loss (issue 33); a write refused after an
// operator's revoke is.
func TestRunRefusalsSayTheirCause(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	co, err := FindCheckout(context.Background(), newRepo(t, ""))
	if err != nil {
		t.Fatal(err)
	}
	acquire := func() *bustest.Lease {
		return b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared, TTL: lease.Duration(10 * time.Second)}, leasebus.HoldOptions{})
	}

	t.Run("held", func(t *testing.T) {
		l := acquire()
		defer l.Holder.Close(context.Background())
		spec, said := runSpec(t, b, co, l, "sh", "-c", "chmod 600 out/seed; "+
			`python3 -c 'import socket; socket.create_connection(("127.0.0.1", 9), timeout=2)' 2>/dev/null; echo ok > in/mine`)
		res, err := Run(context.Background(), spec)
		if err != nil {
			t.Fatal(err)
		}
		if res.Refused.Confined < 2 || res.Refused.AfterLoss != 0 || res.Denials != res.Refused.Total() {
			t.Errorf("Run = %+v, want the chmod and the connect refused while the lease held and nothing after a loss", res)
		}
		if text := said.text(); strings.Contains(text, "lost") || !strings.Contains(text, "outside its claim or its allowed connections were refused") {
			t.Errorf("Run said:\n%s\nwant the refusal outside the claim and no word of a loss", text)
		}
	})

	t.Run("lost", func(t *testing.T) {
		l := acquire()
		spec, said := runSpec(t, b, co, l, "sh", "-c", "echo ready; while echo x > in/probe 2>/dev/null; do sleep 0.05; done; echo refused")
		out, w := io.Pipe()
		spec.Stdout = w
		type ran struct {
			res Result
			err error
		}
		done := make(chan ran, 1)
		go func() {
			res, err := Run(context.Background(), spec)
			w.Close()
			done <- ran{res, err}
		}()
		rd := bufio.NewReader(out)
		if line, err := rd.ReadString('\n'); err != nil || line != "ready\n" {
			t.Fatalf("the agent said %q, %v", line, err)
		}
		go io.Copy(io.Discard, rd)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := b.Operator.Revoke(ctx, l.Record.LeaseID, "test: lose the lease"); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil {
			t.Fatal(r.err)
		}
		if r.res.Refused.AfterLoss == 0 || r.res.Refused.Confined != 0 {
			t.Errorf("Run = %+v, want the write refused after the loss", r.res)
		}
		if !strings.Contains(said.text(), "writes of the agent were refused after the lease was lost") {
			t.Errorf("Run said:\n%s", said.text())
		}
	})
}

// TestRunRefusesUpstreamSocketAgentCanWrite: a Postgres upstream reached
// through a Unix socket in a directory the agent may write is one the
// agent can stand in for (remove the socket, bind its own while the server
// restarts): the fence would then send the agent's session, and what the
// fence adds to it, to the agent. Run refuses before the agent starts.
func TestRunRefusesUpstreamSocketAgentCanWrite(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared, TTL: lease.Duration(10 * time.Second)}, leasebus.HoldOptions{})
	spec, _ := runSpec(t, b, co, l, "sh", "-c", "echo started > in/started")
	spec.Sidecar.PGUpstream = filepath.Join(repo, "in", ".s.PGSQL.5432")
	res, err := Run(context.Background(), spec)
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Field != "Sidecar.PGUpstream" || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "may write") {
		t.Errorf("Run = %v, want an invalid Sidecar.PGUpstream FieldError naming the agent's writable path", err)
	}
	if res.Started {
		t.Error("the agent started")
	}
}
