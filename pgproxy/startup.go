package pgproxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// startup runs the startup phase on the client connection: TLS and GSS
// negotiation, CancelRequest, then the StartupMessage, which it forwards
// (with default_transaction_read_only=on) to a fresh upstream connection,
// and relays authentication untouched until the first ReadyForQuery.
// It returns false when the connection is done (a cancel request, a refusal).
func (s *session) startup() (bool, error) {
	deadline := time.Now().Add(s.p.cfg.StartupTimeout)
	s.client.SetDeadline(deadline)
	pkt, ok, err := s.negotiate(deadline)
	if !ok {
		return false, err
	}
	params, err := s.startupParams(pkt)
	if err != nil {
		return false, err
	}
	if err := s.dialUpstream(deadline); err != nil {
		return false, err
	}
	if _, err := s.sw.Write(buildStartup(code(pkt), params)); err != nil {
		return false, err
	}
	if err := s.sw.Flush(); err != nil {
		return false, err
	}
	if err := s.relayAuth(); err != nil {
		return false, err
	}
	s.client.SetDeadline(time.Time{})
	s.server.SetDeadline(time.Time{})
	return true, nil
}

// negotiate reads startup packets until the StartupMessage, answering TLS
// and GSS encryption requests and forwarding a CancelRequest. ok is false
// when the connection is done (a cancel request, a port probe, an error).
func (s *session) negotiate(deadline time.Time) (pkt []byte, ok bool, err error) {
	tlsDone, gssDone := false, false
	for {
		pkt, err = readStartup(s.client)
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil, false, nil // a port probe
			}
			return nil, false, s.fatalStartup(fmt.Errorf("read startup packet: %w", err))
		}
		code := binary.BigEndian.Uint32(pkt[4:8])
		switch code {
		case sslRequest:
			if tlsDone || len(pkt) != 8 {
				return nil, false, s.fatalStartup(fmt.Errorf("%w: SSLRequest out of place", ErrProtocol))
			}
			tlsDone = true
			if err := s.startTLS(deadline); err != nil {
				return nil, false, err
			}
			continue
		case gssEncRequest:
			if gssDone || len(pkt) != 8 {
				return nil, false, s.fatalStartup(fmt.Errorf("%w: GSSENCRequest out of place", ErrProtocol))
			}
			gssDone = true
			if _, err := s.client.Write([]byte{'N'}); err != nil {
				return nil, false, err
			}
			continue
		case cancelRequest:
			if len(pkt) != 16 {
				return nil, false, fmt.Errorf("%w: CancelRequest of %d bytes", ErrProtocol, len(pkt))
			}
			s.forwardCancel(pkt)
			return nil, false, nil
		}
		if code>>16 != 3 {
			return nil, false, s.fatalStartup(fmt.Errorf("unsupported frontend protocol %d.%d: fenceline speaks protocol 3", code>>16, code&0xffff))
		}
		return pkt, true, nil
	}
}

// startTLS answers an SSLRequest: 'N' without a TLS configuration, else
// 'S' and the handshake, after which the client speaks TLS.
func (s *session) startTLS(deadline time.Time) error {
	if s.p.cfg.TLS == nil {
		_, err := s.client.Write([]byte{'N'})
		return err
	}
	if _, err := s.client.Write([]byte{'S'}); err != nil {
		return err
	}
	tc := tls.Server(s.client, s.p.cfg.TLS)
	hctx, cancel := context.WithDeadline(s.p.ctx, deadline)
	err := tc.HandshakeContext(hctx)
	cancel()
	if err != nil {
		return fmt.Errorf("tls handshake with %s: %w", s.client.RemoteAddr(), err)
	}
	s.client = tc
	s.tls = true
	return nil
}

// startupParams reads the StartupMessage's parameters and refuses what
// may not pass: a replication connection, no user, a parameter that names
// the fence (recorded as a refused write).
func (s *session) startupParams(pkt []byte) (map[string]string, error) {
	params, err := parseStartupParams(pkt[8:])
	if err != nil {
		return nil, s.fatalStartup(err)
	}
	if _, ok := params["replication"]; ok {
		return nil, s.fatalStartup(errors.New("replication connections cannot pass the fenceline proxy"))
	}
	s.user = params["user"]
	s.database = params["database"]
	if s.database == "" {
		// Postgres connects to the user's namesake then: the catalog's
		// cache is by database, and "" would be every such user's
		// (found by a review: one role's lookup was taken for
		// another's database).
		s.database = s.user
	}
	if s.user == "" {
		return nil, s.fatalStartup(errors.New("no user in the startup message"))
	}
	if r := startupNamesFence(params); r != nil {
		li := s.lease()
		msg, detail := s.record(r, &Statement{Tag: "StartupMessage"}, li, "startup parameters")
		s.client.Write(errorResponse('E', "FATAL", "42501", msg, detail, r.hint))
		return nil, errors.New(msg)
	}
	return params, nil
}

