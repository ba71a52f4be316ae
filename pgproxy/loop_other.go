//go:build !linux

package pgproxy

import "time"

// Off Linux every session runs on goroutines (see loop_linux.go).

type (
	eventLoop   struct{}
	sessionLoop struct{}
)

func (p *Proxy) startLoop()         {}
func (p *Proxy) closeLoopIfIdle()   {}
func (p *Proxy) waitLoop()          {}
func (sl *sessionLoop) abort()      {}
func (s *session) moveToLoop() bool { return false }

func (s *session) serveOnLoop() (error, error) { panic("pgproxy: no event loop off Linux") }

func (s *session) waitClientReadable(time.Duration) (bool, error) {
	panic("pgproxy: no event loop off Linux")
}

func (s *session) lockClient()     { s.cmu.Lock() }
func (s *session) unlockClient()   { s.cmu.Unlock() }
func (s *session) wakeClient()     { s.goWakeClient() }
func (s *session) waitWake() error { return s.goWaitWake() }
func (s *session) waitChan(ch <-chan struct{}, timeout time.Duration) bool {
	return goWaitChan(ch, timeout)
}
func (s *session) blocking(f func())             { f() }
func (s *session) setServerDeadline(d time.Time) { s.goSetServerDeadline(d) }
func (s *session) closeServerWrite()             { s.goCloseServerWrite() }
func (s *session) yieldIfLong(*msgReader)        {}

func (s *session) closeClient() { s.client.Close() }
