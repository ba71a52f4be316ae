//go:build integration

package leasebus

import (
	"strings"
	"testing"
)

func TestFleetCannotStoreThroughRepliesOnACluster(t *testing.T) {
	c := startCluster(t)
	nc := c.connect(t)
	ctx := ctxT(t)
	svc, _ := startClusterService(ctx, t, nc)
	fleetCannotStore(t, strings.Join(c.urls, ","), svc, nc, NewClient(nc))
}

func TestFleetCannotForgeABeatOnACluster(t *testing.T) {
	c := startCluster(t)
	nc := c.connect(t)
	startClusterService(ctxT(t), t, nc)
	fleetCannotForgeABeat(t, strings.Join(c.urls, ","))
}
