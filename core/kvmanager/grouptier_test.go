package kvmanager

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// tierMem is groupMem's tier copier: a host slot holds one block of one
// group, the bs tokens its rows hold (-1: a row never written). Each op
// copies between the slot and its group's memory only, so an op naming
// the wrong group moves the wrong bytes and the next check finds them.
type tierMem struct {
	gm     *groupMem
	pool   *host.Pool
	bs     int32
	groups map[int]int // ops copied per group
	// engine: the engine drives the copies (no Copier, FlushCopiesTo, as
	// through the C ABI), its arrays as large as the flush says it needs.
	engine bool
}

func (c *tierMem) Copy(b CopyBatch) error {
	for _, op := range b.Demote {
		buf := c.pool.Bytes(op.Slot)
		for r := range c.bs {
			v, ok := c.gm.mem[op.Group][op.Block*c.bs+r]
			if !ok {
				v = -1
			}
			binary.LittleEndian.PutUint32(buf[4*r:], uint32(v))
		}
		c.groups[op.Group]++
	}
	for _, op := range b.Reload {
		buf := c.pool.Bytes(op.Slot)
		for r := range c.bs {
			if v := int32(binary.LittleEndian.Uint32(buf[4*r:])); v >= 0 {
				c.gm.mem[op.Group][op.Block*c.bs+r] = v
			} else {
				delete(c.gm.mem[op.Group], op.Block*c.bs+r)
			}
		}
	}
	return nil
}

// flush is the engine's copy step: FlushCopies, the copies done at once,
// CompleteCopies.
func (c *tierMem) flush(t testing.TB) {
	t.Helper()
	if c.engine {
		c.flushTo(t)
		return
	}
	tk, _, err := c.gm.m.FlushCopies()
	must(t, err)
	if tk != 0 {
		must(t, c.gm.m.CompleteCopies(tk, false))
	}
}

// flushTo is flush for an engine that copies: FlushCopiesTo into arrays
// of the sizes a first call with none asks for, every op it hands back
// copied, CompleteCopies. An op the flush queued but did not hand back
// would leave its host slot unwritten, for a later reload to serve.
func (c *tierMem) flushTo(t testing.TB) {
	t.Helper()
	m := c.gm.m
	queued := m.TierStats().DemotionsQueued
	tk, nd, nr, needD, needR, err := m.FlushCopiesTo(nil, nil)
	if needD > 0 || needR > 0 {
		if !kverr.Is(err, kverr.BufferTooSmall) {
			t.Fatalf("flush copies into no arrays: %v, want BufferTooSmall (need %d demotions, %d reloads)", err, needD, needR)
		}
		demote, reload := make([]DemoteOp, needD), make([]ReloadOp, needR)
		tk, nd, nr, _, _, err = m.FlushCopiesTo(demote, reload)
		must(t, err)
		must(t, c.Copy(CopyBatch{Ticket: tk, Demote: demote[:nd], Reload: reload[:nr]}))
	} else {
		must(t, err)
	}
	if got := m.TierStats().DemotionsQueued - queued; got != int64(nd) {
		t.Fatalf("the flush queued %d demotions and handed the engine %d (arrays of %d)", got, nd, needD)
	}
	if tk != 0 {
		must(t, m.CompleteCopies(tk, false))
	}
}

func newGroupTier(t testing.TB, numBlocks, bs, slots, ahead int, events bool, groups ...Group) *tierMem {
	t.Helper()
	return newGroupTierOf(t, false, numBlocks, bs, slots, ahead, events, groups...)
}

// newGroupTierOf is newGroupTier with the engine driving the copies
// (tierMem.engine) when engine is set.
func newGroupTierOf(t testing.TB, engine bool, numBlocks, bs, slots, ahead int, events bool, groups ...Group) *tierMem {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: 4 * bs})
	must(t, err)
	c := &tierMem{pool: p, bs: int32(bs), groups: map[int]int{}, engine: engine}
	var cp TierCopier = c
	if engine {
		cp = nil
	}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: events, Groups: groups,
		HostTier: &HostTier{Pool: p, Copier: cp, DemoteAhead: ahead}})
	must(t, err)
	c.gm = newGroupMem(m)
	return c
}

