// Package host is the bookkeeping of the host-memory KV tier: a pool of N
// fixed-size slots, each holding one KV block under its chained block hash,
// with its own LRU over resident blocks and pin counts for blocks whose copy
// is in flight. It is memory-agnostic: the slots' bytes come from an
// Allocator (plain Go memory in tests, pinned CUDA host memory later) and
// the package never copies block data itself; the caller (the manager)
// queues the copies and reports their completion.
//
// A slot is in one of three states:
//
//   - free: holds nothing;
//   - reserved: Reserve handed it out for an incoming copy (a demotion from
//     the GPU or a fetch from the shared tier); it is pinned, invisible to
//     Lookup, and becomes resident on Commit or free again on Abort;
//   - resident: holds a block Lookup can match; evictable by Reserve when
//     its pin count is zero (the least recently used such block goes first),
//     never while a copy out of it (a reload) is in flight: Pin/PinPrefix
//     and Unpin bracket such copies.
//
// Every failing call leaves the pool as it was and returns an error with a
// kverr code. A Pool is safe for concurrent use (one mutex; every call is a
// few map and list operations).
package host

import (
	"sync"

	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/internal/kverr"
)

// Allocator provides the pool's backing memory: one region of size bytes,
// returned by Free when the pool closes.
type Allocator interface {
	Alloc(size int) ([]byte, error)
	Free(b []byte) error
}

// GoAllocator allocates ordinary Go memory.
type GoAllocator struct{}

// Alloc implements Allocator.
func (GoAllocator) Alloc(size int) ([]byte, error) { return make([]byte, size), nil }

// Free implements Allocator.
func (GoAllocator) Free([]byte) error { return nil }

// Config sizes a pool.
type Config struct {
	Slots      int       // number of blocks the pool holds; > 0
	BlockBytes int       // bytes of one block (all layers' K and V); > 0
	Alloc      Allocator // nil: GoAllocator
}

// Slot is a slot's index, 0 <= Slot < Config.Slots; its bytes are
// Pool.Bytes(slot), at offset Slot*BlockBytes of the region.
type Slot int32

// NoSlot is returned with an error.
const NoSlot Slot = -1

type state uint8

const (
	free state = iota
	reserved
	resident
)

type slot struct {
	hash       uint64
	st         state
	pins       int32
	prev, next Slot // LRU links among resident slots; NoSlot at the ends
}

// Stats are the pool's counters and gauges.
type Stats struct {
	Slots       int   // capacity
	Resident    int   // slots holding a committed block
	Reserved    int   // slots with an incoming copy in flight
	Pinned      int   // slots with a nonzero pin count (reserved ones included)
	Demotions   int64 // Reserve calls that succeeded (an incoming copy)
	Commits     int64 // reserved slots committed
	Aborts      int64 // reserved slots aborted
	SkippedFull int64 // Reserve calls refused: every slot pinned
	Evictions   int64 // resident blocks evicted to make room
	Hits        int64 // blocks matched by Lookup/PinPrefix
	Misses      int64 // blocks asked of Lookup/PinPrefix and not matched

	// Of the batched calls by key (keyed.go):
	SkippedPresent int64 // keys ReserveKeys skipped: in the pool already, or repeated
	Stale          int64 // keys CompleteKeys or UnpinKeys found nothing to do for
	Resets         int64 // Reset calls
}

// Pool is the host tier's slot pool. See the package comment.
type Pool struct {
	mu         sync.Mutex
	cfg        Config
	mem        []byte
	slots      []slot
	index      map[uint64]Slot // reserved and resident slots by hash
	freeList   []Slot
	head, tail Slot // LRU: head is the most recently used resident slot
	st         Stats
	closed     bool
}

