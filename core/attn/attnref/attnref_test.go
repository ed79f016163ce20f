package attnref

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/testseed"
)

// raggedLens gives batch lengths including 0, 1, block boundaries and a
// length not a multiple of anything.
func raggedLens(r *rand.Rand, batch, blockSize, maxLen int) []int {
	lens := make([]int, batch)
	special := []int{0, 1, blockSize, blockSize + 1, maxLen}
	for i := range lens {
		if i < len(special) {
			lens[i] = min(special[i], maxLen)
		} else {
			lens[i] = r.IntN(maxLen + 1)
		}
	}
	r.Shuffle(len(lens), func(i, j int) { lens[i], lens[j] = lens[j], lens[i] })
	return lens
}

// The reference decode equals direct attention over each sequence's logical
// K and V, for block sizes 1..256, GQA groups 1..8, ragged lengths, padded
// strides, every dtype and split count.
func TestRefPagedDecodeMatchesNaive(t *testing.T) {
	r := testseed.Rand(t, 7)
	type tc struct {
		d              attn.DType
		D, qh, kvh, bs int
		maxLen, batch  int
		padded         bool
		splits         int
	}
	var cases []tc
	for _, bs := range []int{1, 16, 64, 256} {
		for _, g := range []int{1, 4, 8} {
			cases = append(cases, tc{attn.F32, 64, 2 * g, 2, bs, 300, 6, bs == 16, 1})
		}
	}
	cases = append(cases,
		tc{attn.F16, 128, 8, 2, 16, 200, 4, true, 3},
		tc{attn.BF16, 256, 4, 4, 64, 150, 3, false, 2},
		tc{attn.F32, 64, 8, 1, 1, 700, 3, false, 5},
		tc{attn.BF16, 64, 16, 2, 32, 90, 5, true, 7},
	)
	for _, c := range cases {
		name := fmt.Sprintf("%v_D%d_q%d_kv%d_bs%d_s%d", c.d, c.D, c.qh, c.kvh, c.bs, c.splits)
		t.Run(name, func(t *testing.T) {
			p := newDecodeProblem(t, r, problemShape{c.d, c.D, c.qh, c.kvh, c.bs, raggedLens(r, c.batch, c.bs, c.maxLen), c.padded})
			out := make([]byte, p.outBytes())
			lse := make([]float32, c.batch*c.qh)
			if err := PagedDecode(&p.l, p.q, p.kc, p.vc, p.table, p.lens, out, lse, c.splits); err != nil {
				t.Fatal(err)
			}
			for b := 0; b < c.batch; b++ {
				for i := 0; i < c.qh; i++ {
					want, wantLSE := p.naive(b, i)
					oo := int64(b)*p.l.OutBatchStride + int64(i)*p.l.OutHeadStride
					for e := 0; e < c.D; e++ {
						got := c.d.Load(out, oo+int64(e))
						if math.Abs(got-want[e]) > ulp(c.d)*math.Abs(want[e])+subnormalStep(c.d) {
							t.Fatalf("b %d (len %d) head %d d %d: got %g, want %g", b, p.lens[b], i, e, got, want[e])
						}
					}
					gl := float64(lse[b*c.qh+i])
					if math.IsInf(wantLSE, -1) {
						if !math.IsInf(gl, -1) {
							t.Fatalf("b %d empty: lse %g, want -inf", b, gl)
						}
					} else if math.Abs(gl-wantLSE) > 1e-6*math.Max(1, math.Abs(wantLSE)) {
						t.Fatalf("b %d head %d: lse %g, want %g", b, i, gl, wantLSE)
					}
				}
			}
		})
	}
}

