package policy

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Mode says whether a policy is enforced or only shadowed.
type Mode string

const (
	// ModeEnforce: the policy refuses what it forbids.
	ModeEnforce Mode = "enforce"
	// ModeShadow: the policy is evaluated beside the enforced one and
	// what it would refuse is audited (shadow-refused); it refuses
	// nothing.
	ModeShadow Mode = "shadow"
)

// DefaultScope is what decisions call the default policy (the one every
// repository follows besides its own).
const DefaultScope = "default"

// Document is one stored policy: the default's or a repository's, in one
// mode, at one version. The lease bus stores it; a Store compiles it.
type Document struct {
	Repo    string    `json:"repo"` // "" for the default policy
	Mode    Mode      `json:"mode"`
	Version uint64    `json:"version"` // 1 for the first, +1 for each change
	Text    string    `json:"text"`    // the Cedar text ("" removes the policy)
	Digest  string    `json:"digest"`  // Digest(Text)
	SetBy   string    `json:"setBy"`   // the operator identity that set it
	SetAt   time.Time `json:"setAt"`
}

// Scope is what decisions call the document's policy: the repository, or
// DefaultScope.
func (d Document) Scope() string {
	if d.Repo == "" {
		return DefaultScope
	}
	return d.Repo
}

// Check parses and validates d's text (see Parse) and checks its mode and
// digest.
func (d Document) Check() (*Policy, error) {
	if d.Mode != ModeEnforce && d.Mode != ModeShadow {
		return nil, fmt.Errorf("%w: mode %q (want %s or %s)", ErrInvalid, d.Mode, ModeEnforce, ModeShadow)
	}
	if d.Digest != "" && d.Digest != Digest(d.Text) {
		return nil, fmt.Errorf("%w: %s policy version %d: its digest %s is not its text's", ErrInvalid, d.Scope(), d.Version, d.Digest)
	}
	return Parse(d.Scope()+".cedar", d.Text)
}

type docKey struct {
	repo string
	mode Mode
}

type layer struct {
	doc Document
	pol *Policy
}

// snapshot is one generation of a Store: immutable.
type snapshot struct {
	docs map[docKey]layer
	// sets are the rules each repository's decisions evaluate, by repo;
	// "" holds the default's (for a repository with no policy of its
	// own). Built by Put.
	sets map[string]modeSets
	// cache is the Store's; it answers this generation's lookups only.
	cache *decisionCache
	gen   uint64
}

// modeSets is what a decision evaluates: the enforced rules, then (when a
// shadow policy exists) the rules the shadow side is judged by.
type modeSets struct {
	enforced, shadow *ruleset // shadow nil: no shadow policy
}

// newSnapshot builds docs' rulesets.
func newSnapshot(docs map[docKey]layer) *snapshot {
	cur := &snapshot{docs: docs, sets: map[string]modeSets{}}
	repos := map[string]bool{"": true}
	for k, l := range docs {
		if l.pol != nil {
			repos[k.repo] = true
		}
	}
	for repo := range repos {
		if ms, ok := cur.buildSets(repo); ok {
			cur.sets[repo] = ms
		}
	}
	return cur
}

// buildSets joins the policies in force for repo as decide evaluates
// them: enforced, the default's then the repository's; shadow, each
// scope's shadow policy or, where it has none, its enforced one. ok is
// false when no policy applies to repo.
func (cur *snapshot) buildSets(repo string) (ms modeSets, ok bool) {
	def, hasDef := cur.get("", ModeEnforce)
	own, hasOwn := cur.get(repo, ModeEnforce)
	defShadow, hasDefShadow := cur.get("", ModeShadow)
	ownShadow, hasOwnShadow := cur.get(repo, ModeShadow)
	if repo == "" {
		hasOwn, hasOwnShadow = false, false
	}
	if !hasDef && !hasOwn && !hasDefShadow && !hasOwnShadow {
		return modeSets{}, false
	}
	var enforced, shadow []layer
	if hasDef {
		enforced = append(enforced, def)
	}
	if hasOwn {
		enforced = append(enforced, own)
	}
	ms.enforced = newRuleset(enforced...)
	if !hasDefShadow && !hasOwnShadow {
		return ms, true
	}
	switch {
	case hasDefShadow:
		shadow = append(shadow, defShadow)
	case hasDef:
		shadow = append(shadow, def)
	}
	switch {
	case hasOwnShadow:
		shadow = append(shadow, ownShadow)
	case hasOwn:
		shadow = append(shadow, own)
	}
	ms.shadow = newRuleset(shadow...)
	return ms, true
}

