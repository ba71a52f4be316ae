// Package deploy holds the container images' build (Dockerfile) and the
// Kubernetes example (kubernetes/); its tests check them against the
// Kubernetes API types and fenceline's real command tree.
package deploy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/fenceline/fenceline/internal/cli"
)

// manifest is every document of a manifest file, each decoded strictly
// into its Kubernetes API type.
type manifest struct {
	configMaps map[string]*corev1.ConfigMap
	secrets    map[string]*corev1.Secret
	pods       []*corev1.Pod
	jobs       []*batchv1.Job
}

// decode splits data into YAML documents and decodes each strictly into
// the k8s.io/api type of its kind: an unknown or misspelt field, a
// duplicate key or a value of the wrong type is an error, as it is for
// "kubectl apply --validate=strict".
func decode(data []byte) (*manifest, error) {
	m := &manifest{configMaps: map[string]*corev1.ConfigMap{}, secrets: map[string]*corev1.Secret{}}
	for i, doc := range regexp.MustCompile(`(?m)^---[ \t]*$`).Split(string(data), -1) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		if tm.Kind == "" && strings.TrimSpace(stripComments(doc)) == "" {
			continue // comments only
		}
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 ConfigMap":
			obj = &corev1.ConfigMap{}
		case "v1 Secret":
			obj = &corev1.Secret{}
		case "v1 Pod":
			obj = &corev1.Pod{}
		case "batch/v1 Job":
			obj = &batchv1.Job{}
		default:
			return nil, fmt.Errorf("document %d: apiVersion %q kind %q: not a kind this test decodes (add it)", i+1, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			return nil, fmt.Errorf("document %d (%s): %w", i+1, tm.Kind, err)
		}
		switch o := obj.(type) {
		case *corev1.ConfigMap:
			m.configMaps[o.Name] = o
		case *corev1.Secret:
			m.secrets[o.Name] = o
		case *corev1.Pod:
			m.pods = append(m.pods, o)
		case *batchv1.Job:
			m.jobs = append(m.jobs, o)
		}
	}
	return m, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// TestStrictDecodeRejects: the decoder the example is checked with is
// strict; a misspelt security field (which Kubernetes would drop with a
// warning, leaving the container unhardened) fails it.
func TestStrictDecodeRejects(t *testing.T) {
	for name, doc := range map[string]string{
		"misspelt field": `apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
    - name: agent
      image: x
      securityContext:
        allowPrivilegeEscalaton: false
`,
		"field at the wrong level": `apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  readOnlyRootFilesystem: true
  containers: [{name: agent, image: x}]
`,
		"duplicate key": `apiVersion: v1
kind: ConfigMap
metadata: {name: c}
data:
  A: "1"
  A: "2"
`,
		"wrong type": `apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  automountServiceAccountToken: "no"
  containers: [{name: agent, image: x}]
`,
		"unknown kind": `apiVersion: v1
kind: Podd
metadata: {name: p}
`,
	} {
		if _, err := decode([]byte(doc)); err == nil {
			t.Errorf("%s: decoded without an error", name)
		}
	}
}

