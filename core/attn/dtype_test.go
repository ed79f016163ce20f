package attn

import (
	"math"
	"math/rand/v2"
	"testing"
)

// Every binary16 value survives the trip through float32 (NaNs stay NaN).
func TestHalfRoundTrip(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := HalfToFloat(uint16(h))
		back := FloatToHalf(f)
		if f != f {
			if HalfToFloat(back) == HalfToFloat(back) {
				t.Fatalf("NaN %#04x came back as %#04x", h, back)
			}
			continue
		}
		if back != uint16(h) {
			t.Fatalf("%#04x -> %g -> %#04x", h, f, back)
		}
	}
}

// nearestEven checks that h is a correctly rounded encoding of f among its
// neighbours, with ties going to the even code.
func checkNearest(t *testing.T, name string, f float32, h uint16, dec func(uint16) float32) {
	t.Helper()
	got := float64(dec(h))
	if math.IsInf(got, 0) {
		return // overflow: the saturating cases are checked separately
	}
	err := math.Abs(got - float64(f))
	for _, n := range []uint16{h - 1, h + 1} {
		v := float64(dec(n))
		if v != v || math.IsInf(v, 0) || math.Signbit(v) != math.Signbit(got) && v != 0 {
			continue
		}
		e := math.Abs(v - float64(f))
		if e < err || (e == err && n&1 == 0 && h&1 == 1) {
			t.Fatalf("%s(%g) = %#04x (%g), but %#04x (%g) is nearer or the even tie", name, f, h, got, n, v)
		}
	}
}

func TestFloatToHalfRounding(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 200000; i++ {
		// Magnitudes from subnormal half to beyond its range.
		f := float32(math.Ldexp(r.Float64()*2-1, r.IntN(44)-26))
		checkNearest(t, "FloatToHalf", f, FloatToHalf(f), HalfToFloat)
		checkNearest(t, "FloatToBFloat16", f, FloatToBFloat16(f), BFloat16ToFloat)
	}
	// Exact ties of half: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10.
	if h := FloatToHalf(1 + 1.0/2048); h != 0x3c00 {
		t.Fatalf("tie 1+2^-11 -> %#04x, want 0x3c00 (even)", h)
	}
	if h := FloatToHalf(1 + 3.0/2048); h != 0x3c02 {
		t.Fatalf("tie 1+3*2^-11 -> %#04x, want 0x3c02 (even)", h)
	}
	if h := FloatToHalf(70000); h != 0x7c00 {
		t.Fatalf("70000 -> %#04x, want +inf", h)
	}
	if h := FloatToHalf(65519); h != 0x7bff {
		t.Fatalf("65519 -> %#04x, want 65504", h)
	}
	if h := FloatToBFloat16(float32(math.NaN())); BFloat16ToFloat(h) == BFloat16ToFloat(h) {
		t.Fatalf("bf16 of NaN is %#04x, not a NaN", h)
	}
}

func TestDTypeLoadStore(t *testing.T) {
	for _, d := range []DType{F16, BF16, F32} {
		buf := make([]byte, 4*d.Size())
		d.Store(buf, 2, 1.5)
		if got := d.Load(buf, 2); got != 1.5 {
			t.Fatalf("%v: stored 1.5, loaded %g", d, got)
		}
		if d.Load(buf, 0) != 0 || d.Load(buf, 3) != 0 {
			t.Fatalf("%v: store touched neighbours", d)
		}
	}
	if err := DType(7).check("x"); err == nil {
		t.Fatal("dtype 7 accepted")
	}
}

// Every e4m3 value survives the trip through float32; the two NaNs stay NaN.
func TestE4M3RoundTrip(t *testing.T) {
	for b := 0; b < 256; b++ {
		f := E4M3ToFloat(uint8(b))
		if b&0x7f == 0x7f {
			if f == f || FloatToE4M3(f)&0x7f != 0x7f {
				t.Fatalf("NaN %#02x decoded to %g, re-encoded to %#02x", b, f, FloatToE4M3(f))
			}
			continue
		}
		if back := FloatToE4M3(f); back != uint8(b) {
			t.Fatalf("%#02x -> %g -> %#02x", b, f, back)
		}
	}
	if E4M3ToFloat(0x7e) != E4M3Max || E4M3ToFloat(0x01) != 1.0/512 || E4M3ToFloat(0x08) != 1.0/64 || E4M3ToFloat(0xb8) != -1 {
		t.Fatalf("decoding: 0x7e %g, 0x01 %g, 0x08 %g, 0xb8 %g", E4M3ToFloat(0x7e), E4M3ToFloat(0x01), E4M3ToFloat(0x08), E4M3ToFloat(0xb8))
	}
}

// FloatToE4M3 rounds to the nearest code, ties to the even one, and
// saturates at +-448 (as the kernels' cvt.rn.satfinite): checked against a
// search over all 126 finite positive codes on random and tie inputs.
func TestFloatToE4M3Rounding(t *testing.T) {
	nearest := func(a float64) uint8 { // by search: the closest finite code, ties to the even code
		best, bestErr := uint8(0), math.Inf(1)
		for c := 0; c <= 0x7e; c++ {
			e := math.Abs(float64(E4M3ToFloat(uint8(c))) - a)
			if e < bestErr || e == bestErr && c&1 == 0 {
				best, bestErr = uint8(c), e
			}
		}
		return best
	}
	var inputs []float32
	r := rand.New(rand.NewPCG(5, 6))
	for i := 0; i < 20000; i++ {
		inputs = append(inputs, float32(math.Ldexp(r.Float64()*2-1, r.IntN(24)-14)))
	}
	for c := 0; c < 0x7e; c++ { // midpoints between neighbours: the ties
		lo, hi := float64(E4M3ToFloat(uint8(c))), float64(E4M3ToFloat(uint8(c+1)))
		inputs = append(inputs, float32((lo+hi)/2), -float32((lo+hi)/2))
	}
	inputs = append(inputs, 448, 449, 464, 1e9, -1e9, float32(math.Inf(1)), 1e-9, 0)
	for _, f := range inputs {
		want := nearest(math.Abs(float64(f)))
		if math.Signbit(float64(f)) {
			want |= 0x80
		}
		if got := FloatToE4M3(f); got != want {
			t.Fatalf("FloatToE4M3(%g) = %#02x (%g), want %#02x (%g)", f, got, E4M3ToFloat(got), want, E4M3ToFloat(want))
		}
	}
}
