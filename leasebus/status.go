package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// Status: what each lease service instance knows of the election and of
// the streams a lease request waits on. Every instance answers a status
// request (it is not a queue group's: the asker hears all of them that its
// server reaches), so an operator whose revoke is late learns why from the
// side of the cluster it is on — the primary's claim unrenewed since its
// node was cut off, a standby about to take over, the lease log without a
// leader — instead of guessing from a silence (`fenceline bus status`,
// and `lease revoke` after revokePatience).

const opStatus = "status"

// statusStreams are the streams whose leaders a status reports: the lease
// log every lease request appends to, the claim the election writes, and
// the audit a revoke lands in.
var statusStreams = []string{LogStream, PrimaryStream, AuditStream}

// statusStreamWait bounds each stream's info request in a status answer:
// a stream without a leader answers none.
const statusStreamWait = 500 * time.Millisecond

// Status is one instance's answer to a status request.
type Status struct {
	// Instance is the answering instance's writer stamp; Server the NATS
	// server its connection is on.
	Instance string `json:"instance"`
	Server   string `json:"server,omitempty"`
	// Elected: the instance runs in an election with others (a cluster);
	// alone on a bus it serves every request itself.
	Elected bool `json:"elected"`
	// Serving: it is the primary, in its term.
	Serving bool `json:"serving,omitempty"`
	// Lapsed: it holds a term whose renewals went unanswered past its end.
	Lapsed bool `json:"lapsed,omitempty"`
	// Primary is the writer of the claim it last read ("" when free or
	// unread); ClaimFree that the claim was released.
	Primary   string `json:"primary,omitempty"`
	ClaimFree bool   `json:"claimFree,omitempty"`
	// Unrenewed is how long it has seen the same claim record, on its own
	// clock (a primary renews every quarter term); ClaimRead how long ago
	// it last read the claim, and ClaimErr why its last read failed.
	Unrenewed lease.Duration `json:"unrenewed,omitempty"`
	ClaimRead lease.Duration `json:"claimRead,omitempty"`
	ClaimErr  string         `json:"claimErr,omitempty"`
	// Term is the claim's term; a standby takes over a claim unrenewed
	// for Term plus TakeoverGap.
	Term        lease.Duration `json:"term,omitempty"`
	TakeoverGap lease.Duration `json:"takeoverGap,omitempty"`
	// Streams are the streams a lease request waits on, as the cluster
	// reported them to this instance.
	Streams []StreamStatus `json:"streams"`
}

// StreamStatus is one stream's leadership as an instance read it.
type StreamStatus struct {
	Name     string          `json:"name"`
	Leader   string          `json:"leader,omitempty"`
	Replicas []ReplicaStatus `json:"replicas,omitempty"`
	// Err: its info went unanswered (no leader to answer it) or failed.
	Err string `json:"err,omitempty"`
}

// ReplicaStatus is one follower of a stream, as its leader sees it.
type ReplicaStatus struct {
	Server  string         `json:"server"`
	Current bool           `json:"current"`
	Offline bool           `json:"offline,omitempty"`
	Active  lease.Duration `json:"active"` // since the leader last heard it
	Lag     uint64         `json:"lag,omitempty"`
}

// status is this instance's answer.
func (s *Service) status(ctx context.Context) Status {
	st := Status{Instance: s.store.writer, Server: s.nc.ConnectedServerName(), Elected: s.prim != nil, Serving: true}
	if p := s.prim; p != nil {
		now := s.cfg.Now()
		p.mu.Lock()
		st.Serving = !p.until.IsZero() && now.Before(p.until)
		st.Lapsed = !p.until.IsZero() && !st.Serving
		st.Primary, st.ClaimFree = p.leader, p.free
		if !p.seenAt.IsZero() {
			st.Unrenewed = lease.Duration(now.Sub(p.seenAt))
		}
		if !p.readAt.IsZero() {
			st.ClaimRead = lease.Duration(now.Sub(p.readAt))
		}
		if p.readErr != nil {
			st.ClaimErr = p.readErr.Error()
		}
		st.Term, st.TakeoverGap = lease.Duration(p.term), lease.Duration(primaryGap)
		p.mu.Unlock()
		if st.Serving {
			st.Primary, st.Unrenewed = s.store.writer, 0 // its own renewals are acknowledged
		}
	}
	st.Streams = s.statusCache.streams(ctx, s)
	return st
}

