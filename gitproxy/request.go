package gitproxy

import (
	"bufio"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Limits on the command section of a push. Git itself writes one line per
// ref; these bounds only stop a hostile request from growing memory.
const (
	maxCommands = 10000
	maxOptions  = 1000
)

// zeroOID is the object id git uses for "no object": the old value of a
// create and the new value of a delete.
const zeroOID = "0000000000000000000000000000000000000000"

// command is one ref update of a push.
type command struct {
	Old, New string // 40 hex digits; zeroOID for none
	Ref      string
}

func (c command) isCreate() bool { return c.Old == zeroOID }
func (c command) isDelete() bool { return c.New == zeroOID }

// isBlindDelete reports a delete that names no old value: git sends one
// for a ref the remote did not advertise ("git push URL :nope"). The
// upstream deletes the ref whatever its value, if it has one.
func (c command) isBlindDelete() bool { return c.Old == zeroOID && c.New == zeroOID }

// pushRequest is the head of a git-receive-pack request: everything before
// the pack.
type pushRequest struct {
	Shallow  []string // "shallow <oid>" lines of a shallow client, kept for forwarding
	Commands []command
	Caps     []string
	Options  []string // push options, present when Caps has "push-options"
}

func (r *pushRequest) has(capability string) bool { return slices.Contains(r.Caps, capability) }

// hasPack reports whether a pack follows the head: git sends one unless
// every command is a delete.
func (r *pushRequest) hasPack() bool {
	for _, c := range r.Commands {
		if !c.isDelete() {
			return true
		}
	}
	return false
}

// errProbe is returned for a request that is a lone flush packet: git
// sends one before a large (chunked) push to check that it may post.
var errProbe = errors.New("probe request: no ref updates")

// errSigned refuses a signed push. The proxy does not advertise push-cert
// (the upstream's certificate would name a nonce the fence cannot vouch
// for), so git sends one only when told --signed=yes against that advice.
var errSigned = errors.New("signed pushes (push-cert) are not supported through fenceline: push without --signed, or with --signed=if-asked")

// readPushRequest parses the head of a receive-pack request from br and
// leaves br at the first byte of the pack. It is git's own parser where
// go-git v5's mis-reads push options: commands up to a flush, then, when
// negotiated, push options up to a flush. On an error it also returns
// what it read so far (capabilities, the commands before the bad line),
// so the refusal can reach git in its report-status.
func readPushRequest(br *bufio.Reader) (*pushRequest, error) {
	pr := newPktReader(br)
	req := &pushRequest{}
	for first := true; ; first = false {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			break
		}
		if err != nil {
			return req, fmt.Errorf("read push commands: %w", err)
		}
		s := strings.TrimSuffix(string(line), "\n")
		if first {
			if rest, ok := strings.CutPrefix(s, "push-cert"); ok && (rest == "" || rest[0] == 0) {
				_, caps, _ := strings.Cut(rest, "\x00")
				req.Caps = strings.Fields(caps)
				req.Commands = readCertCommands(pr)
				return req, errSigned
			}
		}
		if oid, ok := strings.CutPrefix(s, "shallow "); ok && len(req.Commands) == 0 {
			if !validOID(oid) {
				return req, fmt.Errorf("malformed shallow line %q: want \"shallow <40 hex digits>\"", clip(s))
			}
			req.Shallow = append(req.Shallow, oid)
			continue
		}
		if len(req.Commands) == 0 {
			var caps string
			s, caps, _ = strings.Cut(s, "\x00")
			req.Caps = strings.Fields(caps)
		}
		cmd, err := parseCommand(s)
		if err != nil {
			if ref, ok := refOf(s); ok {
				// Reported against its ref, so git shows why.
				req.Commands = append(req.Commands, command{Ref: ref})
			}
			return req, err
		}
		if len(req.Commands) == maxCommands {
			return req, fmt.Errorf("push updates more than %d refs: split it", maxCommands)
		}
		req.Commands = append(req.Commands, cmd)
	}
	if len(req.Commands) == 0 {
		return nil, errProbe
	}
	for _, c := range req.Caps {
		if v, ok := strings.CutPrefix(c, "object-format="); ok && v != "sha1" {
			return req, fmt.Errorf("object format %q is not supported: fenceline checks sha1 repositories", v)
		}
	}
	if !req.has("push-options") {
		return req, nil
	}
	for {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			return req, nil
		}
		if err != nil {
			return req, fmt.Errorf("read push options: %w", err)
		}
		if len(req.Options) == maxOptions {
			return req, fmt.Errorf("push carries more than %d push options", maxOptions)
		}
		opt := strings.TrimSuffix(string(line), "\n")
		if strings.ContainsAny(opt, "\x00\n") {
			return req, fmt.Errorf("push option %q contains a NUL or newline", clip(opt))
		}
		req.Options = append(req.Options, opt)
	}
}

