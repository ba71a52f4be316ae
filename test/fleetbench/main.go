// Command fleetbench drives one level of a fleet of lease holders against
// a running lease bus (scripts/bench-bus-cluster.sh starts a 3-node
// cluster of `fenceline bus serve` and runs it once per level): it takes
// -leases active leases over -repos repos through the public client
// (leasebus.Client.AcquireAndHold, each holder renewing at its own
// cadence), -per-conn holders on each NATS connection, the connections
// spread over the enrolled identities named by -identities; then, for -d,
// it keeps them held while -churn acquire+release cycles a second replace
// random ones (Holder.Close, then AcquireAndHold). It prints a SAMPLE
// line every -sample (held leases, each node's RSS and CPU from /proc) and
// one RESULT line at the end (see Result.Line). The driver only listens to
// its holders (HoldOptions.OnChange and OnRenew, Holder.Lost): it never asks
// them for a fence, which would make a holder that heard nothing for a
// while renew at once, a load idle holders do not make. Everything is
// bounded: the
// ramp by -ramp-max, the steady window by -d, each request by its
// timeout; at the end the holders stop (the leases are left to expire
// with the cluster) and the process exits.
//
//	fleetbench ports N   prints N free TCP ports on 127.0.0.1
//	fleetbench respond URL CREDS   the echo yardstick's responder (echo.go)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

func main() {
	if err := run(context.Background(), os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "fleetbench:", err)
		os.Exit(1)
	}
}

// config is one level's load.
type config struct {
	urls         string
	credsDir     string
	identities   []string
	leases       int
	repos        int
	ttl          time.Duration
	churn        float64
	dur          time.Duration
	rampRate     float64
	rampMax      time.Duration
	perConn      int
	rampInflight int
	inflight     int
	sample       time.Duration
	nodes        []*node
}

func run(ctx context.Context, args []string) error {
	if len(args) == 2 && args[0] == "ports" {
		return printPorts(args[1])
	}
	if len(args) == 3 && args[0] == "respond" {
		return respond(args[1], args[2])
	}
	fs := flag.NewFlagSet("fleetbench", flag.ContinueOnError)
	var c config
	var ids, nodes string
	fs.StringVar(&c.urls, "urls", "", "the nodes' client URLs, comma-separated")
	fs.StringVar(&c.credsDir, "creds", "", "the bus's credentials directory (holders/NAME.nk for each identity, service.nk for the stream info)")
	fs.StringVar(&ids, "identities", "", "enrolled holder identities, comma-separated: connection k uses the k-th modulo their number")
	fs.IntVar(&c.leases, "leases", 1000, "active leases to hold")
	fs.IntVar(&c.repos, "repos", 1000, "repos the leases are spread over (disjoint paths)")
	fs.DurationVar(&c.ttl, "ttl", 30*time.Second, "lease TTL (holders renew every TTL/3)")
	fs.Float64Var(&c.churn, "churn", 50, "acquire+release cycles per second during the steady window")
	fs.DurationVar(&c.dur, "d", 60*time.Second, "steady window: all leases held (or as many as the ramp got), churn on")
	fs.Float64Var(&c.rampRate, "ramp-rate", 250, "acquires per second while taking the leases")
	fs.DurationVar(&c.rampMax, "ramp-max", 0, "give up taking the rest of the leases after this long (default: twice -leases at -ramp-rate, plus 1 min)")
	fs.IntVar(&c.perConn, "per-conn", 10, "holders per NATS connection")
	fs.IntVar(&c.rampInflight, "ramp-inflight", 32, "acquires in flight at most while taking the leases (a closed loop: the ramp goes no faster than the bus answers)")
	fs.IntVar(&c.inflight, "inflight", 200, "churn cycles in flight at most (past that a cycle is skipped and counted)")
	fs.DurationVar(&c.sample, "sample", 5*time.Second, "how often to sample the nodes and the holders")
	fs.StringVar(&nodes, "nodes", "", "the node processes to watch: name=pid,name=pid")
	pprofAddr := fs.String("pprof", "", "serve the driver's own profiles (net/http/pprof) on this loopback address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if c.urls == "" || c.credsDir == "" || ids == "" {
		return errors.New("-urls, -creds and -identities are required (scripts/bench-bus-cluster.sh sets them)")
	}
	if c.leases <= 0 || c.repos <= 0 || c.perConn <= 0 || c.inflight <= 0 || c.rampInflight <= 0 || c.rampRate <= 0 {
		return errors.New("-leases, -repos, -per-conn, -inflight, -ramp-inflight and -ramp-rate must be positive")
	}
	if c.rampMax <= 0 {
		c.rampMax = rampMaxFor(c.leases, c.rampRate)
	}
	c.identities = strings.Split(ids, ",")
	if *pprofAddr != "" {
		stop, err := servePprof(*pprofAddr)
		if err != nil {
			return err
		}
		defer stop()
	}
	var err error
	if c.nodes, err = parseNodes(nodes); err != nil {
		return err
	}
	// A hard bound on the whole level, whatever the bus does.
	ctx, cancel := context.WithTimeout(ctx, c.rampMax+c.dur+2*time.Minute)
	defer cancel()
	return level(ctx, c)
}