// TestKubernetesExample: every document of the example decodes strictly
// into its API type; the pod is hardened (no rerun of a finished agent, no
// service-account token, no privilege escalation, no capabilities, a
// read-only root in every container), runs fenceline as a native sidecar
// with probes on the admin port and its own bus identity, queues a
// replacement behind its predecessor's lease (--wait) within its
// startupProbe, wraps the agent's command in fenceline agent pointed at
// that port with egress through the proxy, and every fenceline flag it
// passes (the operator's guarded shell's too) exists.
func TestKubernetesExample(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("kubernetes", "agent-pod.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := decode(data)
	if err != nil {
		t.Fatalf("kubernetes/agent-pod.yaml: %v", err)
	}
	if len(m.pods) != 1 || len(m.configMaps) != 1 {
		t.Fatalf("want one Pod and one ConfigMap, got %d and %d", len(m.pods), len(m.configMaps))
	}
	pod := m.pods[0]
	spec := pod.Spec
	var cm *corev1.ConfigMap
	for _, c := range m.configMaps {
		cm = c
	}

	// Hardening.
	if spec.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("pod restartPolicy %q, want Never: Always (the default) or OnFailure runs a finished agent's command again on the same checkout", spec.RestartPolicy)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("automountServiceAccountToken is not false: the agent needs no Kubernetes API credentials")
	}
	if psc := spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot ||
		psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("the pod's securityContext lacks runAsNonRoot: true and seccompProfile RuntimeDefault")
	}
	all := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	for _, c := range all {
		sc := c.SecurityContext
		switch {
		case sc == nil:
			t.Errorf("container %s: no securityContext", c.Name)
			continue
		case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
			t.Errorf("container %s: allowPrivilegeEscalation is not false", c.Name)
		case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
			t.Errorf("container %s: readOnlyRootFilesystem is not true", c.Name)
		case sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0:
			t.Errorf("container %s: capabilities are not drop [ALL] with none added", c.Name)
		case sc.Privileged != nil && *sc.Privileged:
			t.Errorf("container %s: privileged", c.Name)
		}
	}

	// The native sidecar.
	sc := container(t, spec.InitContainers, "fenceline")
	if sc.RestartPolicy == nil || *sc.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Error("the fenceline init container's restartPolicy is not Always: not a native sidecar")
	}
	for name, p := range map[string]*corev1.Probe{"startupProbe": sc.StartupProbe, "readinessProbe": sc.ReadinessProbe, "livenessProbe": sc.LivenessProbe} {
		want := "/readyz"
		if name == "livenessProbe" {
			want = "/healthz"
		}
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != want || p.HTTPGet.Port.String() != "admin" {
			t.Errorf("sidecar %s: want httpGet %s on the admin port, got %+v", name, want, p)
		}
	}
	if len(sc.Ports) != 1 || sc.Ports[0].Name != "admin" || sc.Ports[0].ContainerPort != 9090 {
		t.Errorf("sidecar ports %+v, want admin 9090", sc.Ports)
	}
	if len(sc.EnvFrom) != 1 || sc.EnvFrom[0].ConfigMapRef == nil || sc.EnvFrom[0].ConfigMapRef.Name != cm.Name {
		t.Errorf("sidecar envFrom %+v, want the ConfigMap %s", sc.EnvFrom, cm.Name)
	}
	env := map[string]bool{}
	for k := range cm.Data {
		env[k] = true
	}
	for _, e := range sc.Env {
		env[e.Name] = true
	}
	expand := regexp.MustCompile(`\$\((\w+)\)`)
	for _, a := range sc.Args {
		for _, mm := range expand.FindAllStringSubmatch(a, -1) {
			if !env[mm[1]] {
				t.Errorf("sidecar arg %s names $(%s), which neither the ConfigMap nor the env defines", a, mm[1])
			}
		}
	}
	if indexOf(sc.Args, "--allow-host") < 0 {
		t.Error("the sidecar allows no host: the agent's egress proxy is missing from the example")
	}
	// A replacement pod waits for its predecessor's lease, and the
	// startupProbe gives it that long.
	if i := indexOf(sc.Args, "--wait"); i < 0 || i+1 >= len(sc.Args) {
		t.Error("the sidecar has no --wait: a replacement pod whose predecessor's lease has not ended fails (exit 3) instead of queueing")
	} else if w, err := time.ParseDuration(sc.Args[i+1]); err != nil {
		t.Errorf("--wait %q: %v", sc.Args[i+1], err)
	} else if p := sc.StartupProbe; p != nil && time.Duration(p.PeriodSeconds*p.FailureThreshold)*time.Second <= w {
		t.Errorf("startupProbe gives %d s, not more than --wait %s: the kubelet restarts a sidecar still queueing", p.PeriodSeconds*p.FailureThreshold, w)
	}

	// The agent.
	agent := container(t, spec.Containers, "agent")
	cmd := agent.Command
	if len(cmd) < 4 || !strings.HasSuffix(cmd[0], "/fenceline") || cmd[1] != "agent" || cmd[2] != "--sidecar" || cmd[3] != "http://127.0.0.1:9090" {
		t.Errorf("agent command %v, want it wrapped in fenceline agent --sidecar http://127.0.0.1:9090", cmd)
	}
	if i := indexOf(cmd, "--"); indexOf(cmd[:max(i, 0)], "--allow-connect") >= 0 {
		t.Error("the agent opens a port with --allow-connect: any host on it (the kube-apiserver's) is then reachable around the egress proxy")
	}
	for _, vm := range agent.VolumeMounts {
		if vm.Name == "fenceline-secrets" || vm.Name == "fenceline-bus-identity" {
			t.Errorf("the agent container mounts the sidecar's secrets (%s)", vm.Name)
		}
	}
	for _, v := range spec.Volumes {
		if v.Secret != nil && m.secrets[v.Secret.SecretName] == nil {
			t.Errorf("volume %s names secret %s, which the example does not declare", v.Name, v.Secret.SecretName)
		}
	}

	// The pod's own bus identity (bus enroll POD), from a Secret of that
	// pod alone: no holder key shared by every pod.
	id := m.secrets["fenceline-bus-"+pod.Name]
	if id == nil || id.StringData["bus-identity.nk"] == "" {
		t.Fatalf("no Secret fenceline-bus-%s with the pod's own bus-identity.nk (fenceline bus enroll %s)", pod.Name, pod.Name)
	}
	creds := ""
	for _, e := range sc.Env {
		if e.Name == "FENCELINE_CREDS" {
			creds = e.Value
		}
	}
	if creds != "/var/run/fenceline-bus/bus-identity.nk" {
		t.Errorf("the sidecar's FENCELINE_CREDS is %q, want the pod's own identity", creds)
	}
	for name, s := range m.secrets {
		for k := range s.StringData {
			if strings.Contains(k, "holder") {
				t.Errorf("Secret %s holds %s: a holder key shared by every pod", name, k)
			}
		}
	}

	// The flags are real: the command tree parses them, with $(VAR)
	// expanded as the kubelet does (--help stops before anything runs).
	var expanded []string
	for _, a := range sc.Args {
		expanded = append(expanded, expand.ReplaceAllStringFunc(a, func(s string) string {
			if v, ok := cm.Data[s[2:len(s)-1]]; ok {
				return v
			}
			return pod.Name // POD_NAME
		}))
	}
	shell := operatorShell(t, string(data))
	for _, args := range [][]string{expanded, cmd[1:], shell} {
		if i := indexOf(args, "--"); i >= 0 {
			args = args[:i]
		}
		var out, errOut bytes.Buffer
		if code := cli.Main(context.Background(), append(args, "--help"), &out, &errOut); code != 0 {
			t.Errorf("fenceline %s: exit %d: %s", strings.Join(args, " "), code, errOut.String())
		}
	}
	if indexOf(shell, "--operator") < 0 {
		t.Errorf("the operator's shell %v is not run with --operator (it would report the attempt settled)", shell)
	}
}

