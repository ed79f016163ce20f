package kvmanager

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// bound is what a call facing a down or slow server (operation timeout
// 100 ms) must return within: generous, for a loaded machine.
const sharedBound = 2 * time.Second

const sharedNS = "test-model.bs4"

// newSharedMgr is newTierMgr with a shared tier at addr (namespace
// sharedNS, 100 ms operation timeout, one-hour backoff unless cfg says
// otherwise); the manager is closed at the test's end.
func newSharedMgr(t testing.TB, addr string, numBlocks, bs, slots, ahead int, cfg func(*SharedTier)) (*Manager, *fakeGPU) {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: tierBlockBytes})
	must(t, err)
	g := &fakeGPU{mem: map[int32][]byte{}, pool: p}
	sh := &SharedTier{Addr: addr, Namespace: sharedNS, OpTimeout: 100 * time.Millisecond, Backoff: time.Hour}
	if cfg != nil {
		cfg(sh)
	}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true,
		HostTier: &HostTier{Pool: p, Copier: g, DemoteAhead: ahead, Shared: sh}})
	must(t, err)
	t.Cleanup(func() { m.Close() })
	return m, g
}

// storeConv has a fresh manager compute conv, demote its blocks and store
// them in the shared tier at addr (Close flushes the store queue).
func storeConv(t *testing.T, addr string, bs int, conv []int32) {
	t.Helper()
	m, g := newSharedMgr(t, addr, 8, bs, 16, 8, func(c *SharedTier) { c.OpTimeout = 2 * time.Second })
	demoteAll(t, m, g, 1, conv)
	must(t, m.Close())
	full := int64((len(conv) - 1) / bs)
	if st := m.TierStats().Shared; st.PutsQueued != full || st.PutsDone != full || st.QueueLen != 0 {
		t.Fatalf("stores: %+v", st)
	}
	if ps := m.TierStats().Host; ps.Pinned != 0 {
		t.Fatalf("host slots still pinned after the stores: %+v", ps)
	}
}

// checkReloaded flushes m's reloads of sequence id (the first n blocks of
// prompt toks), completes them and checks that the GPU blocks hold the
// blocks' K/V.
func checkReloaded(t *testing.T, m *Manager, g *fakeGPU, id int64, toks []int32, n int) {
	t.Helper()
	tk, k, err := m.FlushCopies()
	must(t, err)
	b := g.batches[len(g.batches)-1]
	if k != n || len(b.Reload) != n {
		t.Fatalf("flush: %d copies, batch %+v; want %d reloads", k, b, n)
	}
	must(t, m.CompleteCopies(tk, false))
	tbl := blocksOf(t, m, id, len(toks)/m.BlockSize()+1)
	chain := wholeChain(t, toks, m.BlockSize(), nil)
	for j := range n {
		if !bytes.Equal(g.mem[tbl[j]], kvOf(chain[j])) {
			t.Fatalf("block %d (%d of the prompt) holds %x after the reload, want %x", tbl[j], j, g.mem[tbl[j]], kvOf(chain[j]))
		}
	}
}

