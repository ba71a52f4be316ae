package lease

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/fenceline/fenceline/lease/scope"
)

// A storage (the git server's pre-receive hook, the Postgres trigger)
// accepts only fences the lease service granted. The storage and the lease
// service share one secret per storage, the storage secret, which no
// runner, sidecar or agent holds. For each grant the service derives a
// grant key from it,
//
//	GrantKey = MAC(storage secret, grant message)
//
// over what the storage checks of the grant (repository, lease, fence,
// owner and claim; see GitGrantMessage and PostgresGrantMessage), and
// hands it to the acquirer alone, in the private answer to its acquire or
// renewal. The acquirer's fence signs its writes with the grant key; the
// storage derives the same key from its secret and the fence the write
// names, and verifies. A grant key is good for its one grant: whoever
// steals one (a runner's host) can sign writes for that lease, fence and
// claim only, which is what the runner could do anyway, and can mint no
// other fence, claim or lease.
//
// MAC(k, m) = SHA-256(k || SHA-256(k || m)): Postgres computes it with its
// built-in sha256(), and a storage secret is a fixed-size random key (no
// length extension reaches the outer hash).

// StorageGit and StoragePostgres name the storages a grant key is made for.
const (
	StorageGit      = "git"
	StoragePostgres = "postgres"
)

// grantDomain opens every grant message: a MAC made for anything else
// under a storage secret never serves as a grant key.
const grantDomain = "fenceline-grant v1"

// MinStorageSecret is the shortest storage secret the derivation accepts.
const MinStorageSecret = 16

// GrantKeys are the grant keys of one lease, one per storage whose secret
// the lease service holds for the lease's repository (nil: none).
type GrantKeys struct {
	Git      []byte `json:"git,omitempty"`
	Postgres []byte `json:"postgres,omitempty"`
}

// Granter is a lease source that holds its lease's grant keys (a
// leasebus.Holder); a fence signs its writes with them.
type Granter interface {
	// GrantKeys returns the keys the lease service gave the lease's
	// acquirer, nil when it gave none.
	GrantKeys() *GrantKeys
}

// MAC is SHA-256(key || SHA-256(key || msg)).
func MAC(key, msg []byte) []byte {
	h := sha256.New()
	h.Write(key)
	h.Write(msg)
	inner := h.Sum(nil)
	h.Reset()
	h.Write(key)
	h.Write(inner)
	return h.Sum(nil)
}

// MaxGitClaim is the longest claim (JSON) a git fence carries; a longer
// one travels, and is granted, as "" (no claim: the hook fences the paths
// the push touches). It keeps the push option within one pkt-line.
const MaxGitClaim = 65400

// GitClaim is claim c as the git fence carries and the grant names it:
// its JSON, or "" when longer than MaxGitClaim.
func GitClaim(c scope.Claim) string {
	b, err := json.Marshal(c)
	if err != nil || len(b) > MaxGitClaim {
		return ""
	}
	return string(b)
}

// GitGrantMessage is the grant message of a git grant, every value as the
// push options carry it:
//
//	fenceline-grant v1\n
//	storage git\n
//	repo <repo>\n
//	lease <lease id>\n
//	owner <owner>\n
//	fence <fence, decimal>\n
//	claim <claim JSON, or "">\n
//
// No value may contain a newline or NUL.
func GitGrantMessage(repo, leaseID, owner, fence, claim string) ([]byte, error) {
	return grantMessage(StorageGit, "repo", repo, "lease", leaseID, "owner", owner, "fence", fence, "claim", claim)
}

// GitGrantKey derives the git grant key from the repository's storage
// secret (the pre-receive hook's secret).
func GitGrantKey(secret []byte, repo, leaseID, owner, fence, claim string) ([]byte, error) {
	if len(secret) < MinStorageSecret {
		return nil, fmt.Errorf("git storage secret of %d bytes: want at least %d (fenceline hook install makes one)", len(secret), MinStorageSecret)
	}
	msg, err := GitGrantMessage(repo, leaseID, owner, fence, claim)
	if err != nil {
		return nil, err
	}
	return MAC(secret, msg), nil
}

// PostgresGrantMessage is the grant message of a Postgres grant, every
// value as the fence token carries it (the trigger reads them there):
//
//	fenceline-grant v1\n
//	storage postgres\n
//	lease <hex(lease id)>\n
//	fence <fence, decimal>\n
//	tables <PostgresTables of the claim>\n
//
// The repository is not in it: the trigger never learns it, and a
// database's secret is registered for the repositories whose leases may
// write it.
func PostgresGrantMessage(leaseHex, fence, tables string) ([]byte, error) {
	return grantMessage(StoragePostgres, "lease", leaseHex, "fence", fence, "tables", tables)
}

