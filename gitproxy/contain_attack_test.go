package gitproxy

import (
	"bytes"
	"compress/zlib"
	"crypto/sha1"
	"encoding/binary"
	"encoding/hex"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// atkUnpackAll makes every object of dir's repository loose.
func atkUnpackAll(t *testing.T, dir string) {
	t.Helper()
	packs, _ := filepath.Glob(filepath.Join(dir, ".git", "objects", "pack", "*.pack"))
	for _, p := range packs {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, ext := range []string{".pack", ".idx", ".rev"} {
			os.Remove(strings.TrimSuffix(p, ".pack") + ext)
		}
		cmd := execGit(dir, "unpack-objects", "-q")
		cmd.Stdin = bytes.NewReader(data)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("unpack-objects: %v\n%s", err, out)
		}
	}
}

// atkWriteLoose writes a loose object file for id with the given header type
// and content, whatever id really is.
func atkWriteLoose(t *testing.T, dir, id, typ string, content []byte) {
	t.Helper()
	var z bytes.Buffer
	zw := zlib.NewWriter(&z)
	zw.Write([]byte(typ + " " + strconv.Itoa(len(content)) + "\x00"))
	zw.Write(content)
	zw.Close()
	p := filepath.Join(dir, ".git", "objects", id[:2], id[2:])
	os.MkdirAll(filepath.Dir(p), 0o755)
	os.Remove(p)
	if err := os.WriteFile(p, z.Bytes(), 0o444); err != nil {
		t.Fatal(err)
	}
}

// atkPackHeader is a pack object's type and size header.
func atkPackHeader(typ int, size int) []byte {
	b := []byte{byte(typ<<4) | byte(size&0x0f)}
	size >>= 4
	for size > 0 {
		b[len(b)-1] |= 0x80
		b = append(b, byte(size&0x7f))
		size >>= 7
	}
	return b
}

func atkDeflate(b []byte) []byte {
	var z bytes.Buffer
	zw := zlib.NewWriter(&z)
	zw.Write(b)
	zw.Close()
	return z.Bytes()
}

// atkInsertDelta is a git delta from base to target made of literal inserts.
func atkInsertDelta(base, target []byte) []byte {
	d := binary.AppendUvarint(nil, uint64(len(base)))
	d = binary.AppendUvarint(d, uint64(len(target)))
	for len(target) > 0 {
		n := min(len(target), 127)
		d = append(d, byte(n))
		d = append(d, target[:n]...)
		target = target[n:]
	}
	return d
}

var atkPackTypes = map[string]int{"commit": 1, "tree": 2, "blob": 3, "tag": 4}

// TestRefDeltaAgainstForgedBlobTypeCannotHideACommit: the fence resolves
// a thin pack's REF_DELTA bases from the agent's repository first, and
// believes a base that says it is a blob without hashing it. The agent
// overwrites the loose object of the upstream tip (a commit) with a
// "blob" under the tip's id, and pushes its commit, which changes
// libs/tax and services/billing, as a REF_DELTA against the tip. The scan
// takes the delta for a blob's and drops it, so the commit is not "in the
// pack", the analysis counts no new commit and no path, and the push of a
// services/billing lease lands libs/tax. (No pre-receive hook here: the
// proxy's own verdict is what is tested.)
func TestRefDeltaAgainstForgedBlobTypeCannotHideACommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	checkout := e.clone(e.gs.srv.URL) // the agent's repository: the fence's ObjectDirs
	srv := e.proxy(l, func(c *Config) { c.ObjectDirs = []string{filepath.Join(checkout, ".git")} })
	base := e.upstreamRef("refs/heads/main")
	head := e.commit(checkout, "both", "services/billing/invoice.go", "billing\n", "libs/tax/rates.go", "tax\n")

	// The pack: every new object whole, but the commit, a delta against base.
	list := strings.Fields(mustGit(t, checkout, "rev-list", "--objects", base+".."+head))
	var ids []string
	for _, f := range list {
		if len(f) == 40 {
			ids = append(ids, f)
		}
	}
	var pack bytes.Buffer
	pack.WriteString("PACK")
	binary.Write(&pack, binary.BigEndian, uint32(2))
	binary.Write(&pack, binary.BigEndian, uint32(len(ids)))
	baseRaw := []byte(mustGit(t, checkout, "cat-file", "commit", base))
	for _, id := range ids {
		typ := strings.TrimSpace(mustGit(t, checkout, "cat-file", "-t", id))
		raw := []byte(mustGit(t, checkout, "cat-file", typ, id))
		if id == head {
			delta := atkInsertDelta(baseRaw, raw)
			pack.Write(atkPackHeader(7, len(delta)))
			b, _ := hex.DecodeString(base)
			pack.Write(b)
			pack.Write(atkDeflate(delta))
			continue
		}
		pack.Write(atkPackHeader(atkPackTypes[typ], len(raw)))
		pack.Write(atkDeflate(raw))
	}
	sum := sha1.Sum(pack.Bytes())
	pack.Write(sum[:])

	// The forgery, in the agent's own object store: base's id, a blob.
	atkUnpackAll(t, checkout)
	atkWriteLoose(t, checkout, base, "blob", []byte("not a commit\n"))

	body := append(appendFlush(appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status")), pack.Bytes()...)
	resp, err := http.Post(srv.URL+"/payments.git/git-receive-pack", "application/x-git-receive-pack-request", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if got := e.upstreamRef("refs/heads/main"); got == head {
		t.Fatalf("the push landed libs/tax under a services/billing lease (main is %s); the proxy answered %d %q", got, resp.StatusCode, out)
	}
	if !bytes.Contains(out, []byte("ng refs/heads/main")) {
		t.Errorf("no refusal for main: %d %q", resp.StatusCode, out)
	}
}
