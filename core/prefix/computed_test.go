package prefix

import (
	"math"
	"slices"
	"testing"
)

// A pending chain dropped from its middle takes everything below it, a
// computed block stays, a repeated or nested id counts once, and the
// locks other holders had are reported.
func TestDropPending(t *testing.T) {
	x := newIndex(t, 2, 16, true)
	a := cache(t, x, seq(0, 4), nil, 0, 1) // blocks 0, 1
	x.Commit()
	b := cache(t, x, seq(0, 8), nil, 10, 11, 2, 3) // 0, 1 dups; 2, 3 new below 1
	if !slices.Equal(b, []int32{0, 1, 2, 3}) {
		t.Fatalf("second chain: %v", b)
	}
	c := cache(t, x, seq(0, 6), nil, 12, 13, 14) // shares 0, 1, 2: 2 gets a second lock
	if !slices.Equal(c, []int32{0, 1, 2}) {
		t.Fatalf("third chain: %v", c)
	}
	x.DrainEvents(0)
	if x.IsPending(0) || x.IsPending(1) || !x.IsPending(2) || !x.IsPending(3) || x.Pending() != 2 {
		t.Fatalf("pending: %v %v %v %v, %d", x.IsPending(0), x.IsPending(1), x.IsPending(2), x.IsPending(3), x.Pending())
	}
	unlock(t, x, 2, 3) // the second chain's own blocks' owner lets go
	got, err := x.DropPending([]int32{3, 2, 2, 0, 9}, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []DroppedBlock{{Block: 3, Locks: 0}, {Block: 2, Locks: 1}}
	if !slices.Equal(got, want) {
		t.Fatalf("dropped %v, want %v", got, want)
	}
	check(t, x)
	if x.Len() != 2 || x.Pending() != 0 || x.Stats().DroppedPending != 2 || x.LockCount(0) != 3 {
		t.Fatalf("after the drop: %d cached, %d pending, stats %+v, block 0 locks %d", x.Len(), x.Pending(), x.Stats(), x.LockCount(0))
	}
	evs := x.DrainEvents(0)
	if len(evs) != 1 || evs[0].Kind != BlockRemoved || len(evs[0].Hashes) != 2 {
		t.Fatalf("events %+v, want one BlockRemoved of two hashes", evs)
	}
	// The computed prefix still matches; the dropped part does not.
	if r := match(t, x, seq(0, 8), nil); !slices.Equal(r.Blocks, []int32{0, 1}) {
		t.Fatalf("match after the drop: %v", r.Blocks)
	}
	_ = a
}

// CommitBlocks marks single blocks; a block committed so is never
// dropped.
func TestCommitBlocks(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	cache(t, x, seq(0, 6), nil, 0, 1, 2)
	x.CommitBlocks([]int32{1, 7, -1, 99})
	if x.IsPending(1) || !x.IsPending(0) || !x.IsPending(2) || x.Pending() != 2 {
		t.Fatal("CommitBlocks marked the wrong blocks")
	}
	check(t, x)
	got, err := x.DropPending([]int32{1}, nil)
	if err != nil || len(got) != 0 {
		t.Fatalf("drop of a computed block: %v %v", got, err)
	}
}

// The step counter wraps without making old blocks pending.
func TestCommitWraps(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	x.epoch = math.MaxUint32
	cache(t, x, seq(0, 4), nil, 0, 1)
	if !x.IsPending(0) {
		t.Fatal("a fresh block is not pending")
	}
	x.Commit()
	if x.epoch != 1 || x.IsPending(0) || x.IsPending(1) || x.Pending() != 0 {
		t.Fatalf("after the wrap: epoch %d, pending %v %v", x.epoch, x.IsPending(0), x.IsPending(1))
	}
	cache(t, x, seq(0, 6), nil, 5, 6, 2)
	if x.IsPending(0) || !x.IsPending(2) || x.Pending() != 1 {
		t.Fatal("pending after the wrap is wrong")
	}
	check(t, x)
}

// Release drops locks as Unlock does but leaves the blocks' last access,
// so the eviction order is what it was before the lock.
func TestReleaseIsNotAnAccess(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	a := cache(t, x, seq(0, 2), nil, 0)  // older
	b := cache(t, x, seq(10, 2), nil, 1) // newer
	unlock(t, x, a...)
	unlock(t, x, b...)
	if err := x.Lock([]int32{0, 0}); err != nil {
		t.Fatal(err)
	}
	if err := x.Release([]int32{0, 0, 0}); err == nil {
		t.Fatal("released more locks than held")
	}
	if x.LockCount(0) != 2 {
		t.Fatalf("a refused release changed the locks: %d", x.LockCount(0))
	}
	if err := x.Release([]int32{0, 0}); err != nil {
		t.Fatal(err)
	}
	check(t, x)
	if got := evict(t, x, 1); !slices.Equal(got, []int32{0}) {
		t.Fatalf("evicted %v first, want block 0: the release touched it", got)
	}
	d, toks, ok := x.Describe(1, nil)
	if !ok || d.Block != 1 || !slices.Equal(toks, seq(10, 2)) || d.Parent != (Hash{}) {
		t.Fatalf("describe: %+v %v %v", d, toks, ok)
	}
	if _, _, ok := x.Describe(0, nil); ok {
		t.Fatal("described an evicted block")
	}
}
