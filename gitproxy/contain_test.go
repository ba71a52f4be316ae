package gitproxy

import (
	"bytes"
	"compress/zlib"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
	"github.com/fenceline/fenceline/lease"
)

// forgeRootTree is the attack of issue 22 (4) on the agent's repository
// dir: the loose object of the upstream tip's root tree is overwritten
// with a forged tree, under the genuine tree's id. The forged tree is
// the tree of commit (the agent's) with one top-level entry, keep, taken
// from the tip instead: a diff from it to commit's tree shows only keep
// changed.
func forgeRootTree(t *testing.T, dir, tip, commit, keep string) {
	t.Helper()
	genuine := strings.TrimSpace(mustGit(t, dir, "rev-parse", tip+"^{tree}"))
	// Every object loose, so the forged one is the only copy.
	packs, _ := filepath.Glob(filepath.Join(dir, ".git", "objects", "pack", "*.pack"))
	for _, p := range packs {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		os.Remove(p)
		os.Remove(strings.TrimSuffix(p, ".pack") + ".idx")
		os.Remove(strings.TrimSuffix(p, ".pack") + ".rev")
		cmd := execGit(dir, "unpack-objects", "-q")
		cmd.Stdin = bytes.NewReader(data)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("unpack-objects: %v\n%s", err, out)
		}
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(mustGit(t, dir, "ls-tree", commit)), "\n") {
		if strings.HasSuffix(l, "\t"+keep) {
			l = strings.TrimSpace(mustGit(t, dir, "ls-tree", tip, keep))
		}
		lines = append(lines, l)
	}
	cmd := execGit(dir, "mktree")
	cmd.Stdin = strings.NewReader(strings.Join(lines, "\n") + "\n")
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	forged := strings.TrimSpace(string(out))
	content := mustGit(t, dir, "cat-file", "tree", forged)
	var z bytes.Buffer
	zw := zlib.NewWriter(&z)
	zw.Write([]byte("tree " + strconv.Itoa(len(content)) + "\x00" + content))
	zw.Close()
	p := filepath.Join(dir, ".git", "objects", genuine[:2], genuine[2:])
	os.MkdirAll(filepath.Dir(p), 0o755)
	os.Remove(p)
	if err := os.WriteFile(p, z.Bytes(), 0o444); err != nil {
		t.Fatal(err)
	}
}

// TestHookRunsNoTrap: the server's repository configures every program
// git can run (but its hooks path, which would replace the hook under
// test, and core.alternateRefsCommand, which receive-pack itself runs);
// the pre-receive hook's own git commands run none of them while a fenced
// push goes through.
func TestHookRunsNoTrap(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.installHook(false)
	tpl := t.TempDir()
	marker := filepath.Join(t.TempDir(), "ran")
	if err := gittrap.Plant(tpl, "", filepath.Join(t.TempDir(), "traps"), marker); err != nil {
		t.Fatal(err)
	}
	cfg, _ := os.ReadFile(filepath.Join(tpl, "config"))
	var keep []string
	for _, l := range strings.Split(string(cfg), "\n") {
		// The server's receive-pack runs core.alternateRefsCommand itself
		// (its connectivity check in quarantine): that is the server's git.
		if !strings.Contains(l, "hooksPath") && !strings.Contains(l, "alternateRefsCommand") {
			keep = append(keep, l)
		}
	}
	f, err := os.OpenFile(filepath.Join(e.bare, "config"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(strings.Join(keep, "\n"))
	f.Close()
	os.MkdirAll(filepath.Join(e.bare, "info"), 0o755)
	os.WriteFile(filepath.Join(e.bare, "info", "attributes"), []byte("* filter=trap diff=trap\n"), 0o644)

	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.gs.srv.URL)
	e.commit(dir, "billing", "services/billing/invoice.go", "billing\n")
	opts := signed(t, e.hookKey, testRepo, l.Record, e.updateOf(dir))
	mustPush(t, dir, append(pushOpts(opts), e.gs.url("payments.git"), "HEAD:main")...)
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the hook ran the server repository's programs:\n%s", ran)
	}
}
