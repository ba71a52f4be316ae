package leasebus

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// ErrForbidden: the bus did not let this identity make the request (NATS
// permissions); use credentials of a role that may.
var ErrForbidden = errors.New("not permitted on the bus")

// rolesFor lists the roles that may make lease request op.
func rolesFor(op string) string {
	var out []string
	for _, r := range Roles {
		if g, _ := GrantOf(r, IdentityToken); slices.Contains(g.Publish, requestSubject(op, IdentityToken)) || r == RoleService {
			out = append(out, string(r))
		}
	}
	return strings.Join(out, ", ")
}

// Role is what a bus identity may do. The bus enforces it with NATS's own
// per-user publish and subscribe permissions (Permissions), generated from
// one table (grants) for the embedded server, for any other server
// (AuthConfig) and for docs/trust.md.
type Role string

const (
	// RoleService is the lease service: it alone answers lease requests,
	// announces changes, writes the lease log and the lease boundary's
	// audit events.
	RoleService Role = "service"
	// RoleHolder is a runner or sidecar: it acquires, renews, releases and
	// cancels leases (proving ownership with the lease credential), reads
	// leases (get, and list: the git fence judges a push against every
	// active lease of the repo), hears change notices, sends boundary
	// audit events to the service and asks it to write the shard store's
	// pool and attempt records (shards.go).
	RoleHolder Role = "holder"
	// RoleOperator is a person running the bus: what a holder and a viewer
	// may do, plus revoke, sweep, declaring shard pools and setting
	// policies (policy.go).
	RoleOperator Role = "operator"
	// RoleViewer reads: lease list and get, change notices, the audit
	// stream and the shard records (the run UI, `lease list`).
	RoleViewer Role = "viewer"
)

// Roles are the bus's roles, least to most privileged (RoleEnroller, in
// identities.go, enrols ephemeral holders and does nothing else).
var Roles = []Role{RoleEnroller, RoleViewer, RoleHolder, RoleOperator, RoleService}

// IdentityToken stands for the asking identity in Grant subjects: the
// user's public nkey (see IdentityOf).
const IdentityToken = "{id}"

// Grant is one role's permissions: subjects it may publish on and
// subscribe to. IdentityToken in a subject is replaced by the user's
// identity, so each user may ask only in its own name.
type Grant struct {
	Publish   []string
	Subscribe []string
}

// JetStream API subjects under api ("$JS.API", or FleetJSAPI), by stream.
func jsRead(api, stream string) []string {
	return []string{
		api + ".STREAM.INFO." + stream,
		api + ".STREAM.MSG.GET." + stream,
		api + ".DIRECT.GET." + stream,
		api + ".DIRECT.GET." + stream + ".>",
	}
}

// jsConsume lets a user read a stream through its own ordered pull
// consumers: create, pull, look at and delete them. (No push consumer:
// its deliveries would stay in the service account.)
func jsConsume(api, stream string) []string {
	return []string{
		api + ".CONSUMER.CREATE." + stream,
		api + ".CONSUMER.CREATE." + stream + ".>",
		api + ".CONSUMER.MSG.NEXT." + stream + ".>",
		api + ".CONSUMER.INFO." + stream + ".>",
		api + ".CONSUMER.DELETE." + stream + ".>",
	}
}

// boundaryShard is shard.BoundaryShard: runners audit shard cleaning and
// recovery.
const boundaryShard = "shard"

// Stream names of the shard store's buckets (shard.PoolBucket and
// shard.AttemptBucket; the shard package stands on this one).
const (
	shardPoolStream    = "KV_FENCELINE_SHARDS"
	shardAttemptStream = "KV_FENCELINE_ATTEMPTS"
)

func requestSubject(op, id string) string { return apiPrefix + "." + op + "." + id }

func ops(id string, names ...string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = requestSubject(n, id)
	}
	return out
}

