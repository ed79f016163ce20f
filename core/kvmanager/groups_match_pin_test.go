package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// With layer groups Match offers no partial block: a cached block holds
// group 0's rows, not the other groups' K/V or a recurrent state for its
// tokens, so an engine copying its rows would start from a wrong state.
// Here the recurrent group has no checkpoint inside the first block, so
// the hit is 0 tokens, and group 0's cached first block must not come
// back as a partial match.
func TestMatchWithGroupsOffersNoPartialBlock(t *testing.T) {
	for _, grp := range []Group{
		{Kind: Recurrent, StateBytes: 64, CheckpointEvery: 2},
		{Kind: SlidingWindow, Window: 4},
	} {
		m, err := New(Config{NumBlocks: 32, BlockSize: 4, EnablePrefixCache: true, BlockBytes: 64,
			Groups: []Group{{Kind: FullAttention}, grp}})
		must(t, err)
		m.TakeCopies(nil)
		a := seqTokens(rand.New(rand.NewPCG(1, 2)), 9)
		if n, err := m.Admit([]int64{1}, Prompts{Tokens: a, Offsets: []int64{0, 9}}, nil); err != nil || n != 1 {
			t.Fatal(n, err)
		}
		m.MarkComputed()
		must(t, m.Remove([]int64{1}))
		for _, p := range [][]int32{append(slices.Clone(a[:6]), 99999, 99998), append(slices.Clone(a[:2]), 99999)} {
			out := make([]MatchInfo, 1)
			must(t, m.Match(Prompts{Tokens: p, Offsets: []int64{0, int64(len(p))}}, true, out))
			if out[0].PartialBlock != -1 || out[0].PartialTokens != 0 {
				t.Fatalf("%v group: hit %d tokens, partial block %d offering %d tokens; want none with layer groups",
					grp.Kind, out[0].Tokens, out[0].PartialBlock, out[0].PartialTokens)
			}
		}
	}
}

// With layer groups Pin answers Unsupported and pins nothing: it would
// keep group 0's blocks while the other groups' window blocks and states
// went, and the pinned prefix would stop hitting.
func TestPinWithGroupsUnsupported(t *testing.T) {
	m, err := New(Config{NumBlocks: 16, BlockSize: 4, EnablePrefixCache: true,
		Groups: []Group{{Kind: FullAttention}, {Kind: SlidingWindow, Window: 4}}})
	must(t, err)
	a := seqTokens(rand.New(rand.NewPCG(3, 4)), 8)
	if n, err := m.Admit([]int64{1}, Prompts{Tokens: a, Offsets: []int64{0, 8}}, nil); err != nil || n != 1 {
		t.Fatal(n, err)
	}
	m.MarkComputed()
	must(t, m.Remove([]int64{1}))
	before := m.Stats()
	if _, _, err := m.Pin(a, nil); kverr.CodeOf(err) != kverr.Unsupported {
		t.Fatalf("pin with layer groups: %v, want Unsupported", err)
	}
	if after := m.Stats(); after != before {
		t.Fatalf("a refused pin changed the stats: %+v, then %+v", before, after)
	}
	mustCheck(t, m)
}
