package kvmanager

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// newEvictMgr is newTierMgr with HostTier.DemoteEvicted, and KV events
// when events is set.
func newEvictMgr(t testing.TB, numBlocks, bs, slots, ahead int, events bool) (*Manager, *fakeGPU) {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: tierBlockBytes})
	must(t, err)
	g := &fakeGPU{mem: map[int32][]byte{}, pool: p}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: events,
		HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: ahead, DemoteEvicted: true}})
	must(t, err)
	return m, g
}

// evictConv draws the eviction tests' conversation from seed: four full
// blocks of bs tokens and one token more, so that removing it leaves the
// four full blocks cached.
func evictConv(seed uint64, bs int) []int32 {
	return seqTokens(rand.New(rand.NewPCG(seed, 23)), 4*bs+1)
}

// cacheComputed admits conv as sequence id, writes its K/V, runs the
// admission's step (MarkComputed included) and removes the sequence; it
// returns the GPU blocks of conv's full blocks, now cached with their K/V
// written. The step comes before the removal because FlushCopies never
// demotes a block allocated since the previous flush (its K/V is not
// written yet), and Remove drops from the cache the blocks filled since
// the last MarkComputed (computed.go): without it the blocks would be
// dropped rather than demoted.
func cacheComputed(t testing.TB, m *Manager, g *fakeGPU, id int64, conv []int32) []int32 {
	t.Helper()
	admit(t, m, id, conv, nil)
	g.compute(t, m, id, conv)
	_, _, err := m.FlushCopies() // the admission's step
	must(t, err)
	m.MarkComputed() // the step's forward pass ran
	cached := blocksOf(t, m, id, len(conv)/m.BlockSize()+1)[:len(conv)/m.BlockSize()]
	must(t, m.Remove([]int64{id}))
	return cached
}

// evictCached allocates the whole GPU pool to the new sequence id. The
// tests call it with no sequence live, so the allocation takes every free
// block and evicts every cached one, which is what queues the demotions
// of the evicted blocks.
func evictCached(t testing.TB, m *Manager, id int64) {
	t.Helper()
	st := m.Stats()
	must(t, m.Add(id, st.NumBlocks*st.BlockSize))
}

// holdsKV checks that every full block of live sequence id, whose tokens
// are toks, holds its own K/V in the fake GPU memory: whatever blocks the
// allocations took from the cache, no demotion or reload overwrote a live
// block.
func holdsKV(t testing.TB, m *Manager, g *fakeGPU, id int64, toks []int32, where string) {
	t.Helper()
	bs := m.BlockSize()
	tbl := blocksOf(t, m, id, len(toks)/bs+1)
	for j, h := range wholeChain(t, toks, bs, nil) {
		if !bytes.Equal(g.mem[tbl[j]], kvOf(h)) {
			t.Fatalf("%s: sequence %d's block %d (%d) holds the wrong K/V", where, id, j, tbl[j])
		}
	}
}

// An allocation that evicts cached blocks gets them at once and queues
// their demotions; the next FlushCopies hands them out (the fake copies
// them before the step writes the new owner's K/V, as the step's stream
// orders them); completion commits them, and a returning conversation is
// reloaded from the host tier.
func TestTierDemoteEvicted(t *testing.T) {
	const bs = 4
	m, g := newEvictMgr(t, 8, bs, 16, 0, false)
	conv := evictConv(5, bs)
	old := cacheComputed(t, m, g, 1, conv)

	// 4 free and 4 cached: the allocation takes all 8, evicting the 4.
	evictCached(t, m, 2)
	got := blocksOf(t, m, 2, 8)
	for _, b := range old {
		if !slices.Contains(got, b) {
			t.Fatalf("the evicted block %d does not serve the allocation (table %v)", b, got)
		}
	}
	if ts := m.TierStats(); ts.EvictedUndemoted != 0 || ts.InFlight != 4 || ts.DemotionsQueued != 0 {
		t.Fatalf("after the allocation: %+v", ts)
	}
	if st := m.Stats(); st.FreeBlocks != 0 || st.CachedBlocks != 0 {
		t.Fatalf("after the allocation: %+v", st)
	}
	tk, n, err := m.FlushCopies()
	must(t, err)
	b := g.batches[len(g.batches)-1]
	if n != 4 || len(b.Demote) != 4 || len(b.Reload) != 0 {
		t.Fatalf("batch: %d copies, %+v", n, b)
	}
	chain := wholeChain(t, conv, bs, nil)
	for _, op := range b.Demote {
		if !slices.Contains(old, op.Block) || !slices.Contains(chain, op.Hash) {
			t.Fatalf("demotion %+v is not one of the evicted blocks %v", op, old)
		}
	}
	// The step's forward pass writes the new owner's K/V, after the copy.
	for _, blk := range got {
		g.mem[blk] = bytes.Repeat([]byte{0xee}, tierBlockBytes)
	}
	if got := tierMatch(t, m, conv); got.Host != 0 {
		t.Fatalf("a reserved slot is matched before completion: %+v", got)
	}
	must(t, m.CompleteCopies(tk, false))
	for _, h := range chain {
		hostHolds(t, g.pool, h)
	}
	if ts := m.TierStats(); ts.DemotionsCompleted != 4 || ts.InFlight != 0 || ts.EvictedUndemoted != 0 {
		t.Fatalf("after completion: %+v", ts)
	}
	// The block stays its new owner's.
	if st := m.Stats(); st.UsedBlocks != 8 {
		t.Fatalf("completion changed the GPU pool: %+v", st)
	}
	must(t, m.Remove([]int64{2}))
	if got := tierMatch(t, m, conv); got != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("host match: %+v", got)
	}
	matched := []int32{0}
	n2, err := m.Admit([]int64{3}, one(conv, nil), matched)
	must(t, err)
	if n2 != 1 || matched[0] != 4*bs {
		t.Fatalf("admit: %d matched %v", n2, matched)
	}
	tk, _, err = m.FlushCopies()
	must(t, err)
	must(t, m.CompleteCopies(tk, false))
	holdsKV(t, m, g, 3, conv, "reloaded")
}

