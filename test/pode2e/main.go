// Command pode2e runs deploy/kubernetes/agent-pod.yaml's pod with a real
// container runtime (podman) and checks it end to end; scripts/pod-e2e.sh
// builds the images and runs it. Beside the pod, on this machine's
// loopback (the pod reaches it through slirp4netns at 10.0.2.2, as a pod
// reaches its cluster's services): the lease bus ("fenceline bus serve", a
// child process), a git smart-HTTP server (git http-backend) and a
// Postgres (internal/pgtest). The pod is a podman pod (one network
// namespace) with the manifest's containers in the manifest's order and
// with its hardening (uid 65532, --cap-drop ALL, no-new-privileges, a
// read-only root): fenceline-bin copies the binary, the sidecar holds the
// lease with the pod's own bus identity, checkout clones through the git
// fence, and the agent container runs "fenceline agent" wrapping a shell
// that runs the checks' commands (sent on its stdin). One line per check:
//
//	PASS ready                     sidecar ready (lease held) 0.41 s after its start
//	...
//
//	go run ./test/pode2e -fenceline BIN -sidecar-image IMG -agent-image IMG
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/test/agents"
)

// hostGW is the address of this machine's loopback inside the pod
// (slirp4netns with allow_host_loopback).
const hostGW = "10.0.2.2"

// dnsCheckName is allowed in the pods and pinned to hostGW: only the
// sidecar's egress proxy can answer it.
const dnsCheckName = "dns-e2e.test"

// The pod's ports, as in the manifest.
const (
	adminPort = "9090"
	gitListen = "127.0.0.1:7070"
	pgListen  = "127.0.0.1:6432"
)

