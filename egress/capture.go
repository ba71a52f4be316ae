package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"
)

// CaptureHeader marks a CONNECT as a captured connection: the file
// guard's supervisor connected the agent's socket to the proxy instead of
// the address the agent chose (the CONNECT's authority, kept for the
// audit) and wrote this request before any byte of the agent's. The proxy
// answers nothing and judges what follows by its own content: the TLS
// server name or the HTTP Host header, dialled by that name. The request
// grants nothing a CONNECT would not: whoever sends it (the agent can
// reach the proxy's port) still reaches only names the allowlist allows.
const CaptureHeader = "Fenceline-Capture"

// sniffTimeout bounds how long a captured connection may take to show its
// first request or ClientHello.
const sniffTimeout = 30 * time.Second

// serveCaptured serves a captured connection: DNS over TCP for port 53,
// otherwise judged by the TLS ClientHello's server name or, for plain
// HTTP, each request's Host header.
func (p *Proxy) serveCaptured(w http.ResponseWriter, r *http.Request) {
	dst, err := netip.ParseAddrPort(r.Host)
	if err != nil {
		http.Error(w, "fenceline egress proxy: captured connection to "+r.Host+": want ADDR:PORT", http.StatusBadRequest)
		return
	}
	client, br, ok := p.hijack(w)
	if !ok {
		return
	}
	defer p.untrack(client)
	c := &bufConn{Conn: client, r: br}
	if dst.Port() == 53 {
		p.serveDNS(r.Context(), c)
		return
	}
	isTLS, name, replay, err := sniff(c)
	switch {
	case errors.Is(err, io.EOF):
		return // the agent closed without a byte: nothing to judge
	case err != nil:
		p.recordRefusal(r.Context(), "captured connection to "+dst.String(),
			&refusal{target: targetOf(dst), why: "it is neither TLS nor HTTP (" + err.Error() + ")",
				hint: "point the client at the egress proxy (HTTPS_PROXY) if it speaks another protocol"})
	case isTLS:
		p.serveCapturedTLS(r, replay, dst, name)
	default:
		p.serveCapturedHTTP(r, replay, dst) // judged per request
	}
}

// sniff reads the start of a captured stream: a TLS ClientHello (its
// server name, "" when it sends none) or an HTTP request line. What it
// read is replayed by the returned connection.
func sniff(c *bufConn) (isTLS bool, name string, replay *bufConn, err error) {
	c.SetReadDeadline(time.Now().Add(sniffTimeout))
	defer c.SetReadDeadline(time.Time{})
	first, err := c.r.Peek(1)
	if err != nil {
		return false, "", nil, io.EOF
	}
	// Copied: Peek's slice is the reader's buffer, which the reads below
	// refill (a ClientHello arriving after its first byte made it HTTP).
	isTLS = first[0] == 0x16 // a TLS handshake record
	var rec bytes.Buffer
	if isTLS {
		name, err = clientHelloName(io.TeeReader(c.r, &rec))
	} else {
		err = requestLine(io.TeeReader(c.r, &rec))
	}
	replay = &bufConn{Conn: c.Conn, r: bufio.NewReader(io.MultiReader(&rec, c.r))}
	return isTLS, name, replay, err
}