// A block that manager A computed, demoted and stored is found by
// managers B and C, each with its own host pool, through the same server:
// MatchTiers fetches it into B's host tier and counts it there; C's Admit
// fetches it itself; both reload it into their GPU blocks with A's K/V.
func TestSharedTierAcrossManagers(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(1, 77))
	conv := seqTokens(r, 4*bs+1)
	// D computes the same conversation before A stores it: its own
	// demotions find the blocks held then, and do not send them again.
	d, gd := newSharedMgr(t, srv.Addr(), 8, bs, 16, 8, func(c *SharedTier) { c.OpTimeout = 2 * time.Second })
	if got := admit(t, d, 1, conv, nil); got != 0 {
		t.Fatalf("D matched %d tokens in an empty tier", got)
	}
	gd.step(t, d, 1, conv)

	storeConv(t, srv.Addr(), bs, conv)

	b, gb := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, nil)
	if got := tierMatch(t, b, conv); got != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("B's match: %+v", got)
	}
	st := b.TierStats()
	if sh := st.Shared; sh.Lookups != 1 || sh.Hits != 4 || sh.Misses != 0 || sh.Fetched != 4 || sh.MatchTokens != 4*bs ||
		sh.Corrupt != 0 || !sh.Available || sh.BytesRead != 4*(48+tierBlockBytes) {
		t.Fatalf("B's shared stats after the match: %+v", sh)
	}
	if st.MatchHostTokens != 4*bs || st.Host.Resident != 4 || st.Host.Pinned != 0 {
		t.Fatalf("B's stats after the match: %+v", st)
	}
	chain := wholeChain(t, conv, bs, nil)
	for _, h := range chain {
		hostHolds(t, gb.pool, h)
	}
	// The second turn: the history from the host tier, nothing more looked
	// up (the rest is not held anywhere: one lookup of 2 blocks, misses).
	turn2 := append(slices.Clone(conv), seqTokens(r, 2*bs)...)
	if got := admit(t, b, 2, turn2, nil); got != 4*bs {
		t.Fatalf("B admitted with %d tokens matched, want %d", got, 4*bs)
	}
	if sh := b.TierStats().Shared; sh.Lookups != 2 || sh.Misses != 2 || sh.Fetched != 4 || sh.HitTokens != 0 {
		t.Fatalf("B's shared stats after the admission: %+v", sh)
	}
	checkReloaded(t, b, gb, 2, turn2, 4)

	// C admits straight away: the fetch is the admission's.
	c, gc := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, nil)
	if got := admit(t, c, 1, conv, nil); got != 4*bs {
		t.Fatalf("C admitted with %d tokens matched, want %d", got, 4*bs)
	}
	if ts := c.TierStats(); ts.Shared.Fetched != 4 || ts.Shared.HitTokens != 4*bs || ts.HostHitTokens != 4*bs || ts.Reloads != 4 {
		t.Fatalf("C's stats: %+v", ts)
	}
	checkReloaded(t, c, gc, 1, conv, 4)

	// D's demotions: held already, not sent.
	must(t, d.Remove([]int64{1}))
	tk, _, err := d.FlushCopies()
	must(t, err)
	must(t, d.CompleteCopies(tk, false))
	must(t, d.Close())
	if sh := d.TierStats().Shared; sh.PutsQueued != 4 || sh.PutsPresent != 4 || sh.PutsDone != 0 || sh.PutsFailed != 0 {
		t.Fatalf("D's stores: %+v", sh)
	}
	must(t, d.Close()) // twice: nothing
}

// Managers whose namespaces differ share nothing; nor do managers that
// agree on the namespace but not on the layout (block bytes): the value's
// fingerprint tells, and the read is a miss.
func TestSharedTierModelIdentity(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	conv := seqTokens(rand.New(rand.NewPCG(2, 77)), 3*bs+1)
	storeConv(t, srv.Addr(), bs, conv)
	other, _ := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, func(c *SharedTier) { c.Namespace = "another-model.bs4" })
	if got := admit(t, other, 1, conv, nil); got != 0 {
		t.Fatalf("another namespace matched %d tokens", got)
	}
	if sh := other.TierStats().Shared; sh.Misses != 3 || sh.Fetched != 0 {
		t.Fatalf("another namespace: %+v", sh)
	}
	p, err := host.New(host.Config{Slots: 16, BlockBytes: 2 * tierBlockBytes})
	must(t, err)
	wide, err := New(Config{NumBlocks: 8, BlockSize: bs, EnablePrefixCache: true, HostTier: &HostTier{Pool: p,
		Shared: &SharedTier{Addr: srv.Addr(), Namespace: sharedNS, OpTimeout: time.Second}}})
	must(t, err)
	defer wide.Close()
	if got := admit(t, wide, 1, conv, nil); got != 0 {
		t.Fatalf("another layout matched %d tokens", got)
	}
	if sh := wide.TierStats().Shared; sh.Hits != 3 || sh.Corrupt != 3 || sh.Fetched != 0 || sh.FetchMisses != 3 {
		t.Fatalf("another layout: %+v", sh)
	}
	if hs := p.Stats(); hs.Resident != 0 || hs.Reserved != 0 || hs.Aborts != 3 {
		t.Fatalf("another layout's host pool: %+v", hs)
	}
}

