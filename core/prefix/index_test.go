package prefix

import (
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

func newIndex(t testing.TB, bs, numBlocks int, events bool) *Index {
	t.Helper()
	x, err := New(Config{BlockSize: bs, NumBlocks: numBlocks, EnableEvents: events})
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func check(t testing.TB, x *Index) {
	t.Helper()
	if err := x.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// cache inserts every full block of a prompt with the given block ids
// (consumed in order; a dup keeps its id unused) and returns the cached
// blocks, still locked.
func cache(t testing.TB, x *Index, tokens []int32, keys *Keys, ids ...int32) []int32 {
	t.Helper()
	held := insertChain(t, x, tokens, keys, ids...)
	check(t, x)
	return held
}

// insertChain is cache without the invariant check, for benchmarks.
func insertChain(t testing.TB, x *Index, tokens []int32, keys *Keys, ids ...int32) []int32 {
	t.Helper()
	var parent Hash
	var held []int32
	for i := 0; (i+1)*x.bs <= len(tokens); i++ {
		res, err := x.Insert(parent, tokens[i*x.bs:(i+1)*x.bs], keys, ids[i])
		if err != nil {
			t.Fatalf("insert block %d: %v", i, err)
		}
		parent = res.Hash
		held = append(held, res.Block)
	}
	return held
}

func match(t testing.TB, x *Index, tokens []int32, keys *Keys) MatchResult {
	t.Helper()
	res, err := x.Match(nil, tokens, keys, true)
	if err != nil {
		t.Fatal(err)
	}
	check(t, x)
	return res
}

func unlock(t testing.TB, x *Index, ids ...int32) {
	t.Helper()
	if err := x.Unlock(ids); err != nil {
		t.Fatal(err)
	}
	check(t, x)
}

func evict(t testing.TB, x *Index, n int) []int32 {
	t.Helper()
	got := x.Evict(nil, n)
	check(t, x)
	return got
}

func TestNewErrors(t *testing.T) {
	for _, c := range []Config{
		{BlockSize: 0, NumBlocks: 1},
		{BlockSize: MaxBlockSize + 1, NumBlocks: 1},
		{BlockSize: 16, NumBlocks: 0},
		{BlockSize: 16, NumBlocks: MaxBlocks + 1},
		{BlockSize: 16, NumBlocks: 1, MaxPendingEvents: -1},
	} {
		if _, err := New(c); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("New(%+v): %v", c, err)
		}
	}
}

func TestMatchNeverCoversLastToken(t *testing.T) {
	x := newIndex(t, 4, 16, false)
	p := seq(0, 12)
	held := cache(t, x, p, nil, 0, 1, 2)
	for _, c := range []struct {
		n, blocks int
	}{{0, 0}, {1, 0}, {4, 0}, {5, 1}, {8, 1}, {9, 2}, {12, 2}, {13, 3}, {20, 3}} {
		prompt := append(seq(0, 12), seq(100, 8)...)[:c.n]
		res := match(t, x, prompt, nil)
		if !slices.Equal(res.Blocks, held[:c.blocks]) || res.Tokens != 4*c.blocks {
			t.Errorf("prompt of %d: matched %v (%d tokens), want %v", c.n, res.Blocks, res.Tokens, held[:c.blocks])
		}
		if c.blocks > 0 && res.Last != x.nodes[x.byBlock[held[c.blocks-1]]].hash {
			t.Errorf("prompt of %d: Last is not the last matched block's hash", c.n)
		}
	}
	// Appending to dst keeps what was there.
	res, _ := x.Match([]int32{-7}, seq(0, 9), nil, false)
	if !slices.Equal(res.Blocks, []int32{-7, 0, 1}) || res.PartialBlock != -1 {
		t.Errorf("dst: %+v", res)
	}
}

func TestPartialMatch(t *testing.T) {
	x := newIndex(t, 4, 16, false)
	cache(t, x, []int32{1, 2, 3, 4, 5, 6, 7, 8}, nil, 0, 1)
	cache(t, x, []int32{1, 2, 3, 4, 5, 6, 9, 9}, nil, 7, 2) // block 0 is a dup of 0
	for _, c := range []struct {
		prompt        []int32
		blocks        []int32
		pblock, ptoks int
	}{
		{[]int32{1, 2, 3, 4, 5, 6, 7, 0, 0}, []int32{0}, 1, 3},     // block 1 shares 5 6 7
		{[]int32{1, 2, 3, 4, 5, 6, 9, 0}, []int32{0}, 2, 3},        // block 2 shares 5 6 9
		{[]int32{1, 2, 3, 4, 5, 6, 7, 8}, []int32{0}, 1, 3},        // the dropped last block: all but the last token
		{[]int32{1, 2, 3, 4, 5, 6}, []int32{0}, 2, 1},              // capped before the last token; tie: the newer block
		{[]int32{1, 2, 3, 4, 5}, []int32{0}, -1, 0},                // nothing left to share
		{[]int32{1, 2, 0, 0, 0}, nil, 0, 2},                        // partial first block
		{[]int32{1, 2, 3, 4, 8, 8, 8, 8, 8}, []int32{0}, -1, 0},    // no child shares a token
		{[]int32{1, 2, 3, 4, 5, 6, 0, 0, 0}, []int32{0}, 2, 2},     // tie at 2: the most recently used (2, inserted last)
		{[]int32{1, 2, 3, 4, 5, 6, 7, 8, 0}, []int32{0, 1}, -1, 0}, // full match, no child; touches 1
	} {
		res := match(t, x, c.prompt, nil)
		if !slices.Equal(res.Blocks, c.blocks) || res.PartialBlock != int32(c.pblock) || res.PartialTokens != c.ptoks {
			t.Errorf("%v: got blocks %v partial %d/%d, want %v %d/%d", c.prompt, res.Blocks, res.PartialBlock, res.PartialTokens, c.blocks, c.pblock, c.ptoks)
		}
	}
	// Keys: another adapter or salt shares nothing; a multimodal entry
	// cuts the partial where it begins (1 and 2 tie at 1: 1 is the most
	// recently used now).
	if res := match(t, x, []int32{1, 2, 0, 0, 0}, &Keys{Adapter: 1}); res.PartialBlock != -1 {
		t.Errorf("adapter: partial %d", res.PartialBlock)
	}
	if res := match(t, x, []int32{1, 2, 0, 0, 0}, &Keys{Salt: []byte("s")}); res.PartialBlock != -1 {
		t.Errorf("salt: partial %d", res.PartialBlock)
	}
	img := &Keys{MM: []MMItem{{Offset: 5, Length: 2, Hash: Sum([]byte("i"))}}}
	if res := match(t, x, []int32{1, 2, 3, 4, 5, 6, 7, 0, 0}, img); res.PartialBlock != 1 || res.PartialTokens != 1 {
		t.Errorf("multimodal: partial %d/%d, want 1/1", res.PartialBlock, res.PartialTokens)
	}
	// Without partial, nothing is looked for.
	if res, _ := x.Match(nil, []int32{1, 2, 0, 0, 0}, nil, false); res.PartialBlock != -1 || res.PartialTokens != 0 {
		t.Errorf("partial off: %+v", res)
	}
}

func TestInsertDedupAndErrors(t *testing.T) {
	x := newIndex(t, 4, 8, true)
	a := cache(t, x, seq(0, 8), nil, 0, 1)
	r, err := x.Insert(Hash{}, seq(0, 4), nil, 5)
	if err != nil || !r.Dup || r.Block != a[0] {
		t.Fatalf("dup insert: %+v %v", r, err)
	}
	if n := x.nodes[x.byBlock[a[0]]].lock; n != 2 {
		t.Fatalf("dup insert takes a lock: lock %d", n)
	}
	if x.byBlock[5] != nilNode {
		t.Fatal("the duplicate block id was cached")
	}
	chain := chainOf(t, seq(0, 8), 4, nil)
	if h, ok := x.BlockHash(a[1]); !ok || h != chain[1] || r.Hash != chain[0] {
		t.Fatalf("BlockHash(%d) = %s %v, want %s", a[1], h, ok, chain[1])
	}
	if b, ok := x.Lookup(chain[1]); !ok || b != a[1] {
		t.Fatalf("Lookup: %d %v", b, ok)
	}
	if _, ok := x.Lookup(Sum(nil)); ok {
		t.Fatal("Lookup of an unknown hash")
	}
	if _, ok := x.BlockHash(-1); ok {
		t.Fatal("BlockHash(-1)")
	}
	// Re-inserting the cached block itself is a dup too.
	if r, err := x.Insert(Hash{}, seq(0, 4), nil, a[0]); err != nil || !r.Dup || r.Block != a[0] {
		t.Fatalf("self insert: %+v %v", r, err)
	}
	check(t, x)
	before := x.Stats()
	for _, c := range []struct {
		name   string
		parent Hash
		block  []int32
		keys   *Keys
		id     int32
		code   kverr.Code
	}{
		{"short block", Hash{}, seq(0, 3), nil, 6, kverr.InvalidArgument},
		{"id outside", Hash{}, seq(9, 4), nil, 8, kverr.InvalidArgument},
		{"negative id", Hash{}, seq(9, 4), nil, -1, kverr.InvalidArgument},
		{"parent not cached", Sum([]byte("nope")), seq(9, 4), nil, 6, kverr.NotFound},
		{"id cached elsewhere", Hash{}, seq(9, 4), nil, a[1], kverr.InvalidArgument},
		{"dup with id cached elsewhere", Hash{}, seq(0, 4), nil, a[1], kverr.InvalidArgument},
		{"bad keys", Hash{}, seq(9, 4), &Keys{MM: []MMItem{{Offset: 0, Length: 0}}}, 6, kverr.InvalidArgument},
	} {
		if _, err := x.Insert(c.parent, c.block, c.keys, c.id); kverr.CodeOf(err) != c.code {
			t.Errorf("%s: %v, want %v", c.name, err, c.code)
		}
	}
	check(t, x)
	if after := x.Stats(); after != before {
		t.Errorf("failed inserts changed the stats: %+v -> %+v", before, after)
	}
	evs := x.DrainEvents(0)
	if len(evs) != 2 || evs[0].Kind != BlockStored || evs[1].Parent != evs[0].Hash {
		t.Errorf("events: dups must not be stored twice: %+v", evs)
	}
}

func TestLockUnlockAtomic(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	held := cache(t, x, seq(0, 6), nil, 0, 1, 2)
	if err := x.Lock([]int32{0, 0, 7}); kverr.CodeOf(err) != kverr.NotFound {
		t.Fatalf("lock of an uncached block: %v", err)
	}
	if err := x.Lock([]int32{9}); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("lock outside the pool: %v", err)
	}
	// Each block holds one lock: unlocking block 1 twice must fail whole.
	if err := x.Unlock([]int32{0, 1, 1}); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("double unlock: %v", err)
	}
	check(t, x)
	for _, id := range held {
		if x.nodes[x.byBlock[id]].lock != 1 {
			t.Fatalf("a failed unlock changed block %d", id)
		}
	}
	if err := x.Lock([]int32{2, 2}); err != nil {
		t.Fatal(err)
	}
	unlock(t, x, held...)
	if got := evict(t, x, 10); len(got) != 0 {
		t.Fatalf("evicted a locked chain: %v", got)
	}
	unlock(t, x, 2, 2)
	if got := evict(t, x, 10); !slices.Equal(got, []int32{2, 1, 0}) {
		t.Fatalf("evict: %v", got)
	}
	if x.Len() != 0 || x.Stats().Evictions != 3 {
		t.Fatalf("after evicting everything: %+v", x.Stats())
	}
}

