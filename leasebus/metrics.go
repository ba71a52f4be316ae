package leasebus

import (
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// ServiceMetrics are the lease service's Prometheus metrics, on a registry
// of their own (never the global one), for one Service
// (ServiceConfig.Metrics):
//
//	fenceline_bus_requests_total{op,result}  counter: requests answered, by
//	                                         operation and result ("ok" or the
//	                                         error code: conflict, not_found,
//	                                         lost, invalid, store_full, unavailable...)
//	fenceline_bus_request_seconds{op}        histogram: receipt to answer
//	fenceline_bus_requests_in_flight{op}     gauge: requests this instance
//	                                         took (or a standby forwarded to
//	                                         it) and has not answered yet
//	fenceline_bus_appends_total{result}      counter: lease-log appends (ok,
//	                                         cas: another writer was first,
//	                                         full: the log is at its size
//	                                         limit, error)
//	fenceline_bus_append_seconds             histogram: one append, until the
//	                                         store acknowledged it (fsync)
//	fenceline_bus_active_leases              gauge: active leases, every repo
//	                                         this instance has loaded (each
//	                                         repo's actor keeps its count as it
//	                                         commits and loads: a scrape reads
//	                                         no log)
//	fenceline_bus_repos                      gauge: repos this instance serves
//	                                         (their logs loaded)
//	fenceline_bus_queue_depth                gauge: requests waiting for their
//	                                         repo's actor
//	fenceline_bus_intake_depth               gauge: requests read off the bus
//	                                         and waiting for their asker's
//	                                         turn to be served (intake.go)
//	fenceline_bus_log_reads_total{kind}      counter: reads of the lease log:
//	                                         record (one record of one repo),
//	                                         last (a repo's last record: a
//	                                         refresh), subjects (the list of
//	                                         every repo's log)
//	fenceline_bus_id_scans_total             counter: scans of every repo's
//	                                         log for a lease id of the old form
//	                                         (one that names no repo)
//	fenceline_bus_forwarded_total{to}        counter: lease requests a standby
//	                                         took: forwarded to the primary
//	                                         (primary), or answered that none
//	                                         is known (none)
//	fenceline_bus_forwards_received_total{result}
//	                                         counter: forwarded requests that
//	                                         reached this instance: taken,
//	                                         not_primary, ignored
//	fenceline_bus_primary                    gauge: 1 while this instance is
//	                                         the primary (or no election runs)
//	fenceline_bus_claim_writes_total{result} counter: writes of the
//	                                         primary's claim (takeovers,
//	                                         renewals, releases): ok, lost
//	                                         (another wrote first), busy
//	                                         (another write of it in flight
//	                                         at the stream's leader), error
//	fenceline_bus_beats_total{kind}          counter: beats this instance
//	                                         sent (beat.go): quiet (no lease
//	                                         changed), changes (naming some
//	                                         buckets), all (naming every one)
//	fenceline_bus_beat_buckets_total         counter: buckets the beats named
//
// plus the Go runtime and process collectors, the runtime's with its
// scheduler series (go_sched_*): go_sched_latencies_seconds is how long
// goroutines waited to run once runnable (a node short of CPU shows there
// before its requests do). Grants and conflicts are
// requests_total{op="acquire"} with result ok and conflict.
type ServiceMetrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	inflight *prometheus.GaugeVec
	appends  *prometheus.CounterVec
	appendT  prometheus.Histogram
	reads    *prometheus.CounterVec
	scans    prometheus.Counter
	forwards *prometheus.CounterVec
	fwdIn    *prometheus.CounterVec
	held     *prometheus.CounterVec
	claims   *prometheus.CounterVec
	beats    *prometheus.CounterVec
	buckets  prometheus.Counter
}