// rampMaxFor is the default bound on taking n leases at rate a second:
// twice the time it should take, plus a minute.
func rampMaxFor(n int, rate float64) time.Duration {
	return 2*time.Duration(float64(n)/rate*float64(time.Second)) + time.Minute
}

// servePprof serves net/http/pprof's handlers on addr, a loopback
// address, until stop is called.
func servePprof(addr string) (stop func(), err error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil || !net.ParseIP(host).IsLoopback() {
		return nil, fmt.Errorf("-pprof %q: want a loopback host:port", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	return func() {
		_ = srv.Close()
		<-done
	}, nil
}

// printPorts prints n free loopback ports below the kernel's ephemeral
// range (testutil.StablePorts): a node the bench kills is started again
// on its ports.
func printPorts(arg string) error {
	var n int
	if _, err := fmt.Sscan(arg, &n); err != nil || n <= 0 || n > 64 {
		return fmt.Errorf("ports %q: want a count from 1 to 64", arg)
	}
	ports, err := testutil.StablePorts(n)
	if err != nil {
		return err
	}
	fmt.Println(strings.Trim(fmt.Sprint(ports), "[]"))
	return nil
}

// A holder's state as its OnChange reported it (slot.state).
const (
	stateHeld = iota
	stateUnknown
	stateLost
)

// Phases of a level, for the renewals' histograms.
const (
	phaseRamp = iota
	phaseSteady
	phaseDone
)

// slot is one of the -leases leases the driver keeps: a fixed repo, path
// and connection; its holder changes with churn.
type slot struct {
	c    *leasebus.Client
	repo string
	i    int
	node int // the index in -urls of the node its connection is on

	gen atomic.Int64 // the slot's acquires so far: each takes a path of its own

	mu   sync.Mutex
	h    *leasebus.Holder // nil when none is held; guarded by mu
	ours *atomic.Bool     // set before the driver itself ends h; guarded by mu
	// state is h's last state as its OnChange said (a HolderState index:
	// held, unknown, lost), read without asking h: Holder.State and Fence
	// act (a silent service makes them doubt and renew at once), and the
	// driver must not add renewals a holder that is not writing would not
	// send. Guarded by mu.
	state *atomic.Int32
	busy  bool // an acquire or a churn cycle is under way; guarded by mu
}

// load is one level's state and counts.
type load struct {
	cfg   config
	slots []*slot
	conns []*nats.Conn

	phase     atomic.Int32
	rampAcq   Hist
	steadyAcq Hist
	release   Hist
	// lag is how late the driver's own goroutines run during the steady
	// window (lagLoop): a latency sample includes as much of it as the
	// goroutine that times the answer waited to run.
	lag   Hist
	renew [phaseDone]Hist
	// acqBy and renewBy split the steady window's acquires and renewals
	// by the node the slot's connection is on (-urls order): whether the
	// tail is the primary's or the way through a standby's forward.
	acqBy, renewBy [maxNodes]Hist
	errs           Kinds
	losses         Kinds // spurious losses, by the kind of the holder's error
	unknowns       atomic.Int64
	// doubts counts the holders' Unknown events by why (doubtOf).
	doubts     Kinds
	churnSkips atomic.Int64
	// disconnects counts the driver's connections dropped (a stale
	// connection: the server's answers to PINGs came too late).
	disconnects atomic.Int64
	// disconnectWhy counts them by why (disconnectOf).
	disconnectWhy Kinds
	churned       atomic.Int64
	spurious      atomic.Int64
}

func level(ctx context.Context, cfg config) error {
	l := &load{cfg: cfg}
	defer l.closeConns()
	if err := l.dial(ctx); err != nil {
		return err
	}
	fmt.Printf("fleetbench: leases=%d repos=%d conns=%d identities=%d ttl=%s churn=%.0f/s steady=%s\n",
		cfg.leases, cfg.repos, len(l.conns), len(cfg.identities), cfg.ttl, cfg.churn, cfg.dur)

	sctx, stopSampling := context.WithCancel(ctx)
	var sampling sync.WaitGroup
	start := time.Now()
	sampling.Go(func() { l.sampleLoop(sctx, start) })
	sampling.Go(func() { l.lagLoop(sctx) })
	var yardstick echo
	sampling.Go(func() {
		if err := yardstick.run(sctx, l); err != nil {
			fmt.Fprintln(os.Stderr, "fleetbench:", err)
		}
	})

	// Ramp: take every lease, at most -ramp-rate a second, until all are
	// held or -ramp-max is over.
	rampEnd := start.Add(cfg.rampMax)
	l.ramp(ctx, rampEnd)
	rampTook := time.Since(start)
	l.scanLosses()
	heldAtRamp := l.held()
	fmt.Printf("ramp: %d of %d leases held after %s\n", heldAtRamp, cfg.leases, rampTook.Round(time.Millisecond))

	// Steady window: hold them, with churn.
	now := time.Now()
	for _, n := range cfg.nodes {
		n.markSteady(now)
	}
	msgs0 := l.msgs()
	_, self0, _ := readProc(os.Getpid())
	l.phase.Store(phaseSteady)
	steadyStart := time.Now()
	l.steady(ctx, steadyStart.Add(cfg.dur))
	steadyTook := time.Since(steadyStart)
	msgs1 := l.msgs()
	_, self1, _ := readProc(os.Getpid())
	l.phase.Store(phaseDone)
	stopSampling()
	sampling.Wait()
	l.scanLosses()
	now = time.Now()
	for _, n := range cfg.nodes {
		n.sample(now)
	}
	held := l.held()
	logBytes, auditBytes, logMsgs, streamErr := l.streamBytes(ctx)

	r := &Result{Leases: cfg.leases, Repos: cfg.repos, Acquire: &l.steadyAcq, Renew: &l.renew[phaseSteady],
		Errors: l.errs.Total(), Spurious: l.spurious.Load()}
	// Per lease the holders still vouch for or doubt (not lost): what the
	// log keeps for them.
	r.BytesPerLease = math.NaN()
	if live := held + l.unknownNow(); live > 0 {
		r.BytesPerLease = float64(logBytes) / float64(live)
	}
	var cpu []string
	for _, n := range cfg.nodes {
		r.RSSMBMax = max(r.RSSMBMax, n.rssMax)
		cpu = append(cpu, fmt.Sprintf("%.0f", n.steadyCPU()))
	}
	add := func(k, format string, a ...any) { r.Extra = append(r.Extra, Field{k, fmt.Sprintf(format, a...)}) }
	add("held_end", "%d", held)
	add("held_after_ramp", "%d", heldAtRamp)
	add("ramp_s", "%.1f", rampTook.Seconds())
	add("ramp_acquire_p50_ms", "%s", ms(l.rampAcq.Quantile(.5)))
	add("ramp_acquire_p99_ms", "%s", ms(l.rampAcq.Quantile(.99)))
	add("ramp_renew_p99_ms", "%s", ms(l.renew[phaseRamp].Quantile(.99)))
	var acqBy, renewBy []string
	for i := range maxNodes {
		acqBy = append(acqBy, ms(l.acqBy[i].Quantile(.99)))
		renewBy = append(renewBy, ms(l.renewBy[i].Quantile(.99)))
	}
	add("acquire_p99_ms_by_node", "%s", strings.Join(acqBy, "/"))
	add("renew_p99_ms_by_node", "%s", strings.Join(renewBy, "/"))
	add("release_p50_ms", "%s", ms(l.release.Quantile(.5)))
	add("release_p99_ms", "%s", ms(l.release.Quantile(.99)))
	add("steady_s", "%.1f", steadyTook.Seconds())
	add("churn_per_s", "%.1f", float64(l.churned.Load())/steadyTook.Seconds())
	add("churn_skipped", "%d", l.churnSkips.Load())
	add("renew_per_s", "%.1f", float64(l.renew[phaseSteady].Count())/steadyTook.Seconds())
	add("client_msgs_per_s", "%.0f", float64(msgs1.InMsgs+msgs1.OutMsgs-msgs0.InMsgs-msgs0.OutMsgs)/steadyTook.Seconds())
	add("client_kb_per_s", "%.0f", float64(msgs1.InBytes+msgs1.OutBytes-msgs0.InBytes-msgs0.OutBytes)/1024/steadyTook.Seconds())
	add("unknown_events", "%d", l.unknowns.Load())
	add("unknown_by_why", "%s", l.doubts.String())
	add("disconnects", "%d", l.disconnects.Load())
	add("disconnects_by_why", "%s", l.disconnectWhy.String())
	add("errors_by_kind", "%s", l.errs.String())
	add("losses_by_kind", "%s", l.losses.String())
	add("cpu_pct_nodes", "%s", strings.Join(cpu, "/"))
	add("cpu_pct_driver", "%.0f", cpuPct(self1-self0, steadyTook))
	add("driver_lag_p50_ms", "%s", ms(l.lag.Quantile(.5)))
	add("driver_lag_p99_ms", "%s", ms(l.lag.Quantile(.99)))
	add("driver_lag_p999_ms", "%s", ms(l.lag.Quantile(.999)))
	yardstick.fields(add)
	for _, n := range cfg.nodes {
		add("rss_mb_"+n.name, "%.0f->%.0f", n.rssFirst, n.rssLast)
	}
	add("log_bytes", "%d", logBytes)
	add("log_msgs", "%d", logMsgs)
	add("audit_bytes", "%d", auditBytes)
	if streamErr != nil {
		add("stream_info_error", "%s", kindOf(streamErr))
		fmt.Fprintln(os.Stderr, "fleetbench: stream info:", streamErr)
	}
	l.stopHolders()
	for _, e := range l.errs.Examples() {
		fmt.Println("EXAMPLE error", e)
	}
	for _, e := range l.losses.Examples() {
		fmt.Println("EXAMPLE loss", e)
	}
	for _, e := range l.disconnectWhy.Examples() {
		fmt.Println("EXAMPLE disconnect", e)
	}
	fmt.Println(r.Line())
	return nil
}

// dial opens one connection per -per-conn slots, as the enrolled
// identities, and lays out the slots.
func (l *load) dial(ctx context.Context) error {
	n := (l.cfg.leases + l.cfg.perConn - 1) / l.cfg.perConn
	l.conns = make([]*nats.Conn, n)
	clients := make([]*leasebus.Client, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 16)
	for k := range n {
		id := l.cfg.identities[k%len(l.cfg.identities)]
		creds := leasebus.BusCreds{Path: filepath.Join(leasebus.HoldersDir(l.cfg.credsDir), id+".nk"), Source: "-identities", Role: leasebus.RoleHolder}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if ctx.Err() != nil {
				return
			}
			opts := append(leasebus.HolderConnOptions(),
				// Counted, not printed: nats.go's default handler writes
				// each one to stderr.
				nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { l.errs.AddErr("conn_async:"+kindOf(err), err) }),
				nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
					l.disconnects.Add(1)
					if err != nil {
						l.disconnectWhy.AddErr(disconnectOf(err), err)
					}
				}))
			nc, err := leasebus.Dial(l.cfg.urls, "-urls", creds, opts...)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("connection %d as %s: %w", k, id, err)
				}
				return
			}
			l.conns[k], clients[k] = nc, leasebus.NewClient(nc)
		})
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	l.slots = make([]*slot, l.cfg.leases)
	for i := range l.slots {
		l.slots[i] = &slot{c: clients[i/l.cfg.perConn], repo: fmt.Sprintf("github.com/fleet/repo-%04d", i%l.cfg.repos), i: i,
			node: l.nodeOf(l.conns[i/l.cfg.perConn])}
	}
	return nil
}

