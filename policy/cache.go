package policy

import (
	"bytes"
	"hash/maphash"
	"runtime"
	"sync"
)

const (
	// decisionCacheMax bounds the decisions a generation keeps; past it
	// (or past decisionCacheBytes of keys) the cache starts again (a new
	// generation starts one anyway).
	decisionCacheMax = 1 << 13
	// decisionCacheBytes is the room for the keys of a generation's
	// decisions.
	decisionCacheBytes = 1 << 20
)

// decisionCache keeps the decisions of a Store's current generation by
// request. Its memory is allocated, and written once, by the Store's
// first Put, and reused by every generation after, so that caching a
// decision allocates nothing and touches no page the process has not
// used yet: a decision that grew a map, or faulted in a fresh page (13 µs
// and more on a virtual machine), was the tail of the evaluated
// decision's latency. Keys live in one byte arena and the index holds
// integers: the collector scans only the entries' verdict pointers.
type decisionCache struct {
	seed maphash.Seed

	mu      sync.RWMutex
	gen     uint64       // the generation whose decisions it holds; guarded by mu
	index   []uint32     // open addressing: entry number + 1, 0 empty; guarded by mu
	entries []cacheEntry // guarded by mu
	keys    []byte       // the entries' keys, end to end; guarded by mu
}

type cacheEntry struct {
	hash     uint64
	off, end uint32 // the key: keys[off:end]
	d        Decision
}

func newDecisionCache() *decisionCache {
	c := &decisionCache{
		seed:    maphash.MakeSeed(),
		index:   make([]uint32, 2*decisionCacheMax), // at most half full
		entries: make([]cacheEntry, 0, decisionCacheMax),
		keys:    make([]byte, 0, decisionCacheBytes),
	}
	// Write every page now, while the policy is installed, rather than
	// fault them in one by one under decisions.
	clear(c.index)
	clear(c.entries[:cap(c.entries)])
	clear(c.keys[:cap(c.keys)])
	return c
}

// heapPrefault is how much heap Prefault makes the process's own: about
// what a deciding process's heap grows to.
const heapPrefault = 8 << 20

var prefaultOnce sync.Once

// Prefault touches, once per process, the heap that decisions will grow
// into, and gives it back to the runtime (one collection). A fresh
// process's first decisions otherwise fault its pages in one by one (13 µs
// at the median and 50 µs and more at p99 on a virtual machine, 0.04 per
// evaluated decision over the first 20,000): the tail of an evaluated
// decision's latency until the heap reached its size. It costs about 40 ms
// of a 2-core virtual machine, so processes that decide for long (a run,
// a sidecar, the lease service) call it when they start, and a pre-receive
// hook does not.
func Prefault() {
	prefaultOnce.Do(func() {
		b := make([]byte, heapPrefault)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		runtime.KeepAlive(b)
		runtime.GC() // b is garbage now: its pages go back to the heap, faulted in

	})
}

// start empties the cache for generation gen: lookups and insertions of
// any other generation (a decision begun before a Put) miss and are
// dropped.
func (c *decisionCache) start(gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen = gen
	c.empty()
}

// empty drops every entry. Call with mu held.
func (c *decisionCache) empty() {
	clear(c.index)
	clear(c.entries) // no verdict of an old policy stays reachable
	c.entries, c.keys = c.entries[:0], c.keys[:0]
}

// find returns the index slot of key: the slot holding its entry, or the
// empty slot where it would go.
func (c *decisionCache) find(h uint64, key []byte) (slot uint32, found bool) {
	mask := uint32(len(c.index) - 1)
	for i := uint32(h) & mask; ; i = (i + 1) & mask {
		n := c.index[i]
		if n == 0 {
			return i, false
		}
		e := &c.entries[n-1]
		if e.hash == h && bytes.Equal(c.keys[e.off:e.end], key) {
			return i, true
		}
	}
}

func (c *decisionCache) get(gen uint64, key []byte) (Decision, bool) {
	h := maphash.Bytes(c.seed, key)
	c.mu.RLock()
	defer c.mu.RUnlock()
	if gen != c.gen {
		return Decision{}, false
	}
	slot, ok := c.find(h, key)
	if !ok {
		return Decision{}, false
	}
	return c.entries[c.index[slot]-1].d, true
}

func (c *decisionCache) put(gen uint64, key []byte, d Decision) {
	if len(key) > decisionCacheBytes/64 {
		return // a key this long is not kept (an absurd path): decided each time
	}
	h := maphash.Bytes(c.seed, key)
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen != c.gen {
		return // decided by a policy no longer in force
	}
	if len(c.entries) == cap(c.entries) || len(c.keys)+len(key) > cap(c.keys) {
		c.empty() // start again: old leases' questions go
	}
	slot, found := c.find(h, key)
	if found { // decided meanwhile by another goroutine: the same answer
		return
	}
	off := len(c.keys)
	c.keys = append(c.keys, key...)
	c.entries = append(c.entries, cacheEntry{hash: h, off: uint32(off), end: uint32(len(c.keys)), d: d})
	c.index[slot] = uint32(len(c.entries))
}
