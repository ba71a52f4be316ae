package gitproxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
)

// pkt-line framing (gitprotocol-common): four hex digits giving the length
// of the line including those four digits, then the payload. "0000" is a
// flush packet; "0001" and "0002" are protocol v2's delimiter and
// response-end, which a v0 receive-pack request never carries.
const (
	pktHeaderLen  = 4
	maxPktLen     = 65520 // LARGE_PACKET_MAX: the longest pkt-line git writes
	maxPktPayload = maxPktLen - pktHeaderLen
)

// errFlush is returned by readPkt for a flush packet.
var errFlush = errors.New("flush packet")

// pktReader reads pkt-lines from a buffered stream.
type pktReader struct {
	r   *bufio.Reader
	buf [maxPktPayload]byte
}

func newPktReader(r *bufio.Reader) *pktReader { return &pktReader{r: r} }

// next returns the payload of the next pkt-line, valid until the next call,
// or errFlush for a flush packet. A short, oversized or non-hex header is an
// error that says so.
func (p *pktReader) next() ([]byte, error) {
	var hdr [pktHeaderLen]byte
	if _, err := io.ReadFull(p.r, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("request ended before a flush packet: %w", io.ErrUnexpectedEOF)
		}
		return nil, fmt.Errorf("read pkt-line header: %w", err)
	}
	n, ok := parsePktLen(hdr)
	if !ok {
		return nil, fmt.Errorf("malformed pkt-line header %q: want four hex digits", hdr[:])
	}
	switch {
	case n == 0:
		return nil, errFlush
	case n < pktHeaderLen:
		return nil, fmt.Errorf("pkt-line header %q: special packets are not valid in a receive-pack request", hdr[:])
	case n > maxPktLen:
		return nil, fmt.Errorf("pkt-line of %d bytes is longer than git's maximum of %d", n, maxPktLen)
	}
	payload := p.buf[:n-pktHeaderLen]
	if _, err := io.ReadFull(p.r, payload); err != nil {
		return nil, fmt.Errorf("pkt-line truncated (want %d bytes): %w", n, io.ErrUnexpectedEOF)
	}
	return payload, nil
}

func parsePktLen(h [pktHeaderLen]byte) (int, bool) {
	n := 0
	for _, c := range h {
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, false
		}
		n = n<<4 | int(d)
	}
	return n, true
}

const hexDigits = "0123456789abcdef"

// appendPkt appends payload as one pkt-line. Payloads longer than a pkt-line
// can carry are a programming error.
func appendPkt(b []byte, payload ...string) []byte {
	n := pktHeaderLen
	for _, s := range payload {
		n += len(s)
	}
	if n > maxPktLen {
		panic(fmt.Sprintf("gitproxy: pkt-line of %d bytes", n))
	}
	b = append(b, hexDigits[n>>12&0xf], hexDigits[n>>8&0xf], hexDigits[n>>4&0xf], hexDigits[n&0xf])
	for _, s := range payload {
		b = append(b, s...)
	}
	return b
}

func appendFlush(b []byte) []byte { return append(b, "0000"...) }
