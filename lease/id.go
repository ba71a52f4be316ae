package lease

import (
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"time"
)

var idEncoding = base32.NewEncoding("0123456789abcdefghjkmnpqrstvwxyz").WithPadding(base32.NoPadding)

// NewID returns prefix + 16 characters of Crockford base32: 48 bits of
// milliseconds since the epoch at now, then 32 random bits, so ids sort by
// creation time. Lease ids ("lease_"), request ids ("req_") and attempt
// ids ("att_") are made so.
func NewID(prefix string, now time.Time) string {
	var b [10]byte
	ms := uint64(now.UnixMilli())
	for i := 5; i >= 0; i-- {
		b[i] = byte(ms)
		ms >>= 8
	}
	if _, err := rand.Read(b[6:]); err != nil {
		panic(fmt.Sprintf("crypto/rand: %v", err))
	}
	return prefix + idEncoding.EncodeToString(b[:])
}

// NewAttemptID returns a fresh attempt id (Owner.AttemptID).
func NewAttemptID() string { return NewID("att_", time.Now()) }
