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
	flag.Parse()
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
