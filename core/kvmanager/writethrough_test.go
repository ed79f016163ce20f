package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
)

// nopCopier accepts every batch; the tests complete the batches
// themselves. (The K/V bytes are the slot model's concern, below.)
type nopCopier struct{}

func (nopCopier) Copy(CopyBatch) error { return nil }

// With write-through, the GPU prefix cache behaves exactly as with no tier:
// two managers driven by the same conversations (one with a host tier in
// write-through, one without) match the same GPU tokens at every
// admission, while the tier turns some of the GPU's misses into host hits.
// So it does with a write-through slack (the stores wait while the pool
// has room), which must not lose a queued block when the slack covers the
// walk's allocations between flushes.
func TestWriteThroughNeverCostsAGPUHit(t *testing.T) {
	for _, slack := range []int{0, 8, 20} {
		for seed := range uint64(4) {
			t.Run(fmt.Sprintf("slack%d/%d", slack, seed), func(t *testing.T) {
				testWriteThroughLockstep(t, seed, slack)
			})
		}
	}
}

func testWriteThroughLockstep(t *testing.T, seed uint64, slack int) {
	const bs, blocks = 4, 48
	r := rand.New(rand.NewPCG(seed, 31))
	plain, err := New(Config{NumBlocks: blocks, BlockSize: bs, EnablePrefixCache: true})
	must(t, err)
	wt := 1 + int(seed)*4
	tiered, _ := newWriteThroughMgrCfg(t, blocks, bs, 4*blocks, HostTier{Copier: nopCopier{}, WriteThrough: wt, WriteThroughSlack: slack})
	held := 0 // flushes that found the queue not empty and stored nothing, the free blocks above the slack
	convs := make([][]int32, 12)
	var id int64
	var gpuHits, hostHits int64
	for step := range 600 {
		c := r.IntN(len(convs))
		p := append(slices.Clone(convs[c]), seqTokens(r, 1+r.IntN(3*bs))...)
		if (len(p)+bs-1)/bs > blocks/2 {
			convs[c], p = nil, seqTokens(r, 1+r.IntN(3*bs))
		}
		id++
		a, b := []int32{0}, []int32{0}
		na, err := plain.Admit([]int64{id}, one(p, nil), a)
		must(t, err)
		before := tiered.TierStats().HostHitTokens
		nb, err := tiered.Admit([]int64{id}, one(p, nil), b)
		must(t, err)
		if na != nb {
			t.Fatalf("step %d: admitted %d without the tier, %d with it", step, na, nb)
		}
		if na == 0 {
			continue
		}
		if gpu := int64(b[0]) - (tiered.TierStats().HostHitTokens - before); gpu != int64(a[0]) {
			t.Fatalf("step %d: GPU match %d with the tier (%d with its host hits), %d without", step, gpu, b[0], a[0])
		}
		gpuHits += int64(a[0])
		hostHits += int64(b[0] - a[0])
		// The step: its copies (completed before the next
		// allocations), its forward pass, the request done.
		free, queued := tiered.Stats().FreeBlocks, tiered.TierStats().WriteThroughQueue
		tk, _, err := tiered.FlushCopies()
		must(t, err)
		if tk != 0 {
			must(t, tiered.CompleteCopies(tk, false))
		}
		if slack > 0 && free > slack && queued > 0 {
			if tiered.TierStats().WriteThroughQueue != queued {
				t.Fatalf("step %d: %d free blocks, above the slack %d, and the queue went from %d to %d", step, free, slack, queued, tiered.TierStats().WriteThroughQueue)
			}
			held++
		}
		plain.MarkComputed()
		tiered.MarkComputed()
		must(t, plain.Remove([]int64{id}))
		must(t, tiered.Remove([]int64{id}))
		convs[c] = p
		if ps, ts := plain.PrefixStats(), tiered.PrefixStats(); ps.HitTokens != ts.HitTokens || ps.Evictions != ts.Evictions {
			t.Fatalf("step %d: GPU hits %d / evictions %d with the tier, %d / %d without", step, ts.HitTokens, ts.Evictions, ps.HitTokens, ps.Evictions)
		}
	}
	mustCheck(t, plain)
	mustCheck(t, tiered)
	st := tiered.TierStats()
	t.Logf("GPU hit tokens %d, host hit tokens %d; %+v", gpuHits, hostHits, st)
	if gpuHits == 0 || hostHits == 0 || st.WriteThroughStored == 0 || st.Reloads == 0 || st.DemotionsQueued != 0 || (slack > 0) != (held > 0) {
		t.Fatalf("the walk missed a path: GPU hits %d, host hits %d, %d flushes held, stats %+v", gpuHits, hostHits, held, st)
	}
}

