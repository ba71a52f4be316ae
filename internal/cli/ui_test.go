//go:build integration

package cli

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// browser starts headless Chromium (Debian's chromium, which .ci/run
// installs) and returns a tab's context.
func browser(t *testing.T) context.Context {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatalf("the run UI tests need Chromium: apt-get install chromium (.ci/run does): %v", err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // tests run as root
		chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	tab, cancelTab := chromedp.NewContext(actx)
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc() // waits for the browser process to exit
	})
	if err := chromedp.Do(tab); err != nil { // starts the browser
		t.Fatalf("start chromium: %v", err)
	}
	return tab
}

// within runs action in tab and returns its value, failing t if it takes
// longer than d.
func within[T any](t *testing.T, tab context.Context, d time.Duration, what string, action chromedp.Action[T]) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(tab, d)
	defer cancel()
	v, err := chromedp.Run(ctx, action)
	if err != nil {
		page, _ := chromedp.Run(tab, chromedp.OuterHTML(chromedp.CSS("main")))
		t.Fatalf("%s: not within %s: %v\npage:\n%s", what, d, err, page)
	}
	return v
}

var uiURLRe = regexp.MustCompile(`run UI: (http://\S+)`)

// TestRunUIInBrowser drives the run UI of "fenceline bus serve --ui" in
// real headless Chromium: a lease acquired from the CLI appears within 2 s,
// its release updates the row in place (no reload), and a push refused by
// the git fence shows up in the audit feed.
func TestRunUIInBrowser(t *testing.T) {
	isolate(t)
	store := filepath.Join(t.TempDir(), "bus")
	setCfg(t, func(c *config) { c.Creds = filepath.Join(store, "creds") }) // the bus makes them there; the commands below find them
	busURL, out, _, _ := serveInProcess(t, "--listen", "127.0.0.1:0", "--store", store, "--ui", "127.0.0.1:0")
	var uiURL string
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		m := uiURLRe.FindStringSubmatch(out.String())
		if m == nil {
			return fmt.Errorf("no run UI URL in %q", out.String())
		}
		uiURL = m[1]
		return nil
	})
	tab := browser(t)
	within(t, tab, 10*time.Second, "page live", chromedp.Steps(
		chromedp.Navigate(uiURL),
		chromedp.WaitVisible(chromedp.CSS(`#conn[data-state="live"]`))))
	within(t, tab, 2*time.Second, "mark the document", chromedp.Evaluate[bool](`window.__sameDocument = true`))

	// A lease acquired from the CLI appears within 2 s.
	a := acquireJSON(t, busURL, "--scope", "services/billing", "--agent", "ui-agent")
	row := fmt.Sprintf(`#leases tr[data-lease-id=%q]`, a.LeaseID)
	within(t, tab, 2*time.Second, "acquired lease shown", chromedp.WaitVisible(chromedp.CSS(row+`[data-status="active"]`)))
	text := within(t, tab, 2*time.Second, "read the row", chromedp.Text(chromedp.CSS(row)))
	for _, want := range []string{"services/billing", "agent ui-agent", "active", "in "} {
		if !strings.Contains(text, want) {
			t.Errorf("lease row %q lacks %q", text, want)
		}
	}

	// Its release updates the row without a reload.
	fl(t, "--nats", busURL, "lease", "release", a.LeaseID).want(t, ExitOK)
	within(t, tab, 5*time.Second, "released lease shown", chromedp.WaitVisible(chromedp.CSS(row+`[data-status="released"]`)))
	if !within(t, tab, 2*time.Second, "same document", chromedp.Evaluate[bool](`window.__sameDocument === true`)) {
		t.Error("the page reloaded to show the release")
	}

	// A push refused by the git fence appears in the audit feed.
	gs, _ := seededGitServer(t)
	co := filepath.Join(t.TempDir(), "agent")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", co)
	// The commit was made before the agent ran (the file guard would not
	// let it write libs/); the agent only pushes it.
	if err := os.WriteFile(filepath.Join(co, "libs/tax/rates.go"), []byte("package tax // v2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	mustGitRun(t, co, nil, "commit", "-qam", "outside the claim")
	r := runFL(t, busURL, "--checkout", co, "--scope", "services/billing", "--workspace", "exclusive",
		"--git-upstream", gs.URL+"/payments.git", "--", "git", "push", "-q", "origin", "main")
	mustContain(t, "agent output", r.stderr, "libs/tax/rates.go is outside lease")
	feed := `#audit li[data-type="denied"][data-boundary="git"]`
	within(t, tab, 5*time.Second, "refused push in the feed", chromedp.WaitVisible(chromedp.CSS(feed)))
	text = within(t, tab, 2*time.Second, "read the feed", chromedp.Text(chromedp.CSS(feed)))
	if !strings.Contains(text, "libs/tax/rates.go") {
		t.Errorf("feed entry %q does not name the refused path", text)
	}

	// A shard pool and an attempt in it show up as they happen.
	pooled := newCheckout(t, "")
	fl(t, "--nats", busURL, "shard", "pool", "--checkout", pooled, "--size", "2").want(t, ExitOK)
	r = runFL(t, busURL, "--checkout", pooled, "--scope", "in", "--agent", "ui-pooled", "--", "true").want(t, ExitOK)
	within(t, tab, 5*time.Second, "shard shown", chromedp.WaitVisible(chromedp.CSS(`#shards tr[data-id="shard-1"]`)))
	attempt := regexp.MustCompile(`attempt (att_[a-z0-9]+)`).FindStringSubmatch(r.stderr)
	if attempt == nil {
		t.Fatalf("run named no attempt:\n%s", r.stderr)
	}
	row = fmt.Sprintf(`#attempts tr[data-id=%q]`, attempt[1])
	within(t, tab, 5*time.Second, "attempt shown", chromedp.WaitVisible(chromedp.CSS(row)))
	if text = within(t, tab, 2*time.Second, "read the attempt", chromedp.Text(chromedp.CSS(row))); !strings.Contains(text, "succeeded") || !strings.Contains(text, "ui-pooled") {
		t.Errorf("attempt row %q: want ui-pooled's attempt, succeeded", text)
	}

	// A policy set from the CLI shows, with its version, within the
	// page's refresh.
	fl(t, "--nats", busURL, "policy", "set", "--default", "-f", writeFile(t, "p.cedar", issuePolicy)).want(t, ExitOK)
	pol := `#policy .policy[data-scope="default"][data-mode="enforce"]`
	within(t, tab, 5*time.Second, "policy shown", chromedp.WaitVisible(chromedp.CSS(pol)))
	if text = within(t, tab, 2*time.Second, "read the policy", chromedp.Text(chromedp.CSS(pol))); !strings.Contains(text, "version 1") || !strings.Contains(text, "whole-repo-release-only") {
		t.Errorf("policy shown as %q: want version 1 and its text", text)
	}
}
