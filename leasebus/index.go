package leasebus

import (
	"strings"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// claimIndex finds the active leases that could conflict with a claim
// without scanning them all, so an acquire costs the same with 10 or 1,000
// leases in the repo. Two path claims can only overlap if they share their
// first path component; whole-repo claims overlap every path claim; table
// claims and workspace occupancy are indexed on their own.
type claimIndex struct {
	byTop      map[string]map[string]*entry // first path component -> leases with a path under it
	wholeRepo  map[string]*entry
	withTables map[string]*entry
	withPaths  map[string]*entry            // every lease with a path claim (for whole-repo requests)
	exclusive  map[string]map[string]*entry // workspace -> its exclusive lease
	shared     map[string]map[string]*entry // workspace -> its shared leases
	inside     map[string]map[string]*entry // workspace -> the leases of workspaces inside it
}

func newClaimIndex() *claimIndex {
	return &claimIndex{byTop: map[string]map[string]*entry{}, wholeRepo: map[string]*entry{},
		withTables: map[string]*entry{}, withPaths: map[string]*entry{},
		exclusive: map[string]map[string]*entry{}, shared: map[string]map[string]*entry{},
		inside: map[string]map[string]*entry{}}
}

func topOf(p string) string {
	top, _, _ := strings.Cut(p, "/")
	return top
}

func addTo(m map[string]map[string]*entry, k string, e *entry) {
	set := m[k]
	if set == nil {
		set = map[string]*entry{}
		m[k] = set
	}
	set[e.LeaseID] = e
}

func removeFrom(m map[string]map[string]*entry, k, id string) {
	if set := m[k]; set != nil {
		delete(set, id)
		if len(set) == 0 {
			delete(m, k)
		}
	}
}

func (ix *claimIndex) add(e *entry) {
	for _, p := range e.Scope.Paths {
		addTo(ix.byTop, topOf(p), e)
	}
	if len(e.Scope.Paths) > 0 {
		ix.withPaths[e.LeaseID] = e
	}
	if e.Scope.Kind == scope.KindWholeRepo {
		ix.wholeRepo[e.LeaseID] = e
	}
	if len(e.Scope.Tables) > 0 {
		ix.withTables[e.LeaseID] = e
	}
	addTo(ix.occupants(e.WorkspaceMode), e.WorkspaceID, e)
	ancestors(e.WorkspaceID, func(a string) { addTo(ix.inside, a, e) })
}

func (ix *claimIndex) occupants(mode lease.WorkspaceMode) map[string]map[string]*entry {
	if mode == lease.WorkspaceExclusive {
		return ix.exclusive
	}
	return ix.shared
}

func (ix *claimIndex) remove(e *entry) {
	for _, p := range e.Scope.Paths {
		removeFrom(ix.byTop, topOf(p), e.LeaseID)
	}
	delete(ix.withPaths, e.LeaseID)
	delete(ix.wholeRepo, e.LeaseID)
	delete(ix.withTables, e.LeaseID)
	removeFrom(ix.occupants(e.WorkspaceMode), e.WorkspaceID, e.LeaseID)
	ancestors(e.WorkspaceID, func(a string) { removeFrom(ix.inside, a, e.LeaseID) })
}

// candidates calls f once for each indexed lease that could block req:
// every lease whose claim could overlap, the exclusive occupant of its
// workspace or of one it lies in, and — for an exclusive request, which
// needs the workspace empty — its shared occupants and the leases of the
// workspaces inside it. (Shared occupants only count against
// max-sharers; see sharers.)
func (ix *claimIndex) candidates(req claimRequest, f func(*entry)) {
	seen := map[string]bool{}
	visit := func(set map[string]*entry) {
		for id, e := range set {
			if !seen[id] {
				seen[id] = true
				f(e)
			}
		}
	}
	switch req.scope.Kind {
	case scope.KindWholeRepo:
		visit(ix.withPaths)
		visit(ix.wholeRepo)
	case scope.KindPaths:
		for _, p := range req.scope.Paths {
			visit(ix.byTop[topOf(p)])
		}
		visit(ix.wholeRepo)
	}
	if len(req.scope.Tables) > 0 {
		visit(ix.withTables)
	}
	visit(ix.exclusive[req.workspaceID])
	ancestors(req.workspaceID, func(a string) { visit(ix.exclusive[a]) })
	if req.mode == lease.WorkspaceExclusive {
		visit(ix.shared[req.workspaceID])
		visit(ix.inside[req.workspaceID])
	}
}
