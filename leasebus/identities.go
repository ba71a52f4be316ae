package leasebus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// Identities: a bus identity of its own for every runner, sidecar and pod.
//
// The four role files (EnsureCreds) give one key per role; every runner
// holding holder.nk would be one identity, able to read every other's
// answers (its inbox is _INBOX.<identity>.>). So the operator enrols
// identities, one per runner, sidecar or pod: a fresh nkey user each,
// recorded in the credentials directory as a public record
// (<creds>/identities/<name>.id: role, name, public key) that the server
// reads, and whose seed goes to the one machine or pod that uses it
// (<creds>/holders/<name>.nk, or wherever `bus enroll --out` puts it).
// Removing the record and reloading the server (RevokeIdentity, then the
// embedded server's reload or an external server's) closes that identity's
// connections and refuses it from then on; no other identity changes.
//
// A run on the embedded default bus needs no operator: it makes a key pair
// in memory and asks the bus to enrol its public key as an ephemeral holder
// (EnrollRequest, on identitySubject("enroll", <enroller>)), with the
// machine's enroller.nk. The enroller role may publish that request and
// hear its own inbox, nothing else: no lease request, no other inbox, no
// stream. The run leaves (identitySubject("leave", <itself>)) when it
// ends, which removes its record.

// RoleEnroller may only ask the bus to enrol a new ephemeral holder
// identity for a public key the asker made (see EnrollRequest).
const RoleEnroller Role = "enroller"

// identityPrefix is where identity requests go:
// <identityPrefix>.<op>.<asker's identity>, op one of enroll (an
// enroller's), leave (a holder's own ephemeral identity) and reload (an
// operator's: read the identities again after `bus enroll` or `bus
// revoke-identity`).
const identityPrefix = "fenceline.identity.v1"

func identitySubject(op, id string) string { return identityPrefix + "." + op + "." + id }

// IdentitySubjects is the subject pattern of op identity requests from any
// identity (for the embedded bus's handler).
func IdentitySubjects(op string) string { return identitySubject(op, "*") }

// IdentityOfSubject is the identity an identity request on subject came
// from, and whether its reply goes to that identity's own inbox (else the
// message is not a request that identity sent).
func IdentityOfSubject(subject, reply string) (string, bool) {
	id := subject[strings.LastIndexByte(subject, '.')+1:]
	return id, validIdentity(id) && strings.HasPrefix(reply, inboxPrefix(id)+".")
}

// MaxEphemeral bounds the ephemeral identities a bus keeps at once: an
// enroller key cannot fill the server's user list.
const MaxEphemeral = 1024

// Identity is one enrolled bus identity: its public record.
type Identity struct {
	Name string `json:"name"`
	Role Role   `json:"role"`
	Nkey string `json:"nkey"`
	// Ephemeral identities were enrolled by a run or sidecar for itself
	// (with the enroller key), and leave when it ends.
	Ephemeral bool `json:"ephemeral,omitempty"`
}

// User is i as a server user.
func (i Identity) User() ServerUser { return ServerUser{Role: i.Role, Name: i.Name, Nkey: i.Nkey} }

// ErrIdentityExists: an identity of that name is enrolled already.
var ErrIdentityExists = errors.New("identity already enrolled")

// IdentitiesDir is where the identities' public records are:
// <creds>/identities.
func IdentitiesDir(credsDir string) string { return filepath.Join(credsDir, "identities") }

// HoldersDir is where `bus enroll` keeps an identity's seed when no --out
// is given: <creds>/holders.
func HoldersDir(credsDir string) string { return filepath.Join(credsDir, "holders") }

// ValidIdentityName reports whether name can name an identity: 1 to 64 of
// letters, digits, '-', '_' and '.', not starting with '.'.
func ValidIdentityName(name string) bool {
	if len(name) == 0 || len(name) > 64 || name[0] == '.' {
		return false
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-', c == '.':
		default:
			return false
		}
	}
	return true
}