// operatorShell is the fenceline command of the manifest's comment on a
// guarded shell for operators (kubectl exec ... -- /fenceline-bin/fenceline
// agent ...), continuation lines joined.
func operatorShell(t *testing.T, manifest string) []string {
	t.Helper()
	var joined strings.Builder
	in := false
	for _, l := range strings.Split(manifest, "\n") {
		l = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), "#"))
		if strings.HasPrefix(l, "kubectl exec") {
			in = true
		}
		if !in {
			continue
		}
		cont := strings.HasSuffix(l, "\\")
		joined.WriteString(strings.TrimSuffix(l, "\\") + " ")
		if !cont {
			break
		}
	}
	f := strings.Fields(joined.String())
	i := indexOf(f, "/fenceline-bin/fenceline")
	if i < 0 {
		t.Fatalf("the manifest's comments show no guarded shell for operators (kubectl exec ... -- /fenceline-bin/fenceline agent ... -- sh); got %q", joined.String())
	}
	return f[i+1:]
}

func container(t *testing.T, cs []corev1.Container, name string) corev1.Container {
	t.Helper()
	for _, c := range cs {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

func indexOf(s []string, x string) int {
	for i, v := range s {
		if v == x {
			return i
		}
	}
	return -1
}

// TestDockerfile: the build is static with CGO (pg_query), the images are
// the ones the example and README name, their bases can be replaced (a
// machine without a registry), and the sidecar image's user and group are
// both 65532 (useradd --user-group would give the group 1000).
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	s := string(data)
	for _, want := range []string{"CGO_ENABLED=1", "-tags netgo,osusergo", "-linkmode external -extldflags -static", "AS sidecar", "AS static",
		"ARG GO_IMAGE=golang:${GO_VERSION}-bookworm", "FROM ${GO_IMAGE} AS build",
		"ARG STATIC_IMAGE=gcr.io/distroless/static-debian12:nonroot", "ARG DEBIAN_IMAGE=debian:bookworm-slim",
		"apt-get install -y --no-install-recommends git", "apt-get clean", "./cmd/fenceline",
		"groupadd --gid 65532 fenceline", "useradd --uid 65532 --gid 65532", "USER 65532:65532"} {
		if !strings.Contains(s, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
	if strings.Contains(s, "--user-group") {
		t.Error("Dockerfile uses useradd --user-group: the group gets the next free GID, not 65532")
	}
}
