package prefix

import (
	"slices"
	"testing"
)

// EvictHashes evicts what Evict would, in the same order, and reports each
// block's hash alongside.
func TestEvictHashesMatchesEvict(t *testing.T) {
	a, b := newIndex(t, 4, 16, true), newIndex(t, 4, 16, true)
	p := seq(0, 16)
	var hc Hasher
	chain, err := hc.Chain(nil, p, 4, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []*Index{a, b} {
		unlock(t, x, cache(t, x, p, nil, 3, 5, 7, 9)...)
	}
	want := evict(t, a, 3)
	got, hs := b.EvictHashes([]int32{-1}, []Hash{{1}}, 3)
	check(t, b)
	if !slices.Equal(got[1:], want) || got[0] != -1 || hs[0] != (Hash{1}) {
		t.Fatalf("EvictHashes %v, Evict %v", got, want)
	}
	// Deepest first: blocks 9, 7, 5 under the prompt's last three hashes.
	if !slices.Equal(hs[1:], []Hash{chain[3], chain[2], chain[1]}) {
		t.Fatalf("hashes %v, want %v", hs[1:], []Hash{chain[3], chain[2], chain[1]})
	}
	if !slices.EqualFunc(a.DrainEvents(0), b.DrainEvents(0), func(x, y Event) bool { return x.Kind == y.Kind && slices.Equal(x.Hashes, y.Hashes) }) {
		t.Fatal("EvictHashes and Evict recorded different events")
	}
}
