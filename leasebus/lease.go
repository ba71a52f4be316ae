package leasebus

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Credential is the owner's proof: a secret chosen by the acquirer. The bus
// stores only its SHA-256, so neither the lease id nor the stored record is
// enough to renew or release.
type Credential string

// NewCredential returns a fresh random credential.
func NewCredential() Credential {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("crypto/rand: %v", err)) // never fails on Linux
	}
	return Credential(hex.EncodeToString(b[:]))
}

func (c Credential) hash() string {
	h := sha256.Sum256([]byte(c))
	return hex.EncodeToString(h[:])
}

func (c Credential) matches(hash string) bool {
	if c == "" {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(c.hash()), []byte(hash)) == 1
}

// renewProof is the proof of a renewal of leaseID at version with id
// renewID by the owner of the credential whose SHA-256 is hash (hex, as
// the service stores it): HMAC-SHA256 keyed with that hash over
//
//	fenceline-renew v1\n<lease id>\n<version>\n<renew id>
//
// in hex, or "" when hash is not a SHA-256.
func renewProof(hash, leaseID string, version uint64, renewID string) string {
	key, err := hex.DecodeString(hash)
	if err != nil || len(key) != sha256.Size {
		return ""
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte("fenceline-renew v1\n" + leaseID + "\n" + strconv.FormatUint(version, 10) + "\n" + renewID))
	return hex.EncodeToString(m.Sum(nil))
}

// proves reports whether proof is the proof of renewal r by the owner of
// the credential whose SHA-256 is hash (constant time).
func (r *RenewRequest) proves(hash string) bool {
	want := renewProof(hash, r.LeaseID, r.Version, r.RenewID)
	return want != "" && r.RenewID != "" && hmac.Equal([]byte(want), []byte(r.Proof))
}

// newID returns prefix + 16 characters of Crockford base32 (lease.NewID):
// ids sort by creation time.
func newID(prefix string, now time.Time) string { return lease.NewID(prefix, now) }

// newLeaseID returns a lease id that names its repo: "lease_", 16
// characters of newID (time, then random), then the repo's key (RepoKey,
// 24 hex digits) — 46 characters in all. Any service instance routes a
// request by such an id straight to the repo it names (LeaseRepoKey).
func newLeaseID(key string, now time.Time) string { return newID("lease_", now) + key }

// LeaseRepoKey returns the key (RepoKey) of the repo a lease id names, and
// false for an id of the old form, which names none ("lease_" and 16
// characters: ids granted before ids named their repo).
func LeaseRepoKey(id string) (string, bool) {
	const idLen, keyLen = len("lease_") + 16, 24
	if len(id) != idLen+keyLen || !strings.HasPrefix(id, "lease_") {
		return "", false
	}
	key := id[idLen:]
	for i := 0; i < len(key); i++ {
		if c := key[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", false
		}
	}
	return key, true
}

// NewRequestID returns a fresh id for an idempotent request.
func NewRequestID() string { return newID("req_", time.Now()) }
