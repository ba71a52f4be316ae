//go:build integration

package faults

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
)

// watchFor is how long a revoked agent is left trying to write before it
// is stopped: long enough to see any write land past the bound, short
// enough that a long run does not pile agents up.
const watchFor = 3 * bound

// crew runs the agents of some lineages on one bus: the current agent of
// each lineage, and the revoked ones that go on trying to write.
type crew struct {
	t     *testing.T
	ctx   context.Context
	env   *Env
	h     *History
	lines []*lineage
	cur   []*agent
	old   []revokedAgent
	// pending are the agents revoked and not yet replaced (revoke, then
	// regrant), in the order of lines.
	pending []revokedAgent
	why     string // the pending revokes' reason
	next    int    // the number of the next agents started
	// revokes counts the revokes issued right after a fault, by fault.
	revokes map[string]int
}

type revokedAgent struct {
	a  *agent
	at time.Time
}

// newCrew starts the first agent of every lineage.
func newCrew(ctx context.Context, t *testing.T, env *Env, h *History, lines ...*lineage) *crew {
	c := &crew{t: t, ctx: ctx, env: env, h: h, lines: lines, cur: make([]*agent, len(lines)), revokes: map[string]int{}}
	for k, l := range lines {
		c.cur[k] = l.start(0)
	}
	c.next = 1
	return c
}

// waitLanded waits until every current agent's writes land at each of its
// boundaries (after since when since is not zero: then at one of them).
func (c *crew) waitLanded(since time.Time) {
	c.t.Helper()
	for k, l := range c.lines {
		a := c.cur[k]
		wctx, cancel := context.WithTimeout(c.ctx, 30*time.Second)
		err := testutil.Retry(wctx, 20*time.Millisecond, func() error {
			for _, p := range a.procs {
				if p.Exited() {
					return testutil.Permanent(fmt.Errorf("%s exited", p.Name))
				}
			}
			return l.landed(a, since)
		})
		cancel()
		if err != nil {
			var out strings.Builder
			for _, p := range a.procs {
				fmt.Fprintf(&out, "%s stdout:\n%s\n%s stderr:\n%s\n", p.Name, p.Stdout(), p.Name, p.Stderr())
			}
			c.t.Fatalf("%s agent under %s: %v\n%s", l.name, a.lease.LeaseID, err, out.String())
		}
	}
}

// revokeAll revokes every current agent's lease at once, one after the
// other (each retrying until the bus answers), records the revokes, then
// grants each claim to a new agent at once; the revoked agents go on
// trying to write.
//
// faultAt is when the fault was injected (or ended, for a pause): how long
// after it each revoke returned is logged.
func (c *crew) revokeAll(fault, why string, faultAt time.Time) {
	c.t.Helper()
	c.revoke(fault, why, faultAt)
	c.regrant()
}

// revoke is the first half of revokeAll: the revokes.
func (c *crew) revoke(fault, why string, faultAt time.Time) {
	c.t.Helper()
	c.pending, c.why = c.pending[:0], why
	for k := range c.lines {
		cur := c.cur[k]
		for _, p := range cur.procs {
			if p.Exited() {
				c.t.Fatalf("%s agent under %s exited before its revoke (%s):\nstdout:\n%s\nstderr:\n%s", c.lines[k].name, cur.lease.LeaseID, why, p.Stdout(), p.Stderr())
			}
		}
		revokeAt, endedAt, ended := revokeNow(c.ctx, c.t, c.env, c.h, cur.lease.LeaseID, "faults: "+why)
		c.h.EndedBy(cur.lease.LeaseID, ended, revokeAt, endedAt)
		c.revokes[fault]++
		c.pending = append(c.pending, revokedAgent{cur, revokeAt})
		c.t.Logf("%s: %s: revoked %s (fence %d) %s after the fault", why, c.lines[k].name, cur.lease.LeaseID, cur.lease.Fence, revokeAt.Sub(faultAt).Round(time.Millisecond))
	}
}

// regrant is the second half of revokeAll: each revoked claim to a new
// agent.
func (c *crew) regrant() {
	c.t.Helper()
	for k, l := range c.lines {
		old := c.pending[k]
		next := l.start(c.next)
		c.t.Logf("%s: %s: granted %s (fence %d) after %s, %s after its revoke returned",
			c.why, l.name, next.lease.LeaseID, next.lease.Fence, old.a.lease.LeaseID, next.lease.GrantedAt.Sub(old.at).Round(time.Millisecond))
		c.old = append(c.old, old)
		c.cur[k] = next
	}
	c.pending = nil
	c.next++
	c.reap()
}

// reap stops the revoked agents watched for watchFor.
func (c *crew) reap() {
	for len(c.old) > 0 && time.Since(c.old[0].at) > watchFor {
		stopAgent(c.t, c.old[0].a)
		c.old = c.old[1:]
	}
}

// finish waits for the current agents' writes, lets the last revoked
// agents try for watchFor, stops every agent (the current ones release
// their leases, recorded as the service says they ended) and records every
// write that landed.
func (c *crew) finish() {
	c.t.Helper()
	c.waitLanded(time.Time{})
	if len(c.old) > 0 {
		// Letting late writes happen, if any would (a fault's duration,
		// not a wait for state).
		time.Sleep(watchFor - time.Since(c.old[len(c.old)-1].at))
	}
	for _, o := range c.old {
		stopAgent(c.t, o.a)
	}
	c.old = nil
	for _, a := range c.cur {
		stopAgent(c.t, a) // it releases its lease
		recordEnd(c.ctx, c.env, c.h, a.lease.LeaseID)
	}
	for _, l := range c.lines {
		l.record(c.h)
	}
}
