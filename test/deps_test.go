package test

import (
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// TestFencesDoNotLinkTheBusServer checks the layering of the lease bus:
// the fences (and the lease bus's client side) never link the NATS
// server, which only `fenceline bus serve` and the tests embed (package
// leasebus/embedded); the file guard, the egress proxy, the git and
// Postgres fences and the lease domain link no NATS at all, nor does the
// policy they ask (package policy), nor the shard store, the run UI, the
// sidecar that runs the fences and a guarded attempt, which consume
// interfaces of their own (shard.Records, runui.Source, lease.Holding,
// lease.Auditor) that package leasebus implements and the CLI wires. A
// fence that needs a lease type imports package lease. TestLayers checks
// the whole import graph.
func TestFencesDoNotLinkTheBusServer(t *testing.T) {
	const mod = "github.com/fenceline/fenceline/"
	rules := []struct {
		pkgs   []string
		banned string
	}{
		{[]string{"fsguard", "gitproxy", "pgproxy", "egress", "sidecar", "leasebus"}, "github.com/nats-io/nats-server"},
		{[]string{"fsguard", "lease", "policy"}, "github.com/nats-io/"},                                            // the policy every fence asks: no bus
		{[]string{"egress", "gitproxy", "pgproxy", "shard", "runui", "sidecar", "attempt"}, "github.com/nats-io/"}, // fences that know only the lease domain (issue 29)
	}
	for _, r := range rules {
		for _, pkg := range r.pkgs {
			out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", "../"+pkg).CombinedOutput()
			if err != nil {
				t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
			}
			deps := strings.Fields(string(out))
			if len(deps) < 2 || deps[len(deps)-1] != mod+pkg {
				t.Fatalf("go list -deps %s listed %d packages ending in %q, want its dependencies then itself", pkg, len(deps), deps[len(deps)-1:])
			}
			var bad []string
			for _, d := range deps {
				if strings.HasPrefix(d, r.banned) {
					bad = append(bad, d)
				}
			}
			if len(bad) > 0 {
				t.Errorf("%s depends on %d packages under %s, first %s: find the import with `go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./%s`",
					pkg, len(bad), r.banned, bad[0], pkg)
			}
		}
	}
}

// TestBinaryLinksNoTestFixture checks that the shipped binary links no test
// fixture: no package of cmd/fenceline's dependencies imports "testing",
// and none outside the standard library is named as a test helper (a path
// element testing, *test, test*, *fixture*, as pgtest, bustest, testutil,
// testca are). The demo's real servers are production packages named for
// what they are (gitserver, pgserver).
func TestBinaryLinksNoTestFixture(t *testing.T) {
	const cmd = "github.com/fenceline/fenceline/cmd/fenceline"
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}\t{{.Standard}}\t{{join .Imports \" \"}}", "../cmd/fenceline").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps cmd/fenceline: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) < 2 || !strings.HasPrefix(lines[len(lines)-1], cmd+"\t") {
		t.Fatalf("go list -deps cmd/fenceline listed %d packages, the last not %s: want its dependencies then itself", len(lines), cmd)
	}
	fixture := func(path string) bool {
		for _, el := range strings.Split(path, "/") {
			el = strings.ToLower(el)
			if el == "testing" || strings.HasSuffix(el, "test") || strings.HasPrefix(el, "test") || strings.Contains(el, "fixture") {
				return true
			}
		}
		return false
	}
	for _, l := range lines {
		f := strings.SplitN(l, "\t", 3)
		if len(f) != 3 {
			t.Fatalf("go list line %q: want path, standard, imports", l)
		}
		path, std, imports := f[0], f[1] == "true", strings.Fields(f[2])
		if path == "testing" {
			t.Errorf("cmd/fenceline links package testing")
		}
		if !std && fixture(path) {
			t.Errorf("cmd/fenceline links %s, named as a test fixture: find who imports it with `go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./cmd/fenceline`", path)
		}
		for _, imp := range imports {
			if imp == "testing" {
				t.Errorf("cmd/fenceline links %s, which imports testing", path)
			}
		}
	}
	// The check above must see the fixtures: the tests' own Postgres
	// helper is one by its name.
	if !fixture("github.com/fenceline/fenceline/internal/pgtest") || fixture("github.com/fenceline/fenceline/internal/pgserver") {
		t.Fatal("the fixture rule misjudges pgtest or pgserver")
	}
}

