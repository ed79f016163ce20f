package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// matchBlocks is MatchBlocks for one prompt.
func matchBlocks(t testing.TB, m *Manager, toks []int32) BlockMatch {
	t.Helper()
	var out [1]BlockMatch
	must(t, m.MatchBlocks(Prompts{Tokens: toks, Offsets: []int64{0, int64(len(toks))}}, out[:]))
	return out[0]
}

// A shared system prompt computed in one step with a user's tokens has no
// state at its end: a second user's prompt hits nothing, and MatchBlocks
// says that group 0 caches the whole system prompt. An engine that ends
// the second user's first step there leaves the state that a third user
// resumes from.
func TestMatchBlocksPastTheLastState(t *testing.T) {
	const bs = 4
	gm := qwenNext(t, 64, bs, 1)
	r := rand.New(rand.NewPCG(31, 32))
	system := seqTokens(r, 16)
	first := append(slices.Clone(system), seqTokens(r, 8)...)
	gm.admit(t, 1, first) // one step: a state at 24 only
	gm.finish(t, 1)

	second := append(slices.Clone(system), seqTokens(r, 7)...)
	if got := matchBlocks(t, gm.m, second); got != (BlockMatch{Tokens: 0, BlockTokens: 16}) {
		t.Fatalf("the second user's prompt: %+v, want no hit and a block match of the system prompt's 16 tokens", got)
	}
	// Never the whole prompt: the first user's whole history matches its
	// full blocks but the last, and its one state (at 24) is past that.
	if got := matchBlocks(t, gm.m, first); got != (BlockMatch{Tokens: 0, BlockTokens: 20}) {
		t.Fatalf("the first user's history: %+v, want no hit and a block match of 20 tokens", got)
	}
	// The hit is Match's, and admission takes it.
	var mi [1]MatchInfo
	must(t, gm.m.Match(Prompts{Tokens: second, Offsets: []int64{0, int64(len(second))}}, false, mi[:]))
	if mi[0].Tokens != 0 {
		t.Fatalf("Match found %d tokens, MatchBlocks' hit 0", mi[0].Tokens)
	}
	if k := gm.admit(t, 2, second[:16]); k != 0 { // a step that ends at the block match
		t.Fatalf("the second user's first chunk matched %d tokens", k)
	}
	gm.m.MarkComputed()
	must(t, gm.grow(t, 2, second[16:]))
	gm.finish(t, 2)

	third := append(slices.Clone(system), seqTokens(r, 5)...)
	if got := matchBlocks(t, gm.m, third); got != (BlockMatch{Tokens: 16, BlockTokens: 16}) {
		t.Fatalf("the third user's prompt: %+v, want a hit of the system prompt's 16 tokens", got)
	}
	if k := gm.admit(t, 3, third); k != 16 { // gm.write checks the state the hit copies
		t.Fatalf("the third user matched %d tokens, want 16", k)
	}
	gm.check(t)
	must(t, gm.m.CheckInvariants())
}

// Without recurrent groups a hit is the block match: with full attention
// alone, and with a window group that holds every block its next query
// reads.
func TestMatchBlocksEqualsTheHitWithoutStates(t *testing.T) {
	const bs = 4
	r := rand.New(rand.NewPCG(33, 34))
	for _, groups := range [][]Group{nil, {{Kind: FullAttention}, {Kind: SlidingWindow, Window: 8}}} {
		m, err := New(Config{NumBlocks: 32, BlockSize: bs, EnablePrefixCache: true, Groups: groups})
		must(t, err)
		p := seqTokens(r, 22)
		n, err := m.Admit([]int64{1}, Prompts{Tokens: p, Offsets: []int64{0, 22}}, nil)
		must(t, err)
		if n != 1 {
			t.Fatal("admission refused on an empty pool")
		}
		m.MarkComputed()
		must(t, m.Remove([]int64{1}))
		q := append(slices.Clone(p[:13]), seqTokens(r, 6)...)
		if got := matchBlocks(t, m, q); got != (BlockMatch{Tokens: 12, BlockTokens: 12}) {
			t.Fatalf("groups %v: %+v, want 12 and 12", groups, got)
		}
	}
	m, err := New(Config{NumBlocks: 8, BlockSize: bs})
	must(t, err)
	if got := matchBlocks(t, m, seqTokens(r, 9)); got != (BlockMatch{}) {
		t.Fatalf("without the prefix cache: %+v", got)
	}
}
