package prefix

import (
	"fmt"
	"testing"
)

// TestWalkScanAndTableAgree matches prompts below nodes with up to
// scanChildren children (searched by comparing the children) and with
// more (searched through the hash table; with 12 variants the trunk's
// last block has 8 children): each prompt must match exactly its own
// cached chain, with the chain's hash as Last, and a sibling that differs
// only in a key (adapter, multimodal entry) or in one token must not be
// taken for it.
func TestWalkScanAndTableAgree(t *testing.T) {
	const bs = 4
	img := Sum([]byte("img"))
	for _, kids := range []int{1, scanChildren, scanChildren + 1, 3 * scanChildren} {
		t.Run(fmt.Sprintf("children%d", kids), func(t *testing.T) {
			x := newIndex(t, bs, 1024, false)
			trunk := seq(1000, 2*bs)
			next := int32(0)
			ids := func(n int) []int32 {
				out := make([]int32, n)
				for i := range out {
					out[i] = next
					next++
				}
				return out
			}
			type variant struct {
				prompt []int32
				keys   *Keys
			}
			var vs []variant
			for k := range kids {
				// Children of the trunk's last block that differ in their
				// last token, then two more blocks each.
				p := append(append([]int32{}, trunk...), seq(int32(100*k), 3*bs)...)
				var keys *Keys
				switch k % 3 {
				case 1:
					keys = &Keys{Adapter: 9}
					p[2*bs] = 0 // same tokens as child 0's first block
				case 2:
					keys = &Keys{MM: []MMItem{{Offset: int32(2*bs + 1), Length: 2, Hash: img}}}
					p[2*bs] = 0
				}
				vs = append(vs, variant{p, keys})
				unlock(t, x, cache(t, x, p, keys, ids(len(p)/bs)...)...)
			}
			for k, v := range vs {
				// The whole prompt plus one token: every full block matches.
				q := append(append([]int32{}, v.prompt...), 7)
				res, err := x.Match(nil, q, v.keys, false)
				if err != nil {
					t.Fatal(err)
				}
				if res.Tokens != len(v.prompt) {
					t.Fatalf("variant %d: matched %d tokens, want %d", k, res.Tokens, len(v.prompt))
				}
				if want, _ := x.BlockHash(res.Blocks[len(res.Blocks)-1]); res.Last != want {
					t.Fatalf("variant %d: Last %s is not the last block's hash %s", k, res.Last, want)
				}
				want, _ := (&Hasher{}).Chain(nil, v.prompt, bs, v.keys)
				if res.Last != want[len(want)-1] {
					t.Fatalf("variant %d: Last %s, the prompt's chain ends at %s", k, res.Last, want[len(want)-1])
				}
				// One token changed in the third block: the match stops there.
				q[2*bs+2]++
				res, _ = x.Match(nil, q, v.keys, false)
				if res.Tokens != 2*bs {
					t.Fatalf("variant %d with a changed token: matched %d tokens, want %d", k, res.Tokens, 2*bs)
				}
			}
			// An adapter no variant has matches nothing: it enters every
			// block's hash, the trunk's too.
			q := append(append([]int32{}, vs[0].prompt...), 7)
			res, _ := x.Match(nil, q, &Keys{Adapter: 12345}, false)
			if res.Tokens != 0 {
				t.Fatalf("an unknown adapter matched %d tokens", res.Tokens)
			}
		})
	}
}
