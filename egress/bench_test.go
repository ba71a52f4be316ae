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
// TLS end to end), through an injected host (the proxy terminates TLS,
// adds the key, judges the call by the GitHub rules and forwards over its
// own TLS) and through transparent capture (the client ignores the proxy;
// its connection arrives with the guard's capture preamble, the proxy
// reads the ClientHello's server name, dials that name and pipes it; to
// an injected host, the injection's path). The -new-conn cases open a
// connection per request: what a capture costs the proxy beyond a tunnel
// is per connection (the supervisor's part is fsguard's
// BenchmarkConnectCaptured). Run side by side: go test -run '^$' -bench
// BenchmarkRequest ./egress/.
func BenchmarkRequest(b *testing.B) {
	f := startForge(b)
	tf := startForgeFor(b, "tunnel.example.test")
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
		Resolve: mustPins(b, "api.github.com:443="+f.addr, "tunnel.example.test:443="+tf.addr),
		CA:      &local,
	})
	pu, _ := url.Parse(proxy)
	type via int
	const (
		direct via = iota
		viaProxy
		viaCapture
	)
	client := func(how via, roots *x509.CertPool, name string, newConn bool) *http.Client {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: name}, MaxIdleConnsPerHost: 4, DisableKeepAlives: newConn}
		switch how {
		case viaProxy:
			tr.Proxy = http.ProxyURL(pu)
		case viaCapture:
			// What the guard's supervisor does with a connect that skips
			// the proxy (fsguard.CapturePreamble).
			tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := (&net.Dialer{}).DialContext(ctx, network, pu.Host)
				if err != nil {
					return nil, err
				}
				dst := "203.0.113.7:443"
				if _, err := io.WriteString(c, "CONNECT "+dst+" HTTP/1.1\r\nHost: "+dst+"\r\n"+CaptureHeader+": 1\r\n\r\n"); err != nil {
					c.Close()
					return nil, err
				}
				return c, nil
			}
		default:
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
		{"direct", client(direct, f.ca.Pool, "api.github.com", false), "https://api.github.com/repos/acme/payments", "Bearer " + realToken},
		{"tunnel", client(viaProxy, tf.ca.Pool, "tunnel.example.test", false), "https://tunnel.example.test/repos/acme/payments", "Bearer " + realToken},
		{"injected", client(viaProxy, proxyRoots, "api.github.com", false), "https://api.github.com/repos/acme/payments", "Bearer placeholder"},
		{"capture", client(viaCapture, tf.ca.Pool, "tunnel.example.test", false), "https://tunnel.example.test/repos/acme/payments", "Bearer " + realToken},
		{"capture-injected", client(viaCapture, proxyRoots, "api.github.com", false), "https://api.github.com/repos/acme/payments", "Bearer placeholder"},
		{"direct-new-conn", client(direct, f.ca.Pool, "api.github.com", true), "https://api.github.com/repos/acme/payments", "Bearer " + realToken},
		{"tunnel-new-conn", client(viaProxy, tf.ca.Pool, "tunnel.example.test", true), "https://tunnel.example.test/repos/acme/payments", "Bearer " + realToken},
		{"capture-new-conn", client(viaCapture, tf.ca.Pool, "tunnel.example.test", true), "https://tunnel.example.test/repos/acme/payments", "Bearer " + realToken},
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
