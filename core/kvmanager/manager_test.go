package kvmanager

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

func newMgr(t testing.TB, numBlocks, bs int) *Manager {
	t.Helper()
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs})
	if err != nil {
		t.Fatalf("New(%d, %d): %v", numBlocks, bs, err)
	}
	return m
}

func check(t testing.TB, m *Manager) {
	t.Helper()
	if err := m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

func wantCode(t testing.TB, name string, err error, code kverr.Code) {
	t.Helper()
	if got := kverr.CodeOf(err); got != code {
		t.Fatalf("%s: got %v (%s), want %s", name, err, got, code)
	}
	if err != nil && err.Error() == "" {
		t.Fatalf("%s: error without a message", name)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// liveIDs returns the live sequence ids in ascending order.
func liveIDs(m *Manager) []int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	ids := make([]int64, 0, m.seqs.len())
	for id := range m.seqs.all() {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// view is everything observable about a manager: its stats and a describe of
// every live sequence.
type view struct {
	stats Stats
	ids   []int64
	table []int32
	lens  []int32
	slots []int32
	max   int
}

func describeAll(t testing.TB, m *Manager) view {
	t.Helper()
	v := view{stats: m.Stats(), ids: liveIDs(m)}
	if len(v.ids) == 0 {
		return v
	}
	v.max = 1
	m.mu.Lock()
	for _, s := range m.seqs.all() {
		v.max = max(v.max, len(s.blocks))
	}
	m.mu.Unlock()
	n, err := m.Describe(v.ids, v.max, nil, nil, nil)
	must(t, err)
	v.table = make([]int32, len(v.ids)*v.max)
	v.lens = make([]int32, len(v.ids))
	v.slots = make([]int32, n)
	k, err := m.Describe(v.ids, v.max, v.table, v.lens, v.slots)
	must(t, err)
	if k != n {
		t.Fatalf("describe counted %d slots, then wrote %d", n, k)
	}
	return v
}

func (v view) String() string {
	return fmt.Sprintf("%+v ids %v table %v lens %v slots %v", v.stats, v.ids, v.table, v.lens, v.slots)
}

// unchanged runs a call that must fail with code and checks that nothing
// observable changed.
func unchanged(t *testing.T, m *Manager, name string, code kverr.Code, call func() error) {
	t.Helper()
	before := describeAll(t, m)
	wantCode(t, name, call(), code)
	check(t, m)
	if after := describeAll(t, m); after.String() != before.String() {
		t.Fatalf("%s changed the manager:\n%v\n->\n%v", name, before, after)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  Config
	}{
		{"zero blocks", Config{NumBlocks: 0, BlockSize: 16}},
		{"negative blocks", Config{NumBlocks: -3, BlockSize: 16}},
		{"huge blocks", Config{NumBlocks: 1 << 31, BlockSize: 1}},
		{"negative block size", Config{NumBlocks: 8, BlockSize: -1}},
		{"huge block size", Config{NumBlocks: 8, BlockSize: 1<<16 + 1}},
		{"slots overflow int32", Config{NumBlocks: 1 << 20, BlockSize: 1 << 12}},
	} {
		m, err := New(c.cfg)
		wantCode(t, c.name, err, kverr.InvalidArgument)
		if m != nil {
			t.Fatalf("%s: got a manager", c.name)
		}
	}
	if m, err := New(Config{NumBlocks: 8}); err != nil || m.Stats().BlockSize != DefaultBlockSize {
		t.Fatalf("block size 0 is the default %d: %v", DefaultBlockSize, err)
	}
	m := newMgr(t, 1<<15, 1<<16-1) // 2^31 - 2^15 slots: fits
	if s := m.Stats(); s.NumBlocks != 1<<15 || s.FreeBlocks != 1<<15 || s.Fragmentation != 0 {
		t.Fatalf("fresh stats %+v", s)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	m := newMgr(t, 8, 4)
	must(t, m.Add(1, 10)) // 3 blocks
	must(t, m.Add(2, 4))  // 1 full block
	must(t, m.Grow([]int64{2}, []int32{0}))
	check(t, m)

	// Add.
	unchanged(t, m, "add zero prompt", kverr.InvalidArgument, func() error { return m.Add(3, 0) })
	unchanged(t, m, "add negative prompt", kverr.InvalidArgument, func() error { return m.Add(3, -1) })
	unchanged(t, m, "add huge prompt", kverr.InvalidArgument, func() error { return m.Add(3, MaxPromptLen+1) })
	unchanged(t, m, "add live id", kverr.DuplicateSequence, func() error { return m.Add(1, 1) })
	unchanged(t, m, "add too few blocks", kverr.OutOfBlocks, func() error { return m.Add(3, 4*4+1) })

	// Grow.
	unchanged(t, m, "grow empty batch", kverr.InvalidArgument, func() error { return m.Grow(nil, nil) })
	unchanged(t, m, "grow counts length mismatch", kverr.InvalidArgument, func() error { return m.Grow([]int64{1, 2}, []int32{1}) })
	unchanged(t, m, "grow huge batch", kverr.InvalidArgument, func() error {
		return m.Grow(make([]int64, MaxBatch+1), make([]int32, MaxBatch+1))
	})
	unchanged(t, m, "grow negative count", kverr.InvalidArgument, func() error { return m.Grow([]int64{1, 2}, []int32{1, -1}) })
	unchanged(t, m, "grow huge count", kverr.InvalidArgument, func() error { return m.Grow([]int64{1}, []int32{MaxGrowTokens + 1}) })
	unchanged(t, m, "grow unknown id", kverr.UnknownSequence, func() error { return m.Grow([]int64{1, 42}, []int32{1, 1}) })
	unchanged(t, m, "grow id twice", kverr.DuplicateSequence, func() error { return m.Grow([]int64{1, 2, 1}, []int32{1, 1, 1}) })
	// 1 needs 2 more blocks for 7 tokens, 2 needs 3 for 9: 5 > 4 free.
	unchanged(t, m, "grow too few blocks", kverr.OutOfBlocks, func() error { return m.Grow([]int64{1, 2}, []int32{7, 9}) })
	err := m.Grow([]int64{1, 2}, []int32{7, 9})
	if msg := err.Error(); msg != "grow: the batch needs 5 new blocks, 4 are free" {
		t.Fatalf("out-of-blocks message %q", msg)
	}

	// Fork (sequence 1 has a partial last block, 2 a full one).
	unchanged(t, m, "fork no children", kverr.InvalidArgument, func() error { _, err := m.Fork(1, nil, nil); return err })
	unchanged(t, m, "fork huge batch", kverr.InvalidArgument, func() error {
		_, err := m.Fork(1, make([]int64, MaxBatch+1), nil)
		return err
	})
	unchanged(t, m, "fork unknown parent", kverr.UnknownSequence, func() error { _, err := m.Fork(9, []int64{10}, make([]CopyPair, 1)); return err })
	unchanged(t, m, "fork into live child", kverr.DuplicateSequence, func() error { _, err := m.Fork(1, []int64{10, 2}, make([]CopyPair, 2)); return err })
	unchanged(t, m, "fork into itself", kverr.DuplicateSequence, func() error { _, err := m.Fork(1, []int64{1}, make([]CopyPair, 1)); return err })
	unchanged(t, m, "fork child twice", kverr.DuplicateSequence, func() error { _, err := m.Fork(1, []int64{10, 11, 10}, make([]CopyPair, 3)); return err })
	unchanged(t, m, "fork copies too short", kverr.BufferTooSmall, func() error { _, err := m.Fork(1, []int64{10, 11}, make([]CopyPair, 1)); return err })
	unchanged(t, m, "fork copies nil", kverr.BufferTooSmall, func() error { _, err := m.Fork(1, []int64{10}, nil); return err })
	unchanged(t, m, "fork too few blocks", kverr.OutOfBlocks, func() error { _, err := m.Fork(1, []int64{10, 11, 12, 13, 14}, make([]CopyPair, 5)); return err })

	// Remove.
	unchanged(t, m, "remove empty batch", kverr.InvalidArgument, func() error { return m.Remove(nil) })
	unchanged(t, m, "remove huge batch", kverr.InvalidArgument, func() error { return m.Remove(make([]int64, MaxBatch+1)) })
	unchanged(t, m, "remove unknown", kverr.UnknownSequence, func() error { return m.Remove([]int64{1, 42}) })
	unchanged(t, m, "remove id twice", kverr.DuplicateSequence, func() error { return m.Remove([]int64{2, 1, 2}) })

	// Describe: nothing is written either.
	desc := func(name string, code kverr.Code, ids []int64, maxBlocks int, table, lens, slots []int32) {
		t.Helper()
		for _, b := range [][]int32{table, lens, slots} {
			for i := range b {
				b[i] = -77
			}
		}
		unchanged(t, m, name, code, func() error { _, err := m.Describe(ids, maxBlocks, table, lens, slots); return err })
		for _, b := range [][]int32{table, lens, slots} {
			for i, v := range b {
				if v != -77 {
					t.Fatalf("%s wrote %d at %d", name, v, i)
				}
			}
		}
	}
	both := []int64{1, 2}
	desc("describe empty batch", kverr.InvalidArgument, nil, 4, make([]int32, 4), nil, nil)
	desc("describe huge batch", kverr.InvalidArgument, make([]int64, MaxBatch+1), 0, nil, nil, nil)
	desc("describe unknown", kverr.UnknownSequence, []int64{1, 42}, 4, make([]int32, 8), make([]int32, 2), make([]int32, 20))
	desc("describe zero max_blocks", kverr.InvalidArgument, both, 0, make([]int32, 8), nil, nil)
	desc("describe table shorter than n*max_blocks", kverr.BufferTooSmall, both, 4, make([]int32, 7), nil, nil)
	desc("describe row too narrow", kverr.BufferTooSmall, both, 2, make([]int32, 4), make([]int32, 2), make([]int32, 20))
	desc("describe seq_lens too short", kverr.BufferTooSmall, both, 4, make([]int32, 8), make([]int32, 1), nil)
	desc("describe slots too short", kverr.BufferTooSmall, both, 4, make([]int32, 8), make([]int32, 2), make([]int32, 9))
	desc("describe empty slots", kverr.BufferTooSmall, both, 4, make([]int32, 8), make([]int32, 2), []int32{})

	// Double remove.
	must(t, m.Remove([]int64{1}))
	check(t, m)
	unchanged(t, m, "double remove", kverr.UnknownSequence, func() error { return m.Remove([]int64{1}) })
	unchanged(t, m, "grow removed", kverr.UnknownSequence, func() error { return m.Grow([]int64{1}, []int32{1}) })
	// Sequence 2 has no new tokens: an empty non-nil slot buffer is enough.
	if n, err := m.Describe([]int64{2}, 1, nil, nil, []int32{}); err != nil || n != 0 {
		t.Fatalf("describe with no new tokens: %d %v", n, err)
	}
}

func TestDescribe(t *testing.T) {
	m := newMgr(t, 16, 4)
	must(t, m.Add(7, 6)) // blocks 0,1; slots 0..5
	must(t, m.Add(8, 3)) // block 2; slots 8..10
	check(t, m)
	ids := []int64{8, 7}
	table := make([]int32, 2*3)
	lens := make([]int32, 2)
	slots := make([]int32, 20)
	n, err := m.Describe(ids, 3, table, lens, slots)
	must(t, err)
	if !slices.Equal(table, []int32{2, -1, -1, 0, 1, -1}) || !slices.Equal(lens, []int32{3, 6}) ||
		!slices.Equal(slots[:n], []int32{8, 9, 10, 0, 1, 2, 3, 4, 5}) {
		t.Fatalf("describe: table %v lens %v slots %v", table, lens, slots[:n])
	}
	// Grow: 7 by 3 (fills block 1, then block 3 since 2 is taken), 8 by 0.
	must(t, m.Grow([]int64{7, 8}, []int32{3, 0}))
	check(t, m)
	n, err = m.Describe(ids, 3, table, lens, slots)
	must(t, err)
	if !slices.Equal(table, []int32{2, -1, -1, 0, 1, 3}) || !slices.Equal(lens, []int32{3, 9}) ||
		!slices.Equal(slots[:n], []int32{6, 7, 12}) {
		t.Fatalf("after grow: table %v lens %v slots %v", table, lens, slots[:n])
	}
	// Read-only: a second call gives the same; nil outputs are skipped but
	// the count is still returned; an id may repeat.
	t2, l2, s2 := make([]int32, 6), make([]int32, 2), make([]int32, 3)
	n2, err := m.Describe(ids, 3, t2, l2, s2)
	must(t, err)
	if n2 != n || !slices.Equal(t2, table) || !slices.Equal(l2, lens) || !slices.Equal(s2, slots[:n]) {
		t.Fatal("second describe differs")
	}
	if k, err := m.Describe(ids, 0, nil, nil, nil); err != nil || k != 3 {
		t.Fatalf("count-only describe: %d %v", k, err)
	}
	if k, err := m.Describe([]int64{7, 7}, 3, nil, nil, make([]int32, 6)); err != nil || k != 6 {
		t.Fatalf("repeated id: %d %v", k, err)
	}
	// Growing by more than a block at once, across block boundaries.
	must(t, m.Grow([]int64{8}, []int32{6}))
	n, err = m.Describe([]int64{8}, 3, table[:3], lens[:1], slots)
	must(t, err)
	if !slices.Equal(table[:3], []int32{2, 4, 5}) || lens[0] != 9 || !slices.Equal(slots[:n], []int32{11, 16, 17, 18, 19, 20}) {
		t.Fatalf("multi-block grow: table %v len %d slots %v", table[:3], lens[0], slots[:n])
	}
	st := m.Stats()
	// Blocks 0,1,3 (9 tokens: 3 empty) and 2,4,5 (9 tokens: 3 empty).
	if st.UsedBlocks != 6 || st.NumTokens != 18 || st.InternalWaste != 6 || st.AllocatedSlots != 24 ||
		st.Fragmentation != 0.25 || st.NumSeqs != 2 || st.PeakUsedBlocks != 6 || st.FreeBlocks != 10 {
		t.Fatalf("stats %+v", st)
	}
	check(t, m)
}

func TestFork(t *testing.T) {
	m := newMgr(t, 16, 4)
	must(t, m.Add(1, 6)) // blocks 0, 1 (partial: 2 tokens)
	copies := make([]CopyPair, 3)
	n, err := m.Fork(1, []int64{2, 3}, copies)
	must(t, err)
	check(t, m)
	if n != 2 || copies[0] != (CopyPair{1, 2}) || copies[1] != (CopyPair{1, 3}) {
		t.Fatalf("fork copies %d %v", n, copies)
	}
	v := describeAll(t, m)
	if !slices.Equal(v.table, []int32{0, 1, 0, 2, 0, 3}) || !slices.Equal(v.lens, []int32{6, 6, 6}) ||
		!slices.Equal(v.slots, []int32{0, 1, 2, 3, 4, 5}) { // only the parent has new tokens
		t.Fatalf("after fork: %v", v)
	}
	if st := v.stats; st.SharedBlocks != 1 || st.UsedBlocks != 4 || st.NumTokens != 18 || st.InternalWaste != 6 {
		t.Fatalf("fork stats %+v", st)
	}
	// Children grow into their own blocks.
	must(t, m.Grow([]int64{2, 3}, []int32{1, 3}))
	n, err = m.Describe([]int64{2, 3}, 0, nil, nil, make([]int32, 4))
	must(t, err)
	if n != 4 {
		t.Fatalf("children's new tokens: %d", n)
	}
	// A parent with a full last block: no copies needed, copies may be nil.
	must(t, m.Add(10, 8)) // blocks 4, 5
	n, err = m.Fork(10, []int64{11}, nil)
	if err != nil || n != 0 {
		t.Fatalf("fork of full blocks: %d %v", n, err)
	}
	check(t, m)
	if st := m.Stats(); st.SharedBlocks != 3 {
		t.Fatalf("shared blocks %d, want 3 (1's first and 10's two)", st.SharedBlocks)
	}
	// The child grows into a new block; the parent's stay shared.
	must(t, m.Grow([]int64{11}, []int32{1}))
	check(t, m)
	// Removing the parents leaves the children's shared blocks in use:
	// 2 [0 2], 3 [0 3 4], 11 [5 6 7]; block 0 is still shared by 2 and 3.
	must(t, m.Remove([]int64{1, 10}))
	check(t, m)
	if st := m.Stats(); st.SharedBlocks != 1 || st.UsedBlocks != 7 || st.NumSeqs != 3 {
		t.Fatalf("after removing parents %+v", st)
	}
	must(t, m.Remove([]int64{2, 3, 11}))
	check(t, m)
	if st := m.Stats(); st.UsedBlocks != 0 || st.FreeBlocks != 16 || st.NumTokens != 0 || st.InternalWaste != 0 {
		t.Fatalf("empty manager %+v", st)
	}
}

// isRun reports whether ids is one run of consecutive block ids.
func isRun(ids []int32) bool {
	for i := 1; i < len(ids); i++ {
		if ids[i] != ids[i-1]+1 {
			return false
		}
	}
	return true
}

func blocksOf(t testing.TB, m *Manager, id int64, maxBlocks int) []int32 {
	t.Helper()
	row := make([]int32, maxBlocks)
	_, err := m.Describe([]int64{id}, maxBlocks, row, nil, nil)
	must(t, err)
	if i := slices.Index(row, -1); i >= 0 {
		row = row[:i]
	}
	return row
}

func TestContiguousRuns(t *testing.T) {
	for _, bs := range []int{1, 16} {
		t.Run(fmt.Sprintf("bs%d", bs), func(t *testing.T) {
			const numBlocks = 1024
			m := newMgr(t, numBlocks, bs)
			// Alone in an unfragmented pool: one run, through adds and grows.
			must(t, m.Add(1, 37*bs-3))
			for range 50 {
				must(t, m.Grow([]int64{1}, []int32{int32(bs/2 + 1)}))
			}
			b1 := blocksOf(t, m, 1, numBlocks)
			if !isRun(b1) || b1[0] != 0 {
				t.Fatalf("sequence 1: %v is not one run from 0", b1)
			}
			// A second sequence, then remove the first: the freed run comes
			// back whole to a new sequence of the same size.
			must(t, m.Add(2, 100*bs))
			if b2 := blocksOf(t, m, 2, numBlocks); !isRun(b2) {
				t.Fatalf("sequence 2: %v is not one run", b2)
			}
			must(t, m.Remove([]int64{1}))
			must(t, m.Add(3, 100*bs))
			b3 := blocksOf(t, m, 3, numBlocks)
			if !isRun(b3) {
				t.Fatalf("sequence 3: %v is not one run", b3)
			}
			// With room after its last block, a grow extends the run.
			must(t, m.Grow([]int64{3}, []int32{int32(3 * bs)}))
			if b := blocksOf(t, m, 3, numBlocks); !isRun(b) || len(b) != 103 {
				t.Fatalf("sequence 3 after grow: %v is not one run of 103", b)
			}
			check(t, m)

			// A full pool: the run freed by a removed sequence comes back
			// whole.
			full := newMgr(t, 200, bs)
			must(t, full.Add(1, 100*bs))
			must(t, full.Add(2, 100*bs))
			must(t, full.Remove([]int64{1}))
			must(t, full.Add(3, 100*bs-bs/2))
			if b := blocksOf(t, full, 3, 200); !slices.Equal(b, blocksOf(t, full, 3, 200)) || !isRun(b) || b[0] != 0 {
				t.Fatalf("reused run: %v", b)
			}
			check(t, full)
		})
	}
}

func TestTokenModeSlots(t *testing.T) {
	m := newMgr(t, 64, 1)
	must(t, m.Add(1, 5))
	must(t, m.Add(2, 3))
	must(t, m.Grow([]int64{1, 2}, []int32{2, 1}))
	v := describeAll(t, m)
	// Token mode: the table row is the req-to-token row and slots are blocks.
	if !slices.Equal(v.table, []int32{0, 1, 2, 3, 4, 8, 9, 5, 6, 7, 10, -1, -1, -1}) ||
		!slices.Equal(v.slots, []int32{8, 9, 10}) || !slices.Equal(v.lens, []int32{7, 4}) {
		t.Fatalf("token mode: %v", v)
	}
	if st := v.stats; st.InternalWaste != 0 || st.Fragmentation != 0 || st.AllocatedSlots != 11 {
		t.Fatalf("token mode stats %+v", st)
	}
}

// TestBatchMemo checks that the memoised batch never outlives its sequences
// and never hides a repeat.
func TestBatchMemo(t *testing.T) {
	m := newMgr(t, 64, 4)
	must(t, m.Add(1, 3))
	must(t, m.Add(2, 3))
	ids := []int64{1, 2}
	must(t, m.Grow(ids, []int32{1, 1}))
	must(t, m.Remove([]int64{1}))
	wantCode(t, "grow a removed id of the memoised batch", m.Grow(ids, []int32{1, 1}), kverr.UnknownSequence)
	must(t, m.Add(1, 9)) // the same id, a new sequence
	must(t, m.Grow(ids, []int32{1, 1}))
	lens := make([]int32, 2)
	_, err := m.Describe(ids, 0, nil, lens, nil)
	must(t, err)
	if !slices.Equal(lens, []int32{10, 5}) {
		t.Fatalf("lengths %v, want [10 5]", lens)
	}
	// Removing the memoised batch itself.
	must(t, m.Remove(ids))
	_, err = m.Describe(ids, 0, nil, lens, nil)
	wantCode(t, "describe a removed batch", err, kverr.UnknownSequence)
	// A batch with a repeat is fine for Describe but is not memoised, so
	// Grow still sees the repeat.
	must(t, m.Add(3, 1))
	rep := []int64{3, 3}
	_, err = m.Describe(rep, 1, nil, lens, nil)
	must(t, err)
	wantCode(t, "grow a repeated batch after describing it", m.Grow(rep, []int32{1, 1}), kverr.DuplicateSequence)
	// The caller's slice may change between calls: the memo is a copy.
	one := []int64{3}
	must(t, m.Grow(one, []int32{1}))
	one[0] = 99
	wantCode(t, "grow after the caller changed its ids", m.Grow(one, []int32{1}), kverr.UnknownSequence)
	check(t, m)
}

// TestConcurrentUse hammers one manager from several goroutines, each with
// its own sequences; -race checks the locking.
func TestConcurrentUse(t *testing.T) {
	m := newMgr(t, 4096, 16)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := int64(g * 1000)
			ids := []int64{base, base + 1, base + 2}
			counts := []int32{1, 2, 3}
			table := make([]int32, 3*64)
			lens := make([]int32, 3)
			slots := make([]int32, 16)
			for it := range 200 {
				for _, id := range ids {
					if err := m.Add(id, 10+it%40); err != nil {
						t.Error(err)
						return
					}
				}
				for range 5 {
					if err := m.Grow(ids, counts); err != nil {
						t.Error(err)
						return
					}
					if _, err := m.Describe(ids, 64, table, lens, slots); err != nil {
						t.Error(err)
						return
					}
				}
				_ = m.Stats()
				if err := m.Remove(ids); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	check(t, m)
	if st := m.Stats(); st.NumSeqs != 0 || st.FreeBlocks != 4096 {
		t.Fatalf("after concurrent use %+v", st)
	}
}

// TestCheckInvariantsCatchesDamage makes sure the checker can fail.
func TestCheckInvariantsCatchesDamage(t *testing.T) {
	damage := []func(m *Manager){
		func(m *Manager) { m.seqs.get(1).length += 5 },
		func(m *Manager) { m.seqs.get(1).blocks[0] = 7 },
		func(m *Manager) { m.seqs.get(1).fresh = 99 },
		func(m *Manager) { m.numTokens++ },
		func(m *Manager) { m.waste-- },
		func(m *Manager) { m.seqs.put(2, &seq{blocks: slices.Clone(m.seqs.get(1).blocks), length: 6}) },
	}
	for i, d := range damage {
		m := newMgr(t, 8, 4)
		must(t, m.Add(1, 6))
		d(m)
		if err := m.CheckInvariants(); kverr.CodeOf(err) != kverr.Internal {
			t.Errorf("damage %d not detected: %v", i, err)
		}
	}
}
