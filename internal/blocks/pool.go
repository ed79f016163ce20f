// Package blocks is the paged KV block pool: numBlocks blocks of blockSize
// token slots each, with reference counts, a free queue and the Cached state
// that the prefix cache retains blocks in.
//
// A Pool is not safe for concurrent use; its owner (the KV manager)
// serialises every call.
//
// Every block is in one of three states:
//
//	Free    ref == 0, in the free queue, available to Allocate.
//	InUse   ref > 0, referenced by one or more sequences.
//	Cached  ref == 0, but retained by an external owner (the prefix cache)
//	        that marked it with MarkCached; Incref brings it back to InUse,
//	        Evict or UnmarkCached returns it to Free.
//
// Allocation prefers contiguous block ids (TokenAttention's contiguous-first
// policy), so kernels read runs of blocks rather than scattered ones.
package blocks

import (
	"fmt"
	"math"

	"github.com/kvplug/kvplug/internal/kverr"
)

// Limits of New's arguments.
const (
	// MaxBlocks bounds the pool so its bookkeeping (about 13 bytes a block)
	// stays under 1 GiB: a larger request is refused with an error instead
	// of failing an allocation the Go runtime cannot recover from.
	MaxBlocks    = 1 << 26
	MaxBlockSize = 1 << 16
)

// State is a block's state.
type State uint8

const (
	Free State = iota
	InUse
	Cached
)

