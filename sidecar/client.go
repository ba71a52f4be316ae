package sidecar

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// The agent wrapper's side of the admin API (fenceline agent): a Client
// that follows the events stream into a Gate, forwards the file guard's
// denials and reports the attempt settled.

// Gate is the file guard's Gate in a pod (it implements fsguard.Gate): the
// sidecar's last word on the lease, trusted for grace after it arrived and
// never past the validity the sidecar's holder reported. The gate is bound
// to the first lease the sidecar names — the guard's policy was made for
// it — so a different lease, or that lease lost, closes it for good.
// Client.Follow feeds it.
type Gate struct {
	url   string
	grace time.Duration
	now   func() time.Time

	mu      sync.Mutex
	view    *LeaseView    // guarded by mu: the last one heard
	heardAt time.Time     // guarded by mu: when (monotonic)
	validTo time.Time     // guarded by mu: heardAt + the view's validFor
	bound   LeaseView     // guarded by mu: the view that named the gate's lease (no Lease before)
	lost    error         // guarded by mu: terminal
	first   chan struct{} // closed when the first lease is named

	policy policy.Store // the sidecar's policy documents, as its views carry them
}

var _ lease.Gate = (*Gate)(nil) // fsguard.Gate is lease.Gate

// NewGate returns a gate for the sidecar at url (named in its refusals)
// that trusts each word of the sidecar for grace. It is closed until it
// has heard a view.
func NewGate(url string, grace time.Duration) *Gate {
	return &Gate{url: url, grace: grace, now: time.Now, first: make(chan struct{})}
}

// Fence implements fsguard.Gate: the lease's fence while the sidecar's last
// word says the gate's lease is held, arrived within the grace and is within
// the validity it reported; otherwise an error wrapping
// lease.ErrLeaseUnknown or lease.ErrLeaseLost.
func (g *Gate) Fence() (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.lost != nil:
		return 0, g.lost
	case g.view == nil:
		return 0, fmt.Errorf("%w: never heard from the sidecar at %s", lease.ErrLeaseUnknown, g.url)
	case g.now().Sub(g.heardAt) > g.grace:
		return 0, fmt.Errorf("%w: no word from the sidecar at %s for %s (grace %s)", lease.ErrLeaseUnknown, g.url, g.now().Sub(g.heardAt).Round(time.Millisecond), g.grace)
	case g.view.Lease == nil || g.view.State != lease.Held:
		return 0, fmt.Errorf("%w: the sidecar says lease %s is %s: %s", lease.ErrLeaseUnknown, g.leaseIDLocked(), g.view.State, g.view.Reason)
	case !g.now().Before(g.validTo):
		// Never trust the sidecar's "held" past its holder's own validity:
		// the service may reclaim the lease a margin after that.
		return 0, fmt.Errorf("%w: lease %s not renewed within the validity the sidecar last reported", lease.ErrLeaseUnknown, g.leaseIDLocked())
	}
	return g.view.Fence, nil
}

func (g *Gate) leaseIDLocked() string {
	if g.bound.Lease != nil {
		return g.bound.Lease.LeaseID
	}
	return "(none yet)"
}

// Heard takes one view from the sidecar's events stream. The first view
// that names a lease binds the gate to it.
func (g *Gate) Heard(v *LeaseView) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if v.Lease != nil && g.lost == nil {
		if g.bound.Lease == nil {
			g.bound = *v
			close(g.first)
		}
		switch id := g.bound.Lease.LeaseID; {
		case v.Lease.LeaseID != id:
			g.lost = fmt.Errorf("%w: the sidecar now holds lease %s, not %s", lease.ErrLeaseLost, v.Lease.LeaseID, id)
		case v.State == lease.Lost:
			g.lost = fmt.Errorf("%w: the sidecar says lease %s is lost: %s", lease.ErrLeaseLost, id, v.Reason)
		}
	}
	for _, d := range v.Policies {
		if err := g.policy.Put(d); err != nil && g.lost == nil {
			// The sidecar compiled it; this build cannot: the file guard
			// cannot keep what it protects unwritable.
			g.lost = fmt.Errorf("%w: the sidecar's %s policy version %d does not compile here: %v", lease.ErrPolicyForbids, d.Scope(), d.Version, err)
		}
	}
	g.view = v // a view without a lease (a restarted sidecar) is not "held"
	g.heardAt = g.now()
	g.validTo = g.heardAt.Add(time.Duration(v.ValidFor))
}

// Policy is the security team's policy as the sidecar's views carry it,
// kept in step with every view heard.
func (g *Gate) Policy() *policy.Store { return &g.policy }

// Unbound closes the gate for good when the guard's policy had to be made
// without the sidecar naming a lease (why says so): no lease that arrives
// later is known to cover that policy.
func (g *Gate) Unbound(why string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.lost == nil {
		g.lost = fmt.Errorf("%w: %s; the file guard's policy was made without a lease, so writes stay refused for this run (restart the agent once the sidecar holds its lease)", lease.ErrLeaseUnknown, why)
	}
}

// EverHeard reports whether the sidecar ever answered.
func (g *Gate) EverHeard() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.view != nil
}

