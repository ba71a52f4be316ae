package deploy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/cli"
)

// No YAML library is in the module's graph (go.mod may not grow for a
// test), so the example is read with a small parser for the subset it
// uses: block maps and lists, plain and quoted scalars, {} and comments.

type node = any // map[string]any, []any or string

type line struct {
	indent int
	text   string
}

func lines(doc string) ([]line, error) {
	var out []line
	for i, l := range strings.Split(doc, "\n") {
		if strings.Contains(l, "\t") {
			return nil, fmt.Errorf("line %d: tab (YAML indents with spaces)", i+1)
		}
		t := strings.TrimRight(l, " ")
		trim := strings.TrimLeft(t, " ")
		if trim == "" || strings.HasPrefix(trim, "#") {
			continue
		}
		out = append(out, line{indent: len(t) - len(trim), text: trim})
	}
	return out, nil
}

func scalar(s string) node {
	switch {
	case s == "{}":
		return map[string]any{}
	case len(s) >= 2 && (s[0] == '"' && s[len(s)-1] == '"' || s[0] == '\'' && s[len(s)-1] == '\''):
		return s[1 : len(s)-1]
	}
	return s
}

// parse reads the block starting at ls[i] with the given indent.
func parse(ls []line, i, indent int) (node, int, error) {
	if i >= len(ls) {
		return nil, i, fmt.Errorf("empty block")
	}
	if strings.HasPrefix(ls[i].text, "- ") || ls[i].text == "-" {
		var list []any
		for i < len(ls) && ls[i].indent == indent && strings.HasPrefix(ls[i].text, "-") {
			item := strings.TrimSpace(strings.TrimPrefix(ls[i].text, "-"))
			if k, _, ok := splitKV(item); ok && !strings.ContainsAny(k, " \"'") {
				// A map item: its first key on the dash line, the rest at indent+2.
				sub := append([]line{{indent: indent + 2, text: item}}, ls[i+1:]...)
				n, j, err := parseMap(sub, 0, indent+2)
				if err != nil {
					return nil, i, err
				}
				list = append(list, n)
				i += j
				continue
			}
			list = append(list, scalar(item))
			i++
		}
		return list, i, nil
	}
	return parseMap(ls, i, indent)
}

// splitKV splits "key: value" or "key:" (a colon needs a space after it
// to end a key, as in YAML: "127.0.0.1:7070" is a scalar).
func splitKV(s string) (k, v string, ok bool) {
	if k, v, ok := strings.Cut(s, ": "); ok {
		return k, v, true
	}
	if k, ok := strings.CutSuffix(s, ":"); ok {
		return k, "", true
	}
	return "", "", false
}

func parseMap(ls []line, i, indent int) (map[string]any, int, error) {
	m := map[string]any{}
	for i < len(ls) && ls[i].indent == indent && !strings.HasPrefix(ls[i].text, "- ") {
		k, v, ok := splitKV(ls[i].text)
		if !ok {
			return nil, i, fmt.Errorf("%q: want key: value", ls[i].text)
		}
		if _, dup := m[k]; dup {
			return nil, i, fmt.Errorf("duplicate key %q", k)
		}
		v = strings.TrimSpace(v)
		i++
		if v != "" {
			m[k] = scalar(v)
			continue
		}
		if i < len(ls) && (ls[i].indent > indent || ls[i].indent == indent && strings.HasPrefix(ls[i].text, "- ")) {
			n, j, err := parse(ls, i, ls[i].indent)
			if err != nil {
				return nil, i, fmt.Errorf("%s: %w", k, err)
			}
			m[k], i = n, j
		} else {
			m[k] = nil
		}
	}
	if i < len(ls) && ls[i].indent > indent {
		return nil, i, fmt.Errorf("%q: unexpected indentation", ls[i].text)
	}
	return m, i, nil
}

func parseDocs(t *testing.T, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var docs []map[string]any
	for _, d := range regexp.MustCompile(`(?m)^---$`).Split(string(data), -1) {
		ls, err := lines(d)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(ls) == 0 {
			continue
		}
		m, n, err := parseMap(ls, 0, 0)
		if err != nil || n != len(ls) {
			t.Fatalf("%s: document %d: %v (read %d of %d lines)", path, len(docs)+1, err, n, len(ls))
		}
		docs = append(docs, m)
	}
	return docs
}

