package cascade_test

import (
	"math"
	"testing"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kverr"
)

// planLong plans seqs sequences of prefix shared tokens and newTok new
// tokens each (64 q / 8 kv heads, head_dim 128, block size 16).
func planLong(t *testing.T, seqs, prefix, newTok int, noDecode bool) (cascade.Summary, cascade.Layout, []int32, []int32) {
	t.Helper()
	const bs = 16
	n := prefix + newTok
	mb := (n + bs - 1) / bs
	table := make([]int32, seqs*mb)
	next := int32(0)
	for s := 0; s < seqs; s++ {
		for col := 0; col < mb; col++ {
			if col < prefix/bs {
				table[s*mb+col] = int32(col)
			} else {
				table[s*mb+col] = int32(mb) + next
				next++
			}
		}
	}
	lens, qo := make([]int32, seqs), make([]int32, seqs+1)
	for s := range lens {
		lens[s], qo[s+1] = int32(n), qo[s]+int32(newTok)
	}
	in := &cascade.Input{NumQHeads: 64, NumKVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: bs,
		Tables: table, TableStride: mb, MaxBlocksPerSeq: mb, SeqLens: lens, QIndptr: qo, NoDecodeRoute: noDecode}
	l := layoutFor(t, seqs, int(qo[seqs]), 64, 8, 128)
	var p cascade.Planner
	ws, s := planPoisoned(t, &p, in, &l, "long prompts")
	return s, l, ws, lens
}

// layoutFor is cascade.NewPrefillLayout's, failing the test on an error.
func layoutFor(t *testing.T, maxBatch, maxTokens, qh, kvh, D int) cascade.Layout {
	t.Helper()
	l, err := cascade.NewPrefillLayout(maxBatch, maxTokens, qh, kvh, D)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Long prompts, within max_tokens: the KV chunk the planner picks from the
// batch's work is bounded, so every tail item covers part of its
// sequence's tail (an int32 chunk past 2^31 wrapped negative, and every
// tail item read nothing).
func TestLongTailsChunkWithinInt32(t *testing.T) {
	for _, c := range []struct {
		name             string
		seqs, prefix, nt int
		noDecode         bool
	}{
		{"one prompt of 900k tokens", 1, 0, 900_000, true},
		{"two prompts of 650k new tokens over a shared 64k", 2, 65536, 650_000, false},
	} {
		s, l, ws, lens := planLong(t, c.seqs, c.prefix, c.nt, c.noDecode)
		if s.Route != cascade.RouteCascade {
			t.Fatalf("%s: route %d, want the cascade route", c.name, s.Route)
		}
		if s.Chunk <= 0 || s.Chunk > math.MaxInt32 || s.MaxKV < int(lens[0]) {
			t.Fatalf("%s: chunk %d, max_kv %d", c.name, s.Chunk, s.MaxKV)
		}
		covered := make([]int64, c.seqs)
		for i := 0; i < s.Items; i++ {
			it := ws[l.Items+i*cascade.ItemInts : l.Items+(i+1)*cascade.ItemInts]
			if it[cascade.IDynamic] == 0 || it[cascade.ITile] != 0 {
				continue
			}
			seq, kb, ke := it[cascade.IRep], it[cascade.IKVBegin], it[cascade.IKVEnd]
			if kb < 0 || ke <= kb {
				t.Fatalf("%s: tail item %d of sequence %d reads [%d, %d)", c.name, i, seq, kb, ke)
			}
			covered[seq] += int64(min(ke, lens[seq]) - min(kb, lens[seq]))
		}
		for seq, n := range covered {
			if tb := ws[l.TailBegin+seq]; n != int64(lens[seq]-tb) {
				t.Fatalf("%s: sequence %d's tail items cover %d of its tail's %d tokens", c.name, seq, n, lens[seq]-tb)
			}
		}
	}
}

// Query tokens times q heads per kv head are the packed rows the kernels
// count in int32: a batch of 2^31 of them is refused (INVALID_ARGUMENT),
// where its shared run's tiles wrapped to none and its merge read states
// nothing wrote.
func TestPackedRowsPastInt32Refused(t *testing.T) {
	const bs, prefix, q, qh, kvh, D = 16, 2048, 1 << 18, 4096, 1, 64
	n := prefix + q
	mb := n / bs
	table := make([]int32, 2*mb)
	for s := 0; s < 2; s++ {
		for c := 0; c < mb; c++ {
			table[s*mb+c] = int32(c)
			if c >= prefix/bs {
				table[s*mb+c] = int32(mb*(s+1) + c)
			}
		}
	}
	in := &cascade.Input{NumQHeads: qh, NumKVHeads: kvh, HeadDim: D, DTypeBytes: 2, BlockSize: bs,
		Tables: table, TableStride: mb, MaxBlocksPerSeq: mb, SeqLens: []int32{int32(n), int32(n)},
		QIndptr: []int32{0, q, 2 * q}, NoDecodeRoute: true}
	l := layoutFor(t, 2, 2*q, qh, kvh, D)
	var p cascade.Planner
	if _, err := p.Plan(in, &l, make([]int32, l.HostInts)); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("a plan of 2^31 packed rows: %v, want INVALID_ARGUMENT", err)
	}
	in.QIndptr = []int32{0, q - 1, 2*q - 2} // just below: planned
	if _, err := p.Plan(in, &l, make([]int32, l.HostInts)); err != nil {
		t.Fatalf("a plan of 2^31 - 8192 packed rows: %v", err)
	}
}

// A varlen plan whose query rows equal its sequences (q_len 0 beside 2)
// does not fit the next step: its rows map to sequences by this step's
// qo_indptr.
func TestUpdateVarlenRowsEqualBatch(t *testing.T) {
	table := []int32{0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23, 24, 25}
	in := &cascade.Input{NumQHeads: 8, NumKVHeads: 2, HeadDim: 64, DTypeBytes: 2, BlockSize: 16,
		Tables: table, TableStride: 10, MaxBlocksPerSeq: 10, SeqLens: []int32{100, 100}, QIndptr: []int32{0, 0, 2},
		NoDecodeRoute: true}
	l := layoutFor(t, 2, 2, 8, 2, 64)
	var p cascade.Planner
	ws, s := planPoisoned(t, &p, in, &l, "a varlen plan")
	if s.Rows != s.Batch {
		t.Fatalf("set-up: %d rows for %d sequences", s.Rows, s.Batch)
	}
	fits, err := cascade.Update(ws, &l, s.Route, s.Batch, []int32{101, 101})
	if err != nil || fits {
		t.Fatalf("Update of a varlen plan: fits %v, %v; want false", fits, err)
	}
}
