package sidecar

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// The agent wrapper and its sidecar share the admin token, and the wrapper
// never sends it. A port is not an identity: once the sidecar is gone
// (restarted, killed), whatever listens on its admin port next — the agent
// itself — would receive a bearer token and could answer "held". So the
// wrapper proves the token with an HMAC over its request and a fresh nonce
// (scheme Fenceline-HMAC), and the sidecar proves it back on every event of
// the stream it answers with: an HMAC over that nonce, the event's place in
// the stream and its bytes. Whoever does not hold the token learns nothing
// from a request and can make no event the wrapper takes.
//
//	request: X-Fenceline-Nonce: <nonce>
//	         Authorization: Fenceline-HMAC <hex HMAC(token, "request\n" method "\n" path "\n" nonce "\n" hex(sha256(body)))>
//	event:   mac: <hex HMAC(token, "event\n" nonce "\n" n "\n" data)>   (n = 1, 2, … within the stream)
//
// Bearer tokens stay accepted for other clients (a metrics scraper, an
// operator's curl).

const (
	headerNonce = "X-Fenceline-Nonce"
	hmacScheme  = "Fenceline-HMAC "
)

// adminMAC is HMAC-SHA256 under token over parts joined by newlines, in hex.
func adminMAC(token string, parts ...string) string {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte(strings.Join(parts, "\n")))
	return hex.EncodeToString(m.Sum(nil))
}

// requestMAC is a request's proof of the token.
func requestMAC(token, method, path, nonce string, body []byte) string {
	sum := sha256.Sum256(body)
	return adminMAC(token, "request", method, path, nonce, hex.EncodeToString(sum[:]))
}

// eventMAC is an event's proof of the token, for the stream opened with
// nonce: the n-th event with data.
func eventMAC(token, nonce string, n uint64, data []byte) string {
	return adminMAC(token, "event", nonce, strconv.FormatUint(n, 10), string(data))
}

// newNonce returns 128 random bits in hex.
func newNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}

// validNonce reports whether s can be a nonce (bounded, hex).
func validNonce(s string) bool {
	if len(s) < 16 || len(s) > 64 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

func macEqual(a, b string) bool { return hmac.Equal([]byte(a), []byte(b)) }
