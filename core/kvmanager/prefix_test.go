package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/testtok"
)

func newCached(t testing.TB, numBlocks, bs int, events bool) *Manager {
	t.Helper()
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: events})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// one makes a batch of one prompt.
func one(tokens []int32, keys *prefix.Keys) Prompts {
	p := Prompts{Tokens: tokens, Offsets: []int64{0, int64(len(tokens))}}
	if keys != nil {
		p.Keys = []prefix.Keys{*keys}
	}
	return p
}

// admit admits one prompt and returns its matched tokens.
func admit(t testing.TB, m *Manager, id int64, tokens []int32, keys *prefix.Keys) int {
	t.Helper()
	matched := []int32{-1}
	n, err := m.Admit([]int64{id}, one(tokens, keys), matched)
	if err != nil || n != 1 {
		t.Fatalf("admit %d: admitted %d, %v", id, n, err)
	}
	check(t, m)
	return int(matched[0])
}

func seqTokens(r *rand.Rand, n int) []int32 { return testtok.Rand(r, n, 50000) }

func TestAdmitReusesCachedPrefix(t *testing.T) {
	const bs = 4
	m := newCached(t, 64, bs, false)
	r := rand.New(rand.NewPCG(1, 2))
	sys := seqTokens(r, 10) // two full blocks and two tokens
	a := append(slices.Clone(sys), seqTokens(r, 5)...)
	if got := admit(t, m, 1, a, nil); got != 0 {
		t.Fatalf("first admit matched %d tokens of an empty cache", got)
	}
	ta := blocksOf(t, m, 1, 16)
	// The same system prompt, another user turn: the two full system blocks
	// are shared; the third (two system tokens, then a's own) is not.
	b := append(slices.Clone(sys), seqTokens(r, 7)...)
	if got := admit(t, m, 2, b, nil); got != 2*bs {
		t.Fatalf("matched %d tokens, want %d", got, 2*bs)
	}
	tb := blocksOf(t, m, 2, 16)
	if !slices.Equal(ta[:2], tb[:2]) || ta[2] == tb[2] {
		t.Fatalf("tables %v and %v: want the first two blocks shared, the third not", ta, tb)
	}
	// Only the unmatched tokens are new: their slots start in b's third block.
	_, slots := describeSlots(t, m, 2)
	if len(slots) != len(b)-2*bs || slots[0] != tb[2]*bs {
		t.Fatalf("new-token slots %v, want %d slots from block %d", slots, len(b)-2*bs, tb[2])
	}
	st := m.Stats()
	if st.SharedBlocks != 2 {
		t.Fatalf("shared blocks %d, want 2", st.SharedBlocks)
	}
	// A prompt that is all cached still computes its last token.
	full := slices.Clone(a[:3*bs])
	if got := admit(t, m, 3, full, nil); got != 2*bs {
		t.Fatalf("a fully cached 3-block prompt matched %d tokens, want %d", got, 2*bs)
	}
	ps := m.PrefixStats()
	if ps.Queries != 3 || ps.HitTokens != 4*bs || ps.QueryTokens != int64(len(a)+len(b)+len(full)) {
		t.Fatalf("stats %+v", ps)
	}
}

func describeSlots(t testing.TB, m *Manager, id int64) (int32, []int32) {
	t.Helper()
	lens := make([]int32, 1)
	slots := make([]int32, 1<<12)
	n, err := m.Describe([]int64{id}, 0, nil, lens, slots)
	must(t, err)
	return lens[0], slots[:n]
}

