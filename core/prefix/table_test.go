package prefix

import (
	"math/rand/v2"
	"testing"
)

// TestNodeTableAgainstMap drives the table with random puts and deletes
// (many hashes sharing their first bytes, so probe sequences collide and
// wrap) and compares every lookup with a Go map.
func TestNodeTableAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tab := newNodeTable()
	ref := map[Hash]int32{}
	var keys []Hash
	key := func() Hash {
		var h Hash
		// Few distinct first bytes: many keys share a home slot.
		h[0] = byte(r.IntN(4))
		for i := 8; i < 16; i++ {
			h[i] = byte(r.IntN(256))
		}
		return h
	}
	for step := range 20000 {
		switch {
		case r.IntN(3) > 0 || len(keys) == 0:
			h := key()
			if _, ok := ref[h]; ok {
				continue
			}
			if step%2 == 0 {
				tab.put(h, int32(step))
			} else if _, slot, ok := tab.lookup(h); ok {
				t.Fatalf("step %d: lookup found %x before it was put", step, h)
			} else {
				tab.putAt(slot, h, int32(step))
			}
			ref[h] = int32(step)
			keys = append(keys, h)
		default:
			i := r.IntN(len(keys))
			h := keys[i]
			keys[i] = keys[len(keys)-1]
			keys = keys[:len(keys)-1]
			tab.del(h)
			delete(ref, h)
			tab.del(h) // a second delete is a no-op
		}
		if step%97 == 0 || step > 19900 {
			if tab.len() != len(ref) {
				t.Fatalf("step %d: table holds %d, map %d", step, tab.len(), len(ref))
			}
			for h, v := range ref {
				if got, ok := tab.get(h); !ok || got != v {
					t.Fatalf("step %d: get %x = %d %v, want %d", step, h, got, ok, v)
				}
			}
			if _, ok := tab.get(key()); ok && len(ref) == 0 {
				t.Fatalf("step %d: an empty table found a key", step)
			}
			n := 0
			tab.each(func(h Hash, v int32) {
				if ref[h] != v {
					t.Fatalf("step %d: each gave %x = %d, map has %d", step, h, v, ref[h])
				}
				n++
			})
			if n != len(ref) {
				t.Fatalf("step %d: each visited %d of %d", step, n, len(ref))
			}
		}
	}
	tab.reset()
	if tab.len() != 0 {
		t.Fatal("reset left entries")
	}
	for h := range ref {
		if _, ok := tab.get(h); ok {
			t.Fatal("reset table finds a key")
		}
	}
}
