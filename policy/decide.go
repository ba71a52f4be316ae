package policy

import (
	"fmt"
	"strconv"
	"strings"
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

// key is the request as a cache key (every field that decides).
func (r Request) key() string {
	var b strings.Builder
	b.Grow(64 + len(r.Agent) + len(r.Task) + len(r.Repo) + len(r.Resource.Name) + len(r.Context.LeaseID))
	for _, s := range []string{r.Agent, r.Task, r.Repo, string(r.Action), string(r.Resource.Kind), r.Resource.Name, r.Context.LeaseID, r.Context.WorkspaceMode} {
		b.WriteString(s)
		b.WriteByte(0)
	}
	b.WriteString(strconv.Itoa(r.Resource.Port))
	b.WriteByte(0)
	b.WriteString(strconv.FormatInt(r.Context.TTLSeconds, 10))
	for _, f := range []bool{r.Context.WholeRepo, r.Context.Force, r.Context.Delete, r.Context.Create} {
		if f {
			b.WriteByte('1')
		} else {
			b.WriteByte('0')
		}
	}
	return b.String()
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
// without a map.
type entities struct{ principal, resource types.Entity }

func (e *entities) Get(uid types.EntityUID) (types.Entity, bool) {
	switch uid {
	case e.principal.UID:
		return e.principal, true
	case e.resource.UID:
		return e.resource, true
	}
	return types.Entity{}, false
}

var (
	agentType = types.EntityType(Namespace + "::Agent")
	actionTyp = types.EntityType(Namespace + "::Action")
)

// recordCacheMax bounds the principals and contexts a recordCache keeps.
const recordCacheMax = 4096

// recordCache keeps the records requests repeat — a principal's
// attributes, a lease's context — so a decision builds (sorts, hashes)
// only its resource's. Safe for concurrent use.
type recordCache struct {
	mu sync.Mutex
	m  map[string]types.Record // guarded by mu
}

func (c *recordCache) get(key string, make func() types.Record) types.Record {
	c.mu.Lock()
	rec, ok := c.m[key]
	c.mu.Unlock()
	if ok {
		return rec
	}
	rec = make()
	c.mu.Lock()
	if c.m == nil || len(c.m) >= recordCacheMax {
		c.m = map[string]types.Record{} // start again: old leases' contexts go
	}
	c.m[key] = rec
	c.mu.Unlock()
	return rec
}

var principals, contexts recordCache

// cedarRequest is r as Cedar's request and entities.
func cedarRequest(r Request) (cedar.Request, *entities) {
	principal := types.NewEntityUID(agentType, types.String(r.Agent))
	resource := types.NewEntityUID(types.EntityType(Namespace+"::"+string(r.Resource.Kind)), types.String(r.Resource.Name))
	var attrs types.RecordMap
	switch r.Resource.Kind {
	case KindPath:
		attrs = types.RecordMap{"path": types.String(r.Resource.Name)}
	case KindHost:
		attrs = types.RecordMap{"name": types.String(r.Resource.Name), "port": types.Long(r.Resource.Port)}
	default:
		attrs = types.RecordMap{"name": types.String(r.Resource.Name)}
	}
	pattrs := principals.get(r.Task+"\x00"+r.Repo, func() types.Record {
		return types.NewRecord(types.RecordMap{"task": types.String(r.Task), "repo": types.String(r.Repo)})
	})
	ents := &entities{
		principal: types.Entity{UID: principal, Attributes: pattrs},
		resource:  types.Entity{UID: resource, Attributes: types.NewRecord(attrs)},
	}
	c := r.Context
	flags := [4]byte{'0', '0', '0', '0'}
	for i, f := range []bool{c.WholeRepo, c.Force, c.Delete, c.Create} {
		if f {
			flags[i] = '1'
		}
	}
	ckey := r.Repo + "\x00" + c.LeaseID + "\x00" + c.WorkspaceMode + "\x00" + strconv.FormatInt(c.TTLSeconds, 10) + "\x00" + string(flags[:])
	ctx := contexts.get(ckey, func() types.Record {
		return types.NewRecord(types.RecordMap{
			"repo":           types.String(r.Repo),
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

// judge evaluates one policy's rules: the first (in the text's order)
// that matches, or that fails to evaluate, refuses.
func judge(p *Policy, req cedar.Request, ents *entities) (rule Rule, errMsg string, refused bool) {
	_, diag := cedar.Authorize(p, ents, req)
	first := -1
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
	if first < 0 {
		return Rule{}, "", false
	}
	return p.rule(cedar.PolicyID(strconv.Itoa(first))), errMsg, true
}
