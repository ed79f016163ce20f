package prefix

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// insertInTurn is what InsertRun promises to be: Insert of each block in
// turn, each under the hash the one before returned, stopping at the first
// error.
func insertInTurn(x *Index, parent Hash, tokens []int32, keys *Keys, ids []int32) ([]InsertResult, error) {
	var out []InsertResult
	for k, id := range ids {
		res, err := x.Insert(parent, tokens[k*x.bs:(k+1)*x.bs], keys, id)
		if err != nil {
			return out, err
		}
		out = append(out, res)
		parent = res.Hash
	}
	return out, nil
}

// insertByRuns calls InsertRun as the manager does: again after each
// early stop at a twin, from the block after it.
func insertByRuns(x *Index, parent Hash, tokens []int32, keys *Keys, ids []int32) ([]InsertResult, error) {
	var out []InsertResult
	for len(ids) > 0 {
		res := make([]InsertResult, len(ids))
		n, err := x.InsertRun(parent, tokens, keys, ids, res)
		out = append(out, res[:n]...)
		if err != nil {
			return out, err
		}
		if n == 0 || (n < len(ids) && !res[n-1].Dup) {
			return out, fmt.Errorf("InsertRun stopped after %d of %d blocks with no twin and no error", n, len(ids))
		}
		parent = res[n-1].Hash
		tokens, ids = tokens[n*x.bs:], ids[n:]
	}
	return out, nil
}

// TestInsertRunIsInsertInTurn drives two indexes through the same random
// serving history, one inserting with Insert and one with InsertRun, and
// requires the same results, errors, locks, counters and eviction order:
// prompts share prefixes (so runs meet twins), some carry keys, some runs
// name a block already cached or outside the pool partway, and eviction
// between rounds frees node slots for reuse.
func TestInsertRunIsInsertInTurn(t *testing.T) {
	for _, bs := range []int{1, 4, 16, 32} {
		t.Run(fmt.Sprintf("bs%d", bs), func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(bs), 77))
			const numBlocks = 256
			a := newIndex(t, bs, numBlocks, true)
			b := newIndex(t, bs, numBlocks, true)
			sys := [][]int32{randTokens(r, 6*bs), randTokens(r, 3*bs+1)}
			keyChoices := []*Keys{nil, {Adapter: 3}, {Salt: []byte("t1"), MM: []MMItem{{Offset: int32(bs / 2), Length: int32(2*bs + 1), Hash: Sum([]byte("img"))}}}}
			var held []int32
			next := int32(0)
			dups, refusals := 0, 0
			for round := range 60 {
				prompt := append(slices.Clone(sys[r.IntN(len(sys))]), randTokens(r, r.IntN(4*bs))...)
				if r.IntN(3) == 0 {
					prompt = randTokens(r, r.IntN(8*bs))
				}
				keys := keyChoices[r.IntN(len(keyChoices))]
				full := len(prompt) / bs
				// Match on a, so that both start from the same parent; Match
				// on b too, so its clock and access times stay equal.
				ma, err := a.Match(nil, prompt, keys, false)
				if err != nil {
					t.Fatal(err)
				}
				mb, _ := b.Match(nil, prompt, keys, false)
				if !slices.Equal(ma.Blocks, mb.Blocks) || ma.Last != mb.Last {
					t.Fatalf("round %d: matches differ: %v %v", round, ma.Blocks, mb.Blocks)
				}
				start := len(ma.Blocks)
				// Sometimes restart one block early, so the run begins on a twin.
				if start > 0 && r.IntN(3) == 0 {
					start--
				}
				parent := Hash{}
				if start > 0 {
					parent, _ = b.BlockHash(ma.Blocks[start-1])
				}
				ids := make([]int32, full-start)
				for k := range ids {
					ids[k] = next % numBlocks
					next++
				}
				switch {
				case len(ids) > 2 && r.IntN(8) == 0:
					ids[len(ids)/2] = numBlocks + 5 // outside the pool
				case len(ids) > 2 && len(held) > 0 && r.IntN(8) == 0:
					ids[len(ids)/2] = held[r.IntN(len(held))] // cached already, likely elsewhere
				}
				toks := prompt[start*bs : full*bs]
				ra, ea := insertInTurn(a, parent, toks, keys, ids)
				rb, eb := insertByRuns(b, parent, toks, keys, ids)
				if fmt.Sprint(ea) != fmt.Sprint(eb) || !slices.Equal(ra, rb) {
					t.Fatalf("round %d: Insert in turn gave %v, %v; InsertRun %v, %v", round, ra, ea, rb, eb)
				}
				if ea != nil {
					refusals++
				}
				for _, res := range ra {
					if res.Dup {
						dups++
					}
					held = append(held, res.Block)
				}
				if round%7 == 6 {
					if err := a.Unlock(held); err != nil {
						t.Fatal(err)
					}
					if err := b.Unlock(held); err != nil {
						t.Fatal(err)
					}
					held = held[:0]
					n := r.IntN(a.Len() + 1)
					if ea, eb := a.Evict(nil, n), b.Evict(nil, n); !slices.Equal(ea, eb) {
						t.Fatalf("round %d: evictions differ: %v %v", round, ea, eb)
					}
				}
				check(t, a)
				check(t, b)
				if a.Stats() != b.Stats() {
					t.Fatalf("round %d: stats differ: %+v %+v", round, a.Stats(), b.Stats())
				}
				if ev1, ev2 := a.DrainEvents(0), b.DrainEvents(0); fmt.Sprint(ev1) != fmt.Sprint(ev2) {
					t.Fatalf("round %d: events differ", round)
				}
			}
			if err := a.Unlock(held); err != nil {
				t.Fatal(err)
			}
			if err := b.Unlock(held); err != nil {
				t.Fatal(err)
			}
			if ea, eb := a.Evict(nil, numBlocks), b.Evict(nil, numBlocks); !slices.Equal(ea, eb) {
				t.Fatalf("final evictions differ: %v %v", ea, eb)
			}
			// The history must have exercised twins and refusals.
			if dups == 0 || refusals == 0 {
				t.Fatalf("%d twins and %d refused runs: the scenario is too tame", dups, refusals)
			}
		})
	}
}

// TestInsertRunChecksFirst: bad arguments change nothing.
func TestInsertRunChecksFirst(t *testing.T) {
	x := newIndex(t, 4, 16, false)
	before := x.Stats()
	out := make([]InsertResult, 2)
	for _, c := range []struct {
		tokens []int32
		ids    []int32
		out    []InsertResult
		parent Hash
	}{
		{seq(0, 7), []int32{0, 1}, out, Hash{}},     // not whole blocks
		{seq(0, 8), []int32{0, 1}, out[:1], Hash{}}, // out too short
		{seq(0, 8), []int32{0, 1}, out, Hash{1, 2}}, // parent not cached
	} {
		if n, err := x.InsertRun(c.parent, c.tokens, nil, c.ids, c.out); err == nil || n != 0 {
			t.Fatalf("InsertRun(%v, %v): %d, %v; want an error and nothing done", c.tokens, c.ids, n, err)
		}
	}
	if x.Stats() != before || x.Len() != 0 {
		t.Fatal("a refused InsertRun changed the index")
	}
}
