package pgproxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"
)

var (
	fuzzOnce  sync.Once
	fuzzProxy *Proxy
)

// FuzzClientStream sends arbitrary bytes after a good startup: the proxy
// must answer or close cleanly, never hang or crash, and keep serving.
func FuzzClientStream(f *testing.F) {
	var w msgBuilder
	w.query("SELECT 1")
	f.Add(w.b)
	w = msgBuilder{}
	w.parse("", "INSERT INTO app.items (name) VALUES ($1)")
	w.bind("", "", "x")
	w.execute("")
	w.b = append(w.b, 'S', 0, 0, 0, 4)
	f.Add(w.b)
	f.Add([]byte{'d', 0, 0, 0, 5, 'x', 'c', 0, 0, 0, 4, 'S', 0, 0, 0, 4})
	f.Add([]byte{'Q', 0, 0, 0, 4})
	f.Add([]byte{'B', 0, 0, 0, 9, 0, 0, 0, 0, 0})
	f.Add([]byte{'F', 0, 0, 0, 6, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		watchdog(t, fuzzInputDeadline, data)
		lease := newStaticLease(t, "lease_fuzz", 0, "app.*")
		p := startProxy(t, Config{Lease: lease, MaxMessageSize: 1 << 16})
		c := rawStartup(t, p)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write(data)
		c.Write([]byte{'S', 0, 0, 0, 4, 'X', 0, 0, 0, 4})
		// End of input: a message the data left unfinished ends with EOF
		// instead of waiting for bytes that never come.
		c.(readerConn).Conn.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c) // ends when the proxy closes (Terminate or an error)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ok := connect(t, proxyDSN(p, "agent"))
		var one int
		if err := ok.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
			t.Fatalf("proxy stopped serving after %q: %v", data, err)
		}
	})
}

// fuzzInputDeadline bounds one input of FuzzClientStream, cleanup included:
// every connection in it has a deadline well inside it.
const fuzzInputDeadline = 30 * time.Second

// watchdog fails loudly when one fuzz input (including its cleanup) takes
// longer than d: it prints every goroutine and panics, so the fuzzer records
// the input as a crasher instead of hanging.
func watchdog(t *testing.T, d time.Duration, data []byte) {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		select {
		case <-done:
		case <-time.After(d):
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			fmt.Fprintf(os.Stderr, "fuzz input %q did not finish in %s; goroutines:\n%s\n", data, d, buf)
			panic(fmt.Sprintf("fuzz input %q did not finish in %s", data, d))
		}
	}()
	// Registered first, so it runs after every other cleanup of the input.
	t.Cleanup(func() { close(done); <-stopped })
}

// FuzzClassify: the classifier and the literal folding never panic, and a
// folded key never changes a statement's classification (class, targets,
// parse error: summarize).
func FuzzClassify(f *testing.F) {
	for _, c := range loadCorpus(f) {
		f.Add(c.sql)
	}
	// Issue 18, finding 12: texts whose shape equals an earlier one's.
	for _, s := range []string{"SELECT('\xe8', false)", "SELECT 1into x", "SELECT 1.5into x", "SELECT '\x00' FROM public.big",
		"UPDATE public.accounts SET balance = 1returning WHERE id = 2", "SELECT ? x"} {
		f.Add(s)
	}
	c := NewClassifier(0)
	f.Fuzz(func(t *testing.T, sql string) {
		got, want := summarize(c.Classify(sql)), summarize(Classify(sql))
		if got != want {
			t.Fatalf("%q: cached %s, fresh %s", sql, got, want)
		}
	})
}
