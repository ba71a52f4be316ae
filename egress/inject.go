package egress

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"slices"
	"strings"
	"time"
)

// Injection is what the proxy does for one host whose requests it opens
// instead of tunnelling them: it terminates the agent's TLS with a
// certificate its CA mints, judges each request by the API rules, sets
// Header on it (replacing whatever the agent sent under those names: the
// agent holds a placeholder, never the credential) and forwards it over
// TLS verified against RootCAs. The credential lives in the proxy only.
type Injection struct {
	// Header is set on every forwarded request.
	Header http.Header
	// RootCAs verify the host (nil: the system's).
	RootCAs *x509.CertPool
	// API are the rules requests to the host are judged by (nil: none;
	// see GitHubRules and GitLabRules).
	API []APIRule
}

// maxJudgedBody bounds the request body read to judge a GraphQL call; a
// larger one to a GraphQL endpoint is refused.
const maxJudgedBody = 1 << 20

// injector serves one injected host (see Injection).
type injector struct {
	p     *Proxy
	t     target
	inj   Injection
	tr    *http.Transport
	proxy *httputil.ReverseProxy
	// secrets are the injected values (and their credentials without a
	// scheme): never echoed back to the agent in a response header.
	secrets []string
}

func (p *Proxy) newInjector(t target, inj Injection) *injector {
	in := &injector{p: p, t: t, inj: inj}
	for _, vs := range inj.Header {
		for _, v := range vs {
			// The value, and its credential without an auth scheme
			// ("Bearer ", "token ", "Basic ") an upstream may echo alone.
			_, cred, _ := strings.Cut(v, " ")
			for _, s := range []string{v, strings.TrimSpace(cred)} {
				if len(s) >= 8 {
					in.secrets = append(in.secrets, s)
				}
			}
		}
	}
	in.tr = &http.Transport{
		Proxy:                 nil,
		DialContext:           in.dial,
		TLSClientConfig:       &tls.Config{RootCAs: inj.RootCAs, ServerName: t.host, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          8,
		IdleConnTimeout:       30 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 5 * time.Minute,
	}
	upstream := t.host
	if t.port != DefaultPort {
		upstream = t.String()
	}
	in.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host, pr.Out.Host = "https", upstream, upstream
			pr.Out.Header.Del("Proxy-Authorization")
			for k := range inj.Header {
				pr.Out.Header.Del(k)
			}
			for k, vs := range inj.Header {
				pr.Out.Header[k] = slices.Clone(vs)
			}
		},
		Transport:      in.tr,
		ModifyResponse: in.scrub,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			var rf *refusal
			if errors.As(err, &rf) {
				p.refuse(w, r, rf)
				return
			}
			p.log.Warn("fenceline egress: cannot reach an injected host", "target", t.String(), "err", err)
			http.Error(w, "fenceline egress proxy: "+t.String()+": "+err.Error(), http.StatusBadGateway)
		},
	}
	return in
}

// dial connects to the injected host itself, whatever the agent's request
// named: resolved and judged like any host (never one of this machine's
// addresses unless pinned).
func (in *injector) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, in.p.cfg.DialTimeout)
	defer cancel()
	ap, err := in.p.resolve(ctx, in.t)
	if err != nil {
		return nil, err
	}
	c, err := in.p.cfg.Dial(ctx, "tcp", ap.String())
	if err != nil {
		return nil, fmt.Errorf("connect to %s (%s): %w", in.t, ap, err)
	}
	return c, nil
}

// scrub drops response headers that carry an injected value back (an
// upstream echoing its request): the agent never sees the credential.
func (in *injector) scrub(resp *http.Response) error {
	in.scrubHeader(resp.Header)
	return nil
}

func (in *injector) scrubHeader(h http.Header) {
	for k, vs := range h {
		for _, v := range vs {
			if slices.ContainsFunc(in.secrets, func(s string) bool { return strings.Contains(v, s) }) {
				delete(h, k)
				break
			}
		}
	}
}

// scrubWriter scrubs every header block written to the agent: the
// informational (1xx) ones the reverse proxy relays before the response
// (ModifyResponse never sees them) as well as the response's own.
type scrubWriter struct {
	http.ResponseWriter
	in *injector
}

func (w *scrubWriter) WriteHeader(code int) {
	w.in.scrubHeader(w.Header())
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController flush the writer underneath.
func (w *scrubWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (in *injector) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// The security team's policy judges the host like any connect.
	if rf := in.p.policyAllows(in.t); rf != nil {
		in.p.refuse(w, r, rf)
		return
	}
	in.p.shadow(r, in.t)
	if r.Header.Get("Upgrade") != "" {
		// A protocol switch (websocket) would carry requests the rules
		// never see.
		in.p.refuse(w, r, &refusal{target: in.t, why: "a protocol upgrade (" + r.Header.Get("Upgrade") + ") to a host whose requests are judged one by one",
			hint: "use plain HTTP requests to it"})
		return
	}
	if len(in.inj.API) > 0 {
		rule, call, err := judgeAPI(in.inj.API, r, in.p.lease())
		if err != nil {
			in.p.refuse(w, r, &refusal{target: in.t, why: err.Error(), hint: "send a request the proxy can judge"})
			return
		}
		if rule != nil {
			in.p.refuse(w, r, &refusal{target: in.t,
				why:  fmt.Sprintf("%s is refused by API rule %s (%s): it moves refs or writes content past the git fence and the lease", call, rule.Name, rule.What),
				hint: "push through the git fence, under a lease that claims the paths; reading, issues, comments and opening a pull request stay allowed"})
			return
		}
	}
	in.proxy.ServeHTTP(&scrubWriter{ResponseWriter: w, in: in}, r)
	// Trailers are set in the header map after the body and sent once the
	// handler returns: scrub them too.
	in.scrubHeader(w.Header())
}

// judgedBody reads r's body for judging (up to maxJudgedBody) and puts it
// back for forwarding.
func judgedBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, maxJudgedBody+1))
	r.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("read the request body: %w", err)
	}
	if len(b) > maxJudgedBody {
		return nil, fmt.Errorf("a request body over %d bytes cannot be judged", maxJudgedBody)
	}
	r.Body = io.NopCloser(bytes.NewReader(b))
	r.ContentLength = int64(len(b))
	r.Header.Del("Transfer-Encoding")
	r.TransferEncoding = nil
	return b, nil
}
