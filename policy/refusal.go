package policy

import (
	"errors"
	"fmt"
	"strings"

	"github.com/fenceline/fenceline/lease"
)

// ReasonPolicy is the audit reason code of a policy refusal
// (lease.ReasonPolicy).
const ReasonPolicy = lease.ReasonPolicy

// ErrRefused: the policy in force refuses the request. Refusal carries
// the request and the rule.
var ErrRefused = errors.New("refused by policy")

// Refusal is a request the enforced policy refuses.
type Refusal struct {
	Request Request
	Verdict Verdict
}

func (e *Refusal) Error() string {
	return fmt.Sprintf("%s %s: refused by %s", e.Request.Action, e.Request.Resource, e.Verdict)
}

// Is makes a Refusal match ErrRefused.
func (e *Refusal) Is(target error) bool { return target == ErrRefused }

// Check returns a *Refusal when the enforced policy refuses r, else nil,
// with the decision (for its shadow verdict).
func (s *Store) Check(r Request) (Decision, error) {
	d := s.Decide(r)
	if d.Refused != nil {
		return d, &Refusal{Request: r, Verdict: *d.Refused}
	}
	return d, nil
}

// ErrFlagForbidden: a runner's or sidecar's flag would allow what the
// policy forbids (flags only narrow the policy). The CLI exits 2.
var ErrFlagForbidden = errors.New("a flag would allow what the policy forbids")

// FlagError lists each flag that would allow what the policy forbids,
// with the rule that forbids it.
type FlagError struct {
	Refusals []FlagRefusal
}

// FlagRefusal is one flag and the rule it runs into.
type FlagRefusal struct {
	Flag    string
	Request Request
	Verdict Verdict
}

func (e *FlagError) Error() string {
	var b strings.Builder
	b.WriteString("flags only narrow the policy in force, and ")
	for i, r := range e.Refusals {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s would allow %s %s, which %s forbids", r.Flag, r.Request.Action, r.Request.Resource, r.Verdict)
	}
	b.WriteString(": drop the flag, or ask the policy's owners to change the rule")
	return b.String()
}

// Is makes a FlagError match ErrFlagForbidden.
func (e *FlagError) Is(target error) bool { return target == ErrFlagForbidden }

// Flags are what a runner's or sidecar's flags ask for, before any lease
// is taken.
type Flags struct {
	Agent, Task, Repo string
	// The claim (--scope, --table, --whole-repo, --ttl, --workspace).
	Paths, Tables []string
	WholeRepo     bool
	TTLSeconds    int64
	WorkspaceMode string
	// Paths --allow-write makes writable, repo-relative (those inside the
	// repository).
	AllowWrite []string
	// Hosts --allow-host lets the agent reach, and those
	// --inject-header-file opens for it.
	AllowHosts, InjectHosts []Resource
	// --allow-force-push, --allow-ref-delete, --pg-allow-opaque.
	AllowForcePush, AllowRefDelete, PGAllowOpaque bool
	// Attached: the lease exists already (its claim was judged when it
	// was granted, and is judged again at every policy change); only the
	// fence flags are asked about.
	Attached bool
}

// CheckFlags asks the enforced policy about everything f would allow and
// returns a *FlagError naming each flag that runs into a rule. A push or
// opaque write is asked about any ref or table (name ""): a rule about
// particular refs still refuses them push by push.
func (s *Store) CheckFlags(f Flags) error {
	base := Request{Agent: f.Agent, Task: f.Task, Repo: f.Repo,
		Context: Context{WorkspaceMode: f.WorkspaceMode, TTLSeconds: f.TTLSeconds, WholeRepo: f.WholeRepo}}
	var out []FlagRefusal
	ask := func(flag string, a Action, res Resource, ctx func(*Context)) {
		r := base
		r.Action, r.Resource = a, res
		if ctx != nil {
			ctx(&r.Context)
		}
		if d := s.Decide(r); d.Refused != nil {
			out = append(out, FlagRefusal{Flag: flag, Request: r, Verdict: *d.Refused})
		}
	}
	var claims []Request
	if !f.Attached {
		claims = ClaimRequests(base, f.Paths, f.Tables, f.WholeRepo)
	}
	for _, r := range claims {
		flag := "--scope " + r.Resource.Name
		switch {
		case r.Resource.Kind == KindTable:
			flag = "--table " + r.Resource.Name
		case f.WholeRepo:
			flag = "--whole-repo"
		case len(f.Paths) == 0:
			flag = "--ttl"
		}
		ask(flag, ActionClaim, r.Resource, nil)
	}
	for _, p := range f.AllowWrite {
		ask("--allow-write "+p, ActionWrite, Resource{Kind: KindPath, Name: p}, nil)
	}
	for _, h := range f.AllowHosts {
		ask(fmt.Sprintf("--allow-host %s:%d", h.Name, h.Port), ActionConnect, h, nil)
	}
	for _, h := range f.InjectHosts {
		ask(fmt.Sprintf("--inject-header-file %s:%d", h.Name, h.Port), ActionConnect, h, nil)
	}
	if f.AllowForcePush {
		ask("--allow-force-push", ActionPush, Resource{Kind: KindRef}, func(c *Context) { c.Force = true })
	}
	if f.AllowRefDelete {
		ask("--allow-ref-delete", ActionPush, Resource{Kind: KindRef}, func(c *Context) { c.Delete = true })
	}
	if f.PGAllowOpaque {
		ask("--pg-allow-opaque", ActionSQLOpaque, Resource{Kind: KindTable}, nil)
	}
	if len(out) > 0 {
		return &FlagError{Refusals: out}
	}
	return nil
}

// ClaimRequests are the claim requests a lease's claim makes, from base
// (agent, task, repo and context): one per path, one per table, and for a
// whole-repo claim or a claim of no path one on the root path "".
func ClaimRequests(base Request, paths, tables []string, wholeRepo bool) []Request {
	base.Action = ActionClaim
	base.Context.WholeRepo = wholeRepo
	var out []Request
	if wholeRepo || len(paths) == 0 {
		r := base
		r.Resource = Resource{Kind: KindPath}
		out = append(out, r)
	}
	if !wholeRepo {
		for _, p := range paths {
			r := base
			r.Resource = Resource{Kind: KindPath, Name: p}
			out = append(out, r)
		}
	}
	for _, t := range tables {
		r := base
		r.Resource = Resource{Kind: KindTable, Name: t}
		out = append(out, r)
	}
	return out
}
