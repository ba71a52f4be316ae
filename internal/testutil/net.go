package testutil

import (
	"net"
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
// ago: all n are held open together before any is released, so no two
// are the same.
func FreePorts(t testing.TB, n int) []int {
	t.Helper()
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			_ = ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports
}
