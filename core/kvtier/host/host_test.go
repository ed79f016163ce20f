package host

import (
	"errors"
	"math/rand"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/internal/kverr"
)

func newPool(t testing.TB, n int) *Pool {
	t.Helper()
	p, err := New(Config{Slots: n, BlockBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func mustReserve(t *testing.T, p *Pool, h uint64) Slot {
	t.Helper()
	s, err := p.Reserve(h)
	if err != nil {
		t.Fatalf("Reserve(%d): %v", h, err)
	}
	return s
}

func demote(t *testing.T, p *Pool, h uint64) Slot {
	t.Helper()
	s := mustReserve(t, p, h)
	if err := p.Commit(s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestNewRejectsBadSizes(t *testing.T) {
	for _, c := range []Config{{Slots: 0, BlockBytes: 1}, {Slots: 1, BlockBytes: 0}, {Slots: -1, BlockBytes: 8}, {Slots: 1 << 20, BlockBytes: 1 << 30}} {
		if _, err := New(c); !kverr.Is(err, kverr.InvalidArgument) {
			t.Errorf("%+v: %v", c, err)
		}
	}
	if _, err := New(Config{Slots: 2, BlockBytes: 8, Alloc: failAlloc{}}); !kverr.Is(err, kverr.OutOfMemory) {
		t.Errorf("failing allocator: %v", err)
	}
}

type failAlloc struct{}

func (failAlloc) Alloc(int) ([]byte, error) { return nil, errors.New("no memory") }
func (failAlloc) Free([]byte) error         { return nil }

func TestDemoteLookupEvictLRU(t *testing.T) {
	p := newPool(t, 3)
	for h := uint64(1); h <= 3; h++ {
		s := demote(t, p, h)
		if b := p.Bytes(s); len(b) != 64 {
			t.Fatalf("slot bytes %d", len(b))
		}
	}
	if n := p.Lookup([]uint64{1, 2, 3, 4}); n != 3 {
		t.Fatalf("lookup %d", n)
	}
	if n := p.Lookup([]uint64{2, 9, 3}); n != 1 {
		t.Fatalf("a run stops at the first miss: %d", n)
	}
	// LRU now: 2 (most recent), 3, 1. A fourth block evicts 1.
	demote(t, p, 4)
	if p.Lookup([]uint64{1}) != 0 || p.Lookup([]uint64{2, 3, 4}) != 3 {
		t.Fatalf("LRU eviction: %v", p.lru())
	}
	st := p.Stats()
	if st.Evictions != 1 || st.Resident != 3 || st.Demotions != 4 || st.Pinned != 0 {
		t.Fatalf("stats %+v", st)
	}
	if _, err := p.Reserve(2); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("reserving a resident block: %v", err)
	}
}

// ReserveEvict reports the block it evicted (the LRU resident one, in the
// slot it hands out), and nothing for a free slot.
func TestReserveEvictReportsEvicted(t *testing.T) {
	p := newPool(t, 2)
	for h := uint64(1); h <= 2; h++ {
		s, ev, err := p.ReserveEvict(h)
		if err != nil || ev != (Eviction{}) {
			t.Fatalf("free slot: %v %+v", err, ev)
		}
		if err := p.Commit(s); err != nil {
			t.Fatal(err)
		}
	}
	p.Lookup([]uint64{2}) // 1 is now the least recently used
	s1 := slotOf(t, p, 1)
	s, ev, err := p.ReserveEvict(3)
	if err != nil || ev != (Eviction{Hash: 1, Evicted: true}) || s != s1 {
		t.Fatalf("eviction: slot %d (block 1 was in %d) %+v %v", s, s1, ev, err)
	}
	// A refused reservation reports nothing.
	if _, ev, err := p.ReserveEvict(2); !kverr.Is(err, kverr.InvalidArgument) || ev.Evicted {
		t.Fatalf("present block: %+v %v", ev, err)
	}
}

func slotOf(t *testing.T, p *Pool, h uint64) Slot {
	t.Helper()
	for s := range Slot(p.Stats().Slots) {
		if k, ok := p.Hash(s); ok && k == h {
			return s
		}
	}
	t.Fatalf("block %d is in no slot", h)
	return NoSlot
}

// Host pool full: every slot pinned (copies in flight both ways), so a
// demotion is skipped, counted, and changes nothing.
func TestPoolFullDemotionSkipped(t *testing.T) {
	p := newPool(t, 2)
	a := mustReserve(t, p, 1) // incoming copy in flight
	demote(t, p, 2)
	var out [1]Slot
	if n, err := p.PinPrefix([]uint64{2}, out[:]); n != 1 || err != nil { // outgoing copy in flight
		t.Fatal(n, err)
	}
	before := p.Stats()
	if s, err := p.Reserve(3); !kverr.Is(err, kverr.OutOfBlocks) || s != NoSlot {
		t.Fatalf("Reserve on a full pool: %v %v", s, err)
	}
	after := p.Stats()
	if after.SkippedFull != before.SkippedFull+1 {
		t.Fatalf("skip not counted: %+v", after)
	}
	after.SkippedFull = before.SkippedFull
	if after != before || p.Lookup([]uint64{2}) != 1 {
		t.Fatalf("a failed Reserve changed the pool: %+v -> %+v", before, after)
	}
	// Once the copies complete, the demotion goes through.
	if err := p.Commit(a); err != nil {
		t.Fatal(err)
	}
	if err := p.Unpin(out[0]); err != nil {
		t.Fatal(err)
	}
	demote(t, p, 3)
}

// A block with a copy in flight is never evicted or reused: eviction picks
// the next unpinned block, and its slot bytes stay the block's.
func TestPinnedNeverEvicted(t *testing.T) {
	p := newPool(t, 3)
	s1 := demote(t, p, 1)
	demote(t, p, 2)
	demote(t, p, 3)
	copy(p.Bytes(s1), "block one")
	if err := p.Pin(s1); err != nil { // reload of block 1 in flight; it is the LRU
		t.Fatal(err)
	}
	demote(t, p, 4) // evicts 2, not 1
	if p.Lookup([]uint64{1}) != 1 || p.Lookup([]uint64{2}) != 0 {
		t.Fatalf("evicted a pinned block: %v", p.lru())
	}
	demote(t, p, 5) // evicts 3
	demote(t, p, 6) // evicts 4
	if string(p.Bytes(s1)[:9]) != "block one" {
		t.Fatal("the pinned slot was reused")
	}
	if h, ok := p.Hash(s1); !ok || h != 1 {
		t.Fatal("the pinned slot changed hands")
	}
	if err := p.Unpin(s1); err != nil {
		t.Fatal(err)
	}
	if err := p.Unpin(s1); !kverr.Is(err, kverr.NotFound) {
		t.Fatalf("unpinning twice: %v", err)
	}
	// A reserved slot (demotion in flight) is not evictable either.
	p2 := newPool(t, 1)
	r := mustReserve(t, p2, 7)
	if _, err := p2.Reserve(8); !kverr.Is(err, kverr.OutOfBlocks) {
		t.Fatalf("evicted a reserved slot: %v", err)
	}
	if p2.Lookup([]uint64{7}) != 0 {
		t.Fatal("a reserved block is visible before its commit")
	}
	if err := p2.Abort(r); err != nil {
		t.Fatal(err)
	}
	demote(t, p2, 8)
}

// CommitPinned commits a block that stays pinned (a store out of it
// follows): not evictable until its Unpin, while Lookup matches it.
func TestCommitPinned(t *testing.T) {
	p := newPool(t, 1)
	s := mustReserve(t, p, 1)
	if err := p.CommitPinned(s); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Resident != 1 || st.Pinned != 1 || st.Reserved != 0 || st.Commits != 1 {
		t.Fatalf("stats %+v", st)
	}
	if p.Lookup([]uint64{1}) != 1 {
		t.Fatal("a committed block is not matched")
	}
	if _, err := p.Reserve(2); !kverr.Is(err, kverr.OutOfBlocks) {
		t.Fatalf("evicted a block committed pinned: %v", err)
	}
	if err := p.CommitPinned(s); !kverr.Is(err, kverr.NotFound) {
		t.Fatalf("committing twice: %v", err)
	}
	if err := p.Unpin(s); err != nil {
		t.Fatal(err)
	}
	demote(t, p, 2)
}

// Peek answers as Lookup does, but neither counts nor touches the LRU.
func TestPeek(t *testing.T) {
	p := newPool(t, 3)
	for h := uint64(1); h <= 3; h++ {
		demote(t, p, h)
	}
	before, lru := p.Stats(), p.lru()
	if n := p.Peek([]uint64{1, 2, 9, 3}); n != 2 {
		t.Fatalf("peek %d", n)
	}
	if n := p.Peek([]uint64{9}); n != 0 {
		t.Fatalf("peek %d", n)
	}
	if p.Stats() != before || !slices.Equal(p.lru(), lru) {
		t.Fatalf("Peek changed the pool: %+v %v", p.Stats(), p.lru())
	}
	r := mustReserve(t, p, 9)
	if n := p.Peek([]uint64{9}); n != 0 {
		t.Fatal("Peek matched a reserved block")
	}
	if err := p.Abort(r); err != nil {
		t.Fatal(err)
	}
}

func TestBadCallsChangeNothing(t *testing.T) {
	p := newPool(t, 2)
	s := demote(t, p, 1)
	r := mustReserve(t, p, 2)
	before := p.Stats()
	lru := p.lru()
	checks := []struct {
		err  error
		code kverr.Code
	}{
		{p.Commit(s), kverr.NotFound},
		{p.Abort(s), kverr.NotFound},
		{p.Commit(5), kverr.InvalidArgument},
		{p.Abort(-1), kverr.InvalidArgument},
		{p.Pin(r), kverr.NotFound},
		{p.Unpin(r), kverr.NotFound},
		{p.Unpin(s), kverr.NotFound},
		{p.Pin(9), kverr.InvalidArgument},
		{p.Close(), kverr.InvalidArgument}, // a slot is pinned
	}
	_, err := p.PinPrefix([]uint64{1, 2}, make([]Slot, 1))
	checks = append(checks, struct {
		err  error
		code kverr.Code
	}{err, kverr.BufferTooSmall})
	for i, c := range checks {
		if !kverr.Is(c.err, c.code) {
			t.Errorf("check %d: %v, want %v", i, c.err, c.code)
		}
	}
	if after := p.Stats(); after != before || !slices.Equal(p.lru(), lru) {
		t.Fatalf("failing calls changed the pool: %+v -> %+v", before, after)
	}
	if err := p.Abort(r); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Reserve(3); !kverr.Is(err, kverr.InvalidHandle) {
		t.Fatalf("after Close: %v", err)
	}
}

// ref is the reference model: plain slices, linear scans.
type ref struct {
	n        int
	resident []uint64 // LRU order, most recent first
	reserved map[uint64]bool
	pins     map[uint64]int // resident blocks' pins
}

func (r *ref) used() int { return len(r.resident) + len(r.reserved) }

func (r *ref) touch(h uint64) {
	i := slices.Index(r.resident, h)
	r.resident = slices.Insert(slices.Delete(r.resident, i, i+1), 0, h)
}

// reserve returns the evicted hash (0 for none) and whether it succeeded.
func (r *ref) reserve(h uint64) (uint64, bool) {
	if r.reserved[h] || slices.Contains(r.resident, h) {
		return 0, false
	}
	var ev uint64
	if r.used() == r.n {
		i := len(r.resident) - 1
		for i >= 0 && r.pins[r.resident[i]] > 0 {
			i--
		}
		if i < 0 {
			return 0, false
		}
		ev = r.resident[i]
		r.resident = slices.Delete(r.resident, i, i+1)
	}
	r.reserved[h] = true
	return ev, true
}

func (r *ref) lookup(hs []uint64) int {
	n := 0
	for _, h := range hs {
		if !slices.Contains(r.resident, h) {
			break
		}
		r.touch(h)
		n++
	}
	return n
}

// Random operation sequences against the reference: the same results, the
// same LRU order, never more than N blocks held, a pinned block never
// evicted.
func TestPoolModel(t *testing.T) {
	for seed := int64(1); seed <= 40; seed++ {
		rng := rand.New(rand.NewSource(seed))
		n := 1 + rng.Intn(8)
		p := newPool(t, n)
		m := &ref{n: n, reserved: map[uint64]bool{}, pins: map[uint64]int{}}
		slotOf := map[uint64]Slot{}
		var evictions int64
		for step := range 400 {
			h := uint64(1 + rng.Intn(3*n))
			switch op := rng.Intn(10); {
			case op < 3:
				ev, ok := m.reserve(h)
				s, err := p.Reserve(h)
				if ok != (err == nil) {
					t.Fatalf("seed %d step %d: Reserve(%d) = %v, model ok=%v", seed, step, h, err, ok)
				}
				if ok {
					if ev != 0 {
						evictions++
						if slotOf[ev] != s {
							t.Fatalf("seed %d step %d: evicted %d from slot %d but reused slot %d", seed, step, ev, slotOf[ev], s)
						}
						delete(slotOf, ev)
					}
					slotOf[h] = s
				}
			case op < 5: // commit or abort a reserved block
				if !m.reserved[h] {
					if s, ok := slotOf[h]; ok { // resident: committing again fails
						if err := p.Commit(s); !kverr.Is(err, kverr.NotFound) {
							t.Fatalf("seed %d step %d: Commit of a resident block: %v", seed, step, err)
						}
					}
					continue
				}
				delete(m.reserved, h)
				if rng.Intn(4) == 0 {
					if err := p.Abort(slotOf[h]); err != nil {
						t.Fatal(err)
					}
					delete(slotOf, h)
				} else {
					if err := p.Commit(slotOf[h]); err != nil {
						t.Fatal(err)
					}
					m.resident = slices.Insert(m.resident, 0, h)
				}
			case op < 7:
				hs := []uint64{h, uint64(1 + rng.Intn(3*n)), uint64(1 + rng.Intn(3*n))}
				if got, want := p.Lookup(hs), m.lookup(hs); got != want {
					t.Fatalf("seed %d step %d: Lookup(%v) = %d, model %d", seed, step, hs, got, want)
				}
			case op < 8:
				hs := []uint64{h, uint64(1 + rng.Intn(3*n))}
				out := make([]Slot, 2)
				got, err := p.PinPrefix(hs, out)
				want := m.lookup(hs)
				if err != nil || got != want {
					t.Fatalf("seed %d step %d: PinPrefix = %d %v, model %d", seed, step, got, err, want)
				}
				for i := range got {
					m.pins[hs[i]]++
					if out[i] != slotOf[hs[i]] {
						t.Fatalf("seed %d step %d: PinPrefix slot %d, want %d", seed, step, out[i], slotOf[hs[i]])
					}
				}
			default: // unpin
				if m.pins[h] == 0 {
					continue
				}
				m.pins[h]--
				if err := p.Unpin(slotOf[h]); err != nil {
					t.Fatal(err)
				}
			}
			st := p.Stats()
			if st.Resident+st.Reserved > n || st.Resident != len(m.resident) || st.Reserved != len(m.reserved) || st.Evictions != evictions {
				t.Fatalf("seed %d step %d: stats %+v, model %d resident %d reserved %d evictions", seed, step, st, len(m.resident), len(m.reserved), evictions)
			}
			if !slices.Equal(p.lru(), m.resident) {
				t.Fatalf("seed %d step %d: LRU %v, model %v", seed, step, p.lru(), m.resident)
			}
			pinned := len(m.reserved)
			for h, c := range m.pins {
				if c > 0 {
					pinned++
					if !slices.Contains(m.resident, h) {
						t.Fatalf("seed %d step %d: pinned block %d was evicted", seed, step, h)
					}
				}
			}
			if st.Pinned != pinned {
				t.Fatalf("seed %d step %d: %d pinned, model %d", seed, step, st.Pinned, pinned)
			}
		}
	}
}

// Concurrent demotions and reloads (run with -race).
func TestPoolConcurrent(t *testing.T) {
	p := newPool(t, 16)
	done := make(chan struct{})
	for g := range 4 {
		go func() {
			defer func() { done <- struct{}{} }()
			rng := rand.New(rand.NewSource(int64(g)))
			out := make([]Slot, 4)
			for range 2000 {
				h := uint64(rng.Intn(64))
				if s, err := p.Reserve(h); err == nil {
					p.Bytes(s)[0] = byte(h)
					_ = p.Commit(s)
				}
				hs := []uint64{h, h + 1, h + 2, h + 3}
				n, _ := p.PinPrefix(hs, out)
				for _, s := range out[:n] {
					_ = p.Unpin(s)
				}
			}
		}()
	}
	for range 4 {
		<-done
	}
	if st := p.Stats(); st.Pinned != 0 || st.Reserved != 0 || st.Resident > 16 {
		t.Fatalf("%+v", st)
	}
}

func BenchmarkReserveCommit(b *testing.B) {
	p := newPool(b, 4096)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		s, err := p.Reserve(uint64(i))
		if err != nil {
			b.Fatal(err)
		}
		_ = p.Commit(s)
	}
}

func BenchmarkLookup64(b *testing.B) {
	p := newPool(b, 4096)
	hs := make([]uint64, 64)
	for i := range 4096 {
		s, _ := p.Reserve(uint64(i))
		_ = p.Commit(s)
	}
	for i := range hs {
		hs[i] = uint64(1000 + i)
	}
	b.ReportAllocs()
	for b.Loop() {
		if p.Lookup(hs) != 64 {
			b.Fatal("miss")
		}
	}
}

// Drop frees a resident, unpinned key's slot at once (an eviction) and
// leaves reserved, pinned and absent keys as they are.
func TestDrop(t *testing.T) {
	p := newPool(t, 3)
	a, b := demote(t, p, 1), demote(t, p, 2)
	pending := mustReserve(t, p, 3)
	if s := p.Drop(3); s != NoSlot {
		t.Fatalf("Drop of a reserved key freed slot %d", s)
	}
	if err := p.Pin(b); err != nil {
		t.Fatal(err)
	}
	if s := p.Drop(2); s != NoSlot {
		t.Fatalf("Drop of a pinned key freed slot %d", s)
	}
	if s := p.Drop(9); s != NoSlot {
		t.Fatalf("Drop of an absent key freed slot %d", s)
	}
	if s := p.Drop(1); s != a {
		t.Fatalf("Drop(1) = slot %d, want %d", s, a)
	}
	if _, st := p.State(1); st != Absent {
		t.Fatalf("key 1 is %v after Drop", st)
	}
	st := p.Stats()
	if st.Resident != 1 || st.Evictions != 1 {
		t.Fatalf("stats after Drop: %+v", st)
	}
	// The freed slot is reused without evicting anything.
	s, ev, err := p.ReserveEvict(4)
	if err != nil || s != a || ev.Evicted {
		t.Fatalf("ReserveEvict after Drop: slot %d, %+v, %v", s, ev, err)
	}
	_ = pending
}
