// Command gitbench measures the git fence against a direct push, side by
// side in one run against the same git http-backend: wall time of pushing
// a large history (default 5,000 files, ~80 MB of pack) directly and through
// a fenceline sidecar process, alternating, and the sidecar's peak RSS
// (VmHWM) while it takes a 200 MB push.
//
//	go build -o /tmp/fenceline ./cmd/fenceline && go run ./test/gitbench -fenceline /tmp/fenceline
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
)

// sidecarLog receives the sidecars' logs (-v: stderr).
var sidecarLog io.Writer = io.Discard

func main() {
	var (
		bin     = flag.String("fenceline", "fenceline", "the fenceline binary (the sidecar runs as its own process)")
		files   = flag.Int("files", 5000, "files in the first commit")
		size    = flag.Int("size", 8<<10, "bytes per file (incompressible)")
		commits = flag.Int("commits", 20, "commits after the first, each rewriting files/20 files")
		runs    = flag.Int("runs", 3, "pushes of each kind (alternating)")
		bigMB   = flag.Int("big-mb", 200, "size of the push whose sidecar RSS is measured (0: skip)")
	)
	verbose := flag.Bool("v", false, "show the sidecars' logs")
	flag.Parse()
	if *verbose {
		sidecarLog = os.Stderr
	}
	if err := run(*bin, *files, *size, *commits, *runs, *bigMB); err != nil {
		fmt.Fprintln(os.Stderr, "gitbench:", err)
		os.Exit(1)
	}
}

type bench struct {
	bin   string
	dir   string
	srv   *gitserver.Server
	bus   string
	creds string // the bus's credentials directory (the sidecars' --creds)
	seq   int
	repo  string // the source repository
}

func run(bin string, files, size, commits, runs, bigMB int) error {
	dir, err := os.MkdirTemp("", "fenceline-gitbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	b := &bench{bin: bin, dir: dir}
	if b.srv, err = gitserver.Start(filepath.Join(dir, "server")); err != nil {
		return err
	}
	defer b.srv.Close()
	os.MkdirAll(b.srv.Root, 0o755)
	srv, err := embedded.StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: filepath.Join(dir, "bus")})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	b.bus = srv.ClientURL()
	b.creds = leasebus.CredsDirOf(filepath.Join(dir, "bus"))
	if err := startService(b.bus, b.creds); err != nil {
		return err
	}

	start := time.Now()
	b.repo = filepath.Join(dir, "src")
	packMB, err := generate(b.repo, files, size, commits, files/20, 1)
	if err != nil {
		return err
	}
	fmt.Printf("history: %d files, %d commits, %.0f MB packed (generated in %s)\n", files, commits+1, packMB, time.Since(start).Round(time.Second))

	sc, err := b.sidecar()
	if err != nil {
		return err
	}
	var direct, fenced []time.Duration
	for i := range runs {
		for _, through := range []bool{i%2 == 1, i%2 == 0} {
			d, err := b.push(b.repo, through, sc)
			if err != nil {
				sc.stop()
				return err
			}
			if through {
				fenced = append(fenced, d)
			} else {
				direct = append(direct, d)
			}
		}
	}
	hwm := sc.hwm()
	sc.stop()
	md, mf := median(direct), median(fenced)
	fmt.Printf("\n%-28s %10s %10s %10s\n", "push", "direct", "fenceline", "ratio")
	fmt.Printf("%-28s %10s %10s %9.2fx   (median of %d each, alternating; floor <= 1.25x)\n",
		fmt.Sprintf("%d files, %.0f MB", files, packMB), md.Round(time.Millisecond), mf.Round(time.Millisecond), float64(mf)/float64(md), runs)
	fmt.Printf("sidecar peak RSS over these pushes: %.1f MB\n", float64(hwm)/(1<<20))

	if bigMB > 0 {
		big := filepath.Join(dir, "big")
		n := bigMB * (1 << 20) / (100 << 10)
		mb, err := generate(big, n, 100<<10, 0, 0, 2)
		if err != nil {
			return err
		}
		sc, err := b.sidecar()
		if err != nil {
			return err
		}
		before := sc.hwm()
		d, err := b.push(big, true, sc)
		hwm := sc.hwm()
		sc.stop()
		if err != nil {
			return err
		}
		fmt.Printf("%.0f MB push through the sidecar: %s; sidecar peak RSS %.1f MB (%.1f MB before the push; floor <= 64 MB)\n",
			mb, d.Round(time.Millisecond), float64(hwm)/(1<<20), float64(before)/(1<<20))
	}
	return nil
}

func startService(url, creds string) error {
	// The lease service runs in this process, as the embedded bus does.
	nc, err := natsConnect(url, creds)
	if err != nil {
		return err
	}
	_, err = leasebus.StartService(context.Background(), nc, leasebus.ServiceConfig{})
	return err
}

