package embedded

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// ephemeralPrefix starts the name of every identity a run enrolled for
// itself: an enroller cannot take a name the operator gives.
const ephemeralPrefix = "eph-"

// errAnswered: the handler answered the request itself.
var errAnswered = errors.New("answered")

// Identities answers the bus's identity requests for an embedded server:
// enrol an ephemeral holder (an enroller's request), remove one (its own
// request when its run ends) and read the identities again (an operator's,
// after `bus enroll` or `bus revoke-identity`). Each ends in a reload of
// the server's users (ReloadUsers), so a new identity is admitted and a
// removed one disconnected without a restart.
type Identities struct {
	nc  *nats.Conn
	srv *server.Server
	cfg leasebus.ServerConfig
	log *slog.Logger

	mu    sync.Mutex // serializes changes and reloads
	subs  []*nats.Subscription
	audit *leasebus.Service // records identity changes (Audit); guarded by mu
	// known are the identities as of the last change or reload, to tell
	// what an operator's reload changed; guarded by mu.
	known []leasebus.Identity
	// enrolled is when each ephemeral identity was enrolled here (since
	// started for those enrolled before); guarded by mu.
	enrolled map[string]time.Time
	started  time.Time

	stopCollect func() // ends Collect's loop; nil when none. Guarded by mu
}

// Audit has svc record every identity change made from now on (who asked,
// which identity) and name new identities by their names.
func (ids *Identities) Audit(svc *leasebus.Service) {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	ids.audit = svc
}

// changed records an identity change that by asked for; ids.mu is held.
func (ids *Identities) changed(typ, by string, i leasebus.Identity) {
	if ids.audit != nil {
		ids.audit.IdentityChanged(context.Background(), typ, by, i)
	}
}

// ServeIdentities answers identity requests on nc (a connection with the
// service role to srv, which StartServer(cfg) started) until Stop. Every
// node of a cluster answers (each reloads its own server), so the
// subscriptions are not a queue group.
func ServeIdentities(nc *nats.Conn, srv *server.Server, cfg leasebus.ServerConfig, log *slog.Logger) (*Identities, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	withDefaults(&cfg)
	if cfg.CredsDir == "" {
		cfg.CredsDir = leasebus.CredsDirOf(cfg.StoreDir)
	}
	known, err := leasebus.Identities(cfg.CredsDir)
	if err != nil {
		return nil, err
	}
	ids := &Identities{nc: nc, srv: srv, cfg: cfg, log: log, known: known, enrolled: map[string]time.Time{}, started: time.Now()}
	for op, h := range map[string]func(id string, m *nats.Msg) (string, error){
		"enroll": ids.enroll,
		"leave":  ids.leave,
		"reload": func(by string, _ *nats.Msg) (string, error) { return "", ids.reload(by) },
	} {
		sub, err := nc.Subscribe(leasebus.IdentitySubjects(op), func(m *nats.Msg) {
			id, ok := leasebus.IdentityOfSubject(m.Subject, m.Reply)
			if !ok {
				log.Warn("ignored an identity request not answered to its sender's inbox", "subject", m.Subject, "reply", m.Reply)
				return
			}
			name, err := h(id, m)
			if errors.Is(err, errAnswered) {
				return
			}
			r := leasebus.IdentityReply{Name: name}
			if err != nil {
				r.Error = err.Error()
				log.Warn("identity request refused", "op", op, "by", id, "err", err)
			}
			data, _ := json.Marshal(r)
			_ = m.Respond(data)
		})
		if err != nil {
			ids.Stop()
			return nil, fmt.Errorf("subscribe %s: %w", leasebus.IdentitySubjects(op), err)
		}
		ids.subs = append(ids.subs, sub)
	}
	if err := nc.Flush(); err != nil {
		ids.Stop()
		return nil, fmt.Errorf("subscribe to identity requests: %w", err)
	}
	return ids, nil
}

