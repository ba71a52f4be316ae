// Command capclient is a static Go program with no proxy support (the
// proxy variables are ignored: its transport has no Proxy): it fetches a
// URL by dialling a given address itself, or looks a name up with Go's
// own resolver. The capture tests run it under the file guard.
//
//	capclient get URL ADDR:PORT
//	capclient fetch URL        (by name: Go's own resolver, then the address it found)
//	capclient lookup NAME
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: capclient get URL ADDR:PORT | fetch URL | lookup NAME")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	switch os.Args[1] {
	case "get", "fetch":
		tr := &http.Transport{Proxy: nil}
		if os.Args[1] == "get" {
			addr := os.Args[3]
			tr.DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, network, addr)
			}
		}
		req, _ := http.NewRequestWithContext(ctx, "GET", os.Args[2], nil)
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s", resp.StatusCode, b)
	case "lookup":
		r := &net.Resolver{PreferGo: true}
		addrs, err := r.LookupHost(ctx, os.Args[2])
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println(addrs)
	}
}
