package policy

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"iter"
	"regexp"
	"strconv"
	"strings"

	cedar "github.com/cedar-policy/cedar-go"
	xast "github.com/cedar-policy/cedar-go/x/exp/ast"
)

// MaxText bounds a policy's text (bytes).
const MaxText = 256 << 10

// Problem is one thing wrong with a policy, where it is.
type Problem struct {
	Line    int    `json:"line"`   // 1-based; 0 when the text has no place for it
	Column  int    `json:"column"` // 1-based
	Rule    string `json:"rule,omitempty"`
	Message string `json:"message"`
}

func (p Problem) String() string {
	var b strings.Builder
	if p.Line > 0 {
		fmt.Fprintf(&b, "%d:%d: ", p.Line, p.Column)
	}
	if p.Rule != "" {
		fmt.Fprintf(&b, "rule %q: ", p.Rule)
	}
	b.WriteString(p.Message)
	return b.String()
}

// ErrInvalid: a policy that does not parse or does not validate against
// the schema. Its ParseError lists every problem with its line and column.
var ErrInvalid = errors.New("invalid policy")

// ParseError is a policy's problems; it matches ErrInvalid.
type ParseError struct {
	Name     string // the file or policy's name
	Problems []Problem
}

func (e *ParseError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "policy %s is invalid:", e.Name)
	for _, p := range e.Problems {
		b.WriteString("\n  ")
		if e.Name != "" && p.Line > 0 {
			b.WriteString(e.Name + ":")
		}
		b.WriteString(p.String())
	}
	return b.String()
}

func (e *ParseError) Is(target error) bool { return target == ErrInvalid }

// Rule is one rule of a parsed policy.
type Rule struct {
	ID     string // its @id, else "line N"
	Line   int
	policy *cedar.Policy
}

// Policy is a parsed and validated policy text.
type Policy struct {
	Text   string
	Digest string // "sha256:<hex>" of Text
	Rules  []Rule
}

// All yields the rules in their order in the text, by index (a
// cedar.PolicyIterator).
func (p *Policy) All() iter.Seq2[cedar.PolicyID, *cedar.Policy] {
	return func(yield func(cedar.PolicyID, *cedar.Policy) bool) {
		for i, r := range p.Rules {
			if !yield(cedar.PolicyID(strconv.Itoa(i)), r.policy) {
				return
			}
		}
	}
}

// Digest returns the digest a stored policy carries: "sha256:<hex>".
func Digest(text string) string {
	sum := sha256.Sum256([]byte(text))
	return "sha256:" + hex.EncodeToString(sum[:])
}

var parsePos = regexp.MustCompile(`:(\d+):(\d+):?\s*`)

// Parse reads a policy text and validates it with Cedar's validator
// against SchemaText. A policy that does not parse, names what the schema
// does not have, compares values of the wrong type, or holds a `permit`
// (a policy only narrows) is a *ParseError listing each problem with its
// line and column. name is what errors call the text (a file name).
func Parse(name, text string) (*Policy, error) {
	if len(text) > MaxText {
		return nil, &ParseError{Name: name, Problems: []Problem{{Message: fmt.Sprintf("%d bytes: a policy is at most %d", len(text), MaxText)}}}
	}
	list, err := cedar.NewPolicyListFromBytes(name, []byte(text))
	if err != nil {
		return nil, &ParseError{Name: name, Problems: []Problem{parseProblem(err)}}
	}
	v, err := schemaValidator()
	if err != nil {
		return nil, err
	}
	p := &Policy{Text: text, Digest: Digest(text)}
	var problems []Problem
	ids := map[string]int{}
	for i, cp := range list {
		id := "policy" + strconv.Itoa(i)
		pos := cp.Position()
		r := Rule{ID: ruleID(cp), Line: pos.Line, policy: cp}
		at := Problem{Line: pos.Line, Column: pos.Column, Rule: r.ID}
		if cp.Effect() == cedar.Permit {
			at.Message = "a permit has no effect: a policy only narrows what fenceline allows (write `forbid (...) unless { ... };` to allow one thing and nothing else)"
			problems = append(problems, at)
		}
		if first, dup := ids[r.ID]; dup && r.ID != "" {
			at.Message = fmt.Sprintf("@id %q is also the id of the rule at line %d: refusals name rules by @id, so each must be unique", r.ID, first)
			problems = append(problems, at)
		}
		ids[r.ID] = pos.Line
		if err := v.Policy(id, (*xast.Policy)(cp.AST())); err != nil {
			for _, e := range flatten(err) {
				at.Message = strings.ReplaceAll(e.Error(), "for policy `"+id+"`, ", "")
				problems = append(problems, at)
			}
		}
		p.Rules = append(p.Rules, r)
	}
	if len(problems) > 0 {
		return nil, &ParseError{Name: name, Problems: problems}
	}
	return p, nil
}

// ruleID is a rule's @id, else "line N" (what refusals call it).
func ruleID(cp *cedar.Policy) string {
	if id, ok := cp.Annotations()["id"]; ok && id != "" {
		return string(id)
	}
	return "line " + strconv.Itoa(cp.Position().Line)
}

func flatten(err error) []error {
	if u, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range u.Unwrap() {
			out = append(out, flatten(e)...)
		}
		return out
	}
	return []error{err}
}

// parseProblem finds the line and column in a Cedar parse error.
func parseProblem(err error) Problem {
	msg := strings.TrimPrefix(err.Error(), "parser error: ")
	m := parsePos.FindStringSubmatchIndex(msg)
	if m == nil {
		return Problem{Message: msg}
	}
	line, _ := strconv.Atoi(msg[m[2]:m[3]])
	col, _ := strconv.Atoi(msg[m[4]:m[5]])
	// "parse error at <input>:4:1 "": exact got ; want }" → the rest.
	rest := strings.TrimSpace(msg[m[1]:])
	head := strings.TrimSuffix(strings.TrimSpace(msg[:m[0]]), "<input>")
	head = strings.TrimSuffix(strings.TrimSpace(strings.TrimSuffix(head, " at")), " at")
	return Problem{Line: line, Column: col, Message: strings.TrimSpace(head + ": " + rest)}
}
