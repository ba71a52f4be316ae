package leasebus

import (
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// TestFenceNoWaitDuringReconnect: while nats.go reconnects it holds the
// connection's lock through the dial and the handshake (here: a server
// that accepts and never speaks, for up to 3 s). Fence asks nats.go and
// waits that out; FenceNoWait, which the Postgres fence's event loop uses
// (a wait there holds every session), answers at once from the holder's
// own view: the connection dropped, so writes wait (ErrLeaseUnknown).
func TestFenceNoWaitDuringReconnect(t *testing.T) {
	b := startBus(t)
	hole, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hole.Close() })
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	nc := connectAs(t, b.srv.ClientURL()+",nats://"+hole.Addr().String(), RoleService,
		nats.DontRandomize(), nats.Timeout(3*time.Second))
	h, _ := heldLeaseFor(t, b, nc, "nowait", 30*time.Second, HoldOptions{})
	if _, err := h.FenceNoWait(); err != nil {
		t.Fatalf("FenceNoWait of a held lease: %v", err)
	}
	b.stop()
	var held net.Conn
	select {
	case held = <-accepted: // nats.go now holds its lock, waiting for an INFO that never comes
	case <-time.After(20 * time.Second):
		t.Fatal("the client never tried the silent server")
	}
	t.Cleanup(func() { held.Close() })
	// The holder hears of the drop from its status listener: within the
	// silent server's 3 s, FenceNoWait says so, never waiting itself.
	checkFor(t, 2*time.Second, time.Millisecond, func() error {
		if _, err := h.FenceNoWait(); !errors.Is(err, lease.ErrLeaseUnknown) {
			return fmt.Errorf("FenceNoWait while the connection is down: %v, want ErrLeaseUnknown", err)
		}
		return nil
	})
	// The reconnect was still under way when FenceNoWait answered: the
	// client has not given up on the silent server (it closes it then).
	held.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	var one [1]byte
	_, err = held.Read(one[:])
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("the client ended its try of the silent server (%v) before FenceNoWait answered: the test proves nothing", err)
	}
}