// readCertCommands reads a push certificate up to "push-cert-end" and
// returns the ref updates it lists (after the blank line that ends its
// header), for the report that refuses them.
func readCertCommands(pr *pktReader) []command {
	var cmds []command
	body := false
	for range maxCommands + 16 {
		line, err := pr.next()
		if err != nil {
			return cmds
		}
		s := strings.TrimSuffix(string(line), "\n")
		switch {
		case s == "push-cert-end":
			return cmds
		case s == "":
			body = true
		case body:
			if c, err := parseCommand(s); err == nil {
				cmds = append(cmds, c)
			}
		}
	}
	return cmds
}

// refOf returns the valid ref name of a command line that is otherwise
// malformed ("<old> <new> <ref>").
func refOf(s string) (string, bool) {
	f := strings.SplitN(s, " ", 3)
	if len(f) != 3 || checkRefName(f[2]) != nil {
		return "", false
	}
	return f[2], true
}

// parseCommand parses "<old> <new> <ref>".
func parseCommand(s string) (command, error) {
	oldID, rest, ok1 := strings.Cut(s, " ")
	newID, ref, ok2 := strings.Cut(rest, " ")
	if !ok1 || !ok2 {
		return command{}, fmt.Errorf("malformed push command %q: want \"<old-oid> <new-oid> <ref>\"", clip(s))
	}
	if !validOID(oldID) || !validOID(newID) {
		return command{}, fmt.Errorf("malformed push command %q: object ids must be 40 lowercase hex digits", clip(s))
	}
	if err := checkRefName(ref); err != nil {
		return command{}, err
	}
	return command{Old: oldID, New: newID, Ref: ref}, nil
}

func validOID(s string) bool {
	if len(s) != 40 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// checkRefName applies git check-ref-format's rules to a full ref name.
func checkRefName(ref string) error {
	bad := func(why string) error {
		return fmt.Errorf("invalid ref name %q: %s", clip(ref), why)
	}
	if !strings.HasPrefix(ref, "refs/") {
		return bad("must start with refs/")
	}
	if strings.HasSuffix(ref, "/") || strings.HasSuffix(ref, ".") || strings.HasSuffix(ref, ".lock") {
		return bad("must not end with '/', '.' or '.lock'")
	}
	if strings.Contains(ref, "..") || strings.Contains(ref, "@{") || strings.Contains(ref, "//") || strings.Contains(ref, "/.") {
		return bad("must not contain '..', '@{', '//' or a component starting with '.'")
	}
	for i := 0; i < len(ref); i++ {
		c := ref[i]
		if c < 0x20 || c == 0x7f || strings.IndexByte(" ~^:?*[\\", c) >= 0 {
			return bad("must not contain control characters, spaces or any of ~^:?*[\\")
		}
	}
	return nil
}

// encodeHead writes the request head for the upstream: the same commands
// and shallow lines, caps (plus push-options when options are injected), and
// the client's push options followed by extra.
func (r *pushRequest) encodeHead(extra []string) []byte {
	caps := r.Caps
	sendOptions := r.has("push-options") || len(extra) > 0
	if sendOptions && !r.has("push-options") {
		caps = append(slices.Clip(caps), "push-options")
	}
	var b []byte
	for _, s := range r.Shallow {
		b = appendPkt(b, "shallow ", s)
	}
	for i, c := range r.Commands {
		if i == 0 {
			b = appendPkt(b, c.Old, " ", c.New, " ", c.Ref, "\x00", strings.Join(caps, " "))
			continue
		}
		b = appendPkt(b, c.Old, " ", c.New, " ", c.Ref)
	}
	b = appendFlush(b)
	if sendOptions {
		for _, o := range r.Options {
			b = appendPkt(b, o)
		}
		for _, o := range extra {
			b = appendPkt(b, o)
		}
		b = appendFlush(b)
	}
	return b
}

// clip shortens s for an error message.
func clip(s string) string {
	const max = 120
	if len(s) <= max {
		return s
	}
	return s[:max] + "…"
}
