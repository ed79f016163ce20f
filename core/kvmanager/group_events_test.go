package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
)

// groupMirror is a router's view of a manager of layer groups, built from
// its KV events alone (DrainGroupEvents), and the hit it predicts from
// that view with what a router knows of the model: the block size and the
// groups' kinds and windows.
type groupMirror struct {
	m      *Manager
	x      *prefix.EventIndex
	groups []Group // group 0 included
	bs     int
	h      prefix.Hasher
	r      *rand.Rand
	events int // events applied
	// alone counts the blocks of groups past 0 removed while their group 0
	// block stayed cached; cut the prompts whose hit the other groups cut.
	alone, cut int
}

func newGroupMirror(m *Manager, groups []Group, r *rand.Rand) *groupMirror {
	return &groupMirror{m: m, x: prefix.NewEventIndex(), groups: groups, bs: m.BlockSize(), r: r}
}

// drain applies every pending event of every group, drained with small
// random limits (grown on BufferTooSmall to NextGroupEventSize's answer),
// so that split removals and partial drains are part of the run.
func (mr *groupMirror) drain(t testing.TB) {
	t.Helper()
	for {
		lim := EventLimits{Events: 1 + mr.r.IntN(6), Tokens: mr.r.IntN(3 * mr.bs), MM: 0, Hashes: mr.r.IntN(4)}
		evs, err := mr.m.DrainGroupEvents(lim)
		if kverr.CodeOf(err) == kverr.BufferTooSmall {
			size, ok, err := mr.m.NextGroupEventSize()
			must(t, err)
			if !ok {
				t.Fatal("drain group events: BufferTooSmall with no event pending")
			}
			lim.Tokens, lim.MM, lim.Hashes = max(lim.Tokens, size.Tokens), max(lim.MM, size.MM), max(lim.Hashes, size.Hashes)
			evs, err = mr.m.DrainGroupEvents(lim)
			if err != nil || len(evs) == 0 {
				t.Fatalf("drain group events with the room NextGroupEventSize gave (%+v): %d events, %v", size, len(evs), err)
			}
		} else {
			must(t, err)
		}
		if len(evs) == 0 {
			return
		}
		for _, ev := range evs {
			if ev.Group < 0 || ev.Group >= len(mr.groups) {
				t.Fatalf("an event of group %d in a manager of %d groups", ev.Group, len(mr.groups))
			}
			if ev.Kind == prefix.BlockRemoved && ev.Group > 0 {
				for _, h := range ev.Hashes {
					if mr.x.Contains(h) {
						mr.alone++
					}
				}
			}
			if err := mr.x.Apply(ev); err != nil {
				t.Fatalf("event %d (%v of group %d): %v", mr.events, ev.Kind, ev.Group, err)
			}
			mr.events++
		}
	}
}

// hit is the hit the mirror predicts for a prompt, in tokens: the largest
// h, at most group 0's longest cached prefix in full blocks (never the
// prompt's last token), for which every window group holds the blocks its
// query at h*bs reads and every recurrent group holds the state after
// block h-1 (groups false: group 0's prefix alone).
func (mr *groupMirror) hit(t testing.TB, prompt []int32, groups bool) int {
	t.Helper()
	n := 0
	if len(prompt) > 0 {
		n = (len(prompt) - 1) / mr.bs
	}
	hs, err := mr.h.Chain(nil, prompt[:n*mr.bs], mr.bs, nil)
	must(t, err)
	h := 0
	for h < len(hs) && mr.x.Contains(hs[h]) {
		h++
	}
	if !groups {
		return h * mr.bs
	}
	// The largest such h at which every group holds what the header's
	// rule asks ("KV events of layer groups"), found by trying each.
	for ; h > 0; h-- {
		ok := true
		for g, grp := range mr.groups {
			switch grp.Kind {
			case SlidingWindow:
				for j := max(0, h*mr.bs-grp.Window+1) / mr.bs; j < h; j++ {
					ok = ok && mr.x.ContainsGroup(g, hs[j])
				}
			case Recurrent:
				ok = ok && mr.x.ContainsGroup(g, hs[h-1])
			}
		}
		if ok {
			break
		}
	}
	return h * mr.bs
}