// A failed batch aborts the allocations' demotions (the host tier holds
// nothing, the GPU blocks stay their owners'); a refused batch too. A
// block allocated since the last flush, evicted again before it, is
// dropped (its K/V is not written yet), and so is one for which every
// host slot is pinned; one the host tier holds already is skipped.
func TestTierDemoteEvictedFailuresAndSkips(t *testing.T) {
	const bs = 4
	for _, refuse := range []bool{false, true} {
		m, g := newEvictMgr(t, 8, bs, 16, 0, false)
		conv := evictConv(6, bs)
		cacheComputed(t, m, g, 1, conv)
		evictCached(t, m, 2)
		if refuse {
			g.fail = errors.New("refused")
			_, _, err := m.FlushCopies()
			if err == nil {
				t.Fatal("a refused batch: no error")
			}
			g.fail = nil
		} else {
			tk, _, err := m.FlushCopies()
			must(t, err)
			must(t, m.CompleteCopies(tk, true))
		}
		ts := m.TierStats()
		if ts.DemotionsFailed != 4 || ts.InFlight != 0 || ts.Host.Resident != 0 || ts.Host.Reserved != 0 {
			t.Fatalf("refuse %v: %+v", refuse, ts)
		}
		if st := m.Stats(); st.UsedBlocks != 8 {
			t.Fatalf("refuse %v: %+v", refuse, st)
		}
		if got := tierMatch(t, m, conv); got.Host != 0 {
			t.Fatalf("refuse %v: failed demotions matched: %+v", refuse, got)
		}
	}

	// Allocated, cached and removed within one step, before its forward
	// pass: dropped. No MarkComputed on purpose, the point is a removal
	// before the forward pass. Before the computed K/V contract the blocks
	// stayed cached until the allocation evicted them undemoted
	// (EvictedUndemoted 4); now Remove drops them from the cache at once
	// (computed.go): they are free, the allocation evicts nothing, and
	// nothing is demoted either way.
	m, _ := newEvictMgr(t, 8, bs, 16, 0, false)
	conv := evictConv(7, bs)
	admit(t, m, 1, conv, nil) // no step before the removal: no flush saw the blocks
	must(t, m.Remove([]int64{1}))
	if st, ps := m.Stats(), m.PrefixStats(); st.CachedBlocks != 0 || st.FreeBlocks != 8 || ps.CachedBlocks != 0 || ps.DroppedPending != 4 {
		t.Fatalf("fresh blocks after the removal: %+v %+v", st, ps)
	}
	evictCached(t, m, 2)
	if ts := m.TierStats(); ts.EvictedUndemoted != 0 || ts.InFlight != 0 || ts.DemotionsQueued != 0 {
		t.Fatalf("fresh blocks: %+v", ts)
	}
	if ps := m.PrefixStats(); ps.Evictions != 0 {
		t.Fatalf("fresh blocks: the allocation evicted %d blocks, want 0", ps.Evictions)
	}
	if tk, n, err := m.FlushCopies(); tk != 0 || n != 0 || err != nil {
		t.Fatalf("fresh blocks: a batch %d %d %v", tk, n, err)
	}

	// Present already: skipped, not counted undemoted.
	m, g := newEvictMgr(t, 8, bs, 16, 0, false)
	cacheComputed(t, m, g, 1, conv)
	evictCached(t, m, 2)
	tk, _, err := m.FlushCopies()
	must(t, err)
	must(t, m.CompleteCopies(tk, false))
	must(t, m.Remove([]int64{2}))
	admit(t, m, 3, conv, nil) // reloads
	tk, _, err = m.FlushCopies()
	must(t, err)
	must(t, m.CompleteCopies(tk, false))
	must(t, m.Remove([]int64{3}))
	evictCached(t, m, 4)
	if ts := m.TierStats(); ts.SkippedPresent != 4 || ts.EvictedUndemoted != 0 || ts.InFlight != 0 {
		t.Fatalf("present: %+v", ts)
	}

	// Every host slot pinned: dropped, counted.
	m, g = newEvictMgr(t, 8, bs, 1, 0, false)
	cacheComputed(t, m, g, 1, conv)
	evictCached(t, m, 2) // one slot: the first reserved, the rest full
	if ts := m.TierStats(); ts.InFlight != 1 || ts.EvictedUndemoted != 3 || ts.SkippedFull != 3 {
		t.Fatalf("host full: %+v", ts)
	}
}

