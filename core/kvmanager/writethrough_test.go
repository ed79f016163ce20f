package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// nopCopier accepts every batch; the tests complete the batches
// themselves. (The K/V bytes are the slot model's concern, below.)
type nopCopier struct{}

func (nopCopier) Copy(CopyBatch) error { return nil }

// With write-through, the GPU prefix cache behaves exactly as with no tier:
// two managers driven by the same conversations (one with a host tier in
// write-through, one without) match the same GPU tokens at every
// admission, while the tier turns some of the GPU's misses into host hits.
func TestWriteThroughNeverCostsAGPUHit(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			const bs, blocks = 4, 48
			r := rand.New(rand.NewPCG(seed, 31))
			plain, err := New(Config{NumBlocks: blocks, BlockSize: bs, EnablePrefixCache: true})
			must(t, err)
			tiered, _ := newWriteThroughMgr(t, blocks, bs, 4*blocks, 1+int(seed)*4)
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
				tk, _, err := tiered.FlushCopies()
				must(t, err)
				if tk != 0 {
					must(t, tiered.CompleteCopies(tk, false))
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
			if gpuHits == 0 || hostHits == 0 || st.WriteThroughStored == 0 || st.Reloads == 0 || st.DemotionsQueued != 0 {
				t.Fatalf("the walk missed a path: GPU hits %d, host hits %d, stats %+v", gpuHits, hostHits, st)
			}
		})
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
