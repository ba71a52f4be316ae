//go:build integration

package pgproxy

import (
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// A client that pauses in the middle of an extended-protocol unit (after
// Parse, before Describe or Bind) must see what it would see straight to
// Postgres: a statement_timeout that fires during the pause, a prefix that
// Postgres refused skipping the rest up to Sync, and a write after the
// pause landing under the lease. Each script runs twice, direct and
// through the fence, and the answers must match message for message.
//
// The pause is the fault under test (pgx's own suite pauses 200 ms before
// Describe the same way), not a wait for state.
func TestClientPausesMidUnit(t *testing.T) {
	lease := newStaticLease(t, "lease_stall1", 7, "public.stall")
	p := startProxy(t, Config{Lease: lease})
	// Not fenced at storage, so that the direct run can write it too.
	if _, err := adminConn(t).Exec(ctxT(t), "CREATE TABLE IF NOT EXISTS public.stall (name text); GRANT ALL ON public.stall TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	// The client's pause. The cases with a 100 ms statement_timeout need
	// the fence to have forwarded the paused prefix (stallAfter, 20 ms)
	// at least 100 ms before the pause ends; at 300 ms a CI machine busy
	// with the other packages' tests once forwarded it later, and
	// Postgres saw no idle statement to time out.
	const pause = time.Second
	steps := func(msgs ...pgproto3.FrontendMessage) []pgproto3.FrontendMessage { return msgs }
	for _, tc := range []struct {
		name   string
		setup  string
		before []pgproto3.FrontendMessage // sent, then the pause
		after  []pgproto3.FrontendMessage // sent after the pause; ends with Sync
		want   string                     // the answers, as answerTrace prints them
		check  string                     // a query whose single value must be "t" afterwards (admin, direct)
	}{{
		name:   "statement timeout between Parse and Describe",
		setup:  "SET statement_timeout = '100ms'",
		before: steps(&pgproto3.Parse{Name: "stall_s1", Query: "select $1::varchar"}),
		after:  steps(&pgproto3.Describe{ObjectType: 'S', Name: "stall_s1"}, &pgproto3.Sync{}),
		want:   "ParseComplete ErrorResponse(57014) ReadyForQuery(I)",
	}, {
		name:   "statement timeout between Parse and Bind of a read",
		setup:  "SET statement_timeout = '100ms'",
		before: steps(&pgproto3.Parse{Query: "select 1"}),
		after:  steps(&pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want:   "ParseComplete ErrorResponse(57014) ReadyForQuery(I)",
	}, {
		name:   "statement timeout between Bind and Describe (pgx's exec mode)",
		setup:  "SET statement_timeout = '100ms'",
		before: steps(&pgproto3.Parse{Query: "select 1"}, &pgproto3.Bind{}),
		after:  steps(&pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want:   "ParseComplete BindComplete ErrorResponse(57014) ReadyForQuery(I)",
	}, {
		name:   "a read bound before the pause runs after it, in a unit that then writes",
		before: steps(&pgproto3.Parse{Name: "stall_r", Query: "select 41 + 1"}, &pgproto3.Bind{PreparedStatement: "stall_r"}),
		after: steps(&pgproto3.Execute{}, &pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ($1)"},
			&pgproto3.Bind{Parameters: [][]byte{[]byte("bound-before-%s")}}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want:  "ParseComplete BindComplete DataRow CommandComplete(SELECT 1) ParseComplete BindComplete CommandComplete(INSERT 0 1) ReadyForQuery(I)",
		check: "SELECT count(*) = 1 FROM public.stall WHERE name = 'bound-before-%s'",
	}, {
		name:   "portals bound before the pause and after a Flush in it run in a unit that then writes",
		before: steps(&pgproto3.Parse{Name: "stall_r3", Query: "select 7"}, &pgproto3.Bind{DestinationPortal: "pa", PreparedStatement: "stall_r3"}),
		after: steps(&pgproto3.Bind{DestinationPortal: "pb", PreparedStatement: "stall_r3"}, &pgproto3.Flush{},
			&pgproto3.Execute{Portal: "pa"}, &pgproto3.Execute{Portal: "pb"},
			&pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ($1)"},
			&pgproto3.Bind{Parameters: [][]byte{[]byte("two-portals-%s")}}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want: "ParseComplete BindComplete BindComplete DataRow CommandComplete(SELECT 1) DataRow CommandComplete(SELECT 1) " +
			"ParseComplete BindComplete CommandComplete(INSERT 0 1) ReadyForQuery(I)",
		check: "SELECT count(*) = 1 FROM public.stall WHERE name = 'two-portals-%s'",
	}, {
		name: "a pause inside a transaction the client left open with Flush keeps it one transaction",
		before: steps(&pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ('atomic-%s')"}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Flush{}, &pgproto3.Parse{Name: "stall_x", Query: "select 1"}),
		after: steps(&pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ('atomic-%s')"}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Parse{Query: "SELECT 1 FROM public.stall_missing"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want: "ParseComplete BindComplete CommandComplete(INSERT 0 1) ParseComplete ParseComplete BindComplete CommandComplete(INSERT 0 1) " +
			"ErrorResponse(42P01) ReadyForQuery(I)", // no such table: it fails when parsed
		check: "SELECT count(*) = 0 FROM public.stall WHERE name = 'atomic-%s'", // the error rolled both back
	}, {
		name:   "a read after the pause runs",
		before: steps(&pgproto3.Parse{Query: "select 41 + 1"}, &pgproto3.Describe{ObjectType: 'S'}),
		after:  steps(&pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want:   "ParseComplete ParameterDescription RowDescription BindComplete DataRow CommandComplete(SELECT 1) ReadyForQuery(I)",
	}, {
		name:   "a write after the pause lands",
		before: steps(&pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ($1)"}),
		after: steps(&pgproto3.Bind{Parameters: [][]byte{[]byte("after-pause-%s")}}, &pgproto3.Execute{},
			&pgproto3.Sync{}),
		want:  "ParseComplete BindComplete CommandComplete(INSERT 0 1) ReadyForQuery(I)",
		check: "SELECT count(*) = 1 FROM public.stall WHERE name = 'after-pause-%s'",
	}, {
		name:   "a refused prefix skips the write after the pause",
		before: steps(&pgproto3.Parse{Query: "SELEC 1"}),
		after: steps(&pgproto3.Parse{Query: "INSERT INTO public.stall (name) VALUES ('skipped-%s')"}, &pgproto3.Bind{},
			&pgproto3.Execute{}, &pgproto3.Sync{}),
		want:  "ErrorResponse(42601) ReadyForQuery(I)",
		check: "SELECT count(*) = 0 FROM public.stall WHERE name = 'skipped-%s'",
	}, {
		name:   "BEGIN after the pause starts a block the fence decides",
		before: steps(&pgproto3.Parse{Name: "stall_ins", Query: "INSERT INTO public.stall (name) VALUES ($1)"}),
		after: steps(&pgproto3.Parse{Query: "BEGIN"}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Bind{PreparedStatement: "stall_ins", Parameters: [][]byte{[]byte("in-block-%s")}}, &pgproto3.Execute{},
			&pgproto3.Parse{Query: "COMMIT"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}),
		want: "ParseComplete ParseComplete BindComplete CommandComplete(BEGIN) BindComplete CommandComplete(INSERT 0 1) " +
			"ParseComplete BindComplete CommandComplete(COMMIT) ReadyForQuery(I)",
		check: "SELECT count(*) = 1 FROM public.stall WHERE name = 'in-block-%s'",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			for _, via := range []struct{ name, addr string }{{"direct", pg.Addr()}, {"fence", p.Addr().String()}} {
				tag := via.name + fmt.Sprint(time.Now().UnixNano())
				got := pauseScript(t, via.addr, tc.setup, withTag(tc.before, tag), pause, withTag(tc.after, tag))
				if got != tc.want {
					t.Errorf("%s: got  %s\nwant %s", via.name, got, tc.want)
				}
				if tc.check != "" {
					var ok bool
					if err := adminConn(t).QueryRow(ctxT(t), fmt.Sprintf(tc.check, tag)).Scan(&ok); err != nil || !ok {
						t.Errorf("%s: %s: %v %v", via.name, fmt.Sprintf(tc.check, tag), ok, err)
					}
				}
			}
		})
	}
}

// withTag copies msgs with %s in queries and parameters replaced by tag.
func withTag(msgs []pgproto3.FrontendMessage, tag string) []pgproto3.FrontendMessage {
	out := make([]pgproto3.FrontendMessage, len(msgs))
	for i, m := range msgs {
		switch m := m.(type) {
		case *pgproto3.Parse:
			c := *m
			c.Query = strings.ReplaceAll(c.Query, "%s", tag)
			out[i] = &c
		case *pgproto3.Bind:
			c := *m
			c.Parameters = nil
			for _, p := range m.Parameters {
				c.Parameters = append(c.Parameters, []byte(strings.ReplaceAll(string(p), "%s", tag)))
			}
			out[i] = &c
		default:
			out[i] = m
		}
	}
	return out
}

// pauseScript connects to addr as the agent, runs setup (a simple Query),
// sends before, pauses, sends after, and returns the answers up to
// ReadyForQuery.
func pauseScript(t *testing.T, addr, setup string, before []pgproto3.FrontendMessage, pause time.Duration, after []pgproto3.FrontendMessage) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	fe := pgproto3.NewFrontend(c, c)
	fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber,
		Parameters: map[string]string{"user": "agent", "database": testDB}})
	if setup != "" {
		fe.Send(&pgproto3.Query{String: setup})
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	n := 1 // startup's ReadyForQuery, then setup's
	if setup != "" {
		n++
	}
	for range n {
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			if e, ok := m.(*pgproto3.ErrorResponse); ok {
				t.Fatalf("%s: %s", setup, e.Message)
			}
			if _, ok := m.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
	}
	for _, m := range before {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(pause) // the client's pause: the fault under test
	for _, m := range after {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	return answerTrace(t, fe)
}

// answerTrace reads answers up to ReadyForQuery and prints their types
// (with SQLSTATE, command tag and transaction status).
func answerTrace(t *testing.T, fe *pgproto3.Frontend) string {
	t.Helper()
	var out []string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("after %v: %v", out, err)
		}
		name := strings.TrimPrefix(fmt.Sprintf("%T", m), "*pgproto3.")
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			name += "(" + m.Code + ")"
			if os.Getenv("FL_DEBUG") != "" {
				t.Logf("error: %s", m.Message)
			}
		case *pgproto3.CommandComplete:
			name += "(" + string(m.CommandTag) + ")"
		case *pgproto3.ReadyForQuery:
			out = append(out, name+"("+string(m.TxStatus)+")")
			return strings.Join(out, " ")
		case *pgproto3.NoticeResponse, *pgproto3.ParameterStatus:
			continue
		}
		out = append(out, name)
	}
}
