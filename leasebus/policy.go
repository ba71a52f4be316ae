package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// Policies — the security team's Cedar policies, the default one and one
// per repo, each enforced or shadowed — live on stream PolicyStream, one
// subject per repo and mode, each message one version (policy.Document).
// Like the shard records, they are written by the lease service alone:
// an operator asks it (op "policy", which the bus lets only operators
// publish), and the service parses and validates the text against the
// schema, checks the version the operator replaces (a compare-and-swap:
// the subject's last sequence is also the publish's expected one, so two
// service instances cannot both write version N+1), writes the next
// version stamped with its writer header and audits the change (operator,
// version, digest). Holders and viewers read the stream and follow it
// (WatchPolicies); the bus refuses them op "policy".
//
// Why a stream of the service's and not a KV bucket operators write: the
// change must be audited with the operator's identity, and only the
// service writes the audit (invariant 17); the text must be validated
// before any fence sees it; and a reader must be able to tell a real
// version from an answer someone had the server send onto the subject (a
// JetStream API reply names any subject): readers take only messages the
// service wrote (ServiceWrote), which a KV bucket's reader cannot see.
// The stream keeps every message (no per-subject limit, refusing writes
// when full, like the lease log), so nobody can push a version out with
// such answers; a reader takes the last version the service wrote.

// PolicyStream is the stream of policy versions.
const PolicyStream = "FENCELINE_POLICY"

const (
	policySubjectPrefix = "fenceline.policy"
	opPolicy            = "policy"
	// maxPolicyRequest bounds a policy write's request.
	maxPolicyRequest = policy.MaxText + 4<<10
	// policyMaxValue bounds a stored version.
	policyMaxValue = policy.MaxText + 8<<10
)

// BoundaryPolicy is the boundary of policy changes' audit events (and of
// shadow refusals, whatever fence judged them: see EventShadowRefused).
const BoundaryPolicy = lease.BoundaryPolicy

// Audit event types of policies.
const (
	EventPolicySet     = lease.EventPolicySet
	EventShadowRefused = lease.EventShadowRefused
)

// policyKey is the subject token of a repo's policies ("default" for the
// default policy).
func policyKey(repo string) string {
	if repo == "" {
		return policy.DefaultScope
	}
	return RepoKey(repo)
}

// PolicySubject is where the versions of repo's policy in mode are ("":
// the default policy).
func PolicySubject(repo string, mode policy.Mode) string {
	return policySubjectPrefix + "." + string(mode) + "." + policyKey(repo)
}

func policyStreamConfig(replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              PolicyStream,
		Description:       "fenceline policies: every version of the default and each repo's Cedar policy, written by the lease service alone",
		Subjects:          []string{policySubjectPrefix + ".*.*"},
		Storage:           jetstream.FileStorage,
		Replicas:          replicas,
		Retention:         jetstream.LimitsPolicy,
		MaxMsgsPerSubject: -1,
		DenyDelete:        true,
		DenyPurge:         true,
		AllowDirect:       true,
	}
}

// PolicyWrite asks the lease service to set a policy.
type PolicyWrite struct {
	// Repo is the repository; empty with Default.
	Repo    string      `json:"repo,omitempty"`
	Default bool        `json:"default,omitempty"`
	Mode    policy.Mode `json:"mode"`
	// Text is the Cedar text ("" removes the policy).
	Text string `json:"text"`
	// Version is the version this write replaces (0: there is none yet):
	// a compare-and-swap.
	Version uint64 `json:"version"`
}

func (w *PolicyWrite) check() error {
	switch {
	case w.Default && w.Repo != "":
		return fmt.Errorf("%w: a policy is the default or a repo's (Default or Repo), not both", lease.ErrInvalid)
	case !w.Default && strings.TrimSpace(w.Repo) == "":
		return fmt.Errorf("%w: say whose policy this is: Repo or Default", lease.ErrInvalid)
	case w.Mode == "":
		w.Mode = policy.ModeEnforce
	}
	if w.Mode != policy.ModeEnforce && w.Mode != policy.ModeShadow {
		return fmt.Errorf("%w: mode %q (want %s or %s)", lease.ErrInvalid, w.Mode, policy.ModeEnforce, policy.ModeShadow)
	}
	return nil
}

