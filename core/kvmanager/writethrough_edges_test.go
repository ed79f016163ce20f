package kvmanager

import (
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kvtier/host"
)

// A write-through store in flight on a reloaded block (computed at its
// admission) whose GPU parent is still uncomputed: removing the step's
// sequences before MarkComputed drops the parent with the stored block
// below it, lock and all. The store then completes on a private block,
// its host slot committed (the K/V copied is its hash's), and the block
// returns to the pool; every invariant holds throughout.
func TestStoreOfDroppedReload(t *testing.T) {
	const bs = 4
	rec := &stepRecorder{}
	m, pool := newWriteThroughMgrCfg(t, 8, bs, 2, HostTier{Copier: rec, WriteThrough: 1})
	pB := slices.Concat(iota32(0, bs), iota32(100, bs), []int32{7})
	chainB := wholeChain(t, pB, bs, nil)
	// The host tier holds B's second block (x) but not its first (p).
	admit(t, m, 1, pB, nil)
	flushCompleted(t, m)
	m.MarkComputed()
	must(t, m.Remove([]int64{1}))
	flushCompleted(t, m) // stores p
	flushCompleted(t, m) // stores x
	admit(t, m, 2, slices.Concat(iota32(200, bs), []int32{7}), nil)
	flushCompleted(t, m)
	m.MarkComputed()
	must(t, m.Remove([]int64{2}))
	flushCompleted(t, m) // stores z, evicting p from the host
	if pool.Peek([]uint64{HostKey(chainB[0])}) != 0 || pool.Peek([]uint64{HostKey(chainB[1])}) != 1 {
		t.Fatal("set-up: the host tier should hold x and not p")
	}
	// A sequence over the whole pool evicts p, x and z from the GPU; its
	// seven full blocks are computed and queued for their stores.
	admit(t, m, 3, iota32(1000, 7*bs+1), nil)
	m.MarkComputed()
	must(t, m.Remove([]int64{3}))
	// The step: sequence 10 computes p (pending); 11 matches p on the GPU
	// and reloads x into a block whose id has a queued entry.
	admit(t, m, 10, slices.Concat(iota32(0, bs), []int32{7}), nil)
	if got := admit(t, m, 11, pB, nil); got != 2*bs {
		t.Fatalf("matched %d tokens, want p on the GPU and x from the host", got)
	}
	b := blocksOf(t, m, 11, 3)[1]
	// The step is abandoned (no forward pass, no MarkComputed) while the
	// engine goes on flushing, until the reloaded block's store is in flight.
	var tk uint64
	for {
		var err error
		tk, _, err = m.FlushCopies()
		must(t, err)
		if tk == 0 {
			t.Fatal("the reloaded block was never stored")
		}
		if rec.stored[len(rec.stored)-1] == b {
			break
		}
		must(t, m.CompleteCopies(tk, false))
	}
	mustCheck(t, m)
	must(t, m.Remove([]int64{10, 11})) // preempted before their forward pass: p and x's block dropped
	mustCheck(t, m)
	stored := m.TierStats().WriteThroughStored
	must(t, m.CompleteCopies(tk, false))
	mustCheck(t, m)
	if got := m.TierStats().WriteThroughStored; got != stored+1 {
		t.Fatalf("write-through stored %d, want %d: the store of the dropped block completes", got, stored+1)
	}
	if pool.Peek([]uint64{HostKey(chainB[1])}) != 1 {
		t.Fatal("the host tier does not hold x after its store")
	}
	if st := m.Stats(); st.UsedBlocks != 0 {
		t.Fatalf("%d blocks in use after every sequence went and every copy completed", st.UsedBlocks)
	}
}

// A failed store is a write-through block lost, not a failed demotion:
// DemotionsFailed never passes DemotionsQueued, and every queued block is
// in a write-through counter.
func TestFailedStoreCountsLost(t *testing.T) {
	m, _ := newWriteThroughMgr(t, 8, 4, 16, 4)
	admit(t, m, 1, iota32(0, 9), nil) // two full blocks
	flushCompleted(t, m)
	m.MarkComputed()
	must(t, m.Remove([]int64{1}))
	tk, n, err := m.FlushCopies()
	must(t, err)
	if n != 2 {
		t.Fatalf("%d copies, want the 2 stores", n)
	}
	must(t, m.CompleteCopies(tk, true))
	st := m.TierStats()
	if st.DemotionsFailed != 0 || st.DemotionsQueued != 0 {
		t.Fatalf("demotions queued %d, failed %d: stores are not demotions", st.DemotionsQueued, st.DemotionsFailed)
	}
	if st.WriteThroughStored != 0 || st.WriteThroughLost != 2 {
		t.Fatalf("write-through stored %d, lost %d; want 0 and 2", st.WriteThroughStored, st.WriteThroughLost)
	}
	mustCheck(t, m)
}

// With DemoteEvicted beside write-through, a queued block that an
// allocation evicts is demoted: the host tier holds it, and it is not
// counted lost.
func TestDemotedQueuedBlockNotLost(t *testing.T) {
	const bs = 4
	m, pool := newWriteThroughMgrCfg(t, 8, bs, 16, HostTier{Copier: nopCopier{}, WriteThrough: 8, DemoteEvicted: true})
	p := iota32(0, 2*bs+1)
	admit(t, m, 1, p, nil)
	flushCompleted(t, m)
	m.MarkComputed() // both full blocks queued
	must(t, m.Remove([]int64{1}))
	must(t, m.Add(9, 8*bs)) // evicts both, which DemoteEvicted demotes
	flushCompleted(t, m)
	hc := wholeChain(t, p, bs, nil)
	if held := pool.Peek([]uint64{HostKey(hc[0]), HostKey(hc[1])}); held != 2 {
		t.Fatalf("the host tier holds %d of the 2 demoted blocks", held)
	}
	if st := m.TierStats(); st.WriteThroughLost != 0 || st.DemotionsCompleted != 2 {
		t.Fatalf("lost %d, demotions completed %d; want 0 and 2", st.WriteThroughLost, st.DemotionsCompleted)
	}
	mustCheck(t, m)
}

// Write-through stores are announced parents first (CPU BlockStored), as
// demotions are.
func TestWriteThroughEventsParentsFirst(t *testing.T) {
	const bs = 4
	pool, err := host.New(host.Config{Slots: 16, BlockBytes: 16})
	must(t, err)
	m, err := New(Config{NumBlocks: 8, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true,
		HostTier: &HostTier{Pool: pool, Copier: nopCopier{}, WriteThrough: 8}})
	must(t, err)
	p := iota32(0, 3*bs+1)
	admit(t, m, 1, p, nil)
	flushCompleted(t, m)
	m.MarkComputed()
	drainAll(t, m)
	flushCompleted(t, m)
	got, want := cpuStored(drainAll(t, m)), wholeChain(t, p, bs, nil)
	if !slices.Equal(got, want) {
		t.Fatalf("CPU BlockStored order %v, want parents first %v", got, want)
	}
}
