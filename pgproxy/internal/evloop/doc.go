// Package evloop runs code that blocks on sockets as coroutines of one
// event loop: one locked thread waiting in epoll for every descriptor its
// tasks wait on, resuming each task where it waited. A task is written as
// straight-line code (read, write, wait for a signal, with deadlines);
// between a readiness and the task's read there is no scheduler and no
// poller, only the runtime's direct coroutine switch.
//
// It is the I/O design docs/benchmarks.md measured for the Postgres fence
// (stop 55): a relay on such a loop costs what PgBouncer costs per
// transaction, 0.91–1.03×, where a goroutine per direction costs 1.3–1.7×,
// and its coroutines cost 3–5 % over a loop without them.
//
// The loop waits with a raw epoll_pwait: the runtime does not take its
// processor away while it sleeps, and does not make it take one back when
// it wakes. While it sleeps that processor runs nothing else, so a process
// whose other goroutines must keep running gives the loop one processor
// more (GOMAXPROCS) than they need; otherwise they wait for the runtime to
// preempt the loop (about 10 ms).
//
// Every method but Post and Close runs on the loop's thread: in a task, or
// in a function given to Post. A task holds that thread until it waits:
// one with much to do between waits Yields now and then (Running says how
// long it has run). Should epoll itself fail, the loop closes as on Close
// (every wait ends with ErrClosed, posted functions run) and Run returns
// the failure once the tasks have ended.
//
// It is built for Linux (epoll) only.
package evloop
