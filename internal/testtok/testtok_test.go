package testtok

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func TestIota(t *testing.T) {
	if got := Iota(7, 3); !slices.Equal(got, []int32{7, 8, 9}) {
		t.Fatalf("Iota(7, 3) = %v", got)
	}
	if got := Iota(0, 0); len(got) != 0 {
		t.Fatalf("Iota(0, 0) = %v", got)
	}
}

// Rand draws as r.IntN (and r.Int32N) do, one draw a token: a seeded
// test's prompts stay what they were.
func TestRandDrawsAsIntN(t *testing.T) {
	got := Rand(rand.New(rand.NewPCG(1, 2)), 100, 5)
	r := rand.New(rand.NewPCG(1, 2))
	for i, tok := range got {
		if want := r.Int32N(5); tok != want {
			t.Fatalf("token %d: %d, want %d", i, tok, want)
		}
	}
}
