package testutil

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// FreeAddr is a 127.0.0.1 host:port that was free a moment ago: nothing
// listens there now (for a server to start on, or a dial to be refused).
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// FreePorts returns n distinct 127.0.0.1 ports that were free a moment
// ago (see StablePorts), or fails the test.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	ports, err := StablePorts(n)
	if err != nil {
		t.Fatal(err)
	}
	return ports
}

// StablePorts returns n distinct 127.0.0.1 ports that were free a moment
// ago, all held open together before any is released (so no two are the
// same), and all below the kernel's ephemeral range: a server killed and
// started again on its port must find it free, and every outgoing
// connection takes its local port from that range, so none of the
// thousands a fleet bench reconnects can take it meanwhile. (A guard: the
// "address already in use" the bench's restarted nodes met had another
// cause, the killed process still holding its listening sockets.)
func StablePorts(n int) ([]int, error) {
	low := 32768 // Linux's default start of the range
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	const from = 10000
	if low <= from+n {
		return nil, fmt.Errorf("the ephemeral port range starts at %d: no room below it for %d ports from %d", low, n, from)
	}
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries > 100*n+1000 {
			return nil, fmt.Errorf("found %d free ports from %d to %d, want %d", len(ports), from, low, n)
		}
		port := from + rand.IntN(low-from)
		if slices.Contains(ports, port) {
			continue
		}
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue // taken
		}
		lns = append(lns, ln)
		ports = append(ports, port)
	}
	return ports, nil
}
