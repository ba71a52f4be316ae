package gittrap

import (
	"bytes"
	"crypto/sha1"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
)

// ForgeCommitGraph rewrites graph (a SHA-1 repository's
// objects/info/commit-graph) so that the commit real it lists is listed
// as shown instead: git then reads shown's tree, parents and date from
// real's entry, believing the file over the commit object. The lookup
// table must stay sorted with shown in real's place (callers pick real so
// it does); the fanout and the checksum are made anew.
func ForgeCommitGraph(graph []byte, real, shown string) ([]byte, error) {
	r, err := hex.DecodeString(real)
	if err != nil || len(r) != sha1.Size {
		return nil, fmt.Errorf("forge commit-graph: bad id %q", real)
	}
	s, err := hex.DecodeString(shown)
	if err != nil || len(s) != sha1.Size {
		return nil, fmt.Errorf("forge commit-graph: bad id %q", shown)
	}
	b := bytes.Clone(graph)
	if len(b) < 8+12 || string(b[:4]) != "CGPH" {
		return nil, errors.New("forge commit-graph: not a commit-graph")
	}
	chunks := map[string]int{}
	for i := 0; i <= int(b[6]); i++ {
		chunks[string(b[8+12*i:12+12*i])] = int(binary.BigEndian.Uint64(b[12+12*i : 20+12*i]))
	}
	oidf, oidl := chunks["OIDF"], chunks["OIDL"]
	n := int(binary.BigEndian.Uint32(b[oidf+4*255:]))
	at := -1
	for i := range n {
		if bytes.Equal(b[oidl+20*i:oidl+20*i+20], r) {
			at = i
		}
	}
	if at < 0 {
		return nil, fmt.Errorf("forge commit-graph: %s is not in it", real)
	}
	copy(b[oidl+20*at:], s)
	for i := 1; i < n; i++ {
		if bytes.Compare(b[oidl+20*(i-1):oidl+20*i], b[oidl+20*i:oidl+20*i+20]) >= 0 {
			return nil, fmt.Errorf("forge commit-graph: %s does not sort in %s's place", shown, real)
		}
	}
	for f := range 256 {
		c := 0
		for i := range n {
			if int(b[oidl+20*i]) <= f {
				c++
			}
		}
		binary.BigEndian.PutUint32(b[oidf+4*f:], uint32(c))
	}
	sum := sha1.Sum(b[:len(b)-20])
	copy(b[len(b)-20:], sum[:])
	return b, nil
}