// Split counts change nothing beyond float64 rounding.
func TestRefPagedDecodeSplitsAgree(t *testing.T) {
	r := testseed.Rand(t, 7)
	p := newDecodeProblem(t, r, problemShape{attn.F32, 64, 4, 2, 16, []int{0, 1, 63, 64, 65, 500}, false})
	base := make([]byte, p.outBytes())
	baseLSE := make([]float32, 6*4)
	if err := PagedDecode(&p.l, p.q, p.kc, p.vc, p.table, p.lens, base, baseLSE, 1); err != nil {
		t.Fatal(err)
	}
	for _, s := range []int{2, 3, 8, 64} {
		out := make([]byte, p.outBytes())
		lse := make([]float32, 6*4)
		if err := PagedDecode(&p.l, p.q, p.kc, p.vc, p.table, p.lens, out, lse, s); err != nil {
			t.Fatal(err)
		}
		for i := int64(0); i < int64(len(out))/4; i++ {
			a, b := attn.F32.Load(base, i), attn.F32.Load(out, i)
			if math.Abs(a-b) > 2e-7*math.Abs(a)+1e-12 {
				t.Fatalf("splits %d: element %d is %g, unsplit %g", s, i, b, a)
			}
		}
		for i := range lse {
			if lse[i] != baseLSE[i] && math.Abs(float64(lse[i]-baseLSE[i])) > 1e-6 {
				t.Fatalf("splits %d: lse[%d] = %g, unsplit %g", s, i, lse[i], baseLSE[i])
			}
		}
	}
}

// With QLen new tokens per sequence, row b*QLen+t equals a one-token
// decode of sequence b cut to length L-QLen+t+1 (its causal view), for
// every split count; rows of a sequence shorter than the token's position
// are empty (out 0, lse -inf).
func TestRefPagedDecodeMultiToken(t *testing.T) {
	r := testseed.Rand(t, 7)
	for _, qLen := range []int{2, 5, 16} {
		p := newDecodeProblem(t, r, problemShape{attn.F32, 64, 4, 2, 16, []int{1, qLen, qLen + 1, 64, 300}, false})
		B, H, D := p.l.Batch, p.l.NumQHeads, p.l.HeadDim
		ml := p.l
		ml.QLen = qLen
		rowBytes := int(ml.QBatchStride) * 4
		q := make([]byte, B*qLen*rowBytes)
		for i := 0; i < len(q)/4; i++ {
			attn.F32.Store(q, int64(i), randVal(r, attn.F32))
		}
		out := make([]byte, B*qLen*int(ml.OutBatchStride)*4)
		lse := make([]float32, B*qLen*H)
		if err := PagedDecode(&ml, q, p.kc, p.vc, p.table, p.lens, out, lse, 3); err != nil {
			t.Fatal(err)
		}
		for tk := 0; tk < qLen; tk++ {
			// One token per sequence: row b of the view is row b*qLen+tk.
			one := p.l
			one.QBatchStride, one.OutBatchStride = int64(qLen)*ml.QBatchStride, int64(qLen)*ml.OutBatchStride
			lens := make([]int32, B)
			for b := range lens {
				lens[b] = max(0, p.lens[b]-int32(qLen)+int32(tk)+1)
			}
			qv := q[tk*rowBytes:]
			got := make([]byte, len(out)-tk*int(ml.OutBatchStride)*4)
			gotLSE := make([]float32, B*H)
			if err := PagedDecode(&one, qv, p.kc, p.vc, p.table, lens, got, gotLSE, 1); err != nil {
				t.Fatal(err)
			}
			for b := 0; b < B; b++ {
				row := b*qLen + tk
				for h := 0; h < H; h++ {
					if a, w := lse[row*H+h], gotLSE[b*H+h]; a != w && math.Abs(float64(a-w)) > 1e-5 {
						t.Fatalf("q_len %d token %d seq %d head %d: lse %g, one-token decode %g", qLen, tk, b, h, a, w)
					}
					for d := 0; d < D; d++ {
						a := attn.F32.Load(out, int64(row)*ml.OutBatchStride+int64(h)*ml.OutHeadStride+int64(d))
						w := attn.F32.Load(got, int64(b)*one.OutBatchStride+int64(h)*one.OutHeadStride+int64(d))
						if math.Abs(a-w) > 1e-5*math.Abs(w)+1e-9 {
							t.Fatalf("q_len %d token %d seq %d head %d dim %d: %g, one-token decode %g", qLen, tk, b, h, d, a, w)
						}
					}
				}
			}
		}
	}
	bad := newDecodeProblem(t, r, problemShape{attn.F32, 64, 4, 2, 16, []int{8}, false})
	bad.l.QLen = 17
	if err := PagedDecode(&bad.l, bad.q, bad.kc, bad.vc, bad.table, bad.lens, make([]byte, bad.outBytes()), nil, 1); err == nil {
		t.Fatal("q_len 17 accepted")
	}
}

