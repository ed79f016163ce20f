package attnref

// GPU tests of the e4m3 (FP8) cache: the KV write's quantisation bit-exact
// with the reference's, and decode over e4m3 caches against the float64
// reference over the dequantised cache, outputs poisoned first. Run as the
// other GPU tests (gpu_test.go).

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
	"github.com/kvplug/kvplug/internal/testseed"
)

// e4m3Cache is a problem's K and V quantised into an e4m3 cache by the
// reference write: the layout (strides in bytes, padded when asked), the
// caches and their scales.
type e4m3Cache struct {
	kv     attn.PagedKV
	w      attn.KVWriteLayout
	kc, vc []byte
	ks, vs []float32
}

func newE4M3Cache(t testing.TB, p *decodeProblem, kind attn.ScaleKind, padded bool) *e4m3Cache {
	t.Helper()
	D, H, bs := int64(p.l.HeadDim), int64(p.l.NumKVHeads), int64(p.l.BlockSize)
	pad := int64(0)
	if padded {
		pad = 16
	}
	c := &e4m3Cache{kv: p.l.PagedKV}
	c.kv.DType, c.kv.ScaleKind = attn.E4M3, kind
	c.kv.CacheHeadStride = D + pad
	c.kv.CacheTokenStride = H * c.kv.CacheHeadStride
	c.kv.CacheBlockStride = bs*c.kv.CacheTokenStride + pad
	n := int64(c.kv.NumBlocks) * c.kv.CacheBlockStride
	c.kc, c.vc = make([]byte, n), make([]byte, n)
	for i := range c.kc {
		c.kc[i], c.vc[i] = 0x7f, 0x7f // NaN: a read of an unwritten slot shows
	}
	ns := scaleLen(&c.kv, p.l.NumKVHeads)
	c.ks, c.vs = make([]float32, ns), make([]float32, ns)
	if kind == attn.ScaleTensor {
		// A calibrated scale: the batch's largest magnitude maps to 448.
		amax := func(buf []byte) float64 {
			m := 0.0
			for i := int64(0); i < int64(len(buf)/p.w.DType.Size()); i++ {
				m = math.Max(m, math.Abs(p.w.DType.Load(buf, i)))
			}
			return m
		}
		c.ks[0], c.vs[0] = float32(amax(p.key)/attn.E4M3Max), float32(amax(p.value)/attn.E4M3Max)
	} else {
		for i := range c.ks {
			c.ks[i], c.vs[i] = float32(math.NaN()), float32(math.NaN())
		}
	}
	c.w = p.w
	c.w.PagedKV = c.kv
	c.w.MaxBlocksPerSeq, c.w.BlockTableStride, c.w.BlockTable = 0, 0, 0
	if err := KVWriteE4M3(&c.w, p.key, p.value, p.slots, c.kc, c.vc, c.ks, c.vs); err != nil {
		t.Fatalf("KVWriteE4M3: %v", err)
	}
	return c
}

// decodeLayout is p's decode over this cache.
func (c *e4m3Cache) decodeLayout(p *decodeProblem) attn.DecodeLayout {
	l := p.l
	l.PagedKV = c.kv
	return l
}

// upload places the caches and scales on the device.
func (c *e4m3Cache) upload(t testing.TB, kv *attn.PagedKV) {
	kv.KCache, kv.VCache = gputest.Upload(t, c.kc), gputest.Upload(t, c.vc)
	kv.KScale, kv.VScale = gputest.Upload(t, gputest.Float32Bytes(c.ks)), gputest.Upload(t, gputest.Float32Bytes(c.vs))
}

// checkE4M3Decode compares a decode over c (outputs in g) with the float64
// reference over the dequantised cache, and bounds the error that FP8
// itself brings against the exact 16-bit reference.
func checkE4M3Decode(t testing.TB, p *decodeProblem, c *e4m3Cache, l *attn.DecodeLayout, g *gpuDecode, splits int, what string) {
	t.Helper()
	out := gputest.Download(t, g.args.Out, g.outBytes)
	want := make([]byte, g.outBytes)
	wantLSE := make([]float32, l.Rows()*l.NumQHeads)
	if err := PagedDecodeE4M3(l, p.q, c.kc, c.vc, c.ks, c.vs, p.table, p.lens, want, wantLSE, max(splits, 1)); err != nil {
		t.Fatal(err)
	}
	compareOut(t, what, l.DType, l.HeadDim, l.Rows(), l.NumQHeads, l.OutBatchStride, l.OutHeadStride, out, want)
	if g.args.LSE != 0 {
		compareLSE(t, what, gputest.DownloadF32(t, g.args.LSE, len(wantLSE)), wantLSE)
	}
	// FP8's own error: against attention over the 16-bit cache.
	exact := make([]byte, g.outBytes)
	pl := p.l
	pl.Batch = l.Batch
	if err := PagedDecode(&pl, p.q, p.kc, p.vc, p.table, p.lens, exact, nil, 1); err != nil {
		t.Fatal(err)
	}
	var num, den float64
	for row := int64(0); row < int64(l.Rows()); row++ {
		for h := int64(0); h < int64(l.NumQHeads); h++ {
			for e := int64(0); e < int64(l.HeadDim); e++ {
				i := row*l.OutBatchStride + h*l.OutHeadStride + e
				gv, ev := l.DType.Load(out, i), l.DType.Load(exact, i)
				num += (gv - ev) * (gv - ev)
				den += ev * ev
			}
		}
	}
	if !(den == 0 && num == 0 || math.Sqrt(num/den) <= 0.08) {
		t.Fatalf("%s: e4m3 decode is %.3g (relative L2) from the 16-bit cache's result; FP8 rounding alone stays under 0.08", what, math.Sqrt(num/den))
	}
}

