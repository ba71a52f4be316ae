package shard

import (
	"context"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/lease"
)

// View is one pool as an operator inspects it ("fenceline shard list"):
// the pool record, each shard with the active leases in it, the pool's
// attempts, and the repo's active leases outside the shards. Its JSON is
// what "fenceline shard list --json" prints: the pool's fields, then
// "shards", "attempts" and "otherLeases".
type View struct {
	*Pool
	// Shards are the pool's shards in order; they shadow Pool.Shards in
	// JSON under the same name.
	Shards   []ShardView `json:"shards"`
	Attempts []*Attempt  `json:"attempts"`
	// Other are the repo's active leases in no shard of the pool (the
	// checkout, or a workspace the pool does not have).
	Other []*lease.Lease `json:"otherLeases,omitempty"`
}

// ShardView is one shard of a View with its occupants: the active leases
// whose workspace is the shard or one of its own (CommitWorkspace).
// Occupants is empty, not nil, for a shard nobody is in.
type ShardView struct {
	Shard
	Occupants []*lease.Lease `json:"occupants"`
}

// WorkspaceShard is the shard a lease workspace belongs to: id for both
// id and CommitWorkspace(id); a workspace outside any pool is its own.
func WorkspaceShard(workspaceID string) string {
	id, _, _ := strings.Cut(workspaceID, "/")
	return id
}

// View gathers what an operator sees of pool p. It first recovers the
// pool's crashed attempts, scanning all of them (Recover with all), and
// then re-reads the pool so that the shards they left dirty show so (a
// failed re-read keeps p). Attempts are oldest first: with recent > 0,
// the recent most recent ones and every older one still running; with
// recent 0, all of them.
func (s *Store) View(ctx context.Context, p *Pool, leases lease.View, recent int) (*View, error) {
	if rec, err := s.Recover(ctx, p.Repo, leases, true); err != nil {
		return nil, err
	} else if len(rec) > 0 {
		if np, err := s.Pool(ctx, p.Repo); err == nil {
			p = np
		}
	}
	active, err := leases.List(ctx, p.Repo, false)
	if err != nil {
		return nil, err
	}
	atts, err := s.Attempts(ctx, p.Repo)
	if err != nil {
		return nil, err
	}
	v := &View{Pool: p, Attempts: recentAttempts(atts, recent)}
	placed := map[string]bool{}
	for _, sh := range p.Shards {
		sv := ShardView{Shard: sh, Occupants: []*lease.Lease{}}
		for _, l := range active {
			if WorkspaceShard(l.WorkspaceID) == sh.ID {
				sv.Occupants = append(sv.Occupants, l)
				placed[l.LeaseID] = true
			}
		}
		v.Shards = append(v.Shards, sv)
	}
	for _, l := range active {
		if !placed[l.LeaseID] {
			v.Other = append(v.Other, l)
		}
	}
	return v, nil
}

// recentAttempts keeps the last n of atts (oldest first) and every older
// one still running; n 0 keeps all.
func recentAttempts(atts []*Attempt, n int) []*Attempt {
	if n <= 0 || len(atts) <= n {
		return atts
	}
	cut := len(atts) - n
	keep := slices.DeleteFunc(slices.Clone(atts[:cut]), func(a *Attempt) bool { return a.Status != StatusRunning })
	return append(keep, atts[cut:]...)
}
