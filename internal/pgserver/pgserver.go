// Package pgserver runs a throwaway Postgres: the machine's initdb and
// postgres (Debian keeps them in /usr/lib/postgresql/*/bin) on a free port
// of 127.0.0.1 in a temporary directory, run as the user nobody when this
// process runs as root (initdb refuses root). The server is a child of this
// process and gets SIGQUIT when the process dies, so a killed program
// leaves no server behind; the next Start removes the directories such
// processes left.
//
// It is the Postgres of `fenceline demo` and, through package pgtest, of
// the tests. It takes no setting from the environment: Attach wraps a
// server someone else runs.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Config says how to start a server. The zero Config works.
type Config struct {
	// HBA lines go into pg_hba.conf before the last line, which trusts
	// every user from 127.0.0.1 (and the Unix socket): an authentication
	// method for one user, say "host all scram_user 127.0.0.1/32 scram-sha-256".
	HBA []string
}

// Server is a running Postgres.
type Server struct {
	// Host and Port are where it listens (TCP, 127.0.0.1).
	Host string
	Port int
	// Admin is the superuser's name (no password over TCP from 127.0.0.1
	// for a server this package started).
	Admin string
	// BinDir holds the server's binaries (pg_ctl, psql, pgbench).
	BinDir string

	dir      string // owned temp dir; empty for an external server
	data     string
	proc     *exec.Cmd     // the postmaster, a child of this process
	exited   chan struct{} // closed when proc has exited
	runAs    *syscall.Credential
	external string // the DSN Attach was given
}

// Addr is host:port.
func (s *Server) Addr() string { return net.JoinHostPort(s.Host, strconv.Itoa(s.Port)) }

// SocketPath is the path of the server's Unix-domain socket, or "" for an
// attached server.
func (s *Server) SocketPath() string {
	if s.dir == "" { // external servers have none
		return ""
	}
	return filepath.Join(s.dir, ".s.PGSQL."+strconv.Itoa(s.Port))
}

// DSN returns a URL for user (with password, may be empty) and database.
func (s *Server) DSN(usr, password, db string) string {
	u := url.URL{Scheme: "postgres", Host: s.Addr(), Path: "/" + db, RawQuery: "sslmode=disable"}
	if password != "" {
		u.User = url.UserPassword(usr, password)
	} else {
		u.User = url.User(usr)
	}
	return u.String()
}

// AdminDSN is the superuser DSN for database db ("postgres" when empty).
func (s *Server) AdminDSN(db string) string {
	if s.external != "" && db == "" {
		return s.external
	}
	if db == "" {
		db = "postgres"
	}
	if s.external != "" {
		u, err := url.Parse(s.external)
		if err == nil {
			u.Path = "/" + db
			return u.String()
		}
	}
	return s.DSN(s.Admin, "", db)
}

// Attach returns the running server that the superuser DSN dsn names.
// Stop leaves it running.
func Attach(dsn string) (*Server, error) {
	u, err := url.Parse(dsn)
	if err != nil {
		return nil, fmt.Errorf("pgserver: attach: %w", err)
	}
	port, _ := strconv.Atoi(u.Port())
	if port == 0 {
		port = 5432
	}
	bin, _ := BinDir()
	return &Server{Host: u.Hostname(), Port: port, Admin: u.User.Username(), BinDir: bin, external: dsn}, nil
}