// New allocates a pool's memory and returns it, all slots free.
func New(cfg Config) (*Pool, error) {
	if cfg.Slots <= 0 || cfg.BlockBytes <= 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: %d slots of %d bytes", cfg.Slots, cfg.BlockBytes)
	}
	if cfg.Slots > limits.TierSlots || int64(cfg.Slots)*int64(cfg.BlockBytes) > limits.TierBytes {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: %d slots of %d bytes is too large", cfg.Slots, cfg.BlockBytes)
	}
	if cfg.Alloc == nil {
		cfg.Alloc = GoAllocator{}
	}
	size := cfg.Slots * cfg.BlockBytes
	mem, err := cfg.Alloc.Alloc(size)
	if err != nil {
		return nil, kverr.Wrap(kverr.OutOfMemory, err, "host tier: allocating %d bytes", size)
	}
	if len(mem) < size {
		_ = cfg.Alloc.Free(mem)
		return nil, kverr.Errorf(kverr.Internal, "host tier: the allocator returned %d bytes, not %d", len(mem), size)
	}
	p := &Pool{cfg: cfg, mem: mem, slots: make([]slot, cfg.Slots), index: make(map[uint64]Slot, cfg.Slots),
		freeList: make([]Slot, cfg.Slots), head: NoSlot, tail: NoSlot}
	for i := range p.freeList {
		p.freeList[i] = Slot(cfg.Slots - 1 - i) // slot 0 is handed out first
		p.slots[i].prev, p.slots[i].next = NoSlot, NoSlot
	}
	p.st.Slots = cfg.Slots
	return p, nil
}

// Close returns the memory to the allocator. It fails with InvalidArgument
// while any slot is pinned (a copy may still touch it).
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if p.st.Pinned > 0 {
		return kverr.Errorf(kverr.InvalidArgument, "host tier: closing with %d slots pinned", p.st.Pinned)
	}
	p.closed = true
	err := p.cfg.Alloc.Free(p.mem)
	p.mem = nil
	return err
}

// BlockBytes returns the size of one slot.
func (p *Pool) BlockBytes() int { return p.cfg.BlockBytes }

// Memory returns the whole backing region (slot s at s*BlockBytes).
func (p *Pool) Memory() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mem
}

// Bytes returns slot s's memory. The caller may use it only while the slot
// is reserved or pinned.
func (p *Pool) Bytes(s Slot) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || s < 0 || int(s) >= len(p.slots) {
		return nil
	}
	off := int(s) * p.cfg.BlockBytes
	return p.mem[off : off+p.cfg.BlockBytes : off+p.cfg.BlockBytes]
}

func (p *Pool) check(s Slot) error {
	if p.closed {
		return kverr.Errorf(kverr.InvalidHandle, "host tier: closed")
	}
	if s < 0 || int(s) >= len(p.slots) {
		return kverr.Errorf(kverr.InvalidArgument, "host tier: slot %d out of range [0, %d)", s, len(p.slots))
	}
	return nil
}

// Reserve hands out a slot for an incoming copy of block hash: a free one,
// else the slot of the least recently used unpinned resident block, which
// is evicted. The slot is pinned until Commit or Abort. It fails with
// InvalidArgument when hash is already reserved or resident (nothing to
// copy), and with OutOfBlocks, counted in SkippedFull, when every slot is
// pinned: the demotion is skipped.
func (p *Pool) Reserve(hash uint64) (Slot, error) {
	s, _, err := p.ReserveEvict(hash)
	return s, err
}

// Eviction reports the resident block a ReserveEvict call evicted to
// free its slot: Hash is its key; Evicted is false when the slot was free.
type Eviction struct {
	Hash    uint64
	Evicted bool
}

// ReserveEvict is Reserve that also reports the block it evicted, if any,
// so that the caller can announce the eviction (the manager's KV events):
// the evicted block was resident in the returned slot.
func (p *Pool) ReserveEvict(hash uint64) (Slot, Eviction, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return NoSlot, Eviction{}, kverr.Errorf(kverr.InvalidHandle, "host tier: closed")
	}
	if s, ok := p.index[hash]; ok {
		return NoSlot, Eviction{}, kverr.Errorf(kverr.InvalidArgument, "host tier: block %016x is already in slot %d", hash, s)
	}
	var ev Eviction
	s := p.popFree()
	if s == NoSlot {
		s = p.tail
		for s != NoSlot && p.slots[s].pins > 0 {
			s = p.slots[s].prev
		}
		if s == NoSlot {
			p.st.SkippedFull++
			return NoSlot, Eviction{}, kverr.Errorf(kverr.OutOfBlocks, "host tier: all %d slots pinned", len(p.slots))
		}
		ev = Eviction{Hash: p.evictResident(s), Evicted: true}
	}
	p.reserveFree(s, hash)
	return s, ev, nil
}

