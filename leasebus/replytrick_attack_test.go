package leasebus

// The reply trick (issue 28): NATS checks the subject a client publishes
// on against its permissions, not the reply subject it names, nor the
// deliver subject of a push consumer it creates. So a holder could have
// the server publish onto a subject a fenceline stream stores, and
// JetStream stored it: the answers of STREAM.INFO, DIRECT.GET and
// STREAM.MSG.GET and a pull consumer's delivery, aimed at the lease log,
// the policy stream and both shard buckets (16 cases failed on one node
// and on the 3-node cluster while every identity shared one account).
//
// The fix is the bus's two accounts (accounts.go): the streams live in the
// service account, every other identity in the fleet account, which reads
// them through the JetStream API imported under FleetJSAPI; an answer
// aimed anywhere lands in the fleet account, where nothing is stored.
//
// These tests assert the structural property: after each attack, the
// target stream holds no message the lease service did not write. They
// also guard what held before: the lease service answers only to the
// asker's own inbox (Service.handler refuses any other reply), the server
// refuses `$JS.` replies and deliver subjects (the two audit streams are
// on `$JS.EVENT.FENCELINE.>`), and a push consumer delivers only where
// something subscribes.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// fleetJSAPI is the JetStream API as the attacker (a holder) reaches it.
// A fix that gives the fleet its own account and imports the API under a
// prefix changes this; the barrier (the lease service's own request)
// always uses the API itself (serviceSubject).
const fleetJSAPI = FleetJSAPI

// serviceSubject is a fleet JetStream API subject as the lease service
// asks it.
func serviceSubject(subj string) string { return "$JS.API" + strings.TrimPrefix(subj, fleetJSAPI) }

// replyTrickTarget is a subject a fenceline stream stores.
type replyTrickTarget struct {
	name, stream string
	subject      func(tag string) string
}

var replyTrickTargets = []replyTrickTarget{
	{"lease-log", LogStream, func(tag string) string { return logSubjectFor(RepoKey("replytrick/" + tag)) }},
	{"lease-audit", AuditStream, func(tag string) string { return serviceAuditSubject(RepoKey("replytrick/" + tag)) }},
	{"events", EventsStream, func(tag string) string { return eventsSubjectFor("replytrick/"+tag, "git", serviceWriter) }},
	{"policy", PolicyStream, func(tag string) string { return policySubjectPrefix + "." + RepoKey("replytrick/"+tag) + ".x" }},
	{"shard-pools", shardPoolStream, func(tag string) string { return "$KV." + ShardPoolBucket + ".replytrick" + tag }},
	{"shard-attempts", shardAttemptStream, func(tag string) string { return "$KV." + ShardAttemptBucket + ".replytrick" + tag }},
}

// replyTrickVector has the server or the service publish onto target on
// behalf of attacker (a holder), and returns once what the attack sets in
// motion has happened (a witness: the answer to the same request sent
// with an honest reply, or the consumer's delivery). It also returns how
// to send the same request again with another reply (nil when there is
// nothing to resend): the test's barrier.
type replyTrickVector struct {
	name string
	run  func(t *testing.T, attacker *nats.Conn, planted, target string) (resend func(nc *nats.Conn, reply string) error)
}

// apiRequest publishes the JetStream API request subj (body req) with
// target as its reply, then makes it again honestly and waits for the
// answer.
func apiRequest(t *testing.T, attacker *nats.Conn, subj, target string, req []byte) func(*nats.Conn, string) error {
	t.Helper()
	if err := attacker.PublishRequest(subj, target, req); err != nil {
		t.Fatal(err)
	}
	if _, err := attacker.Request(subj, req, 10*time.Second); err != nil {
		t.Fatalf("witness %s: %v", subj, err)
	}
	return func(nc *nats.Conn, reply string) error { return nc.PublishRequest(serviceSubject(subj), reply, req) }
}

