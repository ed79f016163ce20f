package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// qwenNext is a Qwen3-Next-like group set: one full-attention group and
// three recurrent groups keeping a checkpoint every `every` blocks.
func qwenNext(t testing.TB, numBlocks, bs, every int) *groupMem {
	t.Helper()
	rec := Group{Kind: Recurrent, StateBytes: 64, CheckpointEvery: every}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, BlockBytes: 64,
		Groups: []Group{{Kind: FullAttention}, rec, rec, rec}})
	must(t, err)
	m.TakeCopies(nil) // the engine takes copies
	return newGroupMem(m)
}

// finish removes sequence id and performs the copies its last step
// queued, as the engine's next step does.
func (gm *groupMem) finish(t testing.TB, id int64) {
	t.Helper()
	gm.remove(t, id)
	gm.takeCopies()
}

// growBlocks grows sequence id a block at a time, each step ending at a
// block's end (a checkpoint with every = 1), as an engine's decode does.
func (gm *groupMem) growBlocks(t testing.TB, r *rand.Rand, id int64, n int) {
	t.Helper()
	for range n {
		must(t, gm.grow(t, id, seqTokens(r, gm.m.BlockSize())))
		gm.m.MarkComputed()
	}
}

// Two conversations branch off a shared system prompt, with a state at
// every block of their histories. Pressure that the states inside the
// chains can pay for takes those: each conversation's next turn still
// resumes at the end of its history, and a new user still resumes at the
// end of the system prompt, each from its state (groupMem checks the
// copies). Evicting by age would have taken the older conversation whole.
func TestRecurrentPressureKeepsChainEndsAndBranches(t *testing.T) {
	const bs = 4
	gm := qwenNext(t, 64, bs, 1)
	r := rand.New(rand.NewPCG(21, 22))
	system := seqTokens(r, 16)
	gm.admit(t, 1, system) // a step that ends at the system prompt's end: its state
	gm.m.MarkComputed()
	gm.growBlocks(t, r, 1, 6)
	histA := slices.Clone(gm.toks[1])
	gm.finish(t, 1)
	if k := gm.admit(t, 2, append(slices.Clone(system), seqTokens(r, bs)...)); k != 16 {
		t.Fatalf("B matched %d tokens, want the system prompt's 16", k)
	}
	gm.m.MarkComputed()
	gm.growBlocks(t, r, 2, 5)
	histB := slices.Clone(gm.toks[2])
	gm.finish(t, 2)
	// 16 nodes, 13 states of 3 blocks: 55 cached, 9 free. The states
	// inside the two chains (a1-a5, b1-b5) are 30 blocks.
	if st := gm.m.Stats(); st.FreeBlocks != 9 {
		t.Fatalf("%d free blocks, want 9", st.FreeBlocks)
	}
	gm.admit(t, 3, seqTokens(r, 36*bs-1)) // 36 blocks and 3 states: 30 evicted; no checkpoint at its end
	gm.finish(t, 3)
	must(t, gm.m.CheckInvariants())
	for _, c := range []struct {
		name string
		toks []int32
		want int
	}{
		{"A's next turn", append(histA, seqTokens(r, 3)...), len(histA)},
		{"B's next turn", append(histB, seqTokens(r, 3)...), len(histB)},
		{"a new user", append(slices.Clone(system), seqTokens(r, 5)...), len(system)},
	} {
		if k := gm.admit(t, 4, c.toks); k != c.want {
			t.Fatalf("%s matched %d tokens after the pressure, want %d", c.name, k, c.want)
		}
		gm.check(t)
		gm.finish(t, 4)
	}
	must(t, gm.m.CheckInvariants())
}

