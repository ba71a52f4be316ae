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

// readPushRequest parses the head of a receive-pack request from br and
// leaves br at the first byte of the pack. It is git's own parser where
// go-git v5's mis-reads push options: commands up to a flush, then, when
// negotiated, push options up to a flush.
func readPushRequest(br *bufio.Reader) (*pushRequest, error) {
	pr := newPktReader(br)
	req := &pushRequest{}
	for first := true; ; first = false {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read push commands: %w", err)
		}
		s := strings.TrimSuffix(string(line), "\n")
		if first {
			if strings.HasPrefix(s, "push-cert") {
				return nil, errors.New("signed pushes (push-cert) are not supported through fenceline: push without --signed")
			}
		}
		if oid, ok := strings.CutPrefix(s, "shallow "); ok && len(req.Commands) == 0 {
			if !validOID(oid) {
				return nil, fmt.Errorf("malformed shallow line %q: want \"shallow <40 hex digits>\"", clip(s))
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
			return nil, err
		}
		if len(req.Commands) == maxCommands {
			return nil, fmt.Errorf("push updates more than %d refs: split it", maxCommands)
		}
		req.Commands = append(req.Commands, cmd)
	}
	if len(req.Commands) == 0 {
		return nil, errProbe
	}
	for _, c := range req.Caps {
		if v, ok := strings.CutPrefix(c, "object-format="); ok && v != "sha1" {
			return nil, fmt.Errorf("object format %q is not supported: fenceline checks sha1 repositories", v)
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
			return nil, fmt.Errorf("read push options: %w", err)
		}
		if len(req.Options) == maxOptions {
			return nil, fmt.Errorf("push carries more than %d push options", maxOptions)
		}
		opt := strings.TrimSuffix(string(line), "\n")
		if strings.ContainsAny(opt, "\x00\n") {
			return nil, fmt.Errorf("push option %q contains a NUL or newline", clip(opt))
		}
		req.Options = append(req.Options, opt)
	}
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
	if oldID == zeroOID && newID == zeroOID {
		return command{}, fmt.Errorf("push command for %s has neither an old nor a new object", clip(ref))
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
