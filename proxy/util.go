package proxy

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"os"
)

func mkdirs(dirs ...string) error {
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("sidecar state: %w", err)
		}
	}
	return nil
}

// transportWithCA is the default transport trusting the CAs in file.
func transportWithCA(file string) (*http.Transport, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("git upstream CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("git upstream CA %s: no PEM certificates in it", file)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	return tr, nil
}