// KV write puts each token where the slot says, skips padding and
// out-of-range slots, and touches nothing else.
func TestRefKVWrite(t *testing.T) {
	r := testseed.Rand(t, 7)
	for _, d := range []attn.DType{attn.F16, attn.BF16, attn.F32} {
		D, kvh, bs, nb := 64, 3, 4, 5
		vec := int64(16 / d.Size())
		l := attn.KVWriteLayout{
			DType: d, HeadDim: D, NumTokens: 6, NumKVHeads: kvh,
			KeyTokenStride: int64(kvh*D) + vec, KeyHeadStride: int64(D),
			ValueTokenStride: int64(kvh * D), ValueHeadStride: int64(D), PagedKV: attn.PagedKV{NumBlocks: nb, BlockSize: bs,
				// A combined [num_blocks, 2, block_size, kvh, D] tensor: K and V
				// share strides, V starts one half-block later.
				CacheBlockStride: int64(2 * bs * kvh * D), CacheTokenStride: int64(kvh * D), CacheHeadStride: int64(D)},
		}
		es := d.Size()
		key := make([]byte, int(l.KeyTokenStride)*l.NumTokens*es)
		value := make([]byte, int(l.ValueTokenStride)*l.NumTokens*es)
		for i := 0; i < len(key)/es; i++ {
			d.Store(key, int64(i), randVal(r, d))
		}
		for i := 0; i < len(value)/es; i++ {
			d.Store(value, int64(i), randVal(r, d))
		}
		slots := []int32{7, -1, 0, 19, 20, 1 << 30} // 20 = nb*bs: out of range
		combined := make([]byte, nb*2*bs*kvh*D*es)
		for i := 0; i < len(combined); i++ {
			combined[i] = 0xAB
		}
		before := append([]byte(nil), combined...)
		half := bs * kvh * D * es
		if err := KVWrite(&l, key, value, slots, combined, combined[half:]); err != nil {
			t.Fatal(err)
		}
		written := map[int]int{} // element index in combined -> token
		for tok, s := range slots {
			if s < 0 || int(s) >= nb*bs {
				continue
			}
			blk, off := int(s)/bs, int(s)%bs
			for h := 0; h < kvh; h++ {
				for e := 0; e < D; e++ {
					ki := blk*2*bs*kvh*D + off*kvh*D + h*D + e
					vi := ki + bs*kvh*D
					if got, want := d.Load(combined, int64(ki)), d.Load(key, int64(tok)*l.KeyTokenStride+int64(h*D+e)); got != want {
						t.Fatalf("%v: K of token %d head %d d %d = %g, want %g", d, tok, h, e, got, want)
					}
					if got, want := d.Load(combined, int64(vi)), d.Load(value, int64(tok)*l.ValueTokenStride+int64(h*D+e)); got != want {
						t.Fatalf("%v: V of token %d = %g, want %g", d, tok, got, want)
					}
					written[ki], written[vi] = tok, tok
				}
			}
		}
		for i := 0; i < len(combined)/es; i++ {
			if _, ok := written[i]; ok {
				continue
			}
			for k := 0; k < es; k++ {
				if combined[i*es+k] != before[i*es+k] {
					t.Fatalf("%v: element %d was written but no slot maps to it", d, i)
				}
			}
		}
	}
}

