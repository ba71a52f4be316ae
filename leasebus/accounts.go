package leasebus

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
)

// The bus's two NATS accounts (issue 28, the reply trick).
//
// NATS checks the subject a client publishes on against its permissions,
// never the reply subject it names. Whoever may call the JetStream API can
// therefore have the server publish the answer onto any subject of its
// account, and a stream that captures that subject stores it: a holder
// could append JetStream API answers to the lease log, the policy stream
// and the shard buckets. So the streams and the one identity that writes
// them (the lease service's store connection, RoleService) are in
// ServiceAccount, and every other identity is in FleetAccount, which has
// no JetStream: an answer aimed anywhere lands in the fleet account, where
// nothing stores it.
//
// The fleet reaches what it may read of the service account's streams
// through the JetStream API imported under FleetJSAPI (only the reads in
// fleetJSExports, and each user's permissions narrow them further), and
// the lease service takes the fleet's requests on a second connection in
// the fleet account (RoleServiceFleet), so a request's reply is still the
// asker's own inbox, which the service checks (Service.handler): a service
// import would have the server rewrite every reply, and the service could
// no longer tell where its answer goes. The fleet connection's key is
// derived from the service's own (FleetKey): one credential file.
const (
	// ServiceAccount holds the streams and the lease service's store
	// connection.
	ServiceAccount = "FENCELINE"
	// FleetAccount holds every other identity, and the lease service's
	// connection that answers them.
	FleetAccount = "FENCELINE_FLEET"
	// FleetJSAPI is where the fleet account finds the service account's
	// JetStream API (the reads fleetJSExports lists).
	FleetJSAPI = "FLJS.API"
	// RoleServiceFleet is the lease service's connection in the fleet
	// account: it hears requests and answers them, announces changes, and
	// reaches no stream. Its key is the service's, derived (FleetKey).
	RoleServiceFleet Role = "service-fleet"
)

// jsProbe is the request JetStream makes to learn which API a connection
// reaches (any answer: FleetJSAPI; no responders: "$JS.API").
const jsProbe = FleetJSAPI + ".STREAM.INFO." + PolicyStream

// fleetJSStreams are the streams the fleet may read (each role's grant
// says which of them).
var fleetJSStreams = []string{shardPoolStream, shardAttemptStream, PolicyStream, AuditStream, EventsStream}

// pullResponseWait bounds how long a pull request's deliveries may come
// back across the accounts: longer than any pull's expiry (nats.go asks
// for 30 s by default).
const pullResponseWait = 5 * time.Minute

// jsExport is one JetStream API subject the service account exports to the
// fleet (under FleetJSAPI there).
type jsExport struct {
	subject string // under "$JS.API"
	stream  bool   // answered with more than one message (a pull)
}

// reachPrefix is where a lease service instance's claim connection
// answers its own fleet connection, to show the two reach each other
// (hearsFleet): reachPrefix.<the instance's writer stamp>, a service the
// service account exports to the fleet account under the same name, which
// only the service's fleet identity may publish (a JetStream push
// delivery onto it, which any fleet identity may have made, gets no
// answer: answerReach). Core NATS, not JetStream: a flood of JetStream
// API requests, which any fleet identity may send, cannot hold it up.
const reachPrefix = "fenceline.reach"

// reachSubject is where instance writer's claim connection answers.
func reachSubject(writer string) string { return reachPrefix + "." + writer }

// fleetJSExports lists the JetStream API subjects the fleet account
// imports: reading a stream's info and records, and its own ordered pull
// consumers.
func fleetJSExports() []jsExport {
	var out []jsExport
	for _, st := range fleetJSStreams {
		for _, s := range slices.Concat(jsRead("$JS.API", st), jsConsume("$JS.API", st)) {
			out = append(out, jsExport{subject: s, stream: strings.Contains(s, ".MSG.NEXT.")})
		}
	}
	return out
}

// AccountOf is the account of role's identities.
func AccountOf(role Role) string {
	if role == RoleService {
		return ServiceAccount
	}
	return FleetAccount
}

// fleetKeyContext keys the derivation of the fleet key from the
// service's seed, so the seed is used for nothing else that way.
const fleetKeyContext = "fenceline lease service: the key of its connection in the fleet account, v1"

// fleetKey derives the key pair of the lease service's fleet-account
// connection from the service's seed: an HMAC of the context under the
// raw seed. Whoever holds the service's credentials can make it, nobody
// else, and nothing the service signs for anyone (a server's nonce) gives
// it away.
func fleetKey(seed []byte) (nkeys.KeyPair, error) {
	_, raw, err := nkeys.DecodeSeed(seed)
	if err != nil {
		return nil, fmt.Errorf("derive the service's fleet key: %w", err)
	}
	defer clear(raw)
	mac := hmac.New(sha256.New, raw)
	mac.Write([]byte(fleetKeyContext))
	derived := mac.Sum(nil)
	defer clear(derived)
	kp, err := nkeys.FromRawSeed(nkeys.PrefixByteUser, derived)
	if err != nil {
		return nil, fmt.Errorf("derive the service's fleet key: %w", err)
	}
	return kp, nil
}

