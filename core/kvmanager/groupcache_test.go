package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// groupMem is what an engine's K/V writes leave in every attention group's
// slots: the token each slot holds. It checks that the blocks a sequence's
// tables name hold that sequence's tokens, whoever wrote them (a prefix
// hit reuses another sequence's blocks).
type groupMem struct {
	m    *Manager
	mem  []map[int32]int32 // per group: slot -> token
	toks map[int64][]int32 // each live sequence's tokens
	// A recurrent group's state blocks: the tokens (as a string) whose
	// state each holds; what the engine's copies and forward passes do.
	state map[int32]string
}

// stateOf names the state after toks.
func stateOf(toks []int32) string { return fmt.Sprint(toks) }

func newGroupMem(m *Manager) *groupMem {
	gm := &groupMem{m: m, toks: map[int64][]int32{}, state: map[int32]string{}}
	for range m.NumGroups() {
		gm.mem = append(gm.mem, map[int32]int32{})
	}
	return gm
}

// takeCopies performs the queued copies as an engine does, a few at a time.
func (gm *groupMem) takeCopies() {
	var buf [3]CopyPair
	for {
		n, left := gm.m.TakeCopies(buf[:])
		for _, p := range buf[:n] {
			gm.state[p.Dst] = gm.state[p.Src]
		}
		if left == 0 {
			return
		}
	}
}

// write runs sequence id's step as an engine would: the queued copies
// (TakeCopies, a few at a time), then its new tokens' K/V writes and its
// recurrent states' update, after checking that each state block holds the
// state after the tokens before the new ones.
func (gm *groupMem) write(t testing.TB, id int64) {
	t.Helper()
	gm.takeCopies()
	tabs, slots := describeGroups(t, gm.m, id, 1<<12)
	toks := gm.toks[id]
	fresh := len(slots[0])
	for g, sl := range slots {
		if g > 0 && gm.m.groups.extra[g-1].Kind == Recurrent {
			b, before := tabs[g][0], toks[:len(toks)-fresh]
			if got, ok := gm.state[b]; len(before) > 0 && (!ok || got != stateOf(before)) {
				t.Fatalf("sequence %d's state block %d holds the state after %.60s, want after %d tokens %.60s", id, b, got, len(before), stateOf(before))
			}
			gm.state[b] = stateOf(toks)
			continue
		}
		for k, s := range sl {
			gm.mem[g][s] = toks[len(toks)-len(sl)+k]
		}
	}
}

// check verifies every live sequence's attention-group blocks against its
// tokens: every entry a query may still read holds the right token in
// each of its filled rows.
func (gm *groupMem) check(t testing.TB) {
	t.Helper()
	bs := int32(gm.m.BlockSize())
	for id, toks := range gm.toks {
		tabs, _ := describeGroups(t, gm.m, id, 1<<12)
		for g, row := range tabs {
			if g > 0 && gm.m.groups.extra[g-1].Kind == Recurrent {
				continue
			}
			for j, b := range row {
				if b == NoBlock {
					continue
				}
				for r := int32(0); r < bs && int(int32(j)*bs+r) < len(toks); r++ {
					pos := int32(j)*bs + r
					if got, ok := gm.mem[g][b*bs+r]; !ok || got != toks[pos] {
						t.Fatalf("sequence %d group %d: block %d row %d holds %d (written %v), token %d is %d", id, g, b, r, got, ok, pos, toks[pos])
					}
				}
			}
		}
	}
}

func (gm *groupMem) admit(t testing.TB, id int64, toks []int32) int {
	t.Helper()
	matched := make([]int32, 1)
	n, err := gm.m.Admit([]int64{id}, Prompts{Tokens: toks, Offsets: []int64{0, int64(len(toks))}}, matched)
	must(t, err)
	if n != 1 {
		return -1
	}
	gm.toks[id] = slices.Clone(toks)
	gm.write(t, id)
	return int(matched[0])
}