// Merging the states of parts of a sequence gives attention over the whole.
func TestRefMergeEqualsConcatenation(t *testing.T) {
	r := testseed.Rand(t, 7)
	for _, d := range []attn.DType{attn.F32, attn.BF16} {
		for _, n := range []int{1, 2, 3, 8} {
			const D, heads = 64, 4
			// One sequence of 200 tokens cut into n parts (some empty), each
			// attended as its own batch entry with the same query.
			total := 200
			cuts := []int{0, total}
			for len(cuts) < n {
				cuts = append(cuts, r.IntN(total+1))
			}
			if n > 1 {
				// A repeated cut: the part between the two copies is empty.
				cuts = append(cuts, cuts[r.IntN(len(cuts))])
			}
			sortInts(cuts)
			lens := make([]int, n)
			for i := range lens {
				lens[i] = cuts[i+1] - cuts[i]
			}
			if n > 1 && !slices.Contains(lens, 0) {
				t.Fatalf("cuts %v leave no part empty", cuts)
			}
			whole := newDecodeProblem(t, r, problemShape{d, D, heads, 1, 16, []int{total}, false})
			// Parts: same K/V rows, same query.
			parts := newDecodeProblem(t, r, problemShape{d, D, heads, 1, 16, lens, false})
			copyParts(t, whole, parts, cuts)
			out := make([]byte, parts.outBytes())
			lse := make([]float32, n*heads)
			if err := PagedDecode(&parts.l, parts.q, parts.kc, parts.vc, parts.table, parts.lens, out, lse, 1); err != nil {
				t.Fatal(err)
			}
			// Each part is a state [1 token, heads, D] at out[b], lse[b].
			ml := attn.MergeLayout{
				DType: d, HeadDim: D, NumStates: n, NumTokens: 1, NumHeads: heads,
				VTokenStride: parts.l.OutBatchStride, VHeadStride: parts.l.OutHeadStride,
				STokenStride: heads, SHeadStride: 1,
				OutTokenStride: int64(heads * D), OutHeadStride: D,
				OutLSETokenStride: heads, OutLSEHeadStride: 1,
			}
			vs := make([][]byte, n)
			ss := make([][]float32, n)
			es := int64(d.Size())
			for b := 0; b < n; b++ {
				vs[b] = out[int64(b)*parts.l.OutBatchStride*es:]
				ss[b] = lse[b*heads:]
			}
			merged := make([]byte, heads*D*int(es))
			mergedLSE := make([]float32, heads)
			if err := MergeStates(&ml, vs, ss, merged, mergedLSE); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < heads; i++ {
				want, wantLSE := whole.naive(0, i)
				for e := 0; e < D; e++ {
					got := d.Load(merged, int64(i*D+e))
					// Parts were rounded to the dtype before merging.
					if math.Abs(got-want[e]) > 2*ulp(d)*(math.Abs(want[e])+0.5) {
						t.Fatalf("%v n=%d lens %v head %d d %d: merged %g, whole %g", d, n, lens, i, e, got, want[e])
					}
				}
				if math.Abs(float64(mergedLSE[i])-wantLSE) > 1e-5*math.Max(1, math.Abs(wantLSE)) {
					t.Fatalf("%v n=%d: merged lse %g, whole %g", d, n, mergedLSE[i], wantLSE)
				}
			}
		}
	}
}

func sortInts(a []int) {
	for i := 1; i < len(a); i++ {
		for j := i; j > 0 && a[j] < a[j-1]; j-- {
			a[j], a[j-1] = a[j-1], a[j]
		}
	}
}

// copyParts makes parts' sequences the consecutive slices of whole's single
// sequence, and its queries equal to whole's, by rewriting parts' cache.
func copyParts(t *testing.T, whole, parts *decodeProblem, cuts []int) {
	t.Helper()
	d, D := whole.l.DType, whole.l.HeadDim
	for b := range parts.seqK {
		parts.seqK[b] = whole.seqK[0][cuts[b]:cuts[b+1]]
		parts.seqV[b] = whole.seqV[0][cuts[b]:cuts[b+1]]
		for tok := cuts[b]; tok < cuts[b+1]; tok++ {
			i := tok - cuts[b]
			blk := int64(parts.table[int64(b)*parts.l.BlockTableStride+int64(i/parts.l.BlockSize)])
			base := blk*parts.l.CacheBlockStride + int64(i%parts.l.BlockSize)*parts.l.CacheTokenStride
			for e := 0; e < D; e++ {
				d.Store(parts.kc, base+int64(e), whole.seqK[0][tok][e])
				d.Store(parts.vc, base+int64(e), whole.seqV[0][tok][e])
			}
		}
		for h := 0; h < parts.l.NumQHeads; h++ {
			for e := 0; e < D; e++ {
				v := d.Load(whole.q, int64(h)*whole.l.QHeadStride+int64(e))
				d.Store(parts.q, int64(b)*parts.l.QBatchStride+int64(h)*parts.l.QHeadStride+int64(e), v)
			}
		}
	}
}

