//go:build integration

package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// TestExclusiveRunReplacedGitDirUndone: an exclusive attempt without a
// pool moves the checkout's .git aside, plants every trap in it, and puts
// a symlink to it (or a .git file naming it) where .git was. The restore
// must not write the snapshot through the link and leave the added hooks
// and config beside it: after the run, the user's git in the checkout
// runs none of the attempt's programs.
func TestExclusiveRunReplacedGitDirUndone(t *testing.T) {
	for _, how := range []string{"symlink", "gitfile"} {
		t.Run(how, func(t *testing.T) {
			isolate(t)
			url := startBus(t)
			co := newCheckout(t, "")
			ctl := newCtl(t)
			kit := newTrapKit(t, ctl)
			link := `ln -s moved .git`
			if how == "gitfile" {
				link = `echo "gitdir: moved" > .git`
			}
			script := strings.Join([]string{
				`set -e`,
				`mv .git moved`,
				`(` + kit.plant("moved") + `)`,
				link,
				`echo planted`,
			}, "\n")
			r := runFL(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
			mustContain(t, "attempt", r.stdout, "planted")
			mustContain(t, "run", r.stderr, ".git (replaced; the attempt's moved to .git.fenceline-undone-", ".git (moved to moved; put back)", ".git/hooks/pre-commit (added)")
			// The trap the attempt's own git status ran is the attempt's
			// business (guarded); what follows is the user's.
			os.Remove(kit.marker)
			os.Remove(filepath.Join(co, ".gitattributes"))
			os.WriteFile(filepath.Join(co, "README.md"), []byte("user edit\n"), 0o644)
			userGit(co, "status", "--porcelain")
			userGit(co, "commit", "-qam", "user")
			if ran := gittrap.Ran(kit.marker); ran != "" {
				t.Errorf("the user's git ran the attempt's programs:\n%s\nrun's stderr:\n%s", ran, r.stderr)
			}
			if fi, err := os.Lstat(filepath.Join(co, ".git")); err != nil || !fi.IsDir() {
				t.Errorf("the checkout's .git after the run: %v %v", fi, err)
			}
		})
	}
}
