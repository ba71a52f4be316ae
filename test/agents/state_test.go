//go:build integration

package agents

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Issue 33, item 3: a guarded agent that may write its CLI's state can
// plant what the user's next plain, unguarded run of the CLI executes — a
// SessionStart hook in Claude Code's settings.json, a notify command in
// Codex's config.toml. These tests run the real CLIs: the scripted model
// has the agent plant one, then the user runs the CLI plainly (no
// fenceline) and the test looks for the marker the planted command makes.

// stateRecipe is how the agent gets its CLI's state: the README's recipe
// (--private-state: a private copy, discarded) or the old one
// (--allow-write on the user's own).
type stateRecipe string

const (
	recipePrivate    stateRecipe = "--private-state"
	recipeAllowWrite stateRecipe = "--allow-write"
)

// cliState is what one CLI keeps in HOME, the settings file the attack
// edits there, and the command that plants code running marker at the
// CLI's next start.
type cliState struct {
	paths    []string // relative to HOME, as the README's recipe names them
	settings string   // relative to HOME
	plant    string   // shell; {{M}} is the marker
	// planted is what run's stderr names when the copy is discarded.
	planted string
}

var cliStates = map[string]cliState{
	"claude": {
		paths:    []string{".claude", ".claude.json"},
		settings: ".claude/settings.json",
		plant:    `mkdir -p "$HOME/.claude" && printf '%s\n' '{"hooks": {"SessionStart": [{"hooks": [{"type": "command", "command": "touch {{M}}"}]}]}}' > "$HOME/.claude/settings.json"`,
		planted:  `DISCARDED added hooks.SessionStart[0].hooks[0] in ~/.claude/settings.json: command = "touch {{M}}"`,
	},
	"codex": {
		paths:    []string{".codex"},
		settings: ".codex/config.toml",
		// notify is a top-level key: it goes before the file's tables.
		plant:   `cfg="${CODEX_HOME:-$HOME/.codex}/config.toml" && { echo 'notify = ["sh", "-c", "touch {{M}}"]'; cat "$cfg"; } > "$cfg.new" && mv "$cfg.new" "$cfg"`,
		planted: `DISCARDED added notify in ~/.codex/config.toml = ["sh","-c","touch {{M}}"]`,
	},
}

// stateRun is one guarded run that plants, then the user's plain run.
type stateRun struct {
	w       *world
	agent   string
	marker  string
	logs    string   // run's stderr
	results []string // the tool results of the guarded run
	// before and after are the user's HOME around the guarded run.
	before, after map[string]string
	plainOut      string
}