func TestRemoveKeepsBlocksCachedAndEvictionFreesThem(t *testing.T) {
	const bs = 4
	// 7 blocks, 6 full
	m, r, p := newAdmitted(t, 8, false, 3, 4, 6*bs+1)
	m.MarkComputed() // the step's forward pass: the blocks stay cached after the removal
	must(t, m.Remove([]int64{1}))
	check(t, m)
	st := m.Stats()
	if st.CachedBlocks != 6 || st.FreeBlocks != 2 {
		t.Fatalf("after remove: %d cached, %d free; want 6 and 2", st.CachedBlocks, st.FreeBlocks)
	}
	// A new prompt needing 5 blocks evicts 3 cached ones (the deepest).
	admit(t, m, 2, seqTokens(r, 5*bs), nil)
	st = m.Stats()
	if st.CachedBlocks != 3 || st.FreeBlocks != 0 {
		t.Fatalf("after eviction: %d cached, %d free; want 3 and 0", st.CachedBlocks, st.FreeBlocks)
	}
	if got := m.PrefixStats().Evictions; got != 3 {
		t.Fatalf("evictions %d, want 3", got)
	}
	// The surviving three are the prompt's first three blocks: they still match.
	out := make([]MatchInfo, 1)
	must(t, m.Match(one(p, nil), false, out))
	if out[0].Tokens != 3*bs {
		t.Fatalf("after evicting the deepest blocks, matched %d tokens, want %d", out[0].Tokens, 3*bs)
	}
}

func TestAdmitStopsAtFirstPromptThatDoesNotFit(t *testing.T) {
	const bs = 4
	m := newCached(t, 6, bs, false)
	r := rand.New(rand.NewPCG(5, 6))
	sys := seqTokens(r, 3*bs)
	admit(t, m, 1, append(slices.Clone(sys), 1), nil) // 4 blocks, 3 cached
	before := m.Stats()
	ps := m.PrefixStats()
	// Batch: a 2-block prompt fits; a 3-block one then does not (1 block
	// left, nothing evictable); the third would fit but comes after.
	p := Prompts{Offsets: []int64{0}}
	for _, n := range []int{2 * bs, 3 * bs, 1} {
		p.Tokens = append(p.Tokens, seqTokens(r, n)...)
		p.Offsets = append(p.Offsets, int64(len(p.Tokens)))
	}
	matched := []int32{-1, -1, -1}
	n, err := m.Admit([]int64{10, 11, 12}, p, matched)
	if err != nil || n != 1 {
		t.Fatalf("admitted %d, %v; want 1, nil", n, err)
	}
	check(t, m)
	if matched[1] != -1 || matched[2] != -1 {
		t.Fatalf("matched %v: entries past the admitted ones were written", matched)
	}
	after := m.Stats()
	if after.NumSeqs != before.NumSeqs+1 || after.FreeBlocks != 0 {
		t.Fatalf("stats %+v", after)
	}
	if got := m.PrefixStats().Queries; got != ps.Queries+1 {
		t.Fatalf("queries %d: the prompt that did not fit was counted", got)
	}
	// With 2 blocks free again, a 5-block prompt fits by sharing the
	// system prompt's 3 cached blocks.
	must(t, m.Remove([]int64{10}))
	if got := admit(t, m, 13, append(slices.Clone(sys), 7, 8, 9, 10, 11), nil); got != 3*bs {
		t.Fatalf("matched %d", got)
	}
}

func TestSaltsNeverShareBlocks(t *testing.T) {
	const bs = 4
	m := newCached(t, 32, bs, false)
	r := rand.New(rand.NewPCG(7, 8))
	p := seqTokens(r, 4*bs+1)
	admit(t, m, 1, p, &prefix.Keys{Salt: []byte("tenant-a")})
	if got := admit(t, m, 2, p, &prefix.Keys{Salt: []byte("tenant-b")}); got != 0 {
		t.Fatalf("another tenant matched %d tokens", got)
	}
	if got := admit(t, m, 3, p, nil); got != 0 {
		t.Fatalf("an unsalted prompt matched %d tokens of salted ones", got)
	}
	if got := admit(t, m, 4, p, &prefix.Keys{Salt: []byte("tenant-a")}); got != 4*bs {
		t.Fatalf("the same tenant matched %d tokens, want %d", got, 4*bs)
	}
	if got := admit(t, m, 5, p, &prefix.Keys{Salt: []byte("tenant-a"), Adapter: 9}); got != 0 {
		t.Fatalf("another adapter matched %d tokens", got)
	}
}