func TestEvictionOrder(t *testing.T) {
	t.Run("lru", func(t *testing.T) {
		x := newIndex(t, 2, 16, false)
		a := cache(t, x, []int32{1, 1}, nil, 0)
		b := cache(t, x, []int32{2, 2}, nil, 1)
		c := cache(t, x, []int32{3, 3}, nil, 2)
		unlock(t, x, b...)
		unlock(t, x, a...)
		unlock(t, x, c...)
		match(t, x, []int32{2, 2, 0}, nil) // b becomes the most recent
		if got := evict(t, x, 3); !slices.Equal(got, []int32{0, 2, 1}) {
			t.Fatalf("got %v, want a, c, b", got)
		}
	})
	t.Run("ties to the deepest, leaves before parents", func(t *testing.T) {
		x := newIndex(t, 2, 16, false)
		long := cache(t, x, seq(0, 8), nil, 0, 1, 2, 3)
		short := cache(t, x, seq(50, 4), nil, 4, 5)
		// One batched retire: every block gets the same tick.
		unlock(t, x, append(slices.Clone(short), long...)...)
		if got := evict(t, x, 6); !slices.Equal(got, []int32{3, 2, 1, 5, 0, 4}) {
			t.Fatalf("got %v, want 3 2 1 5 0 4", got)
		}
	})
	t.Run("an old parent waits for its newer child", func(t *testing.T) {
		x := newIndex(t, 2, 16, false)
		pc := cache(t, x, seq(0, 4), nil, 0, 1)
		d := cache(t, x, seq(50, 2), nil, 2)
		unlock(t, x, pc[0]) // parent oldest
		unlock(t, x, pc[1])
		unlock(t, x, d...)
		if got := evict(t, x, 1); !slices.Equal(got, []int32{1}) {
			t.Fatalf("first: %v, want the child 1 (the parent is not a leaf)", got)
		}
		if got := evict(t, x, 1); !slices.Equal(got, []int32{0}) {
			t.Fatalf("second: %v, want the parent 0, now the oldest leaf", got)
		}
	})
	t.Run("pinned never", func(t *testing.T) {
		x := newIndex(t, 2, 16, false)
		p := cache(t, x, seq(0, 6), nil, 0, 1, 2)
		q := cache(t, x, seq(50, 2), nil, 3)
		x.Commit()
		id, n, err := x.Pin(seq(0, 4), nil) // the first two blocks
		if err != nil || n != 2 {
			t.Fatalf("pin: %d %v", n, err)
		}
		unlock(t, x, p...)
		unlock(t, x, q...)
		if got := evict(t, x, 10); !slices.Equal(got, []int32{2, 3}) {
			t.Fatalf("got %v, want 2 3 (0 and 1 pinned)", got)
		}
		if x.Evictable() != 0 {
			t.Fatalf("evictable %d with only pinned blocks", x.Evictable())
		}
		if err := x.Unpin(id); err != nil {
			t.Fatal(err)
		}
		check(t, x)
		if got := evict(t, x, 10); !slices.Equal(got, []int32{1, 0}) {
			t.Fatalf("after unpin: %v", got)
		}
	})
	t.Run("priorities", func(t *testing.T) {
		x := newIndex(t, 2, 16, false)
		old := cache(t, x, seq(0, 4), nil, 0, 1)
		newer := cache(t, x, seq(50, 4), nil, 2, 3)
		unlock(t, x, old...)
		unlock(t, x, newer...)
		if n, err := x.SetPriority(seq(0, 4), nil, 5); err != nil || n != 2 {
			t.Fatalf("set priority: %d %v", n, err)
		}
		if _, err := x.SetPriority(seq(0, 2), nil, -1); err != nil { // the old chain's first block
			t.Fatal(err)
		}
		check(t, x)
		// (priority, last, -depth): newer's blocks (priority 0) before old's
		// leaf (5); old's first block (-1) waits until its child is gone.
		if got := evict(t, x, 4); !slices.Equal(got, []int32{3, 2, 1, 0}) {
			t.Fatalf("got %v, want 3 2 1 0", got)
		}
		if _, err := x.SetPriority(seq(0, 4), nil, 1); kverr.CodeOf(err) != kverr.NotFound {
			t.Fatalf("priority of an uncached prefix: %v", err)
		}
	})
}

