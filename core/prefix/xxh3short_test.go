package prefix

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestHashShortMatchesXXH3 checks the in-place hash against XXH3 of the
// written-out input (HASH.md's definition) for every block size it takes,
// with random and extreme tokens, parents and adapters: a word read from
// the wrong offset or a round out of order changes almost every hash, so
// a few hundred inputs per block size catch it.
func TestHashShortMatchesXXH3(t *testing.T) {
	if !hostLittleEndian {
		t.Skip("hashShort reads token bytes in place only on little-endian hosts")
	}
	r := rand.New(rand.NewPCG(13, 13))
	taken := 0
	for bs := 1; bs <= 64; bs++ {
		if !shortBlock(bs) {
			continue
		}
		taken++
		for it := range 300 {
			tokens := make([]int32, bs)
			for i := range tokens {
				tokens[i] = int32(r.Uint32())
			}
			var parent Hash
			for i := range parent {
				parent[i] = byte(r.Uint32())
			}
			adapter := r.Uint64()
			switch it % 5 {
			case 0:
				parent, adapter = Hash{}, 0
			case 1:
				for i := range tokens {
					tokens[i] = []int32{-1, math.MaxInt32, math.MinInt32, 0}[i%4]
				}
				adapter = math.MaxUint64
				for i := range parent {
					parent[i] = 0xff
				}
			}
			want := Sum(AppendBlockInput(nil, parent, tokens, adapter, nil, nil))
			if got := hashShort(&parent, tokens, adapter); got != want {
				t.Fatalf("block size %d, input %d: hashShort %s, XXH3 of the input %s", bs, it, got, want)
			}
			var h Hasher
			if got := h.sum(parent, tokens, adapter, nil, nil); got != want {
				t.Fatalf("block size %d, input %d: Hasher.sum %s, want %s", bs, it, got, want)
			}
		}
	}
	// 4-6 and 8-22: the sizes the comment on shortBlock names.
	if taken != 18 {
		t.Fatalf("shortBlock takes %d block sizes in [1, 64], want 18", taken)
	}
}

// TestHasherSumKeysTakeGenericPath checks that a block with a multimodal
// entry or a salt hashes as its written-out input does, at a block size
// hashShort would take without them: hashShort has no room for either,
// so taking it there would drop them from the hash.
func TestHasherSumKeysTakeGenericPath(t *testing.T) {
	tokens := seq(0, 16)
	mm := []BlockMM{{Offset: 3, Hash: Sum([]byte("img"))}}
	var h Hasher
	for _, c := range []struct {
		mm   []BlockMM
		salt []byte
	}{{mm, nil}, {nil, []byte("tenant")}, {mm, []byte("tenant")}} {
		want := Sum(AppendBlockInput(nil, Hash{1}, tokens, 5, c.mm, c.salt))
		if got := h.sum(Hash{1}, tokens, 5, c.mm, c.salt); got != want {
			t.Fatalf("mm %v salt %q: %s, want %s", c.mm, c.salt, got, want)
		}
		if plain := h.sum(Hash{1}, tokens, 5, nil, nil); plain == want {
			t.Fatalf("mm %v salt %q: the keys do not change the hash", c.mm, c.salt)
		}
	}
}
