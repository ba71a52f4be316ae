// Command barerelay copies bytes between each client and Postgres and does
// nothing else (io.Copy both ways, one goroutine per direction). It is the
// yardstick scripts/bench-pg.sh runs beside the fenceline proxy: what any
// relay written in Go costs on the machine, before parsing a single message.
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:6434", "listen address")
	upstream := flag.String("upstream", "127.0.0.1:5432", "Postgres host:port, or the path of its Unix socket")
	mode := flag.String("mode", "goroutines", "goroutines: io.Copy, a goroutine per direction; loop: one epoll event loop on one thread (loop_linux.go); coro: that loop resuming each direction as a coroutine (coro_linux.go)")
	flag.Parse()
	var run func(lfd int, upstream string, stop int) error
	switch *mode {
	case "goroutines":
	case "loop":
		run = loopRelay
	case "coro":
		run = coroRelay
	default:
		fmt.Fprintf(os.Stderr, "barerelay: -mode %q: want goroutines, loop or coro\n", *mode)
		os.Exit(2)
	}
	if run != nil {
		lfd, err := listenTCP(*listen)
		if err == nil {
			fmt.Printf("listening %s (-mode %s)\n", *listen, *mode)
			err = run(lfd, *upstream, -1)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "barerelay:", err)
			os.Exit(1)
		}
		return
	}
	network := "tcp"
	if strings.HasPrefix(*upstream, "/") {
		network = "unix"
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "barerelay:", err)
		os.Exit(1)
	}
	fmt.Println("listening", ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, "barerelay:", err)
			os.Exit(1)
		}
		go relay(c, network, *upstream)
	}
}

func relay(c net.Conn, network, upstream string) {
	defer c.Close()
	u, err := net.Dial(network, upstream)
	if err != nil {
		fmt.Fprintln(os.Stderr, "barerelay:", err)
		return
	}
	defer u.Close()
	done := make(chan struct{})
	go func() {
		io.Copy(u, c) //nolint:errcheck // the client closing ends the relay
		u.Close()
		close(done)
	}()
	io.Copy(c, u) //nolint:errcheck // the server closing ends the relay
	c.Close()
	<-done
}
