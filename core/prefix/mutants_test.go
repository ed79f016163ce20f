package prefix

import (
	"slices"
	"testing"
)

// Events drained a few at a time carry their own fields: each BlockStored
// its block's tokens and multimodal entries, each BlockRemoved its hashes,
// whatever the batch sizes, across the queue's compactions.
func TestDrainInPiecesKeepsEachEventsFields(t *testing.T) {
	const bs = 2
	x := newIndex(t, bs, 32, true)
	img := Sum([]byte("img"))
	type want struct {
		kind   EventKind
		hash   Hash
		tokens []int32
		mm     int
		hashes []Hash
	}
	var wants []want
	for round := range 4 {
		toks := seq(int32(100*round), 6) // three blocks
		var keys *Keys
		if round%2 == 1 {
			keys = &Keys{MM: []MMItem{{Offset: 3, Length: 2, Hash: img}}}
		}
		ids := []int32{int32(3 * round), int32(3*round + 1), int32(3*round + 2)}
		held := cache(t, x, toks, keys, ids...)
		for i := range 3 {
			h, ok := x.BlockHash(held[i])
			if !ok {
				t.Fatalf("block %d not cached", held[i])
			}
			nmm := 0
			if keys != nil && i > 0 { // the item covers tokens 3 and 4: blocks 1 and 2
				nmm = 1
			}
			wants = append(wants, want{kind: BlockStored, hash: h, tokens: toks[i*bs : (i+1)*bs], mm: nmm})
		}
		if round%2 == 0 {
			unlock(t, x, held...)
			info, _ := x.EvictBlocks(nil, nil, 2, false)
			if len(info) != 2 {
				t.Fatalf("evicted %v", info)
			}
			wants = append(wants, want{kind: BlockRemoved, hashes: []Hash{info[0].Hash, info[1].Hash}})
		}
	}
	var got []Event
	for k := 0; len(got) < len(wants); k++ {
		evs := x.DrainEvents(1 + k%3)
		if len(evs) == 0 {
			t.Fatalf("drained %d events of %d", len(got), len(wants))
		}
		got = append(got, evs...)
		check(t, x)
	}
	if evs := x.DrainEvents(0); evs != nil {
		t.Fatalf("%d events left", len(evs))
	}
	for i, w := range wants {
		ev := got[i]
		if ev.Kind != w.kind {
			t.Fatalf("event %d is %v, want %v", i, ev.Kind, w.kind)
		}
		switch w.kind {
		case BlockStored:
			if ev.Hash != w.hash || !slices.Equal(ev.Tokens, w.tokens) || ev.BlockSize != bs || len(ev.MM) != w.mm {
				t.Fatalf("event %d: hash %s tokens %v (%d mm entries), want %s %v (%d)", i, ev.Hash, ev.Tokens, len(ev.MM), w.hash, w.tokens, w.mm)
			}
		case BlockRemoved:
			if !slices.Equal(ev.Hashes, w.hashes) {
				t.Fatalf("event %d removes %v, want %v", i, ev.Hashes, w.hashes)
			}
		}
	}
}