// consumerDelivered waits until push consumer name on the attempts bucket
// has delivered a message (wherever it went), or reports that it delivers
// nothing (not push bound: the server sees no interest on its deliver
// subject, and a stream's own subscription is none).
func consumerDelivered(t *testing.T, attacker *nats.Conn, name string) {
	t.Helper()
	checkFor(t, 15*time.Second, 20*time.Millisecond, func() error {
		info, err := attacker.Request(fleetJSAPI+".CONSUMER.INFO."+shardAttemptStream+"."+name, nil, 5*time.Second)
		if err != nil {
			return err
		}
		var ci struct {
			Delivered struct {
				Consumer uint64 `json:"consumer_seq"`
			} `json:"delivered"`
			PushBound bool                          `json:"push_bound"`
			Error     *struct{ Description string } `json:"error"`
		}
		if err := json.Unmarshal(info.Data, &ci); err != nil {
			return err
		}
		if ci.Error != nil {
			return errors.New(ci.Error.Description)
		}
		if !ci.PushBound {
			t.Logf("consumer %s delivers nothing: no interest on its deliver subject", name)
			return nil
		}
		if ci.Delivered.Consumer == 0 {
			return errors.New("nothing delivered yet")
		}
		return nil
	})
}

// createAttemptConsumer has attacker create consumer name on the attempts
// bucket, filtered to the planted record, and reports whether the server
// made it.
func createAttemptConsumer(t *testing.T, attacker *nats.Conn, name, planted string, cfg map[string]any) bool {
	t.Helper()
	filter := "$KV." + ShardAttemptBucket + "." + planted
	cfg["name"], cfg["ack_policy"], cfg["filter_subject"], cfg["deliver_policy"] = name, "none", filter, "last"
	create, _ := json.Marshal(map[string]any{"stream_name": shardAttemptStream, "config": cfg})
	resp, err := attacker.Request(fleetJSAPI+".CONSUMER.CREATE."+shardAttemptStream+"."+name+"."+filter, create, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(resp.Data), `"error"`) {
		t.Logf("consumer create refused: %s", resp.Data)
		return false
	}
	return true
}

var replyTrickVectors = []replyTrickVector{
	{"service-reply", func(t *testing.T, attacker *nats.Conn, _, target string) func(*nats.Conn, string) error {
		// The lease service's answer to the holder's own list.
		req, _ := json.Marshal(listRequest{Repo: repo})
		subj := requestSubject("list", IdentityOf(attacker))
		if err := attacker.PublishRequest(subj, target, req); err != nil {
			t.Fatal(err)
		}
		if _, err := NewClient(attacker).List(ctxT(t), repo, false); err != nil {
			t.Fatalf("witness list: %v", err)
		}
		return nil
	}},
	{"stream-info", func(t *testing.T, attacker *nats.Conn, _, target string) func(*nats.Conn, string) error {
		return apiRequest(t, attacker, fleetJSAPI+".STREAM.INFO."+shardAttemptStream, target, nil)
	}},
	{"direct-get", func(t *testing.T, attacker *nats.Conn, planted, target string) func(*nats.Conn, string) error {
		req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV." + ShardAttemptBucket + "." + planted})
		return apiRequest(t, attacker, fleetJSAPI+".DIRECT.GET."+shardAttemptStream, target, req)
	}},
	{"msg-get", func(t *testing.T, attacker *nats.Conn, planted, target string) func(*nats.Conn, string) error {
		req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV." + ShardAttemptBucket + "." + planted})
		return apiRequest(t, attacker, fleetJSAPI+".STREAM.MSG.GET."+shardAttemptStream, target, req)
	}},
	{"pull-next", func(t *testing.T, attacker *nats.Conn, planted, target string) func(*nats.Conn, string) error {
		name := fmt.Sprintf("replytrickpull%d", time.Now().UnixNano())
		// It lives until the barrier, however slow the machine (an
		// ephemeral consumer idle for 5 s is gone).
		if !createAttemptConsumer(t, attacker, name, planted, map[string]any{"inactive_threshold": int64(2 * time.Minute)}) {
			t.Fatal("the holder may create a pull consumer on the attempts bucket")
		}
		next := fleetJSAPI + ".CONSUMER.MSG.NEXT." + shardAttemptStream + "." + name
		if err := attacker.PublishRequest(next, target, []byte(`{"batch":1}`)); err != nil {
			t.Fatal(err)
		}
		// Witness: an honest pull after it, answered with the record (the
		// attack's pull never reached the consumer) or with a timeout
		// status (the attack's pull took it): either way the consumer has
		// handled the attack's pull.
		// On a loaded cluster the new consumer's leader may not be
		// listening yet ("no responders"): then the attack's pull reached
		// no one either, and the witness asks again until it does.
		checkFor(t, 30*time.Second, 100*time.Millisecond, func() error {
			_, err := attacker.Request(next, []byte(`{"batch":1,"expires":2000000000}`), 10*time.Second)
			if errors.Is(err, nats.ErrNoResponders) {
				return fmt.Errorf("witness pull: %w", err)
			}
			if err != nil {
				t.Fatalf("witness pull: %v", err)
			}
			return nil
		})
		// The barrier's pull is answered at once ("no messages").
		return func(nc *nats.Conn, reply string) error {
			return nc.PublishRequest(serviceSubject(next), reply, []byte(`{"batch":1,"no_wait":true}`))
		}
	}},
	{"push-deliver", func(t *testing.T, attacker *nats.Conn, planted, target string) func(*nats.Conn, string) error {
		name := fmt.Sprintf("replytrickpush%d", time.Now().UnixNano())
		if createAttemptConsumer(t, attacker, name, planted, map[string]any{"deliver_subject": target, "durable_name": name}) {
			consumerDelivered(t, attacker, name)
		}
		return nil
	}},
}

