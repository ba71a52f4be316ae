package leasebus

import (
	"encoding/json"
	"hash/fnv"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// The service's beat: one message for every session, instead of a
// keepalive answered for each.
//
// A holder may write while the service has vouched for its lease within
// its Silence (800 ms), so a session used to ask every heartbeat (200 ms):
// at fleet size, thousands of requests and answers a second, each crossing
// every node of a cluster, most of them saying "nothing changed". The
// instance that vouches for every lease (the primary in its term, or an
// instance alone on the bus) now says that once, to everyone: every
// beatEvery it publishes a beat naming the buckets (beatBucket, a hash of
// the lease id) of every lease whose record changed since its last beat.
// A session whose keepalive the same instance answered, in the same term,
// with every lease active at the version asked (the keepalive's anchor:
// that instance's beat number and clock when it read them), counts each
// later beat that names none of its leases' buckets, and follows the
// anchor's beat with no gap, as the service's word that those leases are
// unchanged as of that beat. A beat naming a bucket of its own takes those
// leases off the anchor (no later beat vouches for them; the session asks
// at its next heartbeat, which anchors them again); a beat missed, or one
// naming everything, drops the anchor and sends a keepalive at once;
// another epoch's beats (instance or term) say nothing either way. Beats
// stopping leave the holders' silence to run, as unanswered keepalives
// did. A session still sends a keepalive every keepEvery(grace), at most
// every maxKeepaliveEvery: the service learns from those that its process
// lives (liveness.go), not from beats.
//
// Why a beat vouches. Its instance marks a lease's bucket after the
// change is in its views and before it answers anyone about it
// (indexLeases), and reads its beat number before reading the views for a
// keepalive (anchor). So a change marked before the anchor's number was
// in the views the keepalive read, and one marked after is named by a
// later beat. A change in the views but not yet marked when a beat is cut
// is one nobody was told of yet: the holder counting that beat heard at
// its time stops writing no later than if it had asked then.
//
// Clocks. A holder counts a keepalive's answer heard as of when it sent
// the keepalive, on its own clock, since the service answered later. For
// a beat it has no send time of its own: it takes the anchor's (the
// service read its clock after that) plus how far the service's clock ran
// from the anchor to the beat, less a beatDrift-th of it. Anchors older
// than maxAnchorAge are not used, so the drift allowed stays a few
// milliseconds; a beat whose clock ran further from the anchor than the
// holder's (a clock with no monotonic reading, stepped) is not used at
// all.
//
// Who may beat. Beats are published on beatSubject, under the change
// subjects only the service may publish on, with the instance's
// writerHeader. The server's own answers can be aimed there (the reply
// trick, accounts.go), but none carries that header without JetStream's
// own (a direct get of a stored message with no headers, no_hdr, would
// carry an arbitrary payload with none), and none decodes as a beat
// (decodeBeat wants its one field and nothing else; a keepalive's answer
// names its anchor "anchor").

const (
	// beatSubject carries the service's beats (core NATS).
	beatSubject = changedPrefix + ".beat"
	// beatEvery is how often the vouching instance beats: a holder's
	// default heartbeat, so a beat vouches as recently as a keepalive did.
	beatEvery = 200 * time.Millisecond
	// maxBeatBuckets bounds the buckets one beat names; past it, the beat
	// says All (every session asks) rather than growing.
	maxBeatBuckets = 1024
	// beatDrift is how fast, at most, the service's clock may run against
	// a holder's: one part in beatDrift. (NTP keeps clocks within a
	// hundred parts per million; this allows a thousand.)
	beatDrift = 1000
	// maxAnchorAge is how long a session trusts beats on one anchor before
	// it asks again (its keepalives come every maxKeepaliveEvery anyway).
	maxAnchorAge = 2 * maxKeepaliveEvery
	// beatRecent is how many beats a session remembers, to catch up an
	// anchor whose answer arrived after a beat that followed it.
	beatRecent = 8
)

// beatBucket is the bucket of lease id a beat names when its record
// changes: 65,536 of them, so at a fleet's few hundred changes a second a
// beat sends few sessions to ask that have nothing to learn.
func beatBucket(leaseID string) uint16 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(leaseID))
	v := h.Sum32()
	return uint16(v ^ v>>16)
}

