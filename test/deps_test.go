package test

import (
	"os/exec"
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
