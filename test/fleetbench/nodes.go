package main

// Each node's resident memory and CPU, read from /proc (Linux).

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTick is the kernel's USER_HZ, the unit of utime and stime in
// /proc/PID/stat (100 on every Linux this runs on).
const clockTick = 100

// node is one process of the cluster the driver watches.
type node struct {
	name string
	pid  int

	rssFirst, rssLast, rssMax float64 // MB
	cpuAt                     time.Time
	cpuTicks                  uint64  // utime+stime at cpuAt
	cpuPct                    float64 // over the last sample interval
	steadyTicks               uint64  // utime+stime when the steady window began
	steadyAt                  time.Time
	gone                      bool // the process was not there at the last sample
}

// parseNodes reads "n0=123,n1=456".
func parseNodes(s string) ([]*node, error) {
	var out []*node
	if s == "" {
		return nil, nil
	}
	for _, part := range strings.Split(s, ",") {
		name, pid, ok := strings.Cut(part, "=")
		n, err := strconv.Atoi(pid)
		if !ok || err != nil || n <= 0 {
			return nil, fmt.Errorf("-nodes %q: want name=pid,name=pid", s)
		}
		out = append(out, &node{name: name, pid: n})
	}
	return out, nil
}

// readProc returns pid's resident set (MB) and its user+system CPU time in
// clock ticks.
func readProc(pid int) (rssMB float64, ticks uint64, err error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			rssMB = kb / 1024
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) may hold spaces: count from after its ')'.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields after the name", pid, len(f))
	}
	utime, _ := strconv.ParseUint(f[11], 10, 64) // field 14
	stime, _ := strconv.ParseUint(f[12], 10, 64) // field 15
	return rssMB, utime + stime, nil
}

// sample reads n's memory and CPU now.
func (n *node) sample(now time.Time) {
	rss, ticks, err := readProc(n.pid)
	if err != nil {
		n.gone = true
		return
	}
	n.gone = false
	if n.rssFirst == 0 {
		n.rssFirst = rss
	}
	n.rssLast, n.rssMax = rss, max(n.rssMax, rss)
	if !n.cpuAt.IsZero() {
		n.cpuPct = cpuPct(ticks-n.cpuTicks, now.Sub(n.cpuAt))
	}
	n.cpuAt, n.cpuTicks = now, ticks
}

// cpuPct is ticks of CPU over wall time d, in percent of one core.
func cpuPct(ticks uint64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(ticks) / clockTick / d.Seconds() * 100
}

// markSteady remembers n's CPU time at the start of the steady window.
func (n *node) markSteady(now time.Time) {
	n.sample(now)
	n.steadyTicks, n.steadyAt = n.cpuTicks, now
}

// steadyCPU is n's average CPU (percent of one core) since markSteady.
func (n *node) steadyCPU() float64 {
	return cpuPct(n.cpuTicks-n.steadyTicks, n.cpuAt.Sub(n.steadyAt))
}