// beatAnchor is what a keepalive's answer says of the beats that follow
// it: the epoch (the instance and its term) whose beats vouch for the
// leases it answered, the number of the last beat cut before the answer
// read them, and the instance's clock then (nanoseconds on its beat
// clock); and how often the session should send a keepalive while beats
// vouch, so the service hears it well within its session grace.
type beatAnchor struct {
	Epoch string         `json:"epoch"`
	Seq   uint64         `json:"seq"`
	Clock int64          `json:"clock"`
	Every lease.Duration `json:"every"`
}

// keepEvery is how often a session whose leases beats vouch for sends a
// keepalive: five times a grace, and at most every maxKeepaliveEvery.
func keepEvery(grace time.Duration) time.Duration {
	return min(maxKeepaliveEvery, grace/5)
}

// beat is one beat: its epoch and number, the instance's clock when it was
// cut, and the buckets of the leases that changed since the last one (or
// All of them).
type beat struct {
	Epoch   string   `json:"epoch"`
	Seq     uint64   `json:"seq"`
	Clock   int64    `json:"clock"`
	Buckets []uint16 `json:"buckets,omitempty"`
	All     bool     `json:"all,omitempty"`
}

// beatMsg is a beat on the wire.
type beatMsg struct {
	Beat *beat `json:"beat"`
}

// isBeat reports whether m came from the service as a beat, by its
// headers: its writer's, and none of JetStream's (serviceWrote).
func isBeat(m *nats.Msg) bool { return fromService(m) && serviceWrote(m.Header) }

// decodeBeat reads a beat as json.Marshal writes it, or reports that data
// is not one: an object with the one field "beat", holding an epoch (an
// instance's id and term: letters, digits and dots), a number and a clock,
// and no field a beat does not have. Every session of the fleet reads five
// a second: no reflection.
func decodeBeat(data []byte) (*beat, bool) {
	b := new(beat)
	var has uint32
	ok := fastDecode(data, func(d *fastDec, key []byte) (uint32, bool) {
		return 1, string(key) == "beat" && d.object(func(d *fastDec, key []byte) (uint32, bool) {
			switch string(key) {
			case "epoch":
				has |= 1
				return 1, d.str(&b.Epoch) && validEpoch(b.Epoch)
			case "seq":
				has |= 2
				return 2, d.uint(&b.Seq)
			case "clock":
				has |= 4
				var c uint64
				ok := d.uint(&c) && c <= math.MaxInt64
				b.Clock = int64(c)
				return 4, ok
			case "buckets":
				return 8, fastArray(d, &b.Buckets, func(d *fastDec, k *uint16) bool {
					var v uint64
					ok := d.uint(&v) && v <= math.MaxUint16
					*k = uint16(v)
					return ok
				})
			case "all":
				return 16, d.boolean(&b.All)
			}
			return 0, false
		})
	})
	if !ok || has != 7 || b.Seq == 0 {
		return nil, false
	}
	return b, true
}

// validEpoch reports whether e is an epoch as beatEpoch makes them.
func validEpoch(e string) bool {
	if e == "" || len(e) > 64 {
		return false
	}
	for _, c := range []byte(e) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && c != '.' {
			return false
		}
	}
	return true
}

// beater is the service's side: the buckets changed since the last beat,
// and the epoch its beats and anchors are numbered in.
type beater struct {
	base  time.Time     // the beat clock's zero (its monotonic reading counts)
	every time.Duration // the keepalive interval anchors ask for (keepEvery)

	mu      sync.Mutex
	epoch   string              // the epoch numbered now ("": none yet); guarded by mu
	term    uint64              // epoch's term: an older one never comes back; guarded by mu
	seq     uint64              // the last beat cut in epoch; guarded by mu
	changed map[uint16]struct{} // marked since; guarded by mu
	all     bool                // more than maxBeatBuckets marked since; guarded by mu
}

