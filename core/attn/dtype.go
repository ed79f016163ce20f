package attn

import (
	"encoding/binary"
	"math"
	"strconv"

	"github.com/kvplug/kvplug/core/kverr"
)

// DType is the element type of Q, K, V and the output: the values of enum
// kvp_dtype in include/kvplug.h.
type DType int32

const (
	F16  DType = 1 // IEEE binary16
	BF16 DType = 2 // bfloat16
	F32  DType = 3 // binary32, for tests
	// E4M3 is FP8 e4m3 (OCP): a cache format only (PagedKV.DType), read and
	// written by the 16-bit calls, never a call's own dtype.
	E4M3 DType = 4
)

// Size is the element size in bytes (0 for an unknown type).
func (d DType) Size() int {
	switch d {
	case F16, BF16:
		return 2
	case F32:
		return 4
	case E4M3:
		return 1
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	case F32:
		return "f32"
	case E4M3:
		return "e4m3"
	}
	return "dtype(" + strconv.Itoa(int(d)) + ")"
}

// check refuses anything but a call's dtype (E4M3 is a cache's only).
func (d DType) check(what string) error {
	if d.Size() == 0 || d == E4M3 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: dtype must be KVP_DTYPE_F16 (1), KVP_DTYPE_BF16 (2) or KVP_DTYPE_F32 (3): got %d", what, int32(d))
	}
	return nil
}

// Load reads element i of buf (little-endian, as on every CUDA host).
func (d DType) Load(buf []byte, i int64) float64 {
	switch d {
	case F16:
		return float64(HalfToFloat(binary.LittleEndian.Uint16(buf[2*i:])))
	case BF16:
		return float64(BFloat16ToFloat(binary.LittleEndian.Uint16(buf[2*i:])))
	case E4M3:
		return float64(E4M3ToFloat(buf[i]))
	default:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(buf[4*i:])))
	}
}

// Store writes v, rounded to nearest even, as element i of buf.
func (d DType) Store(buf []byte, i int64, v float64) {
	switch d {
	case F16:
		binary.LittleEndian.PutUint16(buf[2*i:], FloatToHalf(float32(v)))
	case BF16:
		binary.LittleEndian.PutUint16(buf[2*i:], FloatToBFloat16(float32(v)))
	case E4M3:
		buf[i] = FloatToE4M3(float32(v))
	default:
		binary.LittleEndian.PutUint32(buf[4*i:], math.Float32bits(float32(v)))
	}
}

// NaNBits is a quiet NaN of the type, as the bit pattern a memset writes.
func (d DType) NaNBits() uint32 {
	switch d {
	case F16:
		return 0x7e00
	case BF16:
		return 0x7fc0
	case E4M3:
		return 0x7f
	}
	return 0x7fc00000
}

// HalfToFloat converts IEEE binary16 bits to float32 (exact).
func HalfToFloat(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf, NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
	case man == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: man * 2^-24.
	f := float32(man) * (1.0 / (1 << 24))
	if sign != 0 {
		f = -f
	}
	return f
}

// FloatToHalf converts float32 to binary16 bits, rounding to nearest even
// (as __float2half_rn).
func FloatToHalf(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00 | uint16(man>>13)
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 {
		if e < -10 {
			return sign // rounds to zero
		}
		m := man | 0x800000
		shift := uint32(14 - e)
		h := m >> shift
		rem := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rem > half || (rem == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	h := uint32(e)<<10 | man>>13
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, up to infinity: correct
	}
	return sign | uint16(h)
}

// BFloat16ToFloat converts bfloat16 bits to float32 (exact).
func BFloat16ToFloat(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// FloatToBFloat16 converts float32 to bfloat16 bits, rounding to nearest
// even (as __float2bfloat16_rn).
func FloatToBFloat16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40 // quiet NaN
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// E4M3Max is the largest finite e4m3 value.
const E4M3Max = 448

// E4M3ToFloat converts e4m3 bits to float32 (exact; 0x7f and 0xff are NaN).
func E4M3ToFloat(b uint8) float32 {
	e, m := int(b>>3)&0xf, float64(b&7)
	var v float64
	switch {
	case b&0x7f == 0x7f:
		return float32(math.NaN())
	case e == 0:
		v = m * (1.0 / 512) // subnormal: m * 2^-9
	default:
		v = math.Ldexp(1+m/8, e-7)
	}
	if b&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// FloatToE4M3 converts float32 to e4m3 bits, rounding to nearest even and
// saturating to +-448 (NaN stays NaN), as the kernels' KV write does.
func FloatToE4M3(f float32) uint8 {
	sign := uint8(math.Float32bits(f)>>24) & 0x80
	a := math.Abs(float64(f))
	switch {
	case a != a:
		return 0x7f
	case a >= E4M3Max:
		return sign | 0x7e
	case a < 1.0/64: // below the smallest normal, 2^-6: steps of 2^-9
		return sign | uint8(math.RoundToEven(a*512))
	}
	u := math.Float32bits(float32(a))
	u += 0x7ffff + (u>>20)&1 // 23 mantissa bits to 3, ties to even
	e, m := (u>>23)-120, (u>>20)&7
	if e > 15 || e == 15 && m == 7 {
		return sign | 0x7e
	}
	return sign | uint8(e<<3|m)
}