// push pushes main of repo to a fresh bare repository, directly or through
// the sidecar, and returns the wall time of git push.
func (b *bench) push(repo string, through bool, sc *sidecar) (time.Duration, error) {
	b.seq++
	name := fmt.Sprintf("r%d.git", b.seq)
	if _, err := b.srv.NewRepo(name); err != nil {
		return 0, err
	}
	cmd := exec.Command("git", "push", "--quiet", b.srv.URL+"/"+name, "main")
	cmd.Dir = repo
	cmd.Env = gitEnv(b.dir)
	if through {
		cmd.Env = append(cmd.Env, sc.env...)
	}
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	start := time.Now()
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("push (through=%v): %w\n%s", through, err, out)
	}
	d := time.Since(start)
	// Both must have landed the same history.
	got, err := exec.Command("git", "-C", filepath.Join(b.srv.Root, name), "rev-parse", "main").Output()
	want, _ := exec.Command("git", "-C", repo, "rev-parse", "main").Output()
	if err != nil || string(got) != string(want) {
		return 0, fmt.Errorf("push to %s did not land (through=%v)", name, through)
	}
	return d, nil
}

func gitEnv(home string) []string { return gitserver.ClientEnv(home, "bench") }

// generate writes a repository at dir with git fast-import: a first commit
// of files incompressible files of size bytes, then commits that each
// rewrite churn files. It returns the packed size in MB.
func generate(dir string, files, size, commits, churn int, seed uint64) (float64, error) {
	if out, err := exec.Command("git", "init", "--quiet", "--initial-branch=main", dir).CombinedOutput(); err != nil {
		return 0, fmt.Errorf("git init: %w: %s", err, out)
	}
	cmd := exec.Command("git", "-C", dir, "fast-import", "--quiet")
	cmd.Env = gitEnv(dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 0, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	w := bufio.NewWriterSize(stdin, 1<<20)
	rng := rand.New(rand.NewChaCha8([32]byte{byte(seed)}))
	buf := make([]byte, size)
	path := func(i int) string { return fmt.Sprintf("pkg%03d/mod%02d/file%05d.dat", i/100, i%7, i) }
	commit := func(n int, msg string, paths []int) {
		fmt.Fprintf(w, "commit refs/heads/main\ncommitter bench <bench@example.com> %d +0000\ndata %d\n%s\n", 1700000000+n, len(msg), msg)
		for _, i := range paths {
			for j := 0; j < len(buf); j += 8 {
				v := rng.Uint64()
				for k := 0; k < 8 && j+k < len(buf); k++ {
					buf[j+k] = byte(v >> (8 * k))
				}
			}
			fmt.Fprintf(w, "M 100644 inline %s\ndata %d\n", path(i), len(buf))
			w.Write(buf)
			w.WriteString("\n")
		}
	}
	all := make([]int, files)
	for i := range all {
		all[i] = i
	}
	commit(0, "initial", all)
	for c := 1; c <= commits; c++ {
		var ps []int
		for k := range churn {
			ps = append(ps, (c*churn+k*13)%files)
		}
		slices.Sort(ps)
		ps = slices.Compact(ps)
		commit(c, fmt.Sprintf("change %d", c), ps)
	}
	w.Flush()
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		return 0, fmt.Errorf("git fast-import: %w", err)
	}
	out, err := exec.Command("git", "-C", dir, "count-objects", "-v").Output()
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(l, "size-pack: "); ok {
			kb, _ := strconv.Atoi(v)
			return float64(kb) / 1024, nil
		}
	}
	return 0, errors.New("git count-objects: no size-pack")
}

// sidecar is a fenceline sidecar process holding a whole-repo lease.
type sidecar struct {
	cmd *exec.Cmd
	env []string
}

func (b *bench) sidecar() (*sidecar, error) {
	b.seq++
	envFile := filepath.Join(b.dir, fmt.Sprintf("agent%d.env", b.seq))
	cmd := exec.Command(b.bin, "--nats", b.bus, "--creds", b.creds, "sidecar", "--repo", fmt.Sprintf("bench/%d", b.seq), "--whole-repo",
		"--workspace", "exclusive", "--git-upstream", b.srv.URL, "--git-objects", filepath.Join(b.repo, ".git"),
		"--state-dir", filepath.Join(b.dir, fmt.Sprintf("sidecar%d", b.seq)), "--env-file", envFile)
	cmd.Env = append(os.Environ(), "XDG_STATE_HOME="+b.dir)
	cmd.Stdout = io.Discard
	cmd.Stderr = sidecarLog
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start sidecar: %w", err)
	}
	s := &sidecar{cmd: cmd}
	deadline := time.Now().Add(10 * time.Second)
	for {
		data, err := os.ReadFile(envFile)
		if err == nil {
			s.env = strings.Split(strings.TrimSpace(string(data)), "\n")
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, errors.New("sidecar did not write its env file within 10s")
		}
		time.Sleep(20 * time.Millisecond) // polling a file another process writes
	}
}

// hwm is the sidecar's peak resident set (VmHWM).
func (s *sidecar) hwm() int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

func (s *sidecar) stop() {
	s.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		s.cmd.Process.Kill()
		<-done
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// natsConnect connects as the lease service with the bus's credentials.
func natsConnect(url, creds string) (*nats.Conn, error) {
	opts, err := leasebus.RoleOptions(creds, leasebus.RoleService)
	if err != nil {
		return nil, err
	}
	return nats.Connect(url, opts...)
}
