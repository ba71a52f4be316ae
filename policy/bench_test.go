package policy

import (
	"slices"
	"strconv"
	"testing"
	"time"
)

// benchPolicy is the issue's example plus the recipes of docs/policy.md.
const benchPolicy = issueExample + `
@id("max-ttl") forbid (principal, action == Fenceline::Action::"claim", resource) when { context.ttl_seconds > 3600 };
@id("model-hosts-only") forbid (principal, action == Fenceline::Action::"connect", resource is Fenceline::Host)
unless { resource.name == "api.openai.com" || resource.name == "api.anthropic.com" };
@id("no-force-main") forbid (principal, action == Fenceline::Action::"push", resource is Fenceline::Ref)
when { resource.name == "refs/heads/main" && (context.force || context.delete) };
`

func benchStore(b *testing.B) *Store {
	Prefault() // as a run, a sidecar and the lease service do when they start
	var s Store
	if err := s.Put(Document{Mode: ModeEnforce, Version: 1, Text: benchPolicy}); err != nil {
		b.Fatal(err)
	}
	if err := s.Put(Document{Repo: repo, Mode: ModeEnforce, Version: 1, Text: `@id("no-migrations") forbid (principal, action, resource is Fenceline::Path) when { resource.path like "db/migrations/*" };`}); err != nil {
		b.Fatal(err)
	}
	return &s
}

// reportQuantiles times each call of f and reports p50 and p99 (µs), and
// the page faults the process took meanwhile per call.
func reportQuantiles(b *testing.B, f func(i int)) {
	lat := make([]time.Duration, 0, b.N)
	faults := minorFaults()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		f(i)
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	b.ReportMetric(float64(minorFaults()-faults)/float64(b.N), "faults/op")
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3 }
	b.ReportMetric(q(0.50), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
}

// BenchmarkDecideUncached is a decision evaluated by Cedar (a request
// never asked before: a new path each time), against two policies of
// eight rules.
func BenchmarkDecideUncached(b *testing.B) {
	s := benchStore(b)
	reportQuantiles(b, func(i int) {
		s.Decide(req(ActionWrite, KindPath, "services/billing/f"+strconv.Itoa(i)+".go"))
	})
}

// BenchmarkDecideUncachedWarm is BenchmarkDecideUncached in a process
// past its start: 50,000 other uncached decisions (untimed, other paths)
// first, so that the heap has grown to its working size and the pages
// under it are the process's. The first decisions of a fresh process
// each fault a new page in now and then (13 µs and more on a virtual
// machine); a fence decides for the lifetime of its agent.
func BenchmarkDecideUncachedWarm(b *testing.B) {
	s := benchStore(b)
	for i := 0; i < 50000; i++ {
		s.Decide(req(ActionWrite, KindPath, "warm/f"+strconv.Itoa(i)+".go"))
	}
	reportQuantiles(b, func(i int) {
		s.Decide(req(ActionWrite, KindPath, "services/billing/f"+strconv.Itoa(i)+".go"))
	})
}

// BenchmarkDecideCached is a decision asked again in the same policy
// version (a lease's claim, a connect to the same host).
func BenchmarkDecideCached(b *testing.B) {
	s := benchStore(b)
	r := Request{Agent: "a", Repo: repo, Action: ActionConnect, Resource: Resource{Kind: KindHost, Name: "api.openai.com", Port: 443}}
	s.Decide(r)
	reportQuantiles(b, func(int) { s.Decide(r) })
}

// BenchmarkDecideNoPolicy is what a fence pays with no policy set.
func BenchmarkDecideNoPolicy(b *testing.B) {
	var s Store
	r := req(ActionWrite, KindPath, "services/billing/a.go")
	reportQuantiles(b, func(int) { s.Decide(r) })
}

// BenchmarkQuantileControl is the harness's yardstick: a fixed 3 µs of
// arithmetic timed like a decision, allocating nothing. Its p99 is what
// the machine and the timer add (run beside the decisions: a p99 here
// near its p50 says a decision's tail is the decision's own — its
// allocations and the collector's assists — not the scheduler's).
func BenchmarkQuantileControl(b *testing.B) {
	x := uint64(1)
	reportQuantiles(b, func(i int) {
		for j := 0; j < 3000; j++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
	})
	if x == 0 {
		b.Log(x) // keeps the loop
	}
}
