package kvmanager

import (
	"encoding/hex"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// newSharedEventsMgr is newSharedMgr with KV events on.
func newSharedEventsMgr(t testing.TB, addr string, numBlocks, bs, slots, ahead int) (*Manager, *fakeGPU) {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: tierBlockBytes})
	must(t, err)
	g := &fakeGPU{mem: map[int32][]byte{}, pool: p}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true,
		HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: ahead,
			Shared: &SharedTier{Addr: addr, Namespace: sharedNS, OpTimeout: 2 * time.Second, Backoff: time.Hour}}})
	must(t, err)
	t.Cleanup(func() { m.Close() })
	return m, g
}

// storeKeyed has a fresh manager (no events) admit conv under keys, run
// its step (a flush, then the forward pass writes the blocks and
// MarkComputed), demote its blocks and store them in the shared tier at
// addr.
func storeKeyed(t *testing.T, addr string, bs int, conv []int32, keys *prefix.Keys) {
	t.Helper()
	m, g := newSharedMgr(t, addr, 8, bs, 16, 8, func(c *SharedTier) { c.OpTimeout = 2 * time.Second })
	admit(t, m, 1, conv, keys)
	flushAndComplete(t, m, g, false)
	m.MarkComputed() // the forward pass ran: the blocks stay cached after the removal
	must(t, m.Remove([]int64{1}))
	flushAndComplete(t, m, g, false)
	must(t, m.Close())
	if full := int64((len(conv) - 1) / bs); m.TierStats().Shared.PutsDone != full {
		t.Fatalf("stores: %+v", m.TierStats().Shared)
	}
}

// wantCPUStored checks that evs's CPU BlockStored events are the blocks
// of conv (under keys) from block from on, in order, described as the
// GPU would describe them.
func wantCPUStored(t *testing.T, evs []prefix.Event, conv []int32, bs int, keys *prefix.Keys, from int) {
	t.Helper()
	chain := wholeChain(t, conv, bs, keys)
	var got []prefix.Event
	for _, ev := range evs {
		if ev.Kind == prefix.BlockStored && ev.Medium == prefix.MediumCPU {
			got = append(got, ev)
		}
	}
	n := (len(conv)-1)/bs - from
	if len(got) != n {
		t.Fatalf("%d CPU BlockStored, want %d: %+v", len(got), n, evs)
	}
	for i, ev := range got {
		b := from + i
		var parent prefix.Hash
		if b > 0 {
			parent = chain[b-1]
		}
		var mm []prefix.BlockMM
		var adapter uint64
		if keys != nil {
			mm = keys.AppendBlockMM(nil, b, bs)
			adapter = keys.Adapter
		}
		if ev.Hash != chain[b] || ev.Parent != parent || !slices.Equal(ev.Tokens, conv[b*bs:(b+1)*bs]) ||
			ev.BlockSize != bs || ev.Adapter != adapter || !slices.Equal(ev.MM, mm) {
			t.Fatalf("CPU BlockStored of block %d: %+v", b, ev)
		}
	}
}

// Blocks that manager A stored are fetched by B (events on) through
// MatchTiers and by C (events on) through Admit: each announces them as
// CPU BlockStored, with the hashes, parents, tokens and keys of their
// GPU BlockStored; the GPU's come at admission. Snapshots list them.
func TestSharedTierEventsFetch(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(11, 77))
	conv := seqTokens(r, 4*bs+1)
	keys := &prefix.Keys{Adapter: 3, MM: []prefix.MMItem{{Offset: 2, Length: 5, Hash: prefix.Hash{7}}}, Salt: []byte("tenant")}
	storeKeyed(t, srv.Addr(), bs, conv, keys)

	b, _ := newSharedEventsMgr(t, srv.Addr(), 8, bs, 16, 4)
	out := make([]TierMatch, 1)
	must(t, b.MatchTiers(one(conv, keys), out))
	if out[0] != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("B's match: %+v", out[0])
	}
	evs := drainAll(t, b)
	if len(evs) != 4 {
		t.Fatalf("B's events after the match: %+v", evs)
	}
	wantCPUStored(t, evs, conv, bs, keys, 0)
	truth := prefix.NewEventIndex()
	applyEvents(t, truth, evs)
	sameTiers(t, b, truth, nil)
	// A snapshot lists them.
	must(t, b.RequestEventSnapshot())
	evs = drainAll(t, b)
	if len(evs) != 5 || evs[0].Kind != prefix.AllCleared {
		t.Fatalf("B's snapshot: %+v", evs)
	}
	if !sameSet(cpuStored(evs), wholeChain(t, conv, bs, keys)[:4]) {
		t.Fatalf("B's snapshot lists %v", cpuStored(evs))
	}
	check(t, b)

	// C admits straight away: the fetch's CPU events, then the
	// admission's GPU events for the same blocks (and the last one's).
	c, gc := newSharedEventsMgr(t, srv.Addr(), 8, bs, 16, 4)
	if got := admit(t, c, 1, conv, keys); got != 4*bs {
		t.Fatalf("C matched %d tokens", got)
	}
	evs = drainAll(t, c)
	if len(evs) != 8 {
		t.Fatalf("C's events: %+v", evs)
	}
	wantCPUStored(t, evs[:4], conv, bs, keys, 0)
	for i, ev := range evs[4:] {
		w := evs[i]
		if ev.Kind != prefix.BlockStored || ev.Medium != prefix.MediumGPU || ev.Hash != w.Hash || ev.Parent != w.Parent ||
			!slices.Equal(ev.Tokens, w.Tokens) || ev.Adapter != w.Adapter || !slices.Equal(ev.MM, w.MM) {
			t.Fatalf("C's GPU event %d: %+v, CPU %+v", i, ev, w)
		}
	}
	truth = prefix.NewEventIndex()
	applyEvents(t, truth, evs)
	tk, _, err := c.FlushCopies()
	must(t, err)
	must(t, c.CompleteCopies(tk, false))
	applyEvents(t, truth, drainAll(t, c))
	sameTiers(t, c, truth, nil)
	if len(gc.batches) != 1 || len(gc.batches[0].Reload) != 4 {
		t.Fatalf("C's reloads: %+v", gc.batches)
	}
}

