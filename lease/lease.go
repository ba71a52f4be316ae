package lease

import (
	"fmt"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease/scope"
)

// Status is where a lease is in its life. Only StatusActive grants anything.
type Status string

const (
	StatusActive    Status = "active"
	StatusReleased  Status = "released"  // its owner released it
	StatusExpired   Status = "expired"   // its owner tried to renew after its TTL lapsed
	StatusReclaimed Status = "reclaimed" // the sweeper took it back after its TTL lapsed
	StatusRevoked   Status = "revoked"   // an operator ended it
)

// WorkspaceMode says how a lease occupies its workspace (a shard or the checkout).
type WorkspaceMode string

const (
	// WorkspaceExclusive is the sole occupant of its workspace; it may write
	// the git dir, commit and push.
	WorkspaceExclusive WorkspaceMode = "exclusive"
	// WorkspaceShared shares its workspace with other shared leases whose
	// claims are disjoint; it may not write the git dir.
	WorkspaceShared WorkspaceMode = "shared"
)

// DefaultWorkspace is the workspace of a lease that names none: the repo's
// one checkout when no shard pool is declared.
const DefaultWorkspace = "checkout"

// Owner identifies who holds a lease. It is descriptive; the proof of
// ownership is the lease's secret credential.
type Owner struct {
	TaskID    string `json:"taskId"`
	AgentID   string `json:"agentId"`
	AttemptID string `json:"attemptId"`
	HostID    string `json:"hostId"`
}

func (o Owner) String() string {
	s := fmt.Sprintf("task=%s agent=%s attempt=%s", o.TaskID, o.AgentID, o.AttemptID)
	if o.HostID != "" {
		s += " host=" + o.HostID
	}
	return s
}

// ParseOwner reads an owner as String writes it ("task=… agent=…
// attempt=… [host=…]"); what it does not know it leaves out. For owners
// that travel as text (a git push option): the result is only as true as
// its source.
func ParseOwner(s string) Owner {
	var o Owner
	for _, f := range strings.Fields(s) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "task":
			o.TaskID = v
		case "agent":
			o.AgentID = v
		case "attempt":
			o.AttemptID = v
		case "host":
			o.HostID = v
		}
	}
	return o
}

// Lease is the public lease record, exactly as stored and shown.
type Lease struct {
	LeaseID       string        `json:"leaseId"`
	Repo          string        `json:"repo"`
	Scope         scope.Claim   `json:"scope"`
	WorkspaceID   string        `json:"workspaceId"`
	WorkspaceMode WorkspaceMode `json:"workspaceMode"`
	Owner         Owner         `json:"owner"`
	Status        Status        `json:"status"`
	Version       uint64        `json:"version"`
	Fence         uint64        `json:"fence"`
	AcquiredAt    time.Time     `json:"acquiredAt"`
	RenewedAt     time.Time     `json:"renewedAt"`
	ExpiresAt     time.Time     `json:"expiresAt"`
	// TTL is how long the lease lives without a renewal.
	TTL Duration `json:"ttl"`
	// EndedAt and Reason are set once the lease is no longer active.
	EndedAt time.Time `json:"endedAt,omitzero"`
	Reason  string    `json:"reason,omitempty"`
	// Grants are the lease's grant keys (grant.go), set only on the answer
	// to its acquirer's acquire or renewal: never stored, shown or sent
	// anywhere else.
	Grants *GrantKeys `json:"-"`
}

// Active reports whether the record grants anything.
func (l *Lease) Active() bool { return l.Status == StatusActive }

// Duration is a time.Duration that reads and writes JSON as "300s".
type Duration time.Duration

func (d Duration) String() string { return time.Duration(d).String() }

// MarshalText implements encoding.TextMarshaler.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("parse duration %q: %w", b, err)
	}
	*d = Duration(v)
	return nil
}

// ValidLeaseID reports whether s looks like a lease id ("lease_" and up to
// 58 lower-case letters and digits), so bad input is named before it
// reaches the bus or a file name.
func ValidLeaseID(s string) bool {
	if !strings.HasPrefix(s, "lease_") || len(s) > 64 || len(s) <= len("lease_") {
		return false
	}
	for _, r := range s[len("lease_"):] {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'z') {
			return false
		}
	}
	return true
}