// PostgresGrantKey derives the Postgres grant key of lease leaseID at
// fence for tables (claimed "schema.table" or "schema.*") from the
// database's storage secret (fenceline.secret).
func PostgresGrantKey(secret []byte, leaseID string, fence uint64, tables []string) ([]byte, error) {
	if len(secret) < MinStorageSecret {
		return nil, fmt.Errorf("postgres storage secret of %d bytes: want at least %d (fenceline pg install makes one)", len(secret), MinStorageSecret)
	}
	field, err := PostgresTables(tables)
	if err != nil {
		return nil, err
	}
	msg, err := PostgresGrantMessage(hex.EncodeToString([]byte(leaseID)), strconv.FormatUint(fence, 10), field)
	if err != nil {
		return nil, err
	}
	return MAC(secret, msg), nil
}

// PostgresTables is the tables field of a fence token: ",", then each
// table as hex(schema) "." (hex(name) | "*") followed by ",", sorted and
// without repeats, so that the service and the fence make the same bytes.
func PostgresTables(tables []string) (string, error) {
	items := make([]string, 0, len(tables))
	for _, t := range tables {
		s, n, err := SplitTable(t)
		if err != nil {
			return "", err
		}
		item := hex.EncodeToString([]byte(s)) + "."
		if n == "*" {
			item += "*"
		} else {
			item += hex.EncodeToString([]byte(n))
		}
		items = append(items, item)
	}
	slices.Sort(items)
	items = slices.Compact(items)
	return "," + strings.Join(append(items, ""), ","), nil
}

// GrantKeysFor derives lease l's grant keys from the storage secrets of
// its repository (nil: that storage has none); nil when neither has one.
func GrantKeysFor(l *Lease, gitSecret, pgSecret []byte) (*GrantKeys, error) {
	var keys GrantKeys
	if gitSecret != nil {
		k, err := GitGrantKey(gitSecret, l.Repo, l.LeaseID, l.Owner.String(), strconv.FormatUint(l.Fence, 10), GitClaim(l.Scope))
		if err != nil {
			return nil, fmt.Errorf("git grant key of %s: %w", l.LeaseID, err)
		}
		keys.Git = k
	}
	if pgSecret != nil && len(l.Scope.Tables) > 0 {
		k, err := PostgresGrantKey(pgSecret, l.LeaseID, l.Fence, l.Scope.Tables)
		if err != nil {
			return nil, fmt.Errorf("postgres grant key of %s: %w", l.LeaseID, err)
		}
		keys.Postgres = k
	}
	if keys.Git == nil && keys.Postgres == nil {
		return nil, nil
	}
	return &keys, nil
}

func grantMessage(storage string, kv ...string) ([]byte, error) {
	var b strings.Builder
	b.WriteString(grantDomain + "\nstorage " + storage + "\n")
	for i := 0; i+1 < len(kv); i += 2 {
		if strings.ContainsAny(kv[i+1], "\n\x00") {
			return nil, fmt.Errorf("grant field %s contains a newline or NUL: it cannot be granted", kv[i])
		}
		b.WriteString(kv[i] + " " + kv[i+1] + "\n")
	}
	return []byte(b.String()), nil
}

// SplitTable splits a table claim ("schema.table", "schema.*", quoted
// identifiers allowed) into its raw schema and table names; the table is
// "*" for a wildcard.
func SplitTable(t string) (schemaName, table string, err error) {
	norm, err := scope.NormalizeTable(t)
	if err != nil {
		return "", "", err
	}
	s, rest, err := readIdent(norm)
	if err != nil || !strings.HasPrefix(rest, ".") {
		return "", "", fmt.Errorf("table %q: want schema.table", t)
	}
	rest = rest[1:]
	if rest == "*" {
		return s, "*", nil
	}
	n, rest, err := readIdent(rest)
	if err != nil || rest != "" {
		return "", "", fmt.Errorf("table %q: want schema.table", t)
	}
	return s, n, nil
}

// readIdent reads one identifier of a normalized name: bare (as is) or
// double-quoted with "" for a quote.
func readIdent(s string) (ident, rest string, err error) {
	if !strings.HasPrefix(s, `"`) {
		i := strings.IndexByte(s, '.')
		if i < 0 {
			return s, "", nil
		}
		return s[:i], s[i:], nil
	}
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		if s[i] == '"' {
			if i+1 < len(s) && s[i+1] == '"' {
				b.WriteByte('"')
				i++
				continue
			}
			return b.String(), s[i+1:], nil
		}
		b.WriteByte(s[i])
	}
	return "", "", errors.New("unterminated quoted identifier")
}
