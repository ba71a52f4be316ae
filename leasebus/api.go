package leasebus

import (
	"time"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// Subjects and stream names on the bus. Everything fenceline puts on NATS
// lives under these, so an account can be given exactly these permissions.
const (
	// requests to the lease service: <apiPrefix>.<op>
	apiPrefix = "fenceline.lease.v1"
	// serviceQueue is the queue group of lease service instances.
	serviceQueue = "fenceline-lease"
	// peersSubject is where lease service instances announce themselves.
	peersSubject = "fenceline.lease.v1.instances"
	// changedPrefix.<repoKey>.<leaseId> carries each committed lease record
	// (core NATS, for watchers; holders re-check on renewal anyway).
	changedPrefix = "fenceline.lease.v1.changed"
	// appendedPrefix.<repoKey> carries each lease log record, with its
	// sequence (logSeqHeader), once the stream has acknowledged it (core
	// NATS, between service instances). Not the log subject itself: a core subscriber
	// there can see a record before the stream stores it, or one the
	// compare-and-swap then rejects.
	appendedPrefix = "fenceline.lease.v1.appended"

	// LogStream holds each repo's lease log: deltas and snapshots on
	// fenceline.log.<repoKey>, written with compare-and-swap.
	LogStream  = "FENCELINE_LOG"
	logSubject = "fenceline.log"

	// AuditStream holds the lease service's own audit (grants, renewals'
	// ends, releases, expiries, reclaims, revokes) on
	// AuditSubject.<repoKey>.lease; EventsStream holds every other event
	// (the boundaries' refusals, the bus's reads, sweeps and refusals) on
	// EventsSubject.<repoKey>.<boundary>.<writer>, the writer being the
	// identity that sent the event or caused it. Two streams, so that no
	// volume of events evicts a grant or a revoke; both under "$JS.", which
	// the server takes from no client as a reply subject (nor as a
	// consumer's delivery subject), so that no one can have the server
	// store its answers there. Only the lease service writes either. (Up
	// to this layout every event was on FENCELINE_AUDIT,
	// fenceline.audit.<repoKey>.<boundary>; a store made before keeps that
	// stream, unread.)
	AuditStream   = "FENCELINE_LEASE_AUDIT"
	AuditSubject  = "$JS.EVENT.FENCELINE.audit"
	EventsStream  = "FENCELINE_EVENTS"
	EventsSubject = "$JS.EVENT.FENCELINE.events"
)

// AcquireRequest asks for a lease.
type AcquireRequest struct {
	Repo        string      `json:"repo"`
	Scope       scope.Claim `json:"scope"`
	WorkspaceID string      `json:"workspaceId,omitempty"`
	// Workspaces, instead of WorkspaceID, names candidate workspaces (a
	// shard pool): the lease is granted in the first that fits, decided
	// with the overlap check in one step, and Lease.WorkspaceID names it.
	// A shared lease goes first to a candidate that already has sharers, so
	// empty ones stay free for exclusive leases. Queued requests over the
	// same candidates are served first come, first served; a request for
	// one named workspace (a shard's commit capacity) does not wait behind
	// them, so a steady stream of those can delay a queued pool request
	// until its wait ends.
	Workspaces    []string            `json:"workspaces,omitempty"`
	WorkspaceMode lease.WorkspaceMode `json:"workspaceMode,omitempty"`
	// MaxSharers bounds the shared leases of the workspace (0: no bound).
	MaxSharers int            `json:"maxSharers,omitempty"`
	Owner      lease.Owner    `json:"owner"`
	TTL        lease.Duration `json:"ttl"`
	// Wait is how long to queue behind conflicting leases (0: fail at once).
	Wait lease.Duration `json:"wait,omitempty"`
	// RequestID makes the acquire idempotent: a retry with the same id and
	// credential gets the lease the first try was granted.
	RequestID string `json:"requestId"`
	// CredentialHash is the SHA-256 of the owner's credential; the secret
	// itself never travels on acquire.
	CredentialHash string `json:"credentialHash"`
	// Session binds the lease to the asking client's session (set by
	// AcquireAndHold): once that session sends no keepalive for the
	// service's SessionGrace, the lease is reclaimed — its process is gone
	// — instead of lasting out its TTL. Empty: the lease ends only by its
	// TTL, a release or a revoke (a lease acquired to be handed over).
	Session string `json:"session,omitempty"`

	// by is the asking identity and byName what the audit calls it: set
	// by the service from the request subject, never from the body. The
	// lease is bound to it (renew, release and cancel from another
	// identity are refused).
	by, byName string
}

// RenewRequest extends a lease. Version is the version the holder last saw;
// the renewal is a compare-and-swap on it.
//
// A renewal proves the owner's credential without carrying it: it travels
// as Proof, an HMAC over the lease, the version and the renewal's id
// (renewProof), which is good for that one renewal only. Whoever captures
// renewals (a stream someone made over the request subjects) can replay
// none of them into anything but a retry, and learns nothing that releases
// the lease.
type RenewRequest struct {
	LeaseID string `json:"leaseId"`
	// Repo routes the request straight to the repo's state (optional).
	Repo string `json:"repo,omitempty"`
	// Credential is the owner's credential; the client sends only the
	// Proof made with it (never the credential itself).
	Credential Credential `json:"-"`
	Proof      string     `json:"proof,omitempty"`
	Version    uint64     `json:"version"`
	// RenewID names the renewal: a retry with the same id is recognised.
	// The client makes one when it is empty.
	RenewID string `json:"renewId,omitempty"`

	by string // the asking identity, from the request subject
}

// ReleaseRequest ends a lease; only its owner can.
type ReleaseRequest struct {
	LeaseID    string     `json:"leaseId"`
	Repo       string     `json:"repo,omitempty"` // optional routing hint
	Credential Credential `json:"credential"`

	by string // the asking identity, from the request subject
}

// RevokeRequest ends a lease as an operator, with a reason.
type RevokeRequest struct {
	LeaseID string `json:"leaseId"`
	Repo    string `json:"repo,omitempty"` // optional routing hint
	Reason  string `json:"reason"`
	// by is who asked: set by the service from the request subject, never
	// from the request's body.
	by string
}

// cancelRequest withdraws a queued acquire (or releases what it was granted).
type cancelRequest struct {
	Repo       string     `json:"repo"`
	RequestID  string     `json:"requestId"`
	Credential Credential `json:"credential"`

	by string // the asking identity, from the request subject
}

type getRequest struct {
	LeaseID string `json:"leaseId"`
	Repo    string `json:"repo,omitempty"`
	// Cached asks for the instance's last view of the lease (a holder's
	// heartbeat), answered without reading the log when it has one.
	Cached bool `json:"cached,omitempty"`
}

// syncRequest makes an actor reload its repo's log (another writer
// appended to it).
type syncRequest struct{}

// reapRequest makes an actor reclaim the leases of its repo whose
// sessions have been silent for grace (an internal call of the session
// reaper, which picks the grace: see Service.reapSilent).
type reapRequest struct{ grace time.Duration }

// keepaliveRequest keeps a client's session alive and asks, in one
// request, after every lease the session's holders hold: the heartbeat of
// all of them (see session.go).
type keepaliveRequest struct {
	Session string      `json:"session"`
	Leases  []keptLease `json:"leases"`
	// Compact asks for the answer in short: Kept lists only the leases
	// not simply vouched for, and KeptRest vouches for the others.
	Compact bool `json:"compact,omitempty"`
}

// keptLease is one lease a keepalive asks after, as its holder last saw it.
type keptLease struct {
	LeaseID string `json:"leaseId"`
	Repo    string `json:"repo"`
	Fence   uint64 `json:"fence"`
	Version uint64 `json:"version"`
}

// keptAnswer is the service's word on one lease of a keepalive.
type keptAnswer struct {
	LeaseID string `json:"leaseId"`
	// Lease is the record, when its version or status is not what the
	// holder sent (else the holder's copy stands).
	Lease *lease.Lease `json:"lease,omitempty"`
	// Age is how old the view the answer came from is (0: read now).
	Age lease.Duration `json:"age,omitempty"`
	// Missing: the service read the log, and it has no such lease.
	Missing bool `json:"missing,omitempty"`
	// Unknown: this instance could not vouch for the lease now (the
	// holder counts nothing heard for it).
	Unknown bool `json:"unknown,omitempty"`
}

// keptRest is the service's word on the leases a compact keepalive's
// answer does not list (reply.KeptRest).
type keptRest struct {
	Age lease.Duration `json:"age"`
}

type listRequest struct {
	Repo string `json:"repo,omitempty"`
	// All includes recently ended leases.
	All bool `json:"all,omitempty"`
	// holder keeps only the leases this identity acquired (the service's
	// own asks: shards.go).
	holder string
}

type sweepRequest struct {
	Repo string `json:"repo,omitempty"`
}

// Lease service requests are sent on <apiPrefix>.<op>.<identity>, where
// identity is the asker's public nkey (IdentityOf): the bus lets each
// user publish only under its own (see Grant), so the service knows who
// asked without trusting anything in the request.

type reply struct {
	Lease *lease.Lease `json:"lease,omitempty"`
	// Grants are the lease's grant keys, only in the answer to its
	// acquirer's acquire or renewal (grants.go).
	Grants *GrantKeys     `json:"grants,omitempty"`
	Leases []*lease.Lease `json:"leases,omitempty"`
	Error  *wireError     `json:"error,omitempty"`
	// Age is how old the view a cached get answered from is (0: read now).
	Age lease.Duration `json:"age,omitempty"`
	// Kept answers a keepalive, one per lease it asked after (a compact
	// one: only those KeptRest does not cover).
	Kept []keptAnswer `json:"kept,omitempty"`
	// KeptRest answers a compact keepalive for every lease it asked after
	// that Kept does not list: active at the version asked, as of a view
	// at most Age old. Most keepalives are answered by it alone: a
	// fleet's sessions send thousands a second.
	KeptRest *keptRest `json:"keptRest,omitempty"`
	// Beat is the answering instance's beat anchor: the beats that follow
	// it vouch for the leases the keepalive found unchanged (beat.go).
	Beat *beatAnchor `json:"anchor,omitempty"`
	// Revision is a shard record's revision after a write (shards.go).
	Revision uint64 `json:"revision,omitempty"`
	// Policy is the version a policy write stored (policy.go).
	Policy *policy.Document `json:"policy,omitempty"`
	// Status is an instance's answer to a status request (status.go).
	Status *Status `json:"status,omitempty"`
}

// ChangedSubject is where the lease service announces each committed
// record of one lease (core NATS: Client.Watch and Holder listen there).
func ChangedSubject(repo, leaseID string) string {
	return changedPrefix + "." + RepoKey(repo) + "." + leaseID
}

// RepoKey is the subject token for a repo: the first 12 bytes of the
// SHA-256 of its identity, in hex. Repo identities contain dots and
// slashes, which NATS subjects reserve.
func RepoKey(repo string) string { return repoid.Key(repo) }