// A conversation demoted whole (every group's blocks the GPU cached) is
// reloaded by its next turn: group 0 and the full group whole, the window
// group only the blocks its next query reads, its earlier entries dropped,
// and every reloaded block holds the conversation's tokens.
func TestGroupTierReloadsWithWindows(t *testing.T) {
	for _, engine := range []bool{false, true} {
		t.Run(map[bool]string{false: "copier", true: "engine"}[engine], func(t *testing.T) { groupTierReloadsWithWindows(t, engine) })
	}
}

func groupTierReloadsWithWindows(t *testing.T, engine bool) {
	const bs, w, pool = 4, 8, 40
	c := newGroupTierOf(t, engine, pool, bs, 64, pool, false, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w}, Group{Kind: FullAttention})
	gm, m := c.gm, c.gm.m
	r := rand.New(rand.NewPCG(3, 4))
	conv := seqTokens(r, 18)
	if k := gm.admit(t, 1, conv); k != 0 {
		t.Fatalf("first admission matched %d tokens", k)
	}
	c.flush(t)
	for range 6 {
		c.flush(t) // the step's: a block is demoted only once a step wrote it
		must(t, gm.grow(t, 1, seqTokens(r, 1)))
		m.MarkComputed()
	}
	c.flush(t)
	conv = slices.Clone(gm.toks[1])
	gm.remove(t, 1)
	c.flush(t) // demotes every cached node, with its companions
	if st := m.PrefixStats(); st.CachedBlocks != 0 {
		t.Fatalf("%d blocks still cached on the GPU after demoting ahead of the whole pool", st.CachedBlocks)
	}
	chain := wholeChain(t, conv, bs, nil)
	for j, h := range chain {
		for g, want := range []bool{true, j >= (len(conv)-w+1)/bs, true} {
			if _, st := c.pool.State(kvtier.GroupKey(h, g)); (st == host.Resident) != want && (g != 1 || want) {
				t.Fatalf("block %d of group %d: host state %v, resident wanted %v", j, g, st, want)
			}
		}
	}
	if c.groups[0] != len(chain) || c.groups[2] != len(chain) || c.groups[1] == 0 {
		t.Fatalf("demotions per group %v; want %d of groups 0 and 2 and some of group 1", c.groups, len(chain))
	}
	next := append(slices.Clone(conv), seqTokens(r, 5)...)
	if got := tierMatch(t, m, next); got.GPU != 0 || int(got.Host) != len(chain)*bs {
		t.Fatalf("match tiers: %+v, want %d host tokens", got, len(chain)*bs)
	}
	if k := gm.admit(t, 2, next); k != len(chain)*bs {
		t.Fatalf("next turn matched %d tokens, want %d from the host tier", k, len(chain)*bs)
	}
	tabs, _ := describeGroups(t, m, 2, 64)
	keep := m.keepFrom(len(chain)*bs, w)
	for j := range keep {
		if tabs[1][j] != NoBlock {
			t.Fatalf("window entry %d is block %d; the hit point's query reads from entry %d", j, tabs[1][j], keep)
		}
	}
	c.flush(t) // the reloads
	gm.check(t)
	if st := m.TierStats(); st.HostHitTokens != int64(len(chain)*bs) || st.ReloadsCompleted != int64(2*len(chain)+len(chain)-keep) {
		t.Fatalf("tier stats %+v: want %d hit tokens and %d reloads", st, len(chain)*bs, 3*len(chain)-keep)
	}
	for range 10 {
		must(t, gm.grow(t, 2, seqTokens(r, 1)))
		m.MarkComputed()
		gm.check(t)
	}
}