// A fetch whose reservations take the slots of resident host blocks
// announces their removal (CPU BlockRemoved) before the fetched blocks'
// BlockStored; a read that misses announces nothing.
func TestSharedTierEventsFetchEvicts(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(12, 77))
	conv := seqTokens(r, 2*bs+1)
	storeKeyed(t, srv.Addr(), bs, conv, nil)

	// B's host tier (two slots) holds two blocks of its own.
	b, g := newSharedEventsMgr(t, srv.Addr(), 8, bs, 2, 8)
	own := seqTokens(r, 2*bs+1)
	admit(t, b, 1, own, nil)
	flushAndComplete(t, b, g, false)
	b.MarkComputed() // the step's forward pass ran: the blocks stay cached after the removal
	must(t, b.Remove([]int64{1}))
	flushAndComplete(t, b, g, false)
	waitStored(t, b)
	truth := prefix.NewEventIndex()
	applyEvents(t, truth, drainAll(t, b))
	ownChain := wholeChain(t, own, bs, nil)
	if truth.LenIn(prefix.MediumCPU) != 2 || !truth.ContainsIn(prefix.MediumCPU, ownChain[0]) {
		t.Fatalf("B's host tier: %v", truth.HashesIn(prefix.MediumCPU, nil))
	}
	// The fetch of conv's two blocks evicts both.
	if got := tierMatch(t, b, conv); got != (TierMatch{Host: 2 * bs}) {
		t.Fatalf("B's match: %+v", got)
	}
	evs := drainAll(t, b)
	if len(evs) != 3 || evs[0].Kind != prefix.BlockRemoved || evs[0].Medium != prefix.MediumCPU ||
		!sameSet(evs[0].Hashes, ownChain[:2]) {
		t.Fatalf("the fetch's events: %+v", evs)
	}
	wantCPUStored(t, evs, conv, bs, nil, 0)
	applyEvents(t, truth, evs)
	sameTiers(t, b, truth, nil)

	// Another conversation whose second block's value is corrupt: the
	// fetch reserves two slots (evicting conv's blocks), commits the
	// first and gives the second back, announcing nothing for it.
	other := seqTokens(r, 2*bs+1)
	storeKeyed(t, srv.Addr(), bs, other, nil)
	otherChain := wholeChain(t, other, bs, nil)
	cl := resp.NewClient(srv.Addr(), time.Second)
	defer cl.Close()
	_, err := cl.Do([][][]byte{{[]byte("SET"), []byte("kvplug:" + sharedNS + ":" + hex.EncodeToString(otherChain[1][:])), []byte("short")}})
	must(t, err)
	if got := tierMatch(t, b, other); got != (TierMatch{Host: bs}) {
		t.Fatalf("B's match of the other: %+v", got)
	}
	if sh := b.TierStats().Shared; sh.FetchMisses != 1 || sh.Corrupt != 1 {
		t.Fatalf("B's shared stats: %+v", sh)
	}
	evs = drainAll(t, b)
	if len(evs) != 2 || !sameSet(removedIn(evs, prefix.MediumCPU), wholeChain(t, conv, bs, nil)[:2]) || !slices.Equal(cpuStored(evs), otherChain[:1]) {
		t.Fatalf("the partial fetch's events: %+v", evs)
	}
	applyEvents(t, truth, evs)
	sameTiers(t, b, truth, nil)
	check(t, b)
}

// waitStored waits until m's shared tier has stored its queued blocks and
// unpinned their host slots.
func waitStored(t *testing.T, m *Manager) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		st := m.TierStats()
		if st.Shared.QueueLen == 0 && st.Host.Pinned == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("stores still pending: %+v", st)
		}
	}
}

// The random model of the host tier's events, with a shared tier: a
// consumer applying the events in order always sees both tiers as they
// are, fetches included.
func TestSharedTierEventsRandomModel(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	tierEventsModel(t, srv.Addr())
}