func TestEvictable(t *testing.T) {
	x := newIndex(t, 2, 16, false)
	a := cache(t, x, seq(0, 6), nil, 0, 1, 2)
	b := cache(t, x, append(seq(0, 4), 9, 9), nil, 9, 9, 3) // shares 0 and 1
	if x.Evictable() != 0 {
		t.Fatalf("evictable %d, all locked", x.Evictable())
	}
	unlock(t, x, a...)
	if x.Evictable() != 1 { // block 2 only: 0 and 1 hold b's locks and child
		t.Fatalf("evictable %d, want 1", x.Evictable())
	}
	unlock(t, x, b...)
	if x.Evictable() != 4 {
		t.Fatalf("evictable %d, want 4", x.Evictable())
	}
}

func TestIsolationInIndex(t *testing.T) {
	x := newIndex(t, 4, 32, false)
	p := seq(0, 12)
	img := Sum([]byte("img"))
	mm := &Keys{MM: []MMItem{{Offset: 5, Length: 2, Hash: img}}}
	cache(t, x, p, &Keys{Salt: []byte("a")}, 0, 1, 2)
	cache(t, x, p, &Keys{Adapter: 1}, 3, 4, 5)
	cache(t, x, p, mm, 6, 7, 8)
	for _, c := range []struct {
		name string
		keys *Keys
		want []int32
	}{
		{"salt a", &Keys{Salt: []byte("a")}, []int32{0, 1, 2}},
		{"salt b", &Keys{Salt: []byte("b")}, nil},
		{"no keys", nil, []int32{6}}, // the image's chain begins with a plain block
		{"adapter 1", &Keys{Adapter: 1}, []int32{3, 4, 5}},
		{"adapter 2", &Keys{Adapter: 2}, nil},
		{"image", mm, []int32{6, 7, 8}},
		{"other image", &Keys{MM: []MMItem{{Offset: 5, Length: 2, Hash: Sum([]byte("x"))}}}, []int32{6}},
		{"image moved", &Keys{MM: []MMItem{{Offset: 6, Length: 2, Hash: img}}}, []int32{6}},
	} {
		res := match(t, x, append(slices.Clone(p), 99), c.keys)
		if !slices.Equal(res.Blocks, c.want) {
			t.Errorf("%s: matched %v, want %v", c.name, res.Blocks, c.want)
		}
	}
	// The image begins in block 1, so block 0 is the plain prompt's.
	r, err := x.Insert(Hash{}, p[:4], nil, 9)
	if err != nil || !r.Dup || r.Block != 6 {
		t.Fatalf("block 0 before the image: %+v %v, want a dup of block 6", r, err)
	}
}

