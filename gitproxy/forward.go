package gitproxy

// The forward-proxy mode, for agents whose remotes are https:// URLs,
// lives in the sidecar's egress proxy (package egress): git reaches the
// git host through it (HTTPS_PROXY or http.proxy), and it answers the
// CONNECT itself, terminates TLS with a certificate for the host minted by
// the local CA below (which git trusts through http.sslCAInfo), and hands
// each request to the host's Proxy — the same fence as the reverse mode.
// CONNECTs to any other host are tunnelled only when the egress allowlist
// names it.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"time"
)

// LoadOrCreateCA returns the local CA kept in dir (ca.pem and ca-key.pem),
// creating it on first use. Git is told to trust ca.pem for the intercepted
// hosts only; the key never leaves dir (mode 0600).
func LoadOrCreateCA(dir string) (ca tls.Certificate, certFile string, err error) {
	certFile = filepath.Join(dir, "ca.pem")
	keyFile := filepath.Join(dir, "ca-key.pem")
	if ca, err = tls.LoadX509KeyPair(certFile, keyFile); err == nil {
		ca.Leaf, err = x509.ParseCertificate(ca.Certificate[0])
		return ca, certFile, err
	}
	if !errors.Is(err, os.ErrNotExist) {
		return ca, "", fmt.Errorf("load fenceline CA from %s: %w", dir, err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return ca, "", fmt.Errorf("generate CA key: %w", err)
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "fenceline local git CA", Organization: []string{"fenceline"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(1, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return ca, "", fmt.Errorf("create CA certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return ca, "", fmt.Errorf("encode CA key: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return ca, "", fmt.Errorf("create CA dir: %w", err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return ca, "", fmt.Errorf("write CA key: %w", err)
	}
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return ca, "", fmt.Errorf("write CA certificate: %w", err)
	}
	return LoadOrCreateCA(dir)
}
