package egress

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsTTL is the TTL of the proxy's answers: short, the proxy dials by
// name anyway.
const dnsTTL = 30

// maxDNSQueries bounds the queries one captured DNS connection may ask.
const maxDNSQueries = 256

// serveDNS answers DNS over TCP (RFC 7766: two-byte length, message) on a
// captured connection to port 53. A name the agent may reach (an
// allowlist entry's, a wildcard's, an intercepted or injected host's) is
// resolved by the proxy and answered with its addresses; any other name
// gets NXDOMAIN, logged and audited once per connection. Nothing is
// forwarded to a DNS server: the agent learns addresses of allowed names
// only, and what it then connects to is captured and judged by name again.
func (p *Proxy) serveDNS(ctx context.Context, c *bufConn) {
	refused := map[string]bool{}
	for range maxDNSQueries {
		c.SetReadDeadline(time.Now().Add(sniffTimeout))
		var n [2]byte
		if _, err := io.ReadFull(c, n[:]); err != nil {
			return
		}
		msg := make([]byte, binary.BigEndian.Uint16(n[:]))
		if _, err := io.ReadFull(c, msg); err != nil {
			return
		}
		resp, err := p.answerDNS(ctx, msg, refused)
		if err != nil {
			p.log.Debug("fenceline egress: bad DNS query", "err", err)
			return
		}
		out := binary.BigEndian.AppendUint16(nil, uint16(len(resp)))
		c.SetWriteDeadline(time.Now().Add(sniffTimeout))
		if _, err := c.Write(append(out, resp...)); err != nil {
			return
		}
	}
}

// answerDNS answers one query message; refused holds the names already
// audited on this connection.
func (p *Proxy) answerDNS(ctx context.Context, msg []byte, refused map[string]bool) ([]byte, error) {
	var parser dnsmessage.Parser
	h, err := parser.Start(msg)
	if err != nil {
		return nil, err
	}
	q, err := parser.Question()
	if err != nil {
		return nil, err
	}
	rh := dnsmessage.Header{ID: h.ID, Response: true, OpCode: h.OpCode, RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	name := strings.ToLower(strings.TrimSuffix(q.Name.String(), "."))
	var answers []netip.Addr
	switch {
	case h.OpCode != 0 || q.Class != dnsmessage.ClassINET:
		rh.RCode = dnsmessage.RCodeNotImplemented
	case !p.nameAllowed(name):
		rh.RCode = dnsmessage.RCodeNameError
		if p.searchExpansion(name) {
			p.log.Debug("fenceline egress: DNS lookup of an allowed name under a search domain answered NXDOMAIN", "name", name)
		} else if !refused[name] {
			refused[name] = true
			flag := p.cfg.Hint + " " + name
			p.recordRefusal(ctx, "DNS lookup of "+name, &refusal{target: target{host: name, port: 53},
				why: "not on the egress allowlist (answered NXDOMAIN)", hint: "let the agent reach it with " + flag})
		}
	case q.Type == dnsmessage.TypeA || q.Type == dnsmessage.TypeAAAA:
		addrs, err := p.lookupName(ctx, name)
		if err != nil {
			p.log.Warn("fenceline egress: cannot resolve an allowed name for the agent", "name", name, "err", err)
			rh.RCode = dnsmessage.RCodeServerFailure
			break
		}
		for _, a := range addrs {
			if a.Is4() == (q.Type == dnsmessage.TypeA) {
				answers = append(answers, a)
			}
		}
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(q); err != nil {
		return nil, err
	}
	if err := b.StartAnswers(); err != nil {
		return nil, err
	}
	for _, a := range answers {
		rrh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: dnsTTL}
		if a.Is4() {
			err = b.AResource(rrh, dnsmessage.AResource{A: a.As4()})
		} else {
			err = b.AAAAResource(rrh, dnsmessage.AAAAResource{AAAA: a.As16()})
		}
		if err != nil {
			return nil, err
		}
	}
	return b.Finish()
}

// nameAllowed reports whether the agent may reach name on some port: an
// allowlist entry names it (or a wildcard covers it), or it is an
// intercepted or injected host.
func (p *Proxy) nameAllowed(name string) bool {
	if !validName(name) {
		return false
	}
	for _, r := range p.cfg.Allow {
		if r.matches(name, netip.Addr{}, r.Port) {
			return true
		}
	}
	for hp := range p.intercept {
		if h, _, err := net.SplitHostPort(hp); err == nil && h == name {
			return true
		}
	}
	return false
}

// lookupName resolves an allowed name for the agent's resolver: a pin
// of the name (on any port) wins; otherwise the proxy's resolver, without
// the addresses the proxy would never dial (loopback, link-local, ...).
func (p *Proxy) lookupName(ctx context.Context, name string) ([]netip.Addr, error) {
	var out []netip.Addr
	for hp, ap := range p.cfg.Resolve {
		if h, _, err := net.SplitHostPort(hp); err == nil && h == name && !slices.Contains(out, ap.Addr().Unmap()) {
			out = append(out, ap.Addr().Unmap())
		}
	}
	if len(out) > 0 {
		return out, nil
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	addrs, err := p.cfg.LookupIP(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", name, err)
	}
	for _, a := range addrs {
		if a = a.Unmap(); forbidden(a) == "" && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out, nil
}

// searchExpansion reports whether name is an allowed name with one of the
// resolver's search domains appended.
func (p *Proxy) searchExpansion(name string) bool {
	for _, d := range p.cfg.DNSSearch {
		if base, ok := strings.CutSuffix(name, "."+d); ok && p.nameAllowed(base) {
			return true
		}
	}
	return false
}

// resolvConfSearch reads the search domains of a resolv.conf (none when
// it cannot be read).
func resolvConfSearch(path string) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		return []string{}
	}
	out := []string{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && (f[0] == "search" || f[0] == "domain") {
			for _, d := range f[1:] {
				if d = strings.ToLower(strings.Trim(d, ".")); d != "" && !slices.Contains(out, d) {
					out = append(out, d)
				}
			}
		}
	}
	return out
}
