package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
)

// Chunked prefill with multimodal prompts: the blocks a sequence caches
// must not depend on where its chunks end or on when its items were given.

// placeholder is the token id of every image position, as engines repeat
// one placeholder id: only the items tell two images apart.
const placeholder = -1

// mmPrompt returns a prompt of n tokens with up to three images at random
// offsets (each inside the prompt, some spanning blocks) and random
// adapter and salt.
func mmPrompt(r *rand.Rand, n, bs int) ([]int32, *prefix.Keys) {
	toks := seqTokens(r, n)
	keys := &prefix.Keys{}
	if r.IntN(3) == 0 {
		keys.Adapter = uint64(r.IntN(2) + 1)
	}
	if r.IntN(3) == 0 {
		keys.Salt = []byte{byte(r.IntN(2))}
	}
	at := 0
	for range r.IntN(4) {
		if at >= n {
			break
		}
		off := at + r.IntN(n-at)
		length := 1 + r.IntN(min(2*bs, n-off))
		for i := off; i < off+length; i++ {
			toks[i] = placeholder
		}
		keys.MM = append(keys.MM, prefix.MMItem{Offset: int32(off), Length: int32(length), Hash: prefix.Sum([]byte{byte(r.IntN(3))})})
		at = off + length
	}
	return toks, keys
}

// chunks splits n tokens into a random chunking: the admitted first chunk,
// then the grows (an empty grow now and then).
func chunks(r *rand.Rand, n, bs int) []int {
	var out []int
	for left := n; left > 0 || len(out) == 0; {
		c := r.IntN(min(left, 3*bs) + 1)
		if len(out) == 0 {
			c = max(c, 1) // admit takes at least one token
		}
		out = append(out, c)
		left -= c
	}
	return out
}

// admitChunked admits tokens as sequence id in the chunks of sizes cs and
// returns the tokens matched at admission. With late, only the items that
// must be known at admission (those overlapping its full blocks) go to
// admit; each other item follows with AddMMItems as late as allowed, or
// earlier at random, in the order the items come.
func admitChunked(t testing.TB, m *Manager, r *rand.Rand, id int64, toks []int32, keys *prefix.Keys, cs []int, late bool) int {
	t.Helper()
	bs := m.BlockSize()
	first := *keys
	pending := []prefix.MMItem(nil)
	if late {
		k := 0
		for k < len(keys.MM) && int(keys.MM[k].Offset) < cs[0]/bs*bs {
			k++
		}
		first.MM, pending = keys.MM[:k:k], keys.MM[k:]
	}
	matched := []int32{-1}
	n, err := m.Admit([]int64{id}, one(toks[:cs[0]], &first), matched)
	if err != nil || n != 1 {
		t.Fatalf("admit %d of %d tokens: %d, %v", id, cs[0], n, err)
	}
	at := cs[0]
	for _, c := range cs[1:] {
		// The items this grow's full blocks reach must be given now; any
		// other pending item, by chance.
		k := 0
		for k < len(pending) && (int(pending[k].Offset) < (at+c)/bs*bs || r.IntN(4) == 0) {
			k++
		}
		if k > 0 {
			must(t, m.AddMMItems(id, pending[:k]))
			pending = pending[k:]
		}
		must(t, m.GrowTokens([]int64{id}, []int32{int32(c)}, toks[at:at+c]))
		at += c
	}
	if len(pending) > 0 {
		must(t, m.AddMMItems(id, pending))
	}
	check(t, m)
	return int(matched[0])
}

// cachedChain returns the hashes of sequence id's first n blocks as the
// cache holds them; a zero hash where the block is not cached (a private
// twin of a cached block).
func cachedChain(m *Manager, id int64, n int) []prefix.Hash {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.seqs.get(id)
	out := make([]prefix.Hash, n)
	for i := range n {
		out[i], _ = m.cache.BlockHash(s.blocks[i])
	}
	return out
}

func wholeChain(t testing.TB, toks []int32, bs int, keys *prefix.Keys) []prefix.Hash {
	t.Helper()
	var h prefix.Hasher
	c, err := h.Chain(nil, toks, bs, keys)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Every chunking of a prompt, with its items given at admission or as late
// as allowed, caches the blocks that admitting the whole prompt at once
// caches, under the same hashes, and those are HASH.md's.
func TestChunkedPrefillHashesAsTheWholePrompt(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 1))
	for trial := range 400 {
		bs := []int{1, 2, 4, 16}[trial%4]
		n := 1 + r.IntN(10*bs)
		toks, keys := mmPrompt(r, n, bs)
		full := n / bs
		want := wholeChain(t, toks, bs, keys)

		whole := newCached(t, full+2, bs, false)
		admit(t, whole, 1, toks, keys)
		if got := cachedChain(whole, 1, full); !slices.Equal(got, want) {
			t.Fatalf("trial %d: the whole prompt's admission cached %v, HASH.md says %v", trial, got, want)
		}

		cs := chunks(r, n, bs)
		late := r.IntN(2) == 0
		m := newCached(t, full+2, bs, false)
		admitChunked(t, m, r, 1, toks, keys, cs, late)
		if got := cachedChain(m, 1, full); !slices.Equal(got, want) {
			t.Fatalf("trial %d (block size %d, items %v, chunks %v, late %v): chunked admission cached\n%v\nthe whole prompt\n%v",
				trial, bs, keys.MM, cs, late, got, want)
		}
		if m.PrefixStats().Inserts != int64(full) {
			t.Fatalf("trial %d: %d blocks inserted, want %d", trial, m.PrefixStats().Inserts, full)
		}
	}
}

