package main

import (
	"bytes"
	"crypto/rand"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLoopsRelay runs each event-loop relay between real TCP sockets and an
// echo server: 32 MB each way through one connection, whose client reads
// nothing back until a second connection has echoed meanwhile (so the
// socket buffers fill and the loops take their EAGAIN paths: counted); the
// server sees the second client's close; the loop ends on its stop
// descriptor.
func TestLoopsRelay(t *testing.T) {
	for name, run := range map[string]func(int, string, int) error{"loop": loopRelay, "coro": coroRelay} {
		t.Run(name, func(t *testing.T) {
			echo, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer echo.Close()
			serverSawEOF := make(chan struct{}, 4)
			go func() {
				for {
					c, err := echo.Accept()
					if err != nil {
						return
					}
					go func() {
						defer c.Close()
						io.Copy(c, c) //nolint:errcheck // ends with the client
						serverSawEOF <- struct{}{}
					}()
				}
			}()

			lfd, err := listenTCP("127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			sa, err := unix.Getsockname(lfd)
			if err != nil {
				t.Fatal(err)
			}
			addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*unix.SockaddrInet4).Port}
			stop, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(stop)
			ended := make(chan error, 1)
			go func() { ended <- run(lfd, echo.Addr().String(), stop) }()
			defer func() {
				unix.Write(stop, []byte{1, 0, 0, 0, 0, 0, 0, 0}) //nolint:errcheck // a full counter still wakes it
				select {
				case err := <-ended:
					if err != nil {
						t.Errorf("%s relay ended with %v", name, err)
					}
				case <-time.After(10 * time.Second):
					t.Errorf("%s relay did not end on its stop descriptor", name)
				}
				unix.Close(lfd)
			}()

			big, err := net.Dial("tcp", addr.String())
			if err != nil {
				t.Fatal(err)
			}
			defer big.Close()
			// A receive buffer of its own size: autotuned, it may grow to
			// net.ipv4.tcp_rmem's maximum (32 MiB on some machines), which
			// holds everything sent, and the relay's writes to it never
			// find it full.
			if err := big.(*net.TCPConn).SetReadBuffer(64 << 10); err != nil {
				t.Fatal(err)
			}
			stalls := writeStalls.Load()
			want := make([]byte, 32<<20)
			rand.Read(want)
			wrote := make(chan error, 1)
			go func() {
				_, err := big.Write(want)
				wrote <- err
			}()
			// A second connection is served while the first is stuck on
			// full buffers.
			small, err := net.Dial("tcp", addr.String())
			if err != nil {
				t.Fatal(err)
			}
			small.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := small.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, 4)
			if _, err := io.ReadFull(small, got); err != nil || string(got) != "ping" {
				t.Fatalf("second connection read %q, %v; want ping", got, err)
			}
			small.Close()
			select {
			case <-serverSawEOF:
			case <-time.After(10 * time.Second):
				t.Fatal("the server did not see the client's close through the relay")
			}

			big.SetDeadline(time.Now().Add(30 * time.Second))
			back := make([]byte, len(want))
			if _, err := io.ReadFull(big, back); err != nil {
				t.Fatalf("read back: %v", err)
			}
			if err := <-wrote; err != nil {
				t.Fatalf("write: %v", err)
			}
			if !bytes.Equal(back, want) {
				t.Fatal("the bytes relayed back differ from those sent")
			}
			if writeStalls.Load() == stalls {
				t.Fatal("no write found a full buffer: the test did not reach the loops' EAGAIN paths")
			}
		})
	}
}
