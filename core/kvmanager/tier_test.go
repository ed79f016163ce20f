package kvmanager

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

const tierBlockBytes = 32

// kvOf is the fake K/V of the block with chained hash h: what an engine
// would have computed into it.
func kvOf(h prefix.Hash) []byte {
	b := make([]byte, tierBlockBytes)
	for i := 0; i < tierBlockBytes; i += 16 {
		copy(b[i:], h[:])
	}
	binary.LittleEndian.PutUint32(b, 0xfeedbeef) // not all hash
	return b
}

// fakeGPU is the GPU pool's memory in tests, and the copier: Copy copies
// each demoted block's bytes into its host slot at once, and records the
// batch; completion is the test's to report.
type fakeGPU struct {
	mu      sync.Mutex
	mem     map[int32][]byte
	pool    *host.Pool
	batches []CopyBatch
	fail    error
}

func (g *fakeGPU) Copy(b CopyBatch) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.fail != nil {
		return g.fail
	}
	for _, op := range b.Demote {
		copy(g.pool.Bytes(op.Slot), g.mem[op.Block])
	}
	for _, op := range b.Reload {
		g.mem[op.Block] = slices.Clone(g.pool.Bytes(op.Slot))
	}
	b.Demote = slices.Clone(b.Demote)
	b.Reload = slices.Clone(b.Reload)
	g.batches = append(g.batches, b)
	return nil
}

// compute writes the K/V of sequence id's full blocks of prompt toks into
// the GPU memory, as the engine's step would.
func (g *fakeGPU) compute(t testing.TB, m *Manager, id int64, toks []int32) {
	t.Helper()
	chain := wholeChain(t, toks, m.BlockSize(), nil)
	tbl := blocksOf(t, m, id, len(toks)/m.BlockSize()+1)
	g.mu.Lock()
	defer g.mu.Unlock()
	for i, h := range chain {
		g.mem[tbl[i]] = kvOf(h)
	}
}

// step models the engine's step after admissions: its FlushCopies
// (completed at once when it hands out a batch), then its forward pass,
// which writes the K/V of sequence id's full blocks (compute), then
// MarkComputed, the engine's word that the forward pass ran.
// FlushCopies never demotes a block allocated since the previous flush
// (its K/V is not written yet), and Remove drops from the cache the
// blocks filled since the last MarkComputed (computed.go), so a test that
// demotes the blocks of a sequence it admitted and removed runs the step
// in between, as an engine would.
func (g *fakeGPU) step(t testing.TB, m *Manager, id int64, toks []int32) {
	t.Helper()
	flushCompleted(t, m)
	g.compute(t, m, id, toks)
	m.MarkComputed()
}

func newTierMgr(t testing.TB, numBlocks, bs, slots, ahead int) (*Manager, *fakeGPU) {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: tierBlockBytes})
	must(t, err)
	g := &fakeGPU{mem: map[int32][]byte{}, pool: p}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true,
		HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: ahead}})
	must(t, err)
	return m, g
}

// hostHolds checks that the host tier holds block hash h with its K/V.
func hostHolds(t testing.TB, p *host.Pool, h prefix.Hash) {
	t.Helper()
	slots := make([]host.Slot, 1)
	n, err := p.PinPrefix([]uint64{HostKey(h)}, slots)
	must(t, err)
	if n != 1 {
		t.Fatalf("host tier does not hold block %s", h)
	}
	defer func() { must(t, p.Unpin(slots[0])) }()
	if !bytes.Equal(p.Bytes(slots[0]), kvOf(h)) {
		t.Fatalf("host slot %d of block %s holds %x, want %x", slots[0], h, p.Bytes(slots[0]), kvOf(h))
	}
}

func tierMatch(t testing.TB, m *Manager, toks []int32) TierMatch {
	t.Helper()
	out := make([]TierMatch, 1)
	must(t, m.MatchTiers(one(toks, nil), out))
	return out[0]
}

