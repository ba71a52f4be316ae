package faults

// The cluster half of the fault harness: a NATS cluster whose nodes are
// separate processes of the real fenceline binary ("fenceline bus serve"
// with cluster flags: an embedded JetStream server and a lease service in
// one process), and lease-service-only processes against it. Real
// processes, so a node can be paused with SIGSTOP (its server and its
// service freeze together, TCP connections stay open, its peers see only
// silence) and killed with SIGKILL (nothing flushed, nothing said goodbye).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/testutil"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/leasebus"
)

// BuildBinary returns the fenceline command, as Binary does.
func BuildBinary(t testing.TB) string {
	t.Helper()
	return Binary(t)
}

// Node is one process of the fenceline binary: a cluster node or a lease
// service on its own. It can be started again after a kill with the same
// addresses, store and state directory.
type Node struct {
	Name  string
	args  []string
	env   []string
	state string // its own XDG_STATE_HOME (credentials, default store)

	mu     sync.Mutex
	cmd    *exec.Cmd     // guarded by mu
	out    *bytes.Buffer // stdout and stderr of the current run; guarded by mu
	before []string      // what its earlier runs printed; guarded by mu
	done   chan struct{} // closed when the current run exited; guarded by mu
	paused bool          // guarded by mu
	runs   int           // guarded by mu
}

// lockedWriter serializes writes into a Node's buffer.
type lockedWriter struct {
	mu  *sync.Mutex
	buf **bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return (*w.buf).Write(p)
}

// Cluster is a running cluster of node processes and service processes;
// everything is killed when the test ends.
type Cluster struct {
	t        testing.TB
	bin      string
	Nodes    []*Node
	Services []*Node // lease services without a server of their own
	urls     []string
	creds    string // the credentials every node admits and every process uses
	// FenceSecrets is the fence-secret directory of every node's and
	// service's lease service ("bus fence-secret set --dir").
	FenceSecrets string
	// routes[i][j] carries node i's route connections to node j, through
	// a bridge that can blackhole them (Isolate).
	routes [][]*testutil.Bridge
}