// maxNodes bounds the nodes latencies are split by.
const maxNodes = 3

// nodeOf is the index in -urls of the server nc is connected to (its
// port), or the last when it is none of them.
func (l *load) nodeOf(nc *nats.Conn) int {
	at := nc.ConnectedUrl()
	for i, u := range strings.Split(l.cfg.urls, ",") {
		if _, port, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(u), "nats://"), ":"); ok && strings.HasSuffix(at, ":"+port) && i < maxNodes {
			return i
		}
	}
	return maxNodes - 1
}

func (l *load) closeConns() {
	for _, nc := range l.conns {
		if nc != nil {
			nc.Close()
		}
	}
}

// msgs sums the connections' message and byte counts.
func (l *load) msgs() nats.Statistics {
	var s nats.Statistics
	for _, nc := range l.conns {
		st := nc.Stats()
		s.InMsgs += st.InMsgs
		s.OutMsgs += st.OutMsgs
		s.InBytes += st.InBytes
		s.OutBytes += st.OutBytes
	}
	return s
}

// acquire takes s's lease and starts holding it; into is where its
// latency goes.
func (l *load) acquire(ctx context.Context, s *slot, into *Hist) bool {
	ours := &atomic.Bool{}
	state := &atomic.Int32{}
	opts := leasebus.HoldOptions{
		OnRenew: func(took time.Duration, err error) {
			phase := min(l.phase.Load(), phaseSteady)
			l.renew[phase].Add(took)
			if phase == phaseSteady {
				l.renewBy[s.node].Add(took)
			}
			if err != nil && !ours.Load() {
				l.errs.AddErr("renew:"+kindOf(err), err)
			}
		},
		OnChange: func(st lease.HolderState, err error) {
			switch st {
			case lease.Held:
				state.Store(stateHeld)
			case lease.Unknown:
				state.Store(stateUnknown)
				l.unknowns.Add(1)
				l.doubts.Add(doubtOf(err))
			default:
				state.Store(stateLost)
			}
		},
	}
	// A path of its own per acquire: a release that failed leaves its lease
	// to expire, and must not turn the slot's next acquires into conflicts.
	cl, err := scope.New([]string{fmt.Sprintf("svc/lease-%06d/%d", s.i, s.gen.Add(1))}, false, nil)
	if err != nil {
		l.errs.Add("acquire:claim")
		return false
	}
	// It may wait, as a runner's `fenceline run --wait` does: the claim is
	// the slot's own, so the wait only rides out a takeover's "try again"
	// answers, which would otherwise leave the slot empty until the churn
	// picks it again.
	req := leasebus.AcquireRequest{Repo: s.repo, Scope: cl, TTL: lease.Duration(l.cfg.ttl), Wait: lease.Duration(acquireWait),
		Owner: lease.Owner{TaskID: "fleetbench", AgentID: fmt.Sprintf("slot-%d", s.i)}}
	actx, cancel := context.WithTimeout(ctx, acquireWait+10*time.Second)
	defer cancel()
	t0 := time.Now()
	h, err := s.c.AcquireAndHold(actx, req, leasebus.NewCredential(), opts)
	if err != nil {
		l.errs.AddErr("acquire:"+kindOf(err), err)
		return false
	}
	took := time.Since(t0)
	into.Add(took)
	if into == &l.steadyAcq {
		l.acqBy[s.node].Add(took)
	}
	s.mu.Lock()
	s.h, s.ours, s.state = h, ours, state
	s.mu.Unlock()
	return true
}

