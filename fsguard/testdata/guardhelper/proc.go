package main

// Calls on another process by pid (proc_linux.go).

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"

	"golang.org/x/sys/unix"
)

func init() {
	netModes["proc"] = procTarget // proc self|child|PID: each call sets what is already set
}

// procTarget sets the target's RLIMIT_NOFILE, nice value and CPU affinity
// to what they are (harmless, but each is a change as the kernel judges
// it), and its process group's nice value, printing how each ended.
func procTarget(args []string) {
	pid := 0
	switch args[0] {
	case "self":
		pid = os.Getpid()
	case "child":
		c := exec.Command("sleep", "30")
		if err := c.Start(); err != nil {
			fmt.Println("start child:", err)
			os.Exit(1)
		}
		defer c.Process.Kill()
		pid = c.Process.Pid
	default:
		pid, _ = strconv.Atoi(args[0])
	}
	var lim unix.Rlimit
	err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &lim)
	read := res(err)
	if err == nil {
		err = unix.Prlimit(pid, unix.RLIMIT_NOFILE, &lim, nil)
	}
	out := "prlimit-read=" + read + " prlimit=" + res(err)
	prio, err := unix.Getpriority(unix.PRIO_PROCESS, pid)
	if err == nil {
		err = unix.Setpriority(unix.PRIO_PROCESS, pid, 20-prio) // getpriority's 1..40 back to nice
	}
	out += " setpriority=" + res(err)
	var set unix.CPUSet
	err = unix.SchedGetaffinity(pid, &set)
	if err == nil {
		err = unix.SchedSetaffinity(pid, &set)
	}
	out += " affinity=" + res(err)
	// The target's process group (not user-wide: were it let through, a
	// user-wide call would renice every process of the uid, the machine's
	// when the tests run as root).
	pgid, err := unix.Getpgid(pid)
	if err == nil {
		if prio, err = unix.Getpriority(unix.PRIO_PGRP, pgid); err == nil {
			err = unix.Setpriority(unix.PRIO_PGRP, pgid, 20-prio)
		}
	}
	fmt.Println(out + " setpriority-pgrp=" + res(err))
}