// hardened is the manifest's securityContext as runtime flags.
var hardened = []string{"--user", "65532:65532", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only"}

type env struct {
	rt, fl, scImage, agImage string
	goResolver               string
	dir                      string
	busURL, creds            string // the operator's bus (on this machine) and credentials
	gitURL                   string // the upstream as the pod reaches it
	bare                     string
	pg                       *pgtest.Server
	repo                     string
	failed                   bool
	verbose                  bool
	codex                    string
	model                    *agents.Model
	modelPort                string
	modelCA                  string // PEM file of the model's CA
}

func main() {
	var e env
	flag.StringVar(&e.rt, "runtime", "podman", "container runtime (podman)")
	flag.StringVar(&e.fl, "fenceline", "", "fenceline binary on this machine (the bus, the operator's commands)")
	flag.StringVar(&e.scImage, "sidecar-image", "localhost/fenceline-sidecar:e2e", "the sidecar image (deploy/Dockerfile, target sidecar)")
	flag.StringVar(&e.agImage, "agent-image", "localhost/fenceline-e2e-agent:e2e", "the agent's image (a shell, git, psql)")
	flag.BoolVar(&e.verbose, "v", false, "print the containers' logs")
	flag.StringVar(&e.codex, "codex", "", "the Codex CLI's native binary (static, from @openai/codex): run it in pod 2 against a scripted model")
	flag.StringVar(&e.goResolver, "go-resolver", "", "a static Go program with Go's own resolver (attempt/testdata/capclient): looks names up over UDP in the agent's container")
	flag.Parse()
	if e.fl == "" {
		fmt.Fprintln(os.Stderr, "pode2e: -fenceline is required")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	if err := e.run(ctx); err != nil {
		fmt.Printf("FAIL %v\n", err)
		os.Exit(1)
	}
	if e.failed {
		os.Exit(1)
	}
}

func (e *env) check(name string, ok bool, format string, args ...any) {
	st := "PASS"
	if !ok {
		st, e.failed = "FAIL", true
	}
	fmt.Printf("%s %-28s %s\n", st, name, fmt.Sprintf(format, args...))
}

func (e *env) run(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "pod-e2e-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	e.dir = dir

	// The lease bus.
	busPort, err := freePort()
	if err != nil {
		return err
	}
	e.busURL = "nats://127.0.0.1:" + busPort
	e.creds = filepath.Join(dir, "bus-creds")
	bus := exec.Command(e.fl, "bus", "serve", "--listen", "127.0.0.1:"+busPort, "--store", filepath.Join(dir, "bus"),
		"--creds", e.creds, "--fence-secrets", filepath.Join(dir, "fence-secrets"))
	bus.Env = append(os.Environ(), "XDG_STATE_HOME="+filepath.Join(dir, "state"))
	busLog, err := os.Create(filepath.Join(dir, "bus.log"))
	if err != nil {
		return err
	}
	defer busLog.Close()
	bus.Stdout, bus.Stderr = busLog, busLog
	if err := bus.Start(); err != nil {
		return fmt.Errorf("start the bus: %w", err)
	}
	defer func() { bus.Process.Kill(); bus.Wait() }()
	if err := e.until(ctx, 30*time.Second, func() bool { _, err := e.op(ctx, "lease", "list"); return err == nil }); err != nil {
		b, _ := os.ReadFile(busLog.Name())
		return fmt.Errorf("the bus did not answer: %w\n%s", err, b)
	}

	// The git upstream: payments.git with services/billing and libs/tax.
	gs, err := gitserver.Start(filepath.Join(dir, "git"), gitserver.ClientEnv(filepath.Join(dir, "githome"), "server")...)
	if err != nil {
		return err
	}
	defer gs.Close()
	os.MkdirAll(filepath.Join(dir, "git"), 0o755)
	if e.bare, err = gs.NewRepo("payments.git"); err != nil {
		return err
	}
	seed := filepath.Join(dir, "seed")
	if err := seedRepo(ctx, seed, e.bare); err != nil {
		return err
	}
	_, gitPort, _ := net.SplitHostPort(strings.TrimPrefix(gs.URL, "http://"))
	e.gitURL = "http://" + hostGW + ":" + gitPort + "/payments.git"
	e.repo = hostGW + ":" + gitPort + "/payments"

	// Postgres: billing.invoices is claimed, ledger.entries is not; the
	// fence's secret goes to the lease service, never to the pod.
	if e.pg, err = pgtest.Start(ctx); err != nil {
		return err
	}
	defer e.pg.Stop()
	if _, err := e.psql(ctx, `CREATE SCHEMA billing; CREATE SCHEMA ledger;
		CREATE TABLE billing.invoices (id int PRIMARY KEY, note text);
		CREATE TABLE ledger.entries (id int PRIMARY KEY, note text);`); err != nil {
		return err
	}
	pgKey := filepath.Join(dir, "pg.key")
	if _, err := e.op(ctx, "pg", "install", "--dsn", e.pg.AdminDSN(""), "--table", "billing.invoices", "--table", "ledger.entries", "--secret-file", pgKey); err != nil {
		return err
	}
	if _, err := e.op(ctx, "bus", "fence-secret", "set", "--repo", e.repo, "--postgres", pgKey, "--dir", filepath.Join(dir, "fence-secrets")); err != nil {
		return err
	}

	if e.codex != "" {
		stop, err := e.startModel()
		if err != nil {
			return err
		}
		defer stop()
	}

	// Pod 1: the whole story up to its shutdown in Kubernetes order.
	p1, err := e.startPod(ctx, "agent-e2e-1")
	if err != nil {
		return err
	}
	defer p1.remove()
	if err := p1.waitReady(ctx, 60*time.Second); err != nil {
		e.check("ready", false, "%v\n%s", err, p1.logs("fenceline"))
		return nil
	}
	e.check("ready", true, "sidecar ready (lease %s held) %.2f s after its container started", p1.lease, p1.readyIn.Seconds())
	if err := p1.checkout(ctx); err != nil {
		return err
	}
	ag, err := p1.startAgent(ctx)
	if err != nil {
		return err
	}
	defer ag.kill()
	e.storyChecks(ctx, p1, ag)

	// Pod 2, its replacement, starts while pod 1 still holds the lease:
	// its sidecar waits (--wait) instead of failing.
	p2, err := e.startPod(ctx, "agent-e2e-2")
	if err != nil {
		return err
	}
	defer p2.remove()
	// Its admin server is up (healthz) while its readyz says why not yet.
	var queuedWhy string
	if err := e.until(ctx, 30*time.Second, func() bool { c, _ := p2.get(ctx, "/healthz"); return c == http.StatusOK }); err != nil {
		return fmt.Errorf("pod 2's sidecar never served: %w\n%s", err, p2.logs("fenceline"))
	}
	c, body := p2.get(ctx, "/readyz")
	queued := c == http.StatusServiceUnavailable
	queuedWhy = strings.TrimSpace(body)

	// SIGTERM in Kubernetes order: the agent container first, the native
	// sidecar once the agent has exited; the lease is released after the
	// attempt settled.
	t0 := time.Now()
	code := ag.stop(ctx)
	agLog := ag.stderr.String()
	settled := strings.Contains(agLog, "attempt settled and reported to the sidecar")
	if _, err := e.rtOut(ctx, "stop", "-t", "30", p1.name+"-fenceline"); err != nil {
		return err
	}
	scOut := p1.logs("fenceline")
	st, _ := e.leaseState(ctx, p1.lease)
	e.check("sigterm-k8s-order", settled && st == "released" && strings.Contains(scOut, "released (the agent reported its attempt settled)"),
		"agent exited %d and reported settled; then the sidecar released: bus says %q (%.2f s for both)", code, st, time.Since(t0).Seconds())
	if !settled || st != "released" {
		fmt.Printf("  agent log:\n%s\n  sidecar log:\n%s\n", agLog, scOut)
	}

	if err := p2.waitReady(ctx, 60*time.Second); err != nil {
		e.check("replacement-waits", false, "%v\n%s", err, p2.logs("fenceline"))
		return nil
	}
	e.check("replacement-waits", queued, "pod 2's sidecar queued behind pod 1's lease (readyz: %q) and got %s once it was released", queuedWhy, p2.lease)
	if err := p2.checkout(ctx); err != nil {
		return err
	}
	ag2, err := p2.startAgent(ctx)
	if err != nil {
		return err
	}
	defer ag2.kill()
	if e.codex != "" {
		e.codexCheck(ctx, p2, ag2)
	}
	e.revokeCheck(ctx, p2, ag2)
	return nil
}

// storyChecks: writes in and out of scope, a push and a Postgres write
// through the fences, and the operator's shells.
func (e *env) storyChecks(ctx context.Context, p *pod, ag *agent) {
	co := filepath.Join(p.dir, "workspace", "payments")
	rc, out := ag.do(ctx, `echo in-scope > services/billing/e2e.txt`)
	b, _ := os.ReadFile(filepath.Join(co, "services/billing/e2e.txt"))
	e.check("in-scope-write", rc == 0 && string(b) == "in-scope\n", "services/billing/e2e.txt: exit %d, file holds %q %s", rc, b, out)

	rc, out = ag.do(ctx, `{ echo out-of-scope > libs/tax/e2e.txt; } 2>&1`)
	_, serr := os.Stat(filepath.Join(co, "libs/tax/e2e.txt"))
	e.check("out-of-scope-refused", rc != 0 && errors.Is(serr, os.ErrNotExist), "libs/tax/e2e.txt: exit %d, %s", rc, strings.TrimSpace(out))

	rc, out = ag.do(ctx, `git add services/billing/e2e.txt && git commit -q -m e2e && git push -q origin HEAD:main 2>&1 && git rev-parse HEAD`)
	head := lastLine(out)
	up, _ := gitOut(ctx, "", "--git-dir", e.bare, "rev-parse", "main")
	e.check("push-through-fence", rc == 0 && head != "" && up == head, "exit %d, upstream main %s, agent HEAD %s", rc, up, head)

	rc, out = ag.do(ctx, `psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -qc "INSERT INTO billing.invoices VALUES (1, 'e2e')" 2>&1`)
	n, _ := e.psql(ctx, `SELECT count(*) FROM billing.invoices WHERE note = 'e2e'`)
	rc2, out2 := ag.do(ctx, `psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -qc "INSERT INTO ledger.entries VALUES (1, 'e2e')" 2>&1`)
	m, _ := e.psql(ctx, `SELECT count(*) FROM ledger.entries`)
	e.check("postgres-through-fence", rc == 0 && n == "1" && rc2 != 0 && m == "0",
		"billing.invoices insert: exit %d, rows %s; ledger.entries (unclaimed): exit %d, rows %s (%s)", rc, n, rc2, m, firstLine(out+out2))

	if e.goResolver != "" {
		// Go's own resolver asks over UDP: the guard gives it a socket in
		// a sealed network, where the egress proxy answers DNS.
		rc, out = ag.do(ctx, `/opt/codex/go-resolver lookup `+dnsCheckName+` 2>&1; /opt/codex/go-resolver lookup exfil.example 2>&1`)
		e.check("udp-dns-sealed", strings.Contains(out, "["+hostGW+"]") && strings.Contains(out, "no such host"),
			"Go's resolver over UDP in the agent's container: %s answered %s by the egress proxy, exfil.example NXDOMAIN (%s)", dnsCheckName, hostGW, strings.TrimSpace(out))
	}

	// kubectl exec runs outside the guard (documented); the operator's
	// guarded shell does not.
	_, err := e.rtOut(ctx, "exec", p.name+"-agent", "sh", "-c", "echo exec > /workspace/payments/libs/tax/exec.txt")
	_, serr = os.Stat(filepath.Join(co, "libs/tax/exec.txt"))
	_, gerr := e.rtOut(ctx, "exec", p.name+"-agent", "/fenceline-bin/fenceline", "agent", "--operator", "--sidecar", "http://127.0.0.1:"+adminPort,
		"--token-file", "/var/run/fenceline/admin-token", "--checkout", "/workspace/payments", "--log-format", "text", "--",
		"sh", "-c", "echo ok > services/billing/op.txt && echo bad > libs/tax/op.txt")
	_, oerr := os.Stat(filepath.Join(co, "services/billing/op.txt"))
	_, berr := os.Stat(filepath.Join(co, "libs/tax/op.txt"))
	e.check("operator-shell-guarded", err == nil && serr == nil && gerr != nil && oerr == nil && errors.Is(berr, os.ErrNotExist),
		"a plain exec's write out of scope lands (outside the guard, as documented); under \"fenceline agent --operator\" in scope lands, out of scope refused")
}

// revokeCheck: the agent writes in a loop; an operator revokes the lease;
// the first refused write comes within 1 s.
func (e *env) revokeCheck(ctx context.Context, p *pod, ag *agent) {
	co := filepath.Join(p.dir, "workspace", "payments")
	f := filepath.Join(co, "services/billing/loop.txt")
	// Bounded: 60 s of writes at most.
	ag.send(`end=$(( $(date +%s) + 60 )); while [ "$(date +%s)" -lt $end ] && echo x >> services/billing/loop.txt 2>/dev/null; do :; done; date +%s%N`)
	if err := e.until(ctx, 20*time.Second, func() bool { fi, err := os.Stat(f); return err == nil && fi.Size() > 0 }); err != nil {
		e.check("revoke-stops-writes", false, "the agent's writes did not land before the revoke: %v", err)
		return
	}
	t0 := time.Now()
	if _, err := e.op(ctx, "lease", "revoke", p.lease, "--reason", "pod-e2e"); err != nil {
		e.check("revoke-stops-writes", false, "revoke: %v", err)
		return
	}
	rc, out := ag.wait(ctx)
	ns, _ := strconv.ParseInt(lastLine(out), 10, 64)
	took := time.Unix(0, ns).Sub(t0)
	e.check("revoke-stops-writes", rc == 0 && ns > 0 && took < time.Second, "first refused write %d ms after \"fenceline lease revoke\" started", took.Milliseconds())

	// The sidecar stopped after a revoke says so (not "released").
	ag.stop(ctx)
	e.rtOut(ctx, "stop", "-t", "30", p.name+"-fenceline")
	out = p.logs("fenceline")
	st, _ := e.leaseState(ctx, p.lease)
	e.check("revoked-lease-reported", st == "revoked" && !strings.Contains(out, "released (the agent reported") && strings.Contains(out, "revoked"),
		"bus says %q; the sidecar's last word: %s", st, lastLine(out))
}

// pod is one podman pod: the manifest's containers in one network
// namespace, volumes as directories under dir.
type pod struct {
	e         *env
	name, dir string
	adminURL  string
	token     string
	lease     string
	started   time.Time
	readyIn   time.Duration
}

func (e *env) startPod(ctx context.Context, name string) (*pod, error) {
	p := &pod{e: e, name: name + "-" + strconv.Itoa(os.Getpid()), dir: filepath.Join(e.dir, name)}
	hostPort, err := freePort()
	if err != nil {
		return nil, err
	}
	p.adminURL = "http://127.0.0.1:" + hostPort
	p.token = "e2e-admin-token-" + name
	vols := []string{"fenceline-bin", "fenceline-state", "workspace", "agent-home", "agent-tmp", "secrets", "bus-identity", "codex"}
	for _, v := range vols {
		if err := os.MkdirAll(filepath.Join(p.dir, v), 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(p.dir, "secrets", "admin-token"), []byte(p.token), 0o440); err != nil {
		return nil, err
	}
	// The pod's own bus identity (fenceline bus enroll POD).
	if _, err := e.op(ctx, "bus", "enroll", name, "--dir", e.creds, "--out", filepath.Join(p.dir, "bus-identity", "bus-identity.nk")); err != nil {
		return nil, err
	}
	if err := e.codexFiles(filepath.Join(p.dir, "codex"), filepath.Join(p.dir, "agent-home")); err != nil {
		return nil, err
	}
	if e.goResolver != "" {
		b, err := os.ReadFile(e.goResolver)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(p.dir, "codex", "go-resolver"), b, 0o755); err != nil {
			return nil, err
		}
	}
	for _, v := range vols {
		if err := chownR(filepath.Join(p.dir, v), 65532, 65532); err != nil {
			return nil, err
		}
	}
	// The kubelet probes the pod's IP: here a published loopback port.
	if _, err := e.rtOut(ctx, "pod", "create", "--name", p.name, "--network", "slirp4netns:allow_host_loopback=true",
		"-p", "127.0.0.1:"+hostPort+":"+adminPort); err != nil {
		return nil, err
	}
	// 1. fenceline-bin
	if _, err := e.rtOut(ctx, append(append([]string{"run", "--rm", "--pod", p.name}, hardened...),
		"-v", p.vol("fenceline-bin")+":/fenceline-bin", "--entrypoint", "cp", e.scImage, "/usr/local/bin/fenceline", "/fenceline-bin/fenceline")...); err != nil {
		return nil, err
	}
	// 2. the native sidecar (args as in the manifest, the ConfigMap's
	// values for this machine).
	args := append([]string{"run", "-d", "--pod", p.name, "--name", p.name + "-fenceline"}, hardened...)
	args = append(args,
		"-v", p.vol("fenceline-state")+":/var/lib/fenceline",
		"-v", p.vol("secrets")+":/var/run/fenceline:ro",
		"-v", p.vol("bus-identity")+":/var/run/fenceline-bus:ro",
		"-e", "FENCELINE_NATS=nats://"+hostGW+":"+strings.TrimPrefix(e.busURL, "nats://127.0.0.1:"),
		"-e", "FENCELINE_CREDS=/var/run/fenceline-bus/bus-identity.nk",
		"-e", "FENCELINE_GIT_UPSTREAM_HEADER=X-Fenceline-E2E: upstream-only",
		// The ConfigMap's DATABASE_URL: the sidecar gives the agent its
		// rewrite, pointed at the Postgres fence.
		"-e", "DATABASE_URL=postgres://"+e.pg.Admin+"@"+hostGW+":"+strconv.Itoa(e.pg.Port)+"/postgres?sslmode=disable",
		e.scImage, "sidecar",
		"--repo", e.gitURL, "--scope", "services/billing", "--table", "billing.*", "--workspace", "exclusive", "--ttl", "60s",
		"--agent", name, "--git-upstream", e.gitURL, "--git-listen", gitListen,
		"--pg-upstream", hostGW+":"+strconv.Itoa(e.pg.Port), "--pg-listen", pgListen,
		"--allow-host", "api.openai.com",
		// A name only the egress proxy knows: the agent's Go resolver
		// asks over UDP (udp-dns-sealed).
		"--allow-host", dnsCheckName+":443", "--egress-resolve", dnsCheckName+":443="+hostGW+":443",
		"--admin", "0.0.0.0:"+adminPort, "--admin-token-file", "/var/run/fenceline/admin-token",
		"--state-dir", "/var/lib/fenceline/sidecar", "--settle-timeout", "90s", "--wait", "5m", "--log-format", "json")
	if e.model != nil {
		// The scripted model stands in for the model's API: allowed by
		// name, resolved to this machine.
		args = append(args, "--allow-host", modelHost+":"+e.modelPort, "--egress-resolve", modelHost+":"+e.modelPort+"="+hostGW+":"+e.modelPort)
	}
	p.started = time.Now()
	if _, err := e.rtOut(ctx, args...); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *pod) vol(v string) string { return filepath.Join(p.dir, v) }

func (p *pod) get(ctx context.Context, path string) (int, string) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.adminURL+path, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(b)
}

func (p *pod) readyNow(ctx context.Context) bool {
	c, _ := p.get(ctx, "/readyz")
	return c == http.StatusOK
}

// waitReady waits for /readyz 200 (the startupProbe), then reads the
// lease's id from the admin API.
func (p *pod) waitReady(ctx context.Context, limit time.Duration) error {
	if err := p.e.until(ctx, limit, func() bool { return p.readyNow(ctx) }); err != nil {
		return fmt.Errorf("sidecar not ready: %w", err)
	}
	p.readyIn = time.Since(p.started)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.adminURL+"/api/v1/lease", nil)
	req.Header.Set("Authorization", "Bearer "+p.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var v struct {
		Lease struct {
			LeaseID string `json:"leaseId"`
		} `json:"lease"`
	}
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &v); err != nil || v.Lease.LeaseID == "" {
		return fmt.Errorf("GET /api/v1/lease: %s: %v", b, err)
	}
	p.lease = v.Lease.LeaseID
	return nil
}