func TestRefMergeAllEmptyAndInPlace(t *testing.T) {
	const D = 64
	l := attn.MergeLayout{DType: attn.F32, HeadDim: D, NumStates: 2, NumTokens: 2, NumHeads: 1,
		VTokenStride: D, VHeadStride: D, STokenStride: 1, SHeadStride: 1,
		OutTokenStride: D, OutHeadStride: D, OutLSETokenStride: 1, OutLSEHeadStride: 1}
	v0 := make([]byte, 2*D*4)
	v1 := make([]byte, 2*D*4)
	for i := int64(0); i < 2*D; i++ {
		attn.F32.Store(v0, i, 1)
		attn.F32.Store(v1, i, 3)
	}
	inf := float32(math.Inf(-1))
	s0 := []float32{inf, 0}
	s1 := []float32{inf, 0}
	// In place: out aliases v[0], out_lse aliases s[0].
	if err := MergeStates(&l, [][]byte{v0, v1}, [][]float32{s0, s1}, v0, s0); err != nil {
		t.Fatal(err)
	}
	for e := int64(0); e < D; e++ {
		if got := attn.F32.Load(v0, e); got != 0 {
			t.Fatalf("all-empty token: out[%d] = %g, want 0", e, got)
		}
		if got := attn.F32.Load(v0, D+e); got != 2 {
			t.Fatalf("equal weights: out[%d] = %g, want 2", e, got)
		}
	}
	if !math.IsInf(float64(s0[0]), -1) || math.Abs(float64(s0[1])-math.Ln2) > 1e-7 {
		t.Fatalf("lse = %v, want [-inf, ln 2]", s0)
	}
}

// The oracle refuses buffers too small for a valid layout, and a split
// count out of range.
func TestBuffersTooSmall(t *testing.T) {
	l := attn.DecodeLayout{DType: attn.F16, HeadDim: 128, Batch: 2, NumQHeads: 8, NumKVHeads: 2,
		QBatchStride: 8 * 128, QHeadStride: 128, OutBatchStride: 8 * 128, OutHeadStride: 128,

		Scale: 0.1, PagedKV: attn.PagedKV{NumBlocks: 4, BlockSize: 16, CacheBlockStride: 16 * 2 * 128, CacheTokenStride: 2 * 128, CacheHeadStride: 128,
			MaxBlocksPerSeq: 2, BlockTableStride: 2}}
	err := PagedDecode(&l, make([]byte, 10), make([]byte, 1<<20), make([]byte, 1<<20), make([]int32, 4), make([]int32, 2), make([]byte, 1<<20), nil, 1)
	if !kverr.Is(err, kverr.BufferTooSmall) {
		t.Errorf("short q: got %v, want BUFFER_TOO_SMALL", err)
	}
	err = PagedDecode(&l, make([]byte, 1<<20), make([]byte, 1<<20), make([]byte, 1<<20), make([]int32, 4), make([]int32, 2), make([]byte, 1<<20), make([]float32, 3), 1)
	if !kverr.Is(err, kverr.BufferTooSmall) {
		t.Errorf("short lse: got %v, want BUFFER_TOO_SMALL", err)
	}
	err = PagedDecode(&l, make([]byte, 1<<20), make([]byte, 1<<20), make([]byte, 1<<20), make([]int32, 4), make([]int32, 2), make([]byte, 1<<20), nil, 0)
	if !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("0 splits: got %v, want INVALID_ARGUMENT", err)
	}
}

// Two empty states merge to an empty state (0, -inf), never NaN; one empty
// state beside a full one has weight 0.
func TestMergeEmpty(t *testing.T) {
	out := []float64{7, 7}
	if st := Merge(out, []float64{0, 0, 0, 0}, []float64{math.Inf(-1), math.Inf(-1)}, 2); !math.IsInf(st, -1) || out[0] != 0 || out[1] != 0 {
		t.Fatalf("empty+empty: lse %g out %v", st, out)
	}
	if st := Merge(out, []float64{9, 9, 1, 2}, []float64{math.Inf(-1), 0.5}, 2); st != 0.5 || out[0] != 1 || out[1] != 2 {
		t.Fatalf("empty+state: lse %g out %v", st, out)
	}
	if st := Merge(out, nil, nil, 2); !math.IsInf(st, -1) || out[0] != 0 {
		t.Fatalf("no states: lse %g out %v", st, out)
	}
}
