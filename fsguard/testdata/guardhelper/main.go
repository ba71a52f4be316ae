// Command guardhelper is a static (CGO_ENABLED=0) test program for fsguard:
// it makes system calls directly, as a Go binary does, with no libc to hook.
package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: guardhelper write PATH | connect ADDR | probe DIR FILE | create DIR N | openloop PATH N")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "write":
		err := os.WriteFile(os.Args[2], []byte("x"), 0o644)
		fmt.Println(res(err))
		if err != nil {
			os.Exit(1)
		}
	case "connect":
		c, err := net.DialTimeout("tcp", os.Args[2], 5*time.Second)
		if err == nil {
			c.Close()
		}
		fmt.Println(res(err))
	case "probe":
		probe(os.Args[2], os.Args[3])
	case "create":
		n, _ := strconv.Atoi(os.Args[3])
		start := time.Now()
		for i := range n {
			if err := os.WriteFile(filepath.Join(os.Args[2], "f"+strconv.Itoa(i)), []byte("small file\n"), 0o644); err != nil {
				fmt.Println(res(err))
				os.Exit(1)
			}
		}
		fmt.Println(time.Since(start).Nanoseconds())
	case "openloop":
		n, _ := strconv.Atoi(os.Args[3])
		start := time.Now()
		for range n {
			fd, err := syscall.Open(os.Args[2], syscall.O_WRONLY|syscall.O_CLOEXEC, 0)
			if err != nil {
				fmt.Println(res(err))
				os.Exit(1)
			}
			syscall.Close(fd)
		}
		fmt.Println(time.Since(start).Nanoseconds())
	default:
		if f, ok := netModes[os.Args[1]]; ok { // net.go
			f(os.Args[2:])
			return
		}
		fmt.Fprintln(os.Stderr, "unknown mode", os.Args[1])
		os.Exit(2)
	}
}

// probe tries every few milliseconds, at most 3000 times, to write and
// read, and prints one line per round. It renames and removes a file of
// its own (made again while it may write) and reads file, which it never
// changes: a loss landing between a removal and the write that restores
// it (or between two renames) must not leave the read failing for good.
func probe(dir, file string) {
	scratch := file + ".probe"
	for i := range 3000 {
		p := filepath.Join(dir, "p"+strconv.Itoa(i))
		w := os.WriteFile(p, []byte("x"), 0o644)
		m := os.Mkdir(p+".d", 0o755)
		if _, err := os.Stat(scratch); err != nil {
			os.WriteFile(scratch, []byte("data"), 0o644)
		}
		r := os.Rename(scratch, scratch+".moved")
		if r == nil {
			os.Rename(scratch+".moved", scratch)
		}
		u := os.Remove(scratch)
		if u == nil {
			os.WriteFile(scratch, []byte("data"), 0o644)
		}
		_, rd := os.ReadFile(file)
		fmt.Printf("round=%d write=%s mkdir=%s rename=%s unlink=%s read=%s\n", i, res(w), res(m), res(r), res(u), res(rd))
		time.Sleep(5 * time.Millisecond)
	}
}

func res(err error) string {
	if err == nil {
		return "ok"
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.EACCES:
			return "EACCES"
		case syscall.EPERM:
			return "EPERM"
		case syscall.EXDEV:
			return "EXDEV"
		case syscall.ECONNREFUSED:
			return "ECONNREFUSED"
		case syscall.ENOENT:
			return "ENOENT"
		}
		return errno.Error()
	}
	return err.Error()
}
