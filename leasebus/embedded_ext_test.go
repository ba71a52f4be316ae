package leasebus_test

import (
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
)

func init() {
	leasebus.EmbeddedStartServer = embedded.StartServer
	leasebus.EmbeddedStoreProbe = embedded.StoreProbe
	leasebus.EmbeddedKeepStore = embedded.KeepStore
	leasebus.EmbeddedAuditRefusals = embedded.AuditRefusals
}
