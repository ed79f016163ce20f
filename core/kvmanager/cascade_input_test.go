package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kverr"
)

// sharingManager builds a manager whose live sequences share blocks the
// ways an engine's do: prompts admitted through the prefix cache with one
// of a few system prompts (some with a group-level few-shot block after
// it), forks of some of them (parallel sampling), decode growth of all.
// It returns the live ids in a shuffled order.
func sharingManager(t testing.TB, r *rand.Rand, bs, seqs int) (*Manager, []int64) {
	t.Helper()
	m, err := New(Config{NumBlocks: 1 << 13, BlockSize: bs, EnablePrefixCache: true})
	if err != nil {
		t.Fatal(err)
	}
	systems := make([][]int32, 3)
	for i := range systems {
		systems[i] = seqTokens(r, bs*(4+r.IntN(40))+r.IntN(bs))
	}
	shots := [][]int32{seqTokens(r, 3*bs), seqTokens(r, 7*bs+1)}
	var ids []int64
	next := int64(1)
	for len(ids) < seqs {
		p := slices.Clone(systems[r.IntN(len(systems))])
		if r.IntN(2) == 0 {
			p = append(p, shots[r.IntN(len(shots))]...)
		}
		p = append(p, seqTokens(r, 1+r.IntN(5*bs))...)
		id := next
		next++
		if n, err := m.Admit([]int64{id}, one(p, nil), nil); err != nil || n != 1 {
			t.Fatalf("admit: %d, %v", n, err)
		}
		ids = append(ids, id)
		if r.IntN(4) == 0 && len(ids) < seqs {
			kids := make([]int64, 1+r.IntN(min(6, seqs-len(ids))))
			for k := range kids {
				kids[k] = next
				next++
			}
			if _, err := m.Fork(id, kids, make([]CopyPair, len(kids))); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, kids...)
		}
	}
	// A few decode steps: every sequence grows by one token a step.
	for step := 0; step < r.IntN(3*bs); step++ {
		counts := make([]int32, len(ids))
		for i := range counts {
			counts[i] = 1
		}
		if err := m.Grow(ids, counts); err != nil {
			t.Fatal(err)
		}
	}
	r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	return m, ids
}

func cascadeShape(in *cascade.Input) {
	in.NumQHeads, in.NumKVHeads, in.HeadDim, in.DTypeBytes = 32, 8, 128, 2
}

// planOf plans in into a fresh host workspace of capacity maxBatch and
// returns the workspace and the summary.
func planOf(t testing.TB, in *cascade.Input, maxBatch int) ([]int32, cascade.Summary) {
	t.Helper()
	l, err := cascade.NewLayout(maxBatch, in.NumQHeads, in.NumKVHeads, in.HeadDim)
	if err != nil {
		t.Fatal(err)
	}
	ws := make([]int32, l.HostInts)
	var p cascade.Planner
	s, err := p.Plan(in, &l, ws)
	if err != nil {
		t.Fatal(err)
	}
	return ws, s
}

// The plan from the manager's tables is the plan of the host arrays that
// Describe writes for the same batch: the same summary and the same host
// workspace, word for word, over random sharing (prefix cache, groups,
// forks), block sizes 1, 16 and 64, table widths with and without spare
// columns, repeated ids, and a scratch left dirty by a larger batch.
func TestCascadeInputPlansAsDescribe(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	var sc CascadeScratch
	shared := 0
	for trial := 0; trial < 60; trial++ {
		bs := []int{1, 16, 64}[trial%3]
		seqs := 1 + r.IntN(64)
		m, ids := sharingManager(t, r, bs, seqs)
		if trial%5 == 4 {
			ids = append(ids, ids[r.IntN(len(ids))]) // a repeat, as Describe allows
		}
		lens := make([]int32, len(ids))
		if _, err := m.Describe(ids, 0, nil, lens, nil); err != nil {
			t.Fatal(err)
		}
		need := 0
		for _, n := range lens {
			need = max(need, (int(n)+bs-1)/bs)
		}
		width := need + r.IntN(3)*r.IntN(50)
		table := make([]int32, len(ids)*width)
		if _, err := m.Describe(ids, width, table, lens, nil); err != nil {
			t.Fatal(err)
		}
		var want cascade.Input
		cascadeShape(&want)
		want.BlockSize, want.Tables, want.TableStride, want.MaxBlocksPerSeq, want.SeqLens = bs, table, width, width, lens

		// Leave the scratch dirty where rows end: the planner must never
		// read past a sequence's blocks.
		for i := range sc.table {
			sc.table[i] = int32(r.Uint32())
		}
		var got cascade.Input
		cascadeShape(&got)
		if err := m.CascadeInput(ids, width, &got, &sc); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got.SeqLens, lens) || got.BlockSize != bs || got.TableStride != width || got.MaxBlocksPerSeq != width {
			t.Fatalf("trial %d: input lens/shape differ from describe's", trial)
		}
		maxBatch := len(ids) + r.IntN(8)
		for _, keep := range []bool{false, true} {
			want.NoDecodeRoute, got.NoDecodeRoute = keep, keep
			wws, ws := planOf(t, &want, maxBatch)
			gws, gs := planOf(t, &got, maxBatch)
			if ws != gs {
				t.Fatalf("trial %d: summaries differ: describe %+v, manager %+v", trial, ws, gs)
			}
			if !slices.Equal(wws, gws) {
				t.Fatalf("trial %d: host workspaces differ", trial)
			}
			if keep && ws.Nodes > 0 {
				shared++
			}
		}
	}
	// Most batches must have shared runs, or the comparison above says
	// little about the tree search.
	if shared < 40 {
		t.Fatalf("only %d of 60 batches had shared runs", shared)
	}
}