// A conversation's cached history, evicted ahead of need by FlushCopies,
// is copied to the host tier (the slots hold the blocks' bytes) and
// matched there beyond the GPU's match once the copies completed.
func TestTierDemotesOnFlushAndMatchesPerTier(t *testing.T) {
	const bs = 4
	m, g := newTierMgr(t, 8, bs, 16, 6)
	r := rand.New(rand.NewPCG(1, 23))
	conv := seqTokens(r, 4*bs+1) // four full blocks and one token
	admit(t, m, 1, conv, nil)
	g.step(t, m, 1, conv)
	tbl := blocksOf(t, m, 1, 8)
	must(t, m.Remove([]int64{1}))
	if st := m.Stats(); st.CachedBlocks != 4 || st.FreeBlocks != 4 {
		t.Fatalf("after remove: %+v", st)
	}
	if got := tierMatch(t, m, conv); got != (TierMatch{GPU: 4 * bs}) {
		t.Fatalf("before demotion: %+v", got)
	}

	ticket, n, err := m.FlushCopies()
	must(t, err)
	if ticket == 0 || n != 2 || len(g.batches) != 1 {
		t.Fatalf("flush: ticket %d, %d copies, %d batches; want 2 copies in one batch", ticket, n, len(g.batches))
	}
	chain := wholeChain(t, conv, bs, nil)
	// The deepest blocks go first (the prefix cache's eviction order).
	want := []DemoteOp{{Block: tbl[3], Hash: chain[3]}, {Block: tbl[2], Hash: chain[2]}}
	for i, op := range g.batches[0].Demote {
		if op.Block != want[i].Block || op.Hash != want[i].Hash {
			t.Fatalf("demotion %d: %+v, want block %d hash %s", i, op, want[i].Block, want[i].Hash)
		}
	}
	st, ts := m.Stats(), m.TierStats()
	if st.FreeBlocks != 4 || st.CachedBlocks != 2 || ts.InFlight != 2 || ts.DemotionsQueued != 2 || ts.Host.Reserved != 2 {
		t.Fatalf("in flight: %+v %+v", st, ts)
	}
	// A second flush while they are in flight has nothing to do.
	if tk, n, err := m.FlushCopies(); err != nil || tk != 0 || n != 0 {
		t.Fatalf("second flush: %d %d %v", tk, n, err)
	}
	// Reserved slots are not matched before completion.
	if got := tierMatch(t, m, conv); got != (TierMatch{GPU: 2 * bs}) {
		t.Fatalf("copies in flight: %+v", got)
	}
	must(t, m.CompleteCopies(ticket, false))
	st, ts = m.Stats(), m.TierStats()
	if st.FreeBlocks != 6 || ts.InFlight != 0 || ts.DemotionsCompleted != 2 || ts.Host.Resident != 2 {
		t.Fatalf("completed: %+v %+v", st, ts)
	}
	hostHolds(t, g.pool, chain[2])
	hostHolds(t, g.pool, chain[3])
	if got := tierMatch(t, m, conv); got != (TierMatch{GPU: 2 * bs, Host: 2 * bs}) {
		t.Fatalf("after demotion: %+v", got)
	}
	// The match never covers the last token: a prompt ending at a block
	// boundary matches one block less.
	if got := tierMatch(t, m, conv[:4*bs]); got != (TierMatch{GPU: 2 * bs, Host: bs}) {
		t.Fatalf("block-aligned prompt: %+v", got)
	}
	ts = m.TierStats()
	if ts.MatchQueries != 4 || ts.MatchHostTokens != 3*bs || ts.MatchGPUTokens != (4+2+2+2)*bs {
		t.Fatalf("match counters: %+v", ts)
	}
	wantCode(t, "complete twice", m.CompleteCopies(ticket, false), kverr.NotFound)
}

