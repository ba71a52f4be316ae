package egress

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// APIRule refuses calls of a forge's HTTP API that move refs or write
// repository content: writes that would reach the repository past the git
// fence and the lease. It is data; GitHubRules and GitLabRules are the
// rules fenceline ships.
type APIRule struct {
	// Name names the rule in refusals ("github-contents").
	Name string
	// What says what it refuses, for a person.
	What string
	// Methods are the HTTP methods it judges (none: every method).
	Methods []string
	// Path matches the request's path (cleaned, decoded). Its named group
	// "repo" is the repository the call writes (owner/name, or a GitLab
	// project's path or id).
	Path *regexp.Regexp
	// Mutations, when set, make the rule a GraphQL endpoint's: a document
	// holding a mutation that names any of these fields is refused.
	Mutations []string
}

// matches reports whether the rule judges a request of method to path.
func (r *APIRule) matches(method, path string) bool {
	return (len(r.Methods) == 0 || slices.Contains(r.Methods, method)) && r.Path.MatchString(path)
}

var writes = []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// githubRepo matches /repos/OWNER/NAME and /repositories/ID (GitHub
// serves every repository call under both), under GitHub Enterprise
// Server's /api/v3 too. A repository named by its ID is never the
// lease's: the proxy cannot tell which one it is.
const githubRepo = `(?i)^(?:/api/v3)?/(?:repos/(?P<repo>[^/]+/[^/]+)|repositories/[^/]+)`

// gitPush refuses a git push over smart HTTP to an injected host (one
// that serves git too, as gitlab.com and github.com do): it would carry
// the injected credential to any repository it may write. Pushes go
// through the git fence, with its own credential.
var gitPush = APIRule{Name: "git-push", What: "a git push over smart HTTP",
	Path: regexp.MustCompile(`(?i)/git-receive-pack$`)}

