package host

import (
	"testing"
)

// walkLRU returns the LRU's hashes, most recently used first, failing
// when the list is longer than the pool (a cycle) or its links disagree.
func walkLRU(t *testing.T, p *Pool) []uint64 {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []uint64
	prev := NoSlot
	for s := p.head; s != NoSlot; s = p.slots[s].next {
		if len(out) == len(p.slots) {
			t.Fatalf("the LRU list holds more entries than the pool's %d slots: a cycle (%v...)", len(p.slots), out)
		}
		if p.slots[s].prev != prev {
			t.Fatalf("slot %d's prev is %d, the list reached it from %d", s, p.slots[s].prev, prev)
		}
		out = append(out, p.slots[s].hash)
		prev = s
	}
	if p.tail != prev {
		t.Fatalf("the LRU's tail is %d, its last entry %d", p.tail, prev)
	}
	return out
}

// The LRU stays one list, head to tail, when its head is touched, pinned
// through PinPrefix, evicted or aborted.
func TestLRUStaysAList(t *testing.T) {
	p := newPool(t, 3)
	demote(t, p, 1)
	demote(t, p, 2)
	if got := walkLRU(t, p); len(got) != 2 || got[0] != 2 || got[1] != 1 {
		t.Fatalf("LRU %v, want [2 1]", got)
	}
	// Touch the head, then the tail.
	if n := p.Lookup([]uint64{2}); n != 1 {
		t.Fatalf("lookup of the head matched %d", n)
	}
	if got := walkLRU(t, p); len(got) != 2 || got[0] != 2 || got[1] != 1 {
		t.Fatalf("LRU after touching its head: %v, want [2 1]", got)
	}
	if n := p.Lookup([]uint64{1}); n != 1 {
		t.Fatalf("lookup of the tail matched %d", n)
	}
	if got := walkLRU(t, p); len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Fatalf("LRU after touching its tail: %v, want [1 2]", got)
	}
	demote(t, p, 3)
	slots := make([]Slot, 1)
	if n, err := p.PinPrefix([]uint64{3}, slots); err != nil || n != 1 {
		t.Fatalf("pin prefix: %d, %v", n, err)
	}
	if got := walkLRU(t, p); len(got) != 3 || got[0] != 3 {
		t.Fatalf("LRU after pinning its head: %v", got)
	}
	// A full pool: Reserve evicts the LRU tail (2), never the pinned head.
	s, ev, err := p.ReserveEvict(4)
	if err != nil || !ev.Evicted || ev.Hash != 2 {
		t.Fatalf("reserve in a full pool: slot %d, %+v, %v; want block 2 evicted", s, ev, err)
	}
	if got := walkLRU(t, p); len(got) != 2 || got[0] != 3 || got[1] != 1 {
		t.Fatalf("LRU after an eviction: %v, want [3 1]", got)
	}
	if err := p.Abort(s); err != nil {
		t.Fatal(err)
	}
	if err := p.Unpin(slots[0]); err != nil {
		t.Fatal(err)
	}
	if got := walkLRU(t, p); len(got) != 2 {
		t.Fatalf("LRU after an abort: %v", got)
	}
}

// UnpinKeys of a resident key that holds no pin finds nothing to do: it
// counts it Stale and leaves the pin count alone.
func TestUnpinKeysOfUnpinnedKeyIsStale(t *testing.T) {
	p := newPool(t, 2)
	reserveKeys(t, p, 7)
	if n := p.CompleteKeys([]uint64{7}, false); n != 1 {
		t.Fatalf("completed %d", n)
	}
	if n := p.UnpinKeys([]uint64{7}); n != 0 {
		t.Fatalf("UnpinKeys of an unpinned key unpinned %d", n)
	}
	if st := p.Stats(); st.Stale != 1 || st.Pinned != 0 {
		t.Fatalf("stats %+v: want 1 stale and nothing pinned", st)
	}
	// One pin, one unpin; a second unpin is stale again.
	slots := make([]Slot, 1)
	if n, err := p.PinKeys([]uint64{7}, slots); err != nil || n != 1 {
		t.Fatalf("pin: %d, %v", n, err)
	}
	if n := p.UnpinKeys([]uint64{7, 7}); n != 1 {
		t.Fatalf("two unpins of one pin unpinned %d", n)
	}
	if st := p.Stats(); st.Stale != 2 || st.Pinned != 0 {
		t.Fatalf("stats %+v: want 2 stale and nothing pinned", st)
	}
	// The key is evictable again: a full pool gives its slot up.
	reserveKeys(t, p, 8)
	if _, ev := reserveKeys(t, p, 9); len(ev) != 1 || ev[0] != 7 {
		t.Fatalf("evicted %v, want [7]", ev)
	}
}
