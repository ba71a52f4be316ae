// Command wakecost measures what it costs on this machine for one process
// to wake another: two processes bounce a 16-byte message over a Unix
// socket pair with blocking reads and writes, and it prints the round trip's
// wall time and CPU time (both processes). A proxy adds two such wake-ups to
// every request and response, so scripts/bench-pg.sh prints this beside its
// ratios: where it is large, any proxy (PgBouncer too) is far from free.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"
)

func main() {
	n := flag.Int("n", 100000, "round trips")
	child := flag.Bool("child", false, "internal: the echoing side, on fd 3")
	flag.Parse()
	runtime.LockOSThread()
	if *child {
		echo(3, *n)
		return
	}
	if err := run(*n); err != nil {
		fmt.Fprintln(os.Stderr, "wakecost:", err)
		os.Exit(1)
	}
}

func run(n int) error {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		return fmt.Errorf("socketpair: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "wakecost"), os.NewFile(uintptr(fds[1]), "wakecost-child")
	defer ours.Close()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, "-child", "-n", fmt.Sprint(n))
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the echoing process: %w", err)
	}
	theirs.Close()
	var before syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &before); err != nil {
		return err
	}
	start := time.Now()
	buf := make([]byte, 64)
	for range n {
		if _, err := ours.Write(buf[:16]); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if _, err := io.ReadFull(ours, buf[:16]); err != nil {
			return fmt.Errorf("read: %w", err)
		}
	}
	wall := time.Since(start)
	var after syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &after); err != nil {
		return err
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("echoing process: %w", err)
	}
	childCPU := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	selfCPU := cpu(after) - cpu(before)
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(n) / 1e3 }
	fmt.Printf("process wake-up round trip (unix socket): %.1f us wall, %.1f us CPU (%d round trips)\n",
		per(wall), per(selfCPU+childCPU), n)
	return nil
}

// echo answers n messages on fd. The socket is blocking, so os.File reads
// and writes it with plain system calls, like the parent.
func echo(fd, n int) {
	f := os.NewFile(uintptr(fd), "wakecost-parent")
	buf := make([]byte, 64)
	for range n {
		if _, err := io.ReadFull(f, buf[:16]); err != nil {
			os.Exit(1)
		}
		if _, err := f.Write(buf[:16]); err != nil {
			os.Exit(1)
		}
	}
}

func cpu(r syscall.Rusage) time.Duration {
	return time.Duration(r.Utime.Nano() + r.Stime.Nano())
}