// Commit marks reserved slot s's copy complete: its block becomes resident,
// most recently used and unpinned (other pins taken since Reserve, none
// possible today, would remain).
func (p *Pool) Commit(s Slot) error { return p.commit(s, false) }

// CommitPinned is Commit that keeps the slot pinned, for a caller that
// reads the block next (a store to the shared tier): no other call can
// evict or reuse the slot between its commit and the pin, as one could
// between Commit and Pin. Unpin it when done.
func (p *Pool) CommitPinned(s Slot) error { return p.commit(s, true) }

func (p *Pool) commit(s Slot, keepPin bool) error {
	return p.onSlot(s, reserved, "is not reserved", func() { p.commitReserved(s, keepPin) })
}

// Abort gives reserved slot s back: its copy failed or was cancelled.
func (p *Pool) Abort(s Slot) error {
	return p.onSlot(s, reserved, "is not reserved", func() { p.abortReserved(s) })
}

// onSlot runs act under the lock if slot s is valid and in state st;
// otherwise it fails with NotFound, saying the slot not (what it is not).
func (p *Pool) onSlot(s Slot, st state, not string, act func()) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(s); err != nil {
		return err
	}
	if p.slots[s].st != st {
		return kverr.Errorf(kverr.NotFound, "host tier: slot %d %s", s, not)
	}
	act()
	return nil
}

// The slot transitions below are shared by the per-slot calls and the
// batched calls by key (keyed.go), so that both keep the same counters and
// the same LRU. The caller holds the lock and has checked the slot's state.

// popFree takes the free slot freed last off the free list; NoSlot when
// none is free.
func (p *Pool) popFree() Slot {
	n := len(p.freeList)
	if n == 0 {
		return NoSlot
	}
	s := p.freeList[n-1]
	p.freeList = p.freeList[:n-1]
	return s
}

// reserveFree hands out free slot s, already off the free list, for an
// incoming copy of block hash: pinned until commitReserved or
// abortReserved, and out of the LRU (ReserveKeys links it at once).
func (p *Pool) reserveFree(s Slot, hash uint64) {
	p.slots[s] = slot{hash: hash, st: reserved, pins: 1, prev: NoSlot, next: NoSlot}
	p.index[hash] = s
	p.st.Reserved++
	p.st.Pinned++
	p.st.Demotions++
}

// commitReserved makes reserved slot s's block resident and drops the pin
// its reservation took, unless keepPin. A slot Reserve handed out becomes
// the most recently used; one ReserveKeys handed out is in the LRU already
// and keeps its place there.
func (p *Pool) commitReserved(s Slot, keepPin bool) {
	p.slots[s].st = resident
	p.st.Reserved--
	p.st.Resident++
	p.st.Commits++
	if !keepPin {
		p.unpin(s)
	}
	if !p.linked(s) {
		p.pushFront(s)
	}
}

// abortReserved gives reserved slot s back to the free list, to be reused
// first.
func (p *Pool) abortReserved(s Slot) {
	if p.linked(s) { // a ReserveKeys slot
		p.unlink(s)
	}
	delete(p.index, p.slots[s].hash)
	p.slots[s] = slot{st: free, prev: NoSlot, next: NoSlot}
	p.st.Reserved--
	p.st.Pinned--
	p.st.Aborts++
	p.freeList = append(p.freeList, s)
}

// Drop evicts key hash's block if it is resident and unpinned, freeing
// its slot (counted as an eviction), and returns its slot; NoSlot, with
// nothing changed, when the key is absent, reserved or pinned.
func (p *Pool) Drop(hash uint64) Slot {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.index[hash]
	if !ok || p.closed || p.slots[s].st == reserved || p.slots[s].pins > 0 {
		return NoSlot
	}
	p.evictResident(s)
	p.freeList = append(p.freeList, s)
	return s
}

