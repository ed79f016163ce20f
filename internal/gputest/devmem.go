package gputest

// Device memory for the GPU tests: allocations freed when the test ends,
// copies and fills that fail the test on a CUDA error, and NaN poisoning
// that shows an output element a kernel left unwritten.

import (
	"encoding/binary"
	"math"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
)

// NeedKernels is Need, then load (a package's kernel loader, such as
// attn.Prepare), which must succeed.
func NeedKernels(t testing.TB, load func() error) {
	t.Helper()
	Need(t)
	if err := load(); err != nil {
		t.Fatalf("loading the kernels: %v", err)
	}
}

// Alloc returns bytes of device memory (16 at least), freed at the end of
// the test.
func Alloc(t testing.TB, bytes int) cuda.DevicePtr {
	t.Helper()
	p, err := cuda.MemAlloc(max(bytes, 16))
	if err != nil {
		t.Fatalf("alloc %d bytes: %v", bytes, err)
	}
	t.Cleanup(func() { cuda.MemFree(p) })
	return p
}

// Upload returns device memory (Alloc) holding a copy of b.
func Upload(t testing.TB, b []byte) cuda.DevicePtr {
	t.Helper()
	p := Alloc(t, len(b))
	Put(t, p, b)
	return p
}

// Put copies b to the device at p.
func Put(t testing.TB, p cuda.DevicePtr, b []byte) {
	t.Helper()
	if err := cuda.CopyToDevice(p, b); err != nil {
		t.Fatal(err)
	}
}

// Download returns a copy of n bytes of device memory at p.
func Download(t testing.TB, p cuda.DevicePtr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if err := cuda.CopyFromDevice(b, p); err != nil {
		t.Fatal(err)
	}
	return b
}

// DownloadF32 returns a copy of n float32 values at p.
func DownloadF32(t testing.TB, p cuda.DevicePtr, n int) []float32 {
	t.Helper()
	return F32s(Download(t, p, 4*n))
}

// F32s reads little-endian float32 values from raw.
func F32s(raw []byte) []float32 {
	v := make([]float32, len(raw)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
	}
	return v
}

// NaN is an element type whose NaN can fill device memory: attn.DType.
type NaN interface {
	Size() int       // bytes per element: 1, 2 or 4
	NaNBits() uint32 // the element's NaN, in its low Size() bytes
}

// Poison fills n bytes at p with d's NaN.
func Poison(t testing.TB, p cuda.DevicePtr, n int, d NaN) {
	t.Helper()
	var err error
	switch d.Size() {
	case 1: // e4m3: the byte repeated
		b := d.NaNBits() & 0xff
		err = cuda.Memset32(p, b*0x01010101, n/4)
	case 2:
		err = cuda.Memset16(p, uint16(d.NaNBits()), n/2)
	default:
		err = cuda.Memset32(p, d.NaNBits(), n/4)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// Int32Bytes is v's memory as bytes (nil when v is empty).
func Int32Bytes(v []int32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// Float32Bytes is v's memory as bytes (nil when v is empty).
func Float32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// Stream returns a new stream, destroyed at the end of the test.
func Stream(t testing.TB) cuda.Stream {
	t.Helper()
	s, err := cuda.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cuda.StreamDestroy(s) })
	return s
}