// A block whose demotion copy is in flight is neither free nor evictable:
// no allocation gets it, and one that would need it fails with
// OutOfBlocks, changing nothing. Evictions an allocation makes itself are
// not demoted (counted).
func TestTierBlockInFlightIsNotReused(t *testing.T) {
	const bs = 4
	m, g, r, _ := newCachedConv(t, 16, 6, 2)
	ticket := flushDemotions(t, m, 2)
	inFlight := []int32{g.batches[0].Demote[0].Block, g.batches[0].Demote[1].Block}
	// 4 free and 2 evictable: 7 blocks do not fit.
	before, tsBefore, hsBefore := m.Stats(), m.TierStats(), g.pool.Stats()
	wantCode(t, "add 7 blocks", m.Add(2, 7*bs), kverr.OutOfBlocks)
	if n, err := m.Admit([]int64{2}, one(seqTokens(r, 7*bs), nil), nil); n != 0 || err != nil {
		t.Fatalf("admit 7 blocks: %d %v", n, err)
	}
	if m.Stats() != before || m.TierStats() != tsBefore || g.pool.Stats() != hsBefore {
		t.Fatalf("a failed allocation changed the state:\n%+v\n%+v", before, m.Stats())
	}
	// 6 fit, evicting the 2 cached blocks at once, never the in-flight ones.
	must(t, m.Add(2, 6*bs))
	got := blocksOf(t, m, 2, 8)
	for _, b := range inFlight {
		if slices.Contains(got, b) {
			t.Fatalf("sequence got block %d, whose demotion is in flight (table %v)", b, got)
		}
	}
	if ts := m.TierStats(); ts.EvictedUndemoted != 2 || ts.InFlight != 2 {
		t.Fatalf("tier stats: %+v", ts)
	}
	wantCode(t, "add 1 more block", m.Add(3, 1), kverr.OutOfBlocks)
	must(t, m.CompleteCopies(ticket, false))
	must(t, m.Add(3, 2*bs))
	if got := blocksOf(t, m, 3, 4); !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(inFlight))) {
		t.Fatalf("after completion the freed blocks %v serve the allocation, got %v", inFlight, got)
	}
}

// With every host slot pinned the demotion is skipped, counted, and the
// block freed at once; a block the host tier holds already is not copied
// again.
func TestTierHostFullSkipsDemotion(t *testing.T) {
	const bs = 4
	m, g, _, conv := newCachedConv(t, 1, 6, 3)
	ticket := flushDemotions(t, m, 1)
	st, ts := m.Stats(), m.TierStats()
	if st.FreeBlocks != 5 || st.CachedBlocks != 2 || ts.SkippedFull != 1 || ts.Host.SkippedFull != 1 || ts.InFlight != 1 {
		t.Fatalf("host full: %+v %+v", st, ts)
	}
	must(t, m.CompleteCopies(ticket, false))
	chain := wholeChain(t, conv, bs, nil)
	hostHolds(t, g.pool, chain[3])

	// The same history again: recomputed, cached, demoted: its last block
	// is in the host tier already.
	computeAndRemove(t, m, g, 2, conv)
	_, _, err := m.FlushCopies()
	must(t, err)
	if ts := m.TierStats(); ts.SkippedPresent < 1 {
		t.Fatalf("a block already in the host tier was not skipped: %+v", ts)
	}
}

// A copier that refuses a batch, or copies reported failed, leave the
// blocks free and the host slots free, counted as failed.
func TestTierCopyFailures(t *testing.T) {
	const bs = 4
	m, g, _, conv := newCachedConv(t, 16, 6, 4)
	g.fail = kverr.Errorf(kverr.Internal, "stream broken")
	tk, n, err := m.FlushCopies()
	wantCode(t, "refused batch", err, kverr.Internal)
	if tk != 0 || n != 0 {
		t.Fatalf("refused batch: ticket %d, %d copies", tk, n)
	}
	st, ts := m.Stats(), m.TierStats()
	if st.FreeBlocks != 6 || ts.DemotionsFailed != 2 || ts.InFlight != 0 || ts.Host.Reserved != 0 || ts.Host.Aborts != 2 {
		t.Fatalf("after a refused batch: %+v %+v", st, ts)
	}
	g.fail = nil
	// Evict the rest ahead of need: the two blocks left, reported failed.
	m2, g2 := newTierMgr(t, 8, bs, 16, 8)
	computeAndRemove(t, m2, g2, 1, conv)
	tk = flushDemotions(t, m2, 4)
	wantCode(t, "unknown ticket", m2.CompleteCopies(tk+1, false), kverr.NotFound)
	must(t, m2.CompleteCopies(tk, true))
	st, ts = m2.Stats(), m2.TierStats()
	if st.FreeBlocks != 8 || ts.DemotionsFailed != 4 || ts.Host.Resident != 0 || ts.Host.Reserved != 0 {
		t.Fatalf("after failed copies: %+v %+v", st, ts)
	}
	if got := tierMatch(t, m2, conv); got != (TierMatch{}) {
		t.Fatalf("failed copies matched: %+v", got)
	}
}