// inboxPrefix is where a user's replies arrive: nats.go's inbox prefix is
// set per identity (Creds.Options), so nobody hears another's replies.
func inboxPrefix(id string) string { return "_INBOX." + id }

// grants is the permission table; grants(IdentityToken) prints it.
func grants(id string) map[Role]Grant {
	inbox := inboxPrefix(id) + ".>"
	changed := changedPrefix + ".>"
	// Shard records: read by runners and viewers, written by the lease
	// service alone (a runner asks it: op shard; shards.go).
	// Every identity but the service's store connection is in the
	// fleet account, which has no JetStream of its own: it reads the
	// service account's streams through the API imported under
	// FleetJSAPI (accounts.go).
	shardRead := slices.Concat(
		jsRead(FleetJSAPI, shardPoolStream), jsRead(FleetJSAPI, shardAttemptStream),
		jsConsume(FleetJSAPI, shardPoolStream), jsConsume(FleetJSAPI, shardAttemptStream), // listing pools, attempts
		// Policies: read and followed by every fence and the run UI,
		// written by the lease service alone (an operator asks it: op
		// policy; policy.go).
		jsRead(FleetJSAPI, PolicyStream), jsConsume(FleetJSAPI, PolicyStream),
	)
	viewer := Grant{
		Publish: slices.Concat(ops(id, "get", "list", opStatus),
			jsRead(FleetJSAPI, AuditStream), jsConsume(FleetJSAPI, AuditStream),
			jsRead(FleetJSAPI, EventsStream), jsConsume(FleetJSAPI, EventsStream),
			shardRead),
		Subscribe: []string{inbox, changed},
	}
	holder := Grant{
		// list: the git fence judges a push against every active lease
		// of the repo; shard recovery looks at attempts' leases.
		// audit: boundary events go through the service (see Auditor).
		// leave: an ephemeral identity removes itself when its run ends.
		// shard: shard records go through the service (shards.go).
		Publish:   slices.Concat(ops(id, "acquire", "renew", "release", "cancel", "get", "list", "audit", "keepalive", opShard), shardRead, []string{identitySubject("leave", id)}),
		Subscribe: []string{inbox, changed},
	}
	// The enroller (a machine's shared key) asks for an identity of its
	// own for each run and hears only its own inbox: it reaches no lease,
	// no stream and nobody else's answers.
	enroller := Grant{
		Publish:   []string{identitySubject("enroll", id)},
		Subscribe: []string{inbox},
	}
	// The operator creates no stream: the lease service makes the shard
	// store's buckets (a stream's creator picks its subjects, the lease
	// requests' included, and could capture them).
	operator := Grant{
		Publish:   slices.Concat(ops(id, "revoke", "sweep", opShardAdmin, opPolicy), []string{identitySubject("reload", id)}, holder.Publish, viewer.Publish),
		Subscribe: []string{inbox, changed},
	}
	operator.Publish = dedupe(operator.Publish)
	service := Grant{
		Publish: []string{
			"fenceline.>",                                                       // lease requests and replies' announcements, the lease log
			"$JS.EVENT.FENCELINE.>",                                             // the lease audit and the events (see AuditStream)
			"$KV." + ShardPoolBucket + ".>", "$KV." + ShardAttemptBucket + ".>", // the shard records (shards.go)
			"_INBOX.>",  // answers to every identity's requests
			"$JS.API.>", // creates and reads its streams
			"$JS.ACK." + LogStream + ".>", "$JS.ACK." + AuditStream + ".>", "$JS.ACK." + EventsStream + ".>",
			"$JS.FC.>",
			jsProbe,
			"_R_.>", // answers to its own fleet connection (reachPrefix), which the server sends on through the import
		},
		Subscribe: []string{apiPrefix + ".>", identityPrefix + ".>", inbox, reachPrefix + ".*"},
	}
	// The service's connection in the fleet account (FleetUser): it
	// takes the fleet's requests, answers them in their askers' inboxes
	// and announces changes there; it reads no stream, and asks its
	// instance's claim connection for an answer only to learn the two
	// reach each other (hearsFleet).
	fleetService := Grant{
		Publish:   []string{"_INBOX.>", changed, reachPrefix + ".*"},
		Subscribe: []string{apiPrefix + ".*.*", identityPrefix + ".>", inbox},
	}
	return map[Role]Grant{RoleService: service, RoleServiceFleet: fleetService, RoleHolder: holder, RoleOperator: operator, RoleViewer: viewer, RoleEnroller: enroller}
}

