package sidecar

import (
	"fmt"
	"net/http"

	"github.com/fenceline/fenceline/gitproxy"
)

// EnvGitUpstreamHeader holds one more upstream git header, kept off the
// command line (the agent can read that): the CLI passes it as
// FenceOptions.GitUpstreamSecretHeader.
const EnvGitUpstreamHeader = "FENCELINE_GIT_UPSTREAM_HEADER"

// HeaderError is UpstreamHeaders' error for a header that does not parse.
// Header values are credentials: it names the header's place, never its
// value.
type HeaderError struct {
	// N is the header's number (from 1) among the lines, or 0 for the
	// secret one (FenceOptions.GitUpstreamSecretHeader).
	N   int
	Err error
}

func (e *HeaderError) Error() string {
	if e.N == 0 {
		return fmt.Sprintf("the upstream header kept off the command line (GitUpstreamSecretHeader): %v", e.Err)
	}
	return fmt.Sprintf("upstream header number %d: %v", e.N, e.Err)
}

func (e *HeaderError) Unwrap() error { return e.Err }

// UpstreamHeaders parses "Name: value" lines (gitproxy.ParseHeader), then
// secret when it is not empty, into the headers the git fence adds to
// every upstream request (Config.GitUpstreamHeader). The first line that
// does not parse is a *HeaderError.
func UpstreamHeaders(lines []string, secret string) (http.Header, error) {
	h := http.Header{}
	for i, line := range lines {
		k, v, err := gitproxy.ParseHeader(line)
		if err != nil {
			return nil, &HeaderError{N: i + 1, Err: err}
		}
		h.Add(k, v)
	}
	if secret != "" {
		k, v, err := gitproxy.ParseHeader(secret)
		if err != nil {
			return nil, &HeaderError{Err: err}
		}
		h.Add(k, v)
	}
	return h, nil
}