func (gm *groupMem) grow(t testing.TB, id int64, toks []int32) error {
	t.Helper()
	if err := gm.m.GrowTokens([]int64{id}, []int32{int32(len(toks))}, toks); err != nil {
		return err
	}
	gm.toks[id] = append(gm.toks[id], toks...)
	gm.write(t, id)
	return nil
}

func (gm *groupMem) remove(t testing.TB, id int64) {
	t.Helper()
	gm.m.MarkComputed()
	must(t, gm.m.Remove([]int64{id}))
	delete(gm.toks, id)
}

func newCachedGroups(t testing.TB, numBlocks, bs int, groups ...Group) *groupMem {
	t.Helper()
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, Groups: groups})
	if err != nil {
		t.Fatal(err)
	}
	return newGroupMem(m)
}

// A conversation's next turn hits its whole history in every group, its
// window tables starting with the blocks the window has passed dropped.
func TestGroupCacheHitsTheNextTurn(t *testing.T) {
	const bs, w = 4, 8
	gm := newCachedGroups(t, 64, bs, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w}, Group{Kind: FullAttention})
	r := rand.New(rand.NewPCG(1, 2))
	turn1 := seqTokens(r, 22)
	if k := gm.admit(t, 1, turn1); k != 0 {
		t.Fatalf("first turn matched %d", k)
	}
	for range 10 {
		must(t, gm.grow(t, 1, seqTokens(r, 1)))
	}
	gm.check(t)
	hist := slices.Clone(gm.toks[1])
	gm.remove(t, 1)
	turn2 := append(slices.Clone(hist), seqTokens(r, 9)...)
	k := gm.admit(t, 2, turn2)
	if want := len(hist) / bs * bs; k != want {
		t.Fatalf("next turn matched %d tokens, want %d", k, want)
	}
	tabs, _ := describeGroups(t, gm.m, 2, 64)
	h := k / bs
	keep := gm.m.keepFrom(k, w)
	for j := range h {
		if (tabs[1][j] == NoBlock) != (j < keep) || tabs[0][j] == NoBlock || tabs[2][j] == NoBlock {
			t.Fatalf("entry %d of the hit (keep from %d): %v", j, keep, [][]int32{tabs[0][:h], tabs[1][:h], tabs[2][:h]})
		}
	}
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// Under pressure, the window blocks a conversation slid past go first and
// the ones its next turn reads stay: the turn still hits its history
// while blocks of its interior were given to others.
func TestGroupCacheEvictsBehindWindowsFirst(t *testing.T) {
	const bs, w = 4, 8
	gm := newCachedGroups(t, 40, bs, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w})
	r := rand.New(rand.NewPCG(3, 4))
	gm.admit(t, 1, seqTokens(r, 40)) // 10 blocks a group
	must(t, gm.grow(t, 1, seqTokens(r, 1)))
	hist := slices.Clone(gm.toks[1])
	gm.remove(t, 1)
	gc := gm.m.gc
	// The grow dropped window blocks 0-7 (behind); the remove released 8
	// and 9 (kept) and the partial 11th (private, freed).
	if gc.listed != 10 {
		t.Fatalf("%d window blocks listed, want 10", gc.listed)
	}
	st := gm.m.Stats()
	if st.FreeBlocks != 40-20 {
		t.Fatalf("free %d", st.FreeBlocks)
	}
	// Another prompt needs 12 blocks a group, 24 in all: 20 free and 4
	// of the 8 behind blocks.
	gm.admit(t, 2, seqTokens(r, 48))
	if gc.listed != 6 || gm.m.cache.Len() != 10+12 {
		t.Fatalf("after the pressure: %d listed, %d cached nodes", gc.listed, gm.m.cache.Len())
	}
	gm.remove(t, 2)
	k := gm.admit(t, 3, append(slices.Clone(hist), seqTokens(r, 3)...))
	if k != 40 {
		t.Fatalf("the next turn matched %d tokens, want 40", k)
	}
	gm.check(t)
}

