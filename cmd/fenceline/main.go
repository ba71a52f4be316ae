// Command fenceline keeps parallel AI coding agents from corrupting each
// other's work: leases on repo scopes from a lease bus, fence tokens at
// every write boundary. The command tree lives in internal/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/fenceline/fenceline/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