func TestTierConfigAndNoTier(t *testing.T) {
	p, err := host.New(host.Config{Slots: 4, BlockBytes: 8})
	must(t, err)
	g := &fakeGPU{pool: p}
	for name, cfg := range map[string]Config{
		"no prefix cache": {NumBlocks: 8, BlockSize: 4, HostTier: &HostTier{Pool: p, Copier: g}},
		"no pool":         {NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Copier: g}},
		"ahead < 0":       {NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: -1}},
		"ahead > pool":    {NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: 9}},
	} {
		_, err := New(cfg)
		wantCode(t, name, err, kverr.InvalidArgument)
	}
	m := newCached(t, 8, 4, false)
	_, _, err = m.FlushCopies()
	wantCode(t, "flush without tier", err, kverr.InvalidArgument)
	wantCode(t, "complete without tier", m.CompleteCopies(1, false), kverr.InvalidArgument)
	r := rand.New(rand.NewPCG(5, 23))
	conv := seqTokens(r, 13)
	admit(t, m, 1, conv, nil)
	if got := tierMatch(t, m, conv); got != (TierMatch{GPU: 12}) {
		t.Fatalf("no tier: %+v", got)
	}
	if m.TierStats() != (TierStats{}) {
		t.Fatalf("no tier: stats %+v", m.TierStats())
	}
	wantCode(t, "short out", m.MatchTiers(one(conv, nil), nil), kverr.InvalidArgument)
	// DemoteAhead 0: the tier is matched, nothing is demoted.
	m0, _ := newTierMgr(t, 8, 4, 4, 0)
	if tk, n, err := m0.FlushCopies(); tk != 0 || n != 0 || err != nil {
		t.Fatalf("ahead 0: %d %d %v", tk, n, err)
	}
}

// demoteAll admits conv as sequence id, computes it, removes it and
// demotes every cached block (DemoteAhead is the pool size), completing
// the copies.
func demoteAll(t testing.TB, m *Manager, g *fakeGPU, id int64, conv []int32) {
	t.Helper()
	computeAndRemove(t, m, g, id, conv)
	flushCompleted(t, m)
	if st := m.Stats(); st.CachedBlocks != 0 {
		t.Fatalf("not all demoted: %+v", st)
	}
}

// A conversation that returns after its history left the GPU pool matches
// the history in the host tier: admission allocates GPU blocks for it and
// queues their reloads (right slots, right blocks, in order) in the next
// batch; the blocks hold the history's K/V once the batch completed, and
// the host slots are unpinned then.
func TestTierReloadsAReturningConversation(t *testing.T) {
	const bs = 4
	m, g, r, conv := newDemotedConv(t, 6)
	turn2 := append(slices.Clone(conv), seqTokens(r, 2*bs)...) // 6 full blocks, one token
	if got := tierMatch(t, m, turn2); got != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("match: %+v", got)
	}
	if got := admit(t, m, 2, turn2, nil); got != 4*bs {
		t.Fatalf("admit matched %d tokens, want %d", got, 4*bs)
	}
	tbl := blocksOf(t, m, 2, 8)
	if _, slots := describeSlots(t, m, 2); len(slots) != len(turn2)-4*bs || slots[0] != tbl[4]*bs {
		t.Fatalf("new tokens' slots %v: want them from block %d", slots, tbl[4])
	}
	ts := m.TierStats()
	if ts.Reloads != 4 || ts.HostHitTokens != 4*bs || ts.Host.Pinned != 4 {
		t.Fatalf("after admit: %+v", ts)
	}
	tk, n, err := m.FlushCopies()
	must(t, err)
	if n != 4 || len(g.batches) != 2 {
		t.Fatalf("flush: %d copies, %d batches", n, len(g.batches))
	}
	b := g.batches[1]
	chain := wholeChain(t, turn2, bs, nil)
	if len(b.Demote) != 0 || len(b.Reload) != 4 {
		t.Fatalf("batch %+v", b)
	}
	for j, op := range b.Reload {
		if key, ok := g.pool.Hash(op.Slot); !ok || key != HostKey(chain[j]) || op.Block != tbl[j] {
			t.Fatalf("reload %d: %+v (slot holds %x), want block %d from the slot of %s", j, op, key, tbl[j], chain[j])
		}
	}
	must(t, m.CompleteCopies(tk, false))
	ts = m.TierStats()
	if ts.ReloadsCompleted != 4 || ts.Host.Pinned != 0 || ts.Host.Resident != 4 {
		t.Fatalf("after completion: %+v", ts)
	}
	for j := range 4 {
		if !bytes.Equal(g.mem[tbl[j]], kvOf(chain[j])) {
			t.Fatalf("block %d holds %x after the reload, want %x", tbl[j], g.mem[tbl[j]], kvOf(chain[j]))
		}
	}
	// The reloaded blocks are in the GPU prefix cache: a third prompt
	// shares them (and the two blocks the second one computed).
	if got := admit(t, m, 3, turn2, nil); got != 6*bs {
		t.Fatalf("third prompt matched %d tokens, want %d", got, 6*bs)
	}
	if got := blocksOf(t, m, 3, 8); !slices.Equal(got[:6], tbl[:6]) {
		t.Fatalf("third prompt's table %v, second's %v", got, tbl)
	}
}