// at walks a path of map keys and "name=X" list selectors.
func at(t *testing.T, n node, path ...string) node {
	t.Helper()
	for _, p := range path {
		switch v := n.(type) {
		case map[string]any:
			var ok bool
			if n, ok = v[p]; !ok {
				t.Fatalf("no %q in %v", p, keys(v))
			}
		case []any:
			want, ok := strings.CutPrefix(p, "name=")
			if !ok {
				t.Fatalf("list step %q: want name=X", p)
			}
			n = nil
			for _, item := range v {
				if m, ok := item.(map[string]any); ok && m["name"] == want {
					n = m
				}
			}
			if n == nil {
				t.Fatalf("no item named %q", want)
			}
		default:
			t.Fatalf("%q under a scalar %v", p, n)
		}
	}
	return n
}

func keys(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

func strs(t *testing.T, n node) []string {
	t.Helper()
	l, ok := n.([]any)
	if !ok {
		t.Fatalf("want a list, got %v", n)
	}
	var out []string
	for _, x := range l {
		s, ok := x.(string)
		if !ok {
			t.Fatalf("want a list of strings, got %v", x)
		}
		out = append(out, s)
	}
	return out
}

// TestKubernetesExample: the pod runs fenceline as a native sidecar with
// probes on the admin port, wraps the agent's command in fenceline agent
// pointed at that port, takes its settings from the ConfigMap and Secret
// it declares, and every fenceline flag it passes exists.
func TestKubernetesExample(t *testing.T) {
	docs := parseDocs(t, "kubernetes/agent-pod.yaml")
	byKind := map[string]map[string]any{}
	secrets := map[string]map[string]any{} // by name
	for _, d := range docs {
		for _, k := range []string{"apiVersion", "kind", "metadata"} {
			if d[k] == nil {
				t.Fatalf("a document without %s: %v", k, keys(d))
			}
		}
		if d["kind"] == "Secret" {
			secrets[at(t, d, "metadata", "name").(string)] = d
			if byKind["Secret"] != nil {
				continue // the first is the agent's configuration
			}
		}
		byKind[d["kind"].(string)] = d
	}
	cm, secret, pod := byKind["ConfigMap"], byKind["Secret"], byKind["Pod"]
	if cm == nil || secret == nil || pod == nil {
		t.Fatalf("want a ConfigMap, a Secret and a Pod, got %v", keys(map[string]any{"cm": cm, "secret": secret, "pod": pod}))
	}
	cmName := at(t, cm, "metadata", "name").(string)
	cmData := at(t, cm, "data").(map[string]any)

	spec := at(t, pod, "spec")
	sc := at(t, spec, "initContainers", "name=fenceline")
	if got := at(t, sc, "restartPolicy"); got != "Always" {
		t.Errorf("fenceline init container restartPolicy %v, want Always (a native sidecar)", got)
	}
	for _, probe := range []string{"startupProbe", "readinessProbe"} {
		if got := at(t, sc, probe, "httpGet", "path"); got != "/readyz" {
			t.Errorf("%s path %v, want /readyz", probe, got)
		}
		if got := at(t, sc, probe, "httpGet", "port"); got != "admin" {
			t.Errorf("%s port %v, want the admin port", probe, got)
		}
	}
	if got := at(t, sc, "livenessProbe", "httpGet", "path"); got != "/healthz" {
		t.Errorf("livenessProbe path %v, want /healthz", got)
	}
	if got := at(t, sc, "ports", "name=admin", "containerPort"); got != "9090" {
		t.Errorf("admin port %v", got)
	}
	if got := at(t, sc, "envFrom").([]any)[0].(map[string]any)["configMapRef"].(map[string]any)["name"]; got != cmName {
		t.Errorf("sidecar envFrom %v, want the ConfigMap %s", got, cmName)
	}
	scArgs := strs(t, at(t, sc, "args"))
	env := map[string]bool{"POD_NAME": true}
	for k := range cmData {
		env[k] = true
	}
	for _, a := range scArgs {
		for _, m := range regexp.MustCompile(`\$\((\w+)\)`).FindAllStringSubmatch(a, -1) {
			if !env[m[1]] {
				t.Errorf("sidecar arg %s names $(%s), which neither the ConfigMap nor the env defines", a, m[1])
			}
		}
	}
	if got := at(t, spec, "automountServiceAccountToken"); got != "false" {
		t.Errorf("automountServiceAccountToken %v, want false: the agent needs no Kubernetes API credentials", got)
	}
	if indexOf(scArgs, "--allow-host") < 0 {
		t.Error("the sidecar allows no host: the agent's egress proxy is missing from the example")
	}
	agent := at(t, spec, "containers", "name=agent")
	cmd := strs(t, at(t, agent, "command"))
	if i := indexOf(cmd, "--"); indexOf(cmd[:max(i, 0)], "--allow-connect") >= 0 {
		t.Error("the agent opens a port with --allow-connect: any host on it (the kube-apiserver's) is then reachable around the egress proxy")
	}
	if len(cmd) < 4 || !strings.HasSuffix(cmd[0], "/fenceline") || cmd[1] != "agent" || cmd[2] != "--sidecar" || cmd[3] != "http://127.0.0.1:9090" {
		t.Errorf("agent command %v, want it wrapped in fenceline agent --sidecar http://127.0.0.1:9090", cmd)
	}
	// Secrets named by volumes exist; the agent container does not mount
	// the sidecar's secrets.
	for _, v := range at(t, spec, "volumes").([]any) {
		if s, ok := v.(map[string]any)["secret"].(map[string]any); ok && secrets[s["secretName"].(string)] == nil {
			t.Errorf("volume %v names secret %v, which the example does not declare", v.(map[string]any)["name"], s["secretName"])
		}
	}
	for _, m := range at(t, agent, "volumeMounts").([]any) {
		if n := m.(map[string]any)["name"]; n == "fenceline-secrets" || n == "fenceline-bus-identity" {
			t.Errorf("the agent container mounts the sidecar's secrets (%v)", n)
		}
	}
	// The sidecar's bus identity is the pod's own (bus enroll POD), from
	// a Secret of that pod alone: no holder key shared by every pod.
	podName := at(t, pod, "metadata", "name").(string)
	idSecret := secrets["fenceline-bus-"+podName]
	if idSecret == nil || at(t, idSecret, "stringData", "bus-identity.nk") == nil {
		t.Fatalf("no Secret fenceline-bus-%s with the pod's own bus-identity.nk (fenceline bus enroll %s)", podName, podName)
	}
	if got := at(t, sc, "env", "name=FENCELINE_CREDS", "value"); got != "/var/run/fenceline-bus/bus-identity.nk" {
		t.Errorf("the sidecar's FENCELINE_CREDS is %v, want the pod's own identity", got)
	}
	for name, sec := range secrets {
		for k := range at(t, sec, "stringData").(map[string]any) {
			if strings.Contains(k, "holder") {
				t.Errorf("Secret %s holds %s: a holder key shared by every pod", name, k)
			}
		}
	}

	// The flags are real: the command tree parses them, with $(VAR)
	// expanded as the kubelet does (--help stops before anything runs).
	expand := regexp.MustCompile(`\$\((\w+)\)`)
	var expanded []string
	for _, a := range scArgs {
		expanded = append(expanded, expand.ReplaceAllStringFunc(a, func(m string) string {
			if v, ok := cmData[m[2:len(m)-1]].(string); ok {
				return v
			}
			return "agent-billing-17" // POD_NAME
		}))
	}
	for _, args := range [][]string{expanded, cmd[1:]} {
		if i := indexOf(args, "--"); i >= 0 {
			args = args[:i]
		}
		var out, errOut bytes.Buffer
		if code := cli.Main(context.Background(), append(args, "--help"), &out, &errOut); code != 0 {
			t.Errorf("fenceline %s: exit %d: %s", strings.Join(args, " "), code, errOut.String())
		}
	}
}

func indexOf(s []string, x string) int {
	for i, v := range s {
		if v == x {
			return i
		}
	}
	return -1
}

// TestDockerfile: the build is static with CGO (pg_query) and the images
// are the ones the example and README name.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	for _, want := range []string{"CGO_ENABLED=1", "-tags netgo,osusergo", "-linkmode external -extldflags -static", "AS sidecar", "AS static",
		"distroless/static", "apt-get install -y --no-install-recommends git", "./cmd/fenceline"} {
		if !strings.Contains(s, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if !strings.Contains(s, "FROM golang:${GO_VERSION}-bookworm AS build") {
		t.Error("Dockerfile does not build on the Debian golang image")
	}
}