// fleetKeyOfFile is fleetKey of the seed in a credential file's contents.
func fleetKeyOfFile(data []byte) (nkeys.KeyPair, error) {
	kp, err := nkeys.ParseDecoratedUserNKey(data)
	if err != nil {
		return nil, fmt.Errorf("bus credentials hold no nkey user seed: %w", err)
	}
	defer kp.Wipe()
	seed, err := kp.Seed()
	if err != nil {
		return nil, err
	}
	defer clear(seed)
	return fleetKey(seed)
}

// fleetPublicKey is the public fleet key of the credential file data.
func fleetPublicKey(data []byte) (string, error) {
	fk, err := fleetKeyOfFile(data)
	if err != nil {
		return "", err
	}
	defer fk.Wipe()
	return fk.PublicKey()
}

// connectedCreds maps the public key of every credential file this process
// connected with (Creds.Options) to its path: where fleetConn finds the
// service's seed.
var connectedCreds sync.Map // string -> string

// ConnectFleet connects a fleet-account connection of the lease service
// beside nc, its service-account connection (for what answers the fleet
// outside the lease service: embedded.ServeIdentities on a node that runs
// none). The caller closes it.
func ConnectFleet(nc *nats.Conn) (*nats.Conn, error) {
	fleet, why, err := fleetConn(nc)
	if err != nil {
		return nil, err
	}
	if fleet == nc {
		return nil, fmt.Errorf("no fleet connection: %s", why)
	}
	return fleet, nil
}

// fleetConn connects the lease service's fleet-account connection beside
// nc (its store connection): the same server and options, the derived
// key, its own inbox. On a bus without accounts (nc has no nkey, or the
// server admits no fleet key: configured before the bus had accounts)
// nc serves as both, and the reason is returned for the log.
func fleetConn(nc *nats.Conn) (*nats.Conn, string, error) {
	if nc.Opts.Nkey == "" {
		return nc, "the service connects without an nkey", nil
	}
	p, ok := connectedCreds.Load(nc.Opts.Nkey)
	if !ok {
		return nc, "the service's connection was not made from a credential file (Creds.Options)", nil
	}
	path := p.(string)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, "", fmt.Errorf("read bus credentials: %w", err)
	}
	pub, err := fleetPublicKey(data)
	clear(data)
	if err != nil {
		return nil, "", fmt.Errorf("bus credentials %s: %w", path, err)
	}
	// Signs with the key read again from the file each time, as nats.go's
	// NkeyOptionFromSeed does: the seed is not kept in memory.
	sign := func(nonce []byte) ([]byte, error) {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("read bus credentials: %w", err)
		}
		defer clear(data)
		fk, err := fleetKeyOfFile(data)
		if err != nil {
			return nil, err
		}
		defer fk.Wipe()
		return fk.Sign(nonce)
	}
	o := nc.Opts
	o.Name = strings.TrimSpace(o.Name + " (fleet)")
	o.Nkey = pub
	o.SignatureCB = sign
	o.InboxPrefix = inboxPrefix(pub)
	o.Servers = slices.Clone(o.Servers)
	if u := nc.ConnectedUrl(); u != "" && len(o.Servers) == 0 && o.Url == "" {
		o.Url = u
	}
	fleet, err := o.Connect()
	if err != nil {
		if errors.Is(err, nats.ErrAuthorization) {
			return nc, "the bus does not admit the service's fleet key: it was configured before the bus had accounts; print its configuration again with `fenceline bus creds` and reload the servers", nil
		}
		return nil, "", fmt.Errorf("connect the service's fleet connection: %w", err)
	}
	return fleet, "", nil
}

// JetStream is a JetStream handle for nc wherever its identity is: in the
// fleet account it reaches the service account's streams under FleetJSAPI
// (one probe request learns it); in the service account, or on a bus
// without accounts, under the API itself. Everything but the lease
// service reads the bus's streams through it.
func JetStream(ctx context.Context, nc *nats.Conn) (jetstream.JetStream, error) {
	api, err := jsAPI(ctx, nc)
	if err != nil {
		return nil, err
	}
	if api == FleetJSAPI {
		return jetstream.NewWithAPIPrefix(nc, FleetJSAPI)
	}
	return jetstream.New(nc)
}