// A reload's blocks stay held by the copy until it completes, even when
// their sequence is removed first: no allocation gets them and nothing
// evicts them.
func TestTierReloadHoldsBlocksUntilComplete(t *testing.T) {
	const bs = 4
	m, _, _, conv := newDemotedConv(t, 7)
	admit(t, m, 2, conv, nil)
	reloaded := blocksOf(t, m, 2, 8)[:4]
	must(t, m.Remove([]int64{2}))
	// 8 blocks: 4 held by the pending reload; the rest are free.
	wantCode(t, "add 5 blocks", m.Add(3, 5*bs), kverr.OutOfBlocks)
	tk, _, err := m.FlushCopies()
	must(t, err)
	wantCode(t, "add 5 blocks in flight", m.Add(3, 5*bs), kverr.OutOfBlocks)
	must(t, m.Add(3, 4*bs))
	for _, b := range blocksOf(t, m, 3, 8) {
		if slices.Contains(reloaded, b) {
			t.Fatalf("block %d, being reloaded, was allocated", b)
		}
	}
	must(t, m.CompleteCopies(tk, false))
	if st := m.Stats(); st.CachedBlocks != 4 {
		t.Fatalf("reloaded blocks not cached after completion: %+v", st)
	}
}

// An admission that does not fit changes nothing: no host pin, no host
// LRU touch or hit counted, no reload queued.
func TestTierAdmitThatDoesNotFitChangesNothing(t *testing.T) {
	const bs = 4
	m, g, _, conv := newDemotedConv(t, 8)
	must(t, m.Add(9, 4*bs)) // 4 of 8 blocks left, conv needs 5
	st, ts, hs := m.Stats(), m.TierStats(), g.pool.Stats()
	if n, err := m.Admit([]int64{2}, one(conv, nil), nil); n != 0 || err != nil {
		t.Fatalf("admit: %d %v", n, err)
	}
	if m.Stats() != st || m.TierStats() != ts || g.pool.Stats() != hs {
		t.Fatalf("a refused admission changed the state:\n%+v %+v\n%+v %+v", st, ts, m.Stats(), m.TierStats())
	}
	if tk, n, err := m.FlushCopies(); tk != 0 || n != 0 || err != nil {
		t.Fatalf("flush after a refused admission: %d %d %v", tk, n, err)
	}
}

// A copier that refuses a batch with reloads unpins their slots and
// drops the copies' holds on the blocks.
func TestTierRefusedReloadReleasesPins(t *testing.T) {
	const bs = 4
	m, g, _, conv := newDemotedConv(t, 9)
	admit(t, m, 2, conv, nil)
	g.fail = kverr.Errorf(kverr.Internal, "stream broken")
	_, _, err := m.FlushCopies()
	wantCode(t, "refused", err, kverr.Internal)
	ts := m.TierStats()
	if ts.ReloadsFailed != 4 || ts.Host.Pinned != 0 {
		t.Fatalf("after a refused reload: %+v", ts)
	}
	must(t, m.Remove([]int64{2}))
	check(t, m)
}

