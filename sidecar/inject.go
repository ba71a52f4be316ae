package sidecar

import (
	"bufio"
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/gitproxy"
)

// Credentials injected at the sidecar (--inject-header-file): the agent
// holds a placeholder key; the egress proxy opens that host's requests
// (TLS terminated with the sidecar's CA, whose key stays in the sidecar's
// state dir, hidden from the agent) and adds the real header. The agent's
// clients trust the CA through CABundleEnv.

// InjectSpec is one --inject-header-file value: HOST[:PORT]=FILE, FILE
// holding "Name: value" lines (blank lines and # comments skipped).
type InjectSpec struct {
	HostPort string // normalized host:port
	File     string
}

// ErrEgressCAUnused is the OptionError of EgressCAFile given without
// InjectHeaderFiles.
var ErrEgressCAUnused = errors.New("only the hosts of InjectHeaderFiles are verified with it")

// ParseInjectSpec reads one --inject-header-file value.
func ParseInjectSpec(s string) (InjectSpec, error) {
	host, file, ok := strings.Cut(s, "=")
	if !ok || host == "" || file == "" {
		return InjectSpec{}, fmt.Errorf("%q: want HOST[:PORT]=FILE, e.g. api.openai.com=/run/secrets/openai.headers", s)
	}
	hp, err := egress.HostPort(host)
	if err != nil {
		return InjectSpec{}, fmt.Errorf("%q: host %s: %w", s, host, err)
	}
	return InjectSpec{HostPort: hp, File: file}, nil
}

// ReadInjectHeaders reads a header file. Its values are credentials: an
// error names the file and the line, never a value.
func ReadInjectHeaders(file string) (http.Header, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	h := http.Header{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, err := gitproxy.ParseHeader(line)
		if err != nil {
			return nil, fmt.Errorf("%s line %d: %w", file, n, err)
		}
		h.Add(k, v)
	}
	if len(h) == 0 {
		return nil, fmt.Errorf("%s holds no header (want lines of \"Name: value\", e.g. \"Authorization: Bearer …\")", file)
	}
	return h, nil
}

// injections reads InjectHeaderFiles and EgressCAFile into
// the egress proxy's injections, with the API rules fenceline ships for
// each host (egress.RulesFor).
func injections(specs []string, caFile string) (map[string]egress.Injection, error) {
	if len(specs) == 0 {
		if caFile != "" {
			return nil, &OptionError{Option: "EgressCAFile", Value: caFile, Err: ErrEgressCAUnused}
		}
		return nil, nil
	}
	var roots *x509.CertPool
	if caFile != "" {
		var err error
		if roots, err = ReadCAFile(caFile); err != nil {
			return nil, &OptionError{Option: "EgressCAFile", Value: caFile, Err: err}
		}
	}
	out := map[string]egress.Injection{}
	for _, s := range specs {
		spec, err := ParseInjectSpec(s)
		if err != nil {
			return nil, &OptionError{Option: "InjectHeaderFiles", Err: err}
		}
		if _, dup := out[spec.HostPort]; dup {
			return nil, &OptionError{Option: "InjectHeaderFiles", Err: fmt.Errorf("%s is given twice: put all its headers in one file", spec.HostPort)}
		}
		h, err := ReadInjectHeaders(spec.File)
		if err != nil {
			return nil, &OptionError{Option: "InjectHeaderFiles", Err: err}
		}
		host, _, _ := net.SplitHostPort(spec.HostPort)
		out[spec.HostPort] = egress.Injection{Header: h, RootCAs: roots, API: egress.RulesFor(host)}
	}
	return out, nil
}

// InjectFiles are the header files of --inject-header-file values that
// parse: secrets the agent may not read.
func InjectFiles(specs []string) []string {
	var out []string
	for _, s := range specs {
		if spec, err := ParseInjectSpec(s); err == nil {
			out = append(out, spec.File)
		}
	}
	return out
}

// systemRoots are where Linux distributions keep the system's CA bundle
// (crypto/x509's list).
var systemRoots = []string{
	"/etc/ssl/certs/ca-certificates.crt",
	"/etc/pki/tls/certs/ca-bundle.crt",
	"/etc/ssl/ca-bundle.pem",
	"/etc/pki/tls/cacert.pem",
	"/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
	"/etc/ssl/cert.pem",
}

// writeCABundle writes, next to the CA certificate caFile, the bundle the
// agent's clients trust: the system's roots (or $SSL_CERT_FILE's) and the
// CA, so hosts tunnelled untouched still verify. It returns its path.
func writeCABundle(caFile string) (string, error) {
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return "", err
	}
	var roots []byte
	for _, f := range append([]string{os.Getenv("SSL_CERT_FILE")}, systemRoots...) {
		if f == "" {
			continue
		}
		if roots, err = os.ReadFile(f); err == nil {
			break
		}
	}
	bundle := filepath.Join(filepath.Dir(caFile), "agent-ca-bundle.pem")
	data := append(append(roots, '\n'), ca...)
	if err := os.WriteFile(bundle+".tmp", data, 0o644); err != nil {
		return "", err
	}
	return bundle, os.Rename(bundle+".tmp", bundle)
}

// caBundleVars are the variables common clients read their CA bundle
// from: OpenSSL and Go (SSL_CERT_FILE), curl, Python requests, Codex;
// Node adds NODE_EXTRA_CA_CERTS to its own.
var caBundleVars = []string{"SSL_CERT_FILE", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CODEX_CA_CERTIFICATE"}

// CABundleVars are the variables withCABundle sets (AgentEnv): files the
// agent must be able to read.
var CABundleVars = append(append([]string{}, caBundleVars...), "NODE_EXTRA_CA_CERTS")

// withCABundle points the agent's clients at bundle (and Node at the CA
// alone, which it adds to its own roots).
func withCABundle(env []string, bundle, caFile string) []string {
	out := make([]string, 0, len(env)+4)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.Contains(CABundleVars, k) {
			out = append(out, kv)
		}
	}
	for _, k := range caBundleVars {
		out = append(out, k+"="+bundle)
	}
	return append(out, "NODE_EXTRA_CA_CERTS="+caFile)
}

// LocalCA writes f's CA certificate (CAPEM) and a bundle of the system's
// roots with it into dir, and points f's CAFile and CABundle there: an
// agent beside the sidecar in another container cannot read the
// sidecar's own files. It does nothing without injected hosts.
func LocalCA(f *Fences, dir string) error {
	if f.CAPEM == "" {
		return nil
	}
	caFile := filepath.Join(dir, "fenceline-ca.pem")
	if err := os.WriteFile(caFile, []byte(f.CAPEM), 0o644); err != nil {
		return fmt.Errorf("write the sidecar's CA certificate: %w", err)
	}
	bundle, err := writeCABundle(caFile)
	if err != nil {
		return fmt.Errorf("write the agent's CA bundle: %w", err)
	}
	f.CAFile, f.CABundle = caFile, bundle
	return nil
}
