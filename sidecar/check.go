package sidecar

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"strings"

	"github.com/fenceline/fenceline/gitproxy"
)

// CheckGitUpstream reports what is wrong with a git upstream as Start takes
// it (Config.GitUpstream and Config.GitForward): an http:// or https://
// URL of the git server with a host, https in forward mode. It needs no
// lease, so a command checks its flags with it before taking one.
func CheckGitUpstream(raw string, forward bool) error {
	_, err := splitUpstream(raw, forward)
	return err
}

// splitUpstream parses a git remote URL: the fence proxies its server, and
// its path (when given) is the one repository whose git endpoints it serves.
func splitUpstream(raw string, forward bool) (*url.URL, error) {
	u, err := gitproxy.ParseUpstream(raw)
	if err != nil {
		return nil, err
	}
	base := &url.URL{Scheme: u.Scheme, Host: u.Host, User: u.User, Path: strings.TrimSuffix(u.Path, "/")}
	if forward && base.Scheme != "https" {
		return nil, fmt.Errorf("upstream %q: %w", raw, ErrForwardHTTP)
	}
	return base, nil
}

// ReadCAFile reads a PEM CA bundle (Config.GitUpstreamCAFile); a file
// without a certificate is an error.
func ReadCAFile(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s holds no PEM certificate", file)
	}
	return pool, nil
}

// CheckListen reports what is wrong with a listen address (host:port, the
// port a number or a service name; an empty host is every interface).
func CheckListen(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("want host:port, e.g. 127.0.0.1:0: %w", err)
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return fmt.Errorf("want host:port with a port number, e.g. 127.0.0.1:0: %w", err)
	}
	return nil
}

// ErrForwardHTTP is the error of an http upstream with GitForward.
var ErrForwardHTTP = errors.New("forward mode (GitForward) is for https remotes; an http remote goes through the reverse proxy")

// ErrNeedsToken is why an admin server off loopback will not start
// without a token (AdminConfig.Token).
var ErrNeedsToken = errors.New("the admin API needs a bearer token off loopback: set AdminConfig.Token, or listen on loopback (AdminConfig.Listen 127.0.0.1:PORT)")

// offLoopback reports whether a listen host is known, without resolving
// it, to be no loopback address: every interface, or an IP literal.
func offLoopback(host string) bool {
	if host == "" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && !a.IsLoopback()
}
