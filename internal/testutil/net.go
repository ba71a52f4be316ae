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
