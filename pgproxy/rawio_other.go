//go:build !linux

package pgproxy

import (
	"io"
	"net"
)

// newRawIO is c itself off Linux (see rawio_linux.go).
func newRawIO(c net.Conn) io.ReadWriter { return c }