// check drains the events and compares the mirror with the manager: every
// group's set of blocks, and the hit of every prompt given.
func (mr *groupMirror) check(t testing.TB, prompts [][]int32) {
	t.Helper()
	mr.drain(t)
	if got, want := mr.x.Len(), mr.m.PrefixStats().CachedBlocks; got != want {
		t.Fatalf("the events say %d blocks are cached, the manager %d", got, want)
	}
	for g := 1; g < len(mr.groups); g++ {
		held := 0
		for _, c := range mr.m.gc.comp[g-1] {
			if c != NoBlock {
				held++
			}
		}
		if got := mr.x.LenGroup(g); got != held {
			t.Fatalf("the events say group %d keeps %d blocks, the manager %d", g, got, held)
		}
		if mr.groups[g].Kind == FullAttention && held != mr.x.Len() {
			t.Fatalf("full-attention group %d keeps %d blocks of %d cached", g, held, mr.x.Len())
		}
	}
	out := make([]MatchInfo, 1)
	for _, p := range prompts {
		must(t, mr.m.Match(Prompts{Tokens: p, Offsets: []int64{0, int64(len(p))}}, false, out))
		got, alone := mr.hit(t, p, true), mr.hit(t, p, false)
		if got != int(out[0].Tokens) {
			t.Fatalf("prompt of %d tokens: the events predict a hit of %d tokens, the manager hits %d (group 0 alone predicts %d)",
				len(p), got, out[0].Tokens, alone)
		}
		if got < alone {
			mr.cut++
		}
	}
}

// A conversation whose interior window blocks were evicted alone: group
// 0's events alone predict the whole history for a prompt that diverges
// in it, every group's events predict the hit the manager gives, and the
// old drain reports group 0's events only.
func TestGroupEventsWindowEvictedAlone(t *testing.T) {
	const bs, w = 4, 8
	groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: w}}
	m, err := New(Config{NumBlocks: 40, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true, Groups: groups})
	must(t, err)
	gm := newGroupMem(m)
	mr := newGroupMirror(m, groups, rand.New(rand.NewPCG(1, 1)))
	r := rand.New(rand.NewPCG(3, 4))
	gm.admit(t, 1, seqTokens(r, 40)) // 10 blocks a group
	must(t, gm.grow(t, 1, seqTokens(r, 1)))
	hist := slices.Clone(gm.toks[1])
	gm.remove(t, 1)
	gm.admit(t, 2, seqTokens(r, 48)) // evicts 4 window blocks behind the first conversation's window
	gm.remove(t, 2)
	// Diverges after block 4: its query there reads window blocks 2 and 3,
	// evicted with 0 and 1.
	interior := append(slices.Clone(hist[:16]), seqTokens(r, 5)...)
	mr.check(t, [][]int32{hist, interior, append(slices.Clone(hist), 1, 2, 3)})
	if alone, hit := mr.hit(t, interior, false), mr.hit(t, interior, true); alone != 16 || hit != 0 {
		t.Fatalf("the interior prompt: group 0 predicts %d tokens, every group %d; want 16 and 0", alone, hit)
	}
	// The old drain on a second, identical run: group 0's events only,
	// enough to rebuild group 0's view.
	m2, err := New(Config{NumBlocks: 40, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true, Groups: groups})
	must(t, err)
	gm2 := newGroupMem(m2)
	r = rand.New(rand.NewPCG(3, 4))
	gm2.admit(t, 1, seqTokens(r, 40))
	must(t, gm2.grow(t, 1, seqTokens(r, 1)))
	gm2.remove(t, 1)
	gm2.admit(t, 2, seqTokens(r, 48))
	gm2.remove(t, 2)
	x := prefix.NewEventIndex()
	for {
		size, ok, err := m2.NextEventSize()
		must(t, err)
		evs, err := m2.DrainEvents(EventLimits{Events: 3, Tokens: 3 * bs, Hashes: 2})
		must(t, err)
		if ok != (len(evs) > 0) || ok && evs[0].Kind == prefix.BlockStored && size.Tokens != bs {
			t.Fatalf("next event size %+v (%v), then %d events", size, ok, len(evs))
		}
		if len(evs) == 0 {
			break
		}
		for _, ev := range evs {
			if ev.Group != 0 {
				t.Fatalf("DrainEvents returned an event of group %d", ev.Group)
			}
			must(t, x.Apply(ev))
		}
	}
	if x.Len() != m2.PrefixStats().CachedBlocks || m2.PrefixStats().PendingEvents != 0 {
		t.Fatalf("group 0's events rebuild %d blocks of %d; %d events still pending", x.Len(), m2.PrefixStats().CachedBlocks, m2.PrefixStats().PendingEvents)
	}
}

