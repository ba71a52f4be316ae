package attempt

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/sidecar"
)

// ExitUnknown is the exit status reported when a command's end is not
// known (it never started, or its wait failed).
const ExitUnknown = 1

// CheckGuard reports whether the kernel can confine the agent's writes.
// Without Landlock it refuses, unless allowUnguarded, in which case the
// reason is returned as a warning for the caller to show.
func CheckGuard(name string, allowUnguarded bool) (warning, err error) {
	if _, err := fsguard.Available(); err != nil {
		if !allowUnguarded {
			return nil, fmt.Errorf("refusing to run %s without a file-write guard: %w", name, err)
		}
		return err, nil
	}
	return nil, nil
}

// SecretEnv names the variables of fenceline's own environment that no
// agent inherits: the git upstream's credential, the sidecar's admin
// token, the run UI's token.
var SecretEnv = []string{sidecar.EnvGitUpstreamHeader, sidecar.EnvAdminToken, runui.EnvToken}

// Env is the agent's environment: base without SecretEnv and the
// variables named in drop, routed through the fences by route, and
// naming the lease when leaseID is set. (The guard adds its own: a private TMPDIR, GIT_OPTIONAL_LOCKS=0
// so that read-only git never refreshes the index; see fsguard.Start.)
func Env(base, drop []string, route func([]string) []string, leaseID string) []string {
	env := slices.DeleteFunc(slices.Clone(base), func(kv string) bool {
		k, _, _ := strings.Cut(kv, "=")
		return slices.Contains(SecretEnv, k) || slices.Contains(drop, k)
	})
	if route != nil {
		env = route(env)
	}
	if leaseID != "" {
		env = SetEnv(env, "FENCELINE_LEASE_ID", leaseID)
	}
	return env
}

// SetEnv sets key to val in env, replacing every earlier value.
func SetEnv(env []string, key, val string) []string {
	env = slices.DeleteFunc(env, func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
	return append(env, key+"="+val)
}

// ConnectPorts is the sorted, deduplicated union of port lists.
func ConnectPorts(lists ...[]uint16) []uint16 {
	var ports []uint16
	for _, l := range lists {
		ports = append(ports, l...)
	}
	slices.Sort(ports)
	return slices.Compact(ports)
}

// LocalPorts are the ports of the addresses (host:port or URLs, a NATS
// URL list) that name this host's loopback: a local service the sidecar
// or this process connects to, whose port the agent must not take while
// the service restarts (Policy.ReservedPorts). Others are skipped.
func LocalPorts(addrs ...string) []uint16 {
	var ports []uint16
	for _, list := range addrs {
		for _, a := range strings.Split(list, ",") {
			a = strings.TrimSpace(a)
			if u, err := url.Parse(a); err == nil && u.Host != "" {
				a = u.Host
			}
			host, port, err := net.SplitHostPort(a)
			if err != nil {
				continue
			}
			n, err := strconv.ParseUint(port, 10, 16)
			if err != nil || n == 0 {
				continue
			}
			if ip, err := netip.ParseAddr(host); host == "localhost" || (err == nil && ip.Unmap().IsLoopback()) {
				ports = append(ports, uint16(n))
			}
		}
	}
	return ConnectPorts(ports)
}

// socketOutsideWrites refuses a Unix socket path (a fence's upstream)
// that lies beneath a path the agent may write: the agent could remove
// the socket and bind its own there while the server restarts, and the
// fence would hand it what it sends the server. A host:port is not a path.
// field names the spec's field that gave sock.
func socketOutsideWrites(field, sock string, pol fsguard.Policy) error {
	if !filepath.IsAbs(sock) {
		return nil
	}
	real := filepath.Clean(sock)
	// The deepest existing ancestor, resolved: the socket may not exist yet.
	for dir, rest := real, ""; ; dir, rest = filepath.Dir(dir), filepath.Join(filepath.Base(dir), rest) {
		if r, err := filepath.EvalSymlinks(dir); err == nil {
			real = filepath.Join(r, rest)
			break
		}
		if dir == "/" {
			break
		}
	}
	writable := slices.Clone(pol.Writable)
	if pol.GitDirWritable {
		writable = append(writable, pol.GitDirs...)
		if len(pol.GitDirs) == 0 && pol.Root != "" {
			writable = append(writable, filepath.Join(pol.Root, ".git"))
		}
	}
	for _, w := range writable {
		if rel, err := filepath.Rel(w, real); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return fieldInvalid(field, sock, fmt.Errorf("lies beneath %s, which the agent may write: it could bind its own server there while the real one restarts; put the socket outside what the agent may write (its claim and the other paths it may write)", w))
		}
	}
	return nil
}

// Command is the agent's command, run in the checkout co: in the caller's
// directory when it lies in co (or, for a shard, the same directory of the
// shard when it lies in home, the checkout the shard was made from), else
// in co's root. Its stdin is this process's.
func Command(co, home *Checkout, argv, env []string, stdout, stderr io.Writer) (*exec.Cmd, error) {
	name := argv[0]
	if strings.Contains(name, "/") {
		abs, err := filepath.Abs(name)
		if err != nil {
			return nil, fmt.Errorf("command %s: %w", name, err)
		}
		name = abs
	}
	cmd := exec.Command(name, argv[1:]...)
	if cmd.Err != nil {
		return nil, fmt.Errorf("command %s: %w", argv[0], cmd.Err)
	}
	cmd.Dir = co.Root
	if wd, err := os.Getwd(); err == nil {
		if real, err := filepath.EvalSymlinks(wd); err == nil && Within(real, co.Root) {
			cmd.Dir = real
		} else if err == nil && home != nil && Within(real, home.Root) {
			// The same directory in the shard, when it is there.
			rel, _ := filepath.Rel(home.Root, real)
			if fi, err := os.Stat(filepath.Join(co.Root, rel)); err == nil && fi.IsDir() {
				cmd.Dir = filepath.Join(co.Root, rel)
			}
		}
	}
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
	return cmd, nil
}

// Process is an attempt's command started under the guard, with the
// terminal relay that gives an interactive agent a terminal of its own
// (see terminal.go) until it is waited for.
type Process struct {
	*fsguard.Process
	term *terminal
}

// Start starts cmd under the guard's policy p, the gate that says whether
// the lease still holds and the auditor of its refusals (see
// fsguard.Start), on a terminal of its own when run's stdin is a terminal
// in whose foreground run is.
func Start(ctx context.Context, p fsguard.Policy, gate fsguard.Gate, audit fsguard.Auditor, cmd *exec.Cmd) (*Process, error) {
	term, err := giveTerminal(cmd)
	if err != nil {
		return nil, err
	}
	pr, err := fsguard.Start(ctx, p, gate, audit, cmd)
	if err != nil {
		term.close()
		return nil, err
	}
	if err := term.run(); err != nil {
		pr.Kill()
		pr.Wait()
		term.close()
		return nil, err
	}
	return &Process{Process: pr, term: term}, nil
}

// Wait waits until every process of the attempt is gone, ends the
// terminal relay, and returns the command's exit status (see ExitStatus).
func (p *Process) Wait() (code int, err error) {
	st, err := p.Process.Wait()
	p.term.close()
	return ExitStatus(st), err
}

// ExitStatus is the shell's view of how a command ended: its exit code, or
// 128+N when signal N killed it.
func ExitStatus(st *os.ProcessState) int {
	if st == nil {
		return ExitUnknown
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return st.ExitCode()
}