// checkout clones through the git fence (the manifest's third init
// container).
func (p *pod) checkout(ctx context.Context) error {
	u := strings.TrimSuffix(p.e.gitURL, "payments.git")
	_, err := p.e.rtOut(ctx, append(append([]string{"run", "--rm", "--pod", p.name}, hardened...),
		"-v", p.vol("workspace")+":/workspace", "-v", p.vol("agent-home")+":/home/agent", "-e", "HOME=/home/agent",
		"--entrypoint", "git", p.e.scImage,
		"-c", "url.http://"+gitListen+"/.insteadOf="+u, "clone", "-q", p.e.gitURL, "/workspace/payments")...)
	return err
}

func (p *pod) logs(container string) string {
	out, _ := p.e.rtOut(context.Background(), "logs", p.name+"-"+container)
	return out
}

func (p *pod) remove() {
	if p.e.verbose {
		fmt.Printf("--- %s sidecar log:\n%s\n", p.name, p.logs("fenceline"))
	}
	p.e.rtOut(context.Background(), "pod", "rm", "-f", p.name)
}

// agent is the agent container: "fenceline agent" wrapping a shell that
// runs one command per line of its stdin and ends each with a marker
// line carrying the exit status.
type agent struct {
	p      *pod
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *lockedWriter
	done   chan struct{}
	code   int
}