// StartCluster starts n node processes of bin (see BuildBinary) as one
// cluster, each on 127.0.0.1 with its own store and state directory, and
// waits until each one's lease service is ready.
func StartCluster(t testing.TB, bin string, n int) *Cluster {
	t.Helper()
	// One set of credentials for the whole cluster (a node would otherwise
	// make its own), the one the test's own connections use.
	c := &Cluster{t: t, bin: bin, creds: bustest.CredsDir(t), FenceSecrets: t.TempDir()}
	ports := testutil.FreePorts(t, 2*n)
	c.routes = make([][]*testutil.Bridge, n)
	for i := range n {
		c.urls = append(c.urls, fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
		c.routes[i] = make([]*testutil.Bridge, n)
		for j := range n {
			if j != i {
				c.routes[i][j] = testutil.NewBridge(t, fmt.Sprintf("127.0.0.1:%d", ports[n+j]))
			}
		}
	}
	dir := t.TempDir()
	for i := range n {
		var peers []string
		for j, b := range c.routes[i] {
			if j != i {
				peers = append(peers, "nats://"+b.Addr())
			}
		}
		name := fmt.Sprintf("n%d", i)
		p := &Node{Name: name, state: filepath.Join(dir, name, "state"), args: []string{
			"bus", "serve", "--name", name, "--cluster-name", "faults", "--fence-secrets", c.FenceSecrets,
			"--cluster-listen", fmt.Sprintf("127.0.0.1:%d", ports[n+i]),
			"--cluster-advertise", testutil.DeadAddr,
			"--routes", strings.Join(peers, ","),
			"--listen", fmt.Sprintf("127.0.0.1:%d", ports[i]),
			"--store", filepath.Join(dir, name, "store"),
		}}
		c.Nodes = append(c.Nodes, p)
	}
	t.Cleanup(c.killAll)
	for _, p := range c.Nodes {
		c.start(p)
	}
	for _, p := range c.Nodes {
		c.WaitReady(p, 90*time.Second)
	}
	return c
}

// AddService starts a lease service process (no server of its own)
// against the cluster, replicas 3, and waits until it is ready.
func (c *Cluster) AddService(name string) *Node {
	c.t.Helper()
	p := &Node{Name: name, state: filepath.Join(c.t.TempDir(), "state"),
		args: []string{"--nats", c.URLs(), "bus", "serve", "--replicas", "3", "--fence-secrets", c.FenceSecrets}}
	c.Services = append(c.Services, p)
	c.start(p)
	c.WaitReady(p, 60*time.Second)
	return p
}

// URLs is every node's client URL, comma-separated, for nats.Connect.
func (c *Cluster) URLs() string { return strings.Join(c.urls, ",") }

// URLsBut is URLs without p's: the majority side of a partition of p.
func (c *Cluster) URLsBut(p *Node) string {
	var out []string
	for i, n := range c.Nodes {
		if n != p {
			out = append(out, c.urls[i])
		}
	}
	return strings.Join(out, ",")
}

func (c *Cluster) start(p *Node) {
	c.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	cmd := exec.Command(c.bin, p.args...)
	cmd.Env = append(os.Environ(), "XDG_STATE_HOME="+p.state, "FENCELINE_CREDS="+c.creds)
	cmd.Env = append(cmd.Env, p.env...)
	if p.out != nil {
		p.before = append(p.before, p.out.String())
	}
	p.out = &bytes.Buffer{}
	w := io.Writer(lockedWriter{mu: &p.mu, buf: &p.out})
	if d := os.Getenv("FENCELINE_FAULTS_LOGDIR"); d != "" {
		// Everything each run of each process printed, whole, for a
		// look after the test (a failure logs only heads and tails).
		f, err := os.Create(filepath.Join(d, fmt.Sprintf("%s-%d.log", p.Name, len(p.before))))
		if err != nil {
			c.t.Fatalf("FENCELINE_FAULTS_LOGDIR: %v", err)
		}
		w = io.MultiWriter(w, f)
	}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s: %v", p.Name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	p.cmd, p.done, p.paused = cmd, done, false
	p.runs++
}

// StateHome is the process's own XDG_STATE_HOME, where a bus it serves
// keeps its state (and the credentials the CLI finds there).
func (p *Node) StateHome() string { return p.state }

// Output is what the process's current run printed so far.
func (p *Node) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// WaitReady waits until p's lease service says it is ready, or fails the
// test (with p's output) after timeout or when p exits.
func (c *Cluster) WaitReady(p *Node, timeout time.Duration) {
	c.t.Helper()
	testutil.CheckFor(c.t, timeout, 50*time.Millisecond, func() error {
		p.mu.Lock()
		done := p.done
		p.mu.Unlock()
		select {
		case <-done:
			c.t.Fatalf("%s exited before it was ready:\n%s", p.Name, p.Output())
		default:
		}
		if !strings.Contains(p.Output(), "lease service ready") {
			return fmt.Errorf("%s not ready yet:\n%s", p.Name, p.Output())
		}
		return nil
	})
}

// Pause stops p with SIGSTOP: its server and service freeze mid-step.
func (c *Cluster) Pause(p *Node) {
	c.t.Helper()
	c.signal(p, syscall.SIGSTOP)
	p.mu.Lock()
	p.paused = true
	p.mu.Unlock()
}

// Resume continues a paused p with SIGCONT.
func (c *Cluster) Resume(p *Node) {
	c.t.Helper()
	c.signal(p, syscall.SIGCONT)
	p.mu.Lock()
	p.paused = false
	p.mu.Unlock()
}

// Isolate cuts node p off from every other node (cut), or heals it: the
// routes' bytes are dropped, so every side sees silence, not a closed
// connection, and p's own clients stay connected to it. A service on the
// other side goes on; p's server keeps answering its clients' pings.
func (c *Cluster) Isolate(p *Node, cut bool) {
	c.t.Helper()
	n := slices.Index(c.Nodes, p)
	if n < 0 {
		c.t.Fatalf("isolate %s: not a node of the cluster", p.Name)
	}
	for i := range c.Nodes {
		if i != n {
			c.routes[i][n].Partition(cut)
			c.routes[n][i].Partition(cut)
		}
	}
}

// WaitStreams waits until node p reaches the lease log's stream leader
// again (after a partition healed, its JetStream first catches up and
// answers "temporarily unavailable"), so a run that dials it is served.
func (c *Cluster) WaitStreams(p *Node, timeout time.Duration) {
	c.t.Helper()
	js := c.jetStream(c.urls[slices.Index(c.Nodes, p)])
	testutil.CheckFor(c.t, timeout, 100*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		s, err := js.Stream(ctx, leasebus.LogStream)
		if err != nil {
			return fmt.Errorf("%s: lease log: %w", p.Name, err)
		}
		_, err = s.Info(ctx)
		return err
	})
}