// Random conversations over a small pool, with window, full and (odd
// seeds) recurrent groups: at random points the mirror built from the
// events holds every group's set of blocks and predicts the manager's
// hit for every prompt of a set (whole histories, their continuations,
// prompts that diverge inside them, unrelated ones), through evictions of
// nodes and of window blocks and checkpoints alone, removals of
// uncomputed blocks, queue overflows (a snapshot follows), requested
// snapshots and cache clears.
func TestGroupEventsMirrorPredictsHits(t *testing.T) {
	for seed := range uint64(10) {
		r := rand.New(rand.NewPCG(seed, 7))
		bs := 1 + r.IntN(6)
		pool := 120 + r.IntN(160)
		groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: 1 + r.IntN(12)},
			{Kind: SlidingWindow, Window: 1 + r.IntN(30)}, {Kind: FullAttention}}
		if seed%2 == 1 {
			groups = append(groups, Group{Kind: Recurrent, StateBytes: 8, CheckpointEvery: 1 + r.IntN(3)})
		}
		maxPending, every := 0, 7
		if seed%3 == 2 {
			// Raised to the pool plus one, which rare checks overflow.
			maxPending, every = 1, 80
		}
		m, err := New(Config{NumBlocks: pool, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true,
			MaxPendingEvents: maxPending, Groups: groups, BlockBytes: 8})
		must(t, err)
		gm := newGroupMem(m)
		mr := newGroupMirror(m, groups, rand.New(rand.NewPCG(seed, 8)))
		m.TakeCopies(nil)
		system := seqTokens(r, r.IntN(20))
		var convs [][]int32
		next := int64(1)
		prompts := func() [][]int32 {
			ps := [][]int32{append(slices.Clone(system), seqTokens(r, 1+r.IntN(9))...), seqTokens(r, 1+r.IntN(40))}
			for _, c := range convs[max(0, len(convs)-12):] {
				ps = append(ps, c, append(slices.Clone(c), seqTokens(r, 1+r.IntN(bs+2))...))
				if cut := r.IntN(len(c) + 1); cut > 0 {
					ps = append(ps, append(slices.Clone(c[:cut]), seqTokens(r, 1+r.IntN(3))...))
				}
			}
			for _, toks := range gm.toks {
				ps = append(ps, append(slices.Clone(toks), seqTokens(r, 1)...))
			}
			return ps
		}
		checks := 0
		for step := range 400 {
			switch op := r.IntN(20); {
			case op < 6 && len(gm.toks) < 6:
				var p []int32
				if len(convs) > 0 && r.IntN(2) == 0 {
					c := convs[r.IntN(len(convs))]
					p = append(slices.Clone(c), seqTokens(r, 1+r.IntN(10))...)
				} else {
					p = append(slices.Clone(system), seqTokens(r, 1+r.IntN(20))...)
				}
				if len(p) > pool*bs/8 {
					break
				}
				gm.admit(t, next, p)
				next++
			case op < 15 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				if len(gm.toks[id]) < pool*bs/16 {
					n := 1 + r.IntN(5)*r.IntN(2)
					if seed%2 == 1 && r.IntN(2) == 0 {
						n = bs - len(gm.toks[id])%bs // ends at a block's end: a checkpoint
					}
					_ = gm.grow(t, id, seqTokens(r, n))
				}
				gm.m.MarkComputed()
			case op < 18 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				convs = append(convs, gm.toks[id])
				if r.IntN(4) == 0 {
					// Before the step's mark: its blocks filled since leave
					// the cache (or the removal is refused while another
					// sequence shares them).
					if err := m.Remove([]int64{id}); err == nil {
						delete(gm.toks, id)
						break
					} else if !kverr.Is(err, kverr.InUse) {
						t.Fatal(err)
					}
				}
				gm.remove(t, id)
			case op == 18:
				must(t, m.RequestEventSnapshot())
			case op == 19 && len(gm.toks) == 0 && r.IntN(3) == 0:
				_, err := m.ClearPrefixCache()
				must(t, err)
			}
			for _, l := range m.gc.gone {
				if len(l) > 0 {
					t.Fatal("removals gathered and not recorded")
				}
			}
			if step%every == 0 || every < 10 && r.IntN(10) == 0 {
				mr.check(t, prompts())
				checks++
			}
		}
		if checks == 0 {
			t.Fatalf("seed %d: no check", seed)
		}
		if st := m.PrefixStats(); maxPending > 0 && st.EventsDropped == 0 {
			t.Fatalf("seed %d: the queue bound never dropped events", seed)
		}
		for id := range gm.toks {
			gm.remove(t, id)
		}
		mr.check(t, prompts())
		_, err = m.ClearPrefixCache()
		must(t, err)
		mr.check(t, nil)
		if mr.x.Len() != 0 || mr.x.LenGroup(1) != 0 {
			t.Fatalf("seed %d: after clearing, the events leave %d blocks, %d in group 1", seed, mr.x.Len(), mr.x.LenGroup(1))
		}
		if every < 10 && (mr.alone == 0 || mr.cut == 0) {
			t.Fatalf("seed %d: %d blocks of groups past 0 removed alone, %d hits cut by them: the run tests nothing", seed, mr.alone, mr.cut)
		}
		t.Logf("seed %d: %d events, %d checks, %d blocks removed alone, %d hits cut", seed, mr.events, checks, mr.alone, mr.cut)
	}
}