// blockEntries is HASH.md's list of a block's multimodal entries, written
// out independently of package prefix.
func blockEntries(keys *prefix.Keys, i, bs int) []prefix.BlockMM {
	var out []prefix.BlockMM
	lo, hi := i*bs, (i+1)*bs
	for _, it := range keys.MM {
		if int(it.Offset) < hi && int(it.Offset+it.Length) > lo {
			out = append(out, prefix.BlockMM{Offset: it.Offset - int32(lo), Hash: it.Hash})
		}
	}
	return out
}

// Many chunked sequences in one cache, text-only and multimodal prompts
// over the same tokens (placeholders included): a sequence only ever
// starts on cached blocks whose stored identity (tokens, adapter,
// multimodal entries) is its own block's, so no text-only prompt matches
// a block that held an image and no image matches another's; and each
// block a sequence caches is cached under its whole prompt's hash.
func TestChunkedPrefillNeverSharesAcrossItems(t *testing.T) {
	const bs = 4
	r := rand.New(rand.NewPCG(13, 2))
	m := newCached(t, 160, bs, true)
	type stored struct {
		tokens  []int32
		adapter uint64
		mm      []prefix.BlockMM
	}
	seen := map[prefix.Hash]stored{}
	drain := func() {
		evs, err := m.DrainEvents(NoEventLimits)
		must(t, err)
		for _, ev := range evs {
			if ev.Kind == prefix.BlockStored {
				seen[ev.Hash] = stored{slices.Clone(ev.Tokens), ev.Adapter, slices.Clone(ev.MM)}
			}
		}
	}
	// A few bases, each with a few item sets over the same placeholders.
	type variant struct {
		toks []int32
		keys *prefix.Keys
	}
	var variants [][]variant
	for range 4 {
		toks, keys := mmPrompt(r, 6*bs+r.IntN(4*bs), bs)
		if len(keys.MM) == 0 {
			keys.MM = []prefix.MMItem{{Offset: 5, Length: 6, Hash: prefix.Sum([]byte("x"))}}
			for i := 5; i < 11; i++ {
				toks[i] = placeholder
			}
		}
		keys.Adapter, keys.Salt = 0, nil
		other := &prefix.Keys{MM: slices.Clone(keys.MM)}
		other.MM[0].Hash = prefix.Sum([]byte("another image"))
		moved := &prefix.Keys{MM: slices.Clone(keys.MM)}
		moved.MM[0].Offset++ // the same image one position later
		moved.MM[0].Length = max(moved.MM[0].Length-1, 1)
		variants = append(variants, []variant{{toks, &prefix.Keys{}}, {toks, keys}, {toks, other}, {toks, moved}})
	}
	var live []int64
	hits := 0
	for id := range int64(300) {
		vs := variants[r.IntN(len(variants))]
		v := vs[r.IntN(len(vs))]
		// A prompt may go on past the base (a follow-up turn).
		toks := append(slices.Clone(v.toks), seqTokens(r, r.IntN(2*bs))...)
		cs := chunks(r, len(toks), bs)
		matched := admitChunked(t, m, r, id, toks, v.keys, cs, r.IntN(2) == 0)
		// The forward passes of the sequence's chunks have run: its blocks
		// are computed, so a later removal keeps them cached for the
		// prompts that follow to match (computed.go).
		m.MarkComputed()
		drain()
		want := wholeChain(t, toks, bs, v.keys)
		got := cachedChain(m, id, len(toks)/bs)
		for i, h := range got {
			if i < matched/bs && h != want[i] {
				t.Fatalf("sequence %d starts on block %d cached as %s, its own block hashes %s", id, i, h, want[i])
			}
			if h.IsZero() {
				continue // a private twin of a block cached by another sequence
			}
			if h != want[i] {
				t.Fatalf("sequence %d (items %v, chunks %v) cached block %d as %s, its whole prompt hashes it %s", id, v.keys.MM, cs, i, h, want[i])
			}
			st, ok := seen[h]
			if !ok {
				t.Fatalf("sequence %d's block %d (%s) has no stored event", id, i, h)
			}
			if !slices.Equal(st.tokens, toks[i*bs:(i+1)*bs]) || st.adapter != v.keys.Adapter || !slices.Equal(st.mm, blockEntries(v.keys, i, bs)) {
				t.Fatalf("sequence %d's block %d holds %+v, the prompt's block has entries %v", id, i, st, blockEntries(v.keys, i, bs))
			}
		}
		if matched > 0 {
			hits++
		}
		live = append(live, id)
		if len(live) > 6 {
			k := r.IntN(len(live))
			must(t, m.Remove([]int64{live[k]}))
			live = slices.Delete(live, k, k+1)
		}
	}
	if hits < 50 {
		t.Fatalf("only %d of 300 admissions hit the cache: the test shares too little to mean anything", hits)
	}
}