// A short or corrupt value under a block's key is a miss: the block's
// host slot is given back, and the prefix is computed from there.
func TestSharedTierCorruptValueIsAMiss(t *testing.T) {
	const bs = 4
	srv, _, conv := newStoredConv(t, 3, 77)
	chain := wholeChain(t, conv, bs, nil)
	key := func(h prefix.Hash) []byte { return []byte("kvplug:" + sharedNS + ":" + hex.EncodeToString(h[:])) }
	c := resp.NewClient(srv.Addr(), time.Second)
	defer c.Close()
	get, err := c.Do([][][]byte{{[]byte("GET"), key(chain[2])}})
	must(t, err)
	good := get[0].([]byte)
	for i, v := range [][]byte{
		good[:20], // short
		append(slices.Clone(good[:len(good)-1]), good[len(good)-1]^1), // a flipped payload bit
		append(slices.Clone(good), 0),                                 // trailing byte
	} {
		if _, err := c.Do([][][]byte{{[]byte("SET"), key(chain[2]), v}}); err != nil {
			t.Fatal(err)
		}
		m, g := newSharedMgr(t, srv.Addr(), 8, bs, 16, 4, nil)
		if got := admit(t, m, 1, conv, nil); got != 2*bs {
			t.Fatalf("value %d: admitted with %d tokens matched, want the 2 blocks before the corrupt one", i, got)
		}
		ts := m.TierStats()
		if sh := ts.Shared; sh.Corrupt != 1 || sh.FetchMisses != 1 || sh.Fetched != 3 || sh.HitTokens != 2*bs || sh.Errors != 0 || !sh.Available {
			t.Fatalf("value %d: %+v", i, sh)
		}
		if ts.Host.Resident != 3 || ts.Host.Reserved != 0 || ts.Host.Aborts != 1 {
			t.Fatalf("value %d: host pool %+v", i, ts.Host)
		}
		checkReloaded(t, m, g, 1, conv, 2)
		must(t, m.Close())
	}
}

// admitUncachedWithin admits conv as sequence 1 into m, whose shared
// tier is down or slow: nothing is matched, and the admission returns
// within sharedBound.
func admitUncachedWithin(t testing.TB, m *Manager, conv []int32) {
	t.Helper()
	start := time.Now()
	if got := admit(t, m, 1, conv, nil); got != 0 {
		t.Fatalf("matched %d tokens", got)
	}
	if d := time.Since(start); d > sharedBound {
		t.Fatalf("admission took %v", d)
	}
}

// Valkey down (nothing listens): the admission succeeds at once, computing
// the prefix; the failed call is counted and the next ones are skipped
// without a round trip; stores fail, counted, their slots unpinned.
func TestSharedTierServerDown(t *testing.T) {
	const bs = 4
	addr := fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t))
	m, g := newSharedMgr(t, addr, 8, bs, 16, 8, nil)
	r := rand.New(rand.NewPCG(4, 77))
	conv := seqTokens(r, 4*bs+1)
	admitUncachedWithin(t, m, conv)
	sh := m.TierStats().Shared
	if sh.Errors+sh.Timeouts != 1 || sh.Misses != 4 || sh.Available {
		t.Fatalf("after the first admission: %+v", sh)
	}
	g.step(t, m, 1, conv)
	must(t, m.Remove([]int64{1}))
	tk, _, err := m.FlushCopies()
	must(t, err)
	must(t, m.CompleteCopies(tk, false))
	if got := tierMatch(t, m, append(slices.Clone(conv), 1, 2, 3, 4)); got != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("match: %+v", got)
	}
	if got := admit(t, m, 2, seqTokens(r, 3*bs), nil); got != 0 {
		t.Fatalf("matched %d tokens", got)
	}
	must(t, m.Close())
	ts := m.TierStats()
	// One failure a path (the admission's lookup, the store's EXISTS), each
	// path skipped after its own.
	if sh := ts.Shared; sh.Errors+sh.Timeouts != 2 || sh.Skipped < 2 || sh.PutsQueued != 4 || sh.PutsFailed != 4 || sh.PutsDone != 0 {
		t.Fatalf("after the stores: %+v", sh)
	}
	if ts.Host.Pinned != 0 || ts.Host.Resident != 4 {
		t.Fatalf("host pool: %+v", ts.Host)
	}
}

