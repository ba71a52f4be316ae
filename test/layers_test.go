package test

import (
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"testing"
)

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
		"pgproxy/internal/barerelay", "pgproxy/internal/wakecost", "deploy"},
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
	return p == "test" || strings.HasPrefix(p, "test/") || p == "pgproxy/internal/benchproxy" ||
		p == "internal/bustest" || p == "internal/testutil" || p == "internal/testca" || p == "internal/pgtest"
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
			t.Errorf("%s has no layer: add it to test/layers_test.go's table where its imports put it", pkg)
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
