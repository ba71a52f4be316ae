package egress

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"testing"

	"github.com/fenceline/fenceline/gitproxy"
)

// BenchmarkRequest (issue 31): one small HTTPS request with a warm
// connection, made directly, through the proxy's plain tunnel (CONNECT,
// TLS end to end) and through an injected host (the proxy terminates TLS,
// adds the key, judges the call by the GitHub rules and forwards over its
// own TLS). Run side by side: go test -run '^$' -bench BenchmarkRequest
// ./egress/.
func BenchmarkRequest(b *testing.B) {
	f := startForge(b)
	local, localFile, err := gitproxy.LoadOrCreateCA(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	pem, err := os.ReadFile(localFile)
	if err != nil {
		b.Fatal(err)
	}
	proxyRoots := x509.NewCertPool()
	proxyRoots.AppendCertsFromPEM(pem)
	proxy := startProxy(b, Config{
		Allow: mustRules(b, "tunnel.example.test"),
		Inject: map[string]Injection{"api.github.com": {
			Header: http.Header{"Authorization": {"Bearer " + realToken}}, RootCAs: f.ca.Pool, API: GitHubRules}},
		Resolve: mustPins(b, "api.github.com:443="+f.addr, "tunnel.example.test:443="+f.addr),
		CA:      &local,
	})
	pu, _ := url.Parse(proxy)
	client := func(viaProxy bool, roots *x509.CertPool, name string) *http.Client {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: name}, MaxIdleConnsPerHost: 4}
		if viaProxy {
			tr.Proxy = http.ProxyURL(pu)
		} else {
			tr.DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, network, f.addr)
			}
		}
		b.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	cases := []struct {
		name string
		c    *http.Client
		url  string
		auth string
	}{
		{"direct", client(false, f.ca.Pool, "api.github.com"), "https://api.github.com/repos/acme/payments", "Bearer " + realToken},
		{"tunnel", client(true, f.ca.Pool, "api.github.com"), "https://tunnel.example.test/repos/acme/payments", "Bearer " + realToken},
		{"injected", client(true, proxyRoots, "api.github.com"), "https://api.github.com/repos/acme/payments", "Bearer placeholder"},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				req, _ := http.NewRequest("GET", c.url, nil)
				req.Header.Set("Authorization", c.auth)
				resp, err := c.c.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("%s: %d", c.name, resp.StatusCode)
				}
			}
		})
	}
}
