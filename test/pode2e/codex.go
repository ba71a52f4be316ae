package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fenceline/fenceline/test/agents"
)

// modelHost is the scripted model's made-up name: the agent reaches it
// through the sidecar's egress proxy only, as it would its vendor's API.
const modelHost = "model.example.test"

// startModel serves the scripted model (test/agents) over TLS for
// modelHost on this machine's loopback, with a CA of its own.
func (e *env) startModel() (stop func(), err error) {
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "pod-e2e model CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: modelHost}, DNSNames: []string{modelHost},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	e.modelCA = filepath.Join(e.dir, "model-ca.pem")
	if err := os.WriteFile(e.modelCA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644); err != nil {
		return nil, err
	}
	e.model = &agents.Model{Steps: []agents.Step{
		{Name: "in-claim", Cmd: "( echo codex > services/billing/codex.txt && echo STEP in=landed || echo STEP in=refused ) 2>&1"},
		{Name: "outside", Cmd: "( echo codex > libs/tax/codex.txt && echo STEP out=landed || echo STEP out=refused ) 2>&1"},
	}, Log: slog.New(slog.DiscardHandler)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	_, e.modelPort, _ = net.SplitHostPort(ln.Addr().String())
	srv := &http.Server{Handler: e.model.Handler(), ReadHeaderTimeout: time.Minute,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv.ServeTLS(ln, "", "")
	}()
	return func() { srv.Close(); <-done }, nil
}

// codexFiles puts the Codex binary and its CA where the agent container
// mounts them (/opt/codex) and its config (the scripted model as a custom
// provider, nothing else reached) in the agent's HOME.
func (e *env) codexFiles(dir, home string) error {
	if e.codex == "" {
		return nil
	}
	b, err := os.ReadFile(e.codex)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "codex"), b, 0o755); err != nil {
		return err
	}
	ca, err := os.ReadFile(e.modelCA)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "model-ca.pem"), ca, 0o644); err != nil {
		return err
	}
	cfg := `model = "scripted"
model_provider = "scripted"

[model_providers.scripted]
name = "scripted"
base_url = "https://` + modelHost + `:` + e.modelPort + `/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
metrics_exporter = "none"

[features]
plugins = false
unbounded_connection_retries = false
`
	if err := os.MkdirAll(filepath.Join(home, ".codex"), 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(home, ".codex", "config.toml"), []byte(cfg), 0o600)
}

// codexCheck: the real Codex CLI, run by the wrapped agent shell in the
// pod (so under the guard), edits in its claim, is refused outside it,
// and reaches its model through the egress proxy only.
func (e *env) codexCheck(ctx context.Context, p *pod, ag *agent) {
	co := filepath.Join(p.dir, "workspace", "payments")
	rc, out := ag.do(ctx, `CODEX_HOME=$HOME/.codex OPENAI_API_KEY=test-key CODEX_CA_CERTIFICATE=/opt/codex/model-ca.pem timeout 180 /opt/codex/codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --ephemeral --json "Work through the task the tools give you." < /dev/null 2>&1 | tail -c 3000; exit ${PIPESTATUS[0]}`)
	res := e.model.Results()
	in, _ := os.ReadFile(filepath.Join(co, "services/billing/codex.txt"))
	_, serr := os.Stat(filepath.Join(co, "libs/tax/codex.txt"))
	ok := rc == 0 && len(res) == 2 && strings.Contains(res[0], "STEP in=landed") && strings.Contains(res[1], "STEP out=refused") &&
		string(in) == "codex\n" && os.IsNotExist(serr)
	detail := fmt.Sprintf("codex exec exited %d; the model heard: in-claim %q, outside %q", rc, stepLine(res, 0), stepLine(res, 1))
	if !ok {
		detail += "\n" + out
	}
	e.check("codex-in-pod", ok, "%s", detail)
}

func stepLine(res []string, i int) string {
	if i >= len(res) {
		return "(no answer)"
	}
	for _, l := range strings.Split(res[i], "\n") {
		if strings.Contains(l, "STEP ") {
			return strings.TrimSpace(l[strings.Index(l, "STEP "):])
		}
	}
	return strings.TrimSpace(res[i])
}
