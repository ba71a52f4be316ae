package testutil

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// Bridge is a TCP relay (for a route between two NATS cluster nodes) whose
// traffic can be blackholed: while it is cut, bytes are read and dropped,
// so neither side sees a closed connection — a partition, not a crash, as
// etcd's test bridge makes one.
type Bridge struct {
	ln     net.Listener
	target string // guarded by mu

	mu       sync.Mutex
	cut      bool         // guarded by mu
	cutConns map[int]bool // by the order accepted; guarded by mu
	accepted int          // guarded by mu
	conns    []net.Conn   // guarded by mu
	wg       sync.WaitGroup
}

// DeadAddr is a host:port where nothing listens (connections are refused
// at once): what the nodes of a cluster whose routes go through bridges
// advertise as their routes' address, so that a node that learns of a
// peer from another dials nothing around the bridges, and a cut holds
// (leasebus.ServerConfig.ClusterAdvertise). Before, a route that dropped
// came back straight to the peer's real address and healed a partition.
const DeadAddr = "127.0.0.1:1"

// NewBridge relays connections to target (host:port) from a new port on
// 127.0.0.1 until the test ends.
func NewBridge(t testing.TB, target string) *Bridge {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Bridge{ln: ln, target: target}
	b.wg.Go(b.accept)
	t.Cleanup(b.Close)
	return b
}

// Addr is the bridge's own host:port.
func (b *Bridge) Addr() string { return b.ln.Addr().String() }

func (b *Bridge) accept() {
	for {
		in, err := b.ln.Accept()
		if err != nil {
			return
		}
		b.mu.Lock()
		target := b.target
		b.mu.Unlock()
		out, err := net.Dial("tcp", target)
		if err != nil {
			in.Close()
			continue
		}
		b.mu.Lock()
		b.conns = append(b.conns, in, out)
		n := b.accepted
		b.accepted++
		b.mu.Unlock()
		b.wg.Go(func() { b.pipe(n, out, in) })
		b.wg.Go(func() { b.pipe(n, in, out) })
	}
}

// pipe copies src to dst, of the conn-th connection accepted, dropping
// what it reads while the bridge or that connection is cut.
func (b *Bridge) pipe(conn int, dst, src net.Conn) {
	defer dst.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			b.mu.Lock()
			cut := b.cut || b.cutConns[conn]
			b.mu.Unlock()
			if !cut {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				src.Close()
			}
			return
		}
	}
}

// Partition blackholes the bridge (cut) or heals it. Healing closes the
// connections that lost bytes, so both sides reconnect cleanly.
func (b *Bridge) Partition(cut bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cut = cut
	if !cut {
		for _, c := range b.conns {
			c.Close()
		}
		b.conns = nil
	}
}

// Retarget relays the connections accepted from now on to target
// (host:port) instead: a client that dials one address reaches one server
// with its first connection and another with its next.
func (b *Bridge) Retarget(target string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.target = target
}

// PartitionConn blackholes the n-th connection the bridge accepted (0 the
// first) and no other: one of a client's connections goes silent while
// its others carry on, as when it dialled a server that then froze.
func (b *Bridge) PartitionConn(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cutConns == nil {
		b.cutConns = map[int]bool{}
	}
	b.cutConns[n] = true
}

// Close stops accepting, closes every connection and waits for the relay.
func (b *Bridge) Close() {
	b.ln.Close()
	b.Partition(false)
	b.wg.Wait()
}