func checkIdentity(i Identity) error {
	if !ValidIdentityName(i.Name) {
		return fmt.Errorf("%w: identity name %q: use 1 to 64 letters, digits, '-', '_' or '.'", lease.ErrInvalid, i.Name)
	}
	if !nkeys.IsValidPublicUserKey(i.Nkey) {
		return fmt.Errorf("%w: identity %s: %q is not a public user nkey", lease.ErrInvalid, i.Name, i.Nkey)
	}
	switch i.Role {
	case RoleHolder, RoleViewer, RoleOperator:
	default:
		return fmt.Errorf("%w: identity %s: role %q cannot be enrolled (holder, viewer or operator)", lease.ErrInvalid, i.Name, i.Role)
	}
	return nil
}

// AddIdentity records i in credsDir's identities. An identity of that name
// already there is ErrIdentityExists, unless it is the very same record
// (cluster nodes sharing one directory all record an enrolment).
func AddIdentity(credsDir string, i Identity) error {
	if err := checkIdentity(i); err != nil {
		return err
	}
	dir := IdentitiesDir(credsDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("bus identities dir: %w", err)
	}
	data, err := json.Marshal(i)
	if err != nil {
		return fmt.Errorf("encode identity %s: %w", i.Name, err)
	}
	path := filepath.Join(dir, i.Name+".id")
	err = linkNew(path, append(data, '\n'))
	if errors.Is(err, fs.ErrExist) {
		if old, rerr := readIdentity(path); rerr == nil && old == i {
			return nil
		}
		return fmt.Errorf("%w: %s (revoke it first: fenceline bus revoke-identity %s)", ErrIdentityExists, i.Name, i.Name)
	}
	return err
}

func readIdentity(path string) (Identity, error) {
	var i Identity
	data, err := os.ReadFile(path)
	if err != nil {
		return i, err
	}
	if err := json.Unmarshal(data, &i); err != nil {
		return i, fmt.Errorf("bus identity %s: %w", path, err)
	}
	if err := checkIdentity(i); err != nil {
		return i, fmt.Errorf("bus identity %s: %w", path, err)
	}
	return i, nil
}

