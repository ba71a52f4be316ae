package egress

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// DefaultPort is the port an allowlist entry without one names.
const DefaultPort = 443

// Rule is one allowlist entry: a host pattern and a port.
type Rule struct {
	// Host is a lower-case name ("api.openai.com"), a wildcard
	// ("*.anthropic.com": any name beneath it, never the apex itself) or
	// an IP literal (only that address, written as an IP).
	Host string
	Port int
	addr netip.Addr // valid for an IP literal
}

func (r Rule) String() string { return net.JoinHostPort(r.Host, strconv.Itoa(r.Port)) }

// ParseRule reads an allowlist entry: HOST, HOST:PORT, *.DOMAIN[:PORT],
// IP or [IPv6]:PORT. The port defaults to 443.
func ParseRule(s string) (Rule, error) {
	raw := strings.TrimSpace(s)
	host, port := raw, DefaultPort
	if h, p, err := net.SplitHostPort(raw); err == nil {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return Rule{}, fmt.Errorf("allowed host %q: bad port %q", s, p)
		}
		host, port = h, n
	} else if strings.Count(raw, ":") == 1 {
		return Rule{}, fmt.Errorf("allowed host %q: %w", s, err)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return Rule{}, fmt.Errorf("allowed host %q: an address with a zone cannot be allowed", s)
		}
		a = a.Unmap()
		return Rule{Host: a.String(), Port: port, addr: a}, nil
	}
	host = normHost(host)
	name, wild := strings.CutPrefix(host, "*.")
	if !validName(name) {
		return Rule{}, fmt.Errorf("allowed host %q: want a host name (api.example.com), a wildcard (*.example.com) or an IP address, with an optional :port", s)
	}
	if wild && !strings.Contains(name, ".") {
		return Rule{}, fmt.Errorf("allowed host %q: a wildcard needs a domain beneath a top-level one (*.example.com)", s)
	}
	return Rule{Host: host, Port: port}, nil
}

