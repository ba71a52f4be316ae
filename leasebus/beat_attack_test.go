package leasebus

// Forged beats. A beat vouches for every lease its session anchored, so a
// holder that could put one of its own making on the beat subject, in the
// fleet account where the sessions hear beats, could keep another
// holder's revoked lease writing: the next number in the chain, the
// service's epoch (every holder hears it), no bucket named. These tests
// try every way the fleet has of making a message appear on a subject —
// publishing on it, naming it as the reply of a request to the lease
// service or to the JetStream API (a direct get of a stored beat, with and
// without its headers; a stream's info; a stored message; a pull), naming
// it as a push consumer's deliver subject — and assert that a session
// accepts no beat there but the service's.

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// forgedSeq numbers the forged beats: far past any the service cuts.
const forgedSeq = 1 << 52

// beatEar hears the beat subject as a session does, and keeps the beats a
// session would accept.
type beatEar struct {
	mu       sync.Mutex
	accepted []beat
	all      int // messages heard, accepted or not
}

func (e *beatEar) hear(m *nats.Msg) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.all++
	if !isBeat(m) {
		return
	}
	if b, ok := decodeBeat(m.Data); ok {
		e.accepted = append(e.accepted, *b)
	}
}

// genuine is how many accepted beats are the service's (not forged), and
// the epoch of the last.
func (e *beatEar) genuine() (n int, epoch string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, b := range e.accepted {
		if b.Seq < forgedSeq {
			n, epoch = n+1, b.Epoch
		}
	}
	return n, epoch
}

func (e *beatEar) forged() []beat {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []beat
	for _, b := range e.accepted {
		if b.Seq >= forgedSeq {
			out = append(out, b)
		}
	}
	return out
}

// genuineBeats waits until ear has accepted n more of the service's beats
// than it had, and returns the epoch of the last.
func (e *beatEar) genuineBeats(t *testing.T, n int) string {
	t.Helper()
	had, _ := e.genuine()
	var epoch string
	checkFor(t, 15*time.Second, 10*time.Millisecond, func() error {
		var got int
		if got, epoch = e.genuine(); got < had+n {
			return fmt.Errorf("%d of the service's beats heard, want %d", got-had, n)
		}
		return nil
	})
	return epoch
}

func TestFleetCannotForgeABeat(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	fleetCannotForgeABeat(t, b.srv.ClientURL())
}

// fleetCannotForgeABeat tries every vector on the bus at url, whose lease
// service beats.
func fleetCannotForgeABeat(t *testing.T, url string) {
	ear := &beatEar{}
	listener := connectAs(t, url, RoleHolder)
	if _, err := listener.Subscribe(beatSubject, ear.hear); err != nil {
		t.Fatal(err)
	}
	if err := listener.Flush(); err != nil {
		t.Fatal(err)
	}
	epoch := ear.genuineBeats(t, 1)

	// The beat a forger wants a session to take: the service's epoch, a
	// number of its own, nothing named, a clock that does not run back.
	forged, err := json.Marshal(beatMsg{Beat: &beat{Epoch: epoch, Seq: forgedSeq, Clock: time.Now().UnixNano()}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := decodeBeat(forged); !ok {
		t.Fatalf("the forged beat %s must be one a session would read", forged)
	}
	// Stored with a writer's header, as if a service wrote it: what a
	// direct get hands on is then as close to a beat as storing gets.
	attacker, planted := storeAt(t, url, forged)

	vectors := append([]replyTrickVector{
		{"publish", func(t *testing.T, attacker *nats.Conn, _, target string) func(*nats.Conn, string) error {
			m := nats.NewMsg(target)
			m.Header.Set(writerHeader, "forged")
			m.Data = forged
			if err := attacker.PublishMsg(m); err != nil {
				t.Fatal(err)
			}
			checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
				if err := attacker.LastError(); err == nil || !strings.Contains(err.Error(), target) {
					return fmt.Errorf("the bus has not refused the holder's publish on %s (last error: %v)", target, err)
				}
				return nil
			})
			return nil
		}},
		{"direct-get-no-headers", func(t *testing.T, attacker *nats.Conn, planted, target string) func(*nats.Conn, string) error {
			req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV." + ShardAttemptBucket + "." + planted, "no_hdr": true})
			return apiRequest(t, attacker, fleetJSAPI+".DIRECT.GET."+shardAttemptStream, target, req)
		}},
		{"keepalive-reply", func(t *testing.T, attacker *nats.Conn, _, target string) func(*nats.Conn, string) error {
			// The service's answer to a keepalive carries its anchor.
			req, _ := json.Marshal(keepaliveRequest{Session: sessionPrefix + "forger"})
			subj := requestSubject("keepalive", IdentityOf(attacker))
			if err := attacker.PublishRequest(subj, target, req); err != nil {
				t.Fatal(err)
			}
			if _, err := attacker.Request(subj, req, 10*time.Second); err != nil {
				t.Fatalf("witness keepalive: %v", err)
			}
			return nil
		}},
	}, replyTrickVectors...)
	for _, v := range vectors {
		t.Run(v.name, func(t *testing.T) {
			before := len(ear.forged())
			v.run(t, attacker, planted, beatSubject)
			// Whatever the attack put on the subject reached the listener
			// before the service's beats that follow it.
			ear.genuineBeats(t, 2)
			if f := ear.forged()[before:]; len(f) > 0 {
				t.Fatalf("a session would take %d forged beat(s) after a holder named the beat subject (%s): %+v", len(f), v.name, f)
			}
		})
	}
	ear.mu.Lock()
	defer ear.mu.Unlock()
	t.Logf("%d messages heard on %s, %d taken as beats, none forged", ear.all, beatSubject, len(ear.accepted))
}