// A block removed uncomputed never reaches the host tier, and a write-
// through store of a block the GPU evicted first is counted lost; bad
// settings are refused.
func TestWriteThroughStoresOnlyComputedBlocks(t *testing.T) {
	m, pool := newWriteThroughMgr(t, 8, 4, 16, 1)
	_, err := m.Admit([]int64{1}, one(iota32(0, 9), nil), nil) // two full blocks
	must(t, err)
	must(t, m.Remove([]int64{1})) // before its forward pass: dropped
	m.MarkComputed()
	if tk, n, err := m.FlushCopies(); err != nil || tk != 0 || n != 0 {
		t.Fatalf("flush after an uncomputed removal: ticket %d, %d copies, %v", tk, n, err)
	}
	_, err = m.Admit([]int64{2}, one(iota32(100, 9), nil), nil)
	must(t, err)
	m.MarkComputed()
	if st := m.TierStats(); st.WriteThroughQueue != 2 {
		t.Fatalf("queue %d, want the 2 computed blocks", st.WriteThroughQueue)
	}
	tk, n, err := m.FlushCopies() // one a flush: the rate bound
	if err != nil || tk == 0 || n != 1 {
		t.Fatalf("flush: ticket %d, %d copies, %v", tk, n, err)
	}
	mustCheck(t, m)
	if st := m.Stats(); st.CachedBlocks+st.UsedBlocks != 3 {
		t.Fatalf("blocks under a store left the cache: %+v", st)
	}
	must(t, m.CompleteCopies(tk, false))
	must(t, m.Remove([]int64{2}))
	// An allocation evicts both cached blocks before the second's store.
	_, err = m.Admit([]int64{3}, one(iota32(500, 32), nil), nil)
	must(t, err)
	m.MarkComputed()
	flushCompleted(t, m)
	st := m.TierStats()
	if st.WriteThroughStored < 1 || st.WriteThroughLost < 1 {
		t.Fatalf("stats %+v: want a store and a lost block", st)
	}
	mustCheck(t, m)
	if _, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true,
		HostTier: &HostTier{Pool: pool, WriteThrough: 9}}); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("write_through past the pool: %v", err)
	}
}

// stepRecorder accepts every batch and records its stores' blocks.
type stepRecorder struct{ stored []int32 }

func (r *stepRecorder) Copy(b CopyBatch) error {
	for _, op := range b.Demote {
		r.stored = append(r.stored, op.Block)
	}
	return nil
}

