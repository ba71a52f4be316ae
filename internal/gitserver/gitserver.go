// Package gitserver serves bare repositories over git's smart HTTP with the
// real git http-backend, on 127.0.0.1: the git server of fenceline's demo
// and of the tests that push through the git fence.
package gitserver

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/cgi"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Server is a running git http-backend.
type Server struct {
	Root string // directory of the served repositories
	URL  string // http://127.0.0.1:PORT
	srv  *http.Server
	done chan struct{}
}

// Handler serves the repositories under root with git http-backend; env is
// added to the CGI environment.
func Handler(root string, env ...string) (http.Handler, error) {
	out, err := exec.Command("git", "--exec-path").Output()
	if err != nil {
		return nil, fmt.Errorf("gitserver: git is needed (git --exec-path: %w)", err)
	}
	backend := filepath.Join(strings.TrimSpace(string(out)), "git-http-backend")
	if _, err := os.Stat(backend); err != nil {
		return nil, fmt.Errorf("gitserver: git http-backend not found: %w", err)
	}
	return spoolChunked(&cgi.Handler{
		Path: backend,
		Env: append([]string{
			"GIT_PROJECT_ROOT=" + root,
			"GIT_HTTP_EXPORT_ALL=1",
			"GIT_CONFIG_NOSYSTEM=1",
			"HOME=" + root,
		}, env...),
		InheritEnv: []string{"PATH"},
	}), nil
}

// spoolChunked buffers a chunked request body to a temporary file before
// the CGI runs, as nginx does by default in front of git http-backend: Go's
// CGI handler refuses bodies without a length, and git sends pushes over
// 1 MiB chunked.
func spoolChunked(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength >= 0 || r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		f, err := os.CreateTemp("", "gitserver-body-")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(f.Name())
		defer f.Close()
		n, err := io.Copy(f, r.Body)
		if err == nil {
			_, err = f.Seek(0, io.SeekStart)
		}
		if err != nil {
			http.Error(w, "read request body: "+err.Error(), http.StatusBadRequest)
			return
		}
		r.Body, r.ContentLength = f, n
		r.TransferEncoding = nil
		h.ServeHTTP(w, r)
	})
}

// Start serves the repositories under root on a free loopback port.
func Start(root string, env ...string) (*Server, error) {
	h, err := Handler(root, env...)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("gitserver: %w", err)
	}
	s := &Server{Root: root, URL: "http://" + ln.Addr().String(), done: make(chan struct{})}
	s.srv = &http.Server{Handler: h, ReadHeaderTimeout: time.Minute}
	go func() {
		defer close(s.done)
		s.srv.Serve(ln)
	}()
	return s, nil
}

// Close stops the server.
func (s *Server) Close() error {
	err := s.srv.Close()
	<-s.done
	return err
}

// NewRepo creates a bare repository name.git... under Root that accepts
// pushes and push options, and returns its directory.
func (s *Server) NewRepo(name string) (string, error) { return NewBare(filepath.Join(s.Root, name)) }

// NewBare creates a bare repository at dir that accepts smart-HTTP pushes
// and advertises push options (so the fence can travel as one).
func NewBare(dir string) (string, error) {
	for _, args := range [][]string{
		{"init", "--quiet", "--bare", "--initial-branch=main", dir},
		{"-C", dir, "config", "http.receivepack", "true"},
		{"-C", dir, "config", "receive.advertisePushOptions", "true"},
	} {
		if out, err := exec.Command("git", args...).CombinedOutput(); err != nil {
			return "", fmt.Errorf("gitserver: git %s: %w: %s", args[0], err, bytes.TrimSpace(out))
		}
	}
	return dir, nil
}

// InstallHook installs a hook script in a bare repository.
func InstallHook(bare, name, script string) error {
	if name == "" || strings.ContainsRune(name, '/') {
		return errors.New("gitserver: bad hook name")
	}
	return os.WriteFile(filepath.Join(bare, "hooks", name), []byte(script), 0o755)
}

// ClientEnv is a clean environment for a git client: home (so no user
// config is read), no system config, no prompts, and name as author and
// committer. Add the routing env of a sidecar after it.
func ClientEnv(home, name string) []string {
	return []string{
		"HOME=" + home, "PATH=" + os.Getenv("PATH"), "GIT_CONFIG_NOSYSTEM=1", "GIT_TERMINAL_PROMPT=0",
		"GIT_AUTHOR_NAME=" + name, "GIT_AUTHOR_EMAIL=" + name + "@example.com",
		"GIT_COMMITTER_NAME=" + name, "GIT_COMMITTER_EMAIL=" + name + "@example.com",
	}
}