// layers is the architecture as the imports must show it, from the lease
// domain up to the command: a package may import the module's packages of
// lower layers only (and its own subpackages), so a fence never reaches
// the bus, the bus never reaches a fence, and nothing below the command
// reaches the CLI. Test fixtures and the test and benchmark programs are
// outside the table (TestBinaryLinksNoTestFixture keeps them out of the
// binary). A package missing from the table fails the test: a new package
// takes its place here when it is written.
var layers = [][]string{
	// leaves: no domain of their own
	{"lease/scope", "internal/gitsafe", "internal/gitsafe/gittrap", "internal/gitserver", "internal/pgserver",
		"pgproxy/internal/evloop", "pgproxy/internal/wakecost", "internal/lograte", "deploy"},
	// the lease domain
	{"lease", "internal/repoid"},
	// what every boundary asks: the security team's policy; shard records
	{"policy", "shard/record"},
	// the fences, and shard pools: they know the lease domain, never the bus
	{"fsguard", "gitproxy", "pgproxy", "egress", "shard"},
	// the bus (NATS), and the run UI over what the bus serves it
	{"leasebus", "runui"},
	// the bus's server, the acquirer's credentials; the fences under one lease
	{"leasebus/embedded", "leasebus/credfile", "sidecar"},
	// a guarded attempt; `bus serve`
	{"attempt", "leasebus/busserve"},
	{"internal/demo"},
	{"internal/cli"},
	{"cmd/fenceline"},
}

// outside the table: fixtures, test suites, benchmark and load programs.
func outsideLayers(p string) bool {
	return p == "test" || strings.HasPrefix(p, "test/") || p == "pgproxy/internal/benchproxy" || p == "pgproxy/internal/barerelay" ||
		p == "internal/bustest" || p == "internal/natstest" || p == "internal/testutil" || p == "internal/testca" || p == "internal/pgtest"
}

// busSide may link NATS: the bus itself and what wires it to the rest.
var busSide = map[string]bool{"leasebus": true, "leasebus/embedded": true, "leasebus/credfile": true,
	"leasebus/busserve": true, "internal/demo": true, "internal/cli": true, "cmd/fenceline": true}

// TestLayers checks the module's imports against layers, and that only the
// bus side links any github.com/nats-io/ package (directly or through
// another package).
func TestLayers(t *testing.T) {
	const mod = "github.com/fenceline/fenceline/"
	rank := map[string]int{}
	for i, l := range layers {
		for _, p := range l {
			rank[p] = i
		}
	}
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}\t{{join .Imports \" \"}}\t{{join .Deps \" \"}}", "../...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list ../...: %v\n%s", err, out)
	}
	seen := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 3 || !strings.HasPrefix(f[0], mod) {
			t.Fatalf("go list line %q: want a package of %s, its imports and its dependencies", line, mod)
		}
		pkg := strings.TrimPrefix(f[0], mod)
		if outsideLayers(pkg) {
			continue
		}
		r, ok := rank[pkg]
		if !ok {
			t.Errorf("%s has no layer: add it to test/deps_test.go's table where its imports put it", pkg)
			continue
		}
		seen++
		for _, imp := range strings.Fields(f[1]) {
			dep, ok := strings.CutPrefix(imp, mod)
			if !ok || strings.HasPrefix(dep, pkg+"/") {
				continue
			}
			if dr, ok := rank[dep]; !ok || dr >= r {
				t.Errorf("%s (layer %d) imports %s (layer %s): a package imports only lower layers", pkg, r, dep, layerName(rank, dep))
			}
		}
		if busSide[pkg] {
			continue
		}
		var nats []string
		for _, d := range strings.Fields(f[2]) {
			if strings.HasPrefix(d, "github.com/nats-io/") {
				nats = append(nats, d)
			}
		}
		if len(nats) > 0 {
			sort.Strings(nats)
			t.Errorf("%s links %d NATS packages (first %s); only the bus side does: find the import with `go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./%s`", pkg, len(nats), nats[0], pkg)
		}
	}
	if seen < len(rank) {
		t.Errorf("go list showed %d of the table's %d packages: a package was renamed or removed; update the table", seen, len(rank))
	}
}

func layerName(rank map[string]int, p string) string {
	if r, ok := rank[p]; ok {
		return strconv.Itoa(r)
	}
	return "none: a fixture or test program"
}
