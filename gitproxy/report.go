package gitproxy

import (
	"strings"
)

// Side-band channels (gitprotocol-pack): 1 carries the report, 2 progress
// text that git prints as "remote: …", 3 a fatal error.
const (
	bandData     = 1
	bandProgress = 2
)

// reportWriter builds a receive-pack response in the form the client asked
// for: report-status (or -v2) lines, inside side-band packets when
// side-band or side-band-64k was negotiated.
type reportWriter struct {
	req *pushRequest
	buf []byte
}

func (w *reportWriter) sideband() (ok bool, max int) {
	switch {
	case w.req.has("side-band-64k"):
		return true, maxPktPayload - 1
	case w.req.has("side-band"):
		return true, 1000 - pktHeaderLen - 1
	}
	return false, 0
}

// progress adds a line git prints as "remote: <line>" (side-band only).
func (w *reportWriter) progress(line string) {
	if ok, max := w.sideband(); ok {
		w.band(bandProgress, []byte(line+"\n"), max)
	}
}

// report adds the report-status: "unpack <status>", then one line per
// command: "ok <ref>" or "ng <ref> <reason>".
func (w *reportWriter) report(unpack string, refused []string) {
	if !w.req.has("report-status") && !w.req.has("report-status-v2") {
		return
	}
	var r []byte
	r = appendPkt(r, "unpack ", unpack, "\n")
	for i, c := range w.req.Commands {
		if refused[i] == "" {
			r = appendPkt(r, "ok ", c.Ref, "\n")
			continue
		}
		r = appendPkt(r, "ng ", c.Ref, " ", oneLine(refused[i], maxPktPayload-len(c.Ref)-5), "\n")
	}
	r = appendFlush(r)
	if ok, max := w.sideband(); ok {
		w.band(bandData, r, max)
		return
	}
	w.buf = append(w.buf, r...)
}

// bytes returns the response body.
func (w *reportWriter) bytes() []byte {
	if ok, _ := w.sideband(); ok {
		return appendFlush(w.buf)
	}
	return w.buf
}

func (w *reportWriter) band(ch byte, data []byte, max int) {
	for len(data) > 0 {
		n := min(len(data), max)
		w.buf = appendPkt(w.buf, string([]byte{ch}), string(data[:n]))
		data = data[n:]
	}
}

// oneLine makes s safe for a report line: no newlines, at most n bytes.
func oneLine(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		s = s[:n]
	}
	return s
}