// KV events: the allocation's eviction is the GPU BlockRemoved; the CPU
// BlockStored comes when the demotion commits, never before.
func TestTierDemoteEvictedEvents(t *testing.T) {
	const bs = 4
	m, g := newEvictMgr(t, 8, bs, 16, 0, true)
	conv := evictConv(8, bs)
	cacheComputed(t, m, g, 1, conv)
	drainAll(t, m)
	chain := wholeChain(t, conv, bs, nil)
	evictCached(t, m, 2)
	evs := drainAll(t, m)
	if gone := removedIn(evs, prefix.MediumGPU); len(gone) != 4 || len(cpuStored(evs)) != 0 {
		t.Fatalf("after the allocation: %+v", evs)
	}
	tk, _, err := m.FlushCopies()
	must(t, err)
	if evs := drainAll(t, m); len(cpuStored(evs)) != 0 {
		t.Fatalf("announced in flight: %+v", evs)
	}
	must(t, m.CompleteCopies(tk, false))
	stored := cpuStored(drainAll(t, m))
	if len(stored) != len(chain) || stored[0] != chain[0] || !sameSet(stored, chain) {
		t.Fatalf("CPU stored %v, want %v parents first", stored, chain)
	}
}

// A random model of an engine that follows the ordering rule: each step's
// admissions and allocations, then FlushCopies (the fake copies the batch
// at once), then the step's K/V writes. Every committed host slot holds
// its block's K/V, and every live sequence its own, whatever blocks the
// allocations took from the cache; the per-call invariant checks (race
// builds) watch the counts.
func TestTierDemoteEvictedRandomModel(t *testing.T) {
	for seed := range uint64(6) {
		r := rand.New(rand.NewPCG(seed, 2324))
		const bs = 4
		m, g := newEvictMgr(t, 24, bs, 12+int(seed), int(seed%3), seed%2 == 0)
		convs := make([][]int32, 5)
		live := map[int64][]int32{}
		var id int64
		type write struct {
			b int32
			h prefix.Hash
		}
		var writes []write // the current step's
		inflight := map[uint64]CopyBatch{}
		step := func() {
			tk, _, err := m.FlushCopies()
			must(t, err)
			if tk != 0 {
				inflight[tk] = g.batches[len(g.batches)-1]
			}
			for _, w := range writes {
				g.mem[w.b] = kvOf(w.h)
			}
			writes = writes[:0]
		}
		complete := func(tk uint64) {
			must(t, m.CompleteCopies(tk, false))
			for _, op := range inflight[tk].Demote {
				hostHolds(t, g.pool, op.Hash)
			}
			delete(inflight, tk)
		}
		for range 500 {
			switch op := r.IntN(10); {
			case op < 4:
				c := r.IntN(len(convs))
				p := append(slices.Clone(convs[c]), seqTokens(r, 1+r.IntN(3*bs))...)
				id++
				matched := []int32{0}
				n, err := m.Admit([]int64{id}, one(p, nil), matched)
				must(t, err)
				if n == 0 {
					continue
				}
				tbl := blocksOf(t, m, id, len(p)/bs+1)
				chain := wholeChain(t, p, bs, nil)
				for j := int(matched[0]) / bs; j < len(chain); j++ {
					writes = append(writes, write{tbl[j], chain[j]})
				}
				convs[c] = p
				live[id] = p
				// The forward pass of the admission is enqueued (its
				// writes land at the step, after the step's copies):
				// MarkComputed before any removal, so a removed
				// sequence's blocks stay cached as the model expects
				// (computed.go).
				m.MarkComputed()
			case op < 5 && len(live) > 0:
				k := pickKey(r, live)
				must(t, m.Remove([]int64{k}))
				delete(live, k)
			case op < 6:
				id++
				if err := m.Add(id, 1+r.IntN(6*bs)); err == nil {
					live[id] = nil
				} else {
					wantCode(t, "add", err, kverr.OutOfBlocks)
				}
			case op < 8:
				step()
			case op < 9 && len(inflight) > 0:
				complete(pickKey(r, inflight))
			default:
				matchSomeConv(t, m, r, convs)
			}
		}
		step()
		for tk := range inflight {
			complete(tk)
		}
		for k, p := range live {
			if p == nil {
				continue
			}
			holdsKV(t, m, g, k, p, fmt.Sprintf("seed %d", seed))
		}
		ts := m.TierStats()
		t.Logf("seed %d: %+v", seed, ts)
		if ts.InFlight != 0 || ts.Host.Pinned != 0 || ts.DemotionsCompleted == 0 {
			t.Fatalf("seed %d: %+v", seed, ts)
		}
	}
}

func sameSet(a, b []prefix.Hash) bool {
	for _, h := range a {
		if !slices.Contains(b, h) {
			return false
		}
	}
	return len(a) == len(b)
}