// SetPolicy asks the lease service to set a policy and returns the
// version it stored. A Version that is no longer the policy's is
// jetstream.ErrKeyRevisionMismatch (read it again: `policy get`); a text
// that does not validate is ErrInvalid, naming every problem's line and
// column; a non-operator is ErrForbidden (the bus drops the request).
func (c *Client) SetPolicy(ctx context.Context, w PolicyWrite) (*policy.Document, error) {
	if w.Repo != "" {
		w.Repo = repoid.Normalize(w.Repo)
	}
	if err := w.check(); err != nil {
		return nil, err
	}
	r, err := c.request(ctx, opPolicy, w, 0)
	if err != nil {
		return nil, fmt.Errorf("set policy: %w", err)
	}
	if r.Error != nil {
		return nil, r.Error.err()
	}
	if r.Policy == nil {
		return nil, fmt.Errorf("set policy: the lease service answered without the version it stored (an older service?)")
	}
	return r.Policy, nil
}

// policyVersion is one stored version and its stream sequence.
type policyVersion struct {
	doc policy.Document
	seq uint64
}

// decodePolicy reads a stored version from m, if the service wrote it
// and it is one (its subject's repo and mode, a digest of its text).
func decodePolicy(subject string, h nats.Header, data []byte) (policy.Document, bool) {
	if !ServiceWrote(h) || len(data) > policyMaxValue {
		return policy.Document{}, false
	}
	var d policy.Document
	if err := json.Unmarshal(data, &d); err != nil || d.Version == 0 || d.Digest != policy.Digest(d.Text) {
		return policy.Document{}, false
	}
	if PolicySubject(d.Repo, d.Mode) != subject {
		return policy.Document{}, false
	}
	return d, true
}

// readPolicies reads every version the service wrote on subjects
// (wildcards allowed), oldest first, and the last sequence of each
// subject with any message (versions or not).
func readPolicies(ctx context.Context, js jetstream.JetStream, subjects ...string) ([]policyVersion, map[string]uint64, error) {
	last := map[string]uint64{}
	stream, err := js.Stream(ctx, PolicyStream)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: policy stream: %w", lease.ErrUnavailable, err)
	}
	var any bool
	for _, s := range subjects {
		_, err := stream.GetLastMsgForSubject(ctx, s)
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
		case err != nil:
			return nil, nil, fmt.Errorf("%w: read policy stream: %w", lease.ErrUnavailable, err)
		default:
			any = true
		}
	}
	if !any {
		return nil, last, nil
	}
	cons, err := js.OrderedConsumer(ctx, PolicyStream, jetstream.OrderedConsumerConfig{FilterSubjects: subjects, DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		return nil, nil, fmt.Errorf("%w: read policy stream: %w", lease.ErrUnavailable, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, nil, fmt.Errorf("%w: read policy stream: %w", lease.ErrUnavailable, err)
	}
	defer it.Stop()
	var out []policyVersion
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			return nil, nil, fmt.Errorf("%w: read policy stream: %w", lease.ErrUnavailable, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return nil, nil, fmt.Errorf("read policy stream: %w", err)
		}
		last[m.Subject()] = md.Sequence.Stream
		if d, ok := decodePolicy(m.Subject(), m.Headers(), m.Data()); ok {
			out = append(out, policyVersion{doc: d, seq: md.Sequence.Stream})
		}
		if md.NumPending == 0 {
			return out, last, nil
		}
	}
}

// PolicyHistory returns every version of repo's policy in mode ("": the
// default), oldest first.
func PolicyHistory(ctx context.Context, js jetstream.JetStream, repo string, mode policy.Mode) ([]policy.Document, error) {
	if repo != "" {
		repo = repoid.Normalize(repo)
	}
	vs, _, err := readPolicies(ctx, js, PolicySubject(repo, mode))
	if err != nil {
		return nil, err
	}
	out := make([]policy.Document, len(vs))
	for i, v := range vs {
		out[i] = v.doc
	}
	return out, nil
}

// GetPolicy returns the version in force of repo's policy in mode ("":
// the default), and false when it has none.
func GetPolicy(ctx context.Context, js jetstream.JetStream, repo string, mode policy.Mode) (policy.Document, bool, error) {
	h, err := PolicyHistory(ctx, js, repo, mode)
	if err != nil || len(h) == 0 {
		return policy.Document{}, false, err
	}
	return h[len(h)-1], true, nil
}

