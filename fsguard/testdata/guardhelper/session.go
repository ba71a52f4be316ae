package main

// Modes that try to take a process out of its attempt: into another
// attempt's process group, or into a session of its own made from a
// thread that is not the process's first. Dispatched from init like
// attack.go.

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

func init() {
	if len(os.Args) < 2 {
		return
	}
	var run func([]string) int
	switch os.Args[1] {
	case "atk-joingroup":
		run = atkJoinGroup
	case "atk-threadsetsid":
		run = atkThreadSetsid
	default:
		return
	}
	os.Exit(run(os.Args[2:]))
}

// atkJoinGroup PGID OUT: moves this process into process group PGID,
// writes "joined" or "refused: ERRNO" and its pid to OUT, then sleeps
// until killed.
func atkJoinGroup(args []string) int {
	if len(args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: atk-joingroup PGID OUT")
		return 2
	}
	pgid, err := strconv.Atoi(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	result := "joined"
	if err := unix.Setpgid(0, pgid); err != nil {
		result = "refused: " + err.Error()
	}
	if err := os.WriteFile(args[1], fmt.Appendf(nil, "%s %d\n", result, os.Getpid()), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for {
		time.Sleep(time.Hour)
	}
}

// atkThreadSetsid STARTED GO OUT: calls setsid on a thread other than
// the process's first (the kernel names that thread, not the process, to
// the supervisor), writes "SID PID" to STARTED, then once GO exists (or
// after a minute) writes "finished" to OUT.
func atkThreadSetsid(args []string) int {
	if len(args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: atk-threadsetsid STARTED GO OUT")
		return 2
	}
	type result struct {
		sid, tid int
		err      error
	}
	done := make(chan result)
	for {
		go func() {
			runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
			tid := unix.Gettid()
			if tid == unix.Getpid() {
				done <- result{tid: tid}
				return
			}
			sid, err := unix.Setsid()
			done <- result{sid: sid, tid: tid, err: err}
		}()
		r := <-done
		if r.tid == unix.Getpid() {
			continue // the first thread: try another
		}
		if r.err != nil {
			fmt.Fprintln(os.Stderr, "setsid:", r.err)
			return 1
		}
		if err := os.WriteFile(args[0], fmt.Appendf(nil, "%d %d\n", r.sid, os.Getpid()), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		break
	}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(args[1]); err == nil {
			break
		}
	}
	if err := os.WriteFile(args[2], []byte("finished\n"), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}