// The engine that copies (FlushCopiesTo, as through the C ABI) gets every
// demotion a flush queues: a node brings its companions, so a flush that
// wants a few blocks free queues more ops than blocks, and the arrays the
// flush asks for must hold them all; the next turn's reloads then bring
// back the conversation's tokens, not slots no copy wrote.
func TestGroupTierEngineGetsEveryDemotion(t *testing.T) {
	const bs, w, pool, ahead = 4, 8, 24, 10
	c := newGroupTierOf(t, true, pool, bs, 64, ahead, false, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w}, Group{Kind: FullAttention})
	gm, m := c.gm, c.gm.m
	r := rand.New(rand.NewPCG(7, 8))
	conv := seqTokens(r, 24) // 6 blocks, 18 of the pool's 24 in three groups
	gm.admit(t, 1, conv)
	c.flush(t) // the step's: nothing written yet to demote
	m.MarkComputed()
	gm.remove(t, 1)
	c.flush(t) // demotes ahead: 4 blocks wanted, 2 nodes with their companions
	if c.groups[1] == 0 || c.groups[0]+c.groups[1]+c.groups[2] <= ahead-(pool-18) {
		t.Fatalf("demotions per group %v: want nodes with window companions, more ops than the %d blocks wanted", c.groups, ahead-(pool-18))
	}
	next := append(slices.Clone(conv), seqTokens(r, 3)...)
	got := tierMatch(t, m, next)
	if got.Host == 0 {
		t.Fatalf("match tiers: %+v, want the demoted blocks from the host tier", got)
	}
	if k := gm.admit(t, 2, next); k != int(got.GPU+got.Host) {
		t.Fatalf("next turn matched %d tokens, match tiers said %+v", k, got)
	}
	c.flush(t) // the reloads
	gm.check(t)
}

// Without the window blocks its hit point reads, a host hit stops where a
// window group still has them: the GPU's rule.
// A flush never asks for more room than the pool's blocks (the header's
// promise to engines that size their arrays once): with layer groups its
// request counts the cached blocks a flush can demote, not the nodes it
// would evict times the groups, which asked for twice the pool here.
func TestGroupTierFlushFitsNumBlocks(t *testing.T) {
	const nb, bs = 16, 4
	m, err := New(Config{NumBlocks: nb, BlockSize: bs, EnablePrefixCache: true,
		Groups:   []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: 4}},
		HostTier: &HostTier{Slots: 64, BlockBytes: 64, DemoteAhead: nb}})
	must(t, err)
	toks := make([]int32, 8*bs) // one live sequence holding every block of both groups
	for i := range toks {
		toks[i] = int32(i)
	}
	if _, err := m.Admit([]int64{1}, Prompts{Tokens: toks, Offsets: []int64{0, int64(len(toks))}}, nil); err != nil {
		t.Fatal(err)
	}
	m.MarkComputed()
	d, r := make([]DemoteOp, nb), make([]ReloadOp, nb)
	if _, _, _, needD, needR, err := m.FlushCopiesTo(d, r); err != nil || needD > nb || needR > nb {
		t.Fatalf("flush with arrays of %d: need %d demotions, %d reloads: %v", nb, needD, needR, err)
	}
	must(t, m.Remove([]int64{1})) // now cached: a flush may demote them all, still within the pool
	if _, nd, _, needD, _, err := m.FlushCopiesTo(d, r); err != nil || needD > nb || nd == 0 {
		t.Fatalf("flush of a cached pool with arrays of %d: %d demoted, need %d: %v", nb, nd, needD, err)
	}
	must(t, m.CheckInvariants())
}

// hostWithoutWindowBlock refills the host tier (two groups: full and a
// window) with conversation conv's blocks (chain: their hashes), each
// slot holding its block's tokens as the demotions left them, all but
// block skip's window companion.
func (c *tierMem) hostWithoutWindowBlock(t *testing.T, chain []prefix.Hash, conv []int32, skip int) {
	t.Helper()
	bs := int(c.bs)
	c.pool.Reset()
	for j, h := range chain {
		for g := range 2 {
			if g == 1 && j == skip {
				continue
			}
			s, err := c.pool.Reserve(kvtier.GroupKey(h, g))
			must(t, err)
			for rr := range bs {
				binary.LittleEndian.PutUint32(c.pool.Bytes(s)[4*rr:], uint32(conv[j*bs+rr]))
			}
			must(t, c.pool.Commit(s))
		}
	}
}

