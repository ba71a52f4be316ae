// Ref advertisements: the receive-pack advertisement relayed (push-cert
// dropped, push-options remembered) and the upstream's refs read for the
// proxy's own decisions.

package gitproxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// advertisement relays the receive-pack ref advertisement and remembers
// whether the upstream takes push options, so the fence can travel as one.
func (p *Proxy) advertisement(w http.ResponseWriter, r *http.Request, e endpoint) {
	out, err := p.upstreamRequest(r, e, http.MethodGet, nil)
	if err != nil {
		http.Error(w, "fenceline: "+err.Error(), http.StatusBadRequest)
		return
	}
	resp, err := p.client.Do(out)
	if err != nil {
		http.Error(w, "fenceline: upstream git server unreachable: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		http.Error(w, "fenceline: read upstream advertisement: "+err.Error(), http.StatusBadGateway)
		return
	}
	if resp.StatusCode == http.StatusOK && resp.Header.Get("Content-Encoding") == "" {
		p.pushOptions.Store(e.repo, advertisesPushOptions(body))
		body = withoutCapability(body, "push-cert")
	}
	copyHeaders(w.Header(), resp.Header, "Content-Type", "Cache-Control", "Expires", "Pragma", "WWW-Authenticate", "Location")
	w.WriteHeader(resp.StatusCode)
	w.Write(body)
}

// advertisesPushOptions reads the capabilities of a receive-pack
// advertisement ("# service=…", flush, then "<oid> <ref>\0<caps>").
func advertisesPushOptions(body []byte) bool {
	pr := newPktReader(bufio.NewReader(bytes.NewReader(body)))
	for range 3 {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			continue
		}
		if err != nil {
			return false
		}
		if _, caps, ok := bytes.Cut(line, []byte{0}); ok {
			for _, c := range strings.Fields(string(caps)) {
				if c == "push-options" {
					return true
				}
			}
			return false
		}
	}
	return false
}

// withoutCapability removes capability name (and name=value) from a
// receive-pack advertisement; the rest is returned byte for byte. The
// proxy drops push-cert: it does not vouch for certificates, so git
// --signed=if-asked pushes unsigned and --signed=yes says the receiving
// end does not support signed pushes.
func withoutCapability(body []byte, name string) []byte {
	br := bufio.NewReader(bytes.NewReader(body))
	pr := newPktReader(br)
	off := 0
	for range 3 {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			off += pktHeaderLen
			continue
		}
		if err != nil {
			return body
		}
		end := off + pktHeaderLen + len(line)
		refPart, caps, ok := bytes.Cut(line, []byte{0})
		if !ok {
			off = end
			continue
		}
		nl := bytes.HasSuffix(caps, []byte("\n"))
		var kept []string
		for _, c := range strings.Fields(string(caps)) {
			if c != name && !strings.HasPrefix(c, name+"=") {
				kept = append(kept, c)
			}
		}
		payload := string(refPart) + "\x00" + strings.Join(kept, " ")
		if nl {
			payload += "\n"
		}
		out := append([]byte(nil), body[:off]...)
		out = appendPkt(out, payload)
		return append(out, body[end:]...)
	}
	return body
}

// upstreamRefs reads the upstream's ref advertisement of ps's repository
// for service (git-upload-pack names HEAD too), with the client's
// credentials and the sidecar's: ref name -> object id.
func (p *Proxy) upstreamRefs(ctx context.Context, ps *push, service string) (map[string]string, error) {
	u := p.endpointURL(endpoint{repo: ps.repoPath, service: service, refs: true})
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	copyHeaders(req.Header, ps.r.Header, "Authorization", "User-Agent")
	p.addUpstreamHeader(req.Header)
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read the upstream's refs: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read the upstream's refs: %s answered %s", u.Redacted(), resp.Status)
	}
	refs, err := parseAdvertisement(bufio.NewReader(io.LimitReader(resp.Body, 256<<20)))
	if err != nil {
		return nil, fmt.Errorf("read the upstream's refs: %w", err)
	}
	return refs, nil
}

// parseAdvertisement reads a smart-HTTP v0 ref advertisement: "# service=…",
// flush, then "<oid> <ref>[\0<caps>]" lines up to a flush.
func parseAdvertisement(br *bufio.Reader) (map[string]string, error) {
	pr := newPktReader(br)
	refs := map[string]string{}
	header, lines := false, 0
	for {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			if header && lines == 0 {
				header = false // the flush after "# service=…"
				continue
			}
			return refs, nil
		}
		if err != nil {
			return nil, err
		}
		s := strings.TrimSuffix(string(line), "\n")
		if lines == 0 && strings.HasPrefix(s, "# service=") {
			header = true
			continue
		}
		lines++
		s, _, _ = strings.Cut(s, "\x00")
		oid, ref, ok := strings.Cut(s, " ")
		if !ok || !validOID(oid) {
			return nil, fmt.Errorf("malformed advertisement line %q", clip(s))
		}
		if oid != zeroOID && !strings.HasSuffix(ref, "^{}") {
			refs[ref] = oid
		}
	}
}

// takesPushOptions reports whether the upstream's receive-pack
// advertisement for repo offers push-options: as last relayed to a client,
// else fetched now by the proxy itself (a client may push without the
// advertisement passing through here first).
func (p *Proxy) takesPushOptions(r *http.Request, repo string) bool {
	if v, ok := p.pushOptions.Load(repo); ok {
		return v == true
	}
	out, err := p.upstreamRequest(r, endpoint{repo: repo, service: serviceReceive, refs: true}, http.MethodGet, nil)
	if err != nil {
		return false
	}
	out.Header.Del("Content-Type")
	resp, err := p.client.Do(out)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Encoding") != "" {
		return false
	}
	takes := advertisesPushOptions(body)
	p.pushOptions.Store(repo, takes)
	return takes
}