// dialUpstream connects to the Postgres server (the client is told when it
// cannot) and sets up the session's readers and writers on both sides.
func (s *session) dialUpstream(deadline time.Time) error {
	dctx, cancel := context.WithDeadline(s.p.ctx, deadline)
	up, err := s.p.cfg.Dial(dctx, upstreamNetwork(s.p.cfg.Upstream), s.p.cfg.Upstream)
	cancel()
	if err != nil {
		s.writeClientRaw(errorResponse('E', "FATAL", "08006",
			fmt.Sprintf("fenceline: cannot reach the Postgres server at %s", s.p.cfg.Upstream), err.Error(), ""))
		return fmt.Errorf("dial upstream %s: %w", s.p.cfg.Upstream, err)
	}
	if tc, ok := up.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	s.server = up
	s.server.SetDeadline(deadline)
	srv, cli := newRawIO(s.server), newRawIO(s.client)
	s.srw, s.crw = srv, cli
	s.sr = newMsgReader(srv, s.p.cfg.MaxMessageSize)
	s.sw = bufio.NewWriterSize(srv, 32<<10)
	s.cr = newMsgReader(cli, s.p.cfg.MaxMessageSize)
	s.cw = bufio.NewWriterSize(cli, 32<<10)
	return nil
}

func code(pkt []byte) uint32 { return binary.BigEndian.Uint32(pkt[4:8]) }

// parseStartupParams reads the name/value pairs of a StartupMessage.
func parseStartupParams(b []byte) (map[string]string, error) {
	params := map[string]string{}
	for len(b) > 0 && b[0] != 0 {
		k, rest, err := cstring(b)
		if err != nil {
			return nil, fmt.Errorf("startup message: %w", err)
		}
		v, rest, err := cstring(rest)
		if err != nil {
			return nil, fmt.Errorf("startup message: %w", err)
		}
		params[k] = v
		b = rest
	}
	if len(b) != 1 {
		return nil, fmt.Errorf("%w: startup message not terminated", ErrProtocol)
	}
	return params, nil
}

// buildStartup re-encodes the StartupMessage with the session made
// read-only by default: the client's own default_transaction_read_only is
// dropped, and ours comes after "options", so it wins.
func buildStartup(version uint32, params map[string]string) []byte {
	b := []byte{0, 0, 0, 0}
	b = binary.BigEndian.AppendUint32(b, version)
	for k, v := range params {
		if strings.EqualFold(k, "default_transaction_read_only") {
			continue
		}
		b = append(b, k...)
		b = append(b, 0)
		b = append(b, v...)
		b = append(b, 0)
	}
	b = append(b, "default_transaction_read_only\x00on\x00\x00"...)
	binary.BigEndian.PutUint32(b, uint32(len(b)))
	return b
}

// relayAuth relays authentication between client and server until the
// first ReadyForQuery. It never looks inside credentials; it only strips
// SCRAM-SHA-256-PLUS from the server's offer, because channel binding
// would bind to the proxy's TLS connection, not the server's.
func (s *session) relayAuth() error {
	for {
		t, raw, err := s.sr.next()
		if err != nil {
			return fmt.Errorf("read from server during startup: %w", err)
		}
		switch t {
		case 'R':
			if len(raw) < 9 {
				return fmt.Errorf("%w: short authentication message", ErrProtocol)
			}
			code := binary.BigEndian.Uint32(raw[5:9])
			if code == 10 { // AuthenticationSASL
				raw = stripPlus(raw)
			}
			if err := s.writeClientRaw(raw); err != nil {
				return err
			}
			switch code {
			case 0, 12: // ok, SASL final: no answer
			case 2, 6, 9: // Kerberos, SCM, SSPI
				return s.fatal(fmt.Errorf("authentication method %d is not supported through fenceline", code))
			default: // cleartext, MD5, GSS, SASL and SASL continue expect a reply
				ct, craw, err := s.cr.next()
				if err != nil {
					return fmt.Errorf("read authentication reply from client: %w", err)
				}
				if ct != 'p' {
					return s.fatal(fmt.Errorf("%w: message %q during authentication", ErrProtocol, ct))
				}
				if _, err := s.sw.Write(craw); err != nil {
					return err
				}
				if err := s.sw.Flush(); err != nil {
					return err
				}
			}
		case 'S':
			name, rest, _ := cstring(raw[5:])
			if name == "default_transaction_read_only" {
				raw = parameterStatus(name, "off")
			}
			s.parserSetting(name, rest)
			if err := s.writeClientRaw(raw); err != nil {
				return err
			}
		case 'K':
			if len(raw) == 13 {
				s.key = backendKey{binary.BigEndian.Uint32(raw[5:9]), binary.BigEndian.Uint32(raw[9:13])}
				s.p.registerKey(s.key)
			}
			if err := s.writeClientRaw(raw); err != nil {
				return err
			}
		case 'E':
			s.writeClientRaw(raw)
			f := errorFields(raw)
			return fmt.Errorf("server refused the session: %s", f['M'])
		case 'Z':
			s.txStatus = raw[5]
			return s.writeClientRaw(raw)
		default: // NoticeResponse, NegotiateProtocolVersion
			if err := s.writeClientRaw(raw); err != nil {
				return err
			}
		}
	}
}

