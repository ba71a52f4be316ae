package gitproxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// objectFiles lists every file of the upstream's object store: a refused
// push must leave it exactly as it was.
func objectFiles(t *testing.T, bare string) []string {
	t.Helper()
	var files []string
	filepath.WalkDir(filepath.Join(bare, "objects"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, p)
		}
		return nil
	})
	return files
}

func TestBadInputIsRefusedAndNothingForwarded(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	srv := e.proxy(l, func(c *Config) { c.MaxPushBytes = 1 << 20 })
	// A real pack to truncate: what git would send for one in-scope commit.
	dir := e.clone(srv.URL)
	base := e.upstreamRef("refs/heads/main")
	head := e.commit(dir, "x", "services/billing/x.go", "package billing // x\n")
	packCmd := gitPack(t, dir, head, base)
	cmd := func(caps string) []byte {
		return appendFlush(appendPkt(nil, base, " ", head, " refs/heads/main\x00", caps))
	}
	before := objectFiles(t, e.bare)

	cases := []struct {
		name   string
		body   []byte
		status int    // HTTP status; 200 with a report once the request names a ref and asks for one
		want   string // in the response
	}{
		{"malformed pkt-line", []byte("zzzz0000"), 400, "malformed pkt-line header"},
		{"bogus object id", appendFlush(appendPkt(nil, "nothex", " ", head, " refs/heads/main\x00report-status")), 200, "ng refs/heads/main fenceline: bad push request: malformed push command"},
		{"oversized line", []byte("ffff" + strings.Repeat("a", 100)), 400, "longer than git's maximum"},
		{"truncated line", []byte("0064" + base), 400, "pkt-line truncated"},
		{"no flush", appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status"), 200, "ng refs/heads/main fenceline: bad push request: read push commands: request ended before a flush packet"},
		{"bad ref name", appendFlush(appendPkt(nil, base, " ", head, " refs/heads/../x\x00report-status")), 400, "invalid ref name"},
		{"not under refs", appendFlush(appendPkt(nil, base, " ", head, " HEAD\x00report-status")), 400, "must start with refs/"},
		{"sha256", appendFlush(appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status object-format=sha256")), 200, "ng refs/heads/main fenceline: bad push request: object format"},
		{"signed push", appendFlush(appendPkt(nil, "push-cert\x00report-status")), 400, "signed pushes"},
		{"truncated pack", append(cmd("report-status"), packCmd[:len(packCmd)/2]...), 200, "ng refs/heads/main fenceline: pack not accepted"},
		{"pack checksum wrong", append(cmd("report-status"), flipLast(packCmd)...), 200, "ng refs/heads/main fenceline: pack not accepted"},
		{"no pack", cmd("report-status"), 200, "ng refs/heads/main fenceline: pack not accepted"},
		{"garbage pack", append(cmd("report-status"), []byte("PACK garbage that is not a pack")...), 200, "pack not accepted"},
		{"too large", append(cmd("report-status side-band-64k"), bytes.Repeat([]byte("x"), 2<<20)...), 200, "larger than the proxy accepts"},
		{"pack on delete-only push", append(appendFlush(appendPkt(nil, base, " ", zeroOID, " refs/heads/main\x00report-status")), "PACK"...), 200, "must not carry a pack"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(srv.URL+"/payments.git/git-receive-pack", "application/x-git-receive-pack-request", bytes.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status || !bytes.Contains(body, []byte(tc.want)) {
				t.Fatalf("status %d body %q, want %d with %q", resp.StatusCode, body, tc.status, tc.want)
			}
		})
	}
	if got := e.upstreamRef("refs/heads/main"); got != base {
		t.Fatalf("upstream main moved to %s", got)
	}
	if after := objectFiles(t, e.bare); strings.Join(after, "\n") != strings.Join(before, "\n") {
		t.Fatalf("upstream object store changed:\nbefore %v\nafter  %v", before, after)
	}
	// The same pack, whole, lands: the cases above failed for their input.
	resp, err := http.Post(srv.URL+"/payments.git/git-receive-pack", "application/x-git-receive-pack-request",
		bytes.NewReader(append(cmd("report-status"), packCmd...)))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Contains(body, []byte("ok refs/heads/main")) || e.upstreamRef("refs/heads/main") != head {
		t.Fatalf("whole push not accepted: %d %q", resp.StatusCode, body)
	}
}

// gitPack returns the pack git would send to move a ref from base to head.
func gitPack(t *testing.T, dir, head, base string) []byte {
	t.Helper()
	c := execGit(dir, "pack-objects", "--stdout", "--revs")
	c.Stdin = strings.NewReader(head + "\n^" + base + "\n")
	out, err := c.Output()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func flipLast(b []byte) []byte {
	c := bytes.Clone(b)
	c[len(c)-1] ^= 0xff
	return c
}

// TestClientVanishesMidPack: a client that disconnects halfway through its
// pack leaves the upstream untouched and the proxy with nothing running.
func TestClientVanishesMidPack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	tmp := t.TempDir()
	srv := e.proxy(l, func(c *Config) { c.TempDir = tmp })
	dir := e.clone(srv.URL)
	base := e.upstreamRef("refs/heads/main")
	head := e.commit(dir, "x", "services/billing/x.go", "x\n")
	pack := gitPack(t, dir, head, base)
	before := objectFiles(t, e.bare)

	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(conn)
	w.WriteString("POST /payments.git/git-receive-pack HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-git-receive-pack-request\r\nTransfer-Encoding: chunked\r\n\r\n")
	part := append(appendFlush(appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status")), pack[:len(pack)/2]...)
	w.WriteString(strings.ToUpper(strconvHex(len(part))) + "\r\n")
	w.Write(part)
	w.WriteString("\r\n")
	w.Flush()
	conn.Close()

	// The proxy gives up on the push (its quarantine goes away) and
	// nothing lands upstream.
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		entries, err := os.ReadDir(tmp)
		if err != nil || len(entries) != 0 {
			return fmt.Errorf("push quarantine still there: %v %v", entries, err)
		}
		return nil
	})
	if got := e.upstreamRef("refs/heads/main"); got != base {
		t.Fatalf("upstream main moved to %s", got)
	}
	if strings.Join(objectFiles(t, e.bare), "\n") != strings.Join(before, "\n") {
		t.Fatal("upstream object store changed")
	}
}

func strconvHex(n int) string {
	const digits = "0123456789abcdef"
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n >>= 4 {
		b = append([]byte{digits[n&0xf]}, b...)
	}
	return string(b)
}