// Stop stops answering and collecting.
func (ids *Identities) Stop() {
	for _, s := range ids.subs {
		_ = s.Unsubscribe()
	}
	ids.subs = nil
	ids.mu.Lock()
	stop := ids.stopCollect
	ids.stopCollect = nil
	ids.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// CollectAfter is how long an ephemeral identity must have been enrolled,
// and its sessions unheard, before Collect removes it, for a lease service
// whose session grace is grace: its leases are reclaimed long before.
func CollectAfter(grace time.Duration) time.Duration { return 3 * grace }

// Collect removes, until Stop, every ephemeral identity whose run ended
// without leaving (killed): enrolled at least after ago, with no session
// svc (the lease service beside this server) or any instance it hears has
// heard from for after, no active lease, and no connection to this
// server. It looks every after/4. Each removal is audited.
func (ids *Identities) Collect(svc *leasebus.Service, after time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	ids.mu.Lock()
	if ids.stopCollect != nil {
		ids.mu.Unlock()
		cancel()
		return
	}
	ids.stopCollect = func() { cancel(); <-done }
	ids.mu.Unlock()
	go func() {
		defer close(done)
		t := time.NewTicker(after / 4)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				ids.collect(svc, after, time.Now())
			}
		}
	}()
}

// collect removes the ephemeral identities Collect describes, as of now.
func (ids *Identities) collect(svc *leasebus.Service, after time.Duration, now time.Time) {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	type idle struct {
		i leasebus.Identity
		d time.Duration
	}
	var gone []idle
	for _, i := range ids.known {
		since, ok := ids.enrolled[i.Nkey]
		if !ok {
			since = ids.started
		}
		if !i.Ephemeral || now.Sub(since) < after {
			continue
		}
		d, sure := svc.IdentityIdle(i.Nkey, after)
		if !sure || ids.connected(i.Nkey) {
			continue
		}
		gone = append(gone, idle{i, d})
	}
	if len(gone) == 0 {
		return
	}
	// Each removal is confirmed by its audit event, which only an instance
	// on the majority's side of a cluster can write (Service.IdentityCollected):
	// a node cut off from the others hears none of the sessions there.
	removed := 0
	for _, g := range gone {
		if err := svc.IdentityCollected(context.Background(), g.i, g.d); err != nil {
			ids.log.Warn("ephemeral bus identity not collected: its collection could not be recorded (is this node cut off from the cluster's majority?)", "name", g.i.Name, "err", err)
			continue
		}
		if err := leasebus.RemoveIdentity(ids.cfg.CredsDir, g.i); err != nil {
			ids.log.Error("collect an ephemeral bus identity: recorded as collected but not removed; the next pass tries again", "name", g.i.Name, "err", err)
			continue
		}
		removed++
		ids.known = slices.DeleteFunc(ids.known, func(k leasebus.Identity) bool { return k == g.i })
		delete(ids.enrolled, g.i.Nkey)
		ids.log.Info("collected an ephemeral bus identity whose run ended without leaving", "name", g.i.Name, "idle", g.d.Round(time.Second))
	}
	if removed == 0 {
		return
	}
	if err := ReloadUsers(ids.srv, ids.cfg); err != nil {
		ids.log.Warn("reload after collecting ephemeral identities", "err", err)
	}
}

// connected reports whether nkey has a connection to this server (a run
// connected here is alive whatever the lease service heard).
func (ids *Identities) connected(nkey string) bool {
	cz, err := ids.srv.Connz(&server.ConnzOptions{User: nkey, State: server.ConnOpen, Limit: 1})
	return err != nil || cz.NumConns > 0
}

// Reload has the server read its identities again (what changed is
// recorded as asked by nobody: the bus itself).
func (ids *Identities) Reload() error { return ids.reload("") }