// Valkey slow (a server that never answers, or too late): each admission
// and match returns within a bound of the operation timeout, counted;
// later ones are skipped at once.
func TestSharedTierServerSlow(t *testing.T) {
	const bs = 4
	for _, delay := range []time.Duration{0, 700 * time.Millisecond} {
		t.Run(fmt.Sprint("delay ", delay), func(t *testing.T) {
			m, _ := newSharedMgr(t, redistest.Slow(t, delay), 8, bs, 16, 4, nil)
			r := rand.New(rand.NewPCG(5, 77))
			conv := seqTokens(r, 4*bs+1)
			admitUncachedWithin(t, m, conv)
			if sh := m.TierStats().Shared; sh.Timeouts != 1 || sh.Misses != 4 || sh.Available {
				t.Fatalf("stats %+v", sh)
			}
			start := time.Now()
			tierMatch(t, m, seqTokens(r, 3*bs))
			admit(t, m, 2, seqTokens(r, 3*bs), nil)
			if d := time.Since(start); d > 50*time.Millisecond {
				t.Fatalf("calls in the backoff window took %v", d)
			}
			if sh := m.TierStats().Shared; sh.Timeouts != 1 || sh.Skipped != 2 {
				t.Fatalf("stats %+v", sh)
			}
		})
	}
}

// The store queue full: completions never wait; the demotions that find
// it full are committed to the host tier but not stored, counted.
func TestSharedTierPutQueueFull(t *testing.T) {
	const bs = 4
	m, g := newSharedMgr(t, redistest.Slow(t, 0), 8, bs, 16, 8, func(c *SharedTier) {
		// No skip window: the store goroutine waits on the server.
		c.PutQueue, c.OpTimeout, c.Backoff, c.MaxBackoff = 1, time.Second, time.Nanosecond, time.Nanosecond
	})
	conv := seqTokens(rand.New(rand.NewPCG(6, 77)), 4*bs+1)
	admit(t, m, 1, conv, nil) // a timeout
	g.step(t, m, 1, conv)
	must(t, m.Remove([]int64{1}))
	tk, _, err := m.FlushCopies()
	must(t, err)
	start := time.Now()
	must(t, m.CompleteCopies(tk, false))
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Fatalf("completion took %v", d)
	}
	// Four puts into a queue of one whose store waits on a server that never
	// answers: every put is queued or dropped, and some are dropped (all
	// four queued would need the store to time out twice while they are
	// enqueued).
	sh := m.TierStats().Shared
	if sh.PutsQueued+sh.PutsDropped != 4 || sh.PutsDropped < 1 || sh.PutsQueued < 1 {
		t.Fatalf("stats %+v", sh)
	}
	must(t, m.Close())
	ts := m.TierStats()
	if ts.Shared.PutsFailed != sh.PutsQueued || ts.Shared.QueueLen != 0 || ts.Host.Pinned != 0 || ts.Host.Resident != 4 {
		t.Fatalf("after close: %+v", ts)
	}
	// After Close nothing is fetched or stored; the manager goes on.
	before := m.TierStats().Shared
	if got := admit(t, m, 2, conv, nil); got != 4*bs {
		t.Fatalf("after close: matched %d tokens from the host tier, want %d", got, 4*bs)
	}
	if after := m.TierStats().Shared; after.Lookups != before.Lookups || after.Skipped != before.Skipped {
		t.Fatalf("a lookup after close: %+v", after)
	}
}

