package policy

import (
	"encoding/binary"
	"fmt"
	"iter"
	"strconv"
	"sync"

	cedar "github.com/cedar-policy/cedar-go"
	"github.com/cedar-policy/cedar-go/types"
)

// Resource is what a request acts on.
type Resource struct {
	Kind Kind   `json:"kind"`
	Name string `json:"name"` // a Path's path, a Ref's, Table's or Host's name
	Port int    `json:"port,omitempty"`
}

func (r Resource) String() string {
	if r.Kind == KindHost {
		return fmt.Sprintf("%s %s:%d", r.Kind, r.Name, r.Port)
	}
	return fmt.Sprintf("%s %q", r.Kind, r.Name)
}

// Context is a request's context (see SchemaText's RequestContext).
type Context struct {
	// Identity is the bus identity that asks for a claim, as the bus names
	// it: the lease service's word (from the request's subject), never the
	// request's, unlike the agent and task an owner declares. Set for
	// claims only ("" elsewhere).
	Identity      string `json:"identity,omitempty"`
	LeaseID       string `json:"lease_id,omitempty"`
	WorkspaceMode string `json:"workspace_mode,omitempty"`
	TTLSeconds    int64  `json:"ttl_seconds,omitempty"`
	WholeRepo     bool   `json:"whole_repo,omitempty"`
	Force         bool   `json:"force,omitempty"`
	Delete        bool   `json:"delete,omitempty"`
	Create        bool   `json:"create,omitempty"`
}

// Request is one question a fence asks: may Agent (of Task, in Repo) do
// Action on Resource?
type Request struct {
	Agent    string   `json:"agent"`
	Task     string   `json:"task"`
	Repo     string   `json:"repo"`
	Action   Action   `json:"action"`
	Resource Resource `json:"resource"`
	Context  Context  `json:"context"`
}

func (r Request) String() string {
	return fmt.Sprintf("%s on %s by agent %q (task %q)", r.Action, r.Resource, r.Agent, r.Task)
}