func dedupe(s []string) []string {
	out := make([]string, 0, len(s))
	for _, x := range s {
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	return out
}

// GrantOf returns the permissions of role for identity id (IdentityToken
// leaves the placeholder in, for documentation).
func GrantOf(role Role, id string) (Grant, error) {
	g, ok := grants(id)[role]
	if !ok {
		return Grant{}, fmt.Errorf("%w: unknown role %q (want one of %v)", lease.ErrInvalid, role, Roles)
	}
	return g, nil
}

// ServerUser is one bus identity the embedded server admits.
type ServerUser struct {
	Role Role
	// Name is what the audit calls the identity (default: its nkey).
	Name string
	// Nkey is the user's public nkey (U…); it is the identity.
	Nkey string
	// FleetNkey, for the lease service, is its fleet connection's key
	// (Creds.FleetNkey): the server admits that too, in the fleet account.
	FleetNkey string
}

// Anonymous is the identity of a connection without an nkey (a bus that
// requires no credentials); such a bus enforces no roles.
const Anonymous = "anonymous"

// IdentityOf is the identity nc asks in: the public nkey it authenticated
// with (nats.Nkey / NkeyOptionFromSeed), else Anonymous.
func IdentityOf(nc *nats.Conn) string {
	if nc != nil && nc.Opts.Nkey != "" {
		return nc.Opts.Nkey
	}
	return Anonymous
}

// validIdentity reports whether id can be a subject token.
// (A byte loop, not a regexp: it runs on every request the service takes.)
func validIdentity(id string) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// Creds is one identity's credential file: an nkey seed, with the role and
// name fenceline wrote beside it.
type Creds struct {
	Path string
	Role Role   // "" when the file does not say
	Name string // "" when the file does not say
	Nkey string // the public key: the identity
	// FleetNkey is the public key of the lease service's connection in
	// the fleet account (FleetKey), for the service's credentials.
	FleetNkey string
}

// CredsFile is the file name of role's credentials in a credentials
// directory.
func CredsFile(role Role) string { return string(role) + ".nk" }

// CredsDirOf is where the embedded bus with store dir keeps its
// credentials: <store>/creds.
func CredsDirOf(storeDir string) string { return filepath.Join(storeDir, "creds") }

// LoadCreds reads a credential file (an nkey user seed, optionally in
// fenceline's decorated form).
func LoadCreds(path string) (*Creds, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("bus credentials %s: %w", path, err)
		}
		return nil, fmt.Errorf("read bus credentials: %w", err)
	}
	defer clear(data)
	kp, err := nkeys.ParseDecoratedUserNKey(data)
	if err != nil {
		return nil, fmt.Errorf("bus credentials %s hold no nkey user seed: %w", path, err)
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("bus credentials %s: %w", path, err)
	}
	fpub, err := fleetPublicKey(data)
	if err != nil {
		return nil, fmt.Errorf("bus credentials %s: %w", path, err)
	}
	c := &Creds{Path: path, Nkey: pub, FleetNkey: fpub}
	for line := range bytes.Lines(data) {
		k, v, ok := strings.Cut(strings.TrimSpace(strings.TrimPrefix(string(line), "#")), ":")
		if !ok || !strings.HasPrefix(string(line), "#") {
			continue
		}
		switch strings.TrimSpace(k) {
		case "role":
			c.Role = Role(strings.TrimSpace(v))
		case "name":
			c.Name = strings.TrimSpace(v)
		}
	}
	return c, nil
}