// Start initializes and starts a new server.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	s := &Server{Host: "127.0.0.1", Admin: "postgres", BinDir: bin}
	if os.Geteuid() == 0 {
		cred, err := nobody()
		if err != nil {
			return nil, err
		}
		s.runAs = cred
	}
	sweepStale()
	s.dir, err = os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("pgserver: temp dir: %w", err)
	}
	if err := os.WriteFile(filepath.Join(s.dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		s.cleanup()
		return nil, fmt.Errorf("pgserver: owner file: %w", err)
	}
	if s.runAs != nil {
		if err := os.Chown(s.dir, int(s.runAs.Uid), int(s.runAs.Gid)); err != nil {
			s.cleanup()
			return nil, fmt.Errorf("pgserver: chown %s: %w", s.dir, err)
		}
	}
	s.data = filepath.Join(s.dir, "data")
	if out, err := s.run(ctx, "initdb", "-D", s.data, "-U", s.Admin, "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"); err != nil {
		s.cleanup()
		return nil, fmt.Errorf("pgserver: initdb: %w\n%s", err, out)
	}
	hba := "local all all trust\n" + strings.Join(append(slices.Clone(cfg.HBA), "host all all 127.0.0.1/32 trust"), "\n") + "\n"
	if err := os.WriteFile(filepath.Join(s.data, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		s.cleanup()
		return nil, fmt.Errorf("pgserver: pg_hba.conf: %w", err)
	}
	if s.runAs != nil {
		os.Chown(filepath.Join(s.data, "pg_hba.conf"), int(s.runAs.Uid), int(s.runAs.Gid))
	}
	for try := 0; ; try++ {
		s.Port, err = freePort()
		if err != nil {
			s.cleanup()
			return nil, err
		}
		err = s.startPostmaster(ctx)
		if err == nil {
			break
		}
		if try == 2 || ctx.Err() != nil {
			log, _ := os.ReadFile(filepath.Join(s.dir, "log"))
			s.cleanup()
			return nil, fmt.Errorf("pgserver: start postgres: %w\n%s", err, log)
		}
	}
	return s, nil
}

// startPostmaster runs postgres itself (not pg_ctl, which detaches it) as a
// child that gets SIGQUIT (immediate shutdown) when this process dies, so a
// test binary that is killed — a fuzz worker, a timeout — cannot leave a
// server behind. It returns once the server accepts connections.
func (s *Server) startPostmaster(ctx context.Context) error {
	logf, err := os.OpenFile(filepath.Join(s.dir, "log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	if s.runAs != nil {
		logf.Chown(int(s.runAs.Uid), int(s.runAs.Gid))
	}
	cmd := exec.Command(filepath.Join(s.BinDir, "postgres"), "-D", s.data, "-p", strconv.Itoa(s.Port), "-k", s.dir,
		"-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
		"-c", "full_page_writes=off", "-c", "max_connections=200", "-c", "shared_buffers=128MB")
	cmd.Dir = s.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	cmd.Stdout, cmd.Stderr = logf, logf
	// Pdeathsig is set after the credential change in the child, so it
	// survives running as nobody. It is tied to the OS thread that forks;
	// Go keeps its threads for the life of the process.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if s.runAs != nil {
		cmd.SysProcAttr.Credential = s.runAs
		cmd.Env = append(cmd.Env, "HOME="+s.dir)
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }() // owned by the Server: ends with the postmaster
	s.proc, s.exited = cmd, exited
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	for {
		// postmaster.pid's 8th line is "ready" once it accepts connections.
		if b, err := os.ReadFile(filepath.Join(s.data, "postmaster.pid")); err == nil {
			if lines := strings.Split(string(b), "\n"); len(lines) >= 8 && strings.TrimSpace(lines[7]) == "ready" {
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("postgres exited during startup (%v)", cmd.ProcessState)
		case <-ctx.Done():
			s.kill()
			return ctx.Err()
		case <-deadline.C:
			s.kill()
			return errors.New("postgres not ready after 60s")
		case <-tick.C:
		}
	}
}

// kill stops the postmaster: SIGQUIT (immediate shutdown), then SIGKILL
// after 30 s, and waits for it.
func (s *Server) kill() {
	if s.proc == nil {
		return
	}
	s.proc.Process.Signal(syscall.SIGQUIT)
	select {
	case <-s.exited:
	case <-time.After(30 * time.Second):
		s.proc.Process.Kill()
		<-s.exited
	}
	s.proc = nil
}

// Stop stops a server Start started and removes its files; an attached
// server is left running.
func (s *Server) Stop() error {
	if s.dir == "" {
		return nil
	}
	s.kill()
	s.cleanup()
	return nil
}

// Log returns the server log (empty for an attached server).
func (s *Server) Log() string {
	if s.dir == "" {
		return ""
	}
	b, _ := os.ReadFile(filepath.Join(s.dir, "log"))
	return string(b)
}

func (s *Server) cleanup() {
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}

func (s *Server) run(ctx context.Context, prog string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(s.BinDir, prog), args...)
	cmd.Dir = s.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	if s.runAs != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.runAs}
		cmd.Env = append(cmd.Env, "HOME="+s.dir)
	}
	return cmd.CombinedOutput()
}

// BinDir finds the newest /usr/lib/postgresql/*/bin with initdb, or the
// directory of initdb on PATH.
func BinDir() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	return "", errors.New("pgserver: no Postgres server binaries (initdb, postgres): install them (Debian: apt-get install postgresql)")
}

func version(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func nobody() (*syscall.Credential, error) {
	u, err := user.Lookup("nobody")
	if err != nil {
		return nil, fmt.Errorf("pgserver: running as root needs the user nobody to run Postgres: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if g, err := user.LookupGroup("nogroup"); err == nil {
		gid, _ = strconv.Atoi(g.Gid)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: false, Groups: []uint32{}}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgserver: free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

const (
	dirPrefix = "fenceline-pg-"
	ownerFile = "owner.pid" // the process that started the server
)

// sweepStale removes the directories of servers whose process is gone
// (killed before it could call Stop). Their postmaster died with it
// (Pdeathsig); a directory whose postmaster still runs is left alone.
func sweepStale() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, ownerFile))
		if err != nil {
			continue // not ours, or still being created
		}
		owner, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || owner == os.Getpid() || alive(owner) {
			continue
		}
		if pm, err := os.ReadFile(filepath.Join(d, "data", "postmaster.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.SplitN(string(pm), "\n", 2)[0]); err == nil && alive(pid) {
				continue
			}
		}
		os.RemoveAll(d)
	}
}

func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
