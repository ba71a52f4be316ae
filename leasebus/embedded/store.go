package embedded

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/leasebus"
)

// storeCheckInterval is how often KeepStore looks at the store.
const storeCheckInterval = 100 * time.Millisecond

// StoreProbe probes an embedded server and its store directory, for
// leasebus.ServiceConfig.StoreProbe.
func StoreProbe(srv *server.Server, dir string) leasebus.StoreProbe {
	return func(context.Context) error {
		if err := leasebus.StatStore(dir); err != nil {
			return err
		}
		if !srv.JetStreamEnabled() {
			return fmt.Errorf("%w: it stopped after a write to %s failed (see the bus's log); the bus restarts it once the store takes writes again", leasebus.ErrJetStreamDown, dir)
		}
		return nil
	}
}

// KeepStore watches an embedded, single-node server's store until ctx
// ends, and restarts JetStream once a store fault has cleared: a stream
// whose write found the disk full keeps failing every later write (the
// file store's write error sticks) and nats-server may have shut JetStream
// down altogether. Restarting reloads every stream from the store as a
// server start does, so nothing acknowledged is lost; a write that failed
// was never acknowledged. (The service's leasebus.StoreProbe logs the fault and
// refuses lease writes meanwhile.)
func KeepStore(ctx context.Context, srv *server.Server, dir string, log *slog.Logger) {
	t := time.NewTicker(storeCheckInterval)
	defer t.Stop()
	faulted := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if leasebus.StatStore(dir) != nil {
			faulted = true
			continue
		}
		if !faulted && srv.JetStreamEnabled() {
			continue
		}
		if srv.JetStreamEnabled() {
			if err := srv.ShutdownJetStream(); err != nil {
				log.Error("restart JetStream on the bus store: stop", "store", dir, "err", err)
				continue
			}
		}
		if err := srv.EnableJetStream(&server.JetStreamConfig{StoreDir: dir}); err != nil {
			log.Error("restart JetStream on the bus store", "store", dir, "err", err)
			continue
		}
		faulted = false
		log.Info("JetStream restarted: the bus store takes writes again", "store", dir)
	}
}