func TestGroupTierHitNeedsItsWindowBlocks(t *testing.T) {
	const bs, w, pool = 4, 6, 40
	c := newGroupTier(t, pool, bs, 64, pool, false, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w})
	gm, m := c.gm, c.gm.m
	r := rand.New(rand.NewPCG(5, 6))
	conv := seqTokens(r, 33) // 8 full blocks
	gm.admit(t, 1, conv)
	c.flush(t) // the step's
	gm.remove(t, 1)
	c.flush(t)
	chain := wholeChain(t, conv, bs, nil)
	// The window companion of block 6 leaves the host tier: a hit after
	// 8 blocks reads blocks 6 and 7 (keepFrom(32, 6) = 6), one after 7
	// blocks 5 and 6, one after 6 blocks 4 and 5: 6 blocks hit.
	if _, st := c.pool.State(kvtier.GroupKey(chain[6], 1)); st != host.Resident {
		t.Fatalf("window companion of block 6 not in the host tier: %v", st)
	}
	c.hostWithoutWindowBlock(t, chain, conv, 6)
	next := append(slices.Clone(conv[:32]), seqTokens(r, 3)...)
	if got := tierMatch(t, m, next); got.Host != 6*bs {
		t.Fatalf("match tiers: %+v, want %d host tokens", got, 6*bs)
	}
	if got := gm.admit(t, 2, next); got != 6*bs {
		t.Fatalf("matched %d tokens; the window companion of block 6 is missing, so 6 blocks (%d tokens) hit", got, 6*bs)
	}
	c.flush(t)
	gm.check(t)
}

// The random model: conversations and a shared system prompt on a pool
// under pressure, demoted ahead of need and reloaded; after every step the
// live sequences' blocks hold their tokens in every group (reloaded ones
// included), the invariants hold (every call, -race), and the KV events
// mirror every group's GPU set and the host tier's blocks.
func TestGroupTierRandomModel(t *testing.T) {
	for _, engine := range []bool{false, true} {
		t.Run(map[bool]string{false: "copier", true: "engine"}[engine], func(t *testing.T) { groupTierRandomModel(t, engine) })
	}
}

// groupTierRandomModel is TestGroupTierRandomModel with its copies done by
// a Copier or, engine set, by the engine through FlushCopiesTo.
func groupTierRandomModel(t *testing.T, engine bool) {
	hostHits, windowOps := int64(0), 0
	for seed := range uint64(8) {
		r := rand.New(rand.NewPCG(seed, 11))
		bs := 2 + r.IntN(4)
		pool := 60 + r.IntN(60)
		groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: 1 + r.IntN(12)},
			{Kind: SlidingWindow, Window: 1 + r.IntN(24)}, {Kind: FullAttention}}
		c := newGroupTierOf(t, engine, pool, bs, 40+r.IntN(200), r.IntN(pool/3), true, groups...)
		gm, m := c.gm, c.gm.m
		mr := newGroupMirror(m, groups, rand.New(rand.NewPCG(seed, 12)))
		system := seqTokens(r, r.IntN(3*bs))
		var convs [][]int32
		next := int64(1)
		for step := range 300 {
			switch op := r.IntN(20); {
			case op < 5 && len(gm.toks) < 4:
				p := append(slices.Clone(system), seqTokens(r, 1+r.IntN(12))...)
				if len(convs) > 0 && r.IntN(3) > 0 {
					p = append(slices.Clone(convs[r.IntN(len(convs))]), seqTokens(r, 1+r.IntN(6))...)
				}
				if len(p) < pool*bs/10 {
					gm.admit(t, next, p)
					next++
				}
			case op < 13 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				if len(gm.toks[id]) < pool*bs/10 {
					_ = gm.grow(t, id, seqTokens(r, 1+r.IntN(3)))
				}
				m.MarkComputed()
			case op < 16 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				convs = append(convs, gm.toks[id])
				gm.remove(t, id)
			default:
				c.flush(t)
			}
			if step%5 == 0 {
				c.flush(t) // the reloads land before the next check
				gm.check(t)
				mr.check(t, nil)
				if got, want := mr.x.LenIn(prefix.MediumCPU), m.tier.TierLen(); got != want {
					t.Fatalf("seed %d: the events say the host tier holds %d blocks, it holds %d", seed, got, want)
				}
				// An announced host block has its full groups' blocks
				// there too: a host hit needs them.
				for _, h := range mr.x.HashesIn(prefix.MediumCPU, nil) {
					for g, grp := range groups {
						if _, st := c.pool.State(kvtier.GroupKey(h, g)); grp.Kind == FullAttention && st != host.Resident {
							t.Fatalf("seed %d: host block %s is announced, its group %d block is %v", seed, h, g, st)
						}
					}
				}
			}
		}
		st := m.TierStats()
		hostHits += st.HostHitTokens
		windowOps += c.groups[1] + c.groups[2]
		t.Logf("seed %d: %d host hit tokens, demotions per group %v, %d events", seed, st.HostHitTokens, c.groups, mr.events)
	}
	if hostHits == 0 || windowOps == 0 {
		t.Fatalf("the runs tested nothing: %d host hit tokens, %d window companions demoted", hostHits, windowOps)
	}
}

