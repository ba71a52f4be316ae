package policy

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Case is one request of a policy's tests with its expected decision
// (`fenceline policy test --cases FILE`: a JSON array of cases).
type Case struct {
	Name    string  `json:"name"`
	Request Request `json:"request"`
	// Expect is "allow" or "deny".
	Expect string `json:"expect"`
	// Rule, when set, is the @id that must refuse a "deny".
	Rule string `json:"rule,omitempty"`
}

// CaseResult is one case's outcome.
type CaseResult struct {
	Case   Case
	Got    Decision
	Passed bool
	Why    string // what did not match
}

// ParseCases reads a JSON array of cases.
func ParseCases(data []byte) ([]Case, error) {
	var cs []Case
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cs); err != nil {
		return nil, fmt.Errorf("policy test cases: %w (want a JSON array of {name, request: {agent, task, repo, action, resource: {kind, name, port}, context}, expect: allow|deny, rule})", err)
	}
	for i, c := range cs {
		if c.Expect != "allow" && c.Expect != "deny" {
			return nil, fmt.Errorf("policy test case %d (%s): expect %q: want allow or deny", i+1, c.Name, c.Expect)
		}
	}
	return cs, nil
}

// RunCases decides every case with s and says which matched.
func RunCases(s *Store, cs []Case) []CaseResult {
	out := make([]CaseResult, len(cs))
	for i, c := range cs {
		d := s.Decide(c.Request)
		r := CaseResult{Case: c, Got: d, Passed: true}
		switch {
		case c.Expect == "allow" && d.Refused != nil:
			r.Passed, r.Why = false, "want allow, got deny by "+d.Refused.String()
		case c.Expect == "deny" && d.Refused == nil:
			r.Passed, r.Why = false, "want deny, got allow"
		case c.Expect == "deny" && c.Rule != "" && d.Refused.Rule != c.Rule:
			r.Passed, r.Why = false, fmt.Sprintf("want deny by rule %q, got deny by %s", c.Rule, d.Refused)
		}
		out[i] = r
	}
	return out
}
