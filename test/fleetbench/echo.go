package main

import (
	"context"
	"fmt"
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
// lease service on the way. A responder on the first node answers at once;
// one prober on each node asks every echoEvery, and the steady window's
// round trips are kept by the prober's node (the first node's stay on its
// server; the others cross a route each way, as a request a standby
// forwards does). What the leases take beyond it is the lease service's;
// what it takes is the machine's, NATS's and this driver's.
type echo struct {
	all  Hist
	by   [maxNodes]Hist
	errs Kinds
}

// run answers and probes until ctx ends, recording only while steady
// says so. It returns once its connections are closed.
func (e *echo) run(ctx context.Context, l *load) error {
	urls := strings.Split(l.cfg.urls, ",")
	creds := leasebus.BusCreds{Path: filepath.Join(l.cfg.credsDir, leasebus.CredsFile(leasebus.RoleService)), Source: "-creds", Role: leasebus.RoleService}
	dial := func(url string) (*nats.Conn, error) { return leasebus.Dial(strings.TrimSpace(url), "-urls", creds) }
	responder, err := dial(urls[0])
	if err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	defer responder.Close()
	if _, err := responder.Subscribe(echoSubject, func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	if err := responder.Flush(); err != nil {
		return fmt.Errorf("echo responder: %w", err)
	}
	var probers sync.WaitGroup
	defer probers.Wait()
	for i, url := range urls[:min(len(urls), maxNodes)] {
		nc, err := dial(url)
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
	t := time.NewTicker(echoEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		began := time.Now()
		_, err := nc.RequestWithContext(rctx, echoSubject, []byte("x"))
		took := time.Since(began)
		cancel()
		if l.phase.Load() != phaseSteady {
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				e.errs.AddErr(kindOf(err), err)
			}
			continue
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