// A hit point keeps the window blocks its queries read: a shared system
// prompt's last window blocks stay through pressure that takes the blocks
// behind conversations, so every later user hits it.
func TestGroupCacheKeepsHitPointWindows(t *testing.T) {
	const bs, w = 4, 8
	gm := newCachedGroups(t, 48, bs, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: w})
	r := rand.New(rand.NewPCG(5, 6))
	system := seqTokens(r, 16)
	user := func() []int32 { return append(slices.Clone(system), seqTokens(r, 17)...) }
	gm.admit(t, 1, user())
	must(t, gm.grow(t, 1, seqTokens(r, 1)))
	gm.remove(t, 1)
	if k := gm.admit(t, 2, user()); k != 16 {
		t.Fatalf("the second user matched %d, want the system prompt's 16", k)
	}
	must(t, gm.grow(t, 2, seqTokens(r, 1))) // slides past the system prompt: kept, a hit point reads it
	gm.remove(t, 2)
	// Pressure: a long unrelated prompt takes every behind block and
	// every evictable node but the system prompt's chain is reached last.
	gm.admit(t, 3, seqTokens(r, 4*18))
	gm.remove(t, 3)
	if k := gm.admit(t, 4, user()); k != 16 {
		t.Fatalf("a user after the pressure matched %d, want 16", k)
	}
	gm.check(t)
}

// Random conversations over a small pool with shared prefixes: every
// block a table names holds its sequence's tokens in every group (a hit
// never reuses a window block that was overwritten), the invariants hold
// after every call, and hits happen.
func TestGroupCacheRandomConversations(t *testing.T) {
	for seed := range uint64(8) {
		r := rand.New(rand.NewPCG(seed, 99))
		bs := 1 + r.IntN(6)
		pool := 160 + r.IntN(160)
		groups := []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: 1 + r.IntN(12)},
			{Kind: SlidingWindow, Window: 1 + r.IntN(30)}, {Kind: FullAttention}}
		if seed%2 == 1 { // a recurrent group too: its states checked at every step (groupMem.write)
			groups = append(groups, Group{Kind: Recurrent, StateBytes: 8, CheckpointEvery: 1 + r.IntN(3)})
		}
		m, err := New(Config{NumBlocks: pool, BlockSize: bs, EnablePrefixCache: true, Groups: groups, BlockBytes: 8})
		must(t, err)
		gm := newGroupMem(m)
		m.TakeCopies(nil)
		system := seqTokens(r, r.IntN(20))
		var convs [][]int32
		next := int64(1)
		hits := 0
		for range 300 {
			switch op := r.IntN(10); {
			case op < 3 && len(gm.toks) < 6:
				var p []int32
				if len(convs) > 0 && r.IntN(2) == 0 {
					c := r.IntN(len(convs))
					p = append(slices.Clone(convs[c]), seqTokens(r, 1+r.IntN(10))...)
				} else {
					p = append(slices.Clone(system), seqTokens(r, 1+r.IntN(20))...)
				}
				if len(p) > pool*bs/8 {
					break // four groups of it would crowd the pool
				}
				if k := gm.admit(t, next, p); k > 0 {
					hits++
				}
				next++
			case op < 8 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				if len(gm.toks[id]) < pool*bs/16 { // room for a continuation to be admitted
					n := 1 + r.IntN(5)*r.IntN(2)
					if seed%2 == 1 && r.IntN(2) == 0 {
						n = bs - len(gm.toks[id])%bs // a step that ends at a block's end: a checkpoint
					}
					_ = gm.grow(t, id, seqTokens(r, n))
				}
				gm.m.MarkComputed()
			case len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				convs = append(convs, gm.toks[id])
				gm.remove(t, id)
			}
			gm.check(t)
			must(t, gm.m.CheckInvariants())
		}
		if hits == 0 {
			t.Fatalf("seed %d: no prompt hit", seed)
		}
		for id := range gm.toks {
			gm.remove(t, id)
		}
		gm.takeCopies() // the copies still queued hold their blocks until the engine takes them
		if _, err := gm.m.ClearPrefixCache(); err != nil {
			t.Fatal(err)
		}
		if st := gm.m.Stats(); st.FreeBlocks != st.NumBlocks {
			t.Fatalf("seed %d: %d of %d free after clearing", seed, st.FreeBlocks, st.NumBlocks)
		}
	}
}

