package policy

import (
	"fmt"
	"sync"

	"github.com/cedar-policy/cedar-go/x/exp/schema"
	"github.com/cedar-policy/cedar-go/x/exp/schema/resolved"
	"github.com/cedar-policy/cedar-go/x/exp/schema/validate"
)

// Namespace is the Cedar namespace of fenceline's entities and actions.
const Namespace = "Fenceline"

// Action is what a request asks to do.
type Action string

// The actions of the schema. Security teams write policies against these
// names: they are never renamed.
const (
	// ActionClaim is a lease's claim: once per claimed path
	// (Fenceline::Path), once per table (Fenceline::Table), and for a
	// whole-repo claim or a claim of nothing once on the root path ""
	// (context.whole_repo says which).
	ActionClaim Action = "claim"
	// ActionWrite is a file write at the file guard, and every path a push
	// touches at the git fence and the pre-receive hook.
	ActionWrite Action = "write"
	// ActionPush is a ref update (context.force, delete, create).
	ActionPush Action = "push"
	// ActionSQLWrite is a write to one table.
	ActionSQLWrite Action = "sql_write"
	// ActionSQLOpaque is a write whose table cannot be known (DDL, DO,
	// functions): its resource is the table "".
	ActionSQLOpaque Action = "sql_opaque"
	// ActionConnect is an egress connection to a host and port.
	ActionConnect Action = "connect"
)

// Actions are every action of the schema.
var Actions = []Action{ActionClaim, ActionWrite, ActionPush, ActionSQLWrite, ActionSQLOpaque, ActionConnect}

// Kind is a resource's entity type.
type Kind string

// The resource kinds of the schema.
const (
	KindPath  Kind = "Path"  // attribute path: repo-relative, "/"-separated
	KindRef   Kind = "Ref"   // attribute name: refs/heads/main
	KindTable Kind = "Table" // attribute name: schema.table
	KindHost  Kind = "Host"  // attributes name and port
)

// SchemaText is the Cedar schema of fenceline's requests
// (`fenceline policy schema` prints it). It may grow; nothing in it is
// ever renamed.
const SchemaText = `// fenceline's Cedar schema: what a policy may name.
namespace Fenceline {
  // An agent: the principal of every request, by its agent id.
  entity Agent = {
    "task": String,  // the lease owner's task id
    "repo": String,  // the repository (host/org/repo)
  };

  entity Path = { "path": String };                 // repo-relative, "/"-separated; "" is the root
  entity Ref = { "name": String };                  // refs/heads/main
  entity Table = { "name": String };                // schema.table; "" when it cannot be known
  entity Host = { "name": String, "port": Long };   // lower-case host name or IP

  // Every action has the same context; what does not apply is "", 0 or false.
  type RequestContext = {
    "repo": String,            // the repository (host/org/repo)
    "identity": String,        // claim: the bus identity asking, as the bus names it ("" elsewhere)
    "lease_id": String,        // the lease asking ("" for a claim not yet granted)
    "workspace_mode": String,  // "exclusive" or "shared"
    "ttl_seconds": Long,       // the lease's TTL
    "whole_repo": Bool,        // the lease claims the whole repository
    "force": Bool,             // push: the update is not a fast-forward
    "delete": Bool,            // push: the ref is deleted
    "create": Bool,            // push: the ref is created
  };

  action claim appliesTo { principal: [Agent], resource: [Path, Table], context: RequestContext };
  action write appliesTo { principal: [Agent], resource: [Path], context: RequestContext };
  action push appliesTo { principal: [Agent], resource: [Ref], context: RequestContext };
  action sql_write appliesTo { principal: [Agent], resource: [Table], context: RequestContext };
  action sql_opaque appliesTo { principal: [Agent], resource: [Table], context: RequestContext };
  action connect appliesTo { principal: [Agent], resource: [Host], context: RequestContext };
}
`

var (
	validatorOnce sync.Once
	validator     *validate.Validator
	validatorErr  error
)

// schemaValidator is Cedar's validator for SchemaText (strict mode).
func schemaValidator() (*validate.Validator, error) {
	validatorOnce.Do(func() {
		var s schema.Schema
		s.SetFilename("fenceline.cedarschema")
		if err := s.UnmarshalCedar([]byte(SchemaText)); err != nil {
			validatorErr = fmt.Errorf("fenceline's policy schema does not parse: %w", err)
			return
		}
		var r *resolved.Schema
		if r, validatorErr = s.Resolve(); validatorErr != nil {
			validatorErr = fmt.Errorf("fenceline's policy schema does not resolve: %w", validatorErr)
			return
		}
		validator = validate.New(r, validate.WithStrict())
	})
	return validator, validatorErr
}