func TestGrowTokensCachesBlocksAsTheyFill(t *testing.T) {
	const bs = 4
	m, r, prompt := newAdmitted(t, 32, false, 9, 10, 6)
	gen := seqTokens(r, 9)
	all := append(slices.Clone(prompt), gen...)
	for i, tok := range gen { // decode, one token a step
		must(t, m.GrowTokens([]int64{1}, []int32{1}, []int32{tok}))
		check(t, m)
		if want := (len(prompt) + i + 1) / bs; m.PrefixStats().CachedBlocks != want {
			t.Fatalf("after %d tokens: %d cached blocks, want %d", len(prompt)+i+1, m.PrefixStats().CachedBlocks, want)
		}
	}
	// A follow-up turn over the whole conversation reuses all of it.
	turn := append(slices.Clone(all), seqTokens(r, 3)...)
	if got := admit(t, m, 2, turn, nil); got != 3*bs {
		t.Fatalf("matched %d tokens, want %d", got, 3*bs)
	}
	// Grow without tokens: the sequence's later blocks stay private.
	must(t, m.Grow([]int64{1}, []int32{2*bs + 1}))
	check(t, m)
	if got := m.PrefixStats().CachedBlocks; got != 4 { // three of 1, one more of 2
		t.Fatalf("cached %d, want 4", got)
	}
	wantCode(t, "grow tokens count mismatch", m.GrowTokens([]int64{2}, []int32{3}, []int32{1, 2}), kverr.InvalidArgument)
}

func TestForkLocksSharedCachedBlocks(t *testing.T) {
	const bs = 4
	m, _, _ := newAdmitted(t, 32, false, 11, 12, 2*bs+2)
	m.MarkComputed() // the prefill's forward pass, before the fork
	copies := make([]CopyPair, 2)
	n, err := m.Fork(1, []int64{2, 3}, copies)
	if err != nil || n != 2 {
		t.Fatalf("fork: %d, %v", n, err)
	}
	check(t, m) // locks == references on the two shared cached blocks
	// Children extend differently and cache their own third blocks.
	must(t, m.GrowTokens([]int64{2, 3}, []int32{2, 2}, []int32{1, 2, 3, 4}))
	check(t, m)
	if got := m.PrefixStats().CachedBlocks; got != 4 {
		t.Fatalf("cached %d, want 4 (2 shared + one per child)", got)
	}
	m.MarkComputed() // the children's step: their third blocks stay cached after the removal
	must(t, m.Remove([]int64{1, 2, 3}))
	check(t, m)
	if st := m.Stats(); st.CachedBlocks != 4 || st.UsedBlocks != 0 {
		t.Fatalf("after removing all: %+v", st)
	}
}

func TestClearPrefixCache(t *testing.T) {
	const bs = 4
	m, _, p := newAdmitted(t, 16, true, 13, 14, 3*bs+1)
	m.MarkComputed() // the step's forward pass: the blocks stay cached after the removal, and Pin covers them
	if _, err := m.ClearPrefixCache(); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("clear with a live sequence holding cached blocks: %v", err)
	}
	check(t, m)
	must(t, m.Remove([]int64{1}))
	pin, nb, err := m.Pin(p, nil)
	if err != nil || nb != 3 {
		t.Fatalf("pin: %d blocks, %v", nb, err)
	}
	n, err := m.ClearPrefixCache()
	if err != nil || n != 3 {
		t.Fatalf("clear: %d, %v", n, err)
	}
	check(t, m)
	if st := m.Stats(); st.FreeBlocks != 16 || st.CachedBlocks != 0 {
		t.Fatalf("after clear: %+v", st)
	}
	wantCode(t, "unpin after clear", m.Unpin(pin), kverr.NotFound)
	evs, err := m.DrainEvents(NoEventLimits)
	must(t, err)
	// The clear supersedes the undrained stored events.
	if len(evs) != 1 || evs[0].Kind != prefix.AllCleared {
		t.Fatalf("events %v: want one all-cleared", evs)
	}
}