// storedOn is how many messages stream holds on subject.
func storedOn(ctx context.Context, t *testing.T, js jetstream.JetStream, stream, subject string) uint64 {
	t.Helper()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	return info.State.Subjects[subject]
}

// lastSeq is stream's last sequence, read by the lease service's own
// connection.
func lastSeq(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	return info.State.LastSeq
}

// foreignAfter lists the messages stream stored after seq that the lease
// service (writer) did not write (a pull consumer's delivery is stored under the planted
// record's own subject, not the one the attacker named, so every message
// is looked at).
func foreignAfter(ctx context.Context, t *testing.T, js jetstream.JetStream, writer, stream string, seq uint64, barrier string) []string {
	t.Helper()
	var out []string
	for last := lastSeq(ctx, t, js, stream); seq < last; {
		seq++
		// The API's own read (not a direct get, whose answer's headers a
		// stored direct-get answer would shadow).
		m, err := storedMsg(ctx, js.Conn(), "$JS.API", stream, msgGetRequest{Seq: seq})
		if err != nil {
			t.Fatalf("stream %s message %d: %v", stream, seq, err)
		}
		if m == nil {
			continue
		}
		if m.Header.Get(writerHeader) == writer || m.Subject == barrier {
			continue
		}
		out = append(out, fmt.Sprintf("%d on %s (%.80q)", seq, m.Subject, m.Data))
	}
	return out
}

// fleetCannotStore runs every vector against every target on the bus at
// url whose lease service is svc (connected with svcNC; c its client).
func fleetCannotStore(t *testing.T, url string, svc *Service, svcNC *nats.Conn, c *Client) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	js, err := JetStream(context.Background(), svcNC)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range replyTrickVectors {
		t.Run(v.name, func(t *testing.T) {
			// A record the holder may read (the service planted it; what
			// it holds does not matter: only where the server sends it).
			attacker, planted := storeAt(t, url, []byte(`{"planted":true}`))
			for _, target := range replyTrickTargets {
				t.Run(target.name, func(t *testing.T) {
					subj := target.subject(v.name)
					before := lastSeq(ctx, t, js, target.stream)
					resend := v.run(t, attacker, planted, subj)
					// The barrier: the lease service's own connection sends
					// the same request with a reply on the same stream (it
					// may: it is the stream's writer), and the test waits
					// until that answer is stored. It leaves the same
					// server the same way after the attack's, so on a
					// cluster the attack's answer, if it were stored,
					// would be committed by then.
					barrier := target.subject("barrier-" + v.name)
					if resend != nil && !strings.HasPrefix(barrier, "$JS.") {
						if err := resend(svcNC, barrier); err != nil {
							t.Fatal(err)
						}
						checkFor(t, 15*time.Second, 20*time.Millisecond, func() error {
							if n := storedOn(ctx, t, js, target.stream, barrier); n == 0 {
								return fmt.Errorf("the barrier's answer is not stored on %s yet", barrier)
							}
							return nil
						})
					}
					if foreign := foreignAfter(ctx, t, js, svc.store.writer, target.stream, before, barrier); len(foreign) > 0 {
						t.Errorf("%s stored %d message(s) no service wrote after a holder named %s (%s): %v", target.stream, len(foreign), subj, v.name, foreign)
					}
				})
			}
		})
	}
}

func TestFleetCannotStoreThroughReplies(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	fleetCannotStore(t, b.srv.ClientURL(), b.svc, b.nc, b.c)
}
