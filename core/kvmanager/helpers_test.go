package kvmanager

import (
	"cmp"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/internal/redistest"
)

// pickKey returns one of m's keys at random (r's draw over the sorted
// keys, so that a seed replays the same choices).
func pickKey[K cmp.Ordered, V any](r *rand.Rand, m map[K]V) K {
	keys := slices.Sorted(maps.Keys(m))
	return keys[r.IntN(len(keys))]
}

// matchSomeConv queries the tiers' match of one of convs at random, if
// that conversation has begun.
func matchSomeConv(t testing.TB, m *Manager, r *rand.Rand, convs [][]int32) {
	t.Helper()
	if c := r.IntN(len(convs)); len(convs[c]) > 0 {
		tierMatch(t, m, convs[c])
	}
}

// computeAndRemove admits conv as sequence id, runs its step (the
// blocks are written and marked computed) and removes it: its full
// blocks stay cached.
func computeAndRemove(t testing.TB, m *Manager, g *fakeGPU, id int64, conv []int32) {
	t.Helper()
	admit(t, m, id, conv, nil)
	g.step(t, m, id, conv)
	must(t, m.Remove([]int64{id}))
}

// newCachedConv is a tiered manager of 8 blocks of 4 tokens (slots host
// slots, DemoteAhead ahead) whose cache holds a conversation of four full
// blocks and one token, drawn from seed, computed and removed as
// sequence 1. r draws on after the conversation.
func newCachedConv(t testing.TB, slots, ahead int, seed uint64) (*Manager, *fakeGPU, *rand.Rand, []int32) {
	t.Helper()
	m, g := newTierMgr(t, 8, 4, slots, ahead)
	r := rand.New(rand.NewPCG(seed, 23))
	conv := seqTokens(r, 4*4+1)
	computeAndRemove(t, m, g, 1, conv)
	return m, g, r, conv
}

// newDemotedConv is newTierMgr(8 blocks of 4 tokens, 16 host slots,
// DemoteAhead 8) with a conversation of four full blocks and one token,
// drawn from seed, demoted whole to the host tier (demoteAll, sequence 1).
// r draws on after the conversation.
func newDemotedConv(t testing.TB, seed uint64) (*Manager, *fakeGPU, *rand.Rand, []int32) {
	t.Helper()
	m, g := newTierMgr(t, 8, 4, 16, 8)
	r := rand.New(rand.NewPCG(seed, 23))
	conv := seqTokens(r, 4*4+1)
	demoteAll(t, m, g, 1, conv)
	return m, g, r, conv
}

// flushCompleted flushes the manager's copies and, if a batch went out,
// completes it at once (the fake copier copies when it is handed one).
func flushCompleted(t testing.TB, m *Manager) {
	t.Helper()
	tk, _, err := m.FlushCopies()
	must(t, err)
	if tk != 0 {
		must(t, m.CompleteCopies(tk, false))
	}
}

// flushDemotions flushes the manager's copies, wants n of them
// (demotions) and returns the batch's ticket.
func flushDemotions(t testing.TB, m *Manager, n int) uint64 {
	t.Helper()
	ticket, got, err := m.FlushCopies()
	must(t, err)
	if got != n {
		t.Fatalf("%d demotions, want %d", got, n)
	}
	return ticket
}

// newWriteThroughMgr is a manager of numBlocks blocks of bs tokens with a
// host tier of slots 16-byte slots in write-through (wt), whose copier
// accepts every batch; and its host pool.
func newWriteThroughMgr(t testing.TB, numBlocks, bs, slots, wt int) (*Manager, *host.Pool) {
	t.Helper()
	return newWriteThroughMgrCfg(t, numBlocks, bs, slots, HostTier{Copier: nopCopier{}, WriteThrough: wt})
}

// newWriteThroughMgrCfg is newWriteThroughMgr with the host tier's config
// h (its Pool set here).
func newWriteThroughMgrCfg(t testing.TB, numBlocks, bs, slots int, h HostTier) (*Manager, *host.Pool) {
	t.Helper()
	pool, err := host.New(host.Config{Slots: slots, BlockBytes: 16})
	must(t, err)
	h.Pool = pool
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, HostTier: &h})
	must(t, err)
	return m, pool
}

// newStoredConv starts a Valkey or Redis server and stores in its shared
// tier a conversation of four full blocks of 4 tokens and one token,
// drawn from rand.NewPCG(seed1, seed2) (storeConv); r draws on after it.
func newStoredConv(t *testing.T, seed1, seed2 uint64) (*redistest.Server, *rand.Rand, []int32) {
	t.Helper()
	srv := redistest.Start(t, redistest.Find(t), 0)
	r := rand.New(rand.NewPCG(seed1, seed2))
	conv := seqTokens(r, 4*4+1)
	storeConv(t, srv.Addr(), 4, conv)
	return srv, r, conv
}

// newAdmitted is newCached (blocks of 4 tokens) with a prompt of n
// tokens, drawn from rand.NewPCG(seed1, seed2), admitted as sequence 1;
// r draws on after the prompt.
func newAdmitted(t testing.TB, numBlocks int, events bool, seed1, seed2 uint64, n int) (*Manager, *rand.Rand, []int32) {
	t.Helper()
	m := newCached(t, numBlocks, 4, events)
	r := rand.New(rand.NewPCG(seed1, seed2))
	p := seqTokens(r, n)
	admit(t, m, 1, p, nil)
	return m, r, p
}
