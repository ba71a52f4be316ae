package cli

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// trapKit is what an attacking agent copies into git dirs: a config
// section, hooks and info/attributes (gittrap's), made by the test in a
// directory the agent may read, with the scripts and the marker outside
// every checkout.
type trapKit struct{ tpl, marker string }

func newTrapKit(t *testing.T, ctl ctlDir) trapKit {
	t.Helper()
	k := trapKit{tpl: ctl.path("tpl"), marker: ctl.path("ran")}
	os.MkdirAll(k.tpl, 0o755)
	if err := gittrap.Plant(k.tpl, "", ctl.path("scripts"), k.marker); err != nil {
		t.Fatal(err)
	}
	return k
}

// plant is the agent's shell code that plants the kit into git dir $1.
func (k trapKit) plant(gitDir string) string {
	return strings.NewReplacer("TPL", k.tpl, "GD", gitDir).Replace(
		`cat TPL/config >> GD/config && mkdir -p GD/hooks GD/info && cp TPL/hooks/* GD/hooks/ && cp TPL/info/attributes GD/info/ && cp TPL/info/attributes .gitattributes`)
}

// userGit runs git as the user does, with the repository's config and hooks.
func userGit(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=u", "GIT_AUTHOR_EMAIL=u@localhost", "GIT_COMMITTER_NAME=u", "GIT_COMMITTER_EMAIL=u@localhost")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestExclusiveRunRestoresTheCheckoutsGitDir is issue 22's attack 1
// without a pool: an exclusive attempt in the user's checkout (git dir
// writable) plants every trap there. At settle the run puts back the
// config and hooks the user had and says what it undid; the user's git
// status runs none of it.
func TestExclusiveRunRestoresTheCheckoutsGitDir(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	ctl := newCtl(t)
	kit := newTrapKit(t, ctl)
	cfgBefore, _ := os.ReadFile(filepath.Join(co, ".git", "config"))
	script := `(` + kit.plant(filepath.Join(co, ".git")) + `) && echo planted`
	r := runFL(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "planted")
	mustContain(t, "run", r.stderr, "restored the checkout's git configuration and hooks", ".git/config (changed)", ".git/hooks/post-checkout (added)")
	if b, _ := os.ReadFile(filepath.Join(co, ".git", "config")); string(b) != string(cfgBefore) {
		t.Errorf("the checkout's config after the run:\n%s", b)
	}
	os.Remove(filepath.Join(co, ".gitattributes"))
	os.WriteFile(filepath.Join(co, "README.md"), []byte("user edit\n"), 0o644)
	if out, err := userGit(co, "status", "--porcelain"); err != nil || !strings.Contains(out, "README.md") {
		t.Errorf("the user's git status: %q, %v", out, err)
	}
	userGit(co, "commit", "-qam", "user")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("the user's git ran the attempt's programs:\n%s", ran)
	}
}