// ramp acquires every slot without a holder, -ramp-rate a second and
// -ramp-inflight at a time, pass after pass, until all are held or until end.
func (l *load) ramp(ctx context.Context, end time.Time) {
	gap := time.Duration(float64(time.Second) / l.cfg.rampRate)
	sem := make(chan struct{}, l.cfg.rampInflight)
	var wg sync.WaitGroup
	defer wg.Wait()
	next := time.Now()
	for ctx.Err() == nil && time.Now().Before(end) {
		l.scanLosses()
		todo := 0
		for _, s := range l.slots {
			if time.Now().After(end) || ctx.Err() != nil {
				return
			}
			s.mu.Lock()
			free := s.h == nil && !s.busy
			s.busy = s.busy || free
			s.mu.Unlock()
			if !free {
				continue
			}
			todo++
			if d := time.Until(next); d > 0 {
				time.Sleep(d) // pacing the load, not waiting for state
			}
			next = next.Add(gap)
			if now := time.Now(); next.Before(now) {
				next = now
			}
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				l.acquire(ctx, s, &l.rampAcq)
				s.mu.Lock()
				s.busy = false
				s.mu.Unlock()
			})
		}
		if todo == 0 {
			return
		}
		wg.Wait() // this pass's acquires, before looking for what failed
	}
}