// writePolicy checks and stores w for operator id.
func (s *Service) writePolicy(ctx context.Context, id string, w PolicyWrite) reply {
	d, err := s.checkAndWritePolicy(ctx, id, w)
	if err != nil {
		return reply{Error: toWire(err)}
	}
	return reply{Policy: d}
}

func (s *Service) checkAndWritePolicy(ctx context.Context, id string, w PolicyWrite) (*policy.Document, error) {
	if w.Repo != "" {
		w.Repo = repoid.Normalize(w.Repo)
	}
	if err := w.check(); err != nil {
		return nil, err
	}
	d := policy.Document{Repo: w.Repo, Mode: w.Mode, Text: w.Text, Digest: policy.Digest(w.Text), SetBy: s.name(id), SetAt: s.cfg.Now().UTC()}
	if w.Text != "" {
		if _, err := d.Check(); err != nil {
			return nil, fmt.Errorf("%w: %w", lease.ErrInvalid, err)
		}
	}
	subj := PolicySubject(w.Repo, w.Mode)
	vs, last, err := readPolicies(ctx, s.js, subj)
	if err != nil {
		return nil, err
	}
	var cur uint64
	if len(vs) > 0 {
		cur = vs[len(vs)-1].doc.Version
	}
	if w.Version != cur {
		return nil, fmt.Errorf("%w: the %s policy (%s) is at version %d, not %d: read it again (policy get) and set it on that version", jetstream.ErrKeyRevisionMismatch, d.Scope(), w.Mode, cur, w.Version)
	}
	d.Version = cur + 1
	data, err := json.Marshal(&d)
	if err != nil {
		return nil, fmt.Errorf("encode policy: %w", err)
	}
	msg := nats.NewMsg(subj)
	msg.Data = data
	msg.Header.Set(writerHeader, s.store.writer)
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(last[subj], 10))
	if _, err := s.store.publish(ctx, msg); err != nil {
		if isCASMismatch(err) {
			return nil, fmt.Errorf("%w: the %s policy changed while this write was checked: read it again and retry", jetstream.ErrKeyRevisionMismatch, d.Scope())
		}
		return nil, fmt.Errorf("store policy: %w", streamFull(PolicyStream, err))
	}
	what := "set"
	if w.Text == "" {
		what = "removed"
	}
	ev := lease.AuditEvent{Time: d.SetAt, Type: EventPolicySet, Boundary: BoundaryPolicy, Repo: w.Repo, RequestedBy: d.SetBy,
		Message: fmt.Sprintf("policy %s: %s %s the %s policy (%s) at version %d, digest %s", what, d.SetBy, what, d.Scope(), d.Mode, d.Version, d.Digest)}
	if err := s.writeEvent(ctx, eventsSubjectFor(w.Repo, BoundaryPolicy, id), ev); err != nil {
		// The version is stored and carries its operator and digest; the
		// event is what a reader of the audit sees, so say it loudly.
		s.log.Error("audit event of a policy change not written", "scope", d.Scope(), "version", d.Version, "set_by", d.SetBy, "err", err)
	}
	return &d, nil
}

// PolicyWatch follows policies on the bus into a policy.Store: every
// version the service writes is in the store within the bus's delivery
// time (milliseconds), without restarting anything.
type PolicyWatch struct {
	cancel context.CancelFunc
	done   chan struct{}
	wg     sync.WaitGroup
	err    error // why it stopped early; read after done
}