// runPlantThenPlain runs agent under "fenceline run" with recipe, the
// model asking it to plant (and, with the private recipe, to write the
// user's own state directly and through .. from its HOME, and
// ~/.bashrc), then the user's plain run of the same CLI.
func runPlantThenPlain(t *testing.T, agent string, recipe stateRecipe) *stateRun {
	t.Helper()
	w := newWorld(t)
	cs := cliStates[agent]
	sr := &stateRun{w: w, agent: agent, marker: filepath.Join(w.base, "planted-ran")}
	argv := w.agentArgv(t, agent) // writes Codex's config.toml
	w.seedState(agent)
	sr.before = snapshot(t, w.home)

	m := strings.NewReplacer("{{M}}", sr.marker)
	steps := []Step{{Name: "plant", Cmd: "( " + m.Replace(cs.plant) + " && echo STEP plant=landed || echo STEP plant=refused ) 2>&1"}}
	if recipe == recipePrivate {
		own := filepath.Join(w.home, cs.settings)
		steps = append(steps, Step{Name: "reach-the-users-own", Cmd: fmt.Sprintf(`( echo x >> %[1]s && echo STEP own=landed || echo STEP own=refused
echo x >> "$HOME/../..%[1]s" && echo STEP dotdot=landed || echo STEP dotdot=refused
echo x >> %[2]s && echo STEP bashrc=landed || echo STEP bashrc=refused
mkdir -p "$HOME/locked/in" && touch "$HOME/locked/in/f" && chmod 000 "$HOME/locked/in/f" "$HOME/locked/in" "$HOME/locked" && echo STEP locked=ok ) 2>&1`, own, filepath.Join(w.home, ".bashrc"))})
	}
	w.model.SetSteps(steps)

	args := []string{w.fl, "--nats", w.busURL, "run", "--checkout", w.co, "--ttl", "2m",
		"--scope", "services/billing", "--workspace", "exclusive",
		"--allow-host", w.modelHost(), "--egress-resolve", w.modelHost() + "=127.0.0.1:" + w.modelPt}
	for _, p := range cs.paths {
		args = append(args, string(recipe), filepath.Join(w.home, p)) // the README's recipe, or the old one
	}
	args = append(append(args, "--"), argv...)
	start := time.Now()
	p := w.start(w.co, w.agentEnv(), nil, args...)
	code := p.wait(t, 4*time.Minute)
	sr.logs, sr.results = p.errOut.String(), w.model.Results()
	t.Logf("%s under fenceline run %s (%s) exited %d in %s:\n%s", agent, recipe, strings.Join(cs.paths, ", "), code, time.Since(start).Round(time.Millisecond), sr.logs)
	if code != 0 || !w.model.Finished() {
		t.Fatalf("the guarded run: exit %d, finished %v\nstdout:\n%s", code, w.model.Finished(), p.out)
	}
	if marker(sr.results[0], "plant") != "landed" {
		t.Fatalf("the agent could not plant (the attack did not happen): %q", sr.results[0])
	}
	if _, err := os.Lstat(sr.marker); err == nil {
		t.Fatalf("the planted command ran during the guarded run: %s exists", sr.marker)
	}
	sr.after = snapshot(t, w.home)

	// The user's next plain run: no fenceline, the user's own HOME, the
	// model by its address.
	w.model.SetSteps(nil) // every request gets the final answer
	reqs := w.model.Requests()
	start = time.Now()
	plain := w.start(w.co, w.plainEnv(), nil, w.plainArgv(t, agent)...)
	pcode := plain.wait(t, 2*time.Minute)
	sr.plainOut = plain.out.String() + plain.errOut.String()
	t.Logf("the plain run of %s exited %d in %s", agent, pcode, time.Since(start).Round(time.Millisecond))
	if pcode != 0 || w.model.Requests() == reqs {
		t.Fatalf("the plain run: exit %d, %d model requests\n%s", pcode, w.model.Requests()-reqs, sr.plainOut)
	}
	return sr
}

// stateFlags is the README's recipe for agent's CLI state: a private
// copy of each of its paths.
func (w *world) stateFlags(agent string) []string {
	var fl []string
	for _, p := range cliStates[agent].paths {
		fl = append(fl, string(recipePrivate), filepath.Join(w.home, p))
	}
	return fl
}

// plainEnv is the user's environment for a plain run: agentEnv, the
// model by its IP (no egress proxy resolves its name).
func (w *world) plainEnv() []string {
	return w.agentEnv("ANTHROPIC_BASE_URL=https://127.0.0.1:" + w.modelPt)
}

// plainArgv is the user's plain command line: the same CLI, its model
// by IP (for Codex a -c override; its config.toml names the model).
func (w *world) plainArgv(t *testing.T, agent string) []string {
	bin := agentBin(t, agent)
	if agent == "codex" {
		return []string{bin, "-c", `model_providers.scripted.base_url="https://127.0.0.1:` + w.modelPt + `/v1"`,
			"exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--ephemeral", "--json", prompt}
	}
	return []string{bin, "-p", prompt, "--output-format", "json", "--max-turns", "5", "--dangerously-skip-permissions"}
}

// seedState gives the user some state of agent's CLI before the run:
// Claude Code's settings.json and .claude.json (Codex's config.toml is
// agentArgv's).
func (w *world) seedState(agent string) {
	w.t.Helper()
	if agent == "claude" {
		for p, c := range map[string]string{
			".claude/settings.json": `{"permissions": {"deny": ["Bash(rm -rf:*)"]}}` + "\n",
			".claude.json":          `{"numStartups": 1}` + "\n",
		} {
			os.MkdirAll(filepath.Join(w.home, filepath.Dir(p)), 0o700)
			if err := os.WriteFile(filepath.Join(w.home, p), []byte(c), 0o600); err != nil {
				w.t.Fatal(err)
			}
		}
	}
	if w.user.cred != nil {
		if err := chownR(w.home, w.user.uid, w.user.gid); err != nil {
			w.t.Fatal(err)
		}
	}
}

