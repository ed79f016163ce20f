package kvmanager

import (
	"math/rand/v2"
	"testing"
)

// TestSeqIndex checks the hash table against a Go map under random puts and
// deletes, with id patterns a scheduler uses and ones that collide.
func TestSeqIndex(t *testing.T) {
	patterns := map[string]func(r *rand.Rand) int64{
		"small":    func(r *rand.Rand) int64 { return int64(r.IntN(300)) },
		"strided":  func(r *rand.Rand) int64 { return int64(r.IntN(300)) << 32 },
		"random":   func(r *rand.Rand) int64 { return int64(r.Uint64()>>(r.IntN(64))) - 1<<20 },
		"negative": func(r *rand.Rand) int64 { return -int64(r.IntN(300)) },
	}
	for name, gen := range patterns {
		t.Run(name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(7, 7))
			var x seqIndex
			want := map[int64]*seq{}
			if x.get(5) != nil {
				t.Fatal("empty index found 5")
			}
			x.del(5) // no-op
			for step := range 20000 {
				id := gen(r)
				switch {
				case want[id] == nil && r.IntN(3) != 0:
					s := &seq{length: step}
					x.put(id, s)
					want[id] = s
				case want[id] != nil && r.IntN(2) == 0:
					x.del(id)
					delete(want, id)
				default:
					if a := id + 1<<40; want[a] == nil {
						x.del(a) // absent: a no-op
					}
				}
				if got := x.get(id); got != want[id] {
					t.Fatalf("step %d: get(%d) = %p, want %p", step, id, got, want[id])
				}
				if x.len() != len(want) {
					t.Fatalf("step %d: len %d, want %d", step, x.len(), len(want))
				}
				if step%1000 == 0 {
					n := 0
					for id, s := range x.all() {
						if want[id] != s {
							t.Fatalf("step %d: all yields %d -> %p, want %p", step, id, s, want[id])
						}
						n++
					}
					for id, s := range want {
						if x.get(id) != s {
							t.Fatalf("step %d: lost %d", step, id)
						}
					}
					if n != len(want) {
						t.Fatalf("step %d: all yields %d, want %d", step, n, len(want))
					}
				}
			}
		})
	}
}