// The reproducer of the header's chunked-prefill flow: match the whole
// prompt, admit a first chunk that ends inside an image, grow the rest.
func TestChunkedPrefillThroughAnImage(t *testing.T) {
	const bs = 16
	var p []int32
	for i := range 48 {
		p = append(p, int32(i))
	}
	for range 32 {
		p = append(p, placeholder) // the image at [48, 80)
	}
	for i := range 10 {
		p = append(p, int32(100+i))
	}
	img := &prefix.Keys{MM: []prefix.MMItem{{Offset: 48, Length: 32, Hash: prefix.Sum([]byte{0x11})}}}
	other := &prefix.Keys{MM: []prefix.MMItem{{Offset: 48, Length: 32, Hash: prefix.Sum([]byte{0x22})}}}
	m := newCached(t, 64, bs, false)
	admitChunked(t, m, rand.New(rand.NewPCG(1, 1)), 1, p, img, []int{40, 50}, false)
	out := make([]MatchInfo, 1)
	for _, c := range []struct {
		keys *prefix.Keys
		want int32
	}{{nil, 48}, {img, 80}, {other, 48}} {
		must(t, m.Match(one(p, c.keys), false, out))
		if out[0].Tokens != c.want {
			t.Errorf("match with keys %v: %d tokens, want %d", c.keys, out[0].Tokens, c.want)
		}
	}
	// A second request with another image, by the header's flow (the
	// match said 48: admit 48 and a chunk of 16), starts on the three text
	// blocks and caches its own two image blocks: no duplicate of the
	// first image's.
	before := m.PrefixStats()
	if k := admitChunked(t, m, rand.New(rand.NewPCG(1, 2)), 2, p, other, []int{64, 26}, true); k != 48 {
		t.Fatalf("the other image matched %d tokens, want 48", k)
	}
	st := m.PrefixStats()
	if st.Dedups != before.Dedups || st.Inserts-before.Inserts != 2 {
		t.Fatalf("the other image: %d inserts and %d dedups, want 2 and 0", st.Inserts-before.Inserts, st.Dedups-before.Dedups)
	}
}

func TestAddMMItemsRefusals(t *testing.T) {
	const bs = 4
	m := newCached(t, 16, bs, false)
	img := func(off, n int32) prefix.MMItem {
		return prefix.MMItem{Offset: off, Length: n, Hash: prefix.Sum([]byte{byte(off)})}
	}
	admit(t, m, 1, seqTokens(rand.New(rand.NewPCG(3, 3)), 6), &prefix.Keys{MM: []prefix.MMItem{img(5, 3)}})
	must(t, m.Add(2, 6))
	for _, c := range []struct {
		name string
		id   int64
		mm   []prefix.MMItem
		code kverr.Code
	}{
		{"unknown sequence", 9, []prefix.MMItem{img(8, 1)}, kverr.UnknownSequence},
		{"inside a full block", 1, []prefix.MMItem{img(3, 4)}, kverr.InvalidArgument},
		{"not after the sequence's items", 1, []prefix.MMItem{img(5, 1)}, kverr.InvalidArgument},
		{"out of order", 1, []prefix.MMItem{img(9, 1), img(8, 1)}, kverr.InvalidArgument},
		{"length 0", 1, []prefix.MMItem{img(8, 0)}, kverr.InvalidArgument},
		{"negative offset", 2, []prefix.MMItem{img(-1, 2)}, kverr.InvalidArgument},
		{"inside a full block of an added sequence", 2, []prefix.MMItem{img(2, 2)}, kverr.InvalidArgument},
	} {
		m.mu.Lock()
		var before *prefix.Keys
		if s := m.seqs.get(1); s.pc != nil {
			before = s.pc.keys
		}
		m.mu.Unlock()
		err := m.AddMMItems(c.id, c.mm)
		wantCode(t, c.name, err, c.code)
		m.mu.Lock()
		if m.seqs.get(1).pc.keys != before {
			t.Errorf("%s: the sequence's keys changed", c.name)
		}
		m.mu.Unlock()
	}
	// The tail's items (positions 4 and 5 are known but not yet hashed)
	// are accepted, and a fork keeps the keys it had.
	_, err := m.Fork(1, []int64{3}, make([]CopyPair, 1))
	must(t, err)
	must(t, m.AddMMItems(1, []prefix.MMItem{img(6, 1)}))
	must(t, m.AddMMItems(2, []prefix.MMItem{img(4, 1)})) // tokens unknown: checked, dropped
	m.mu.Lock()
	got, forked := m.seqs.get(1).pc.keys.MM, m.seqs.get(3).pc.keys.MM
	m.mu.Unlock()
	if len(got) != 2 || len(forked) != 1 {
		t.Fatalf("items: sequence %v, its fork %v; want 2 and 1", got, forked)
	}
	check(t, m)
}
