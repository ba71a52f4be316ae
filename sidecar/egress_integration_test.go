//go:build integration

package sidecar

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestEgressRealClients: with nothing but the sidecar's agent environment,
// curl, Python's urllib, a Go program and git reach an allowed host
// through the egress proxy with TLS verified end to end, and none of them
// reaches another host.
func TestEgressRealClients(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ca := testca.New(t)
	var seen sync.Map // paths the api server was asked for
	api := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Store(r.URL.Path, true)
		fmt.Fprintf(w, "hello %s", r.URL.Path)
	}))
	api.TLS = ca.ServerTLS(t, "api.example.test", "other.example.test")
	api.StartTLS()
	defer api.Close()
	bus := bustest.Start(t)
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "services/billing"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	addr := api.Listener.Addr().String()
	m := NewMetrics()
	sc, err := Start(ctx, Config{Lease: l.Holder, Bus: bus.Client, Audit: bus.Auditor, StateDir: t.TempDir(), Metrics: m,
		AllowHosts:    []string{"api.example.test"},
		EgressResolve: []string{"api.example.test:443=" + addr, "other.example.test:443=" + addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close(ctx)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	env := sc.AgentEnv([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "SSL_CERT_FILE=" + ca.File})
	clients := map[string]func(url string) []string{
		"curl": func(u string) []string {
			return []string{"curl", "-sS", "--fail", "--max-time", "10", "--cacert", ca.File, u}
		},
		"python": func(u string) []string {
			return []string{"python3", "-c", "import sys,urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())", u}
		},
		"go": func(u string) []string { return []string{"env", goClientEnv + "=" + u, self} },
		"git": func(u string) []string {
			return []string{"git", "-c", "http.sslCAInfo=" + ca.File, "ls-remote", u}
		},
	}
	for name, argv := range clients {
		t.Run(name, func(t *testing.T) {
			out, err := runClient(ctx, env, argv("https://api.example.test/"+name))
			if name == "git" {
				// Not a git server, but git got there, over verified TLS.
				if _, ok := seen.Load("/git/info/refs"); !ok {
					t.Fatalf("git through the proxy did not reach the host: %v\n%s", err, out)
				}
			} else if err != nil || out != "hello /"+name {
				t.Fatalf("allowed host: %v\n%s", err, out)
			}
			out, err = runClient(ctx, env, argv("https://other.example.test/"+name))
			if err == nil || strings.Contains(out, "hello") || !strings.Contains(out, "403") && !strings.Contains(out, "Forbidden") {
				t.Fatalf("other host: %v\n%s", err, out)
			}
		})
	}
	// Each client's tunnel counts as a request of boundary net; each
	// refusal as a refusal.
	if got := counter(t, m, "fenceline_proxy_requests_total", map[string]string{"boundary": "net"}); got < float64(len(clients)) {
		t.Errorf("net requests counted: %v, want >= %d", got, len(clients))
	}
	if got := counter(t, m, "fenceline_refusals_total", map[string]string{"boundary": "net", "reason": "not-allowed"}); got != float64(len(clients)) {
		t.Errorf("net refusals counted: %v, want %d", got, len(clients))
	}
}
