package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// chunkEnd is where an engine's step over tokens start .. end-1 stops with
// a checkpoint every period tokens (kvplug.hf's chunk_end): at stop (the
// end of the cached blocks past the hit) when it lies inside, else at the
// last boundary past start when end is not one.
func chunkEnd(start, end, period, stop int) int {
	if start < stop && stop < end {
		return stop
	}
	if end%period != 0 && end-end%period > start {
		return end - end%period
	}
	return end
}

// sharedSystemRun serves n requests sharing a 10-block system prompt over
// a Qwen3-Next-like group set (three recurrent groups, a checkpoint every
// block of 4) in a pool of pool blocks, at most live at a time, as
// kvplug.hf's engine does: a request is admitted on its prefix hit with a
// first chunk that ends where the cached blocks end (MatchBlocks), its
// prompt is computed in chunks ending at block ends, its output decoded a
// token a step; a sequence the pool cannot grow is preempted and
// re-admitted later with its tokens so far. It returns the tokens each
// admission matched, in order; groupMem checks every hit's states.
func sharedSystemRun(t *testing.T, pool, live, n int, seed uint64) []int {
	t.Helper()
	const bs, chunk = 4, 9
	gm := qwenNext(t, pool, bs, 1)
	r := rand.New(rand.NewPCG(seed, seed+1))
	system := seqTokens(r, 10*bs)
	type req struct {
		id     int64
		toks   []int32 // prompt, and the output so far
		prompt int
		decode int // output tokens left
	}
	var waiting, running []*req
	for i := range n {
		p := append(slices.Clone(system), seqTokens(r, 5+r.IntN(16))...)
		waiting = append(waiting, &req{id: int64(i + 1), toks: p, prompt: len(p), decode: 8 + r.IntN(9)})
	}
	var hits []int
	bm := make([]BlockMatch, 1)
	for step := 0; len(waiting)+len(running) > 0; step++ {
		if step > 100*n {
			t.Fatalf("pool %d: %d requests left after %d steps", pool, len(waiting)+len(running), step)
		}
		for len(running) < live && len(waiting) > 0 {
			q := waiting[0]
			must(t, gm.m.MatchBlocks(Prompts{Tokens: q.toks, Offsets: []int64{0, int64(len(q.toks))}}, bm))
			hit := int(bm[0].Tokens)
			k := gm.admit(t, q.id, q.toks[:chunkEnd(hit, min(len(q.toks), hit+chunk), bs, int(bm[0].BlockTokens))])
			if k < 0 {
				break
			}
			hits = append(hits, k)
			waiting, running = waiting[1:], append(running, q)
		}
		for i := 0; i < len(running); i++ {
			q := running[i]
			done := len(gm.toks[q.id])
			if done == len(q.toks) && q.decode > 0 {
				q.toks = append(q.toks, seqTokens(r, 1)...)
				q.decode--
			}
			if done == len(q.toks) {
				gm.finish(t, q.id)
				running = slices.Delete(running, i, i+1)
				i--
				continue
			}
			end := len(q.toks)
			if done < q.prompt {
				end = chunkEnd(done, min(q.prompt, done+chunk), bs, 0)
			}
			if err := gm.grow(t, q.id, q.toks[done:end]); err != nil {
				// Preempted: back to the queue's head, to be admitted
				// again with its tokens so far.
				gm.remove(t, q.id)
				q.prompt = len(q.toks)
				running = slices.Delete(running, i, i+1)
				waiting = append([]*req{q}, waiting...)
				i--
			}
		}
		gm.m.MarkComputed()
		gm.takeCopies()
		gm.check(t)
	}
	must(t, gm.m.CheckInvariants())
	return hits
}

// Requests sharing a system prompt, four at a time, over a pool that
// their own blocks and states keep under pressure: once the first request
// has computed the system prompt (its steps leave a state at every block)
// and the pool has cycled (the second half of the admissions), every
// admission resumes from the state at the system prompt's end.
// The live sequences' latest states, each of use to its own sequence
// alone, go before it: listed after it by age, they once outlived it, and
// a pool of 72 blocks left 18 of 60 admissions without a hit.
func TestRecurrentSharedSystemPromptHitsUnderPressure(t *testing.T) {
	for _, pool := range []int{72, 80, 96} {
		for seed := range uint64(4) {
			hits := sharedSystemRun(t, pool, 4, 60, 5+seed)
			half := len(hits) / 2
			for i, k := range hits[half:] {
				if k < 40 {
					t.Fatalf("pool %d seed %d: admission %d matched %d tokens, want the system prompt's 40: %v", pool, seed, half+i, k, hits)
				}
			}
		}
	}
}