// jetStream is JetStream through a connection to urls that the test
// closes at its end.
func (c *Cluster) jetStream(urls string) jetstream.JetStream {
	c.t.Helper()
	js, err := jetstream.New(bustest.Connect(c.t, urls))
	if err != nil {
		c.t.Fatal(err)
	}
	return js
}

// WaitWhole waits until every stream on the cluster has a leader and
// every one of its replicas is online and current, p among them: a node
// back from a kill or a partition has caught up, so the cluster can take
// its next fault (R3 outlives one node down at a time, not a second
// while the first still catches up).
func (c *Cluster) WaitWhole(p *Node, timeout time.Duration) {
	c.t.Helper()
	js := c.jetStream(c.URLsBut(p))
	testutil.CheckFor(c.t, timeout, 100*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		streams := js.ListStreams(ctx)
		n := 0
		for info := range streams.Info() {
			n++
			cl := info.Cluster
			if cl == nil || cl.Leader == "" {
				return fmt.Errorf("stream %s has no leader", info.Config.Name)
			}
			// An R1 stream lives on one node, not necessarily p.
			found := cl.Leader == p.Name || info.Config.Replicas < len(c.Nodes)
			for _, r := range cl.Replicas {
				if r.Offline || !r.Current {
					return fmt.Errorf("stream %s: replica %s is not current (offline %v, lag %d)", info.Config.Name, r.Name, r.Offline, r.Lag)
				}
				found = found || r.Name == p.Name
			}
			if !found {
				return fmt.Errorf("stream %s: %s is not among its replicas yet", info.Config.Name, p.Name)
			}
		}
		if err := streams.Err(); err != nil {
			return fmt.Errorf("list streams: %w", err)
		}
		if n == 0 {
			return errors.New("no streams listed")
		}
		return nil
	})
}

// Kill kills p with SIGKILL and waits until it is gone.
func (c *Cluster) Kill(p *Node) {
	c.t.Helper()
	c.signal(p, syscall.SIGKILL)
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.t.Fatalf("%s did not exit after SIGKILL", p.Name)
	}
}

// Restart starts a killed p again (same addresses, store and state) and
// waits until its lease service is ready.
func (c *Cluster) Restart(p *Node, timeout time.Duration) {
	c.t.Helper()
	c.start(p)
	c.WaitReady(p, timeout)
}

func (c *Cluster) signal(p *Node, sig syscall.Signal) {
	c.t.Helper()
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if err := cmd.Process.Signal(sig); err != nil {
		c.t.Fatalf("signal %s to %s: %v", sig, p.Name, err)
	}
}

// killAll kills every process still running (continuing paused ones is
// not needed: SIGKILL ends a stopped process too) and waits for them. A
// failed test gets what every process printed, run by run: the nodes'
// and services' own account of elections, takeovers and refusals.
func (c *Cluster) killAll() {
	if c.t.Failed() {
		defer c.logOutputs()
	}
	for _, p := range append(append([]*Node{}, c.Nodes...), c.Services...) {
		p.mu.Lock()
		cmd, done := p.cmd, p.done
		p.mu.Unlock()
		if cmd == nil {
			continue
		}
		_ = cmd.Process.Kill()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
	}
}