// ParseRules reads every entry of ss.
func ParseRules(ss []string) ([]Rule, error) {
	var rs []Rule
	for _, s := range ss {
		r, err := ParseRule(s)
		if err != nil {
			return nil, err
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// Covers reports whether every host and port o allows, r allows too.
func (r Rule) Covers(o Rule) bool {
	if r.Port != o.Port {
		return false
	}
	if r.Host == o.Host {
		return true
	}
	if strings.HasPrefix(r.Host, "*.") && !o.addr.IsValid() {
		return strings.HasSuffix(o.Host, r.Host[1:]) // a name or a narrower wildcard beneath it
	}
	return false
}

// matches reports whether r allows host (normalized) on port.
func (r Rule) matches(host string, addr netip.Addr, port int) bool {
	if port != r.Port {
		return false
	}
	switch {
	case r.addr.IsValid():
		return addr.IsValid() && addr == r.addr
	case addr.IsValid():
		return false // an IP literal only matches an entry that names it
	case strings.HasPrefix(r.Host, "*."):
		return strings.HasSuffix(host, r.Host[1:]) && len(host) > len(r.Host)-1
	}
	return host == r.Host
}

// ParseResolve reads pins of names to addresses, each
// "HOST:PORT=ADDR:PORT" (like curl --resolve): a connection to HOST:PORT
// goes to ADDR:PORT, whatever DNS says, and that address is taken as
// explicitly allowed (it may be loopback: a test server).
func ParseResolve(ss []string) (map[string]netip.AddrPort, error) {
	pins := make(map[string]netip.AddrPort, len(ss))
	for _, s := range ss {
		from, to, ok := strings.Cut(strings.TrimSpace(s), "=")
		h, p, err := net.SplitHostPort(from)
		if !ok || err != nil || h == "" {
			return nil, fmt.Errorf("resolve %q: want HOST:PORT=ADDR:PORT, e.g. api.example.test:443=127.0.0.1:8443", s)
		}
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return nil, fmt.Errorf("resolve %q: bad port %q", s, p)
		}
		ap, err := netip.ParseAddrPort(to)
		if err != nil {
			return nil, fmt.Errorf("resolve %q: %s is not ADDR:PORT: %w", s, to, err)
		}
		pins[hostPort(normHost(h), n)] = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return pins, nil
}

// forbidden says why the proxy refuses to dial a, or "" when it may: the
// sidecar's own listeners and the bus live on loopback, cloud metadata on
// link-local; nothing the agent names reaches them unless pinned or
// allowed by address.
func forbidden(a netip.Addr) string {
	a = a.Unmap()
	switch {
	case a.IsLoopback():
		return "a loopback address (the sidecar's own ports and the bus are there)"
	case a.IsUnspecified() || (a.Is4() && a.As4()[0] == 0):
		return "an unspecified address (it reaches this host)"
	case a.IsLinkLocalUnicast():
		return "a link-local address (cloud metadata services are there)"
	case a.IsMulticast() || a.IsLinkLocalMulticast() || a.IsInterfaceLocalMulticast():
		return "a multicast address"
	case a.IsPrivate() || sharedAddrs.Contains(a):
		return "a private address (in a pod or a private network the bus and the fences' upstreams are there)"
	}
	return forbiddenThroughV4(a)
}

// IPv6 prefixes whose addresses a translator or tunnel turns into IPv4
// ones: judged by the IPv4 address they reach, or refused where it cannot
// be read off the address.
var (
	nat64Prefix = netip.MustParsePrefix("64:ff9b::/96")   // RFC 6052: the IPv4 address in the last 32 bits
	nat64Local  = netip.MustParsePrefix("64:ff9b:1::/48") // RFC 8215: where it sits depends on the operator's prefix
	sixToFour   = netip.MustParsePrefix("2002::/16")      // RFC 3056: the IPv4 address in bits 16 to 47
	teredo      = netip.MustParsePrefix("2001::/32")      // RFC 4380: the client's IPv4 address, obfuscated
	v4Compat    = netip.MustParsePrefix("::/96")          // RFC 4291's deprecated IPv4-compatible addresses
)

// forbiddenThroughV4 says why the proxy refuses an IPv6 address that
// reaches an IPv4 address it refuses (a NAT64 address of 127.0.0.1 is
// loopback by another name), or "".
func forbiddenThroughV4(a netip.Addr) string {
	if !a.Is6() {
		return ""
	}
	b := a.As16()
	v4 := func(off int) netip.Addr { return netip.AddrFrom4([4]byte(b[off : off+4])) }
	var via string
	var to netip.Addr
	switch {
	case nat64Local.Contains(a) || teredo.Contains(a):
		return "an IPv6 translation address (NAT64 local use, Teredo): the IPv4 address it reaches cannot be judged"
	case nat64Prefix.Contains(a):
		via, to = "a NAT64 address", v4(12)
	case sixToFour.Contains(a):
		via, to = "a 6to4 address", v4(2)
	case v4Compat.Contains(a):
		via, to = "an IPv4-compatible address", v4(12)
	default:
		return ""
	}
	if why := forbidden(to); why != "" {
		return via + " of " + to.String() + ", " + why
	}
	return ""
}

// sharedAddrs is the shared address space (RFC 6598, carrier-grade NAT and
// overlay networks): private in all but name.
var sharedAddrs = netip.MustParsePrefix("100.64.0.0/10")

// localAddr reports whether a is an address of one of this host's
// interfaces: a connection to it reaches every service listening on all
// interfaces (the bus, a local Postgres), as loopback would.
func localAddr(a netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return true // cannot tell: fail closed
	}
	for _, ia := range addrs {
		if p, err := netip.ParsePrefix(ia.String()); err == nil && p.Addr().Unmap() == a.Unmap() {
			return true
		}
	}
	return false
}

// normHost is host lower-cased without a trailing dot or IPv6 brackets.
func normHost(h string) string {
	h = strings.TrimSuffix(strings.ToLower(strings.TrimSpace(h)), ".")
	return strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
}

func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// validName reports whether s is a DNS name: labels of letters, digits,
// '-' and '_', separated by dots.
func validName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return false
			}
		}
	}
	return true
}

// HostPort normalizes "host[:port]" (port DefaultPort when absent) to the
// "host:port" Config.Inject and Config.Resolve are keyed by.
func HostPort(hp string) (string, error) {
	t, err := newTarget(hp, DefaultPort)
	if err != nil {
		return "", err
	}
	return t.String(), nil
}