// reload reads the identities again for identity by (an operator, after
// `bus enroll` or `bus revoke-identity`), and records what changed.
func (ids *Identities) reload(by string) error {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	before := ids.known
	if err := ReloadUsers(ids.srv, ids.cfg); err != nil {
		return err
	}
	after, err := leasebus.Identities(ids.cfg.CredsDir)
	if err != nil {
		return err
	}
	ids.known = after
	for _, i := range after {
		if !slices.Contains(before, i) {
			ids.changed(leasebus.EventIdentityEnrolled, by, i)
		}
	}
	for _, i := range before {
		if !slices.Contains(after, i) {
			ids.changed(leasebus.EventIdentityRevoked, by, i)
		}
	}
	return nil
}

// enroll records the public key an enroller sent as an ephemeral holder
// and has the server admit it before answering.
func (ids *Identities) enroll(by string, m *nats.Msg) (string, error) {
	var r leasebus.EnrollRequest
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return "", fmt.Errorf("%w: decode enrol request: %v", lease.ErrInvalid, err)
	}
	name := r.Name
	if !strings.HasPrefix(name, ephemeralPrefix) {
		name = ephemeralPrefix + name
	}
	ids.mu.Lock()
	defer ids.mu.Unlock()
	all, err := leasebus.Identities(ids.cfg.CredsDir)
	if err != nil {
		return "", err
	}
	n := 0
	for _, i := range all {
		if i.Ephemeral {
			n++
		}
	}
	if n >= leasebus.MaxEphemeral {
		return "", fmt.Errorf("%d ephemeral identities are enrolled, the most the bus keeps: remove those of runs that ended (fenceline bus identities; fenceline bus revoke-identity NAME)", n)
	}
	id := leasebus.Identity{Name: name, Role: leasebus.RoleHolder, Nkey: r.Nkey, Ephemeral: true}
	if err := leasebus.AddIdentity(ids.cfg.CredsDir, id); err != nil {
		return "", err
	}
	if err := ReloadUsers(ids.srv, ids.cfg); err != nil {
		_ = leasebus.RemoveIdentity(ids.cfg.CredsDir, id)
		return "", err
	}
	ids.known = append(ids.known, id)
	ids.enrolled[id.Nkey] = time.Now()
	ids.changed(leasebus.EventIdentityEnrolled, by, id)
	ids.log.Info("enrolled an ephemeral bus identity", "name", name, "nkey", r.Nkey, "by", by)
	return name, nil
}

// leave removes the asker's own ephemeral identity; an identity the
// operator enrolled stays until the operator revokes it. The answer goes
// out before the reload closes the asker's connection.
func (ids *Identities) leave(by string, m *nats.Msg) (string, error) {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	i, ok, err := leasebus.FindIdentity(ids.cfg.CredsDir, by)
	switch {
	case err != nil:
		return "", err
	case !ok || i.Nkey != by:
		return "", fmt.Errorf("%w: %s is no enrolled identity", lease.ErrNotFound, by)
	case !i.Ephemeral:
		return "", fmt.Errorf("%w: %s was enrolled by the operator, who revokes it (fenceline bus revoke-identity %s)", lease.ErrInvalid, i.Name, i.Name)
	}
	if err := leasebus.RemoveIdentity(ids.cfg.CredsDir, i); err != nil {
		return "", err
	}
	data, _ := json.Marshal(leasebus.IdentityReply{Name: i.Name})
	_ = m.Respond(data)
	_ = ids.nc.FlushTimeout(time.Second) // the answer is with the server before the reload closes the asker
	if err := ReloadUsers(ids.srv, ids.cfg); err != nil {
		ids.log.Warn("reload after an identity left", "name", i.Name, "err", err)
	}
	ids.known = slices.DeleteFunc(ids.known, func(k leasebus.Identity) bool { return k == i })
	delete(ids.enrolled, i.Nkey)
	ids.changed(leasebus.EventIdentityRevoked, by, i)
	ids.log.Info("an ephemeral bus identity left", "name", i.Name)
	return i.Name, errAnswered
}