// jsAPI is the JetStream API prefix nc reaches: "$JS.API" when nothing
// subscribes to the fleet's prefix (the server answers no responders at
// once: the service account, or a bus without accounts), else FleetJSAPI.
// An import that does not answer in time is still an import: JetStream is
// slow (a leader election), and the caller's own reads wait for it.
func jsAPI(ctx context.Context, nc *nats.Conn) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, jsProbeWait)
	defer cancel()
	_, err := nc.RequestWithContext(ctx, jsProbe, nil)
	switch {
	case err == nil, errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
		return FleetJSAPI, nil
	case errors.Is(err, nats.ErrNoResponders):
		return "$JS.API", nil
	default:
		return "", fmt.Errorf("reach JetStream: %w", err)
	}
}

// jsProbeWait bounds the probe (jsAPI).
const jsProbeWait = 2 * time.Second

// AuthConfig renders the nats-server configuration of the bus's two
// accounts with users (their roles' permissions, the service's fleet
// connection beside it): the embedded server parses the same text
// (embedded.StartServer), and `fenceline bus creds` prints it for any
// other server (docs/trust.md). A cluster's nodes all need it.
func AuthConfig(users []ServerUser) (string, error) {
	var b strings.Builder
	b.WriteString("# fenceline lease bus: the service account (its streams and the lease service) and the fleet\n")
	b.WriteString("# account (every other identity, one per role and one per enrolled runner; see docs/trust.md).\n")
	b.WriteString("# Generated by `fenceline bus creds` (again after each `bus enroll` or `bus revoke-identity`,\n")
	b.WriteString("# then reload every server); every permission not listed is denied.\n")
	byAccount := map[string][]ServerUser{}
	for _, u := range users {
		if !nkeys.IsValidPublicUserKey(u.Nkey) {
			return "", fmt.Errorf("bus user %q: %q is not a public user nkey", u.Name, u.Nkey)
		}
		if _, err := GrantOf(u.Role, u.Nkey); err != nil {
			return "", fmt.Errorf("bus user %q: %w", u.Name, err)
		}
		byAccount[AccountOf(u.Role)] = append(byAccount[AccountOf(u.Role)], u)
		if u.Role == RoleService {
			if !nkeys.IsValidPublicUserKey(u.FleetNkey) {
				return "", fmt.Errorf("bus user %q: the lease service needs its fleet key (ServerUser.FleetNkey, from its credential file)", u.Name)
			}
			byAccount[FleetAccount] = append(byAccount[FleetAccount], ServerUser{Role: RoleServiceFleet, Name: u.Name + " (fleet)", Nkey: u.FleetNkey})
		}
	}
	b.WriteString("accounts {\n")
	fmt.Fprintf(&b, "  %s {\n    jetstream: enabled\n", ServiceAccount)
	writeUsers(&b, byAccount[ServiceAccount])
	b.WriteString("    exports = [\n")
	for _, e := range fleetJSExports() {
		if e.stream {
			fmt.Fprintf(&b, "      { service: %q, accounts: [%s], response_type: stream, response_threshold: %q }\n", e.subject, FleetAccount, pullResponseWait)
		} else {
			fmt.Fprintf(&b, "      { service: %q, accounts: [%s] }\n", e.subject, FleetAccount)
		}
	}
	fmt.Fprintf(&b, "      { service: %q, accounts: [%s] }\n", reachPrefix+".*", FleetAccount)
	b.WriteString("    ]\n  }\n")
	fmt.Fprintf(&b, "  %s {\n", FleetAccount)
	writeUsers(&b, byAccount[FleetAccount])
	b.WriteString("    imports = [\n")
	for _, e := range fleetJSExports() {
		fmt.Fprintf(&b, "      { service: { account: %s, subject: %q }, to: %q }\n", ServiceAccount, e.subject, FleetJSAPI+strings.TrimPrefix(e.subject, "$JS.API"))
	}
	fmt.Fprintf(&b, "      { service: { account: %s, subject: %q } }\n", ServiceAccount, reachPrefix+".*")
	b.WriteString("    ]\n  }\n}\n")
	return b.String(), nil
}

// writeUsers writes an account's users block.
func writeUsers(b *strings.Builder, users []ServerUser) {
	b.WriteString("    users = [\n")
	for _, u := range users {
		g, _ := GrantOf(u.Role, u.Nkey)
		fmt.Fprintf(b, "      # %s (role %s)\n", cmpName(u), u.Role)
		fmt.Fprintf(b, "      { nkey: %q\n        permissions: {\n", u.Nkey)
		writeList := func(what string, subjects []string) {
			fmt.Fprintf(b, "          %s: { allow: [\n", what)
			for _, s := range subjects {
				fmt.Fprintf(b, "            %q\n", s)
			}
			b.WriteString("          ] }\n")
		}
		writeList("publish", g.Publish)
		writeList("subscribe", g.Subscribe)
		b.WriteString("        }\n      }\n")
	}
	b.WriteString("    ]\n")
}

func cmpName(u ServerUser) string {
	if u.Name != "" {
		return u.Name
	}
	return u.Nkey
}
