package host

import "github.com/kvplug/kvplug/internal/kverr"

// Batched calls by block hash, for a caller that keeps no slot numbers of
// its own between calls: an engine's offloading manager that tracks
// blocks by key (vLLM's OffloadingManager) or a storage backend that is
// asked by key (SGLang's HiCache storage). They are the per-slot calls
// above applied to a batch under one lock, with the engines' rules for
// what a batch that cannot be served means:
//
//   - ReserveKeys is all or nothing: either every absent key of the batch
//     gets a slot or none does (OutOfBlocks), and keys of the batch that
//     are already in the pool are never evicted to make room for the rest;
//   - PinKeys, UnpinKeys and CompleteKeys act on the keys they find and
//     count the rest (Stale): a key that is gone (the pool was Reset, or
//     the key never stored) is a miss in the engine's terms, not an error.
//
// Recency follows the engines' logical accesses, not the copies' timing: a
// slot ReserveKeys hands out joins the LRU at once (pinned, so never a
// victim while its copy is in flight), TouchKeys moves pending keys too, and
// CompleteKeys leaves a committed block where it is. A request that offered
// blocks, finished (touching them) and only then saw its copies complete
// keeps its blocks' places behind the requests that came after it.

// SlotState is the state of a key's slot (State).
type SlotState uint8

// The states State reports.
const (
	Absent   SlotState = iota // no slot holds the key
	Pending                   // reserved: its copy in is in flight
	Resident                  // committed: readable
)

// State returns the state of key hash and its slot (NoSlot when absent)
// without touching the LRU or counting a hit or miss.
func (p *Pool) State(hash uint64) (Slot, SlotState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.index[hash]
	if !ok || p.closed {
		return NoSlot, Absent
	}
	if p.slots[s].st == reserved {
		return s, Pending
	}
	return s, Resident
}

// ReserveKeys reserves a slot for each key of hashes that the pool does not
// hold (reserved or resident), as Reserve does: slots[i] receives key i's
// slot, or NoSlot for a key that is there already or repeated in the batch
// (counted in SkippedPresent). Room is made by evicting least recently used
// unpinned resident blocks that are not keys of the batch; their hashes are
// written to evicted[:nEvicted] in eviction order (evicted must hold
// len(hashes); at most that many are evicted). Free slots are handed out
// before evicted ones, and a slot freed last is reused first. All or none:
// when the free and evictable slots cannot cover the batch, nothing changes
// and OutOfBlocks is returned (the batch's blocks counted in SkippedFull).
func (p *Pool) ReserveKeys(hashes []uint64, slots []Slot, evicted []uint64) (nEvicted int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, kverr.Errorf(kverr.InvalidHandle, "host tier: closed")
	}
	if len(slots) < len(hashes) || len(evicted) < len(hashes) {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "host tier: %d slots and %d evicted for %d keys", len(slots), len(evicted), len(hashes))
	}
	batch := make(map[uint64]struct{}, len(hashes))
	need, present := 0, 0
	for _, h := range hashes {
		if _, dup := batch[h]; dup {
			present++
			continue
		}
		batch[h] = struct{}{}
		if _, ok := p.index[h]; ok {
			present++
			continue
		}
		need++
	}
	// Victims: LRU first, unpinned, not keys of the batch.
	short := need - len(p.freeList)
	var victims []Slot
	for s := p.tail; short > 0 && s != NoSlot; s = p.slots[s].prev {
		if p.slots[s].pins > 0 {
			continue
		}
		if _, inBatch := batch[p.slots[s].hash]; inBatch {
			continue
		}
		victims = append(victims, s)
		short--
	}
	if short > 0 {
		p.st.SkippedFull += int64(need)
		return 0, kverr.Errorf(kverr.OutOfBlocks, "host tier: %d new blocks, %d slots free and %d evictable", need, len(p.freeList), len(victims))
	}
	// Evicted slots go under the free ones, so that free slots are taken
	// first and, among the evicted, the one freed last.
	if len(victims) > 0 {
		fl := make([]Slot, 0, len(victims)+len(p.freeList))
		for _, s := range victims {
			evicted[nEvicted] = p.evictResident(s)
			nEvicted++
			fl = append(fl, s)
		}
		p.freeList = append(fl, p.freeList...)
	}
	clear(batch)
	for i, h := range hashes {
		if _, seen := batch[h]; seen {
			slots[i] = NoSlot
			continue
		}
		batch[h] = struct{}{}
		if _, ok := p.index[h]; ok {
			slots[i] = NoSlot
			continue
		}
		s := p.popFree() // never NoSlot: the victims above made room
		p.reserveFree(s, h)
		p.pushFront(s) // recency follows the engine's access, not the copy
		slots[i] = s
	}
	p.st.SkippedPresent += int64(present)
	return nEvicted, nil
}

