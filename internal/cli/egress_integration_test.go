//go:build integration

package cli

import (
	"net"
	"strings"
	"testing"
)

// TestRunEgressGitForward: with --git-forward the agent's git keeps its
// https remote and reaches it through the egress proxy, which serves the
// git host with the git fence (a local CA's certificate, trusted for that
// host only).
func TestRunEgressGitForward(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	script := `echo '// v3' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "forwarded" && git push -q origin main && echo push=ok
env | grep -c '^GIT_CONFIG_KEY_.*=http\..*\.proxy$'`
	r := runFL(t, busURL, append(w.args("--git-forward"), "--", "bash", "-c", script)...).want(t, ExitOK)
	if got := strings.Fields(r.stdout); len(got) != 2 || got[0] != "push=ok" || got[1] != "1" {
		t.Errorf("agent: %q, want push=ok and one http.<upstream>.proxy entry\nstderr:\n%s", r.stdout, r.stderr)
	}
	if got := w.upstreamMain(t); got != "forwarded" {
		t.Errorf("upstream main: %q, want the pushed commit", got)
	}
}

// TestAgentEgressThroughSidecar: in a pod, the sidecar's egress proxy
// travels to "fenceline agent" with its fences: the agent's curl reaches
// the allowed host through it (TLS verified end to end), is refused for
// another, and cannot connect to the host's port directly. An agent
// --allow-host the sidecar does not allow stops the wrapper before CMD.
func TestAgentEgressThroughSidecar(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	co := newCheckout(t, "")
	sc := startSidecar(t, busURL, "--repo", testRepo, "--scope", "in", "--state-dir", t.TempDir(),
		"--allow-host", "api.example.test", "--egress-resolve", "api.example.test:443="+w.api,
		"--egress-resolve", "other.example.test:443="+w.api)
	mustContain(t, "sidecar stdout", sc.out.String(), "egress proxy: http://127.0.0.1:", "HTTPS_PROXY=http://127.0.0.1:")
	_, apiPort, _ := net.SplitHostPort(w.api)
	script := `curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/pod && echo api=ok || echo api=failed
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://other.example.test/ 2>/dev/null && echo other=reached || echo other=refused
exec 3<>/dev/tcp/127.0.0.1/` + apiPort + ` 2>/dev/null && echo api-direct=connected || echo api-direct=refused`
	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--allow-host", "api.example.test", "--", "bash", "-c", script)
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d\n%s", code, r.errOut)
	}
	const want = "model says hi on /pod api=ok other=refused api-direct=refused"
	if got := strings.Join(strings.Fields(r.out.String()), " "); got != want {
		t.Errorf("agent: %s\nwant   %s\nstderr:\n%s\nsidecar:\n%s", got, want, r.errOut, sc.errOut)
	}

	r2 := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--allow-host", "api.openai.com", "--", "true")
	if code := r2.wait(t); code != ExitUsage {
		t.Fatalf("agent with a host the sidecar does not allow: exit %d, want %d\n%s", code, ExitUsage, r2.errOut)
	}
	mustContain(t, "agent stderr", r2.errOut.String(), "--allow-host api.openai.com: the sidecar's egress proxy does not allow it", "start the sidecar with --allow-host api.openai.com")
}