// Options are the nats.go options that connect as c: the nkey (signing
// the server's challenge from the file, nats.go's NkeyOptionFromSeed) and
// the identity's own inbox prefix.
func (c *Creds) Options() ([]nats.Option, error) {
	nk, err := nats.NkeyOptionFromSeed(c.Path)
	if err != nil {
		return nil, fmt.Errorf("bus credentials %s: %w", c.Path, err)
	}
	connectedCreds.Store(c.Nkey, c.Path) // the lease service's fleet key is derived from it (fleetConn)
	return []nats.Option{nk, nats.CustomInboxPrefix(inboxPrefix(c.Nkey))}, nil
}

// User is c as a server user.
func (c *Creds) User() ServerUser {
	u := ServerUser{Role: c.Role, Name: c.Name, Nkey: c.Nkey}
	if c.Role == RoleService {
		u.FleetNkey = c.FleetNkey
	}
	return u
}

// EnsureCreds returns the credentials of every role in dir, creating the
// missing ones (a fresh nkey each, mode 0600 in a 0700 directory) and
// reusing the others. The embedded bus calls it on start.
func EnsureCreds(dir string) (map[Role]*Creds, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("bus credentials dir: %w", err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("bus credentials dir: %w", err)
	} else if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return nil, fmt.Errorf("restrict bus credentials dir %s to its owner: %w", dir, err)
		}
	}
	out := make(map[Role]*Creds, len(Roles))
	for _, role := range Roles {
		path := filepath.Join(dir, CredsFile(role))
		c, err := LoadCreds(path)
		if errors.Is(err, fs.ErrNotExist) {
			// Another process (a cluster node on the same directory) may
			// make it at the same moment: the first link wins, both read it.
			if err = writeCreds(path, role); err == nil || errors.Is(err, fs.ErrExist) {
				c, err = LoadCreds(path)
			}
		}
		if err != nil {
			return nil, err
		}
		if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
			// Copied in with looser modes: only the owner may read a seed.
			if err := os.Chmod(path, 0o600); err != nil {
				return nil, fmt.Errorf("restrict bus credentials %s to their owner: %w", path, err)
			}
		}
		if c.Role == "" {
			c.Role = role
		}
		if c.Role != role {
			return nil, fmt.Errorf("bus credentials %s say role %q, want %q: move the file away and restart the bus to make a new one", path, c.Role, role)
		}
		if c.Name == "" {
			c.Name = string(role)
		}
		out[role] = c
	}
	return out, nil
}

func writeCreds(path string, role Role) error {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return fmt.Errorf("make bus credentials: %w", err)
	}
	defer kp.Wipe()
	seed, err := kp.Seed()
	if err != nil {
		return fmt.Errorf("make bus credentials: %w", err)
	}
	defer clear(seed)
	if err := writeSeed(path, role, string(role), seed); err != nil {
		return fmt.Errorf("write bus credentials: %w", err)
	}
	return nil
}

// RoleOptions are the nats.go options that connect as role with the
// credentials in dir (a bus's credentials directory, see EnsureCreds).
func RoleOptions(dir string, role Role) ([]nats.Option, error) {
	c, err := LoadCreds(filepath.Join(dir, CredsFile(role)))
	if err != nil {
		return nil, err
	}
	return c.Options()
}

// NamesIn maps the identities of the credentials in dir to their names,
// for ServiceConfig.Names: the roles' files and the enrolled identities
// (files that are missing or unreadable are left out).
func NamesIn(dir string) map[string]string {
	names := map[string]string{}
	for _, r := range Roles {
		if c, err := LoadCreds(filepath.Join(dir, CredsFile(r))); err == nil {
			names[c.Nkey] = cmp.Or(c.Name, string(r))
		}
	}
	ids, _ := Identities(dir)
	for _, i := range ids {
		names[i.Nkey] = i.Name
	}
	return names
}
