package pgproxy

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Protocol codes of the untyped first messages.
const (
	protoV3         = 3 << 16
	sslRequest      = 80877103
	gssEncRequest   = 80877104
	cancelRequest   = 80877102
	maxStartupBytes = 10000 // Postgres's own limit for a startup packet
)

// ErrProtocol is wrapped by errors about malformed protocol input.
var ErrProtocol = errors.New("postgres protocol violation")

// msgReader reads typed protocol messages from a buffered stream.
type msgReader struct {
	r   *bufio.Reader
	max int
	buf []byte // reused for each message: valid until the next read
}

func newMsgReader(r io.Reader, max int) *msgReader {
	return &msgReader{r: bufio.NewReaderSize(r, 32<<10), max: max}
}

// next reads one message and returns its type and its raw bytes (type,
// length and body). The slice is valid until the next call.
func (m *msgReader) next() (byte, []byte, error) {
	if cap(m.buf) < 5 {
		m.buf = make([]byte, 0, 8<<10)
	}
	hdr := m.buf[:5] // the last message's bytes are no longer valid
	if _, err := io.ReadFull(m.r, hdr); err != nil {
		return 0, nil, err
	}
	n := int(binary.BigEndian.Uint32(hdr[1:]))
	if n < 4 {
		return 0, nil, fmt.Errorf("%w: message %q with length %d", ErrProtocol, hdr[0], n)
	}
	if n > m.max {
		return 0, nil, fmt.Errorf("%w: message %q of %d bytes is over the limit of %d", ErrProtocol, hdr[0], n, m.max)
	}
	total := n + 1
	if cap(m.buf) < total {
		nb := make([]byte, total, max(total, 8<<10))
		copy(nb, hdr)
		m.buf = nb
	}
	b := m.buf[:total]
	if _, err := io.ReadFull(m.r, b[5:]); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	if cap(m.buf) > 1<<20 && total < 64<<10 {
		// Do not keep a huge buffer after one large message.
		m.buf = nil
	}
	return b[0], b, nil
}

// peek waits for the next byte without consuming it (a read deadline
// on the connection bounds the wait; the reader stays usable after it).
func (m *msgReader) peek() (byte, error) {
	b, err := m.r.Peek(1)
	if err != nil {
		return 0, err
	}
	return b[0], nil
}

// buffered reports how many bytes are read ahead.
func (m *msgReader) buffered() int { return m.r.Buffered() }

// readStartup reads an untyped startup-phase packet (length, then body).
func readStartup(r io.Reader) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n < 8 || n > maxStartupBytes {
		return nil, fmt.Errorf("%w: startup packet of %d bytes", ErrProtocol, n)
	}
	b := make([]byte, n)
	copy(b, hdr[:])
	if _, err := io.ReadFull(r, b[4:]); err != nil {
		return nil, fmt.Errorf("read startup packet: %w", err)
	}
	return b, nil
}

// cstring reads a NUL-terminated string from b.
func cstring(b []byte) (string, []byte, error) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return "", nil, fmt.Errorf("%w: unterminated string", ErrProtocol)
	}
	return string(b[:i]), b[i+1:], nil
}

// twoCStrings reads the two NUL-terminated strings a Parse (statement,
// query) or a Bind (portal, statement) starts with, and what follows.
func twoCStrings(b []byte) (string, string, []byte, error) {
	first, rest, err := cstring(b)
	if err != nil {
		return "", "", nil, err
	}
	second, rest, err := cstring(rest)
	if err != nil {
		return "", "", nil, err
	}
	return first, second, rest, nil
}

// msgBuilder appends protocol messages to a byte slice.
type msgBuilder struct{ b []byte }

func (w *msgBuilder) begin(t byte) int {
	w.b = append(w.b, t, 0, 0, 0, 0)
	return len(w.b) - 4
}

func (w *msgBuilder) end(at int) {
	binary.BigEndian.PutUint32(w.b[at:], uint32(len(w.b)-at))
}

func (w *msgBuilder) str(s string) { w.b = append(w.b, s...); w.b = append(w.b, 0) }
func (w *msgBuilder) i16(v int)    { w.b = binary.BigEndian.AppendUint16(w.b, uint16(v)) }
func (w *msgBuilder) i32(v int)    { w.b = binary.BigEndian.AppendUint32(w.b, uint32(v)) }

func (w *msgBuilder) query(sql string) {
	at := w.begin('Q')
	w.str(sql)
	w.end(at)
}

func (w *msgBuilder) parse(name, sql string) {
	at := w.begin('P')
	w.str(name)
	w.str(sql)
	w.i16(0)
	w.end(at)
}

// bind binds statement stmt to portal with text parameters, text results.
func (w *msgBuilder) bind(portal, stmt string, params ...string) {
	at := w.begin('B')
	w.str(portal)
	w.str(stmt)
	w.i16(0)
	w.i16(len(params))
	for _, p := range params {
		w.i32(len(p))
		w.b = append(w.b, p...)
	}
	w.i16(0)
	w.end(at)
}

func (w *msgBuilder) execute(portal string) {
	at := w.begin('E')
	w.str(portal)
	w.i32(0)
	w.end(at)
}

func (w *msgBuilder) sync() { w.b = append(w.b, 'S', 0, 0, 0, 4) }

func (w *msgBuilder) close(kind byte, name string) {
	at := w.begin('C')
	w.b = append(w.b, kind)
	w.str(name)
	w.end(at)
}

// errorResponse builds an ErrorResponse (or NoticeResponse with t 'N').
func errorResponse(t byte, severity, code, msg, detail, hint string) []byte {
	var w msgBuilder
	at := w.begin(t)
	field := func(f byte, v string) {
		if v != "" {
			w.b = append(w.b, f)
			w.str(v)
		}
	}
	field('S', severity)
	field('V', severity)
	field('C', code)
	field('M', msg)
	field('D', detail)
	field('H', hint)
	w.b = append(w.b, 0)
	w.end(at)
	return w.b
}

// errorFields parses an ErrorResponse or NoticeResponse body.
func errorFields(raw []byte) map[byte]string {
	m := map[byte]string{}
	b := raw[5:]
	for len(b) > 0 && b[0] != 0 {
		f := b[0]
		v, rest, err := cstring(b[1:])
		if err != nil {
			break
		}
		m[f] = v
		b = rest
	}
	return m
}