// statusCache keeps the streams' status an instance last asked the
// cluster for, for statusFresh: a flood of status requests costs
// JetStream three info requests per instance per statusFresh, not per
// request.
type statusCache struct {
	mu   sync.Mutex
	at   time.Time
	last []StreamStatus
}

// statusFresh is how long a status answer reuses the streams' status.
const statusFresh = 250 * time.Millisecond

func (c *statusCache) streams(ctx context.Context, s *Service) []StreamStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last != nil && time.Since(c.at) < statusFresh {
		return slices.Clone(c.last)
	}
	out := make([]StreamStatus, len(statusStreams))
	var wg sync.WaitGroup
	for i, name := range statusStreams {
		wg.Go(func() { out[i] = s.streamStatus(ctx, name) })
	}
	wg.Wait()
	c.last, c.at = out, time.Now()
	return slices.Clone(out)
}

// streamStatus asks the cluster who leads stream name.
func (s *Service) streamStatus(ctx context.Context, name string) StreamStatus {
	out := StreamStatus{Name: name}
	ctx, cancel := context.WithTimeout(ctx, statusStreamWait)
	defer cancel()
	str, err := s.js.Stream(ctx, name)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
			out.Err = fmt.Sprintf("no answer within %s", statusStreamWait)
		} else {
			out.Err = err.Error()
		}
		return out
	}
	ci := str.CachedInfo().Cluster
	if ci == nil {
		return out // a single server: it leads every stream
	}
	out.Leader = ci.Leader
	for _, r := range ci.Replicas {
		out.Replicas = append(out.Replicas, ReplicaStatus{Server: r.Name, Current: r.Current, Offline: r.Offline, Active: lease.Duration(r.Active), Lag: r.Lag})
	}
	return out
}

// Status asks every lease service instance its server reaches for its
// status and returns the answers that arrive within wait, by instance.
// None is an error saying so.
func (c *Client) Status(ctx context.Context, wait time.Duration) ([]Status, error) {
	subj := requestSubject(opStatus, c.identity)
	inbox := c.nc.NewInbox()
	sub, err := c.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	defer sub.Unsubscribe()
	nonce := randomToken()
	msg := &nats.Msg{Subject: subj, Reply: inbox, Header: nats.Header{nonceHeader: []string{nonce}}}
	if err := c.nc.PublishMsg(msg); err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	var out []Status
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			break
		}
		if m.Header.Get(nonceHeader) != nonce {
			continue
		}
		var r reply
		if json.Unmarshal(m.Data, &r) != nil || r.Status == nil {
			continue
		}
		out = append(out, *r.Status)
	}
	if len(out) == 0 {
		if ferr := c.forbidden(opStatus, subj); ferr != nil {
			return nil, ferr
		}
		return nil, fmt.Errorf("%w: no lease service instance answered a status request within %s (none runs, or none is reachable from server %s)%w",
			lease.ErrUnavailable, wait, c.nc.ConnectedServerName(), errNoService)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Instance, b.Instance) })
	return out, nil
}