// logOutputs logs the first and last lines each process printed in each
// run, then, last (what a truncated CI log keeps), the warnings and the
// primary's changes of every process merged in time order.
func (c *Cluster) logOutputs() {
	const head, tail, merged = 40, 80, 30
	var events []string
	for _, p := range append(append([]*Node{}, c.Nodes...), c.Services...) {
		p.mu.Lock()
		runs := append([]string{}, p.before...)
		if p.out != nil {
			runs = append(runs, p.out.String())
		}
		p.mu.Unlock()
		for i, out := range runs {
			events = append(events, timeline(p.Name, i+1, out)...)
			lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
			if len(lines) > head+tail {
				lines = slices.Concat(lines[:head], []string{fmt.Sprintf("(%d lines between)", len(lines)-head-tail)}, lines[len(lines)-tail:])
			}
			c.t.Logf("%s, run %d of %d, printed:\n%s", p.Name, i+1, len(runs), strings.Join(lines, "\n"))
		}
	}
	slices.Sort(events) // RFC 3339 times in UTC sort as text
	if len(events) > merged {
		events = events[len(events)-merged:]
	}
	c.t.Logf("the last %d warnings and primary changes of every process (name/run), in time order; FENCELINE_FAULTS_LOGDIR keeps every line:\n%s", len(events), strings.Join(events, "\n"))
}

// timeline picks the warnings, errors and the primary's changes out of
// what run of process name printed, each as "<time> name/run <the rest>",
// so that several processes' lines sort in time order. A run of lines
// with one message (a reload failing for each batch while JetStream has
// no meta leader) is its first line and a count.
func timeline(name string, run int, out string) []string {
	var events []string
	var last string // the msg of the last line kept
	repeats := 0
	flush := func() {
		if repeats > 0 {
			events[len(events)-1] += fmt.Sprintf(" (and %d more like it)", repeats)
			repeats = 0
		}
	}
	for _, l := range strings.Split(out, "\n") {
		if !strings.HasPrefix(l, "time=") || !strings.Contains(l, " ") {
			continue
		}
		if !strings.Contains(l, "level=WARN") && !strings.Contains(l, "level=ERROR") && !strings.Contains(l, "primary") {
			continue
		}
		at, rest, _ := strings.Cut(strings.TrimPrefix(l, "time="), " ")
		msg := rest
		if i := strings.Index(rest, "msg="); i >= 0 {
			msg, _, _ = strings.Cut(rest[i:], "\" ")
		}
		if msg == last {
			repeats++
			continue
		}
		flush()
		last = msg
		events = append(events, fmt.Sprintf("%s %s/%d %s", at, name, run, rest))
	}
	flush()
	return events
}

// Node returns the node process named name (a server name), or nil.
func (c *Cluster) Node(name string) *Node {
	for _, p := range c.Nodes {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// StreamLeader asks JetStream which node leads stream.
func (c *Cluster) StreamLeader(ctx context.Context, js jetstream.JetStream, stream string) (*Node, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream info %s: %w", stream, err)
	}
	info := s.CachedInfo()
	if info.Cluster == nil || info.Cluster.Leader == "" {
		return nil, errors.New("stream " + stream + " has no leader")
	}
	p := c.Node(info.Cluster.Leader)
	if p == nil {
		return nil, fmt.Errorf("stream %s: leader %q is not one of the nodes", stream, info.Cluster.Leader)
	}
	return p, nil
}

// NodeOf returns the node process that the process pid has a connection
// to (its client port), or nil: which node a holder hears the bus through.
// It reads the process's sockets from /proc (Linux).
func (c *Cluster) NodeOf(pid int) (*Node, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return nil, fmt.Errorf("sockets of process %d: %w", pid, err)
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	ports := map[string]*Node{} // client port, upper-case hex as /proc writes it
	for i, u := range c.urls {
		_, port, err := net.SplitHostPort(strings.TrimPrefix(u, "nats://"))
		if err != nil {
			return nil, err
		}
		var n int
		fmt.Sscan(port, &n)
		ports[fmt.Sprintf("%04X", n)] = c.Nodes[i]
	}
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode
			if len(f) < 10 || f[3] != "01" || !inodes[f[9]] {
				continue
			}
			if i := strings.LastIndex(f[2], ":"); i >= 0 {
				if p := ports[f[2][i+1:]]; p != nil {
					return p, nil
				}
			}
		}
	}
	return nil, fmt.Errorf("process %d has no connection to a node of the cluster", pid)
}