const marker = "@@pod-e2e-exit="

func (p *pod) startAgent(ctx context.Context) (*agent, error) {
	args := append([]string{"run", "-i", "--rm", "--pod", p.name, "--name", p.name + "-agent"}, hardened...)
	args = append(args,
		"-v", p.vol("fenceline-bin")+":/fenceline-bin:ro",
		"-v", p.vol("workspace")+":/workspace",
		"-v", p.vol("agent-home")+":/home/agent",
		"-v", p.vol("agent-tmp")+":/tmp",
		"-v", p.vol("secrets")+":/var/run/fenceline:ro",
		"-v", p.vol("codex")+":/opt/codex:ro",
		"-e", "HOME=/home/agent",
		"-e", "DATABASE_URL=postgres://"+p.e.pg.Admin+"@postgres.billing.svc:5432/postgres?sslmode=disable",
		"-e", "GIT_AUTHOR_NAME=agent", "-e", "GIT_AUTHOR_EMAIL=agent@example.com",
		"-e", "GIT_COMMITTER_NAME=agent", "-e", "GIT_COMMITTER_EMAIL=agent@example.com",
		"--entrypoint", "/fenceline-bin/fenceline", p.e.agImage,
		"agent", "--sidecar", "http://127.0.0.1:"+adminPort, "--token-file", "/var/run/fenceline/admin-token",
		"--checkout", "/workspace/payments", "--grace", "2s", "--kill-grace", "60s", "--log-format", "json")
	if p.e.codex != "" {
		// Codex's state: a private, writable copy (as test/agents runs it).
		args = append(args, "--private-state", "/home/agent/.codex")
	}
	args = append(args, "--", "bash", "-c", `while IFS= read -r line; do bash -c "$line"; echo "`+marker+`$?"; done`)
	cmd := exec.Command(p.e.rt, args...)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	a := &agent{p: p, cmd: cmd, in: in, out: bufio.NewReader(stdout), stderr: &lockedWriter{b: &strings.Builder{}}, done: make(chan struct{})}
	cmd.Stderr = a.stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		defer close(a.done)
		cmd.Wait()
		a.code = cmd.ProcessState.ExitCode()
	}()
	// The wrapper is up once the guard runs the shell: a first command
	// answers.
	if rc, out := a.do(ctx, "true"); rc != 0 {
		return nil, fmt.Errorf("the agent container did not start its shell (exit %d): %s\n%s", rc, out, a.stderr.String())
	}
	return a, nil
}