func (s State) String() string {
	switch s {
	case Free:
		return "free"
	case InUse:
		return "in use"
	case Cached:
		return "cached"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// none marks the end of the free list and "no block".
const none = -1

// Pool is a fixed set of KV blocks.
//
// The free queue is an intrusive doubly-linked list threaded through the
// prev/next arrays, so any free block can be unlinked in O(1): Allocate takes
// a block next to the sequence's last one wherever it sits in the queue.
type Pool struct {
	blockSize int
	ref       []int32
	state     []State
	retained  []bool // marked by MarkCached: goes to Cached, not Free, at ref 0
	prev      []int32
	next      []int32
	head      int32
	tail      int32

	numFree   int
	numInUse  int
	numCached int
	numShared int // blocks with ref > 1
	peakInUse int
}

// Stats are the pool's counters.
type Stats struct {
	Total     int // blocks in the pool
	Free      int // in the free queue
	InUse     int // ref > 0
	Cached    int // ref == 0, retained by the prefix cache
	PeakInUse int // highest InUse since New
	Shared    int // ref > 1
}

// New returns a pool of numBlocks free blocks of blockSize token slots.
// numBlocks must be in [1, MaxBlocks = 2^26] and blockSize in [1, 2^16].
func New(numBlocks, blockSize int) (*Pool, error) {
	if numBlocks < 1 || numBlocks > MaxBlocks {
		return nil, kverr.Errorf(kverr.InvalidArgument, "num_blocks must be in [1, 2^26]: got %d", numBlocks)
	}
	if blockSize < 1 || blockSize > MaxBlockSize {
		return nil, kverr.Errorf(kverr.InvalidArgument, "block_size must be in [1, 2^16]: got %d", blockSize)
	}
	p := &Pool{
		blockSize: blockSize,
		ref:       make([]int32, numBlocks),
		state:     make([]State, numBlocks),
		retained:  make([]bool, numBlocks),
		prev:      make([]int32, numBlocks),
		next:      make([]int32, numBlocks),
		head:      0,
		tail:      int32(numBlocks - 1),
		numFree:   numBlocks,
	}
	// Ascending order: the first allocations walk one long run from block 0.
	for i := range numBlocks {
		p.prev[i] = int32(i - 1)
		p.next[i] = int32(i + 1)
	}
	p.next[numBlocks-1] = none
	return p, nil
}

// NumBlocks returns the pool's size.
func (p *Pool) NumBlocks() int { return len(p.ref) }

// BlockSize returns the token slots per block.
func (p *Pool) BlockSize() int { return p.blockSize }

// NumFree returns the number of blocks in the free queue.
func (p *Pool) NumFree() int { return p.numFree }

// State returns a block's state; Free for an id outside the pool.
func (p *Pool) State(id int32) State {
	if !p.valid(id) {
		return Free
	}
	return p.state[id]
}

// Ref returns a block's reference count; -1 for an id outside the pool.
func (p *Pool) Ref(id int32) int32 {
	if !p.valid(id) {
		return -1
	}
	return p.ref[id]
}

// IsCached reports whether the block is marked as retained by the prefix
// cache (whether it is InUse or already Cached).
func (p *Pool) IsCached(id int32) bool { return p.valid(id) && p.retained[id] }

// Stats returns the pool's counters.
func (p *Pool) Stats() Stats {
	return Stats{
		Total:     len(p.ref),
		Free:      p.numFree,
		InUse:     p.numInUse,
		Cached:    p.numCached,
		PeakInUse: p.peakInUse,
		Shared:    p.numShared,
	}
}

func (p *Pool) valid(id int32) bool { return id >= 0 && int(id) < len(p.ref) }

// Allocate fills dst with len(dst) newly allocated blocks (ref 1, InUse), all
// or none: with fewer free blocks it returns OutOfBlocks and changes nothing.
//
// Contiguous first: hint is the block the new ones will follow (the
// sequence's current last block, or -1 for none; an id outside the pool counts
// as none). If hint+1 is free the run continues there, and each next block is
// hint+2, hint+3, ... while those are free. When the run breaks, allocation
// restarts at the free queue's head and again extends contiguously from it.
// Each block costs O(1).
func (p *Pool) Allocate(dst []int32, hint int32) error {
	if len(dst) > p.numFree {
		return kverr.Errorf(kverr.OutOfBlocks, "allocate: %d blocks needed, %d free", len(dst), p.numFree)
	}
	cur := int32(none)
	if p.valid(hint) {
		cur = hint + 1
	}
	n := int32(len(p.ref))
	for i := range dst {
		if cur < 0 || cur >= n || p.state[cur] != Free {
			cur = p.head
		}
		p.unlink(cur)
		p.state[cur] = InUse
		p.ref[cur] = 1
		dst[i] = cur
		cur++
	}
	p.numFree -= len(dst)
	p.numInUse += len(dst)
	p.peakInUse = max(p.peakInUse, p.numInUse)
	return nil
}

// Incref adds one reference to each block of ids (a repeated id gets one per
// occurrence). Every block must be InUse or Cached; a Cached block becomes
// InUse again. All or none: a bad id, or a count that would pass 2^31-1,
// changes nothing.
func (p *Pool) Incref(ids []int32) error {
	// Pass 1 increments tentatively, so repeats are counted exactly, and
	// undoes its work on the first bad id.
	joinedShared := 0
	for i, id := range ids {
		var err error
		switch {
		case !p.valid(id):
			err = kverr.Errorf(kverr.InvalidArgument, "incref: block %d is outside the pool of %d", id, len(p.ref))
		case p.state[id] == Free:
			err = kverr.Errorf(kverr.InvalidArgument, "incref: block %d is free", id)
		case p.ref[id] == math.MaxInt32:
			err = kverr.Errorf(kverr.InvalidArgument, "incref: block %d already has 2^31-1 references", id)
		}
		if err != nil {
			for _, u := range ids[:i] {
				p.ref[u]--
			}
			return err
		}
		p.ref[id]++
		if p.ref[id] == 2 {
			joinedShared++
		}
	}
	p.numShared += joinedShared
	// Pass 2 revives Cached blocks; a repeated id is revived once.
	for _, id := range ids {
		if p.state[id] == Cached {
			p.state[id] = InUse
			p.numCached--
			p.numInUse++
		}
	}
	p.peakInUse = max(p.peakInUse, p.numInUse)
	return nil
}

// Decref drops one reference from each block of ids (a repeated id loses one
// per occurrence). A block reaching ref 0 returns to the free queue, unless
// it is marked cached: then it enters the Cached state and is appended to
// becameCached, whose extended slice is returned (the prefix cache makes those
// blocks evictable; pass a slice with capacity to avoid allocating).
// All or none: a block outside the pool or with too few references changes
// nothing.
func (p *Pool) Decref(ids []int32, becameCached []int32) ([]int32, error) {
	// Pass 1 decrements tentatively, so repeats are counted exactly, and
	// undoes its work on the first bad id.
	leftShared := 0
	for i, id := range ids {
		if !p.valid(id) || p.ref[id] < 1 {
			for _, u := range ids[:i] {
				p.ref[u]++
			}
			if !p.valid(id) {
				return becameCached, kverr.Errorf(kverr.InvalidArgument, "decref: block %d is outside the pool of %d", id, len(p.ref))
			}
			return becameCached, kverr.Errorf(kverr.InvalidArgument, "decref: block %d has no reference left (%s)", id, p.state[id])
		}
		p.ref[id]--
		if p.ref[id] == 1 {
			leftShared++
		}
	}
	p.numShared -= leftShared
	// Pass 2 moves blocks that reached 0; a repeated id moves only once
	// because its state is no longer InUse the second time.
	for _, id := range ids {
		if p.ref[id] != 0 || p.state[id] != InUse {
			continue
		}
		p.numInUse--
		if p.retained[id] {
			p.state[id] = Cached
			p.numCached++
			becameCached = append(becameCached, id)
			continue
		}
		p.release(id)
	}
	return becameCached, nil
}

// MarkCached marks an InUse or Cached block as retained by the prefix cache:
// when its last reference goes it enters the Cached state instead of the
// free queue. Marking a marked block is a no-op.
func (p *Pool) MarkCached(id int32) error {
	if !p.valid(id) {
		return kverr.Errorf(kverr.InvalidArgument, "mark cached: block %d is outside the pool of %d", id, len(p.ref))
	}
	if p.state[id] == Free {
		return kverr.Errorf(kverr.InvalidArgument, "mark cached: block %d is free", id)
	}
	p.retained[id] = true
	return nil
}

// UnmarkCached withdraws the prefix cache's claim on a block: an InUse block
// will go to the free queue at ref 0; a Cached block goes there now.
// Unmarking an unmarked InUse block is a no-op.
func (p *Pool) UnmarkCached(id int32) error {
	if !p.valid(id) {
		return kverr.Errorf(kverr.InvalidArgument, "unmark cached: block %d is outside the pool of %d", id, len(p.ref))
	}
	if p.state[id] == Free {
		return kverr.Errorf(kverr.InvalidArgument, "unmark cached: block %d is free", id)
	}
	p.retained[id] = false
	if p.state[id] == Cached {
		p.numCached--
		p.release(id)
	}
	return nil
}

// Evict returns Cached blocks to the free queue (the prefix cache's eviction).
// Every id must be Cached; a repeated id is evicted once. All or none.
func (p *Pool) Evict(ids []int32) error {
	for _, id := range ids {
		if !p.valid(id) {
			return kverr.Errorf(kverr.InvalidArgument, "evict: block %d is outside the pool of %d", id, len(p.ref))
		}
		if p.state[id] != Cached {
			return kverr.Errorf(kverr.InvalidArgument, "evict: block %d is %s, not cached", id, p.state[id])
		}
	}
	for _, id := range ids {
		if p.state[id] != Cached {
			continue // repeated
		}
		p.retained[id] = false
		p.numCached--
		p.release(id)
	}
	return nil
}

// release puts a block with no references back into the free queue.
//
// Where it goes decides the runs that later allocations find, because
// Allocate extends by id (b, b+1, ...) and restarts at the queue's head when
// a run breaks. So the queue keeps free runs together and puts long runs at
// the front:
//   - next to a free left neighbour b-1 (right after it), or else right
//     before a free right neighbour b+1, so a run freed block by block
//     re-forms in ascending order and a restart at its first block walks all
//     of it;
//   - an isolated block goes to the tail, so restarts keep using the long
//     runs at the front (at first, the untouched rest of the pool) instead
//     of stranding single blocks between sequences.
//
// A sequence's blocks are released in table order, i.e. ascending within a
// run, so its run re-forms whole. All O(1).
func (p *Pool) release(id int32) {
	p.state[id] = Free
	p.numFree++
	switch {
	case id > 0 && p.state[id-1] == Free:
		p.insertAfter(id-1, id)
	case int(id)+1 < len(p.ref) && p.state[id+1] == Free:
		p.insertBefore(id+1, id)
	default:
		p.insertAfter(p.tail, id)
	}
}

// insertAfter links b after a (a == none: b becomes the only element).
func (p *Pool) insertAfter(a, b int32) {
	if a == none {
		p.prev[b], p.next[b] = none, none
		p.head, p.tail = b, b
		return
	}
	n := p.next[a]
	p.prev[b], p.next[b] = a, n
	p.next[a] = b
	if n == none {
		p.tail = b
	} else {
		p.prev[n] = b
	}
}

// insertBefore links b before a, which is in the queue.
func (p *Pool) insertBefore(a, b int32) {
	pr := p.prev[a]
	p.prev[b], p.next[b] = pr, a
	p.prev[a] = b
	if pr == none {
		p.head = b
	} else {
		p.next[pr] = b
	}
}

func (p *Pool) unlink(b int32) {
	pr, n := p.prev[b], p.next[b]
	if pr == none {
		p.head = n
	} else {
		p.next[pr] = n
	}
	if n == none {
		p.tail = pr
	} else {
		p.prev[n] = pr
	}
	p.prev[b], p.next[b] = none, none
}

// CheckInvariants verifies the pool's internal consistency: the free queue is
// a well-linked list without cycles holding exactly the Free blocks; every
// block's state agrees with its reference count and cached mark; the
// counters match. O(numBlocks). It returns the first violation found.
func (p *Pool) CheckInvariants() error {
	n := len(p.ref)
	bad := func(format string, args ...any) error {
		return kverr.Errorf(kverr.Internal, "block pool: "+format, args...)
	}
	var free, inUse, cached, shared int
	for i := range n {
		r, s := p.ref[i], p.state[i]
		if r < 0 {
			return bad("block %d has reference count %d", i, r)
		}
		if r > 1 {
			shared++
		}
		switch s {
		case Free:
			free++
			if r != 0 || p.retained[i] {
				return bad("free block %d has ref %d, cached mark %v", i, r, p.retained[i])
			}
		case InUse:
			inUse++
			if r == 0 {
				return bad("in-use block %d has ref 0", i)
			}
		case Cached:
			cached++
			if r != 0 || !p.retained[i] {
				return bad("cached block %d has ref %d, cached mark %v", i, r, p.retained[i])
			}
		default:
			return bad("block %d has state %d", i, s)
		}
	}
	if free != p.numFree || inUse != p.numInUse || cached != p.numCached || shared != p.numShared {
		return bad("counters free %d, in use %d, cached %d, shared %d; states say %d, %d, %d, %d",
			p.numFree, p.numInUse, p.numCached, p.numShared, free, inUse, cached, shared)
	}
	if free+inUse+cached != n {
		return bad("%d free + %d in use + %d cached != %d blocks", free, inUse, cached, n)
	}
	if p.peakInUse < inUse || p.peakInUse > n {
		return bad("peak in use %d, in use %d, total %d", p.peakInUse, inUse, n)
	}
	// Walk the queue; more than `free` steps means a cycle or a stray block.
	prev, steps := int32(none), 0
	for b := p.head; b != none; b = p.next[b] {
		if !p.valid(b) {
			return bad("free queue links to block %d outside the pool", b)
		}
		if steps++; steps > free {
			return bad("free queue is longer than the %d free blocks (cycle or stray block)", free)
		}
		if p.state[b] != Free {
			return bad("free queue holds block %d in state %s", b, p.state[b])
		}
		if p.prev[b] != prev {
			return bad("block %d's prev is %d, want %d", b, p.prev[b], prev)
		}
		prev = b
	}
	if steps != free {
		return bad("free queue holds %d blocks, %d are free", steps, free)
	}
	if p.tail != prev {
		return bad("free queue tail is %d, last element is %d", p.tail, prev)
	}
	return nil
}
