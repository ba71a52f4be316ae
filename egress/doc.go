// Package egress is the guarded agent's way out to the network: an
// HTTP(S) forward proxy the sidecar serves and the agent's environment
// points at (HTTPS_PROXY, HTTP_PROXY). The file guard lets the agent
// connect only to the sidecar's ports, so this proxy is the only road to
// any other host, and it decides per request:
//
//	CONNECT host:port / GET http://host/...
//	  the git upstream's host:port    served by the git fence (Intercept):
//	                                  TLS terminated with a certificate the
//	                                  sidecar's local CA mints, then the
//	                                  fence judges every push; it serves
//	                                  only the repository's smart-HTTP
//	                                  endpoints (403 for any other path)
//	  on the allowlist (Allow)        tunnelled untouched (TLS end to end,
//	                                  the client verifies the real host)
//	  anything else                   403, a body naming the host, the lease
//	                                  and the flag to add (--allow-host), a
//	                                  log line and an audit event (boundary
//	                                  net, reason not-allowed)
//
// An allowlist entry is a host name ("api.openai.com"), a wildcard
// ("*.anthropic.com": names beneath it, not the apex) or an IP address,
// with port 443 unless it names one ("host:8443"). An IP literal is only
// reached when an entry names that address.
//
// A name is resolved once, every address it resolves to is judged, and the
// proxy dials the judged address, never the name again, so a DNS answer
// that changes between check and connection (rebinding) gains nothing.
// Loopback (the sidecar's admin and fence ports, the bus), unspecified,
// link-local (cloud metadata), multicast, private and shared (100.64/10)
// addresses and this host's own addresses (where a pod's bus and the
// fences' upstreams live) are refused unless an operator pins the name to
// an address (Resolve, the --egress-resolve flag, like curl --resolve) or
// allows the address itself. A name that resolves to an address of an
// intercepted host (the git upstream) is refused on every port: a CNAME or
// an alias under an allowed wildcard would carry a push around the git
// fence (TestAttackAllowedNameIntoThePrivateNetwork,
// TestAttackGitUpstreamByAnotherName).
//
//	agent (HTTPS_PROXY)          egress proxy                 api host
//	  | CONNECT api:443 ----------->| allowed? resolve, judge     |
//	  |                             |------------ TCP ----------->|
//	  |<-- 200 Connection established                             |
//	  |<========== TLS, end to end (untouched) ==================>|
//	  | CONNECT other:443 --------->|
//	  |<-- 403 "other:443 refused for lease …; --allow-host other"
//
// A tunnel is untouched: what an allowed host serves is what the agent
// reaches (a CDN that fronts other names by SNI or Host, a hosting API
// that writes repositories with the agent's token, e.g. api.github.com:
// allowing it lets the agent change refs past the git fence).
//
// # Transparent capture
//
// A client that ignores HTTPS_PROXY (Node 20's fetch, a static binary,
// a raw socket) connects to an address itself. The file guard's
// supervisor performs every connect: one it would refuse (any address but
// the loopback's, or port 53) is connected to this proxy instead and
// announced with a CONNECT carrying CaptureHeader (the address the agent
// chose as its authority), written before any byte of the agent's. The
// proxy answers nothing and judges the stream itself:
//
//	agent (no proxy)        supervisor              egress proxy            host
//	  | connect(A:443) ------->| connect(proxy)          |                    |
//	  |                        | CONNECT A:443 + header ->|                    |
//	  |<-- 0 (connected) ------|                          |                    |
//	  | ClientHello (SNI api) ---------------------------->| allowed? resolve api, judge
//	  |                                                    |------ TCP -------->| (api's address,
//	  |<================== TLS, end to end ==================================> |  never A)
//
// TLS is judged by the ClientHello's server name (none: by the address,
// which must be allowed as one) and dialled by that name, resolved and
// judged like a CONNECT: a server name of an allowed host on a connect to
// another address reaches the allowed host only. An intercepted or
// injected host is served as through CONNECT (its TLS terminated with the
// run's CA, the credential added). Plain HTTP is served as HTTP_PROXY
// requests, each judged by its Host header at the port the agent chose.
// Anything else is refused and audited (boundary net). Port 53 is DNS over
// TCP (RFC 7766): the proxy answers A and AAAA queries for names the
// agent may reach (allowlist entries, names under a wildcard, intercepted
// and injected hosts) with the addresses it resolves (a pin wins;
// loopback, link-local and the like left out), other names NXDOMAIN
// (audited once per connection); nothing is forwarded to a DNS server.
//
// The proxy does not look at the lease's state: egress is not a write to
// anything fenceline fences (pushes still go through the git fence, which
// does).
package egress