func (a *agent) send(line string) { fmt.Fprintln(a.in, line) }

// wait reads the output of the command sent last up to its marker.
func (a *agent) wait(ctx context.Context) (int, string) {
	type res struct {
		rc  int
		out string
	}
	ch := make(chan res, 1)
	go func() {
		var b strings.Builder
		for {
			l, err := a.out.ReadString('\n')
			if rest, ok := strings.CutPrefix(strings.TrimSpace(l), marker); ok {
				rc, _ := strconv.Atoi(rest)
				ch <- res{rc, b.String()}
				return
			}
			b.WriteString(l)
			if err != nil {
				ch <- res{-1, b.String() + " (the agent's stdout ended: " + err.Error() + ")"}
				return
			}
		}
	}()
	select {
	case r := <-ch:
		return r.rc, r.out
	case <-ctx.Done():
		return -1, "timed out"
	}
}

func (a *agent) do(ctx context.Context, line string) (int, string) {
	a.send(line)
	return a.wait(ctx)
}

// stop is the kubelet's SIGTERM to the agent container; it returns the
// container's exit status.
func (a *agent) stop(ctx context.Context) int {
	a.p.e.rtOut(ctx, "stop", "-t", "60", a.p.name+"-agent")
	select {
	case <-a.done:
	case <-ctx.Done():
	}
	return a.code
}

