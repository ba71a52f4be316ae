package sidecar

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"
)

func mkdirs(dirs ...string) error {
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("sidecar state: %w", err)
		}
	}
	return nil
}

// upstreamTransport is the default transport trusting the CAs in file
// (when set) and dialling pinned host:ports at their pinned address.
func upstreamTransport(file string, pins map[string]netip.AddrPort) (*http.Transport, error) {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.WriteBufferSize = 256 << 10 // packs go upstream in large writes (as gitproxy's default)
	tr.ReadBufferSize = 64 << 10
	if file != "" {
		pool, err := ReadCAFile(file)
		if err != nil {
			return nil, fmt.Errorf("git upstream CA: %w", err)
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	if len(pins) > 0 {
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
		tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			h, p, err := net.SplitHostPort(addr)
			if err == nil {
				if pin, ok := pins[net.JoinHostPort(strings.TrimSuffix(strings.ToLower(h), "."), p)]; ok {
					addr = pin.String()
				}
			}
			return d.DialContext(ctx, network, addr)
		}
	}
	return tr, nil
}