// NewServiceMetrics returns the metrics on a new private registry.
func NewServiceMetrics() *ServiceMetrics {
	m := &ServiceMetrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceline_bus_requests_total",
			Help: "Lease requests answered, by operation and result (ok, or the error code).",
		}, []string{"op", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "fenceline_bus_request_seconds",
			Help:    "Time from a request's receipt to its answer, by operation.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16), // 0.1 ms .. 3.3 s
		}, []string{"op"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "fenceline_bus_requests_in_flight",
			Help: "Lease requests taken (by this instance, or forwarded to it) and not answered yet, by operation. One that stays up on a quiet bus was never answered.",
		}, []string{"op"}),
		appends: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "fenceline_bus_appends_total",
			Help: "Appends to a repo's lease log: ok, cas (another writer appended first), busy (another write of the repo's log was in flight at the stream's leader), full (the log is at its size limit), error.",
		}, []string{"result"}),
		appendT: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "fenceline_bus_append_seconds",
			Help:    "One lease-log append, until the store acknowledged it (after its fsync).",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}),
	}
	m.reads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_log_reads_total",
		Help: "Reads of the lease log: record (one record of one repo's log), last (the last record of one repo's log: a refresh), subjects (the list of every repo's log).",
	}, []string{"kind"})
	m.scans = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "fenceline_bus_id_scans_total",
		Help: "Scans of every repo's lease log for a lease id of the old form, which names no repo.",
	})
	m.forwards = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_forwarded_total",
		Help: "Lease requests a standby took: forwarded to the primary (to=primary), or answered that no primary is known (to=none) or that the one it forwarded to takes no requests (to=gone).",
	}, []string{"to"})
	m.fwdIn = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_forwards_received_total",
		Help: "Requests standbys forwarded that reached this instance: taken (handled as the primary), not_primary (answered to try again), ignored (not a standby's, another op's, or an account with no answering connection).",
	}, []string{"result"})
	m.held = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_reclaims_held_total",
		Help: "Looks of the session reaper that held off reclaiming, by why: stall (this instance did not run for a while: nothing reclaimed), backlog (keepalives wait to be read), peers (another instance's digest of the sessions it heard is late) and mass (many sessions of several identities fell silent at once): only sessions silent for the longer grace reclaimed.",
	}, []string{"why"})
	m.claims = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_claim_writes_total",
		Help: "Writes of the primary's claim (takeovers, renewals, releases), by result: ok, lost (another instance wrote it first), busy (another write of it was in flight at the stream's leader), error.",
	}, []string{"result"})
	m.beats = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "fenceline_bus_beats_total",
		Help: "Beats this lease service instance sent (vouching for every lease it serves at once), by kind: quiet (no lease changed since the last), changes (naming the buckets of those that did), all (so many changed that every session asks).",
	}, []string{"kind"})
	m.buckets = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "fenceline_bus_beat_buckets_total",
		Help: "Buckets of changed leases the beats named: each sends the sessions holding a lease in it to ask.",
	})
	m.reg.MustRegister(m.requests, m.latency, m.inflight, m.appends, m.appendT, m.reads, m.scans, m.forwards, m.fwdIn, m.held, m.claims, m.beats, m.buckets,
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(collectors.MetricsScheduler)),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is where the metrics are registered (to add more, or gather).
func (m *ServiceMetrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in Prometheus's text format.
func (m *ServiceMetrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// attach registers the gauges read from s at scrape time: from what s
// keeps in memory, never from the log.
func (m *ServiceMetrics) attach(s *Service) error {
	active := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_bus_active_leases",
		Help: "Active leases in every repo this lease service has loaded, as it knows them.",
	}, func() float64 { return float64(s.activeLeases.Load()) })
	repos := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_bus_repos",
		Help: "Repos this lease service serves (their logs loaded).",
	}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return float64(len(s.actors))
	})
	queued := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_bus_queue_depth",
		Help: "Requests waiting for their repo's actor.",
	}, func() float64 {
		n := 0
		for _, a := range s.allActors() {
			n += a.calls.len()
		}
		return float64(n)
	})
	intake := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_bus_intake_depth",
		Help: "Requests read off the bus and waiting for their asker's turn to be served.",
	}, func() float64 {
		s.mu.Lock()
		intakes := s.intakes
		s.mu.Unlock()
		n := 0
		for _, in := range intakes {
			n += in.waiting()
		}
		return float64(n)
	})
	primary := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "fenceline_bus_primary",
		Help: "1 while this lease service instance is the primary, which serves the lease requests (always without an election); 0 as a standby.",
	}, func() float64 {
		if s.Primary() {
			return 1
		}
		return 0
	})
	for _, c := range []prometheus.Collector{active, repos, queued, intake, primary} {
		if err := m.reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// answered counts one answered request of op received at 'at'.
func (m *ServiceMetrics) answered(op string, took time.Duration, err *wireError) {
	if m == nil || op == "" {
		return
	}
	result := "ok"
	if err != nil {
		result = err.Code
	}
	m.requests.WithLabelValues(op, result).Inc()
	m.latency.WithLabelValues(op).Observe(took.Seconds())
	m.inflight.WithLabelValues(op).Dec()
}

// took counts a request of op taken, until answered counts its answer.
func (m *ServiceMetrics) took(op string) {
	if m != nil && op != "" {
		m.inflight.WithLabelValues(op).Inc()
	}
}

// read counts one read of the lease log of a kind (see reads).
func (m *ServiceMetrics) read(kind string) {
	if m != nil {
		m.reads.WithLabelValues(kind).Inc()
	}
}

// forwarded counts a lease request a standby took, by where it went.
func (m *ServiceMetrics) forwarded(to string) {
	if m != nil {
		m.forwards.WithLabelValues(to).Inc()
	}
}

// forwardIn counts a forwarded request that reached this instance.
func (m *ServiceMetrics) forwardIn(result string) {
	if m != nil {
		m.fwdIn.WithLabelValues(result).Inc()
	}
}

// beat counts one beat sent, naming buckets buckets (or all).
func (m *ServiceMetrics) beat(buckets int, all bool) {
	if m == nil {
		return
	}
	kind := "quiet"
	switch {
	case all:
		kind = "all"
	case buckets > 0:
		kind = "changes"
	}
	m.beats.WithLabelValues(kind).Inc()
	m.buckets.Add(float64(buckets))
}

// claimWritten counts one write of the primary's claim by its result.
func (m *ServiceMetrics) claimWritten(result string) {
	if m != nil {
		m.claims.WithLabelValues(result).Inc()
	}
}

// reclaimsHeld counts one look of the session reaper that held off.
func (m *ServiceMetrics) reclaimsHeld(why string) {
	if m != nil {
		m.held.WithLabelValues(why).Inc()
	}
}

// scanned counts one scan of every repo's log for an old-form lease id.
func (m *ServiceMetrics) scanned() {
	if m != nil {
		m.scans.Inc()
	}
}

// appended counts one lease-log append.
func (m *ServiceMetrics) appended(took time.Duration, err error) {
	if m == nil {
		return
	}
	switch {
	case err == nil:
		m.appends.WithLabelValues("ok").Inc()
		m.appendT.Observe(took.Seconds())
	case err == errCAS:
		m.appends.WithLabelValues("cas").Inc()
	case err == errLogBusy:
		m.appends.WithLabelValues("busy").Inc()
	case errors.Is(err, ErrLogFull):
		m.appends.WithLabelValues("full").Inc()
	default:
		m.appends.WithLabelValues("error").Inc()
	}
}