// With a write-through slack no store is handed out while the GPU pool's
// free queue holds more blocks than the slack: the computed blocks queue
// up, and once allocations bring the free blocks to the slack the stores
// start, WriteThrough a flush, oldest first; with the slack covering a
// step's allocations, no queued block is lost.
func TestWriteThroughSlackWaitsWhileThePoolHasRoom(t *testing.T) {
	const bs, blocks, wt, slack = 4, 24, 2, 5
	rec := &stepRecorder{}
	m, _ := newWriteThroughMgrCfg(t, blocks, bs, 4*blocks, HostTier{Copier: rec, WriteThrough: wt, WriteThroughSlack: slack})
	r := rand.New(rand.NewPCG(5, 7))
	var computed []int32 // the blocks in the order they were computed
	table := make([]int32, 3)
	started := false
	for step := range 20 {
		id := int64(step + 1)
		admit(t, m, id, seqTokens(r, 2*bs+1), nil) // two full blocks and one token: 3 blocks
		free, queued := m.Stats().FreeBlocks, m.TierStats().WriteThroughQueue
		before := len(rec.stored)
		flushCompleted(t, m)
		got := len(rec.stored) - before
		st := m.TierStats()
		switch {
		case free > slack:
			if got != 0 || st.WriteThroughStored != 0 || st.WriteThroughQueue != queued {
				t.Fatalf("step %d: %d free blocks, above the slack: %d stores, stats %+v (queue was %d)", step, free, got, st, queued)
			}
		default:
			if want := min(queued, wt); got != want {
				t.Fatalf("step %d: %d free blocks, at most the slack: %d stores, want %d (queue %d)", step, free, got, want, queued)
			}
			if !started && queued != 2*step {
				t.Fatalf("step %d: the first stores found %d queued blocks, want the %d of the steps before", step, queued, 2*step)
			}
			started = true
		}
		_, err := m.Describe([]int64{id}, 3, table, nil, nil)
		must(t, err)
		computed = append(computed, table[:2]...) // the full blocks; the last one is freed at removal
		m.MarkComputed()
		must(t, m.Remove([]int64{id}))
		mustCheck(t, m)
	}
	st := m.TierStats()
	if !started || st.WriteThroughLost != 0 || st.WriteThroughStored != int64(len(rec.stored)) || len(rec.stored) == 0 {
		t.Fatalf("stores started %v, %d recorded, stats %+v", started, len(rec.stored), st)
	}
	if !slices.Equal(rec.stored, computed[:len(rec.stored)]) {
		t.Fatalf("stored %v, want the computed blocks oldest first: %v", rec.stored, computed)
	}
}

// A write-through slack outside [0, NumBlocks], without write-through, or
// below demote_ahead (whose demotions would keep the free queue above it,
// so no store would ever go) is refused; demote_ahead up to the slack is
// taken. (A manager with layer groups refuses write-through, and so any
// slack: groups_test.go.)
func TestWriteThroughSlackRefused(t *testing.T) {
	pool, err := host.New(host.Config{Slots: 16, BlockBytes: 16})
	must(t, err)
	for _, h := range []HostTier{
		{Pool: pool, WriteThrough: 1, WriteThroughSlack: -1},
		{Pool: pool, WriteThrough: 1, WriteThroughSlack: 9},
		{Pool: pool, WriteThroughSlack: 1},
		{Pool: pool, DemoteAhead: 2, WriteThroughSlack: 1},
		{Pool: pool, WriteThrough: 1, DemoteAhead: 3, WriteThroughSlack: 2},
	} {
		if _, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &h}); !kverr.Is(err, kverr.InvalidArgument) {
			t.Fatalf("write_through %d, slack %d: %v, want InvalidArgument", h.WriteThrough, h.WriteThroughSlack, err)
		}
	}
	for _, slack := range []int{0, 1, 8} {
		m, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Pool: pool, WriteThrough: 1, WriteThroughSlack: slack}})
		if err != nil {
			t.Fatalf("slack %d: %v", slack, err)
		}
		must(t, m.Close())
	}
	for _, h := range []HostTier{
		{Pool: pool, WriteThrough: 1, DemoteAhead: 2, WriteThroughSlack: 2},
		{Pool: pool, WriteThrough: 1, DemoteAhead: 5, WriteThroughSlack: 0},
	} {
		m, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &h})
		if err != nil {
			t.Fatalf("demote_ahead %d, slack %d: %v", h.DemoteAhead, h.WriteThroughSlack, err)
		}
		must(t, m.Close())
	}
}