func TestPinnedPrefixSurvivesPressure(t *testing.T) {
	const bs = 4
	m := newCached(t, 8, bs, false)
	r := rand.New(rand.NewPCG(15, 16))
	sys := seqTokens(r, 2*bs)
	admit(t, m, 1, append(slices.Clone(sys), 5), nil)
	m.MarkComputed() // the step's forward pass: the blocks stay cached after the removal, and Pin covers them
	must(t, m.Remove([]int64{1}))
	if _, n, err := m.Pin(sys, nil); err != nil || n != 2 {
		t.Fatalf("pin: %d, %v", n, err)
	}
	// 6 free, 2 pinned: a 7-block prompt does not fit.
	n, err := m.Admit([]int64{2}, one(seqTokens(r, 7*bs), nil), nil)
	if err != nil || n != 0 {
		t.Fatalf("admitted %d, %v; want 0", n, err)
	}
	check(t, m)
	if got := admit(t, m, 3, append(slices.Clone(sys), 1, 2), nil); got != 2*bs {
		t.Fatalf("the pinned prefix matched %d tokens", got)
	}
}

func TestPriorityOrdersEviction(t *testing.T) {
	const bs = 2
	m := newCached(t, 6, bs, false)
	r := rand.New(rand.NewPCG(17, 18))
	hi, lo := seqTokens(r, 2*bs), seqTokens(r, 2*bs)
	admit(t, m, 1, append(slices.Clone(hi), 1), nil)
	admit(t, m, 2, append(slices.Clone(lo), 1), nil)
	m.MarkComputed() // the step's forward pass: both prefixes stay cached after the removal
	must(t, m.Remove([]int64{1, 2}))
	// hi was used first, so LRU would evict it; its priority keeps it.
	if n, err := m.SetPriority(hi, nil, 5); err != nil || n != 2 {
		t.Fatalf("set priority: %d, %v", n, err)
	}
	admit(t, m, 3, seqTokens(r, 4*bs), nil) // needs 4: 2 free + 2 evicted
	out := make([]MatchInfo, 2)
	p := Prompts{Tokens: append(append(slices.Clone(hi), 1), append(slices.Clone(lo), 1)...), Offsets: []int64{0, 2*bs + 1, 4*bs + 2}}
	must(t, m.Match(p, false, out))
	if out[0].Tokens != 2*bs || out[1].Tokens != 0 {
		t.Fatalf("matches %+v: want the high-priority prefix kept", out)
	}
}

func TestPrefixCallsWithoutCache(t *testing.T) {
	m := newMgr(t, 8, 4)
	p := []int32{1, 2, 3, 4, 5}
	if got := admit(t, m, 1, p, nil); got != 0 {
		t.Fatalf("matched %d without a cache", got)
	}
	if got := admit(t, m, 2, p, nil); got != 0 {
		t.Fatalf("matched %d without a cache", got)
	}
	out := []MatchInfo{{Tokens: 9}}
	must(t, m.Match(one(p, nil), true, out))
	if out[0] != (MatchInfo{PartialBlock: -1}) {
		t.Fatalf("match without a cache: %+v", out[0])
	}
	_, _, err := m.Pin(p, nil)
	wantCode(t, "pin", err, kverr.InvalidArgument)
	_, err = m.DrainEvents(NoEventLimits)
	wantCode(t, "drain", err, kverr.InvalidArgument)
	if _, err := New(Config{NumBlocks: 8, BlockSize: 4, EnableKVEvents: true}); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("events without the cache: %v", err)
	}
}

