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
// Postgres fences and the lease domain link no NATS at all, nor does the policy they ask (package
// policy). A fence that needs a lease type imports package lease.
func TestFencesDoNotLinkTheBusServer(t *testing.T) {
	const mod = "github.com/fenceline/fenceline/"
	rules := []struct {
		pkgs   []string
		banned string
	}{
		{[]string{"fsguard", "gitproxy", "pgproxy", "egress", "sidecar", "leasebus"}, "github.com/nats-io/nats-server"},
		{[]string{"fsguard", "lease", "policy"}, "github.com/nats-io/"},    // the policy every fence asks: no bus
		{[]string{"egress", "gitproxy", "pgproxy"}, "github.com/nats-io/"}, // fences that know only the lease domain (issue 29)
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
