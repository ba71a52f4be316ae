package embedded

import (
	"encoding/base64"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"

	"github.com/fenceline/fenceline/leasebus"
)

// identityAuth admits the bus's identities, each into its account with
// its role's permissions (leasebus.GrantOf), from a table that changes
// without reloading the server.
//
// Why not the server's own users and a reload: with accounts configured, a
// reload of users rebuilds every account's imports and exports, and for a
// moment the service account has no JetStream API and the fleet account
// none of its imports: requests in flight get "no responders". Runs enrol
// and leave an identity each, so the bus would reload all the time. The
// accounts themselves (leasebus.AuthConfig) never change.
type identityAuth struct {
	srv atomic.Pointer[server.Server]

	mu    sync.RWMutex
	users map[string]admitted // by public nkey; guarded by mu
}

// admitted is what an identity is let in as.
type admitted struct {
	account string
	perms   *server.Permissions
}

// auths finds a running server's identityAuth (ReloadUsers).
var auths sync.Map // *server.Server -> *identityAuth

// Check is server.Authentication: the client signed the server's nonce
// with the key of an identity in the table.
func (a *identityAuth) Check(c server.ClientAuthentication) bool {
	o := c.GetOpts()
	if o == nil || o.Nkey == "" || c.Kind() != server.CLIENT {
		return false
	}
	a.mu.RLock()
	u, ok := a.users[o.Nkey]
	a.mu.RUnlock()
	if !ok {
		return false
	}
	// As nats-server checks an nkey user: raw URL base64, else standard.
	sig, err := base64.RawURLEncoding.DecodeString(o.Sig)
	if err != nil {
		if sig, err = base64.StdEncoding.DecodeString(o.Sig); err != nil {
			return false
		}
	}
	pub, err := nkeys.FromPublicKey(o.Nkey)
	if err != nil || pub.Verify(c.GetNonce(), sig) != nil {
		return false
	}
	srv := a.srv.Load()
	if srv == nil {
		return false
	}
	acc, err := srv.LookupAccount(u.account)
	if err != nil {
		return false
	}
	c.RegisterUser(&server.User{Account: acc, Permissions: u.perms})
	return true
}

// set replaces the table with users (and the lease service's fleet
// connection beside its own), and disconnects every client whose key is
// no longer in it.
func (a *identityAuth) set(users []leasebus.ServerUser) error {
	table := make(map[string]admitted, len(users)+1)
	add := func(role leasebus.Role, name, key string) error {
		if !nkeys.IsValidPublicUserKey(key) {
			return fmt.Errorf("bus user %q: %q is not a public user nkey", name, key)
		}
		g, err := leasebus.GrantOf(role, key)
		if err != nil {
			return fmt.Errorf("bus user %q: %w", name, err)
		}
		table[key] = admitted{account: leasebus.AccountOf(role), perms: &server.Permissions{
			Publish:   &server.SubjectPermission{Allow: g.Publish},
			Subscribe: &server.SubjectPermission{Allow: g.Subscribe},
		}}
		return nil
	}
	for _, u := range users {
		if err := add(u.Role, u.Name, u.Nkey); err != nil {
			return err
		}
		if u.Role == leasebus.RoleService {
			if err := add(leasebus.RoleServiceFleet, u.Name+" (fleet)", u.FleetNkey); err != nil {
				return err
			}
		}
	}
	a.mu.Lock()
	old := a.users
	a.users = table
	a.mu.Unlock()
	var gone []string
	for key := range old {
		if _, ok := table[key]; !ok {
			gone = append(gone, key)
		}
	}
	return a.disconnect(gone)
}

// disconnect closes the connections of keys no longer admitted: a revoked
// identity loses its connection at once, as a reload would. An enrolment
// removes no key and costs nothing here, however many are connected.
func (a *identityAuth) disconnect(keys []string) error {
	srv := a.srv.Load()
	if srv == nil || !srv.Running() || len(keys) == 0 {
		return nil
	}
	for _, key := range keys {
		cz, err := srv.Connz(&server.ConnzOptions{User: key, State: server.ConnOpen, Limit: 1 << 16})
		if err != nil {
			return fmt.Errorf("list the bus's connections of %s: %w", key, err)
		}
		for _, ci := range cz.Conns {
			_ = srv.DisconnectClientByID(ci.Cid)
		}
	}
	return nil
}
