//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// childEnv marks the re-executed binary as a guarded child; its value is
// the number of the inherited setup socket.
const childEnv = "_FENCELINE_FSGUARD_CHILD"

// childConfig is what the supervisor sends the guarded child.
type childConfig struct {
	Path     string         `json:"path"`
	Args     []string       `json:"args"`
	Env      []string       `json:"env"`
	Landlock *landlockRules `json:"landlock,omitempty"`
	Seccomp  bool           `json:"seccomp"`
}

// Setup messages on the socket (SOCK_SEQPACKET, one message each):
//
//	supervisor                       guarded child
//	    | -- childConfig (JSON) -------> | no_new_privs, Landlock restrict_self,
//	    |                                | seccomp filter with a new listener
//	    | <------- "ok" + listener fd -- | (SCM_RIGHTS) or "error: ..."
//	    | -- "go" ---------------------> | execve(command)
//	    | <-- EOF (close-on-exec) ------ | or "exec: ..." on failure
const (
	msgOK = "ok"
	msgGo = "go"
)

// Init turns the process into a guarded child or the git shim when it was
// started as one, and never returns in that case; otherwise it returns at
// once. Call it first thing in main (and in TestMain of packages whose
// tests start guarded processes), before any other goroutine runs.
func Init() {
	if v, ok := os.LookupEnv(childEnv); ok {
		runtime.LockOSThread() // Landlock, no_new_privs and seccomp are per thread: restrict the one that execs
		fd, err := strconv.Atoi(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fenceline guard: bad %s=%q\n", childEnv, v)
			os.Exit(126)
		}
		os.Exit(runChild(fd))
	}
	if v, ok := os.LookupEnv(sealedEnv); ok {
		fd, err := strconv.Atoi(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fenceline guard: bad %s=%q\n", sealedEnv, v)
			os.Exit(126)
		}
		os.Exit(runSealedNet(fd))
	}
	if cfg, ok := os.LookupEnv(shimEnv); ok && filepath.Base(os.Args[0]) == "git" {
		os.Exit(runShim(cfg, os.Args[1:], os.Stderr))
	}
}

func runChild(sock int) int {
	fail := func(format string, args ...any) int {
		msg := fmt.Sprintf(format, args...)
		if err := unix.Sendmsg(sock, []byte("error: "+msg), nil, nil, 0); err != nil {
			fmt.Fprintf(os.Stderr, "fenceline guard: %s\n", msg)
		}
		return 126
	}
	buf := make([]byte, 1<<20)
	n, _, _, _, err := unix.Recvmsg(sock, buf, nil, 0)
	if err != nil {
		return fail("read setup: %v", err)
	}
	var cfg childConfig
	if err := json.Unmarshal(buf[:n], &cfg); err != nil {
		return fail("decode setup: %v", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fail("prctl(PR_SET_NO_NEW_PRIVS): %v", err)
	}
	// A core dump is written by the kernel, not by a call the filter
	// sees, wherever Landlock lets the crashing process write: in the
	// lease even after a loss. A hard limit of 0 cannot be raised again.
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fail("setrlimit(RLIMIT_CORE): %v", err)
	}
	if cfg.Landlock != nil {
		if err := restrictSelf(*cfg.Landlock); err != nil {
			return fail("landlock: %v", err)
		}
	}
	if cfg.Seccomp {
		lfd, err := installFilter()
		if err != nil {
			return fail("%v", err)
		}
		err = unix.Sendmsg(sock, []byte(msgOK), unix.UnixRights(lfd), nil, 0)
		unix.Close(lfd) // the command must never hold its own listener
	} else {
		err = unix.Sendmsg(sock, []byte(msgOK), nil, nil, 0)
	}
	if err != nil {
		return fail("send listener: %v", err)
	}
	n, _, _, _, err = unix.Recvmsg(sock, buf, nil, 0)
	if err != nil || string(buf[:n]) != msgGo {
		return 126 // the supervisor gave up on us
	}
	unix.CloseOnExec(sock)
	err = syscall.Exec(cfg.Path, cfg.Args, cfg.Env)
	unix.Sendmsg(sock, []byte(fmt.Sprintf("exec: %s: %v", cfg.Path, err)), nil, nil, 0)
	return 127
}
