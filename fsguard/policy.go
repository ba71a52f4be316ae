package fsguard

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Gate says whether the lease allows writes right now (lease.Gate;
// *leasebus.Holder is one): a nil error means writes are allowed (the
// token is informational here), ErrLeaseLost or ErrLeaseUnknown means
// every write-class system call is refused from now on.
type Gate = lease.Gate

// Auditor records denied writes (lease.Auditor; *leasebus.Auditor is one).
type Auditor = lease.Auditor

// ErrNoLandlock means the kernel cannot enforce the write boundary; Start
// refuses to run unless Policy.AllowUnguarded is set.
var ErrNoLandlock = errors.New("landlock unavailable")

// DefaultRepoWideGit are the git subcommands the shim refuses in a shared
// workspace: every one changes the repository as a whole (HEAD, the index,
// refs or the object store), not just files of the caller's claim.
var DefaultRepoWideGit = []string{
	"stash", "reset", "checkout", "switch", "commit", "push", "rebase", "merge",
	"cherry-pick", "revert", "am", "pull", "fetch", "gc", "worktree", "prune", "repack",
	"update-ref", "symbolic-ref", "branch -d", "tag -d", "add", "rm", "mv",
}

// Policy is what a guarded attempt may do. The zero value (plus a command)
// is the strictest guard: nothing writable but the private temp dir and
// a few devices, every path readable, no TCP connect, no git shim.
type Policy struct {
	// Root is the attempt's worktree (the shard or checkout). It is only
	// writable when it is listed in Writable; it names the git dir default.
	Root string
	// Writable are absolute files or directories the attempt may write
	// beneath: its leased paths under Root, caches, extra paths. A shared
	// workspace must not list Root or a git dir (Validate refuses it).
	Writable []string
	// GitDirs are the worktree's git directories (default Root/.git).
	// GitDirWritable adds them to Writable: an exclusive workspace commits.
	GitDirs        []string
	GitDirWritable bool
	// Hidden are absolute paths the attempt may not read (the sidecar's
	// credentials). Directory names along them stay listable.
	Hidden []string
	// ConnectPorts are the TCP ports on the loopback the attempt may
	// connect to (the sidecar's, plus the policy's allowlist): every
	// connect is judged by the supervisor on its own copy of the address
	// (and by Landlock's port rule with ABI >= 4). Other hosts are reached
	// through the sidecar's egress proxy. AllowAnyConnect allows TCP to
	// any address and UDP sockets; it does not open Unix sockets.
	ConnectPorts    []uint16
	AllowAnyConnect bool
	// Capture is the egress proxy's address (loopback). When set, a TCP
	// connect to any address but the loopback's, or to port 53 anywhere,
	// is connected to the proxy instead, announced with CapturePreamble
	// naming the address the agent chose; the proxy judges the stream by
	// its TLS server name or HTTP Host header (DNS over TCP for port 53)
	// and dials that name. A UDP socket is then made in a sealed network
	// whose port 53 (any address) the proxy answers as DNS and where
	// nothing else is reached. Zero: such connects and UDP are refused.
	Capture netip.AddrPort
	// BindPorts are the fixed TCP ports the attempt may bind and listen
	// on (a dev server's). A port the kernel chooses (bind to port 0, or
	// listen with no bind: test servers) is always allowed; every other
	// fixed port is refused, because the attempt shares its network
	// namespace with the sidecar and every other container of a pod, and
	// a port it holds is one their clients would reach after a restart.
	BindPorts []uint16
	// ReservedPorts are ports of trusted local services the attempt may
	// not connect to but must never take either: the sidecar's admin
	// port, which the agent wrapper asks for the lease, a local upstream.
	// ConnectPorts are reserved too: whoever listens there is trusted by
	// the attempt. A reserved port is refused to bind and to listen on,
	// by the supervisor and by Landlock (ABI >= 4), even when the kernel
	// chose it.
	ReservedPorts []uint16
	// UnixSockets are the absolute paths of the Unix sockets the attempt
	// may connect to (a local Postgres, the sidecar's). A socket is judged
	// by the file the path names when the agent connects (device and
	// inode), however the agent spells it; abstract sockets are refused.
	UnixSockets []string
	// TempRoot is where the attempt's private temp dir is made (default
	// os.TempDir()); the dir is TMPDIR for the attempt and removed after it.
	TempRoot string
	// Lease names the lease in denials, audit events and the git shim.
	Lease lease.Lease
	// GitShim puts a git shim first on the attempt's PATH that refuses
	// GitDenied (default DefaultRepoWideGit; entries may be "branch -d") with
	// a message naming the lease. RealGit is the git it runs otherwise
	// (default: git on PATH).
	GitShim   bool
	GitDenied []string
	RealGit   string
	// KillGrace is how long the attempt has between SIGTERM (on context
	// cancel) and SIGKILL of its whole process tree (default 10 s).
	KillGrace time.Duration
	// AllowUnguarded runs the command without Landlock when the kernel has
	// none (loudly logged). Never set it by default.
	AllowUnguarded bool
	// Logger receives operational logs (default: discard).
	Logger *slog.Logger
}

// Validate reports a policy that cannot be enforced as written, naming the
// field and what to do.
func (p *Policy) Validate() error {
	if p.Root != "" && !filepath.IsAbs(p.Root) {
		return fmt.Errorf("policy root %q: must be an absolute path", p.Root)
	}
	for _, w := range p.Writable {
		if !filepath.IsAbs(w) {
			return fmt.Errorf("policy writable path %q: must be an absolute path", w)
		}
		if filepath.Clean(w) == "/" {
			return fmt.Errorf("policy writable path %q: the whole filesystem cannot be writable", w)
		}
		if _, err := os.Stat(w); err != nil {
			return fmt.Errorf("policy writable path %q: %w (create it before the attempt starts)", w, err)
		}
	}
	for _, w := range p.writable() {
		// Landlock grants what a path resolves to: a writable path through
		// a symlink grants its target, which nobody compared with other
		// leases. Only real paths are granted (the child checks again on
		// the descriptor it grants).
		real, err := filepath.EvalSymlinks(w)
		if errors.Is(err, os.ErrNotExist) {
			continue // a git dir yet to be made: the child cannot grant it either
		}
		if err != nil {
			return fmt.Errorf("policy writable path %q: %w", w, err)
		}
		if real != filepath.Clean(w) {
			return fmt.Errorf("policy writable path %q resolves to %q through a symlink: grant the real path (a claim is judged by what it resolves to)", w, real)
		}
	}
	for _, h := range p.Hidden {
		if !filepath.IsAbs(h) || filepath.Clean(h) == "/" {
			return fmt.Errorf("policy hidden path %q: must be an absolute path below /", h)
		}
		for _, w := range p.writable() {
			if within(h, w) {
				return fmt.Errorf("policy hidden path %q lies under writable path %q: a writable path is also readable; move the secret out of it", h, w)
			}
		}
	}
	if !p.GitDirWritable {
		for _, g := range p.gitDirs() {
			for _, w := range p.Writable {
				if within(g, w) {
					return fmt.Errorf("policy writable path %q covers the git dir %q: only an exclusive workspace (GitDirWritable) may write it; lease the paths inside the worktree instead", w, g)
				}
			}
		}
	}
	for _, u := range p.UnixSockets {
		if !filepath.IsAbs(u) {
			return fmt.Errorf("policy unix socket %q: must be an absolute path", u)
		}
	}
	for _, b := range p.BindPorts {
		switch {
		case b == 0:
			return fmt.Errorf("policy bind port 0: a port the kernel chooses is always allowed; list fixed ports only")
		case p.reserved(b):
			return fmt.Errorf("policy bind port %d: it is a port of the sidecar or of a service the attempt connects to (reserved); choose another port for the agent's server", b)
		}
	}
	if p.KillGrace < 0 {
		return fmt.Errorf("policy kill grace %v: must not be negative", p.KillGrace)
	}
	return nil
}

// reserved reports whether port belongs to a trusted local service
// (ReservedPorts or ConnectPorts).
func (p *Policy) reserved(port uint16) bool {
	return slices.Contains(p.ReservedPorts, port) || slices.Contains(p.ConnectPorts, port)
}

func (p *Policy) gitDirs() []string {
	if len(p.GitDirs) > 0 {
		return p.GitDirs
	}
	if p.Root != "" {
		return []string{filepath.Join(p.Root, ".git")}
	}
	return nil
}

// writable is Writable plus the git dirs when they may be written.
func (p *Policy) writable() []string {
	w := append([]string(nil), p.Writable...)
	if p.GitDirWritable {
		w = append(w, p.gitDirs()...)
	}
	return w
}

func (p *Policy) killGrace() time.Duration {
	if p.KillGrace == 0 {
		return 10 * time.Second
	}
	return p.KillGrace
}

func (p *Policy) logger() *slog.Logger {
	if p.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return p.Logger
}

// leaseDesc names the lease for messages: id, owner, fence, workspace.
func (p *Policy) leaseDesc() string {
	l := p.Lease
	if l.LeaseID == "" {
		return "no lease"
	}
	return fmt.Sprintf("lease %s (owner %s, fence %d, %s workspace %s, scope %s)",
		l.LeaseID, l.Owner, l.Fence, l.WorkspaceMode, l.WorkspaceID, claimDesc(l))
}

func claimDesc(l lease.Lease) string {
	switch {
	case l.Scope.Kind == "whole-repo":
		return "whole repo"
	case len(l.Scope.Paths) > 0:
		return strings.Join(l.Scope.Paths, ", ")
	default:
		return "no repo paths"
	}
}

// within reports whether p is dir or lies beneath it (both cleaned, absolute).
func within(p, dir string) bool {
	p, dir = filepath.Clean(p), filepath.Clean(dir)
	if dir == "/" {
		return true
	}
	return p == dir || strings.HasPrefix(p, dir+"/")
}