// GitHubRules refuse the GitHub REST and GraphQL calls that create or move
// refs, write contents or merge (github.com and Enterprise Server):
// reading, issues, comments, reviews and opening a pull request stay
// allowed.
var GitHubRules = []APIRule{
	{Name: "github-git-data", What: "git data API writes: refs, commits, trees, blobs, tags", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/git/(?:refs|commits|trees|blobs|tags)(?:/.*)?$`)},
	{Name: "github-contents", What: "contents API writes", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/contents(?:/.*)?$`)},
	{Name: "github-merge", What: "merging a pull request or a branch, updating a pull request's branch, a deployment (auto_merge merges the default branch into its ref)", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/(?:pulls/[0-9]+/(?:merge|update-branch)|merges|merge-upstream|deployments)$`)},
	{Name: "github-branches", What: "renaming branches, branch protection and rulesets", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/(?:branches/.+/(?:rename|protection(?:/.*)?)|rulesets(?:/.*)?)$`)},
	{Name: "github-releases", What: "creating or changing a release (it creates or moves a tag)", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/releases(?:/[0-9]+)?$`)},
	{Name: "github-repository", What: "changing the repository itself (default branch, deletion, transfer)", Methods: []string{http.MethodPatch, http.MethodDelete, http.MethodPost},
		Path: regexp.MustCompile(githubRepo + `(?:/transfer)?$`)},
	{Name: "github-workflows", What: "dispatching workflows (they run with the repository's write token)", Methods: writes,
		Path: regexp.MustCompile(githubRepo + `/(?:dispatches|actions/workflows/[^/]+/dispatches)$`)},
	{Name: "github-credentials", What: "adding an SSH, signing or deploy key or a collaborator (a credential that pushes past the lease)", Methods: writes,
		Path: regexp.MustCompile(`(?i)^(?:/api/v3)?/(?:user/(?:keys|gpg_keys|ssh_signing_keys)|(?:repos/[^/]+/[^/]+|repositories/[^/]+)/(?:keys|collaborators|invitations)|orgs/[^/]+/(?:invitations|memberships|outside_collaborators))(?:/.*)?$`)},
	{Name: "github-graphql", What: "GraphQL mutations that move refs, commit or merge",
		Path: regexp.MustCompile(`(?i)^(?:/api)?/graphql$`),
		Mutations: []string{"createCommitOnBranch", "createRef", "updateRef", "updateRefs", "deleteRef", "createLinkedBranch", "createDeployment",
			"mergePullRequest", "mergeBranch", "enablePullRequestAutoMerge", "enqueuePullRequest",
			"updatePullRequestBranch", "revertPullRequest", "createBranchProtectionRule",
			"updateBranchProtectionRule", "deleteBranchProtectionRule", "createRepositoryRuleset", "updateRepositoryRuleset",
			"deleteRepositoryRuleset", "updateRepository", "deleteRepository"}},
	gitPush,
}

// gitlabProject matches /api/v4/projects/ID-OR-PATH (a path's slashes come
// decoded).
const gitlabProject = `(?i)^/api/v4/projects/(?P<repo>.+?)`

// GitLabRules refuse the GitLab REST and GraphQL calls that create or
// move refs, write files or merge.
var GitLabRules = []APIRule{
	{Name: "gitlab-commits", What: "creating, cherry-picking or reverting commits, committing a changelog or a submodule update", Methods: writes,
		Path: regexp.MustCompile(gitlabProject + `/repository/(?:commits(?:/[^/]+/(?:cherry_pick|revert))?|changelog|submodules/.+)$`)},
	{Name: "gitlab-files", What: "repository files API writes", Methods: writes,
		Path: regexp.MustCompile(gitlabProject + `/repository/files/.+$`)},
	{Name: "gitlab-refs", What: "creating or deleting branches and tags (a release creates its tag), protected branches, mirroring", Methods: writes,
		Path: regexp.MustCompile(gitlabProject + `/(?:repository/(?:branches|tags)(?:/.*)?|repository/merged_branches|protected_(?:branches|tags)(?:/.*)?|releases(?:/.*)?|mirror/pull|remote_mirrors(?:/.*)?)$`)},
	{Name: "gitlab-merge", What: "merging or rebasing a merge request, adding it to a merge train", Methods: writes,
		Path: regexp.MustCompile(gitlabProject + `/(?:merge_requests/[0-9]+/(?:merge|rebase|merge_when_pipeline_succeeds)|merge_trains/merge_requests/[0-9]+)$`)},
	{Name: "gitlab-project", What: "changing or deleting the project", Methods: []string{http.MethodPut, http.MethodDelete},
		Path: regexp.MustCompile(`(?i)^/api/v4/projects/(?P<repo>[^/]+)$`)},
	{Name: "gitlab-credentials", What: "creating or rotating a token, adding a key or a member (a credential the agent would hold, or one that pushes past the lease)", Methods: writes,
		Path: regexp.MustCompile(`(?i)^/api/v4/(?:personal_access_tokens|deploy_keys|user/(?:personal_access_tokens|keys|gpg_keys)|users/[^/]+/(?:personal_access_tokens|impersonation_tokens|keys|gpg_keys)|(?:projects|groups)/.+/(?:access_tokens|deploy_tokens|deploy_keys|members|invitations))(?:/.*)?$`)},
	{Name: "gitlab-graphql", What: "GraphQL mutations that commit, move refs or merge",
		Path: regexp.MustCompile(`(?i)^/api/graphql$`),
		Mutations: []string{"commitCreate", "createBranch", "mergeRequestAccept", "mergeRequestSetAutoMerge",
			"mergeRequestRebase", "branchRuleCreate", "branchRuleUpdate", "branchRuleDelete", "projectUpdate", "projectDelete"}},
	gitPush,
}

// RulesFor are the API rules fenceline ships for a host: GitHub's for
// api.github.com, hosts named github.* and GitHub Enterprise Cloud's
// *.ghe.com, GitLab's for gitlab.com and gitlab.*; none for others.
func RulesFor(host string) []APIRule {
	h := strings.TrimSuffix(strings.ToLower(host), ".")
	switch {
	case h == "api.github.com" || strings.HasPrefix(h, "github.") || strings.Contains(h, ".github.") || strings.HasSuffix(h, ".ghe.com"):
		return GitHubRules
	case h == "gitlab.com" || strings.HasPrefix(h, "gitlab.") || strings.Contains(h, ".gitlab."):
		return GitLabRules
	}
	return nil
}

// methodOverrides are the headers some APIs read as the request's real
// method.
var methodOverrides = []string{"X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"}

// judgeAPI judges r by rules for lease l: the rule that refuses it and the
// call as it names it, or an error when it cannot be judged (it is
// refused then too). A ref-moving REST call to the lease's own repository
// is allowed to a whole-repo lease: nothing of the repository lies
// outside its claim.
func judgeAPI(rules []APIRule, r *http.Request, l lease.Lease) (*APIRule, string, error) {
	path := r.URL.Path
	if !cleanPath(path) {
		return nil, "", fmt.Errorf("the path %q has empty, '.' or '..' segments: the API might read it otherwise than the proxy", r.URL.EscapedPath())
	}
	for _, h := range methodOverrides {
		if r.Header.Get(h) != "" {
			return nil, "", fmt.Errorf("a request carrying %s: the API might take another method than the proxy judged", h)
		}
	}
	if ms, err := queryParams(r.URL.RawQuery, "_method"); err != nil || len(ms) > 0 {
		return nil, "", errors.New("a request with a _method parameter: the API might take another method than the proxy judged")
	}
	call := r.Method + " " + path
	// The forge routes /merges/ as /merges and may take a method in any
	// case: judge the path without its trailing slash, the method upper
	// case. And judge the path as the forge may split it: decoded (a
	// GitHub contents path with %2F) and as sent (a GitLab project named
	// by its path is one escaped segment, acme%2Fpayments).
	method := strings.ToUpper(r.Method)
	var paths []string
	for _, p := range []string{path, r.URL.EscapedPath()} {
		if len(p) > 1 {
			p = strings.TrimSuffix(p, "/")
		}
		if !slices.Contains(paths, p) {
			paths = append(paths, p)
		}
	}
	// Rack::MethodOverride (Rails, so GitLab's API too) takes a POST whose
	// form body holds _method=PUT for a PUT: a POST with a body that is not
	// JSON is judged as any write.
	as := []string{method}
	if method == http.MethodPost && !jsonType(r.Header.Values("Content-Type")) {
		as = writes
	}
	for i := range rules {
		rule := &rules[i]
		for _, p := range paths {
			if !slices.ContainsFunc(as, func(m string) bool { return rule.matches(m, p) }) {
				continue
			}
			if len(rule.Mutations) > 0 {
				field, err := graphQLMutation(r, rule.Mutations)
				if err != nil {
					return nil, "", err
				}
				if field != "" {
					return rule, "GraphQL mutation " + field, nil
				}
				break
			}
			if i := rule.Path.SubexpIndex("repo"); i >= 0 {
				repo, err := url.PathUnescape(rule.Path.FindStringSubmatch(p)[i])
				if err == nil && leaseAllowsRefs(l, repo) {
					continue
				}
			}
			return rule, call, nil
		}
	}
	return nil, call, nil
}

// jsonType reports whether the Content-Type names JSON (a body no form
// parser reads): one header, one type (a second might be the one read).
func jsonType(cts []string) bool {
	if len(cts) != 1 {
		return false
	}
	mt, _, err := mime.ParseMediaType(cts[0])
	return err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json"))
}

// cleanPath reports whether p is absolute with no empty, "." or ".."
// segment.
func cleanPath(p string) bool {
	if !strings.HasPrefix(p, "/") {
		return false
	}
	segs := strings.Split(p[1:], "/")
	for i, s := range segs {
		if s == "." || s == ".." || (s == "" && i != len(segs)-1) {
			return false
		}
	}
	return true
}

// leaseAllowsRefs reports whether l may move the refs of repo: an active
// whole-repo lease of that same repository, its identity's path (host/
// path, see repoid) the whole of repo: a path merely ending in repo is
// another namespace's project (GitLab's sub/payments beside
// group/sub/payments).
func leaseAllowsRefs(l lease.Lease, repo string) bool {
	if !l.Active() || l.Scope.Kind != scope.KindWholeRepo || repo == "" {
		return false
	}
	_, path, ok := strings.Cut(l.Repo, "/")
	return ok && strings.EqualFold(path, repo)
}

// graphQLMutation reads the GraphQL documents of r (its body is put back)
// and returns the first field of forbid a mutation in them names ("" for
// none). Every reading a server might take is judged: each "query"
// parameter (split at '&' and ';'), the body as JSON whenever it is JSON
// (GitHub reads it so whatever its type), and as a document when its type
// says GraphQL. A body it cannot read as GraphQL is an error.
func graphQLMutation(r *http.Request, forbid []string) (string, error) {
	docs, err := queryParams(r.URL.RawQuery, "query")
	if err != nil {
		return "", err
	}
	body, err := judgedBody(r)
	if err != nil {
		return "", err
	}
	if len(bytes.TrimSpace(body)) > 0 {
		// The bytes judged must be the text the forge reads.
		for _, ce := range strings.Split(strings.Join(r.Header.Values("Content-Encoding"), ","), ",") {
			if ce = strings.TrimSpace(ce); ce != "" && !strings.EqualFold(ce, "identity") {
				return "", fmt.Errorf("a GraphQL request body in Content-Encoding %s: the proxy judges plain bodies only", ce)
			}
		}
		if _, params, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err == nil {
			if cs := strings.ToLower(params["charset"]); cs != "" && cs != "utf-8" && cs != "us-ascii" {
				return "", fmt.Errorf("a GraphQL request body in charset %s: the proxy judges UTF-8 only", cs)
			}
		}
		raw := strings.HasPrefix(strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Type"))), "application/graphql")
		// A parser that skips a byte-order mark reads JSON behind one.
		switch jb := bytes.TrimPrefix(body, []byte("\ufeff")); {
		case json.Valid(jb):
			ds, err := graphQLDocuments(jb)
			if err != nil {
				return "", err
			}
			docs = append(docs, ds...)
		case !raw:
			return "", errors.New("a GraphQL request body that is not JSON (send application/json, or application/graphql for a bare document)")
		}
		if raw {
			docs = append(docs, string(body))
		}
	}
	for _, d := range docs {
		f, err := mutationField(d, forbid)
		if f != "" || err != nil {
			return f, err
		}
	}
	return "", nil
}

// queryParams are the values of every parameter name (any case) of a
// raw query string, split at '&' and at ';' (Go's parser drops a pair
// holding ';', older Rack splits there).
func queryParams(raw, name string) ([]string, error) {
	var out []string
	for _, kv := range strings.FieldsFunc(raw, func(c rune) bool { return c == '&' || c == ';' }) {
		k, v, _ := strings.Cut(kv, "=")
		k, err := url.QueryUnescape(k)
		if err != nil {
			return nil, fmt.Errorf("a query string the proxy cannot read: %w", err)
		}
		if !strings.EqualFold(strings.TrimSpace(k), name) {
			continue
		}
		if v, err = url.QueryUnescape(v); err != nil {
			return nil, fmt.Errorf("a query string the proxy cannot read: %w", err)
		}
		out = append(out, v)
	}
	return out, nil
}

// graphQLDocuments are the queries of a GraphQL-over-HTTP JSON body: one
// request or a batch. Every key a server might take for "query" counts
// (a parser that keeps the first of two, one that keeps the last, one
// that folds case), so none hides another.
func graphQLDocuments(body []byte) ([]string, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("a GraphQL request body that is not JSON: %v", err)
	}
	var out []string
	switch tok {
	case json.Delim('{'):
		if out, err = graphQLRequest(dec); err != nil {
			return nil, err
		}
	case json.Delim('['):
		for dec.More() {
			if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
				return nil, errors.New("a GraphQL batch holding something other than requests")
			}
			qs, err := graphQLRequest(dec)
			if err != nil {
				return nil, err
			}
			out = append(out, qs...)
		}
	default:
		return nil, errors.New("a GraphQL request body that is neither a request nor a batch")
	}
	return out, nil
}

// graphQLRequest reads the rest of one request object (its '{' read):
// the values of its query keys.
func graphQLRequest(dec *json.Decoder) ([]string, error) {
	var out []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("a GraphQL request body that is not JSON: %v", err)
		}
		key, _ := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("a GraphQL request body that is not JSON: %v", err)
		}
		if !strings.EqualFold(key, "query") || string(v) == "null" {
			continue
		}
		var q string
		if err := json.Unmarshal(v, &q); err != nil {
			return nil, errors.New("a GraphQL request whose query is not a string")
		}
		out = append(out, q)
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return nil, fmt.Errorf("a GraphQL request body that is not JSON: %v", err)
	}
	if len(out) == 0 {
		return nil, errors.New("a GraphQL request without its query (a persisted query cannot be judged)")
	}
	return out, nil
}

// mutationField returns the first name in forbid that doc uses, when doc
// holds a mutation operation ("" otherwise). Names are GraphQL's tokens
// outside strings and comments, so an alias or a fragment does not hide
// a field.
func mutationField(doc string, forbid []string) (string, error) {
	names, mutation, err := graphQLNames(doc)
	if err != nil || !mutation {
		return "", err
	}
	for _, n := range names {
		if slices.Contains(forbid, n) {
			return n, nil
		}
	}
	return "", nil
}

// graphQLNames lexes doc: its names, and whether an operation at the top
// level is a mutation.
func graphQLNames(doc string) (names []string, mutation bool, err error) {
	depth := 0
	for i := 0; i < len(doc); {
		c := doc[i]
		switch {
		case c == '#':
			for i < len(doc) && doc[i] != '\n' && doc[i] != '\r' {
				i++
			}
		case strings.HasPrefix(doc[i:], `"""`):
			end := strings.Index(strings.ReplaceAll(doc[i+3:], `\"""`, "xxxx"), `"""`)
			if end < 0 {
				return nil, false, errors.New("a GraphQL document with an unterminated block string")
			}
			i += 3 + end + 3
		case c == '"':
			i++
			for i < len(doc) && doc[i] != '"' {
				if doc[i] == '\\' {
					i++
				}
				if i < len(doc) && (doc[i] == '\n' || doc[i] == '\r') {
					return nil, false, errors.New("a GraphQL document with a line break in a string")
				}
				i++
			}
			if i >= len(doc) {
				return nil, false, errors.New("a GraphQL document with an unterminated string")
			}
			i++
		case c == '{' || c == '(' || c == '[':
			depth++
			i++
		case c == '}' || c == ')' || c == ']':
			depth--
			i++
		case c == '_' || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z'):
			j := i + 1
			for j < len(doc) && (doc[j] == '_' || ('a' <= doc[j] && doc[j] <= 'z') || ('A' <= doc[j] && doc[j] <= 'Z') || ('0' <= doc[j] && doc[j] <= '9')) {
				j++
			}
			name := doc[i:j]
			if depth == 0 && (name == "mutation" || name == "subscription") {
				mutation = mutation || name == "mutation"
			}
			names = append(names, name)
			i = j
		default:
			i++
		}
	}
	return names, mutation, nil
}
