//go:build integration

package cli

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// TestRunNestedRepoTrapUndone: a path-leased attempt (shared
// workspace, git dir read-only) makes a repository inside its own claim
// whose config and hooks name programs: a .git directory, a .git file
// naming a git dir outside the checkout, or a bare repository whose
// core.worktree is itself. The user's plain git status in that directory
// ran them, unconfined (and they could write any path). At settle the run
// disarms every repository the attempt made in its claim and says so; the
// user's git there runs nothing of it. "pooled" is the .git directory in
// a shard's claim, left there for the coordinator; "pooled-exclusive" the
// same in an exclusive attempt's shard, which cleaning empties.
func TestRunNestedRepoTrapUndone(t *testing.T) {
	for _, how := range []string{"dotgit", "gitfile", "bare", "pooled", "pooled-exclusive"} {
		t.Run(how, func(t *testing.T) {
			isolate(t)
			url := startBus(t)
			ctl := newCtl(t)
			pooled := strings.HasPrefix(how, "pooled")
			var co string
			if pooled {
				co = newPool(t, url, 1, 2)
			} else {
				co = newCheckout(t, "")
			}
			args := []string{"--checkout", co, "--scope", "in", "--allow-write", string(ctl)}
			if how == "pooled-exclusive" {
				args = append(args, "--workspace", "exclusive")
			}
			kit := newTrapKit(t, ctl)
			gd, dir := "in/sub/.git", "in/sub"
			base := `[core]\n\trepositoryformatversion = 0\n\tbare = false\n`
			var link string
			switch how {
			case "gitfile":
				gd = ctl.path("elsewhere.git")
				link = `echo "gitdir: ` + gd + `" > in/sub/.git`
			case "bare":
				gd, dir = "in/bare", "in/bare"
				base += `\tworktree = .\n`
			}
			script := strings.Join([]string{
				`set -e`,
				`mkdir -p ` + dir + ` ` + gd + `/objects ` + gd + `/refs/heads`,
				`echo "ref: refs/heads/main" > ` + gd + `/HEAD`,
				`printf '` + base + `' > ` + gd + `/config`,
				`gd=$(cd ` + gd + ` && pwd) && cd ` + dir + ` && (` + kit.plant("$gd") + `) && cd -`,
				link,
				`echo hello > ` + dir + `/work && echo planted`,
			}, "\n")
			r := runFL(t, url, append(args, "--", "sh", "-c", script)...).want(t, ExitOK)
			mustContain(t, "attempt", r.stdout, "planted")
			switch how {
			case "pooled-exclusive":
				mustContain(t, "run", r.stderr, "shard-1 cleaned for the next attempt")
			case "bare":
				mustContain(t, "run", r.stderr, "in/bare (a repository the attempt made: its HEAD moved to HEAD.fenceline-undone-")
			default:
				mustContain(t, "run", r.stderr, "in/sub/.git (added; moved to in/sub/.git.fenceline-undone-")
			}
			os.Remove(kit.marker)
			if pooled {
				co = poolJSON(t, url, co).Shards[0].Path
			}
			nested := filepath.Join(co, filepath.FromSlash(dir))
			os.MkdirAll(nested, 0o755)
			os.WriteFile(filepath.Join(nested, "work"), []byte("user edit\n"), 0o644)
			gitRun(t, nested, nil, "status")
			gitRun(t, nested, nil, "diff")
			gitRun(t, nested, nil, "log", "-1")
			if ran := gittrap.Ran(kit.marker); ran != "" {
				t.Errorf("the user's git in %s ran the attempt's programs:\n%s\nrun's stderr:\n%s", dir, ran, r.stderr)
			}
		})
	}
}