// acquireWait is how long an acquire may wait (AcquireRequest.Wait).
const acquireWait = 20 * time.Second

// steady runs churn until end: every 1/-churn seconds a random slot's
// holder is released and a new lease acquired in its place (a slot
// without a holder only acquires).
func (l *load) steady(ctx context.Context, end time.Time) {
	var wg sync.WaitGroup
	defer wg.Wait()
	if l.cfg.churn <= 0 {
		select {
		case <-ctx.Done():
		case <-time.After(time.Until(end)):
		}
		return
	}
	sem := make(chan struct{}, l.cfg.inflight)
	tick := time.NewTicker(time.Duration(float64(time.Second) / l.cfg.churn))
	defer tick.Stop()
	deadline := time.NewTimer(time.Until(end))
	defer deadline.Stop()
	scan := time.NewTicker(time.Second)
	defer scan.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-deadline.C:
			return
		case <-scan.C:
			l.scanLosses()
		case <-tick.C:
			s := l.slots[rand.IntN(len(l.slots))]
			s.mu.Lock()
			busy := s.busy
			s.busy = true
			s.mu.Unlock()
			if busy {
				l.churnSkips.Add(1)
				continue
			}
			select {
			case sem <- struct{}{}:
			default:
				l.churnSkips.Add(1)
				s.mu.Lock()
				s.busy = false
				s.mu.Unlock()
				continue
			}
			wg.Go(func() {
				defer func() { <-sem }()
				l.cycle(ctx, s)
				s.mu.Lock()
				s.busy = false
				s.mu.Unlock()
			})
		}
	}
}

