package gitproxy

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// ParseUpstream parses the URL of a smart-HTTP git server as
// Config.Upstream takes it: http:// or https://, with a host. The URL may
// name a repository on the server (https://git.example.com/acme/app.git).
func ParseUpstream(raw string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return nil, fmt.Errorf("upstream %q: want an http:// or https:// URL of the git server, e.g. https://git.example.com/acme/payments.git", raw)
	}
	return u, nil
}

// ParseHeader parses one header line, "Name: value", as
// Config.UpstreamHeader holds them: the name is an HTTP token, the value
// has no control characters but tabs (a line break would smuggle another
// header into the upstream request).
func ParseHeader(line string) (name, value string, err error) {
	k, v, ok := strings.Cut(line, ":")
	name, value = strings.TrimSpace(k), strings.TrimSpace(v)
	switch {
	case !ok || name == "":
		return "", "", errors.New(`want "Name: value"`)
	case !isToken(name):
		// Not quoted back: a line missing the colon after its name has the
		// credential in this part when the credential holds a colon.
		return "", "", fmt.Errorf(`the header name (the %d characters before the first ":") is not an HTTP token: want "Name: value"`, len(name))
	case strings.ContainsFunc(value, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }):
		return "", "", errors.New(`the value holds a control character: want "Name: value" on one line`)
	}
	return name, value, nil
}

// isToken reports whether s is an HTTP token (RFC 9110, 5.6.2).
func isToken(s string) bool {
	for _, r := range s {
		switch {
		case 'a' <= r && r <= 'z', 'A' <= r && r <= 'Z', '0' <= r && r <= '9':
		case strings.ContainsRune("!#$%&'*+-.^_`|~", r):
		default:
			return false
		}
	}
	return s != ""
}