// WaitFirst waits up to d for the view that names the gate's lease and
// returns a copy of it; nil when d passes or ctx ends first.
func (g *Gate) WaitFirst(ctx context.Context, d time.Duration) *LeaseView {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-g.first:
	default:
		select {
		case <-g.first:
		case <-t.C:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	v := g.bound
	return &v
}

// Client talks to a sidecar's admin API for the agent wrapper: it follows
// the lease events stream, reports the attempt settled and forwards file
// denials.
type Client struct {
	base, token string
	hc          *http.Client
}

// NewClient returns a client of the admin server at base (e.g.
// http://127.0.0.1:9090) that sends token as its bearer token (none when
// empty).
func NewClient(base, token string) *Client {
	return &Client{base: strings.TrimRight(base, "/"), token: token, hc: &http.Client{}}
}

// request makes a request of the admin API, signed with the token (see
// adminauth.go): the token itself is never sent.
func (c *Client) request(ctx context.Context, method, path string, body any) (*http.Request, error) {
	var b []byte
	if body != nil {
		var err error
		if b, err = json.Marshal(body); err != nil {
			return nil, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	if c.token != "" {
		nonce := newNonce()
		req.Header.Set(headerNonce, nonce)
		req.Header.Set("Authorization", hmacScheme+requestMAC(c.token, method, path, nonce, b))
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// post sends body and wants a 2xx answer.
func (c *Client) post(ctx context.Context, path string, body any) error {
	req, err := c.request(ctx, http.MethodPost, path, body)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("post %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
		return fmt.Errorf("post %s: %s: %s", path, resp.Status, strings.TrimSpace(string(msg)))
	}
	return nil
}

// Settled reports the attempt settled (POST /api/v1/settled), retrying for
// up to retry (0: one try).
func (c *Client) Settled(ctx context.Context, rep SettledReport, retry time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, retry+5*time.Second)
	defer cancel()
	deadline := time.Now().Add(retry)
	var err error
	for delay := 100 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		if err = c.post(ctx, PathSettled, rep); err == nil || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(delay):
		}
	}
}

// Follow keeps the events stream open until ctx ends, reconnecting with
// backoff, and feeds every view to g. A stream silent for twice the gate's
// grace is dropped and reopened (the gate already denies by then). Each
// break is logged to log.
func (c *Client) Follow(ctx context.Context, g *Gate, log *slog.Logger) {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		heard, err := c.stream(ctx, g)
		if ctx.Err() != nil {
			return
		}
		if heard {
			delay = 100 * time.Millisecond
		}
		log.Warn("lease events stream from the sidecar broken; writes are denied until it is back", "sidecar", c.base, "err", err, "retry", delay.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 2*time.Second)
	}
}

// stream reads one events stream until it fails.
func (c *Client) stream(ctx context.Context, g *Gate) (heard bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := c.request(sctx, http.MethodGet, PathEvents, nil)
	if err != nil {
		return false, err
	}
	req.Header.Set("Accept", "text/event-stream")
	resp, err := c.hc.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
		return false, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	// A silent stream (a half-open connection) is cut after 2×grace.
	idle := time.AfterFunc(2*g.grace, cancel)
	defer idle.Stop()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 16<<10), 1<<20)
	var data []byte
	var mac string
	nonce := req.Header.Get(headerNonce)
	var n uint64 // events taken from this stream
	for sc.Scan() {
		line := sc.Bytes()
		switch {
		case len(line) == 0: // end of an event
			if len(data) > 0 {
				n++
				if c.token != "" && !macEqual(mac, eventMAC(c.token, nonce, n, data)) {
					// Not the sidecar: whatever listens on its port
					// without its token (the agent, once the sidecar is
					// gone) cannot say the lease is held.
					return heard, fmt.Errorf("event %d of the stream does not prove the admin token: whatever answers on %s is not the sidecar", n, c.base)
				}
				var v LeaseView
				if err := json.Unmarshal(data, &v); err != nil {
					return heard, fmt.Errorf("bad event from the sidecar: %w", err)
				}
				g.Heard(&v)
				heard = true
				idle.Reset(2 * g.grace)
			}
			data, mac = data[:0], ""
		case bytes.HasPrefix(line, []byte("data:")):
			data = append(data, bytes.TrimPrefix(bytes.TrimPrefix(line, []byte("data:")), []byte(" "))...)
		case bytes.HasPrefix(line, []byte("mac:")):
			mac = string(bytes.TrimSpace(bytes.TrimPrefix(line, []byte("mac:"))))
		}
	}
	if err := sc.Err(); err != nil {
		return heard, err
	}
	return heard, errors.New("the sidecar closed the stream")
}

// Auditor returns the file guard's Auditor (it implements fsguard.Auditor)
// that records each denial through the sidecar (POST /api/v1/audit), which
// names its lease in it and writes it to the audit stream. It logs
// nothing: the guard logs each denial once, as it queues it.
func (c *Client) Auditor() lease.Auditor {
	return &clientAuditor{c: c}
}

// clientAuditor is Client.Auditor.
type clientAuditor struct {
	c *Client
}

func (s *clientAuditor) Record(ctx context.Context, ev lease.AuditEvent) error {
	if err := s.c.post(ctx, PathAudit, ev); err != nil {
		return fmt.Errorf("record denial through the sidecar: %w", err)
	}
	return nil
}
