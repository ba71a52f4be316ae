package sidecar

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// Once the sidecar is gone, whatever listens on its admin port — the
// agent, which may bind it after a sidecar restart — is asked by the agent
// wrapper for the lease. It must learn nothing it can use (the wrapper
// used to send it the admin token as a bearer token) and must not be able
// to say "held": neither with events of its own nor with the real
// sidecar's events recorded from another stream.
func TestWrapperTrustsOnlyItsSidecar(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	const token = "0123456789abcdef0123"
	a := startAdmin(t, AdminConfig{Token: token, Audit: bus.Auditor, KeepAlive: 50 * time.Millisecond, Poll: 20 * time.Millisecond})
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/fake", Scope: bustest.Claim(t, "a"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	a.SetLease(l.Holder, Fences{Git: "http://127.0.0.1:1"})

	// The real sidecar's stream, as anyone who once heard it recorded it
	// (a genuine "held" event with its proof, for another request).
	real := NewClient(a.URL(), token)
	req, err := real.request(context.Background(), http.MethodGet, PathEvents, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var recorded []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() && len(recorded) < 8 {
		recorded = append(recorded, sc.Text())
	}
	resp.Body.Close()
	if !strings.Contains(strings.Join(recorded, "\n"), `"state":"held"`) {
		t.Fatalf("the real sidecar's stream: %q", recorded)
	}

	for _, tc := range []struct {
		name   string
		answer func(w http.ResponseWriter)
	}{
		{"own-events", func(w http.ResponseWriter) {
			v := LeaseView{State: lease.Held, Lease: l.Record, Fence: l.Record.Fence, ValidFor: lease.Duration(time.Minute)}
			data, _ := json.Marshal(v)
			fmt.Fprintf(w, "event: lease\nid: 1\nmac: %064d\ndata: %s\n\n", 0, data)
		}},
		{"recorded-events", func(w http.ResponseWriter) {
			fmt.Fprint(w, strings.Join(recorded, "\n")+"\n\n")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var heard []string
			fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				heard = append(heard, r.Header.Get("Authorization")+" "+r.Header.Get(headerNonce))
				mu.Unlock()
				w.Header().Set("Content-Type", "text/event-stream")
				for range 20 {
					tc.answer(w)
					w.(http.Flusher).Flush()
					select {
					case <-r.Context().Done():
						return
					case <-time.After(20 * time.Millisecond):
					}
				}
			}))
			t.Cleanup(fake.Close)
			g := NewGate(fake.URL, 10*time.Second)
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				NewClient(fake.URL, token).Follow(ctx, g, slog.New(slog.DiscardHandler))
			}()
			testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
				mu.Lock()
				defer mu.Unlock()
				if len(heard) < 3 {
					return errors.New("the wrapper has not asked the fake three times yet")
				}
				return nil
			})
			cancel()
			<-done
			if g.EverHeard() {
				t.Fatal("the wrapper took an event of a fake sidecar")
			}
			if _, err := g.Fence(); err == nil {
				t.Fatal("the gate opened on a fake sidecar's word")
			}
			mu.Lock()
			defer mu.Unlock()
			for _, h := range heard {
				if strings.Contains(h, token) {
					t.Fatalf("the fake sidecar received the admin token: %q", h)
				}
			}
		})
	}
}