// evictResident drops unpinned resident slot s's block and returns its
// hash. The slot is left free but off the free list: the caller either
// reserves it at once (ReserveEvict) or decides where it goes on the free
// list (ReserveKeys).
func (p *Pool) evictResident(s Slot) uint64 {
	h := p.slots[s].hash
	p.unlink(s)
	delete(p.index, h)
	p.slots[s] = slot{st: free, prev: NoSlot, next: NoSlot}
	p.st.Resident--
	p.st.Evictions++
	return h
}

// Lookup returns the length of the longest run of hashes, from the first,
// that are resident, and marks them most recently used. It pins nothing:
// a copy out of the matched slots must use PinPrefix instead.
func (p *Pool) Lookup(hashes []uint64) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.match(hashes, nil, false)
}

// Peek returns what Lookup would, without marking anything used or
// counting hits and misses: a look ahead of the lookup that follows.
func (p *Pool) Peek(hashes []uint64) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, h := range hashes {
		if s, ok := p.index[h]; !ok || p.slots[s].st != resident {
			break
		}
		n++
	}
	return n
}

// PinPrefix is Lookup that also pins the matched slots, writing them to
// slots[:n] (slots may be nil when the caller only needs the pins; else it
// must hold len(hashes)). Each must be Unpin'd when its copy completes.
func (p *Pool) PinPrefix(hashes []uint64, slots []Slot) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if slots != nil && len(slots) < len(hashes) {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "host tier: %d slots for %d hashes", len(slots), len(hashes))
	}
	if p.closed {
		return 0, kverr.Errorf(kverr.InvalidHandle, "host tier: closed")
	}
	return p.match(hashes, slots, true), nil
}

func (p *Pool) match(hashes []uint64, out []Slot, pin bool) int {
	n := 0
	for _, h := range hashes {
		s, ok := p.index[h]
		if !ok || p.slots[s].st != resident {
			break
		}
		p.unlink(s)
		p.pushFront(s)
		if pin {
			p.pin(s)
		}
		if out != nil {
			out[n] = s
		}
		n++
	}
	p.st.Hits += int64(n)
	p.st.Misses += int64(len(hashes) - n)
	return n
}

// Pin pins resident slot s (a copy out of it is in flight): it is not
// evicted until as many Unpin calls.
func (p *Pool) Pin(s Slot) error {
	return p.onSlot(s, resident, "holds no block", func() { p.pin(s) })
}

// Unpin drops one pin of resident slot s. (A reserved slot's pin is
// dropped by Commit or Abort.)
func (p *Pool) Unpin(s Slot) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(s); err != nil {
		return err
	}
	if p.slots[s].st != resident || p.slots[s].pins == 0 {
		return kverr.Errorf(kverr.NotFound, "host tier: slot %d is not pinned", s)
	}
	p.unpin(s)
	return nil
}

// Hash returns the block hash slot s holds and whether it holds one
// (reserved or resident).
func (p *Pool) Hash(s Slot) (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.check(s) != nil || p.slots[s].st == free {
		return 0, false
	}
	return p.slots[s].hash, true
}

// Stats returns the counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.st
}

func (p *Pool) pin(s Slot) {
	if p.slots[s].pins == 0 {
		p.st.Pinned++
	}
	p.slots[s].pins++
}

func (p *Pool) unpin(s Slot) {
	p.slots[s].pins--
	if p.slots[s].pins == 0 {
		p.st.Pinned--
	}
}

func (p *Pool) pushFront(s Slot) {
	sl := &p.slots[s]
	sl.prev, sl.next = NoSlot, p.head
	if p.head != NoSlot {
		p.slots[p.head].prev = s
	}
	p.head = s
	if p.tail == NoSlot {
		p.tail = s
	}
}

func (p *Pool) unlink(s Slot) {
	sl := &p.slots[s]
	if sl.prev != NoSlot {
		p.slots[sl.prev].next = sl.next
	} else if p.head == s {
		p.head = sl.next
	}
	if sl.next != NoSlot {
		p.slots[sl.next].prev = sl.prev
	} else if p.tail == s {
		p.tail = sl.prev
	}
	sl.prev, sl.next = NoSlot, NoSlot
}

// lru returns the resident slots' hashes, most recently used first (tests).
func (p *Pool) lru() []uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []uint64
	for s := p.head; s != NoSlot; s = p.slots[s].next {
		out = append(out, p.slots[s].hash)
	}
	return out
}