// Store holds the policies in force — the default and those of any
// number of repositories, each enforced and shadowed — and answers
// decisions from them. Put replaces one document; every decision after
// Put returns sees it. The zero Store holds no policy: every request is
// allowed, as without fenceline policies. A Store is safe for concurrent
// use.
type Store struct {
	mu      sync.Mutex // serializes Put
	current atomic.Pointer[snapshot]
	changed atomic.Pointer[chan struct{}]
	// cache is allocated by the first Put that brings a policy and kept
	// for every generation after (each starts it empty), so that a
	// policy change allocates no new one. guarded by mu (the pointer).
	cache *decisionCache
	gen   uint64 // guarded by mu
}

// Put installs d (replacing the document of its repo and mode; an empty
// text removes it). A document that does not check is refused and the
// one before stays in force.
func (s *Store) Put(d Document) error {
	var pol *Policy
	if d.Text != "" {
		var err error
		if pol, err = d.Check(); err != nil {
			return err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	docs := map[docKey]layer{}
	if cur := s.current.Load(); cur != nil {
		for k, l := range cur.docs {
			docs[k] = l
		}
	}
	k := docKey{d.Repo, d.Mode}
	if old, ok := docs[k]; ok && old.doc.Version > d.Version {
		return nil // an older version arriving late
	}
	// A removed policy stays as a tombstone (pol nil) so that an older
	// version arriving late cannot bring it back.
	docs[k] = layer{doc: d, pol: pol}
	next := newSnapshot(docs)
	if len(next.sets) > 0 {
		if s.cache == nil {
			s.cache = newDecisionCache()
		}
		s.gen++
		next.cache, next.gen = s.cache, s.gen
		s.cache.start(next.gen)
	}
	s.current.Store(next)
	s.notify()
	return nil
}

// Changed returns a channel closed at the next Put: a fence that judged
// something once (a lease's claim, an open file) judges it again.
func (s *Store) Changed() <-chan struct{} {
	for {
		if ch := s.changed.Load(); ch != nil {
			return *ch
		}
		ch := make(chan struct{})
		if s.changed.CompareAndSwap(nil, &ch) {
			return ch
		}
	}
}

func (s *Store) notify() {
	if ch := s.changed.Swap(nil); ch != nil {
		close(*ch)
	}
}

// Documents returns the documents in force for repo: the default's and
// (repo not empty) the repository's, enforced and shadowed, those that
// exist.
func (s *Store) Documents(repo string) []Document {
	cur := s.current.Load()
	if cur == nil {
		return nil
	}
	keys := []docKey{{"", ModeEnforce}, {"", ModeShadow}}
	if repo != "" {
		keys = append(keys, docKey{repo, ModeEnforce}, docKey{repo, ModeShadow})
	}
	var out []Document
	for _, k := range keys {
		if l, ok := cur.get(k.repo, k.mode); ok {
			out = append(out, l.doc)
		}
	}
	return out
}

// Copy returns what another Store needs to answer as this one does for
// repo: the documents of Documents plus the removals (Text empty) at their
// versions, so that Put of each, in any order and again after any later
// Copy, brings the other store to this one's state for repo.
func (s *Store) Copy(repo string) []Document {
	cur := s.current.Load()
	if cur == nil {
		return nil
	}
	var out []Document
	for _, r := range []string{"", repo} {
		for _, m := range []Mode{ModeEnforce, ModeShadow} {
			if l, ok := cur.docs[docKey{r, m}]; ok {
				out = append(out, l.doc)
			}
		}
		if repo == "" {
			break
		}
	}
	return out
}

// Empty reports whether the store holds no policy at all.
func (s *Store) Empty() bool {
	cur := s.current.Load()
	if cur == nil {
		return true
	}
	for _, l := range cur.docs {
		if l.pol != nil {
			return false
		}
	}
	return true
}

// Decide answers r from the policies in force for r.Repo: the default's
// and the repository's. Any enforced forbid rule that matches refuses;
// the shadow policies (each scope's shadow document, or its enforced one
// where it has none) are asked only when the enforced ones allow.
func (s *Store) Decide(r Request) Decision {
	cur := s.current.Load()
	if cur == nil || cur.cache == nil {
		return Decision{}
	}
	ms, ok := cur.sets[r.Repo]
	if !ok {
		if ms, ok = cur.sets[""]; !ok {
			return Decision{} // no policy applies to r.Repo
		}
	}
	var buf [256]byte // the key on the stack unless the request is long
	key := r.appendKey(buf[:0])
	if d, ok := cur.cache.get(cur.gen, key); ok {
		return d
	}
	d := ms.decide(r)
	cur.cache.put(cur.gen, key, d)
	return d
}

// get returns the policy in force of repo in mode, if any.
func (cur *snapshot) get(repo string, m Mode) (layer, bool) {
	l, ok := cur.docs[docKey{repo, m}]
	return l, ok && l.pol != nil
}

func (ms modeSets) decide(r Request) Decision {
	req, ents := cedarRequest(r)
	defer ents.release()
	var d Decision
	if d.Refused = ms.enforced.judge(req, ents); d.Refused == nil {
		d.Shadow = ms.shadow.judge(req, ents)
	}
	return d
}