// Concurrent admissions, matches, completions and stores on managers that
// share a server (run with -race: the invariants are checked after every
// call).
func TestSharedTierConcurrent(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	convs := make([][]int32, 6)
	r := rand.New(rand.NewPCG(7, 77))
	for i := range convs {
		convs[i] = seqTokens(r, 3*bs+1)
	}
	var wg sync.WaitGroup
	for w := range 3 {
		m, g := newSharedMgr(t, srv.Addr(), 16, bs, 8, 12, func(c *SharedTier) { c.OpTimeout = 5 * time.Second; c.PutQueue = 4 })
		wg.Go(func() {
			id := int64(0)
			for round := range 12 {
				conv := convs[(round+w)%len(convs)]
				id++
				if _, err := m.Admit([]int64{id}, one(conv, nil), nil); err != nil {
					t.Error(err)
					return
				}
				g.step(t, m, id, conv)
				out := make([]TierMatch, 1)
				if err := m.MatchTiers(one(convs[(round+w+1)%len(convs)], nil), out); err != nil {
					t.Error(err)
					return
				}
				if err := m.Remove([]int64{id}); err != nil {
					t.Error(err)
					return
				}
				tk, _, err := m.FlushCopies()
				if err == nil && tk != 0 {
					err = m.CompleteCopies(tk, false)
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
			if err := m.Close(); err != nil {
				t.Error(err)
			}
			if ts := m.TierStats(); ts.Host.Pinned != 0 || ts.Shared.Timeouts+ts.Shared.Errors != 0 {
				t.Errorf("after close: %+v", ts)
			}
		})
	}
	wg.Wait()
}

func TestSharedTierConfig(t *testing.T) {
	p, err := host.New(host.Config{Slots: 4, BlockBytes: 8})
	must(t, err)
	for name, sh := range map[string]SharedTier{
		"no address":        {Namespace: "m"},
		"no namespace":      {Addr: "127.0.0.1:1"},
		"namespace with /":  {Addr: "127.0.0.1:1", Namespace: "meta-llama/Llama-3"},
		"negative timeout":  {Addr: "127.0.0.1:1", Namespace: "m", OpTimeout: -1},
		"timeout too long":  {Addr: "127.0.0.1:1", Namespace: "m", OpTimeout: time.Minute + 1},
		"negative queue":    {Addr: "127.0.0.1:1", Namespace: "m", PutQueue: -1},
		"queue too long":    {Addr: "127.0.0.1:1", Namespace: "m", PutQueue: 1<<20 + 1},
		"TTL under 1 ms":    {Addr: "127.0.0.1:1", Namespace: "m", TTL: time.Microsecond},
		"negative backoffs": {Addr: "127.0.0.1:1", Namespace: "m", Backoff: -time.Second},
	} {
		_, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, HostTier: &HostTier{Pool: p, Shared: &sh}})
		wantCode(t, name, err, kverr.InvalidArgument)
	}
	// KV events with a shared tier: accepted (the CPU events follow the
	// shared tier's fetches).
	sh := SharedTier{Addr: "127.0.0.1:1", Namespace: "m"}
	ev, err := New(Config{NumBlocks: 8, BlockSize: 4, EnablePrefixCache: true, EnableKVEvents: true, HostTier: &HostTier{Pool: p, Shared: &sh}})
	must(t, err)
	must(t, ev.Close())
	// Without a shared tier: zero stats, Close does nothing.
	m, _ := newTierMgr(t, 8, 4, 4, 0)
	if m.TierStats().Shared != (SharedStats{}) || m.Close() != nil {
		t.Fatal("a manager without a shared tier")
	}
}

// A prompt whose first block past its GPU and host matches the server
// said it lacks is not asked about again for a second (a prompt waiting
// for admission is matched every step): the repeat costs no round trip,
// even after another manager stored the blocks; after the second the
// next match asks and finds them. A server that did not answer (down) is
// not remembered as lacking anything.
func TestSharedTierRemembersALackingBlock(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(9, 77))
	conv := seqTokens(r, 4*bs+1)
	m, _ := newSharedMgr(t, srv.Addr(), 8, bs, 16, 8, func(c *SharedTier) { c.OpTimeout = 2 * time.Second })
	start := time.Now()
	if got := tierMatch(t, m, conv); got != (TierMatch{}) {
		t.Fatalf("first match in an empty tier: %+v", got)
	}
	if sh := m.TierStats().Shared; sh.Lookups != 1 || sh.Misses != 4 || sh.Remembered != 0 {
		t.Fatalf("after the first match: %+v", sh)
	}
	storeConv(t, srv.Addr(), bs, conv)
	if got := tierMatch(t, m, conv); time.Since(start) < time.Second && got != (TierMatch{}) {
		t.Fatalf("a match within a second of the miss: %+v", got)
	}
	if sh := m.TierStats().Shared; time.Since(start) < time.Second && (sh.Lookups != 1 || sh.Remembered != 1) {
		t.Fatalf("a match within a second of the miss asked the server: %+v", sh)
	}
	time.Sleep(time.Until(start.Add(time.Second + 10*time.Millisecond)))
	if got := tierMatch(t, m, conv); got != (TierMatch{Host: 4 * bs}) {
		t.Fatalf("the match after a second: %+v", got)
	}
	if sh := m.TierStats().Shared; sh.Lookups != 2 || sh.Fetched != 4 {
		t.Fatalf("after the second: %+v", sh)
	}

	down, _ := newSharedMgr(t, fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t)), 8, bs, 16, 8,
		func(c *SharedTier) { c.Backoff = time.Millisecond })
	for range 2 {
		tierMatch(t, down, conv)
		time.Sleep(5 * time.Millisecond) // past the backoff: the second match dials again
	}
	if sh := down.TierStats().Shared; sh.Lookups != 2 || sh.Remembered != 0 || sh.Errors+sh.Timeouts != 2 {
		t.Fatalf("a down server's misses were remembered: %+v", sh)
	}
}
