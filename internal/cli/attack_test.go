package cli

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

// TestRunHidesSiblingBusCredentials: $FENCELINE_CREDS may name one file
// (the holder's, used for every command) in a credentials directory that
// holds the other roles' files too, as `bus serve --store` writes them.
// Hiding only the named file left the service's and the operator's seeds
// beside it readable: a guarded agent could then act as the lease service.
func TestRunHidesSiblingBusCredentials(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	dir := bustest.CredsDir(t)
	setCfg(t, func(c *config) { c.Creds = filepath.Join(dir, leasebus.CredsFile(leasebus.RoleHolder)) })
	co := newCheckout(t, "")
	var script []string
	for _, role := range leasebus.Roles {
		p := filepath.Join(dir, leasebus.CredsFile(role))
		if data, err := os.ReadFile(p); err != nil || !strings.Contains(string(data), "NKEY SEED") {
			t.Fatalf("%s: %v", p, err) // readable outside the guard
		}
		script = append(script, fmt.Sprintf("cat %s || echo %s-unreadable", p, role))
	}
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", strings.Join(script, "; ")).want(t, ExitOK)
	if strings.Contains(r.stdout, "SEED") {
		t.Fatalf("the agent read bus credentials:\n%s", r.stdout)
	}
	for _, role := range leasebus.Roles {
		mustContain(t, "agent stdout", r.stdout, string(role)+"-unreadable")
	}
}

// TestRunAgentCannotReadParentSecrets: what the agent's environment leaves
// out (the upstream git credential) and what fenceline run holds in memory
// or open stays out of reach through /proc: Landlock keeps a sandboxed
// process from ptrace-class access (environ, mem, fd, maps) to processes
// outside its domain, and the agent inherits no descriptor but stdio.
func TestRunAgentCannotReadParentSecrets(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	const secret = "fenceline-attack-upstream-secret-4242"
	setCfg(t, func(c *config) { c.GitUpstreamHeader = "Authorization: Basic " + secret })
	co := newCheckout(t, "")
	// One process probes every other (a shell spawning cat, grep and dd
	// per process took longer than the run's deadline on a busy machine):
	// environ and open descriptors read (non-blocking, bounded), mem
	// opened (which needs ptrace access).
	probe := `import os, glob, sys
secret = sys.argv[1].encode()
skip = {os.getpid(), os.getppid()}
for p in glob.glob("/proc/[0-9]*"):
    if int(p[6:]) in skip:
        continue
    try:
        if secret in open(p + "/environ", "rb").read():
            print("environ-of-" + p)
    except OSError:
        pass
    try:
        fds = os.listdir(p + "/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            f = os.open(p + "/fd/" + fd, os.O_RDONLY | os.O_NONBLOCK)
            try:
                if secret in os.read(f, 65536):
                    print("fd-" + p + "/fd/" + fd)
            finally:
                os.close(f)
        except OSError:
            pass
    try:
        open(p + "/mem", "rb").close()
        print("mem-of-" + p)
    except OSError:
        pass
`
	script := `python3 -c '` + probe + `' ` + secret + `
ls -l /proc/self/fd/ | sed "s/^/fd: /"; env | grep -i -a "secret\|nk\|creds" | sed "s/^/env: /"
echo probed`
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "agent stdout", r.stdout, "probed")
	if strings.Contains(r.stdout, "environ-of") || strings.Contains(r.stdout, "fd-/proc") || strings.Contains(r.stdout, "mem-of") || strings.Contains(r.stdout, secret) {
		t.Fatalf("the agent read a secret of another process:\n%s", r.stdout)
	}
	t.Logf("agent: %s", r.stdout)
}

// TestRunHidesFenceSecretFiles: the Postgres fence's TLS key, which a
// flag may keep outside fenceline's state dir, is unreadable to the agent
// by name (reads elsewhere go on: the certificate beside the key stays
// readable); so is the state dir, where pg install keeps the database's
// secret. run takes no fence secret at all (--pg-secret-file is refused).
func TestRunHidesFenceSecretFiles(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	dir := t.TempDir()
	secretFile := pgproxy.DefaultSecretFile(stateDir(t))
	if err := pgproxy.WriteSecretFile(secretFile, bytes.Repeat([]byte{7}, 32)); err != nil {
		t.Fatal(err)
	}
	cert := testca.New(t).ServerTLS(t, "127.0.0.1").Certificates[0]
	keyDER, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600)
	probe := func(name, file string) string {
		return fmt.Sprintf("if cat %s >/dev/null 2>&1; then echo %s=read; else echo %s=hidden; fi", file, name, name)
	}
	script := strings.Join([]string{probe("secret", secretFile), probe("key", keyFile), probe("cert", certFile)}, "; ")
	runFL(t, url, "--checkout", co, "--scope", "in", "--pg-upstream", "127.0.0.1:1", "--pg-secret-file", secretFile,
		"--", "true").want(t, ExitUsage)
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--pg-upstream", "127.0.0.1:1",
		"--pg-tls-cert", certFile, "--pg-tls-key", keyFile, "--", "sh", "-c", script).want(t, ExitOK)
	if got := strings.Join(strings.Fields(r.stdout), " "); got != "secret=hidden key=hidden cert=read" {
		t.Errorf("the agent: %s, want the secret and the TLS key hidden, the certificate readable\n%s", got, r.stderr)
	}
}