// A node is in the host tier with its full-attention companions or not at
// all: a host hit needs every full group's block. Here the host tier has
// room for one slot when the flush demotes a node: its group-0 block alone
// could take it, but would serve no hit, and its CPU BlockStored would
// tell a router of a hit the tier refuses. The node is dropped whole; once
// the tier has room, it is demoted whole and its next turn hits.
func TestGroupTierNodeNeedsItsFullCompanions(t *testing.T) {
	const bs, w, pool = 4, 6, 16
	groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: w}, {Kind: FullAttention}}
	c := newGroupTier(t, pool, bs, 4, pool, true, groups...)
	gm, m := c.gm, c.gm.m
	mr := newGroupMirror(m, groups, rand.New(rand.NewPCG(9, 10)))
	r := rand.New(rand.NewPCG(11, 12))
	conv := seqTokens(r, bs+1) // one full block
	h := wholeChain(t, conv, bs, nil)[0]
	next := append(slices.Clone(conv), seqTokens(r, 2)...)
	demote := func() {
		t.Helper()
		gm.admit(t, 1, conv)
		c.flush(t) // the step's: nothing written yet to demote
		m.MarkComputed()
		gm.remove(t, 1)
		c.flush(t) // demotes the node
		mr.drain(t)
	}
	// Three of the four host slots pinned: reservations of other copies.
	var pinned []host.Slot
	for k := range uint64(3) {
		s, err := c.pool.Reserve(0xfeed0000 + k)
		must(t, err)
		pinned = append(pinned, s)
	}
	demote()
	for g := range groups {
		if _, st := c.pool.State(kvtier.GroupKey(h, g)); st != host.Absent {
			t.Fatalf("group %d's block is %v in the host tier, which had no room for the node's full companion", g, st)
		}
	}
	if mr.x.ContainsIn(prefix.MediumCPU, h) {
		t.Fatal("a CPU BlockStored announced a block the host tier cannot serve a hit from")
	}
	if got := tierMatch(t, m, next); got.Host != 0 {
		t.Fatalf("match tiers: %+v, want no host hit", got)
	}
	if st := m.Stats(); st.FreeBlocks != pool {
		t.Fatalf("%d of %d GPU blocks free after the node was dropped", st.FreeBlocks, pool)
	}
	for _, s := range pinned {
		must(t, c.pool.Abort(s))
	}
	demote()
	for g := range groups {
		if _, st := c.pool.State(kvtier.GroupKey(h, g)); st != host.Resident {
			t.Fatalf("group %d's block is %v in the host tier, with room for the node", g, st)
		}
	}
	if !mr.x.ContainsIn(prefix.MediumCPU, h) {
		t.Fatal("no CPU BlockStored for the node demoted whole")
	}
	if k := gm.admit(t, 2, next); k != bs {
		t.Fatalf("next turn matched %d tokens, want %d from the host tier", k, bs)
	}
	c.flush(t)
	gm.check(t)
	must(t, m.CheckInvariants())
}

