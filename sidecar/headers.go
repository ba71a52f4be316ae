package sidecar

import (
	"fmt"
	"net/http"
	"os"

	"github.com/fenceline/fenceline/gitproxy"
)

// EnvGitUpstreamHeader holds one more upstream git header, kept off the
// command line (the agent can read that); UpstreamHeaders reads it.
const EnvGitUpstreamHeader = "FENCELINE_GIT_UPSTREAM_HEADER"

// HeaderError is UpstreamHeaders' error for a header that does not parse.
// Header values are credentials: it names the header's place, never its
// value.
type HeaderError struct {
	// N is the header's number (from 1) among the lines, or 0 for the one
	// in $EnvGitUpstreamHeader.
	N   int
	Err error
}

func (e *HeaderError) Error() string {
	if e.N == 0 {
		return fmt.Sprintf("$%s: %v", EnvGitUpstreamHeader, e.Err)
	}
	return fmt.Sprintf("upstream header number %d: %v", e.N, e.Err)
}

func (e *HeaderError) Unwrap() error { return e.Err }

// UpstreamHeaders parses "Name: value" lines (gitproxy.ParseHeader), then
// the one in $EnvGitUpstreamHeader when set, into the headers the git
// fence adds to every upstream request (Config.GitUpstreamHeader). The
// first line that does not parse is a *HeaderError.
func UpstreamHeaders(lines []string) (http.Header, error) {
	h := http.Header{}
	for i, line := range lines {
		k, v, err := gitproxy.ParseHeader(line)
		if err != nil {
			return nil, &HeaderError{N: i + 1, Err: err}
		}
		h.Add(k, v)
	}
	if line := os.Getenv(EnvGitUpstreamHeader); line != "" {
		k, v, err := gitproxy.ParseHeader(line)
		if err != nil {
			return nil, &HeaderError{Err: err}
		}
		h.Add(k, v)
	}
	return h, nil
}