// A random model: conversations come back turn after turn, sequences are
// removed, unrelated sequences press on the pool, batches are flushed and
// completed in any order. The per-call invariants hold (-race builds);
// no allocation gets a block being demoted; each completed demotion's
// slot holds its block's K/V and each completed reload's block its
// slot's; and at the end every live sequence's full blocks hold the K/V
// of their chained hashes, whether computed, shared or reloaded.
func TestTierRandomModel(t *testing.T) {
	for seed := range uint64(6) {
		r := rand.New(rand.NewPCG(seed, 2323))
		const bs = 4
		m, g := newTierMgr(t, 24, bs, 12+int(seed), 4+int(seed))
		convs := make([][]int32, 5)
		live := map[int64][]int32{} // id -> prompt (nil: added without tokens)
		var id int64
		inflight := map[uint64]CopyBatch{}
		demoting := map[int32]bool{}
		complete := func(tk uint64) {
			must(t, m.CompleteCopies(tk, false))
			b := inflight[tk]
			delete(inflight, tk)
			for _, op := range b.Demote {
				delete(demoting, op.Block)
				hostHolds(t, g.pool, op.Hash)
			}
			for _, op := range b.Reload {
				key := binary.BigEndian.Uint64(g.mem[op.Block][16:24])
				if k, ok := g.pool.Hash(op.Slot); !ok || k != key {
					t.Fatalf("seed %d: reloaded block %d holds key %x, its slot %d %x", seed, op.Block, key, op.Slot, k)
				}
			}
		}
		for step := range 400 {
			switch op := r.IntN(10); {
			case op < 4: // a conversation's next turn
				c := r.IntN(len(convs))
				p := append(slices.Clone(convs[c]), seqTokens(r, 1+r.IntN(3*bs))...)
				id++
				matched := []int32{0}
				n, err := m.Admit([]int64{id}, one(p, nil), matched)
				if (len(p)+bs-1)/bs > 24 { // longer than the whole pool: refused, never admitted
					if !kverr.Is(err, kverr.InvalidArgument) {
						t.Fatalf("seed %d step %d: a %d-token prompt over a 24-block pool: %v", seed, step, len(p), err)
					}
					convs[c] = nil // the conversation starts over
					continue
				}
				must(t, err)
				if n == 0 {
					continue
				}
				tbl := blocksOf(t, m, id, len(p)/bs+1)
				for _, b := range tbl {
					if demoting[b] {
						t.Fatalf("seed %d step %d: sequence %d got block %d, being demoted", seed, step, id, b)
					}
				}
				chain := wholeChain(t, p, bs, nil)
				for j := int(matched[0]) / bs; j < len(chain); j++ {
					g.mem[tbl[j]] = kvOf(chain[j])
				}
				// The K/V writes above are the admission's forward pass:
				// MarkComputed before any removal, so a removed
				// sequence's blocks stay cached as the model expects
				// (computed.go).
				m.MarkComputed()
				convs[c] = p
				live[id] = p
			case op < 6 && len(live) > 0: // a sequence finishes
				k := pickKey(r, live)
				must(t, m.Remove([]int64{k}))
				delete(live, k)
			case op < 7: // pressure
				id++
				if err := m.Add(id, 1+r.IntN(6*bs)); err == nil {
					for _, b := range blocksOf(t, m, id, 8) {
						if demoting[b] {
							t.Fatalf("seed %d step %d: added sequence got block %d, being demoted", seed, step, b)
						}
					}
					live[id] = nil
				} else {
					wantCode(t, "add", err, kverr.OutOfBlocks)
				}
			case op < 8: // the step's copies
				tk, _, err := m.FlushCopies()
				must(t, err)
				if tk != 0 {
					b := g.batches[len(g.batches)-1]
					inflight[tk] = b
					for _, op := range b.Demote {
						demoting[op.Block] = true
					}
				}
			case op < 9 && len(inflight) > 0: // a batch completes
				complete(pickKey(r, inflight))
			default:
				matchSomeConv(t, m, r, convs)
			}
		}
		tk, _, err := m.FlushCopies()
		must(t, err)
		if tk != 0 {
			inflight[tk] = g.batches[len(g.batches)-1]
		}
		for tk := range inflight {
			complete(tk)
		}
		for k, p := range live {
			if p == nil {
				continue
			}
			tbl := blocksOf(t, m, k, len(p)/bs+1)
			for j, h := range wholeChain(t, p, bs, nil) {
				if !bytes.Equal(g.mem[tbl[j]], kvOf(h)) {
					t.Fatalf("seed %d: sequence %d's block %d (%d) holds the wrong K/V", seed, k, j, tbl[j])
				}
			}
		}
		ts := m.TierStats()
		t.Logf("seed %d: %+v", seed, ts)
		if ts.InFlight != 0 || ts.Host.Pinned != 0 {
			t.Fatalf("seed %d: left in flight: %+v", seed, ts)
		}
	}
}