func newBeater(now time.Time, grace time.Duration) *beater {
	return &beater{base: now, every: keepEvery(grace), changed: map[uint16]struct{}{}}
}

// clock is now on the beat clock.
func (b *beater) clock(now time.Time) int64 { return int64(now.Sub(b.base)) }

// mark notes that lease id's record changed: the next beat names its
// bucket. Called once the change is in the views, before anyone is told.
func (b *beater) mark(id string) {
	k := beatBucket(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.all {
		return
	}
	b.changed[k] = struct{}{}
	if len(b.changed) > maxBeatBuckets {
		b.all = true
		clear(b.changed)
	}
}

// enterLocked makes epoch (of term) the one numbered, starting its beats
// afresh, unless it is already; it reports false for an epoch of an older
// term than the current one's (a deposed term's word is never mixed into
// a newer chain). b.mu is held.
func (b *beater) enterLocked(epoch string, term uint64) bool {
	switch {
	case epoch == b.epoch:
		return true
	case b.epoch != "" && term < b.term:
		return false
	}
	// What was marked before belongs to no anchor of epoch: everything
	// marked is in the views any anchor of it reads.
	b.epoch, b.term, b.seq, b.all = epoch, term, 0, false
	clear(b.changed)
	return true
}

// anchor is a keepalive's anchor in epoch, read before the keepalive reads
// the views it answers from.
func (b *beater) anchor(epoch string, term uint64, now time.Time) (*beatAnchor, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.enterLocked(epoch, term) {
		return nil, false
	}
	return &beatAnchor{Epoch: epoch, Seq: b.seq, Clock: b.clock(now), Every: lease.Duration(b.every)}, true
}

// cut takes the next beat of epoch.
func (b *beater) cut(epoch string, term uint64, now time.Time) (beat, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.enterLocked(epoch, term) {
		return beat{}, false
	}
	b.seq++
	bt := beat{Epoch: epoch, Seq: b.seq, Clock: b.clock(now), All: b.all}
	if !b.all && len(b.changed) > 0 {
		bt.Buckets = make([]uint16, 0, len(b.changed))
		for k := range b.changed {
			bt.Buckets = append(bt.Buckets, k)
		}
		slices.Sort(bt.Buckets)
	}
	b.all = false
	clear(b.changed)
	return bt, true
}

// beatEpoch is the epoch this instance vouches in at v, if it vouches for
// every lease: alone on the bus, or the primary in its term.
func (s *Service) beatEpoch(v vantage) (epoch string, term uint64, ok bool) {
	switch {
	case v.sole:
		return s.store.writer, 0, true
	case s.prim != nil && v.inTerm:
		return s.store.writer + "." + strconv.FormatUint(v.term, 10), v.term, true
	}
	return "", 0, false
}

// beatAnchor is the anchor for a keepalive answered now, nil when this
// instance does not beat.
func (s *Service) beatAnchor(v vantage) *beatAnchor {
	epoch, term, ok := s.beatEpoch(v)
	if !ok {
		return nil
	}
	a, _ := s.beats.anchor(epoch, term, v.now)
	return a
}

// sendBeat cuts and publishes a beat, when this instance vouches.
func (s *Service) sendBeat() {
	v := s.viewing()
	epoch, term, ok := s.beatEpoch(v)
	if !ok {
		return
	}
	bt, ok := s.beats.cut(epoch, term, v.now)
	if !ok {
		return
	}
	data, err := json.Marshal(beatMsg{Beat: &bt})
	if err != nil {
		return
	}
	m := nats.NewMsg(beatSubject)
	m.Header.Set(writerHeader, s.store.writer)
	m.Data = data
	_ = s.fleet.PublishMsg(m)
	if s.fleet != s.nc && s.asked.Load() {
		_ = s.nc.PublishMsg(m)
	}
	s.cfg.Metrics.beat(len(bt.Buckets), bt.All)
}