// Identities lists credsDir's enrolled identities, by name. A record that
// does not parse is an error (the server would otherwise silently drop an
// identity someone enrolled).
func Identities(credsDir string) ([]Identity, error) {
	ents, err := os.ReadDir(IdentitiesDir(credsDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bus identities: %w", err)
	}
	var out []Identity
	for _, e := range ents {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".id") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		i, err := readIdentity(filepath.Join(IdentitiesDir(credsDir), e.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, err
		}
		out = append(out, i)
	}
	slices.SortFunc(out, func(a, b Identity) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// FindIdentity returns the identity of credsDir named name, or the one
// whose public key is name.
func FindIdentity(credsDir, name string) (Identity, bool, error) {
	all, err := Identities(credsDir)
	if err != nil {
		return Identity{}, false, err
	}
	for _, i := range all {
		if i.Name == name || i.Nkey == name {
			return i, true, nil
		}
	}
	return Identity{}, false, nil
}

// RemoveIdentity removes the identity i from credsDir: its record, and its
// seed in HoldersDir if `bus enroll` left it there. The running server
// still admits it until it reloads its users.
func RemoveIdentity(credsDir string, i Identity) error {
	if err := os.Remove(filepath.Join(IdentitiesDir(credsDir), i.Name+".id")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove bus identity %s: %w", i.Name, err)
	}
	if err := os.Remove(filepath.Join(HoldersDir(credsDir), i.Name+".nk")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the seed of bus identity %s: %w", i.Name, err)
	}
	return nil
}

// EnrollIdentity makes a fresh nkey for name with role, records its
// public key in credsDir and writes its seed to seedPath (mode 0600; an
// existing file is never replaced): the identity's credentials file, for
// --creds. An empty seedPath means HoldersDir(credsDir)/<name>.nk.
func EnrollIdentity(credsDir, name string, role Role, seedPath string) (Identity, string, error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return Identity{}, "", fmt.Errorf("make bus identity: %w", err)
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return Identity{}, "", fmt.Errorf("make bus identity: %w", err)
	}
	id := Identity{Name: name, Role: role, Nkey: pub}
	if err := checkIdentity(id); err != nil {
		return Identity{}, "", err
	}
	if seedPath == "" {
		if err := os.MkdirAll(HoldersDir(credsDir), 0o700); err != nil {
			return Identity{}, "", fmt.Errorf("bus identities dir: %w", err)
		}
		seedPath = filepath.Join(HoldersDir(credsDir), name+".nk")
	}
	if _, err := os.Lstat(seedPath); err == nil {
		return Identity{}, "", fmt.Errorf("%w: %s exists; move it away or name another seed path", ErrIdentityExists, seedPath)
	}
	if err := AddIdentity(credsDir, id); err != nil {
		return Identity{}, "", err
	}
	seed, err := kp.Seed()
	if err != nil {
		return Identity{}, "", fmt.Errorf("make bus identity: %w", err)
	}
	defer clear(seed)
	if err := writeSeed(seedPath, role, name, seed); err != nil {
		_ = RemoveIdentity(credsDir, id)
		return Identity{}, "", err
	}
	return id, seedPath, nil
}

// ServerUsers are every identity credsDir admits: its roles' files (made
// when missing, EnsureCreds) and its enrolled identities.
func ServerUsers(credsDir string) ([]ServerUser, error) {
	creds, err := EnsureCreds(credsDir)
	if err != nil {
		return nil, err
	}
	var users []ServerUser
	for _, r := range Roles {
		users = append(users, creds[r].User())
	}
	ids, err := Identities(credsDir)
	if err != nil {
		return nil, err
	}
	for _, i := range ids {
		users = append(users, i.User())
	}
	return users, nil
}

// EnrollRequest asks the bus to enrol Nkey, a public key the asker made,
// as an ephemeral holder identity named Name.
type EnrollRequest struct {
	Name string `json:"name"`
	Nkey string `json:"nkey"`
}

// IdentityReply answers an identity request.
type IdentityReply struct {
	Name  string `json:"name,omitempty"`
	Error string `json:"error,omitempty"`
}

// EphemeralIdentity is a holder identity a run enrolled for itself: its
// key lives in memory only.
type EphemeralIdentity struct {
	Name string
	kp   nkeys.KeyPair
	pub  string
}

// Nkey is the identity: its public key.
func (e *EphemeralIdentity) Nkey() string { return e.pub }

// Options connect as e: its nkey and its own inbox prefix.
func (e *EphemeralIdentity) Options() []nats.Option {
	return []nats.Option{
		nats.Nkey(e.pub, e.kp.Sign),
		nats.CustomInboxPrefix(inboxPrefix(e.pub)),
	}
}

// ErrNoEnrolment: nothing on the bus enrols identities (a bus other than
// the embedded one, or one from before identities).
var ErrNoEnrolment = errors.New("the bus enrols no identities")

// EnrollEphemeral makes a key pair and has the bus, reached by enroller (a
// connection with the enroller role), enrol it as an ephemeral holder
// named name. The bus answers once its server admits the new identity.
func EnrollEphemeral(enroller *nats.Conn, name string) (*EphemeralIdentity, error) {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return nil, fmt.Errorf("make bus identity: %w", err)
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, fmt.Errorf("make bus identity: %w", err)
	}
	data, _ := json.Marshal(EnrollRequest{Name: name, Nkey: pub})
	m, err := enroller.Request(identitySubject("enroll", IdentityOf(enroller)), data, 2*ConnectTimeout)
	if errors.Is(err, nats.ErrNoResponders) {
		return nil, fmt.Errorf("%w: %w", ErrNoEnrolment, err)
	}
	if err != nil {
		return nil, fmt.Errorf("enrol bus identity %s: %w", name, err)
	}
	var r IdentityReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return nil, fmt.Errorf("enrol bus identity %s: %w", name, err)
	}
	if r.Error != "" {
		return nil, fmt.Errorf("enrol bus identity %s: %s", name, r.Error)
	}
	return &EphemeralIdentity{Name: r.Name, kp: kp, pub: pub}, nil
}

// Leave asks the bus, on nc (connected as e), to remove e. The server
// closes nc once it has.
func (e *EphemeralIdentity) Leave(nc *nats.Conn) error {
	m, err := nc.Request(identitySubject("leave", e.pub), nil, 2*ConnectTimeout)
	if err != nil && !nc.IsConnected() {
		// The bus closed this identity's connection: it reloaded its users
		// without this one (the answer, sent first, can be lost with the
		// connection).
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove bus identity %s: %w", e.Name, err)
	}
	var r IdentityReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return fmt.Errorf("remove bus identity %s: %w", e.Name, err)
	}
	if r.Error != "" {
		return fmt.Errorf("remove bus identity %s: %s", e.Name, r.Error)
	}
	return nil
}