// TestExclusiveRunForgedObjectsUndone: an exclusive attempt without a
// pool, claiming in/ (git dir writable, out/ not), forges the object
// store. It rewrites README.md's loose blob in place (same id, its own
// bytes): git trusts a loose object's name, so the user's git checkout --
// README.md and git worktree add wrote the attempt's bytes, and git diff
// showed nothing. And it commits a change to out/seed, an unclaimed path,
// with a forged objects/info/commit-graph that gives the commit the tree
// of an honest one (in/seed alone): git believes the commit-graph over
// the commit, so git show, git log -p and git diff hid the change to
// out/seed from a review, while a push sends it. At settle the run checks
// what the attempt wrote to the object store: the rewritten object is put
// back, the commit-graph removed, and it says so.
func TestExclusiveRunForgedObjectsUndone(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	ctl := newCtl(t)
	readme := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "HEAD:README.md"))
	// The attempt's commit, made the same way the test makes it in a copy
	// first (fixed identity and dates: the same ids), to forge the graph.
	commit := strings.Join([]string{
		`export GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@a GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@a`,
		`export GIT_AUTHOR_DATE="@1700000000 +0000" GIT_COMMITTER_DATE="@1700000000 +0000"`,
		`export GIT_INDEX_FILE=$TMPDIR/forge-index`,
		`git read-tree HEAD`,
		`git update-index --cacheinfo 100644,$(echo tidy | git hash-object -w --stdin),in/seed`,
		`git write-tree > $TMPDIR/honest-tree`,
		`git update-index --cacheinfo 100644,$(echo evil | git hash-object -w --stdin),out/seed`,
		`c=$(git commit-tree $(git write-tree) -p HEAD -m "in: tidy")`,
		`unset GIT_INDEX_FILE`,
		`git update-ref refs/heads/main $c && git read-tree $c && echo tidy > in/seed`,
	}, "\n")
	graph := forgedGraph(t, co, commit)
	os.WriteFile(ctl.path("graph"), graph, 0o644)
	obj := ".git/objects/" + readme[:2] + "/" + readme[2:]
	script := strings.Join([]string{
		`set -e`,
		`evil=$(echo evil | git hash-object -w --stdin)`,
		`chmod u+w ` + obj + ` && cat .git/objects/$(echo $evil | cut -c1-2)/$(echo $evil | cut -c3-) > ` + obj,
		commit,
		`cp ` + ctl.path("graph") + ` .git/objects/info/commit-graph`,
		`git show --stat --format= HEAD | grep -q out/seed || echo hidden`,
	}, "\n")
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--workspace", "exclusive", "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "hidden")
	mustContain(t, "run", r.stderr, obj[len(".git/"):], "objects/info/commit-graph")

	os.WriteFile(filepath.Join(co, "README.md"), []byte("user edit\n"), 0o644)
	if out, err := gitRun(t, co, nil, "checkout", "--", "README.md"); err != nil {
		t.Errorf("the user's git checkout -- README.md: %v\n%s", err, out)
	}
	if b, _ := os.ReadFile(filepath.Join(co, "README.md")); string(b) != "payments\n" {
		t.Errorf("the user's git checkout -- README.md wrote %q, want payments (run's stderr:\n%s)", b, r.stderr)
	}
	wt := filepath.Join(t.TempDir(), "wt")
	if out, err := gitRun(t, co, nil, "worktree", "add", "-q", "--detach", wt, "HEAD"); err != nil {
		t.Errorf("the user's git worktree add: %v\n%s", err, out)
	}
	for f, want := range map[string]string{"README.md": "payments\n", "out/seed": "evil\n"} {
		if b, _ := os.ReadFile(filepath.Join(wt, f)); string(b) != want {
			t.Errorf("git worktree add wrote %s as %q, want %q", f, b, want)
		}
	}
	for _, args := range [][]string{
		{"show", "--stat", "--format=", "HEAD"},
		{"log", "-p", "-1"},
		{"diff", "HEAD~1", "HEAD"},
	} {
		if out, err := gitRun(t, co, nil, args...); err != nil || !strings.Contains(out, "out/seed") {
			t.Errorf("the user's git %s hides the change to out/seed: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// forgedGraph makes, in a copy of the checkout co, the commit the shell
// code commit makes, and returns a commit-graph that lists that commit
// with the tree of an honest one (in/seed changed alone: the tree commit
// writes to $TMPDIR/honest-tree).
func forgedGraph(t *testing.T, co, commit string) []byte {
	t.Helper()
	cp := filepath.Join(t.TempDir(), "copy")
	mustGitRun(t, co, nil, "clone", "-q", "--no-local", co, cp)
	tmp := t.TempDir()
	mustGitRun(t, cp, []string{"TMPDIR=" + tmp}, "-c", "alias.x=!sh -c '"+strings.ReplaceAll(commit, "'", `'\''`)+"'", "x")
	c := strings.TrimSpace(mustGitRun(t, cp, nil, "rev-parse", "HEAD"))
	honest, _ := os.ReadFile(filepath.Join(tmp, "honest-tree"))
	for i := range 64 {
		h := strings.TrimSpace(mustGitRun(t, cp, nil, "commit-tree", strings.TrimSpace(string(honest)), "-p", "HEAD~1", "-m", "honest "+strconv.Itoa(i)))
		os.Remove(filepath.Join(cp, ".git", "objects", "info", "commit-graph"))
		cmd := []string{"-c", "alias.g=!echo " + h + " | git commit-graph write --stdin-commits", "g"}
		mustGitRun(t, cp, nil, cmd...)
		b, err := os.ReadFile(filepath.Join(cp, ".git", "objects", "info", "commit-graph"))
		if err != nil {
			t.Fatal(err)
		}
		if forged, err := gittrap.ForgeCommitGraph(b, h, c); err == nil {
			return forged
		}
	}
	t.Fatal("no honest commit sorts in the attempt's commit's place")
	return nil
}

// TestCommitCapacityForgedObjectUndone: a commit capacity writes its
// shard's git dir, whose object store is not wiped after it (only an
// exclusive attempt's cleaning does that). One rewrites in place the
// loose blob an earlier commit capacity wrote there: the shard's later
// path-leased attempts, and the coordinator's git in the shard, read the
// attempt's bytes under that blob's id. At settle the shard's object
// store is checked like a checkout's: the blob is put back.
func TestCommitCapacityForgedObjectUndone(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	runFL(t, url, "--checkout", co, "--", "true").want(t, ExitOK) // creates shard-1
	commit := func(script string) result {
		return fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--exclusive", "--", "sh", "-c", script).want(t, ExitOK)
	}
	commit(`echo x > in/x && git add -A && git -c user.name=c -c user.email=c@c commit -qm one`)
	sh := poolJSON(t, url, co).Shards[0].Path
	blob := strings.TrimSpace(mustGitRun(t, sh, nil, "rev-parse", "HEAD:in/x"))
	obj := ".git/objects/" + blob[:2] + "/" + blob[2:]
	r := commit(strings.Join([]string{
		`set -e`,
		`evil=$(echo evil | git hash-object -w --stdin)`,
		`chmod u+w ` + obj + ` && cat .git/objects/$(echo $evil | cut -c1-2)/$(echo $evil | cut -c3-) > ` + obj,
		`git cat-file -p ` + blob,
	}, "\n"))
	mustContain(t, "commit capacity", r.stdout, "evil")
	mustContain(t, "commit capacity", r.stderr, obj[len(".git/"):]+" (written by the attempt, its content does not hash to its name: put back)")
	if out, err := gitRun(t, sh, nil, "cat-file", "-p", blob); err != nil || out != "x\n" {
		t.Errorf("the shard's %s after the commit capacity: %q, %v", blob, out, err)
	}
}

// TestSharedRunForgedObjectInNestedRepoUndone: the user keeps a
// repository of their own inside a path-leased attempt's claim (in/lib, a
// clone the checkout ignores). The attempt may write it all, objects
// included: it rewrites in place the loose blob of in/lib/x, and the
// user's git checkout -- x there wrote the attempt's bytes. At settle
// the object stores of the user's repositories in the claim are checked.
func TestSharedRunForgedObjectInNestedRepoUndone(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	lib := filepath.Join(co, "in", "lib")
	os.MkdirAll(lib, 0o755)
	mustGitRun(t, lib, nil, "init", "-q")
	os.WriteFile(filepath.Join(lib, "x"), []byte("true\n"), 0o644)
	mustGitRun(t, lib, nil, "add", "x")
	mustGitRun(t, lib, nil, "commit", "-qm", "lib")
	blob := strings.TrimSpace(mustGitRun(t, lib, nil, "rev-parse", "HEAD:x"))
	obj := "in/lib/.git/objects/" + blob[:2] + "/" + blob[2:]
	script := strings.Join([]string{
		`set -e`,
		`evil=$(echo evil | git -C in/lib hash-object -w --stdin)`,
		`chmod u+w ` + obj + ` && cat in/lib/.git/objects/$(echo $evil | cut -c1-2)/$(echo $evil | cut -c3-) > ` + obj,
		`echo forged`,
	}, "\n")
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "forged")
	mustContain(t, "run", r.stderr, obj+" (written by the attempt, its content does not hash to its name: put back)")
	os.WriteFile(filepath.Join(lib, "x"), []byte("user edit\n"), 0o644)
	gitRun(t, lib, nil, "checkout", "--", "x")
	if b, _ := os.ReadFile(filepath.Join(lib, "x")); string(b) != "true\n" {
		t.Errorf("the user's git checkout -- x in in/lib wrote %q, want true", b)
	}
}