// The generated managers do share: the test above compares real trees.
func TestCascadeInputFindsTheSharing(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	m, ids := sharingManager(t, r, 16, 48)
	var in cascade.Input
	cascadeShape(&in)
	in.NoDecodeRoute = true // whether sharing pays is the cost model's business; the tree is what is tested
	var sc CascadeScratch
	if err := m.CascadeInput(ids, 512, &in, &sc); err != nil {
		t.Fatal(err)
	}
	_, s := planOf(t, &in, 48)
	if s.Route != cascade.RouteCascade || s.Nodes < 3 || s.SavedTokens*2 < s.TotalTokens {
		t.Fatalf("48 sequences over 3 system prompts: %+v", s)
	}
}

// Bad arguments are errors that leave the input and the scratch as they
// were; an empty batch is an empty input.
func TestCascadeInputErrors(t *testing.T) {
	m := newCached(t, 256, 16, false)
	if err := m.Add(1, 100); err != nil { // 7 blocks
		t.Fatal(err)
	}
	var sc CascadeScratch
	var in cascade.Input
	cascadeShape(&in)
	if err := m.CascadeInput([]int64{1}, 8, &in, &sc); err != nil {
		t.Fatal(err)
	}
	before, tbl := in, slices.Clone(sc.table)
	for _, c := range []struct {
		name      string
		ids       []int64
		maxBlocks int
		want      kverr.Code
	}{
		{"unknown id", []int64{1, 2}, 8, kverr.UnknownSequence},
		{"too many blocks", []int64{1}, 6, kverr.BufferTooSmall},
		{"max_blocks 0", []int64{1}, 0, kverr.InvalidArgument},
		{"max_blocks 2^30+1", []int64{1}, 1<<30 + 1, kverr.InvalidArgument},
		{"table too large", []int64{1, 1, 1}, 1 << 27, kverr.InvalidArgument},
		{"batch too large", make([]int64, 1<<16+1), 1, kverr.InvalidArgument},
	} {
		err := m.CascadeInput(c.ids, c.maxBlocks, &in, &sc)
		if kverr.CodeOf(err) != c.want {
			t.Errorf("%s: got %v, want %v", c.name, err, c.want)
		}
		if fmt.Sprint(in) != fmt.Sprint(before) || !slices.Equal(sc.table, tbl) {
			t.Errorf("%s: a failed call changed the input or the scratch", c.name)
		}
	}
	if err := m.CascadeInput(nil, 4, &in, &sc); err != nil || len(in.SeqLens) != 0 || in.SeqLens == nil {
		t.Fatalf("empty batch: %v, lens %v", err, in.SeqLens)
	}
	_, s := planOf(t, &in, 1)
	if s.Batch != 0 || s.Route != cascade.RouteDecode {
		t.Fatalf("empty batch plan: %+v", s)
	}
}

// Gathering while other goroutines grow, fork and remove sequences: each
// gather is a consistent snapshot (every row's length within its blocks),
// and the race detector sees the lock cover every read.
func TestCascadeInputConcurrent(t *testing.T) {
	m := newCached(t, 1<<14, 16, false)
	for id := int64(1); id <= 32; id++ {
		if err := m.Add(id, 40+int(id)); err != nil {
			t.Fatal(err)
		}
	}
	ids := make([]int64, 16)
	for i := range ids {
		ids[i] = int64(i + 1)
	}
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		counts := make([]int32, len(ids))
		for i := range counts {
			counts[i] = 1
		}
		for k := 0; k < 2000; k++ { // 2000 tokens each: 2000 more blocks in all
			if err := m.Grow(ids, counts); err != nil {
				t.Error(err)
				return
			}
			if k%16 == 0 {
				if _, err := m.Fork(20, []int64{100}, make([]CopyPair, 1)); err != nil {
					t.Error(err)
					return
				}
				if err := m.Remove([]int64{100}); err != nil {
					t.Error(err)
					return
				}
			}
		}
	}()
	var sc CascadeScratch
	for k := 0; ; k++ {
		select {
		case <-done:
			if k < 10 {
				t.Fatalf("only %d gathers ran beside the growth", k)
			}
			wg.Wait()
			return
		default:
		}
		var in cascade.Input
		if err := m.CascadeInput(ids, 1024, &in, &sc); err != nil {
			t.Fatal(err)
		}
		for i, n := range in.SeqLens {
			b := (int(n) + 15) / 16
			row := in.Tables[i*1024 : i*1024+b]
			if slices.Contains(row, -1) || int(n) < 40+i+1 {
				t.Fatalf("row %d of length %d: %v", i, n, row[:min(b, 4)])
			}
		}
	}
}

// The gather of a 256-sequence batch of 4096-token sequences (block size
// 16): the cost the manager path adds to Planner.Plan.
func BenchmarkCascadeInput256x4096(b *testing.B) {
	m, err := New(Config{NumBlocks: 1 << 17, BlockSize: 16})
	if err != nil {
		b.Fatal(err)
	}
	ids := make([]int64, 256)
	for i := range ids {
		ids[i] = int64(i)
		if err := m.Add(int64(i), 4096); err != nil {
			b.Fatal(err)
		}
	}
	var sc CascadeScratch
	var in cascade.Input
	for b.Loop() {
		if err := m.CascadeInput(ids, 256, &in, &sc); err != nil {
			b.Fatal(err)
		}
	}
}
