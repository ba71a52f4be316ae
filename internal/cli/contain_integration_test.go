//go:build integration

package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// TestShardAttemptCannotReachTheCheckout is issue 22's attack 2-3 under
// the real guard: an exclusive attempt in a shard commits, tries to move
// the checkout's main branch to its commit (git --git-dir=<checkout>/.git
// update-ref) and to plant traps in the checkout's git dir, and plants
// every trap in its own git dir. The checkout's branch, config and hooks
// are untouched; fenceline's cleaning, the user's git in the checkout and
// the next attempt in the shard run none of the traps; the attempt's
// commit is kept in the checkout.
func TestShardAttemptCannotReachTheCheckout(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	ctl := newCtl(t)
	kit := newTrapKit(t, ctl)
	mainTip := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/heads/main"))
	cfgBefore, _ := os.ReadFile(filepath.Join(co, ".git", "config"))
	coGit := filepath.Join(co, ".git")
	script := strings.Join([]string{
		`echo evil > in/evil && git add -A && git -c user.name=a -c user.email=a@a commit -qm evil`,
		`c=$(git rev-parse HEAD)`,
		`git --git-dir=` + coGit + ` update-ref refs/heads/main $c 2>/dev/null && echo MOVED-MAIN`,
		`git update-ref refs/heads/main $c`,
		`(` + kit.plant(coGit) + `) 2>/dev/null && echo PLANTED-IN-CHECKOUT`,
		`for d in $(git rev-parse --absolute-git-dir) $(git rev-parse --path-format=absolute --git-common-dir); do (` + kit.plant("$d") + `) || echo "could not plant in $d"; done`,
		`echo done`,
	}, "\n")
	r := runFL(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	att, _ := placed(t, r.stderr)
	mustContain(t, "attacking attempt", r.stdout, "done")
	for _, bad := range []string{"MOVED-MAIN", "PLANTED-IN-CHECKOUT", "could not plant"} {
		if strings.Contains(r.stdout, bad) {
			t.Errorf("attempt output says %s:\n%s\nstderr:\n%s", bad, r.stdout, r.stderr)
		}
	}
	mustContain(t, "attacking attempt", r.stderr, "undone in its git dir", "hooks/post-checkout", "config")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("fenceline ran the attempt's programs:\n%s", ran)
	}
	if got := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/heads/main")); got != mainTip {
		t.Errorf("the checkout's main moved to %s (was %s)", got, mainTip)
	}
	if b, _ := os.ReadFile(filepath.Join(co, ".git", "config")); string(b) != string(cfgBefore) {
		t.Errorf("the checkout's config changed:\n%s", b)
	}
	if out := mustGitRun(t, co, nil, "log", "-1", "--format=%s", "refs/fenceline/attempts/"+att); strings.TrimSpace(out) != "evil" {
		t.Errorf("kept commit: %q", out)
	}
	if out, err := userGit(co, "status", "--porcelain"); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("the user's git status: %q, %v", out, err)
	}
	r2 := runFL(t, url, "--checkout", co, "--", "sh", "-c", "echo x > in/x && git status --porcelain && git add -A && git -c user.name=a -c user.email=a@a commit -qm next && echo next-ok").want(t, ExitOK)
	mustContain(t, "next attempt", r2.stdout, "next-ok")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("the user's or the next attempt's git ran the first attempt's programs:\n%s", ran)
	}
}

// TestCommitCapacityPublishesAndRestores: the exclusive commit capacity
// commits in a shard and plants traps in the shard's git dir; at settle
// the shard's branch is published to the checkout by name and the git dir
// is restored, so the shard's next attempt runs none of the traps.
func TestCommitCapacityPublishesAndRestores(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	ctl := newCtl(t)
	kit := newTrapKit(t, ctl)
	runFL(t, url, "--checkout", co, "--", "true").want(t, ExitOK) // creates shard-1
	script := `echo x > in/x && git add -A && git -c user.name=c -c user.email=c@c commit -qm coord && (` + kit.plant(".git") + `) && echo planted`
	r := fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--exclusive", "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "commit capacity", r.stdout, "planted")
	mustContain(t, "commit capacity", r.stderr, "refs/heads/fenceline/shard-1 published to the checkout", "undone in its git dir", "hooks/post-checkout")
	if out := mustGitRun(t, co, nil, "log", "-1", "--format=%s", "refs/heads/fenceline/shard-1"); strings.TrimSpace(out) != "coord" {
		t.Errorf("the checkout's fenceline/shard-1: %q", out)
	}
	r2 := runFL(t, url, "--checkout", co, "--scope", "out", "--", "sh", "-c", "echo y > out/y && git status --porcelain && echo next-ok").want(t, ExitOK)
	mustContain(t, "next attempt", r2.stdout, "next-ok")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("the traps ran:\n%s", ran)
	}
}
