package policy

import (
	"slices"
	"syscall"
	"testing"
	"time"
)

// minorFaults is the process's page faults so far (pages touched the
// first time, or again after the runtime returned them).
func minorFaults() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Minflt
}

// BenchmarkPageFaultControl is the machine's price of a fresh page: the
// first write to each page of an anonymous mapping, timed like a
// decision. It is what a decision pays when the allocator hands it memory
// the process has not touched yet (13 µs at the median on the 2-core
// development machine, a virtual machine; ~1 µs on bare metal).
func BenchmarkPageFaultControl(b *testing.B) {
	mem, err := syscall.Mmap(-1, 0, b.N*4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		b.Fatal(err)
	}
	defer syscall.Munmap(mem)
	lat := make([]time.Duration, b.N)
	for i := range lat {
		lat[i] = 0 // the slice's own pages, before the clock runs
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		mem[i*4096] = 1
		lat[i] = time.Since(t0)
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[int(0.99*float64(len(lat)-1))].Nanoseconds())/1e3, "p99-µs")
}
