package sidecar

import (
	"context"
	"io"
	"net"
	"net/http"
	"regexp"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/fenceline/fenceline/lease"
)

// Byte directions of fenceline_proxy_bytes_total.
const (
	DirToUpstream = "to_upstream" // from the agent, through the fence, to the server
	DirToAgent    = "to_agent"    // from the server, through the fence, to the agent
)

// Metrics are the sidecar's Prometheus metrics, on a registry of their own
// (never the global one), so several sidecars in one process (tests) do
// not collide:
//
//	fenceline_leases_held                          gauge: leases held right now
//	fenceline_lease_renew_seconds                  histogram: renewal round trips
//	fenceline_lease_renew_failures_total           counter: renewals that failed
//	fenceline_refusals_total{boundary,reason}      counter: refused writes, and egress refused (boundary net)
//	fenceline_proxy_requests_total{boundary}       counter: git HTTP requests, Postgres connections,
//	                                               connections the egress proxy made (boundary net)
//	fenceline_proxy_bytes_total{boundary,direction} counter: bytes relayed (to_upstream, to_agent)
//	fenceline_fsguard_denials_total                counter: file writes the guard refused
//
// plus the Go runtime and process collectors. reason is a short code
// (gitproxy's, or a class of the Postgres and file refusals: lease-lost,
// lease-unknown, outside-lease, unnamed-table, fence-tamper,
// read-only-transaction, other), never free text, so the label stays
// bounded.
type Metrics struct {
	reg           *prometheus.Registry
	renew         prometheus.Histogram
	renewFailures prometheus.Counter
	refusals      *prometheus.CounterVec
	requests      *prometheus.CounterVec
	bytes         *prometheus.CounterVec
	fsDenials     prometheus.Counter

	mu      sync.Mutex
	holders []lease.Holding // guarded by mu
}

// NewMetrics returns the sidecar's metrics on a new private registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		renew: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceline_lease_renew_seconds",
			Help:    "Round trip of one lease renewal (successful or not).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14), // 0.5 ms .. 4 s
		}),
		renewFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceline_lease_renew_failures_total",
			Help: "Lease renewals that failed (bus unreachable, or refused: the lease is lost).",
		}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceline_refusals_total",
			Help: "Writes refused at a fence, by boundary (git, postgres, file) and reason code.",
		}, []string{"boundary", "reason"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceline_proxy_requests_total",
			Help: "Requests through a fence: git HTTP requests, Postgres connections.",
		}, []string{"boundary"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceline_proxy_bytes_total",
			Help: "Bytes relayed by a fence, by direction (to_upstream, to_agent).",
		}, []string{"boundary", "direction"}),
		fsDenials: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "fenceline_fsguard_denials_total",
			Help: "File writes the file guard refused because the lease was not held.",
		}),
	}
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_leases_held",
		Help: "Leases this process holds right now (renewed within their ttl minus margin).",
	}, m.heldCount)
	m.reg.MustRegister(held, m.renew, m.renewFailures, m.refusals, m.requests, m.bytes, m.fsDenials,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is the private registry the metrics are on.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// ObserveRenew records one renewal attempt: a holder's hook after each
// renewal (leasebus.HoldOptions.OnRenew), feeding the renewal histogram
// and failure counter.
func (m *Metrics) ObserveRenew(took time.Duration, err error) {
	m.renew.Observe(took.Seconds())
	if err != nil {
		m.renewFailures.Inc()
	}
}

// TrackLease counts h in fenceline_leases_held while it is held.
func (m *Metrics) TrackLease(h lease.Holding) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.holders = append(m.holders, h)
}

func (m *Metrics) heldCount() float64 {
	m.mu.Lock()
	hs := append([]lease.Holding(nil), m.holders...)
	m.mu.Unlock()
	n := 0
	for _, h := range hs {
		if st, _ := h.State(); st == lease.Held {
			n++
		}
	}
	return float64(n)
}

// Refused counts one refused write.
func (m *Metrics) Refused(boundary, reason string) {
	m.refusals.WithLabelValues(boundary, ReasonCode(reason)).Inc()
	if boundary == lease.BoundaryFile {
		m.fsDenials.Inc()
	}
}

// Auditor returns an Auditor that counts every denied-write event it is
// given and passes it on to next (nil: count only).
func (m *Metrics) Auditor(next lease.Auditor) lease.Auditor {
	return &countingAuditor{m: m, next: next}
}

type countingAuditor struct {
	m    *Metrics
	next lease.Auditor
}

func (c *countingAuditor) Record(ctx context.Context, ev lease.AuditEvent) error {
	if ev.Type == lease.EventDenied {
		c.m.Refused(ev.Boundary, ev.Reason)
	}
	if c.next == nil {
		return nil
	}
	return c.next.Record(ctx, ev)
}

var reasonCodeRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`)

// ReasonCode is the metric label of a refusal's reason: the fences put a
// short code there (gitproxy.Reason*, pgproxy.Reason*, fsguard.Reason*);
// anything else counts as "other", so the label's values stay bounded.
func ReasonCode(reason string) string {
	if reasonCodeRE.MatchString(reason) {
		return reason
	}
	return "other"
}

// countHTTP wraps a fence's handler: it counts requests and the bytes of
// request bodies (to the upstream) and responses (to the agent).
func (m *Metrics) countHTTP(boundary string, h http.Handler) http.Handler {
	requests := m.requests.WithLabelValues(boundary)
	up, down := m.bytes.WithLabelValues(boundary, DirToUpstream), m.bytes.WithLabelValues(boundary, DirToAgent)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Inc()
		if r.Body != nil && r.Body != http.NoBody {
			r.Body = &countingBody{ReadCloser: r.Body, c: up}
		}
		h.ServeHTTP(&countingWriter{ResponseWriter: w, c: down}, r)
	})
}

type countingBody struct {
	io.ReadCloser
	c prometheus.Counter
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.c.Add(float64(n))
	}
	return n, err
}

type countingWriter struct {
	http.ResponseWriter
	c prometheus.Counter
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	if n > 0 {
		w.c.Add(float64(n))
	}
	return n, err
}

// Unwrap lets http.ResponseController reach the real writer (flushes).
func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *countingWriter) Flush() { http.NewResponseController(w.ResponseWriter).Flush() }

// countDial wraps a fence's upstream dialer: every connection counts as a
// request, and bytes written to it go to the upstream, bytes read from it
// to the agent.
func (m *Metrics) countDial(boundary string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		d := &net.Dialer{}
		dial = d.DialContext
	}
	requests := m.requests.WithLabelValues(boundary)
	up, down := m.bytes.WithLabelValues(boundary, DirToUpstream), m.bytes.WithLabelValues(boundary, DirToAgent)
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		requests.Inc()
		return &countingConn{Conn: c, up: up, down: down}, nil
	}
}

type countingConn struct {
	net.Conn
	up, down prometheus.Counter
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.down.Add(float64(n))
	}
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.up.Add(float64(n))
	}
	return n, err
}

// CloseWrite half-closes the upstream connection when it can (pgproxy
// does at the end of a session).
func (c *countingConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
