package blocks

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/internal/kverr"
)

func newPool(t testing.TB, n, bs int) *Pool {
	t.Helper()
	p, err := New(n, bs)
	if err != nil {
		t.Fatalf("New(%d, %d): %v", n, bs, err)
	}
	check(t, p)
	return p
}

func check(t testing.TB, p *Pool) {
	t.Helper()
	if err := p.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

func alloc(t testing.TB, p *Pool, k int, hint int32) []int32 {
	t.Helper()
	dst := make([]int32, k)
	if err := p.Allocate(dst, hint); err != nil {
		t.Fatalf("Allocate(%d, hint %d): %v", k, hint, err)
	}
	check(t, p)
	return dst
}

func decref(t testing.TB, p *Pool, ids ...int32) []int32 {
	t.Helper()
	cached, err := p.Decref(ids, nil)
	if err != nil {
		t.Fatalf("Decref(%v): %v", ids, err)
	}
	check(t, p)
	return cached
}

func wantCode(t *testing.T, name string, err error, code kverr.Code) {
	t.Helper()
	if kverr.CodeOf(err) != code {
		t.Fatalf("%s: got %v (%s), want %s", name, err, kverr.CodeOf(err), code)
	}
	if err != nil && err.Error() == "" {
		t.Fatalf("%s: error without a message", name)
	}
}

func run(from int32, n int) []int32 {
	r := make([]int32, n)
	for i := range r {
		r[i] = from + int32(i)
	}
	return r
}

func TestNewRejectsBadSizes(t *testing.T) {
	for _, c := range []struct {
		name      string
		blocks    int
		blockSize int
	}{
		{"zero blocks", 0, 16},
		{"negative blocks", -1, 16},
		{"huge blocks", MaxBlocks + 1, 16},
		{"zero block size", 8, 0},
		{"negative block size", 8, -16},
		{"huge block size", 8, MaxBlockSize + 1},
	} {
		p, err := New(c.blocks, c.blockSize)
		wantCode(t, c.name, err, kverr.InvalidArgument)
		if p != nil {
			t.Fatalf("%s: got a pool", c.name)
		}
	}
	// The message states the real limit.
	if _, err := New(MaxBlocks+1, 16); err == nil || !strings.Contains(err.Error(), "[1, 2^26]") {
		t.Fatalf("num_blocks past the limit: %v, want a message naming [1, 2^26]", err)
	}
	p := newPool(t, 1, MaxBlockSize)
	if s := p.Stats(); s != (Stats{Total: 1, Free: 1}) {
		t.Fatalf("fresh pool stats %+v", s)
	}
}

func TestAllocateAllOrNone(t *testing.T) {
	p := newPool(t, 8, 16)
	a := alloc(t, p, 5, -1)
	if !slices.Equal(a, run(0, 5)) {
		t.Fatalf("first allocation %v, want 0..4", a)
	}
	before := p.Stats()
	dst := []int32{-7, -7, -7, -7}
	wantCode(t, "allocate 4 of 3 free", p.Allocate(dst, a[4]), kverr.OutOfBlocks)
	check(t, p)
	if p.Stats() != before || !slices.Equal(dst, []int32{-7, -7, -7, -7}) {
		t.Fatalf("failed allocation changed something: %+v -> %+v, dst %v", before, p.Stats(), dst)
	}
	if err := p.Allocate(nil, -1); err != nil {
		t.Fatalf("empty allocation: %v", err)
	}
	alloc(t, p, 3, -1)
	if s := p.Stats(); s.Free != 0 || s.InUse != 8 || s.PeakInUse != 8 {
		t.Fatalf("full pool stats %+v", s)
	}
}

func TestAllocateContiguousFirst(t *testing.T) {
	p := newPool(t, 32, 1)
	a := alloc(t, p, 4, -1)  // 0..3
	b := alloc(t, p, 4, -1)  // 4..7
	a2 := alloc(t, p, 2, 3)  // 4 is taken: restart at the head, 8..9
	b2 := alloc(t, p, 2, 7)  // 8 is taken: 10..11
	a3 := alloc(t, p, 2, 9)  // 10 is taken: 12..13
	a4 := alloc(t, p, 3, 13) // 14..16 continue the run
	if !slices.Equal(a, run(0, 4)) || !slices.Equal(b, run(4, 4)) || !slices.Equal(a2, run(8, 2)) ||
		!slices.Equal(b2, run(10, 2)) || !slices.Equal(a3, run(12, 2)) || !slices.Equal(a4, run(14, 3)) {
		t.Fatalf("allocations %v %v %v %v %v %v", a, b, a2, b2, a3, a4)
	}
	// Free 20..23 out of the middle of the rest; hint 19 then continues
	// through them while they are free.
	mid := alloc(t, p, 7, 16) // 17..23
	decref(t, p, mid[3:]...)  // 20..23 free again
	got := alloc(t, p, 3, 19)
	if !slices.Equal(got, run(20, 3)) {
		t.Fatalf("hint 19: got %v, want 20..22", got)
	}
	// The run breaks at 24? No: 23 is free and 24 too; take 5 from hint 22.
	got = alloc(t, p, 5, 22)
	if !slices.Equal(got, run(23, 5)) {
		t.Fatalf("hint 22: got %v, want 23..27", got)
	}
	// A hint outside the pool counts as none.
	got = alloc(t, p, 1, 1000)
	if got[0] != 28 {
		t.Fatalf("bad hint: got %v, want [28]", got)
	}
	got = alloc(t, p, 1, -5)
	if got[0] != 29 {
		t.Fatalf("negative hint: got %v, want [29]", got)
	}
	// A run that breaks part way restarts at the head.
	p2 := newPool(t, 10, 4)
	x := alloc(t, p2, 3, -1) // 0..2
	y := alloc(t, p2, 1, -1) // 3
	_ = y
	decref(t, p2, x...) // 0..2 free, behind 4..9 in the queue
	got = alloc(t, p2, 4, 1)
	if !slices.Equal(got, []int32{2, 4, 5, 6}) {
		t.Fatalf("broken run: got %v, want [2 4 5 6]", got)
	}
}

// TestReleaseReformsRuns checks the release order: a run freed block by block
// re-forms whole, and the next allocation gets it back as one run.
func TestReleaseReformsRuns(t *testing.T) {
	p := newPool(t, 200, 1)
	a := alloc(t, p, 100, -1)
	b := alloc(t, p, 100, -1)
	decref(t, p, a...)
	c := alloc(t, p, 100, -1)
	if !slices.Equal(c, run(0, 100)) {
		t.Fatalf("after freeing a run, allocation got %v..., want 0..99 contiguous", c[:8])
	}
	// Free b in two halves, second half first: each half re-forms, so the
	// next allocation gets them as two runs (the queue holds 150..199 first).
	decref(t, p, b[50:]...)
	decref(t, p, b[:50]...)
	d := alloc(t, p, 100, -1)
	if !slices.Equal(d, append(run(150, 50), run(100, 50)...)) {
		t.Fatalf("halves freed in reverse: got %v, want 150..199 then 100..149", d)
	}
	// Isolated blocks go behind the runs already free: with 10 and 20
	// freed after the run 150..199, an allocation of 50 still gets the run.
	decref(t, p, d[:50]...)
	decref(t, p, 10)
	decref(t, p, 20)
	e := alloc(t, p, 50, -1)
	if !slices.Equal(e, run(150, 50)) {
		t.Fatalf("with isolated blocks free: got %v, want 150..199", e)
	}
}

func TestRefcounts(t *testing.T) {
	p := newPool(t, 4, 16)
	a := alloc(t, p, 2, -1) // 0, 1
	if err := p.Incref([]int32{0, 0, 1}); err != nil {
		t.Fatal(err)
	}
	check(t, p)
	if p.Ref(0) != 3 || p.Ref(1) != 2 || p.Stats().Shared != 2 {
		t.Fatalf("refs %d %d shared %d", p.Ref(0), p.Ref(1), p.Stats().Shared)
	}
	before := p.Stats()
	wantCode(t, "incref free block", p.Incref([]int32{0, 2}), kverr.InvalidArgument)
	wantCode(t, "incref outside", p.Incref([]int32{0, 4}), kverr.InvalidArgument)
	wantCode(t, "incref negative", p.Incref([]int32{-1}), kverr.InvalidArgument)
	_, err := p.Decref([]int32{1, 1, 1}, nil) // ref 2: the third fails
	wantCode(t, "decref below zero", err, kverr.InvalidArgument)
	_, err = p.Decref([]int32{0, 3}, nil)
	wantCode(t, "decref free block", err, kverr.InvalidArgument)
	_, err = p.Decref([]int32{0, 99}, nil)
	wantCode(t, "decref outside", err, kverr.InvalidArgument)
	check(t, p)
	if p.Stats() != before || p.Ref(0) != 3 || p.Ref(1) != 2 {
		t.Fatalf("failed calls changed refs: %+v -> %+v, refs %d %d", before, p.Stats(), p.Ref(0), p.Ref(1))
	}
	decref(t, p, 0, 1, 0)
	if p.Ref(0) != 1 || p.Ref(1) != 1 || p.Stats().Shared != 0 {
		t.Fatalf("after decref: refs %d %d, stats %+v", p.Ref(0), p.Ref(1), p.Stats())
	}
	decref(t, p, a...)
	if s := p.Stats(); s.Free != 4 || s.InUse != 0 || s.PeakInUse != 2 {
		t.Fatalf("after release %+v", s)
	}
	if p.Ref(-1) != -1 || p.Ref(4) != -1 || p.State(4) != Free {
		t.Fatal("out-of-range accessors")
	}
}

func TestCachedState(t *testing.T) {
	p := newPool(t, 4, 16)
	wantCode(t, "mark free block", p.MarkCached(0), kverr.InvalidArgument)
	wantCode(t, "mark outside", p.MarkCached(9), kverr.InvalidArgument)
	a := alloc(t, p, 3, -1)
	if err := p.MarkCached(a[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.MarkCached(a[1]); err != nil {
		t.Fatal(err)
	}
	check(t, p)
	if !p.IsCached(a[0]) || p.IsCached(a[2]) || p.State(a[0]) != InUse {
		t.Fatal("mark state")
	}
	cached := decref(t, p, a...)
	if !slices.Equal(cached, a[:2]) {
		t.Fatalf("Decref reported %v, want %v", cached, a[:2])
	}
	if s := p.Stats(); s.Cached != 2 || s.Free != 2 || s.InUse != 0 {
		t.Fatalf("stats %+v", s)
	}
	if p.State(a[0]) != Cached || p.State(a[2]) != Free {
		t.Fatal("states after decref")
	}
	// Decref of a cached block: it has no reference.
	_, err := p.Decref([]int32{a[0]}, nil)
	wantCode(t, "decref cached", err, kverr.InvalidArgument)
	// Incref revives a cached block.
	if err := p.Incref([]int32{a[0], a[0]}); err != nil {
		t.Fatal(err)
	}
	check(t, p)
	if p.State(a[0]) != InUse || p.Ref(a[0]) != 2 || p.Stats().Cached != 1 || p.Stats().Shared != 1 {
		t.Fatalf("revived: state %s ref %d stats %+v", p.State(a[0]), p.Ref(a[0]), p.Stats())
	}
	// Evict: all or none.
	before := p.Stats()
	wantCode(t, "evict in-use", p.Evict([]int32{a[1], a[0]}), kverr.InvalidArgument)
	wantCode(t, "evict free", p.Evict([]int32{a[2]}), kverr.InvalidArgument)
	wantCode(t, "evict outside", p.Evict([]int32{-3}), kverr.InvalidArgument)
	check(t, p)
	if p.Stats() != before {
		t.Fatal("failed evict changed the pool")
	}
	if err := p.Evict([]int32{a[1], a[1]}); err != nil {
		t.Fatal(err)
	}
	check(t, p)
	if p.State(a[1]) != Free || p.IsCached(a[1]) || p.Stats().Free != 3 {
		t.Fatalf("evicted: %s, stats %+v", p.State(a[1]), p.Stats())
	}
	// Unmark: the revived block now goes to the free queue at ref 0.
	if err := p.UnmarkCached(a[0]); err != nil {
		t.Fatal(err)
	}
	if cached := decref(t, p, a[0], a[0]); len(cached) != 0 || p.State(a[0]) != Free {
		t.Fatalf("unmarked block: cached %v, state %s", cached, p.State(a[0]))
	}
	// Unmark of a Cached block frees it now.
	b := alloc(t, p, 1, -1)
	if err := p.MarkCached(b[0]); err != nil {
		t.Fatal(err)
	}
	decref(t, p, b[0])
	if err := p.UnmarkCached(b[0]); err != nil {
		t.Fatal(err)
	}
	check(t, p)
	if p.State(b[0]) != Free {
		t.Fatalf("unmarked cached block is %s", p.State(b[0]))
	}
	wantCode(t, "unmark free", p.UnmarkCached(b[0]), kverr.InvalidArgument)
	wantCode(t, "unmark outside", p.UnmarkCached(4), kverr.InvalidArgument)
	// Decref appends to the caller's slice.
	c := alloc(t, p, 2, -1)
	for _, id := range c {
		if err := p.MarkCached(id); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]int32, 1, 8)
	buf[0] = -9
	out, err := p.Decref(c, buf)
	if err != nil || !slices.Equal(out, []int32{-9, c[0], c[1]}) || &out[0] != &buf[0] {
		t.Fatalf("Decref append: %v %v", out, err)
	}
	check(t, p)
}

// TestPoolRandomized drives a pool with random operations against a plain
// reference model, checking the invariants after every step.
func TestPoolRandomized(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		rng := rand.New(rand.NewPCG(seed, 99))
		const n = 64
		p := newPool(t, n, 8)
		ref := make([]int32, n)
		marked := make([]bool, n)
		for step := range 3000 {
			live := []int32{}
			cachedIDs := []int32{}
			for i := range ref {
				if ref[i] > 0 {
					live = append(live, int32(i))
				} else if marked[i] {
					cachedIDs = append(cachedIDs, int32(i))
				}
			}
			free := n - len(live) - len(cachedIDs)
			pick := func(from []int32, k int) []int32 {
				out := make([]int32, k)
				for i := range out {
					out[i] = from[rng.IntN(len(from))]
				}
				return out
			}
			switch op := rng.IntN(6); {
			case op == 0 || op == 1:
				k := rng.IntN(10)
				hint := int32(rng.IntN(n+2) - 1)
				dst := make([]int32, k)
				err := p.Allocate(dst, hint)
				if k > free {
					wantCode(t, "allocate", err, kverr.OutOfBlocks)
					break
				}
				if err != nil {
					t.Fatalf("seed %d step %d: %v", seed, step, err)
				}
				for _, b := range dst {
					if ref[b] != 0 || marked[b] {
						t.Fatalf("seed %d step %d: allocated block %d with ref %d marked %v", seed, step, b, ref[b], marked[b])
					}
					ref[b] = 1
				}
			case op == 2 && len(live) > 0:
				ids := pick(live, rng.IntN(4)+1)
				if err := p.Incref(ids); err != nil {
					t.Fatal(err)
				}
				for _, b := range ids {
					ref[b]++
				}
			case op == 2 && len(cachedIDs) > 0:
				ids := pick(cachedIDs, 1)
				if err := p.Incref(ids); err != nil {
					t.Fatal(err)
				}
				ref[ids[0]]++
			case op == 3 && len(live) > 0:
				ids := pick(live, rng.IntN(4)+1)
				cnt := map[int32]int32{}
				ok := true
				for _, b := range ids {
					cnt[b]++
					ok = ok && cnt[b] <= ref[b]
				}
				got, err := p.Decref(ids, nil)
				if !ok {
					wantCode(t, "decref", err, kverr.InvalidArgument)
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				var want []int32
				for _, b := range ids {
					ref[b]--
					if ref[b] == 0 && marked[b] && !slices.Contains(want, b) {
						want = append(want, b)
					}
				}
				if !slices.Equal(got, want) {
					t.Fatalf("seed %d step %d: Decref reported %v, want %v", seed, step, got, want)
				}
			case op == 4 && len(live) > 0:
				b := pick(live, 1)[0]
				if err := p.MarkCached(b); err != nil {
					t.Fatal(err)
				}
				marked[b] = true
			case op == 5 && len(cachedIDs) > 0:
				ids := pick(cachedIDs, rng.IntN(3)+1)
				if err := p.Evict(ids); err != nil {
					t.Fatal(err)
				}
				for _, b := range ids {
					marked[b] = false
				}
			}
			check(t, p)
			var inUse, cached, shared int
			for i := range ref {
				if p.Ref(int32(i)) != ref[i] || p.IsCached(int32(i)) != marked[i] {
					t.Fatalf("seed %d step %d: block %d ref %d cached %v, model %d %v", seed, step, i, p.Ref(int32(i)), p.IsCached(int32(i)), ref[i], marked[i])
				}
				switch {
				case ref[i] > 0:
					inUse++
				case marked[i]:
					cached++
				}
				if ref[i] > 1 {
					shared++
				}
			}
			s := p.Stats()
			if s.InUse != inUse || s.Cached != cached || s.Shared != shared || s.Free != n-inUse-cached {
				t.Fatalf("seed %d step %d: stats %+v, model in use %d cached %d shared %d", seed, step, s, inUse, cached, shared)
			}
		}
	}
}

// TestCheckInvariantsCatchesDamage makes sure the checker can fail.
func TestCheckInvariantsCatchesDamage(t *testing.T) {
	damage := []func(p *Pool){
		func(p *Pool) { p.ref[5] = 1 },                     // free block with a ref
		func(p *Pool) { p.next[3] = 1 },                    // cycle
		func(p *Pool) { p.numFree-- },                      // counter
		func(p *Pool) { p.state[2] = InUse },               // in use with ref 0
		func(p *Pool) { p.prev[4] = 0 },                    // bad back link
		func(p *Pool) { p.tail = 3 },                       // bad tail
		func(p *Pool) { p.ref[0] = -1 },                    // negative ref
		func(p *Pool) { p.state[1], p.ref[1] = Cached, 0 }, // cached without mark
	}
	for i, d := range damage {
		p := newPool(t, 8, 4)
		alloc(t, p, 1, -1) // block 0 in use
		d(p)
		if err := p.CheckInvariants(); kverr.CodeOf(err) != kverr.Internal {
			t.Errorf("damage %d not detected: %v", i, err)
		}
	}
}

func BenchmarkPoolAllocateFree(b *testing.B) {
	for _, k := range []int{1, 64} {
		b.Run(map[int]string{1: "1block", 64: "64blocks"}[k], func(b *testing.B) {
			p, _ := New(1<<16, 16)
			// Fragment the pool a little so allocation takes the general path.
			hold := make([]int32, 1<<14)
			_ = p.Allocate(hold, -1)
			for i := 0; i < len(hold); i += 2 {
				_, _ = p.Decref(hold[i:i+1], nil)
			}
			dst := make([]int32, k)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				_ = p.Allocate(dst, -1)
				_, _ = p.Decref(dst, nil)
			}
		})
	}
}