// snapshot is every path beneath dir with its type and content.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			l, _ := os.Readlink(p)
			out[rel] = "link " + l
		case d.IsDir():
			out[rel] = "dir"
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[rel] = fmt.Sprintf("file %x", sha256.Sum256(b))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffSnapshots(before, after map[string]string) []string {
	var d []string
	for p, v := range before {
		if a, ok := after[p]; !ok {
			d = append(d, p+" removed")
		} else if a != v {
			d = append(d, p+" changed")
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			d = append(d, p+" added")
		}
	}
	return d
}

// mustNotPersist: with the README's recipe the plant lands in the
// agent's private copy only; the user's HOME is as it was (not one path
// added or changed), the direct writes to it were refused, run's stderr
// names what was discarded, and the plain run executes nothing planted.
func (sr *stateRun) mustNotPersist(t *testing.T) {
	t.Helper()
	cs := cliStates[sr.agent]
	if d := diffSnapshots(sr.before, sr.after); len(d) > 0 {
		t.Errorf("the guarded run changed the user's HOME: %q", d)
	}
	for _, k := range []string{"own", "dotdot", "bashrc"} {
		if got := marker(sr.results[1], k); got != "refused" {
			t.Errorf("the agent's write to the user's own state (%s): %q; it saw %q", k, got, gist(sr.results[1]))
		}
	}
	want := strings.NewReplacer("{{M}}", sr.marker).Replace(cs.planted)
	for _, w := range []string{want, "private state: the agent's HOME is", "private state: discarded"} {
		if !strings.Contains(sr.logs, w) {
			t.Errorf("run's stderr does not say %q", w)
		}
	}
	if _, err := os.Lstat(sr.marker); err == nil {
		t.Errorf("the user's plain run executed what the agent planted: %s exists", sr.marker)
	}
	// The copy is gone, also the dirs the agent locked (chmod 000).
	if m := regexp.MustCompile(`the agent's HOME is (\S+),`).FindStringSubmatch(sr.logs); m == nil {
		t.Error("run did not name the agent's HOME")
	} else if _, err := os.Lstat(m[1]); !errors.Is(err, fs.ErrNotExist) || marker(sr.results[1], "locked") != "ok" {
		t.Errorf("the private HOME %s after the run: %v (the agent's locked dirs: %q)", m[1], err, marker(sr.results[1], "locked"))
	}
}

// TestClaudeStateStaysPrivate: Claude Code under the README's recipe
// (--private-state ~/.claude --private-state ~/.claude.json) adds a
// SessionStart hook; it never reaches the user's next plain claude.
func TestClaudeStateStaysPrivate(t *testing.T) {
	runPlantThenPlain(t, "claude", recipePrivate).mustNotPersist(t)
}

// TestCodexStateStaysPrivate: Codex under the README's recipe
// (--private-state ~/.codex, CODEX_HOME pointing into it) adds a notify
// command; it never reaches the user's next plain codex exec.
func TestCodexStateStaysPrivate(t *testing.T) {
	runPlantThenPlain(t, "codex", recipePrivate).mustNotPersist(t)
}

// mustPersist: the old recipe (--allow-write on the CLI's state) lets the
// plant land in the user's own settings and the user's plain run execute
// it — the attack the recipe changed for.
func (sr *stateRun) mustPersist(t *testing.T) {
	t.Helper()
	settings, _ := os.ReadFile(filepath.Join(sr.w.home, cliStates[sr.agent].settings))
	if !strings.Contains(string(settings), sr.marker) {
		t.Errorf("the plant did not reach the user's settings: %s", settings)
	}
	if _, err := os.Lstat(sr.marker); err != nil {
		t.Errorf("the user's plain run did not execute the planted command (%v): the attack test proves nothing\n%s", err, sr.plainOut)
	}
}

// TestClaudeStateAttackAllowWrite: the old recipe, --allow-write
// ~/.claude: the agent's SessionStart hook runs, unguarded, at the user's
// next plain claude.
func TestClaudeStateAttackAllowWrite(t *testing.T) {
	runPlantThenPlain(t, "claude", recipeAllowWrite).mustPersist(t)
}

// TestCodexStateAttackAllowWrite: the old recipe, --allow-write
// ~/.codex: the agent's notify command runs, unguarded, at the user's
// next plain codex exec.
func TestCodexStateAttackAllowWrite(t *testing.T) {
	runPlantThenPlain(t, "codex", recipeAllowWrite).mustPersist(t)
}