// appendKey appends the request as a cache key (every field that
// decides) to b: each string preceded by its length, so that no two
// requests share a key whatever bytes their fields hold.
func (r Request) appendKey(b []byte) []byte {
	for _, s := range [...]string{r.Agent, r.Task, r.Repo, string(r.Action), string(r.Resource.Kind), r.Resource.Name, r.Context.LeaseID, r.Context.WorkspaceMode, r.Context.Identity} {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	b = binary.AppendVarint(b, int64(r.Resource.Port))
	b = binary.AppendVarint(b, r.Context.TTLSeconds)
	var flags byte
	for i, f := range [...]bool{r.Context.WholeRepo, r.Context.Force, r.Context.Delete, r.Context.Create} {
		if f {
			flags |= 1 << i
		}
	}
	return append(b, flags)
}

// Verdict names the rule that refuses a request and the policy it is in.
type Verdict struct {
	Rule    string `json:"rule"`    // the rule's @id (else "line N")
	Policy  string `json:"policy"`  // DefaultScope or the repository
	Version uint64 `json:"version"` // the policy's version
	Error   string `json:"error,omitempty"`
}

func (v Verdict) String() string {
	s := fmt.Sprintf("policy rule %q (%s policy, version %d)", v.Rule, v.Policy, v.Version)
	if v.Error != "" {
		s += ": the rule failed to evaluate, which refuses: " + v.Error
	}
	return s
}

// Decision is a policy's answer to a Request.
type Decision struct {
	// Refused is the enforced rule that refuses the request; nil: allowed.
	Refused *Verdict `json:"refused,omitempty"`
	// Shadow is the rule of a shadow policy that would refuse a request
	// the enforced policy allows (audit it as EventShadowRefused; refuse
	// nothing).
	Shadow *Verdict `json:"shadow,omitempty"`
}

// Allowed reports whether the enforced policy allows the request.
func (d Decision) Allowed() bool { return d.Refused == nil }

// entities is the two entities a request names: a cedar.EntityGetter
// without a map. Decisions take one from entitiesPool and return it
// (release).
type entities struct {
	principal, resource types.Entity
	// attrs is the scratch map types.NewRecord copies a resource's
	// attributes from (by kind): a decision fills it rather than build a
	// map of its own.
	attrs map[Kind]types.RecordMap
}

// resourceRecord is the attribute record of r.
func (e *entities) resourceRecord(r Resource) types.Record {
	m := e.attrs[r.Kind]
	if m == nil {
		m = types.RecordMap{}
		e.attrs[r.Kind] = m
	}
	switch r.Kind {
	case KindPath:
		m["path"] = types.String(r.Name)
	case KindHost:
		m["name"], m["port"] = types.String(r.Name), types.Long(r.Port)
	default:
		m["name"] = types.String(r.Name)
	}
	rec := types.NewRecord(m) // a copy
	for k := range m {
		m[k] = types.String("") // hold no request's values
	}
	return rec
}

func (e *entities) release() {
	e.principal, e.resource = types.Entity{}, types.Entity{}
	entitiesPool.Put(e)
}

func (e *entities) Get(uid types.EntityUID) (types.Entity, bool) {
	switch uid {
	case e.principal.UID:
		return e.principal, true
	case e.resource.UID:
		return e.resource, true
	}
	return types.Entity{}, false
}

var entitiesPool = sync.Pool{New: func() any { return &entities{attrs: map[Kind]types.RecordMap{}} }}

var (
	agentType = types.EntityType(Namespace + "::Agent")
	actionTyp = types.EntityType(Namespace + "::Action")
)

// kindType is k's entity type (built without a concatenation for the
// schema's kinds).
func kindType(k Kind) types.EntityType {
	switch k {
	case KindPath:
		return Namespace + "::" + types.EntityType(KindPath)
	case KindRef:
		return Namespace + "::" + types.EntityType(KindRef)
	case KindTable:
		return Namespace + "::" + types.EntityType(KindTable)
	case KindHost:
		return Namespace + "::" + types.EntityType(KindHost)
	}
	return types.EntityType(Namespace + "::" + string(k))
}

// recordCacheMax bounds the principals and contexts a recordCache keeps.
const recordCacheMax = 4096

// recordCache keeps the records requests repeat — a principal's
// attributes, a lease's context — so a decision builds (sorts, hashes)
// only its resource's. Safe for concurrent use.
type recordCache struct {
	mu sync.Mutex
	m  map[string]types.Record // guarded by mu
}

// get returns the record of key, built by build the first time.
func (c *recordCache) get(key []byte, build func() types.Record) types.Record {
	c.mu.Lock()
	rec, ok := c.m[string(key)] // no allocation: the conversion is only looked up
	c.mu.Unlock()
	if ok {
		return rec
	}
	rec = build()
	c.mu.Lock()
	if c.m == nil || len(c.m) >= recordCacheMax {
		c.m = map[string]types.Record{} // start again: old leases' contexts go
	}
	c.m[string(key)] = rec
	c.mu.Unlock()
	return rec
}

var principals, contexts recordCache

// appendStrings appends each of ss preceded by its length (a key no two
// lists share).
func appendStrings(b []byte, ss ...string) []byte {
	for _, s := range ss {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return b
}

// cedarRequest is r as Cedar's request and entities; the caller releases
// ents when Cedar is done with them.
func cedarRequest(r Request) (req cedar.Request, ents *entities) {
	principal := types.NewEntityUID(agentType, types.String(r.Agent))
	resource := types.NewEntityUID(kindType(r.Resource.Kind), types.String(r.Resource.Name))
	var buf [128]byte
	pattrs := principals.get(appendStrings(buf[:0], r.Task, r.Repo), func() types.Record {
		return types.NewRecord(types.RecordMap{"task": types.String(r.Task), "repo": types.String(r.Repo)})
	})
	ents = entitiesPool.Get().(*entities)
	ents.principal = types.Entity{UID: principal, Attributes: pattrs}
	ents.resource = types.Entity{UID: resource, Attributes: ents.resourceRecord(r.Resource)}
	c := r.Context
	ckey := appendStrings(buf[:0], r.Repo, c.LeaseID, c.WorkspaceMode, c.Identity)
	ckey = binary.AppendVarint(ckey, c.TTLSeconds)
	for _, f := range [...]bool{c.WholeRepo, c.Force, c.Delete, c.Create} {
		if f {
			ckey = append(ckey, 1)
		} else {
			ckey = append(ckey, 0)
		}
	}
	ctx := contexts.get(ckey, func() types.Record {
		return types.NewRecord(types.RecordMap{
			"repo":           types.String(r.Repo),
			"identity":       types.String(c.Identity),
			"lease_id":       types.String(c.LeaseID),
			"workspace_mode": types.String(c.WorkspaceMode),
			"ttl_seconds":    types.Long(c.TTLSeconds),
			"whole_repo":     types.Boolean(c.WholeRepo),
			"force":          types.Boolean(c.Force),
			"delete":         types.Boolean(c.Delete),
			"create":         types.Boolean(c.Create),
		})
	})
	return cedar.Request{
		Principal: principal,
		Action:    types.NewEntityUID(actionTyp, types.String(r.Action)),
		Resource:  resource,
		Context:   ctx,
	}, ents
}

// ruleset is the rules of one or two policies — the default's, then the
// repository's — as one Cedar PolicyIterator, so that a decision asks
// Cedar once per mode rather than once per policy. Rule i's PolicyID is
// its index, so the lowest id that refuses is the first refusing rule of
// the first policy (the order separate evaluations would give).
type ruleset struct {
	rules []*cedar.Policy
	ids   []cedar.PolicyID
	from  []*Verdict                               // rule i's verdict, built once per policy version
	all   iter.Seq2[cedar.PolicyID, *cedar.Policy] // built once: All allocates nothing
}

// newRuleset joins the rules of ls, in order.
func newRuleset(ls ...layer) *ruleset {
	rs := &ruleset{}
	for _, l := range ls {
		for _, r := range l.pol.Rules {
			rs.ids = append(rs.ids, cedar.PolicyID(strconv.Itoa(len(rs.rules))))
			rs.rules = append(rs.rules, r.policy)
			rs.from = append(rs.from, &Verdict{Rule: r.ID, Policy: l.doc.Scope(), Version: l.doc.Version})
		}
	}
	rs.all = func(yield func(cedar.PolicyID, *cedar.Policy) bool) {
		for i, p := range rs.rules {
			if !yield(rs.ids[i], p) {
				return
			}
		}
	}
	return rs
}

// All yields the rules in order (a cedar.PolicyIterator).
func (rs *ruleset) All() iter.Seq2[cedar.PolicyID, *cedar.Policy] { return rs.all }

// judge evaluates rs: the first rule (in the texts' order) that matches,
// or that fails to evaluate, refuses. nil: allowed.
func (rs *ruleset) judge(req cedar.Request, ents *entities) *Verdict {
	if rs == nil || len(rs.rules) == 0 {
		return nil
	}
	_, diag := cedar.Authorize(rs, ents, req)
	first, errMsg := -1, ""
	for _, r := range diag.Reasons {
		if i, err := strconv.Atoi(string(r.PolicyID)); err == nil && (first < 0 || i < first) {
			first, errMsg = i, ""
		}
	}
	for _, e := range diag.Errors {
		if i, err := strconv.Atoi(string(e.PolicyID)); err == nil && (first < 0 || i < first) {
			first, errMsg = i, e.Message
		}
	}
	switch {
	case first < 0:
		return nil
	case first >= len(rs.from): // not an id of ours: refuse all the same
		return &Verdict{Rule: strconv.Itoa(first), Error: errMsg}
	case errMsg == "":
		return rs.from[first]
	}
	v := *rs.from[first]
	v.Error = errMsg
	return &v
}