// cycle releases s's holder (if any) and acquires a new lease for s.
func (l *load) cycle(ctx context.Context, s *slot) {
	s.mu.Lock()
	h, ours := s.h, s.ours
	s.h, s.ours, s.state = nil, nil, nil
	s.mu.Unlock()
	if h != nil {
		ours.Store(true)
		t0 := time.Now()
		err := h.Close(ctx) // bounded by leasebus.ReleaseTimeout
		if err != nil {
			l.errs.AddErr("release:"+kindOf(err), err)
		} else {
			l.release.Add(time.Since(t0))
		}
	}
	if l.acquire(ctx, s, &l.steadyAcq) {
		l.churned.Add(1)
	}
}

// scanLosses finds holders that lost their lease without the driver
// ending it: nobody revokes in this benchmark, so each is spurious. The
// slot is freed for the churn (or the ramp's next pass) to refill.
func (l *load) scanLosses() {
	for _, s := range l.slots {
		s.mu.Lock()
		h, ours := s.h, s.ours
		if h == nil {
			s.mu.Unlock()
			continue
		}
		select {
		case <-h.Lost():
		default:
			s.mu.Unlock()
			continue
		}
		s.h, s.ours, s.state = nil, nil, nil
		s.mu.Unlock()
		if ours.Load() {
			continue
		}
		l.spurious.Add(1)
		_, err := h.State()
		kind := "unknown"
		if err != nil {
			kind = kindOf(err)
		}
		l.losses.AddErr(kind, cmpErr(err))
		h.Orphan()
	}
}