// A recurrent model's next turn hits up to the last checkpoint of its
// history, and its new state block gets the checkpoint's state (the engine
// performs the queued copies): the step after the hit starts from exactly
// the state a run without the cache would have.
func TestGroupCacheRecurrentCheckpoints(t *testing.T) {
	const bs = 4
	m, err := New(Config{NumBlocks: 64, BlockSize: bs, EnablePrefixCache: true, BlockBytes: 64,
		Groups: []Group{{Kind: FullAttention}, {Kind: Recurrent, StateBytes: 64, CheckpointEvery: 2}, {Kind: SlidingWindow, Window: 6}}})
	must(t, err)
	gm := newGroupMem(m)
	m.TakeCopies(nil) // the engine's first, with nothing queued: it takes copies
	r := rand.New(rand.NewPCG(11, 12))
	gm.admit(t, 1, seqTokens(r, 16)) // ends at block 4: a checkpoint (every 2)
	gm.m.MarkComputed()
	for range 5 { // to 21 tokens: ends at 17-21, no checkpoint
		must(t, gm.grow(t, 1, seqTokens(r, 1)))
		gm.m.MarkComputed()
	}
	hist := slices.Clone(gm.toks[1])
	gm.remove(t, 1)
	if k := gm.admit(t, 2, append(slices.Clone(hist), seqTokens(r, 2)...)); k != 16 {
		t.Fatalf("the next turn matched %d tokens, want the 16 of the checkpoint", k)
	}
	gm.check(t)
	// Its step ran from the checkpoint's state (write checked it); a grow to
	// 24 tokens ends at block 6: another checkpoint, taken at MarkComputed.
	gm.m.MarkComputed()
	must(t, gm.grow(t, 2, seqTokens(r, 24-len(gm.toks[2]))))
	gm.m.MarkComputed()
	hist = slices.Clone(gm.toks[2])
	gm.remove(t, 2)
	if k := gm.admit(t, 3, append(slices.Clone(hist), seqTokens(r, 1)...)); k != 24 {
		t.Fatalf("matched %d tokens, want 24", k)
	}
	gm.m.MarkComputed()
	must(t, gm.grow(t, 3, seqTokens(r, 1)))
	must(t, gm.m.CheckInvariants())
}

// Without an engine that takes copies, no checkpoint is taken and a
// recurrent model never hits: never a hit without its state.
func TestGroupCacheNoCheckpointsWithoutTakes(t *testing.T) {
	m, err := New(Config{NumBlocks: 64, BlockSize: 4, EnablePrefixCache: true, BlockBytes: 64,
		Groups: []Group{{Kind: FullAttention}, {Kind: Recurrent, StateBytes: 64, CheckpointEvery: 1}}})
	must(t, err)
	toks := seqTokens(rand.New(rand.NewPCG(1, 1)), 17)
	n, err := m.Admit([]int64{1}, Prompts{Tokens: toks[:16], Offsets: []int64{0, 16}}, nil)
	if err != nil || n != 1 {
		t.Fatal(n, err)
	}
	m.MarkComputed()
	must(t, m.Remove([]int64{1}))
	matched := make([]int32, 1)
	if _, err := m.Admit([]int64{2}, Prompts{Tokens: toks, Offsets: []int64{0, 17}}, matched); err != nil || matched[0] != 0 {
		t.Fatalf("matched %d (%v) with no checkpoint", matched[0], err)
	}
}