// A node with no state at or below it resumes nothing: a recurrent model's
// blocks past a conversation's last state go before an older
// conversation's state, though they were released later.
func TestRecurrentSpentBlocksGoFirst(t *testing.T) {
	const bs = 4
	gm := qwenNext(t, 16, bs, 2)
	r := rand.New(rand.NewPCG(23, 24))
	a := seqTokens(r, 16) // 4 blocks: a state at 4 (every 2)
	gm.admit(t, 1, a)
	gm.finish(t, 1)
	gm.admit(t, 2, seqTokens(r, 14)) // 3 full blocks, no state: each spent
	gm.finish(t, 2)
	// A: 4 nodes and 3 checkpoints; B: 3 nodes; 6 free. 23 tokens need 6
	// blocks and 3 states: B's 3 spent blocks go, A's state stays.
	gm.admit(t, 3, seqTokens(r, 23))
	gm.finish(t, 3)
	if k := gm.admit(t, 4, append(slices.Clone(a), seqTokens(r, 2)...)); k != 16 {
		t.Fatalf("A's next turn matched %d tokens, want 16: its state was evicted", k)
	}
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// The deepest state of a chain stays while a live sequence holds the
// stateless blocks past it: a state is inner only when another state
// below it resumes the prompts that follow the chain. A (checkpoints
// every 2 blocks, 5 blocks long) has states at 2 and 4, and its block 5
// below them; C, idle, a state at its end. Pressure that two states' blocks
// would pay for takes A's state at 2 (the one at 4 resumes whatever it
// resumes) and then C's nodes, not A's state at 4: A, preempted, resumes
// at 16 tokens.
func TestRecurrentDeepestStateAboveALiveTailKept(t *testing.T) {
	const bs = 4
	gm := qwenNext(t, 24, bs, 2)
	r := rand.New(rand.NewPCG(29, 30))
	gm.admit(t, 1, seqTokens(r, 2*bs)) // A: a state at 2 blocks
	gm.m.MarkComputed()
	gm.growBlocks(t, r, 1, 3) // at 4; block 5 cached without one, A's
	histA := slices.Clone(gm.toks[1])
	gm.admit(t, 2, seqTokens(r, 2*bs)) // C: a state at 2 blocks
	gm.finish(t, 2)
	// A: 5 blocks, its 3 state blocks, 2 states of 3; C: 2 nodes and a
	// state: 19 of 24 blocks.
	if st := gm.m.Stats(); st.FreeBlocks != 5 {
		t.Fatalf("%d free blocks, want 5", st.FreeBlocks)
	}
	gm.admit(t, 3, seqTokens(r, 8*bs-1)) // 8 blocks and 3 states: 6 more than are free
	gm.finish(t, 3)
	must(t, gm.m.CheckInvariants())
	gm.remove(t, 1) // A preempted
	if k := gm.admit(t, 4, append(histA, seqTokens(r, 3)...)); k != 4*bs {
		t.Fatalf("A back after its preemption matched %d tokens, want %d: its state at 4 blocks was evicted", k, 4*bs)
	}
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// stateless caches a 16-token system prompt (block size 4, checkpoints at
// every block) without a state in it: one step computed it and 8 tokens
// more, so the only state is at 6 blocks.
func stateless(t *testing.T, seed uint64) (*groupMem, *rand.Rand, []int32) {
	t.Helper()
	gm := qwenNext(t, 64, 4, 1)
	r := rand.New(rand.NewPCG(seed, seed+1))
	system := seqTokens(r, 16)
	gm.admit(t, 1, append(slices.Clone(system), seqTokens(r, 8)...))
	gm.finish(t, 1)
	return gm, r, system
}

// A cached prefix without a state gets one from the next sequence that
// computes it: its blocks are private copies of the cached ones, and the
// state it reaches at their end is the cached twin's.
func TestRecurrentStateForACachedTwin(t *testing.T) {
	gm, r, system := stateless(t, 25)
	if k := gm.admit(t, 2, system); k != 0 {
		t.Fatalf("the system prompt alone matched %d tokens with no state in it", k)
	}
	gm.finish(t, 2) // its step ended at 16: the cached block 4 (its twin) takes its state
	if k := gm.admit(t, 3, append(slices.Clone(system), seqTokens(r, 3)...)); k != 16 {
		t.Fatalf("a new user matched %d tokens, want the system prompt's 16", k)
	}
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// A checkpoint noted for a sequence goes to its block only while the
// sequence is the one that noted it: an id removed and admitted again in
// the same step, by a prompt of the same length, is another sequence, and
// its state must not become the first one's cached twin's.
func TestRecurrentCheckpointOfAReusedID(t *testing.T) {
	gm, r, system := stateless(t, 27)
	gm.admit(t, 2, system) // private twins of the cached blocks, a checkpoint noted at 16
	must(t, gm.m.Remove([]int64{2}))
	delete(gm.toks, 2)
	gm.admit(t, 2, seqTokens(r, 16)) // another prompt of the same length, under the same id
	gm.finish(t, 2)
	// groupMem.write checks that the hit's state is the system prompt's.
	gm.admit(t, 3, append(slices.Clone(system), seqTokens(r, 3)...))
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// Random conversations after a shared system prompt over a small pool,
// with three recurrent groups (intervals drawn apart: a block where only
// some keep a checkpoint gets none) and forks: every hit's states hold
// what a run without the cache would (groupMem.write), the invariants
// (the states' classes and the spent marks among them) hold after every
// call, and hits happen.
func TestRecurrentEvictionRandom(t *testing.T) {
	for seed := range uint64(6) {
		r := rand.New(rand.NewPCG(seed, 77))
		bs := 1 + r.IntN(4)
		pool := 60 + r.IntN(100)
		groups := []Group{{Kind: FullAttention}}
		for range 3 {
			every := 1
			if seed%2 == 1 {
				every = 1 + r.IntN(2)
			}
			groups = append(groups, Group{Kind: Recurrent, StateBytes: 8, CheckpointEvery: every})
		}
		m, err := New(Config{NumBlocks: pool, BlockSize: bs, EnablePrefixCache: true, Groups: groups, BlockBytes: 8})
		must(t, err)
		gm := newGroupMem(m)
		m.TakeCopies(nil)
		system := seqTokens(r, 2*bs+r.IntN(3*bs))
		var convs [][]int32
		next := int64(1)
		hits := 0
		for range 400 {
			switch op := r.IntN(12); {
			case op < 3 && len(gm.toks) < 4:
				p := slices.Clone(system)
				if len(convs) > 0 && r.IntN(2) == 0 {
					p = slices.Clone(convs[r.IntN(len(convs))])
				}
				if r.IntN(4) == 0 && len(p) >= bs {
					// A cached prefix ending at a block's end: where it has
					// no state, its twin gets the one this step computes.
					p = p[:bs*(1+r.IntN(len(p)/bs))]
				} else {
					p = append(p, seqTokens(r, 1+r.IntN(3*bs))...)
				}
				if len(p) > pool*bs/6 {
					break
				}
				if k := gm.admit(t, next, p); k > 0 {
					hits++
				}
				next++
			case op < 9 && len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				if len(gm.toks[id]) < pool*bs/8 {
					n := bs - len(gm.toks[id])%bs // a step that ends at a block's end
					if r.IntN(3) == 0 {
						n = 1 + r.IntN(2*bs)
					}
					_ = gm.grow(t, id, seqTokens(r, n))
				}
				gm.m.MarkComputed()
			case op < 10 && len(gm.toks) > 0 && len(gm.toks) < 4:
				id := pickKey(r, gm.toks)
				gm.m.MarkComputed()
				buf := make([]CopyPair, gm.m.forkCopies(true))
				n, err := gm.m.Fork(id, []int64{next}, buf)
				if err != nil {
					break
				}
				// The engine's copies: the child's partial last block and
				// its states are the parent's.
				for _, p := range buf[:n] {
					for _, mem := range gm.mem {
						for r := range int32(bs) {
							if v, ok := mem[p.Src*int32(bs)+r]; ok {
								mem[p.Dst*int32(bs)+r] = v
							}
						}
					}
					gm.state[p.Dst] = gm.state[p.Src]
				}
				gm.toks[next] = slices.Clone(gm.toks[id])
				next++
			case len(gm.toks) > 0:
				id := pickKey(r, gm.toks)
				convs = append(convs, gm.toks[id])
				gm.remove(t, id)
			}
		}
		if hits == 0 {
			t.Fatalf("seed %d: no prompt hit", seed)
		}
		for id := range gm.toks {
			gm.remove(t, id)
		}
		gm.takeCopies()
		if _, err := gm.m.ClearPrefixCache(); err != nil {
			t.Fatal(err)
		}
		if st := gm.m.Stats(); st.FreeBlocks != st.NumBlocks {
			t.Fatalf("seed %d: %d of %d free after clearing", seed, st.FreeBlocks, st.NumBlocks)
		}
	}
}