func parameterStatus(name, value string) []byte {
	var w msgBuilder
	at := w.begin('S')
	w.str(name)
	w.str(value)
	w.end(at)
	return w.b
}

// stripPlus removes SCRAM-SHA-256-PLUS from an AuthenticationSASL message.
func stripPlus(raw []byte) []byte {
	var mechs []string
	b := raw[9:]
	for len(b) > 0 && b[0] != 0 {
		m, rest, err := cstring(b)
		if err != nil {
			return raw
		}
		if !strings.HasSuffix(m, "-PLUS") {
			mechs = append(mechs, m)
		}
		b = rest
	}
	var w msgBuilder
	at := w.begin('R')
	w.i32(10)
	for _, m := range mechs {
		w.str(m)
	}
	w.b = append(w.b, 0)
	w.end(at)
	return w.b
}

// forwardCancel passes a CancelRequest for a backend of a live session to
// the upstream; requests for unknown backends are dropped, as Postgres
// itself answers nothing either way.
func (s *session) forwardCancel(pkt []byte) {
	k := backendKey{binary.BigEndian.Uint32(pkt[8:12]), binary.BigEndian.Uint32(pkt[12:16])}
	if !s.p.knownKey(k) {
		s.p.log.Warn("cancel request for an unknown backend dropped", "pid", k.pid, "client", s.client.RemoteAddr().String())
		return
	}
	if err := s.p.cancelUpstream(k); err != nil {
		s.p.log.Warn("cancel request not forwarded", "pid", k.pid, "err", err)
	}
}

// cancelUpstream sends a CancelRequest for backend k to the upstream and
// waits until Postgres has handled it (it then closes the connection).
func (p *Proxy) cancelUpstream(k backendKey) error {
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.DialTimeout)
	defer cancel()
	c, err := p.cfg.Dial(ctx, upstreamNetwork(p.cfg.Upstream), p.cfg.Upstream)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(p.cfg.DialTimeout))
	var pkt [16]byte
	binary.BigEndian.PutUint32(pkt[0:], 16)
	binary.BigEndian.PutUint32(pkt[4:], cancelRequest)
	binary.BigEndian.PutUint32(pkt[8:], k.pid)
	binary.BigEndian.PutUint32(pkt[12:], k.secret)
	if _, err := c.Write(pkt[:]); err != nil {
		return err
	}
	io.Copy(io.Discard, c) //nolint:errcheck
	return nil
}

// fatalStartup answers the client with a FATAL error before a server exists.
func (s *session) fatalStartup(err error) error {
	s.client.Write(errorResponse('E', "FATAL", "08P01", "fenceline: "+err.Error(), "", ""))
	return err
}

// startupNamesFence refuses startup parameters that name the fence's
// schema (search_path=fenceline, options=-c search_path=fenceline, a
// fenceline.* setting): unqualified names would then resolve to the
// fence's objects, past fenceGuard.
func startupNamesFence(params map[string]string) *refusal {
	for k, v := range params {
		switch k {
		case "user", "database", "application_name":
			continue
		}
		if containsFold(k, Schema) || containsFold(v, Schema) {
			return &refusal{code: ReasonFenceTamper,
				reason: fmt.Sprintf("startup parameter %s names the fenceline schema, which holds the storage fence and which no agent reads or writes", k),
				hint:   "connect without it"}
		}
	}
	return nil
}
