package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
)

// echoEvery spaces one prober's requests: 50 a second from each node, a
// load too small to move the figures it sits beside.
const echoEvery = 20 * time.Millisecond

// echoSubject is the yardstick's request subject: under the lease API's
// prefix, which the service role may use, but no operation the lease
// service takes.
const echoSubject = "fenceline.lease.v1.fleetbench-echo.x"

// echo is the yardstick beside the leases' latencies: a raw NATS request
// and its reply through the same cluster, from this same process, with no
// lease service on the way. A responder on the first node, a process of
// its own as the lease service is (`fleetbench respond`), answers at
// once; one prober on each node asks about every echoEvery (jittered, so
// as not to sample one phase of the service's beats), and the steady
// window's round trips are kept by the prober's node (the first node's
// stay on its server; the others cross a route each way, as a request a
// standby forwards does). A try that fails counts at what it took, as a
// lease request's does. It is one request at a time on a quiet
// connection, where the leases' are many on busy ones: a stall costs it
// one sample and them many.
type echo struct {
	all  Hist
	by   [maxNodes]Hist
	errs Kinds
}

// run answers and probes until ctx ends, recording only while steady
// says so. It returns once its connections are closed.
func (e *echo) run(ctx context.Context, l *load) error {
	urls := strings.Split(l.cfg.urls, ",")
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	responder := exec.CommandContext(rctx, self, "respond", strings.TrimSpace(urls[0]), l.cfg.credsDir)
	responder.Stderr = os.Stderr
	out, err := responder.StdoutPipe()
	if err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	in, err := responder.StdinPipe() // its end is the responder's
	if err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	defer in.Close()
	if err := responder.Start(); err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	defer func() { stop(); _ = responder.Wait() }()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		return fmt.Errorf("echo responder did not start: %q %v", line, err)
	}
	var probers sync.WaitGroup
	defer probers.Wait()
	for i, url := range urls[:min(len(urls), maxNodes)] {
		nc, err := dialService(url, l.cfg.credsDir)
		if err != nil {
			return fmt.Errorf("echo prober on node %d: %w", i, err)
		}
		probers.Go(func() {
			defer nc.Close()
			e.probe(ctx, l, nc, i)
		})
	}
	return nil
}

func (e *echo) probe(ctx context.Context, l *load, nc *nats.Conn, node int) {
	t := time.NewTimer(echoEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		t.Reset(echoEvery/2 + rand.N(echoEvery))
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		began := time.Now()
		_, err := nc.RequestWithContext(rctx, echoSubject, []byte("x"))
		took := time.Since(began)
		cancel()
		if l.phase.Load() != phaseSteady {
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			e.errs.AddErr(kindOf(err), err)
		}
		e.all.Add(took)
		e.by[node].Add(took)
	}
}

// fields are the yardstick's figures for the RESULT line.
func (e *echo) fields(add func(k, format string, a ...any)) {
	add("echo_p50_ms", "%s", ms(e.all.Quantile(.5)))
	add("echo_p99_ms", "%s", ms(e.all.Quantile(.99)))
	add("echo_p999_ms", "%s", ms(e.all.Quantile(.999)))
	var by []string
	for i := range maxNodes {
		by = append(by, ms(e.by[i].Quantile(.99)))
	}
	add("echo_p99_ms_by_node", "%s", strings.Join(by, "/"))
	add("echo_errors", "%d", e.errs.Total())
}

// dialService connects to the bus at urls (one node's, or a list) as the
// lease service's role: it may use the echo's subject and read every
// stream's info.
func dialService(url, credsDir string) (*nats.Conn, error) {
	creds := leasebus.BusCreds{Path: filepath.Join(credsDir, leasebus.CredsFile(leasebus.RoleService)), Source: "-creds", Role: leasebus.RoleService}
	return leasebus.Dial(strings.TrimSpace(url), "-urls", creds)
}

// respond is `fleetbench respond URL CREDS`: the echo's responder, in a
// process of its own. It prints "ready" once the server has its
// subscription, and answers until killed or its stdin closes.
func respond(url, credsDir string) error {
	nc, err := dialService(url, credsDir)
	if err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	defer nc.Close()
	if _, err := nc.Subscribe(echoSubject, func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	if err := nc.Flush(); err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin) // until the driver goes
	return nil
}
