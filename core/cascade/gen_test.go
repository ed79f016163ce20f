package cascade_test

import (
	. "github.com/kvplug/kvplug/core/cascade"
	"math/rand/v2"

	"github.com/kvplug/kvplug/core/attn"
)

// batch is a decode batch's host arrays.
type batch struct {
	bs, maxBlocks, stride int
	table                 []int32
	lens                  []int32
	qo                    []int32 // query offsets [batch+1]; nil: decode
	numBlocks             int
}

// treeCase is a test case over random trees: their spec and the attention
// shape of the layer.
type treeCase struct {
	name       string
	spec       treeSpec
	d          attn.DType
	qh, kvh, D int
}

// prefillCase is a test case over random trees whose sequences have up to
// maxQ new query tokens each.
type prefillCase struct {
	name       string
	spec       treeSpec
	maxQ       int
	d          attn.DType
	qh, kvh, D int
}

// treeSpec describes a random sharing tree: each level splits a group into
// children of random sizes that share a run of random length.
type treeSpec struct {
	seqs      int
	depth     int // shared levels, 0: no sharing
	maxRun    int // blocks per shared level, at most
	maxTail   int // own tokens, at most
	bs        int
	forkFrac  float64 // chance that a leaf group is a fork set (tails only)
	partialOK bool    // lengths may end inside a shared run
}

// randomSpec is a random tree of 1 to maxSeqs sequences with tails of 0 to
// maxTail-1 tokens: depth 0-4, shared runs of 1-12 blocks, block sizes
// 1/16/64, lengths ending inside shared runs half the time.
func randomSpec(r *rand.Rand, maxSeqs, maxTail int) treeSpec {
	return treeSpec{seqs: 1 + r.IntN(maxSeqs), depth: r.IntN(5), maxRun: 1 + r.IntN(12), maxTail: r.IntN(maxTail),
		bs: []int{1, 16, 64}[r.IntN(3)], partialOK: r.IntN(2) == 0}
}

// cycleHeads is the attention shape (q heads, kv heads, head_dim) of
// iteration iter of a random test: GQA groups 1, 4 and 8 over head_dim 64,
// 128 and 256 in turn.
func cycleHeads(iter int) (qh, kvh, D int) {
	return []int{4, 32, 8}[iter%3], []int{4, 8, 1}[iter%3], []int{64, 128, 256}[iter%3]
}

// genTree builds a batch whose sequences share runs of blocks as a random
// tree of the given depth; block ids are distinct per run, shuffled.
func genTree(r *rand.Rand, s treeSpec) *batch {
	next := int32(0)
	alloc := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = next
			next++
		}
		return out
	}
	rows := make([][]int32, s.seqs)
	var split func(members []int, level int)
	split = func(members []int, level int) {
		if level >= s.depth || len(members) == 0 {
			return
		}
		r.Shuffle(len(members), func(i, j int) { members[i], members[j] = members[j], members[i] })
		for len(members) > 0 {
			n := 1 + r.IntN(len(members))
			if r.Float64() < 0.3 {
				n = len(members)
			}
			g := members[:n]
			members = members[n:]
			run := alloc(1 + r.IntN(s.maxRun))
			for _, m := range g {
				rows[m] = append(rows[m], run...)
			}
			split(g, level+1)
		}
	}
	all := make([]int, s.seqs)
	for i := range all {
		all[i] = i
	}
	split(all, 0)
	b := &batch{bs: s.bs}
	lens := make([]int32, s.seqs)
	for i := range rows {
		shared := len(rows[i]) * s.bs
		tail := r.IntN(s.maxTail + 1)
		own := (tail + s.bs - 1) / s.bs
		rows[i] = append(rows[i], alloc(own)...)
		lens[i] = int32(shared + tail)
		if s.partialOK && r.IntN(5) == 0 && shared > 0 {
			lens[i] = int32(r.IntN(shared + 1))
		}
		b.maxBlocks = max(b.maxBlocks, len(rows[i]))
	}
	b.maxBlocks = max(b.maxBlocks, 1)
	b.stride = b.maxBlocks + r.IntN(3)
	b.table = make([]int32, s.seqs*b.stride)
	for i := range b.table {
		b.table[i] = -1 - int32(r.IntN(5)) // unused columns: garbage
	}
	perm := r.Perm(int(next))
	for i, row := range rows {
		for c, id := range row {
			b.table[i*b.stride+c] = int32(perm[id])
		}
	}
	b.lens = lens
	b.numBlocks = int(next)
	return b
}

func (b *batch) input(qh, kvh, D int) *Input {
	return &Input{NumQHeads: qh, NumKVHeads: kvh, HeadDim: D, DTypeBytes: 2, BlockSize: b.bs,
		Tables: b.table, TableStride: b.stride, MaxBlocksPerSeq: b.maxBlocks, SeqLens: b.lens, QIndptr: b.qo}
}

// withQueries gives each sequence a random number of query tokens: of its
// length, up to maxQ; a third of the sequences are decode rows (1), some
// have none.
func withQueries(r *rand.Rand, b *batch, maxQ int) *batch {
	b.qo = make([]int32, len(b.lens)+1)
	for s, n := range b.lens {
		q := int32(1)
		switch r.IntN(6) {
		case 0, 1:
		case 2:
			q = 0
		default:
			q = int32(1 + r.IntN(maxQ))
		}
		b.qo[s+1] = b.qo[s] + min(q, n)
	}
	return b
}

// widen gives every row extra table columns (unused, garbage).
func widen(b *batch, extra int) *batch {
	w := &batch{bs: b.bs, maxBlocks: b.maxBlocks + extra, stride: b.stride + extra, lens: b.lens, qo: b.qo, numBlocks: b.numBlocks}
	w.table = make([]int32, len(b.lens)*w.stride)
	for i := range w.table {
		w.table[i] = -3
	}
	for s := range b.lens {
		copy(w.table[s*w.stride:], b.table[s*b.stride:s*b.stride+b.maxBlocks])
	}
	return w
}
