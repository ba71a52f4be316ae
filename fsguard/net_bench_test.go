//go:build linux && (amd64 || arm64)

package fsguard

import (
	"io"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkConnect: a static binary connects (blocking) to a loopback port
// the policy allows and closes, 2,000 times. Guarded, every connect traps:
// the supervisor copies the address, duplicates the socket, judges and
// connects it in a goroutine of its own and answers.
func BenchmarkConnect(b *testing.B) {
	helper := guardHelper(b)
	const connects = 2000
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	defer func() { l.Close(); <-done }()
	w := newWorktree(b)
	p := w.policy()
	p.ConnectPorts = []uint16{port(l)}
	var plainLoop, guardedLoop time.Duration
	for range b.N {
		plainLoop += connectLoop(b, nil, helper, l.Addr().String(), connects)
		guardedLoop += connectLoop(b, &p, helper, l.Addr().String(), connects)
	}
	b.ReportMetric(float64(plainLoop)/float64(b.N*connects)/1e3, "plain-µs/connect")
	b.ReportMetric(float64(guardedLoop)/float64(b.N*connects)/1e3, "guarded-µs/connect")
	b.ReportMetric(float64(guardedLoop-plainLoop)/float64(b.N*connects)/1e3, "overhead-µs/connect")
}

// connectLoop runs the helper's connectloop and returns the time its loop
// measured; p == nil runs it unguarded.
func connectLoop(b *testing.B, p *Policy, helper, addr string, n int) time.Duration {
	b.Helper()
	var out string
	if p == nil {
		o, err := exec.Command(helper, "connectloop", addr, strconv.Itoa(n)).CombinedOutput()
		if err != nil {
			b.Fatalf("connectloop: %v %s", err, o)
		}
		out = string(o)
	} else {
		r := runGuarded(b, *p, &testGate{}, "/", helper, "connectloop", addr, strconv.Itoa(n))
		if r.code != 0 {
			b.Fatalf("guarded connectloop: exit %d %s", r.code, r.out)
		}
		out = r.out
	}
	ns, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		b.Fatalf("connectloop output %q: %v", out, err)
	}
	return time.Duration(ns)
}

// BenchmarkConnectCaptured: the same static binary connects (blocking) to
// a non-loopback address, 2,000 times, with Policy.Capture set: the
// supervisor connects its duplicate of the socket to the capture address
// (a listener standing in for the egress proxy, which reads and closes)
// and writes the preamble before it answers. Compared with a guarded
// connect to an allowed loopback port.
func BenchmarkConnectCaptured(b *testing.B) {
	helper := guardHelper(b)
	const connects = 2000
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	defer func() { l.Close(); <-done }()
	w := newWorktree(b)
	p := w.policy()
	p.ConnectPorts = []uint16{port(l)}
	p.Capture = netip.MustParseAddrPort(l.Addr().String())
	var allowedLoop, capturedLoop time.Duration
	for range b.N {
		allowedLoop += connectLoop(b, &p, helper, l.Addr().String(), connects)
		capturedLoop += connectLoop(b, &p, helper, "192.0.2.1:443", connects)
	}
	b.ReportMetric(float64(allowedLoop)/float64(b.N*connects)/1e3, "guarded-loopback-µs/connect")
	b.ReportMetric(float64(capturedLoop)/float64(b.N*connects)/1e3, "captured-µs/connect")
}