func TestPinErrors(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	if _, _, err := x.Pin(seq(0, 4), nil); kverr.CodeOf(err) != kverr.NotFound {
		t.Fatalf("pin of an empty index: %v", err)
	}
	if err := x.Unpin(1); kverr.CodeOf(err) != kverr.NotFound {
		t.Fatalf("unpin of an unknown id: %v", err)
	}
	cache(t, x, seq(0, 4), nil, 0, 1)
	// Pending blocks (no commit since their insert) are never pinned.
	if _, _, err := x.Pin(seq(0, 4), nil); kverr.CodeOf(err) != kverr.NotFound {
		t.Fatalf("pin of pending blocks: %v", err)
	}
	x.CommitBlocks([]int32{0})
	if id, n, err := x.Pin(seq(0, 4), nil); err != nil || n != 1 || x.Unpin(id) != nil {
		t.Fatalf("pin of one computed block then a pending one: %d %v, want 1 block", n, err)
	}
	x.Commit()
	id1, n1, err1 := x.Pin(seq(0, 2), nil)
	id2, n2, err2 := x.Pin(seq(0, 5), nil) // every full block: both
	if err1 != nil || err2 != nil || n1 != 1 || n2 != 2 || id1 == id2 {
		t.Fatalf("pins: %d %d %v %v", n1, n2, err1, err2)
	}
	check(t, x)
	if err := x.Unpin(id2); err != nil {
		t.Fatal(err)
	}
	if x.nodes[x.byBlock[0]].pin != 1 || x.nodes[x.byBlock[1]].pin != 0 {
		t.Fatal("unpin released the wrong blocks")
	}
	check(t, x)
}