// CompleteKeys ends the incoming copies of the reserved keys of hashes:
// committed (failed false; the block keeps its place in the LRU) or given
// back (failed true), as Commit and Abort. Keys that are not reserved
// (resident already, or gone) are counted in Stale and left alone. It
// returns how many it completed.
func (p *Pool) CompleteKeys(hashes []uint64, failed bool) int {
	return p.eachKey(hashes, func(s Slot, ok bool) bool {
		if !ok || p.slots[s].st != reserved {
			p.st.Stale++
			return false
		}
		if failed {
			p.abortReserved(s)
		} else {
			p.commitReserved(s, false)
		}
		return true
	})
}

// eachKey calls do, under the pool's lock, with the slot of each key of
// hashes in turn (ok false for a key the pool does not hold); do reports
// whether it acted on the slot. It returns how many times do did, 0 once
// the pool is closed.
func (p *Pool) eachKey(hashes []uint64, do func(s Slot, ok bool) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0
	}
	n := 0
	for _, h := range hashes {
		if s, ok := p.index[h]; do(s, ok) {
			n++
		}
	}
	return n
}

// PinKeys pins the slot of each resident key of hashes for a copy out of it
// (Pin), writing it to slots[i]; a key that is not resident gets NoSlot and
// counts as a miss. It does not touch the LRU (TouchKeys does). It returns
// how many it pinned; each must be UnpinKeys'd once its copy completed.
func (p *Pool) PinKeys(hashes []uint64, slots []Slot) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, kverr.Errorf(kverr.InvalidHandle, "host tier: closed")
	}
	if len(slots) < len(hashes) {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "host tier: %d slots for %d keys", len(slots), len(hashes))
	}
	n := 0
	for i, h := range hashes {
		s, ok := p.index[h]
		if !ok || p.slots[s].st != resident {
			slots[i] = NoSlot
			p.st.Misses++
			continue
		}
		p.pin(s)
		slots[i] = s
		p.st.Hits++
		n++
	}
	return n, nil
}

// UnpinKeys drops one pin of each pinned resident key of hashes (Unpin);
// keys that are not pinned (gone, or never pinned) are counted in Stale.
// It returns how many it unpinned.
func (p *Pool) UnpinKeys(hashes []uint64) int {
	return p.eachKey(hashes, func(s Slot, ok bool) bool {
		if !ok || p.slots[s].st != resident || p.slots[s].pins == 0 {
			p.st.Stale++
			return false
		}
		p.unpin(s)
		return true
	})
}

// TouchKeys marks the keys of hashes (resident or pending) recently used,
// the first key most recently (a prompt's prefix outlives its tail);
// absent keys are ignored.
func (p *Pool) TouchKeys(hashes []uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	for i := len(hashes) - 1; i >= 0; i-- {
		s, ok := p.index[hashes[i]]
		if !ok || !p.linked(s) {
			continue
		}
		p.unlink(s)
		p.pushFront(s)
	}
}

// Reset drops every block, reserved and pinned ones included, and returns
// how many slots it freed. The caller guarantees that no copy still uses
// the memory (or ignores what such a copy does); later completions, pins
// and unpins of the dropped keys count as Stale.
func (p *Pool) Reset() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0
	}
	n := len(p.index)
	clear(p.index)
	p.freeList = p.freeList[:0]
	for i := range p.slots {
		p.slots[i] = slot{st: free, prev: NoSlot, next: NoSlot}
		p.freeList = append(p.freeList, Slot(len(p.slots)-1-i))
	}
	p.head, p.tail = NoSlot, NoSlot
	p.st.Resident, p.st.Reserved, p.st.Pinned = 0, 0, 0
	p.st.Resets++
	return n
}

// linked reports whether slot s is in the LRU list: every resident slot,
// and the reserved slots ReserveKeys handed out.
func (p *Pool) linked(s Slot) bool {
	sl := &p.slots[s]
	return sl.prev != NoSlot || sl.next != NoSlot || p.head == s
}