// ReloadIdentities asks the embedded bus, on nc (an operator's
// connection), to read its identities again. It returns ErrNoEnrolment
// when nothing answers (no embedded bus there).
func ReloadIdentities(nc *nats.Conn) error {
	m, err := nc.Request(identitySubject("reload", IdentityOf(nc)), nil, 2*ConnectTimeout)
	if errors.Is(err, nats.ErrNoResponders) {
		return fmt.Errorf("%w: %w", ErrNoEnrolment, err)
	}
	if err != nil {
		return fmt.Errorf("reload bus identities: %w", err)
	}
	var r IdentityReply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		return fmt.Errorf("reload bus identities: %w", err)
	}
	if r.Error != "" {
		return fmt.Errorf("reload bus identities: %s", r.Error)
	}
	return nil
}

// writeSeed writes a credentials file for role and name with seed at
// path: whole, mode 0600, never replacing a file.
func writeSeed(path string, role Role, name string, seed []byte) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# fenceline lease bus credentials (an nkey user seed; see docs/trust.md)\n")
	fmt.Fprintf(&b, "# role: %s\n# name: %s\n", role, name)
	fmt.Fprintf(&b, "# Whoever reads this file acts as %s on the bus: keep it mode 0600.\n", name)
	b.WriteString("-----BEGIN USER NKEY SEED-----\n")
	b.Write(seed)
	b.WriteString("\n------END USER NKEY SEED------\n")
	defer clear(b.Bytes())
	return linkNew(path, b.Bytes())
}

// linkNew writes data to a temporary file beside path, then links it into
// place: a reader never sees half a file, and an existing file is never
// replaced (fs.ErrExist).
func linkNew(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp") // mode 0600
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", f.Name(), err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", f.Name(), err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", f.Name(), err)
	}
	if err := os.Link(f.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("write %s: %w", path, fs.ErrExist)
		}
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// Audit event types of identity changes (boundary bus).
const (
	EventIdentityEnrolled = "identity-enrolled"
	EventIdentityRevoked  = "identity-revoked" // by the operator, or an ephemeral identity's own leave
)

// IdentityChanged records that identity by asked for i to be enrolled or
// revoked (typ: EventIdentityEnrolled, EventIdentityRevoked), as an audit
// event of the bus naming both, and names i by its name from now on in
// every event (RequestedBy). The bus's identity service calls it
// (embedded.Identities.Audit).
func (s *Service) IdentityChanged(ctx context.Context, typ, by string, i Identity) {
	if typ == EventIdentityEnrolled {
		s.names.Store(i.Nkey, i.Name)
	}
	who := s.name(by)
	kind := "enrolled"
	if typ == EventIdentityRevoked {
		kind = "revoked"
		if by == i.Nkey {
			kind = "left (its run ended)"
		}
	}
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: typ, Boundary: lease.BoundaryBus, RequestedBy: who,
		Message: clip(fmt.Sprintf("%s (%s): %s as %s by %s", i.Name, i.Nkey, kind, i.Role, who), maxEventMessage)}
	if err := s.writeBusEvent(ctx, by, ev); err != nil {
		s.log.Warn("audit event of an identity change not written", "type", typ, "identity", i.Name, "requested_by", who, "err", err)
	}
}

// IdentityCollected records that the embedded bus removes i, an ephemeral
// identity none of whose sessions had been heard for idle: its run ended
// without leaving (killed). It is the collection's confirmation, written
// before the identity is removed: on a cluster the audit is replicated, so
// an instance cut off from the majority — which stops hearing the
// sessions on the other side, and after a grace stops counting the
// instances there — cannot write it and removes nothing.
func (s *Service) IdentityCollected(ctx context.Context, i Identity, idle time.Duration) error {
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: EventIdentityRevoked, Boundary: lease.BoundaryBus, RequestedBy: s.name(""),
		Message: clip(fmt.Sprintf("%s (%s): collected as %s: none of its sessions heard for %s (its run ended without leaving)", i.Name, i.Nkey, i.Role, idle.Round(time.Second)), maxEventMessage)}
	if err := s.writeBusEvent(ctx, "", ev); err != nil {
		return fmt.Errorf("audit the collection of %s: %w", i.Name, err)
	}
	return nil
}