func TestGPUKVWriteE4M3(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 11)
	for _, d := range []attn.DType{attn.F16, attn.BF16} {
		for _, D := range []int{64, 128, 256} {
			for _, kind := range []attn.ScaleKind{attn.ScaleTokenHead, attn.ScaleTensor} {
				for _, bs := range []int{1, 16} {
					name := fmt.Sprintf("%v_D%d_scale%d_bs%d", d, D, kind, bs)
					r := rand.New(rand.NewPCG(r.Uint64(), 2))
					t.Run(name, func(t *testing.T) {
						p := newDecodeProblem(t, r, problemShape{d, D, 8, 2, bs, raggedLens(r, 5, bs, 300), true})
						// A padding token and an out-of-range slot: both skipped.
						if len(p.slots) > 2 {
							p.slots[1] = -1
							p.slots[len(p.slots)-1] = int32(p.w.NumBlocks * p.w.BlockSize)
						}
						c := newE4M3Cache(t, p, kind, bs == 16)
						a := attn.KVWriteArgs{KVWriteLayout: c.w, Key: gputest.Upload(t, p.key), Value: gputest.Upload(t, p.value),
							SlotMapping: gputest.Upload(t, gputest.Int32Bytes(p.slots))}
						a.KCache, a.VCache = poisoned(t, attn.E4M3, len(c.kc)), poisoned(t, attn.E4M3, len(c.vc))
						if kind == attn.ScaleTensor {
							a.KScale, a.VScale = gputest.Upload(t, gputest.Float32Bytes(c.ks)), gputest.Upload(t, gputest.Float32Bytes(c.vs))
						} else {
							a.KScale, a.VScale = poisoned(t, attn.F32, 4*len(c.ks)), poisoned(t, attn.F32, 4*len(c.vs))
						}
						if err := attn.KVWrite(&a, 0); err != nil {
							t.Fatal(err)
						}
						gotK, gotV := gputest.Download(t, a.KCache, len(c.kc)), gputest.Download(t, a.VCache, len(c.vc))
						for i := range gotK {
							if gotK[i] != c.kc[i] || gotV[i] != c.vc[i] {
								t.Fatalf("cache byte %d: gpu K %#02x V %#02x, reference K %#02x V %#02x", i, gotK[i], gotV[i], c.kc[i], c.vc[i])
							}
						}
						gotKS, gotVS := gputest.DownloadF32(t, a.KScale, len(c.ks)), gputest.DownloadF32(t, a.VScale, len(c.vs))
						for i := range gotKS {
							if math.Float32bits(gotKS[i]) != math.Float32bits(c.ks[i]) || math.Float32bits(gotVS[i]) != math.Float32bits(c.vs[i]) {
								t.Fatalf("scale %d: gpu K %g V %g, reference K %g V %g", i, gotKS[i], gotVS[i], c.ks[i], c.vs[i])
							}
						}
						// Decode over the GPU-written cache, clean sequences only.
						clean := p.cleanPrefix()
						if clean == 0 {
							return
						}
						g := uploadDecode(t, p, 1, true)
						l := c.decodeLayout(p)
						l.Batch = clean
						g.args.DecodeLayout = l
						g.args.KCache, g.args.VCache, g.args.KScale, g.args.VScale = a.KCache, a.VCache, a.KScale, a.VScale
						g.args.BlockTable = gputest.Upload(t, gputest.Int32Bytes(p.table))
						if err := attn.PagedDecode(&g.args, 0); err != nil {
							t.Fatal(err)
						}
						checkE4M3Decode(t, p, c, &l, g, 1, name)
					})
				}
			}
		}
	}
}