// A manager without layer groups: DrainGroupEvents returns what
// DrainEvents would, every event of group 0.
func TestGroupEventsWithoutGroups(t *testing.T) {
	run := func(all bool) []prefix.Event {
		m, r, _ := newAdmitted(t, 16, true, 5, 6, 5*4+1)
		m.MarkComputed()
		must(t, m.Remove([]int64{1}))
		admit(t, m, 2, seqTokens(r, 15*4), nil)
		var out []prefix.Event
		for {
			var evs []prefix.Event
			var err error
			if all {
				evs, err = m.DrainGroupEvents(EventLimits{Events: 2, Tokens: 8, Hashes: 3})
			} else {
				evs, err = m.DrainEvents(EventLimits{Events: 2, Tokens: 8, Hashes: 3})
			}
			must(t, err)
			if len(evs) == 0 {
				return out
			}
			out = append(out, evs...)
		}
	}
	a, b := run(false), run(true)
	if len(a) == 0 || len(a) != len(b) {
		t.Fatalf("%d events from DrainEvents, %d from DrainGroupEvents", len(a), len(b))
	}
	for i := range a {
		if a[i].Kind != b[i].Kind || a[i].Hash != b[i].Hash || !slices.Equal(a[i].Hashes, b[i].Hashes) || b[i].Group != 0 {
			t.Fatalf("event %d: %+v and %+v", i, a[i], b[i])
		}
	}
}
