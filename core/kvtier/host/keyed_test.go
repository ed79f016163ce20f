package host

import (
	"math/rand"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/internal/kverr"
)

func reserveKeys(t *testing.T, p *Pool, hashes ...uint64) ([]Slot, []uint64) {
	t.Helper()
	slots := make([]Slot, len(hashes))
	ev := make([]uint64, len(hashes))
	n, err := p.ReserveKeys(hashes, slots, ev)
	if err != nil {
		t.Fatalf("ReserveKeys(%v): %v", hashes, err)
	}
	return slots, ev[:n]
}

func TestReserveKeysOrderAndEviction(t *testing.T) {
	p := newPool(t, 4)
	slots, ev := reserveKeys(t, p, 1, 2)
	if !slices.Equal(slots, []Slot{0, 1}) || len(ev) != 0 {
		t.Fatalf("slots %v evicted %v", slots, ev)
	}
	if s, st := p.State(1); s != 0 || st != Pending {
		t.Fatalf("State(1) = %d, %d", s, st)
	}
	if got := p.CompleteKeys([]uint64{1, 2}, false); got != 2 {
		t.Fatalf("completed %d", got)
	}
	if _, st := p.State(2); st != Resident {
		t.Fatalf("State(2) = %d", st)
	}
	p.TouchKeys([]uint64{1}) // 2 is now the LRU block
	// 2 is a key of the batch: never evicted for its neighbours; 1 goes.
	slots, ev = reserveKeys(t, p, 2, 3, 4, 5)
	if !slices.Equal(slots, []Slot{NoSlot, 2, 3, 0}) || !slices.Equal(ev, []uint64{1}) {
		t.Fatalf("slots %v evicted %v", slots, ev)
	}
	if _, st := p.State(2); st != Resident {
		t.Fatal("a key of the batch was evicted")
	}
	if st := p.Stats(); st.SkippedPresent != 1 || st.Evictions != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestReserveKeysAllOrNothing(t *testing.T) {
	p := newPool(t, 3)
	reserveKeys(t, p, 1, 2)
	p.CompleteKeys([]uint64{1, 2}, false)
	if n, _ := p.PinKeys([]uint64{1, 2}, make([]Slot, 2)); n != 2 {
		t.Fatalf("pinned %d", n)
	}
	before := p.Stats()
	slots := make([]Slot, 2)
	_, err := p.ReserveKeys([]uint64{7, 8}, slots, make([]uint64, 2))
	if !kverr.Is(err, kverr.OutOfBlocks) {
		t.Fatalf("err %v", err)
	}
	after := p.Stats()
	if after.SkippedFull != before.SkippedFull+2 || after.Reserved != 0 || after.Resident != 2 {
		t.Fatalf("stats %+v", after)
	}
	if _, st := p.State(7); st != Absent {
		t.Fatal("a refused batch reserved a key")
	}
	// Unpinned, 1 and 2 can make room again.
	if n := p.UnpinKeys([]uint64{1, 2, 9}); n != 2 {
		t.Fatalf("unpinned %d", n)
	}
	if p.Stats().Stale != 1 {
		t.Fatal("unpin of an absent key not counted")
	}
	_, ev := reserveKeys(t, p, 7, 8)
	if len(ev) != 1 {
		t.Fatalf("evicted %v", ev)
	}
}

func TestReserveKeysDuplicatesAndFailures(t *testing.T) {
	p := newPool(t, 2)
	slots, _ := reserveKeys(t, p, 5, 5)
	if slots[0] == NoSlot || slots[1] != NoSlot {
		t.Fatalf("slots %v", slots)
	}
	// A failed copy frees the slot; completing again is stale.
	if n := p.CompleteKeys([]uint64{5}, true); n != 1 {
		t.Fatal(n)
	}
	if n := p.CompleteKeys([]uint64{5}, false); n != 0 {
		t.Fatal(n)
	}
	if st := p.Stats(); st.Aborts != 1 || st.Stale != 1 || st.Pinned != 0 || st.Reserved != 0 {
		t.Fatalf("stats %+v", st)
	}
	if _, err := p.ReserveKeys([]uint64{1}, nil, nil); !kverr.Is(err, kverr.BufferTooSmall) {
		t.Fatal(err)
	}
}

func TestPinKeysMissesAndReset(t *testing.T) {
	p := newPool(t, 4)
	reserveKeys(t, p, 1, 2, 3)
	p.CompleteKeys([]uint64{1, 2}, false) // 3 stays pending
	slots := make([]Slot, 4)
	n, err := p.PinKeys([]uint64{2, 3, 4, 1}, slots)
	if err != nil || n != 2 || slots[1] != NoSlot || slots[2] != NoSlot || slots[0] == NoSlot || slots[3] == NoSlot {
		t.Fatalf("n %d slots %v err %v", n, slots, err)
	}
	if got := p.Reset(); got != 3 {
		t.Fatalf("reset dropped %d", got)
	}
	st := p.Stats()
	if st.Resident != 0 || st.Reserved != 0 || st.Pinned != 0 || st.Resets != 1 {
		t.Fatalf("stats %+v", st)
	}
	// After the reset: completions and unpins of the old keys are stale,
	// lookups miss, and the slots are handed out from 0 again.
	if p.CompleteKeys([]uint64{3}, false) != 0 || p.UnpinKeys([]uint64{1, 2}) != 0 {
		t.Fatal("stale calls acted")
	}
	if p.Lookup([]uint64{1}) != 0 {
		t.Fatal("lookup after reset hit")
	}
	slots, _ = reserveKeys(t, p, 9)
	if slots[0] != 0 {
		t.Fatalf("slot %d after reset", slots[0])
	}
	if err := p.Close(); !kverr.Is(err, kverr.InvalidArgument) { // 9 is reserved
		t.Fatal(err)
	}
	p.Reset()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ReserveKeys([]uint64{1}, make([]Slot, 1), make([]uint64, 1)); !kverr.Is(err, kverr.InvalidHandle) {
		t.Fatal(err)
	}
}

func TestTouchKeysOrder(t *testing.T) {
	p := newPool(t, 3)
	reserveKeys(t, p, 1, 2, 3)
	p.CompleteKeys([]uint64{1, 2, 3}, false)
	p.TouchKeys([]uint64{3, 1, 42})
	if got := p.lru(); !slices.Equal(got, []uint64{3, 1, 2}) {
		t.Fatalf("lru %v", got)
	}
}

// A random mix of the keyed calls keeps the pool's counts consistent with
// a model of it.
func TestKeyedCallsRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	p := newPool(t, 8)
	pins := map[uint64]int{}
	pending := map[uint64]bool{}
	for step := 0; step < 5000; step++ {
		keys := make([]uint64, 1+rng.Intn(4))
		for i := range keys {
			keys[i] = uint64(rng.Intn(20))
		}
		switch rng.Intn(6) {
		case 0, 1:
			slots := make([]Slot, len(keys))
			ev := make([]uint64, len(keys))
			n, err := p.ReserveKeys(keys, slots, ev)
			if err != nil && !kverr.Is(err, kverr.OutOfBlocks) {
				t.Fatal(err)
			}
			for _, h := range ev[:n] {
				if pins[h] > 0 || pending[h] {
					t.Fatalf("evicted pinned or pending %d", h)
				}
			}
			for i, s := range slots {
				if err == nil && s != NoSlot {
					pending[keys[i]] = true
				}
			}
		case 2:
			for _, h := range keys {
				if pending[h] {
					p.CompleteKeys([]uint64{h}, rng.Intn(4) == 0)
					delete(pending, h)
				}
			}
		case 3:
			slots := make([]Slot, len(keys))
			if _, err := p.PinKeys(keys, slots); err != nil {
				t.Fatal(err)
			}
			for i, s := range slots {
				if s != NoSlot {
					pins[keys[i]]++
				}
			}
		case 4:
			for h, n := range pins {
				if n > 0 && rng.Intn(2) == 0 {
					p.UnpinKeys([]uint64{h})
					pins[h]--
				}
			}
		case 5:
			p.TouchKeys(keys)
		}
		st := p.Stats()
		want := len(pending)
		for _, n := range pins {
			if n > 0 {
				want++
			}
		}
		if st.Pinned != want || st.Reserved != len(pending) {
			t.Fatalf("step %d: pinned %d reserved %d, want %d and %d", step, st.Pinned, st.Reserved, want, len(pending))
		}
		if st.Resident+st.Reserved+len(p.freeList) != 8 {
			t.Fatalf("step %d: slots do not add up: %+v free %d", step, st, len(p.freeList))
		}
	}
}