// A node whose group-0 block the host tier holds already (it was reloaded,
// or computed again after a hit its missing window block cut) still has
// its companions demoted, those the host tier lacks: dropping them would
// leave the tier's hit cut where it was cut, however often the prefix is
// computed again.
func TestGroupTierCompanionsOfAPresentNode(t *testing.T) {
	const bs, w, pool = 4, 6, 40
	c := newGroupTier(t, pool, bs, 64, pool, false, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w})
	gm, m := c.gm, c.gm.m
	r := rand.New(rand.NewPCG(13, 14))
	conv := seqTokens(r, 33) // 8 full blocks
	gm.admit(t, 1, conv)
	c.flush(t) // the step's
	gm.remove(t, 1)
	c.flush(t)
	chain := wholeChain(t, conv, bs, nil)
	// The host tier loses block 6's window companion: a hit stops after 6
	// blocks (TestGroupTierHitNeedsItsWindowBlocks).
	c.hostWithoutWindowBlock(t, chain, conv, 6)
	next := append(slices.Clone(conv[:32]), seqTokens(r, 3)...)
	if got := gm.admit(t, 2, next); got != 6*bs {
		t.Fatalf("matched %d tokens, want %d: block 6's window companion is missing", got, 6*bs)
	}
	c.flush(t) // the reloads
	gm.remove(t, 2)
	c.flush(t) // blocks 6 and 7 computed again, demoted: block 6's window companion with them
	if _, st := c.pool.State(kvtier.GroupKey(chain[6], 1)); st != host.Resident {
		t.Fatalf("block 6's window companion is %v in the host tier after the GPU computed it again", st)
	}
	next = append(slices.Clone(conv[:32]), seqTokens(r, 3)...)
	if got := gm.admit(t, 3, next); got != 8*bs {
		t.Fatalf("matched %d tokens, want all %d from the host tier", got, 8*bs)
	}
	c.flush(t)
	gm.check(t)
	must(t, m.CheckInvariants())
}

// A node's group-0 host slot goes when the host pool evicts one of its
// full-attention companions: no host hit can use the node any more, and
// its CPU BlockStored would stand for a hit the tier refuses. Here node X
// loses group 0 to the LRU, keeps its full companion, is computed again
// and demoted with a group-0 slot younger than that companion; the next
// pressure evicts the companion first, and takes X's group-0 slot with it.
func TestGroupTierDropsAGroupZeroSlotWithoutItsFullCompanion(t *testing.T) {
	const bs, w, slots = 4, 6, 5
	groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: w}, {Kind: FullAttention}}
	c := newGroupTier(t, 32, bs, slots, 32, true, groups...)
	gm, m := c.gm, c.gm.m
	mr := newGroupMirror(m, groups, rand.New(rand.NewPCG(15, 16)))
	r := rand.New(rand.NewPCG(17, 18))
	id := int64(0)
	serve := func(conv []int32) {
		t.Helper()
		id++
		gm.admit(t, id, conv)
		c.flush(t) // the step's: nothing written yet to demote
		m.MarkComputed()
		gm.remove(t, id)
		c.flush(t) // demotes the node
		mr.drain(t)
		must(t, m.CheckInvariants())
		// Every announced host block has its full groups' blocks there.
		for _, h := range mr.x.HashesIn(prefix.MediumCPU, nil) {
			for g, grp := range groups {
				if _, st := c.pool.State(kvtier.GroupKey(h, g)); grp.Kind == FullAttention && st != host.Resident {
					t.Fatalf("host block %s is announced, its group %d block is %v", h, g, st)
				}
			}
		}
	}
	state := func(h prefix.Hash, g int) host.SlotState { _, st := c.pool.State(kvtier.GroupKey(h, g)); return st }
	x, y, z := seqTokens(r, bs+1), seqTokens(r, bs+1), seqTokens(r, bs+1)
	hx := wholeChain(t, x, bs, nil)[0]
	serve(x)
	serve(y) // the LRU takes X's group-0 slot, the oldest
	if state(hx, 0) != host.Absent || state(hx, 2) != host.Resident {
		t.Fatalf("X: group 0 %v, full companion %v; want absent and resident", state(hx, 0), state(hx, 2))
	}
	serve(x) // computed again: a group-0 slot younger than its full companion's
	if state(hx, 0) != host.Resident || state(hx, 2) != host.Resident {
		t.Fatalf("X demoted again: group 0 %v, full companion %v", state(hx, 0), state(hx, 2))
	}
	serve(z) // the LRU takes X's full companion first
	if state(hx, 2) != host.Absent {
		t.Fatalf("X's full companion %v after Z's demotion: the scenario did not evict it", state(hx, 2))
	}
	if state(hx, 0) != host.Absent {
		t.Fatalf("X's group-0 slot %v without its full companion", state(hx, 0))
	}
	if slices.Contains(mr.x.HashesIn(prefix.MediumCPU, nil), hx) {
		t.Fatal("X is still announced in the host tier")
	}
}