// Completion reported from another goroutine (an engine's event poller)
// while the scheduler admits, removes and flushes: the race detector and
// the per-call invariant checks watch it.
func TestTierConcurrentCompletion(t *testing.T) {
	const bs = 4
	m, _ := newTierMgr(t, 32, bs, 24, 12)
	tickets := make(chan uint64, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for tk := range tickets {
			if err := m.CompleteCopies(tk, false); err != nil {
				t.Error(err)
			}
			_ = m.TierStats()
		}
	}()
	r := rand.New(rand.NewPCG(10, 23))
	convs := make([][]int32, 4)
	for i := range 300 {
		c := i % len(convs)
		p := append(slices.Clone(convs[c]), seqTokens(r, 1+r.IntN(2*bs))...)
		if len(p) > 20*bs {
			p = seqTokens(r, 1+r.IntN(2*bs))
		}
		id := int64(i + 1)
		if n, err := m.Admit([]int64{id}, one(p, nil), nil); err != nil {
			t.Fatal(err)
		} else if n == 1 {
			convs[c] = p
			// The step's forward pass, before the sequence finishes: its
			// blocks stay cached and are demoted (computed.go).
			m.MarkComputed()
			must(t, m.Remove([]int64{id}))
		}
		tk, _, err := m.FlushCopies()
		must(t, err)
		if tk != 0 {
			tickets <- tk
		}
	}
	close(tickets)
	<-done
	check(t, m)
	if ts := m.TierStats(); ts.InFlight != 0 || ts.Host.Pinned != 0 || ts.DemotionsQueued == 0 {
		t.Fatalf("after the run: %+v", ts)
	}
}

// An engine that drives its own copies (no copier) gets each batch from
// FlushCopiesTo: arrays too short fail with BufferTooSmall and the sizes
// needed, changing nothing; FlushCopies refuses. The batch's ops are the
// ones a copier would have got, and CompleteCopies ends them.
func TestTierFlushCopiesTo(t *testing.T) {
	const bs = 4
	p, err := host.New(host.Config{Slots: 16, BlockBytes: tierBlockBytes})
	must(t, err)
	m, err := New(Config{NumBlocks: 8, BlockSize: bs, EnablePrefixCache: true,
		HostTier: &HostTier{Pool: p, DemoteAhead: 6}})
	must(t, err)
	g := &fakeGPU{mem: map[int32][]byte{}, pool: p}
	r := rand.New(rand.NewPCG(7, 23))
	conv := seqTokens(r, 4*bs+1)
	admit(t, m, 1, conv, nil)
	// The step: its flush (nothing to copy), then its forward pass and
	// MarkComputed, so the blocks stay cached after the removal.
	if tk, _, _, _, _, err := m.FlushCopiesTo(make([]DemoteOp, 6), nil); err != nil || tk != 0 {
		t.Fatalf("the step's flush: ticket %d, %v", tk, err)
	}
	g.compute(t, m, 1, conv)
	m.MarkComputed()
	tbl := blocksOf(t, m, 1, 8)
	must(t, m.Remove([]int64{1}))
	_, _, err = m.FlushCopies()
	wantCode(t, "flush without copier", err, kverr.InvalidArgument)

	before, tsBefore := m.Stats(), m.TierStats()
	_, _, _, nd, nr, err := m.FlushCopiesTo(make([]DemoteOp, 1), nil)
	wantCode(t, "short demote", err, kverr.BufferTooSmall)
	if nd != 2 || nr != 0 || m.Stats() != before || m.TierStats() != tsBefore {
		t.Fatalf("short: need %d %d; %+v %+v", nd, nr, m.Stats(), m.TierStats())
	}
	demote := make([]DemoteOp, 6)
	tk, nd, nr, _, _, err := m.FlushCopiesTo(demote, nil)
	must(t, err)
	chain := wholeChain(t, conv, bs, nil)
	if tk == 0 || nd != 2 || nr != 0 || demote[0].Block != tbl[3] || demote[0].Hash != chain[3] || demote[1].Block != tbl[2] {
		t.Fatalf("flush: ticket %d, %d %d, %+v", tk, nd, nr, demote[:nd])
	}
	for _, op := range demote[:nd] {
		copy(p.Bytes(op.Slot), g.mem[op.Block])
	}
	must(t, m.CompleteCopies(tk, false))
	hostHolds(t, p, chain[2])
	hostHolds(t, p, chain[3])
	must(t, m.CheckInvariants())
}