// WatchPolicies reads the policies of repos (the default always; every
// repo when repos is empty; an empty repo adds none) into store, returns once what was on the bus
// when it was called is in the store, and follows every change after it
// until ctx ends or Stop. Log says why a reading failed (the consumer
// restarts itself while the bus reconnects).
func WatchPolicies(ctx context.Context, js jetstream.JetStream, store *policy.Store, repos ...string) (*PolicyWatch, error) {
	subjects := []string{policySubjectPrefix + ".*." + policy.DefaultScope}
	if len(repos) == 0 {
		subjects = []string{policySubjectPrefix + ".>"}
	}
	for _, r := range repos {
		if r = repoid.Normalize(r); r != "" { // "": the default alone
			subjects = append(subjects, policySubjectPrefix+".*."+policyKey(r))
		}
	}
	// What is there now, read in full first (so a fence never starts
	// before the policy in force is in the store).
	vs, last, err := readPolicies(ctx, js, subjects...)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		// A lease service older than policies: it made no policy stream,
		// and nobody else can (only the service creates streams), so no
		// policy exists. Nothing to follow until it is upgraded.
		ctx, cancel := context.WithCancel(ctx)
		w := &PolicyWatch{cancel: cancel, done: make(chan struct{})}
		w.wg.Go(func() {
			<-ctx.Done()
			close(w.done)
		})
		return w, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the policies in force: %w (a bus whose NATS authorization predates policies refuses the read: regenerate it with `fenceline bus creds` and reload the servers)", err)
	}
	for _, v := range vs {
		if err := store.Put(v.doc); err != nil {
			return nil, fmt.Errorf("policy %s version %d: %w", v.doc.Scope(), v.doc.Version, err)
		}
	}
	// Follow from the first message after the last one read (of these
	// subjects): a version written meanwhile is delivered, none twice.
	var from uint64
	for _, seq := range last {
		from = max(from, seq)
	}
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: subjects, DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: from + 1}
	cons, err := js.OrderedConsumer(ctx, PolicyStream, cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: follow the policy stream: %w", lease.ErrUnavailable, err)
	}
	it, err := cons.Messages()
	if err != nil {
		return nil, fmt.Errorf("%w: follow the policy stream: %w", lease.ErrUnavailable, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &PolicyWatch{cancel: cancel, done: make(chan struct{})}
	var once sync.Once
	stop := func() { once.Do(it.Stop) }
	w.wg.Go(func() {
		<-ctx.Done()
		stop()
	})
	w.wg.Go(func() {
		defer close(w.done)
		defer stop()
		for {
			m, err := it.Next()
			if err != nil {
				if ctx.Err() == nil && !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					w.err = fmt.Errorf("follow the policy stream: %w", err)
				}
				cancel()
				return
			}
			if d, ok := decodePolicy(m.Subject(), m.Headers(), m.Data()); ok {
				_ = store.Put(d) // the service validated it; a schema this build lacks keeps the version before
			}
		}
	})
	return w, nil
}

// Stop stops following and waits for the watch's goroutines.
func (w *PolicyWatch) Stop() {
	w.cancel()
	w.wg.Wait()
}

// Done is closed when the watch stopped (Stop, its context, or a failure:
// Err).
func (w *PolicyWatch) Done() <-chan struct{} { return w.done }

// Err is why the watch stopped by itself (nil after Stop).
func (w *PolicyWatch) Err() error {
	select {
	case <-w.done:
		return w.err
	default:
		return nil
	}
}

// FollowPolicy reads the policies repo follows (the default and its own)
// from the bus into a new store and keeps them in step until ctx ends or
// the watch is stopped: what a runner or a sidecar gives its fences.
func FollowPolicy(ctx context.Context, nc *nats.Conn, repo string) (*policy.Store, *PolicyWatch, error) {
	js, err := JetStream(ctx, nc)
	if err != nil {
		return nil, nil, fmt.Errorf("policy: %w", err)
	}
	st := new(policy.Store)
	w, err := watchPoliciesPatiently(ctx, js, st, policyFollowPatience, nil, repo)
	if err != nil {
		return nil, nil, err
	}
	return st, w, nil
}

// watchPoliciesPatiently is WatchPolicies tried again while JetStream
// answers "temporarily unavailable" or not at all, for up to patience: it
// does for a while after a node rejoins, a stream leader moves, or a new
// cluster elects the policy stream's leader. A run, a sidecar or a lease
// service starting then waits for the policy (none may start without it)
// instead of failing. waiting, when set, hears each failed try.
func watchPoliciesPatiently(ctx context.Context, js jetstream.JetStream, st *policy.Store, patience time.Duration, waiting func(try int, err error), repos ...string) (*PolicyWatch, error) {
	deadline := time.Now().Add(patience)
	wait := 250 * time.Millisecond
	for try := 1; ; try++ {
		w, err := WatchPolicies(ctx, js, st, repos...)
		if err == nil {
			return w, nil
		}
		if !transient(err) || time.Now().Add(wait).After(deadline) {
			return nil, err
		}
		if waiting != nil {
			waiting(try, err)
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// policyFollowPatience bounds how long FollowPolicy waits out a JetStream
// that is temporarily unavailable.
const policyFollowPatience = 15 * time.Second