// A pending key's place in the LRU is its reservation (or last touch), not
// its copy's completion: a request whose copies complete late does not
// outlive the requests that came after it.
func TestKeyedRecencyIsLogical(t *testing.T) {
	p := newPool(t, 4)
	reserveKeys(t, p, 1, 2) // an old request's blocks, copies in flight
	p.TouchKeys([]uint64{1, 2})
	reserveKeys(t, p, 3, 4)
	p.CompleteKeys([]uint64{3, 4}, false)
	p.TouchKeys([]uint64{3, 4})
	p.CompleteKeys([]uint64{1, 2}, false) // late
	if got := p.lru(); !slices.Equal(got, []uint64{3, 4, 1, 2}) {
		t.Fatalf("lru %v", got)
	}
	_, ev := reserveKeys(t, p, 5)
	if !slices.Equal(ev, []uint64{2}) {
		t.Fatalf("evicted %v", ev)
	}
	// A failed copy leaves the list; Commit and Abort of a keyed slot too.
	reserveKeys(t, p, 6)
	p.CompleteKeys([]uint64{6}, true)
	s, _ := reserveKeys(t, p, 7)
	if err := p.Abort(s[0]); err != nil {
		t.Fatal(err)
	}
	if got := p.lru(); slices.Contains(got, 6) || slices.Contains(got, 7) {
		t.Fatalf("lru %v keeps a given-back key", got)
	}
}