// Explain says, from the instances' answers, what a lease request waits
// for right now: which instance serves, or why none does and when one
// will, and whether the lease log can take a write. An empty answer list
// says nobody answered.
func Explain(sts []Status) string {
	if len(sts) == 0 {
		return "no lease service instance answers: none runs, or every one is cut off from this server"
	}
	var why []string
	var serving *Status
	for i := range sts {
		if sts[i].Serving {
			serving = &sts[i]
			break
		}
	}
	switch {
	case serving != nil && !serving.Elected:
		why = append(why, fmt.Sprintf("instance %s serves alone (on server %s)", serving.Instance, serving.Server))
	case serving != nil:
		why = append(why, fmt.Sprintf("instance %s is the primary and serves (on server %s)", serving.Instance, serving.Server))
	default:
		why = append(why, noPrimary(sts))
	}
	// The lease log, as the best-informed answer saw it: one that
	// reached its leader, else the first.
	log := streamOf(sts, LogStream)
	switch {
	case log == nil:
	case log.Err != "":
		why = append(why, fmt.Sprintf("the lease log (%s) answers no info request (%s): it has no leader, most likely — its node was lost and the others elect one (NATS takes 4-9 s), or too few of its servers are up for a majority", LogStream, log.Err))
	case log.Leader != "":
		var behind []string
		for _, r := range log.Replicas {
			if !r.Current || r.Offline {
				behind = append(behind, fmt.Sprintf("%s (last heard %s ago)", r.Server, time.Duration(r.Active).Round(time.Millisecond)))
			}
		}
		s := fmt.Sprintf("the lease log (%s) is led by %s", LogStream, log.Leader)
		if len(behind) > 0 {
			s += ", which does not hear " + strings.Join(behind, ", ")
		}
		why = append(why, s)
	}
	var silent []string
	for _, st := range sts {
		if st.Primary != "" && !slices.ContainsFunc(sts, func(o Status) bool { return o.Instance == st.Primary }) && !slices.Contains(silent, st.Primary) {
			silent = append(silent, st.Primary)
		}
	}
	if len(silent) > 0 {
		why = append(why, fmt.Sprintf("instance %s did not answer from here (its server cut off, paused or down?)", strings.Join(silent, ", ")))
	}
	return strings.Join(why, "; ")
}

// noPrimary says why no answering instance serves, from the standbys'
// views of the claim.
func noPrimary(sts []Status) string {
	for _, st := range sts {
		if st.Lapsed {
			return fmt.Sprintf("instance %s was the primary but its term ran out: its claim's renewals go unanswered (the claim's stream electing a leader?); it takes the claim back once one is acknowledged", st.Instance)
		}
	}
	// The standby that read the claim last knows best.
	best := sts[0]
	for _, st := range sts[1:] {
		if st.ClaimErr == "" && (best.ClaimErr != "" || st.ClaimRead < best.ClaimRead) {
			best = st
		}
	}
	switch {
	case !best.Elected:
		return fmt.Sprintf("instance %s does not serve", best.Instance)
	case best.ClaimErr != "":
		return fmt.Sprintf("no instance serves and the primary's claim cannot be read (%s): its stream has no leader, most likely; an election follows once it can be read", best.ClaimErr)
	case best.ClaimFree || best.Primary == "":
		return "no instance serves: the claim is free and an instance takes it within a second"
	}
	takeover := time.Duration(best.Term + best.TakeoverGap)
	left := takeover - time.Duration(best.Unrenewed)
	if left > 0 {
		return fmt.Sprintf("no instance serves here: the primary %s has not renewed its claim for %s (it renews every %s: it, or its server, is cut off, paused or down); standby %s takes over once the claim is %s old, in about %s",
			best.Primary, time.Duration(best.Unrenewed).Round(time.Millisecond), time.Duration(best.Term)/4, best.Instance, takeover, left.Round(100*time.Millisecond))
	}
	return fmt.Sprintf("no instance serves here: the primary %s has not renewed its claim for %s, past its term; standby %s is taking over (it writes the claim, then reads each repo's log)",
		best.Primary, time.Duration(best.Unrenewed).Round(time.Millisecond), best.Instance)
}

// streamOf is stream name as the answers saw it: one that reached its
// leader if any did.
func streamOf(sts []Status, name string) *StreamStatus {
	var first *StreamStatus
	for i := range sts {
		for j := range sts[i].Streams {
			ss := &sts[i].Streams[j]
			if ss.Name != name {
				continue
			}
			if ss.Err == "" {
				return ss
			}
			if first == nil {
				first = ss
			}
		}
	}
	return first
}