func TestClear(t *testing.T) {
	x := newIndex(t, 2, 8, true)
	a := cache(t, x, seq(0, 4), nil, 0, 1)
	id, _, _ := x.Pin(seq(0, 4), nil)
	if ids, err := x.Clear(nil); err == nil || len(ids) != 0 {
		t.Fatalf("clear with locked blocks: %v %v", ids, err)
	}
	check(t, x)
	unlock(t, x, a...)
	ids, err := x.Clear(nil)
	if err != nil || !slices.Equal(ids, []int32{0, 1}) {
		t.Fatalf("clear: %v %v", ids, err)
	}
	check(t, x)
	if x.Len() != 0 || x.Stats().PinnedBlocks != 0 {
		t.Fatalf("after clear: %+v", x.Stats())
	}
	if err := x.Unpin(id); kverr.CodeOf(err) != kverr.NotFound {
		t.Fatalf("unpin after clear: %v", err)
	}
	if evs := x.DrainEvents(0); len(evs) != 1 || evs[0].Kind != AllCleared {
		t.Fatalf("events after clear: %+v", evs)
	}
	// The index works after a clear, reusing its slots.
	cache(t, x, seq(5, 6), nil, 1, 0, 2)
	if res := match(t, x, seq(5, 7), nil); !slices.Equal(res.Blocks, []int32{1, 0, 2}) {
		t.Fatalf("match after clear: %v", res.Blocks)
	}
}