// A queued copy's blocks stay the copy's until TakeCopies hands it to the
// engine. A prefix hit's checkpoint is not among the blocks its own
// admission may evict (its state would come from a block that no longer
// holds it), and a checkpoint's copy keeps its source (the sequence's state
// block) and its destination through the sequence's removal and through an
// admission short of blocks before the engine takes the copy.
func TestQueuedCopiesHoldTheirBlocks(t *testing.T) {
	rec := Group{Kind: Recurrent, StateBytes: 64, CheckpointEvery: 1}
	t.Run("a hit's checkpoint under pressure", func(t *testing.T) {
		m, err := New(Config{NumBlocks: 16, BlockSize: 8, EnablePrefixCache: true, BlockBytes: 64,
			Groups: []Group{{Kind: FullAttention}, rec, rec, rec}})
		must(t, err)
		gm := newGroupMem(m)
		gm.m.TakeCopies(nil)
		r := rand.New(rand.NewPCG(9, 9))
		a, d := seqTokens(r, 16), seqTokens(r, 16)
		gm.admit(t, 1, a) // a checkpoint at 16 (a block per recurrent group), queued at MarkComputed
		gm.remove(t, 1)
		gm.admit(t, 2, d) // performs A's checkpoint copies; D's follow at its MarkComputed
		gm.m.MarkComputed()
		b := append(slices.Clone(a), seqTokens(r, 8)...)
		// B needs 4 blocks; 3 are free, and what else could go is A's
		// checkpoint (its hit's) and D's (their copies not taken yet).
		if k := gm.admit(t, 3, b); k != -1 {
			t.Fatalf("B admitted on %d tokens with only the copies' and its hit's blocks to evict", k)
		}
		must(t, gm.m.CheckInvariants())
		got := make([]MatchInfo, 1)
		must(t, gm.m.Match(Prompts{Tokens: b, Offsets: []int64{0, int64(len(b))}}, false, got))
		if got[0].Tokens != 16 {
			t.Fatalf("after the refused admission B matches %d tokens, want A's 16", got[0].Tokens)
		}
		gm.takeCopies() // the engine's step: D's checkpoints become evictable
		if k := gm.admit(t, 3, b); k != 16 {
			t.Fatalf("B matched %d tokens, want A's 16 (its checkpoint kept, D's evicted)", k)
		}
		// gm.admit's write checked that B's state blocks hold A's state.
		gm.check(t)
		must(t, gm.m.CheckInvariants())
	})
	t.Run("a checkpoint's copy through a removal and an eviction", func(t *testing.T) {
		m, err := New(Config{NumBlocks: 12, BlockSize: 4, EnablePrefixCache: true, BlockBytes: 64,
			Groups: []Group{{Kind: FullAttention}, rec}})
		must(t, err)
		m.TakeCopies(nil)
		r := rand.New(rand.NewPCG(3, 4))
		x := seqTokens(r, 8)
		if n, err := m.Admit([]int64{1}, Prompts{Tokens: x, Offsets: []int64{0, 8}}, nil); err != nil || n != 1 {
			t.Fatal(n, err)
		}
		tabs, _ := describeGroups(t, m, 1, 1<<12)
		state := tabs[1][0]
		m.MarkComputed() // queues X's state into a checkpoint at 8
		must(t, m.Remove([]int64{1}))
		must(t, m.CheckInvariants())
		// Y takes every block an admission can get; the copy's two blocks are not among them.
		y := seqTokens(r, 4*8)
		n, err := m.Admit([]int64{2}, Prompts{Tokens: y, Offsets: []int64{0, int64(len(y))}}, nil)
		must(t, err)
		var held []int32
		if n == 1 {
			tabs, _ := describeGroups(t, m, 2, 1<<12)
			held = append(slices.Clone(tabs[0]), tabs[1]...)
		}
		must(t, m.CheckInvariants())
		var buf [4]CopyPair
		k, left := m.TakeCopies(buf[:])
		if k != 1 || left != 0 || buf[0].Src != state {
			t.Fatalf("copies %v (%d left), want X's state block %d into its checkpoint", buf[:k], left, state)
		}
		if slices.Contains(held, buf[0].Src) || slices.Contains(held, buf[0].Dst) {
			t.Fatalf("Y's tables hold a block of the queued copy %v", buf[0])
		}
		must(t, m.CheckInvariants())
		if got := m.Stats(); n == 0 && got.FreeBlocks == 0 {
			t.Fatalf("the copy taken, its source is still held: %+v", got)
		}
	})
}