func (a *agent) kill() {
	a.in.Close()
	select {
	case <-a.done:
	default:
		a.cmd.Process.Kill()
		<-a.done
	}
}

// op runs fenceline on this machine as the bus's operator.
func (e *env) op(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, e.fl, append([]string{"--nats", e.busURL, "--creds", e.creds}, args...)...)
	cmd.Env = append(os.Environ(), "XDG_STATE_HOME="+filepath.Join(e.dir, "state"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("fenceline %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (e *env) leaseState(ctx context.Context, id string) (string, error) {
	out, err := e.op(ctx, "lease", "list", "--all", "--json")
	if err != nil {
		return "", err
	}
	var ls []struct {
		LeaseID string `json:"leaseId"`
		State   string `json:"status"`
	}
	if err := json.Unmarshal([]byte(out), &ls); err != nil {
		return "", fmt.Errorf("lease list --json: %w: %s", err, out)
	}
	for _, l := range ls {
		if l.LeaseID == id {
			return l.State, nil
		}
	}
	return "", fmt.Errorf("lease %s not listed", id)
}

func (e *env) rtOut(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, e.rt, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w\n%s", e.rt, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// psql runs SQL as Postgres's superuser, directly (not through the fence).
func (e *env) psql(ctx context.Context, sql string) (string, error) {
	bin, err := pgtest.BinDir()
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "psql"), "-d", e.pg.AdminDSN(""), "-v", "ON_ERROR_STOP=1", "-qAtc", sql).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("psql: %w: %s", err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

// until polls cond every 50 ms until it holds or limit passes.
func (e *env) until(ctx context.Context, limit time.Duration, cond func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("not within %s", limit)
		case <-t.C:
		}
	}
	return nil
}

func seedRepo(ctx context.Context, dir, bare string) error {
	if _, err := gitOut(ctx, "", "init", "-q", "--initial-branch=main", dir); err != nil {
		return err
	}
	for p, c := range map[string]string{"services/billing/invoice.go": "package billing\n", "libs/tax/rates.go": "package tax\n"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			return err
		}
	}
	for _, args := range [][]string{{"add", "-A"}, {"commit", "-q", "-m", "seed"}, {"push", "-q", bare, "main"}} {
		if _, err := gitOut(ctx, dir, args...); err != nil {
			return err
		}
	}
	return nil
}

func gitOut(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=seed", "GIT_AUTHOR_EMAIL=seed@example.com",
		"GIT_COMMITTER_NAME=seed", "GIT_COMMITTER_EMAIL=seed@example.com", "GIT_CONFIG_NOSYSTEM=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("git %v: %w: %s", args, err, out)
	}
	return strings.TrimSpace(string(out)), nil
}

func chownR(root string, uid, gid int) error {
	return filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
}

func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return port, nil
}

// lockedWriter collects a child's stderr for the checks to read.
type lockedWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (w *lockedWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func lastLine(s string) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(ls[len(ls)-1])
}

func firstLine(s string) string {
	l, _, _ := strings.Cut(strings.TrimSpace(s), "\n")
	return l
}
