// Command fenceline keeps parallel AI coding agents from corrupting each
// other's work: leases on repo scopes from a lease bus, fence tokens at
// every write boundary. The command tree lives in internal/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/cli"
)

func main() {
	// A guarded agent process and the git shim are this binary re-executed:
	// they take over here and never return.
	fsguard.Init()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