func TestGPUPagedDecodeE4M3(t *testing.T) {
	gputest.NeedKernels(t, attn.Prepare)
	r := testseed.Rand(t, 13)
	type tc struct {
		d                           attn.DType
		D, qh, kvh, bs, qLen, split int
		maxLen, batch               int
		kind                        attn.ScaleKind
	}
	var cases []tc
	for _, d := range []attn.DType{attn.F16, attn.BF16} {
		for _, D := range []int{64, 128, 256} {
			for _, bs := range []int{1, 16, 64} {
				for i, g := range []int{1, 4, 8} {
					kind := []attn.ScaleKind{attn.ScaleTokenHead, attn.ScaleTensor}[(bs+i)%2]
					split := []int{1, 0, 3}[(bs+g)%3]
					cases = append(cases, tc{d, D, 2 * g, 2, bs, 1, split, 700, 5, kind})
				}
			}
		}
	}
	cases = append(cases,
		tc{attn.BF16, 128, 32, 8, 16, 1, 0, 5000, 2, attn.ScaleTokenHead}, // the split heuristic
		tc{attn.F16, 128, 32, 8, 16, 4, 2, 900, 3, attn.ScaleTokenHead},   // 4 new tokens a sequence
		tc{attn.BF16, 64, 16, 2, 1, 16, 1, 300, 2, attn.ScaleTensor},      // 16 new tokens, token mode
	)
	for _, c := range cases {
		name := fmt.Sprintf("%v_D%d_q%d_kv%d_bs%d_qlen%d_split%d_scale%d", c.d, c.D, c.qh, c.kvh, c.bs, c.qLen, c.split, c.kind)
		r := rand.New(rand.NewPCG(r.Uint64(), 3))
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			lens := raggedLens(r, c.batch, c.bs, c.maxLen)
			for i := range lens {
				lens[i] = max(lens[i], c.qLen) // q_len new tokens need as many positions
			}
			p := newDecodeProblem(t, r, problemShape{c.d, c.D, c.qh, c.kvh, c.bs, lens, c.bs == 64})
			if c.qLen > 1 {
				// q_len rows per sequence: a fresh q with batch * q_len rows.
				p.l.QLen = c.qLen
				es := int64(c.d.Size())
				p.q = make([]byte, int64(p.l.Rows())*p.l.QBatchStride*es)
				for i := int64(0); i < int64(len(p.q))/es; i++ {
					c.d.Store(p.q, i, randVal(r, c.d))
				}
			}
			e := newE4M3Cache(t, p, c.kind, c.bs != 1)
			l := e.decodeLayout(p)
			g := uploadDecode(t, p, c.split, true)
			g.args.DecodeLayout = l // the e4m3 cache in place of the 16-bit one
			e.upload(t, &g.args.PagedKV)
			g.args.BlockTable = gputest.Upload(t, gputest.Int32Bytes(p.table))
			maxLen := 0
			for _, L := range p.lens {
				maxLen = max(maxLen, int(L))
			}
			g.args.MaxSeqLen = maxLen
			if err := attn.PagedDecode(&g.args, 0); err != nil {
				t.Fatal(err)
			}
			if err := cuda.Synchronize(); err != nil {
				t.Fatal(err)
			}
			splits := c.split
			if splits == 0 {
				dev, _ := cuda.DeviceInfo(0)
				splits = attn.DecodeSplits(dev.SMs, c.d, c.D, l.Batch, c.qh, c.kvh, maxLen)
			}
			checkE4M3Decode(t, p, e, &l, g, splits, name)
		})
	}
}

// The reference's own e4m3 path on the CPU: the write's round trip stays
// within e4m3's rounding of every element, and decode over the dequantised
// cache stays within FP8's error of the 16-bit result.
func TestE4M3ReferenceRoundTrip(t *testing.T) {
	r := testseed.Rand(t, 17)
	for _, kind := range []attn.ScaleKind{attn.ScaleTokenHead, attn.ScaleTensor} {
		p := newDecodeProblem(t, r, problemShape{attn.BF16, 64, 8, 2, 16, []int{40, 3, 0, 77}, true})
		c := newE4M3Cache(t, p, kind, true)
		kf, err := Dequantize(&c.kv, 2, 64, c.kc, c.ks)
		if err != nil {
			t.Fatal(err)
		}
		for b, seq := range p.seqK {
			for i, row := range seq {
				blk := int64(p.table[int64(b)*p.l.BlockTableStride+int64(i/16)])
				for h := int64(0); h < 2; h++ {
					s := float64(c.ks[scaleIndex(&c.kv, 2, blk, int64(i%16), h)])
					for e := int64(0); e < 64; e++ {
						x := row[h*64+e]
						got := attn.F32.Load(kf, blk*c.kv.CacheBlockStride+int64(i%16)*c.kv.CacheTokenStride+h*c.kv.CacheHeadStride+e)
						// Half a step of e4m3 at x's magnitude (3 mantissa bits), or half the subnormal step.
						if bound := math.Max(math.Abs(x)/16, s/1024) * 1.0001; math.Abs(got-x) > bound {
							t.Fatalf("scale kind %d: seq %d token %d head %d dim %d: %g came back as %g (bound %g)", kind, b, i, h, e, x, got, bound)
						}
					}
				}
			}
		}
		l := c.decodeLayout(p)
		out := make([]byte, p.outBytes())
		if err := PagedDecodeE4M3(&l, p.q, c.kc, c.vc, c.ks, c.vs, p.table, p.lens, out, nil, 1); err != nil {
			t.Fatal(err)
		}
		if err := PagedDecode(&l, p.q, c.kc, c.vc, p.table, p.lens, out, nil, 1); err == nil {
			t.Fatal("PagedDecode took an e4m3 layout without its scales")
		}
	}
}