func TestMatchAllocatesNothing(t *testing.T) {
	x := newIndex(t, 16, 1024, false)
	img := Sum([]byte("img"))
	keys := &Keys{Adapter: 3, Salt: []byte("tenant"), MM: []MMItem{{Offset: 40, Length: 100, Hash: img}}}
	p := seq(0, 1024)
	ids := make([]int32, 64)
	for i := range ids {
		ids[i] = int32(i)
	}
	cache(t, x, p[:512], keys, ids...)
	dst := make([]int32, 0, 64)
	var res MatchResult
	allocs := testing.AllocsPerRun(100, func() {
		res, _ = x.Match(dst[:0], p, keys, true)
	})
	if allocs != 0 || res.Tokens != 512 {
		t.Fatalf("Match: %v allocations, %d tokens", allocs, res.Tokens)
	}
}

func TestStats(t *testing.T) {
	x := newIndex(t, 4, 8, false)
	cache(t, x, seq(0, 8), nil, 0, 1)
	match(t, x, seq(0, 10), nil)
	match(t, x, seq(50, 6), nil)
	s := x.Stats()
	want := Stats{Queries: 2, QueryTokens: 16, HitTokens: 8, Inserts: 2, CachedBlocks: 2, LockedBlocks: 2, PendingBlocks: 2}
	if s != want {
		t.Fatalf("stats %+v, want %+v", s, want)
	}
	x.Commit()
	x.ResetStats()
	want = Stats{CachedBlocks: 2, LockedBlocks: 2}
	if s := x.Stats(); s != want {
		t.Fatalf("after reset %+v, want %+v", s, want)
	}
}

func TestAcquireLocksOnlyWhatFits(t *testing.T) {
	x := newIndex(t, 2, 16, false)
	a := []int32{1, 2, 3, 4, 5, 6}
	b := []int32{7, 8, 9, 10}
	must(t, x.Unlock(cache(t, x, a, nil, 0, 1, 2)))
	must(t, x.Unlock(cache(t, x, b, nil, 3, 4)))
	if x.Evictable() != 5 {
		t.Fatalf("evictable %d, want 5", x.Evictable())
	}
	prompt := []int32{1, 2, 3, 4, 0, 0, 0} // matches a's first two blocks
	st := x.Stats()
	clock := x.clock
	// 4 blocks needed, 2 matched: with 0 free, the 3 other evictable
	// blocks (a's third, b's two) are enough for the 2 left.
	if _, ok, err := x.Acquire(nil, prompt, nil, 4, 0); err != nil || !ok {
		t.Fatalf("acquire with enough evictable blocks: %v %v", ok, err)
	}
	check(t, x)
	if x.LockCount(0) != 1 || x.LockCount(1) != 1 || x.LockCount(2) != 0 {
		t.Fatalf("locks %d %d %d, want 1 1 0", x.LockCount(0), x.LockCount(1), x.LockCount(2))
	}
	// Now 3 evictable: a prompt needing 6 with 2 matched and 0 free does
	// not fit, and changes nothing.
	st, clock = x.Stats(), x.clock
	res, ok, err := x.Acquire(nil, prompt, nil, 6, 0)
	if err != nil || ok || len(res.Blocks) != 0 {
		t.Fatalf("acquire past the pool: %v %v %v", res.Blocks, ok, err)
	}
	if x.Stats() != st || x.clock != clock || x.LockCount(0) != 1 {
		t.Fatalf("a refused acquire changed the index")
	}
	// Matched blocks do not count as evictable for the rest: with a's first
	// two unlocked again, 5 evictable, but 2 of them are the match.
	must(t, x.Unlock([]int32{0, 1}))
	if _, ok, _ := x.Acquire(nil, prompt, nil, 6, 0); ok {
		t.Fatalf("acquire counted its own matched blocks as evictable")
	}
	if _, ok, _ := x.Acquire(nil, prompt, nil, 5, 0); !ok {
		t.Fatalf("acquire refused a prompt that fits exactly")
	}
	if x.LockCount(7) != -1 {
		t.Fatalf("LockCount of an uncached block: %d", x.LockCount(7))
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
