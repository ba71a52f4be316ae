package runui

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"time"
)

// Running is a run UI serving on its own listener.
type Running struct {
	srv  *Server
	http *http.Server
	url  string
	done chan error
}

// Listen serves the run UI on addr (host:port; port 0 picks a free one).
// Off loopback a token is required: cfg.Token, or a random one when it is
// empty; URL then carries it for the browser.
func Listen(addr string, cfg Config) (*Running, error) {
	if !Loopback(addr) && cfg.Token == "" {
		var b [18]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, fmt.Errorf("run UI token: %w", err)
		}
		cfg.Token = base64.RawURLEncoding.EncodeToString(b[:])
	}
	srv, err := New(cfg)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("run UI: listen on %s: %w (pick another --ui address)", addr, err)
	}
	u := url.URL{Scheme: "http", Host: ln.Addr().String(), Path: "/"}
	if cfg.Token != "" {
		u.RawQuery = url.Values{"token": {cfg.Token}}.Encode()
	}
	r := &Running{srv: srv, url: u.String(), done: make(chan error, 1),
		http: &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}}
	go func() { r.done <- r.http.Serve(ln) }()
	return r, nil
}

// URL is where a browser opens the UI (with its token, when one is needed).
func (r *Running) URL() string { return r.url }

// Close ends the event streams, then stops the server (waiting for the
// requests in flight until ctx ends).
func (r *Running) Close(ctx context.Context) error {
	r.srv.Close()
	err := r.http.Shutdown(ctx)
	if serr := <-r.done; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