// cmpErr is err, or a placeholder for a loss without one.
func cmpErr(err error) error {
	if err == nil {
		return errors.New("(no error given)")
	}
	return err
}

// held counts the slots whose holder last said held.
func (l *load) held() int { return l.countState(stateHeld) }

// unknownNow counts the slots whose holder last said unknown.
func (l *load) unknownNow() int { return l.countState(stateUnknown) }

func (l *load) countState(want int32) int {
	n := 0
	for _, s := range l.slots {
		s.mu.Lock()
		if s.h != nil && s.state.Load() == want {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// sampleLoop prints a SAMPLE line every -sample until ctx ends.
func (l *load) sampleLoop(ctx context.Context, start time.Time) {
	t := time.NewTicker(l.cfg.sample)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			now := time.Now() // the tick may be late; CPU is over the real interval
			l.scanLosses()    // so the line's count is current during a long ramp pass
			var b strings.Builder
			fmt.Fprintf(&b, "SAMPLE t=%.0fs phase=%s held=%d unknown=%d spurious=%d errors=%d disconnects=%d acquires=%d renewals=%d",
				now.Sub(start).Seconds(), [...]string{"ramp", "steady", "done"}[l.phase.Load()], l.held(), l.unknownNow(),
				l.spurious.Load(), l.errs.Total(), l.disconnects.Load(), l.rampAcq.Count()+l.steadyAcq.Count(), l.renew[phaseRamp].Count()+l.renew[phaseSteady].Count())
			for _, n := range l.cfg.nodes {
				n.sample(time.Now())
				if n.gone {
					fmt.Fprintf(&b, " %s=gone", n.name)
					continue
				}
				fmt.Fprintf(&b, " %s_rss_mb=%.0f %s_cpu_pct=%.0f", n.name, n.rssLast, n.name, n.cpuPct)
			}
			fmt.Println(b.String())
		}
	}
}

// lagLoop measures, during the steady window, how late a goroutine of the
// driver that is due to run does: a ticker every lagEvery, each tick's
// lateness from when it fired to when this goroutine took it. On a loaded
// machine the driver's answers wait to run as long, and its latency
// figures include that wait; a tail of the same size there is the
// driver's, not the bus's.
func (l *load) lagLoop(ctx context.Context) {
	const lagEvery = 10 * time.Millisecond
	t := time.NewTicker(lagEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case fired := <-t.C:
			if l.phase.Load() == phaseSteady {
				l.lag.Add(time.Since(fired))
			}
		}
	}
}

// streamBytes sums the bus's streams from their stream info, as the
// service role: the audit's, and the lease log's (every other stream but
// the events and the key-value buckets, so a layout of several log streams
// counts whole).
func (l *load) streamBytes(ctx context.Context) (logBytes, auditBytes, logMsgs uint64, err error) {
	nc, err := dialService(l.cfg.urls, l.cfg.credsDir)
	if err != nil {
		return 0, 0, 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, 0, 0, err
	}
	ictx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	streams := js.ListStreams(ictx)
	for info := range streams.Info() {
		switch name := info.Config.Name; {
		case strings.Contains(name, "AUDIT"):
			auditBytes += info.State.Bytes
		case strings.Contains(name, "EVENTS"), strings.HasPrefix(name, "KV_"):
		default:
			logBytes += info.State.Bytes
			logMsgs += info.State.Msgs
		}
	}
	if err := streams.Err(); err != nil {
		return logBytes, auditBytes, logMsgs, fmt.Errorf("list streams: %w", err)
	}
	return logBytes, auditBytes, logMsgs, nil
}

// stopHolders stops every holder, in parallel (each waits for its
// goroutines): the leases are left to expire with the cluster.
func (l *load) stopHolders() {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for _, s := range l.slots {
		s.mu.Lock()
		h, ours := s.h, s.ours
		s.h = nil
		s.mu.Unlock()
		if h == nil {
			continue
		}
		ours.Store(true)
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			h.Orphan()
		})
	}
	wg.Wait()
}