// A block cached at admission whose sequence is removed before the
// step's forward pass holds no K/V, and the host tier would serve
// whatever it held: it is never demoted. Under the computed K/V contract
// (computed.go) such a block leaves the cache at the removal itself, as
// no MarkComputed came after its admission: it is free at once, and the
// flush neither demotes it nor evicts it. A block computed before
// (its step ran, MarkComputed included) stays cached and is demoted.
// (Without DemoteEvicted; FlushCopies also never demotes a block
// allocated since the previous flush.)
func TestTierFlushSkipsUnwrittenBlocks(t *testing.T) {
	const bs = 4
	m, g := newTierMgr(t, 8, bs, 16, 8)
	r := rand.New(rand.NewPCG(8, 23))
	a := seqTokens(r, 2*bs+1)
	admit(t, m, 1, a, nil)
	g.step(t, m, 1, a) // A's blocks are written, and marked computed
	b := seqTokens(r, 2*bs+1)
	admit(t, m, 2, b, nil)
	// B's before its step: no MarkComputed on purpose, the point of the
	// test is a removal before the forward pass.
	must(t, m.Remove([]int64{1, 2}))
	// Before the contract B's 2 blocks stayed cached until the flush
	// evicted them undemoted (4 cached). Now Remove drops them: only A's 2
	// stay cached, and B's 2 are free with A's and B's partial blocks.
	if st, ps := m.Stats(), m.PrefixStats(); st.CachedBlocks != 2 || st.FreeBlocks != 6 || ps.CachedBlocks != 2 || ps.DroppedPending != 2 {
		t.Fatalf("after remove: %+v %+v", st, ps)
	}
	tk, n, err := m.FlushCopies()
	must(t, err)
	chainA := wholeChain(t, a, bs, nil)
	if tk == 0 || n != 2 || len(g.batches[len(g.batches)-1].Demote) != 2 {
		t.Fatalf("flush: ticket %d, %d copies; want A's 2 demotions", tk, n)
	}
	for _, op := range g.batches[len(g.batches)-1].Demote {
		if !slices.Contains(chainA, op.Hash) {
			t.Fatalf("demoted %s, not one of A's blocks", op.Hash)
		}
	}
	must(t, m.CompleteCopies(tk, false))
	st, ts := m.Stats(), m.TierStats()
	if st.CachedBlocks != 0 || st.FreeBlocks != 8 || ts.DemotionsCompleted != 2 || ts.Host.Resident != 2 || ts.Host.Demotions != 2 {
		t.Fatalf("after the flush: %+v %+v", st, ts)
	}
	if got := tierMatch(t, m, b); got != (TierMatch{}) {
		t.Fatalf("B's unwritten blocks matched: %+v", got)
	}
	if got := tierMatch(t, m, a); got != (TierMatch{Host: 2 * bs}) {
		t.Fatalf("A's match: %+v", got)
	}
	check(t, m)
}