// serveCapturedTLS reaches the host a captured ClientHello names (by
// address when it names none), judged like a CONNECT to it at the port
// the agent chose, and pipes the stream there untouched; an intercepted
// or injected host is served by its handler.
func (p *Proxy) serveCapturedTLS(r *http.Request, c *bufConn, dst netip.AddrPort, name string) {
	t := targetOf(dst)
	if name != "" {
		var err error
		if t, err = newTarget(hostPort(name, int(dst.Port())), 0); err != nil {
			p.recordRefusal(r.Context(), "captured connection to "+dst.String(),
				&refusal{target: targetOf(dst), why: fmt.Sprintf("TLS server name %q: %v", name, err)})
			return
		}
	}
	if h, ok := p.intercept[t.String()]; ok {
		p.serveIntercepted(r, t, c, h)
		return
	}
	up, err := p.dial(r.Context(), t)
	var rf *refusal
	switch {
	case errors.As(err, &rf):
		p.recordRefusal(r.Context(), fmt.Sprintf("captured connection to %s (TLS server name %q)", dst, name), rf)
		return
	case err != nil:
		p.log.Warn("fenceline egress: cannot reach an allowed host", "target", t.String(), "captured", dst.String(), "err", err)
		return
	}
	p.shadow(r, t)
	if !p.track(up) {
		up.Close()
		return
	}
	defer p.untrack(up)
	p.pipe(c.Conn, c.r, up)
}

// targetOf is the target an address names by itself (judged by address).
func targetOf(ap netip.AddrPort) target {
	a := ap.Addr().Unmap()
	return target{host: a.String(), addr: a, port: int(ap.Port())}
}

// serveCapturedHTTP serves plain HTTP on a captured connection as if the
// agent had sent each request to the proxy (HTTP_PROXY): each request is
// judged by its Host header, at the port the agent connected to.
func (p *Proxy) serveCapturedHTTP(r *http.Request, c *bufConn, dst netip.AddrPort) {
	h := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		host := req.Host
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		if host == "" {
			host = dst.Addr().Unmap().String()
		}
		req.URL.Scheme, req.URL.Host = "http", hostPort(strings.Trim(host, "[]"), int(dst.Port()))
		p.ServeHTTP(w, req)
	})
	srv := &http.Server{Handler: h, ReadHeaderTimeout: sniffTimeout, ErrorLog: slog.NewLogLogger(p.log.Handler(), slog.LevelDebug),
		BaseContext: func(net.Listener) context.Context { return r.Context() }}
	srv.Serve(newConnListener(c)) // returns once the connection is done
}

// requestLine reads an HTTP/1 request line from r ("METHOD TARGET
// HTTP/1.x"), at most 8 KiB.
func requestLine(r io.Reader) error {
	line, err := bufio.NewReaderSize(io.LimitReader(r, 8<<10), 8<<10).ReadSlice('\n')
	if err != nil {
		return fmt.Errorf("no HTTP request line: %w", err)
	}
	f := strings.Fields(string(line))
	if len(f) != 3 || !strings.HasPrefix(f[2], "HTTP/1.") || strings.ToUpper(f[0]) != f[0] {
		return errors.New("no HTTP request line")
	}
	return nil
}

// errHelloRead ends the handshake once the ClientHello was read.
var errHelloRead = errors.New("client hello read")

// clientHelloName reads a TLS ClientHello from r and returns its server
// name ("" when it sends none). Nothing is written back.
func clientHelloName(r io.Reader) (string, error) {
	var name string
	var seen bool
	err := tls.Server(readOnlyConn{r: r}, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			name, seen = h.ServerName, true
			return nil, errHelloRead
		},
	}).Handshake()
	if seen {
		return strings.ToLower(strings.TrimSuffix(name, ".")), nil
	}
	return "", fmt.Errorf("no TLS ClientHello: %w", err)
}

// readOnlyConn is a net.Conn that reads from r and discards writes (the
// alert a failed handshake sends).
type readOnlyConn struct{ r io.Reader }

func (c readOnlyConn) Read(b []byte) (int, error)       { return c.r.Read(b) }
func (c readOnlyConn) Write(b []byte) (int, error)      { return len(b), nil }
func (c readOnlyConn) Close() error                     { return nil }
func (c readOnlyConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c readOnlyConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c readOnlyConn) SetDeadline(time.Time) error      { return nil }
func (c readOnlyConn) SetReadDeadline(time.Time) error  { return nil }
func (c readOnlyConn) SetWriteDeadline(time.Time) error { return nil }