func TestAdmitRejectsBadBatches(t *testing.T) {
	m := newCached(t, 16, 4, false)
	admit(t, m, 1, []int32{1, 2, 3}, nil)
	cases := []struct {
		name string
		ids  []int64
		p    Prompts
		code kverr.Code
	}{
		{"empty prompt", []int64{2}, Prompts{Tokens: []int32{1}, Offsets: []int64{0, 0}}, kverr.InvalidArgument},
		{"offsets decrease", []int64{2, 3}, Prompts{Tokens: []int32{1, 2}, Offsets: []int64{0, 2, 1}}, kverr.InvalidArgument},
		{"offsets past tokens", []int64{2}, Prompts{Tokens: []int32{1, 2}, Offsets: []int64{0, 3}}, kverr.InvalidArgument},
		{"ids and prompts differ", []int64{2, 3}, one([]int32{1}, nil), kverr.InvalidArgument},
		{"live id", []int64{1}, one([]int32{1}, nil), kverr.DuplicateSequence},
		{"repeated id", []int64{4, 4}, Prompts{Tokens: []int32{1, 2}, Offsets: []int64{0, 1, 2}}, kverr.DuplicateSequence},
		{"multimodal item of length 0", []int64{2}, one([]int32{1, 2}, &prefix.Keys{MM: []prefix.MMItem{{Offset: 1, Length: 0}}}), kverr.InvalidArgument},
		{"multimodal items out of order", []int64{2}, one([]int32{1, 2}, &prefix.Keys{MM: []prefix.MMItem{{Offset: 9, Length: 1}, {Offset: 1, Length: 1}}}), kverr.InvalidArgument},
		{"no batch", nil, Prompts{Offsets: []int64{0}}, kverr.InvalidArgument},
	}
	for _, c := range cases {
		before := describeAll(t, m)
		ps := m.PrefixStats()
		n, err := m.Admit(c.ids, c.p, nil)
		wantCode(t, c.name, err, c.code)
		if n != 0 {
			t.Fatalf("%s: admitted %d", c.name, n)
		}
		if after := describeAll(t, m); after.String() != before.String() || m.PrefixStats() != ps {
			t.Fatalf("%s: state changed", c.name)
		}
	}
}

func TestDrainEventsRespectsLimits(t *testing.T) {
	const bs = 4
	m, r, _ := newAdmitted(t, 16, true, 19, 20, 5*bs+1)
	// The step's forward pass: without it the removal would drop the 5
	// blocks (one BlockRemoved of 5 hashes, split 3 + 2, which happens to
	// give the same kinds) instead of leaving them for the eviction below.
	m.MarkComputed()
	must(t, m.Remove([]int64{1}))
	admit(t, m, 2, seqTokens(r, 15*bs), nil) // evicts 4 of the 5 cached blocks
	replay := prefix.NewEventIndex()
	_, err := m.DrainEvents(EventLimits{Events: 10, Tokens: bs - 1, MM: 10, Hashes: 10})
	wantCode(t, "tokens below a block", err, kverr.BufferTooSmall)
	var kinds []prefix.EventKind
	for {
		evs, err := m.DrainEvents(EventLimits{Events: 2, Tokens: 2 * bs, MM: 0, Hashes: 3})
		must(t, err)
		if len(evs) == 0 {
			break
		}
		for _, ev := range evs {
			kinds = append(kinds, ev.Kind)
			if ev.Kind == prefix.BlockRemoved && len(ev.Hashes) > 3 {
				t.Fatalf("a removed event with %d hashes past the limit", len(ev.Hashes))
			}
			must(t, replay.Apply(ev))
		}
	}
	// 5 stored (in batches of two), 4 removed split 3 + 1, then the 15
	// blocks of the second prompt stored.
	want := []prefix.EventKind{1, 1, 1, 1, 1, 2, 2}
	for range 15 {
		want = append(want, prefix.BlockStored)
	}
	if !slices.Equal(kinds, want) {
		t.Fatalf("event kinds %v, want %v", kinds, want)
	}
	if replay.Len() != m.PrefixStats().CachedBlocks {
		t.Fatalf("replayed %d blocks, cache holds %d", replay.Len(), m.PrefixStats().CachedBlocks)
	}
}
