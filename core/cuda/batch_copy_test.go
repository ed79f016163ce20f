package cuda

import (
	"errors"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/kvplug/kvplug/core/kverr"
)

// The entry point follows the driver's version and exports: the CUDA 13.0
// signature where the driver has it, the 12.8 one on 12.8-12.9 drivers (and
// on a 13.x driver that would lack the _v2 symbol), and a clear refusal
// where neither is (a driver older than 12.8, which exports no symbol).
func TestPickBatchABI(t *testing.T) {
	for _, tc := range []struct {
		driver         int
		have13, have12 bool
		want           batchABI
	}{
		{13000, true, true, batch13000},
		{13010, true, true, batch13000},
		{13000, false, true, batch12080},
		{12090, false, true, batch12080},
		{12080, false, true, batch12080},
		// A 12.x driver never has the 13.0 signature, whatever it exports.
		{12080, true, true, batch12080},
		{12060, false, false, batchNone},
		{12070, false, true, batchNone},
		{11080, false, false, batchNone},
		{13000, false, false, batchNone},
	} {
		got, err := pickBatchABI(tc.driver, tc.have13, tc.have12)
		if got != tc.want {
			t.Errorf("pickBatchABI(%d, %v, %v) = %d, want %d", tc.driver, tc.have13, tc.have12, got, tc.want)
		}
		if (err == nil) != (tc.want != batchNone) {
			t.Errorf("pickBatchABI(%d, %v, %v): error %v", tc.driver, tc.have13, tc.have12, err)
		}
		if err != nil && (!kverr.Is(err, kverr.Unsupported) || !strings.Contains(err.Error(), "CUDA 12.8")) {
			t.Errorf("pickBatchABI(%d): %v, want UNSUPPORTED naming the version needed", tc.driver, err)
		}
	}
	if _, err := pickBatchABI(12060, false, false); !strings.Contains(err.Error(), "supports CUDA 12.6") {
		t.Errorf("the refusal does not name the driver's version: %v", err)
	}
}

// memcpyAttributes is CUmemcpyAttributes: an enum, two CUmemLocation
// {type, id} and an unsigned flags word, 24 bytes with 4-byte alignment.
func TestMemcpyAttributesLayout(t *testing.T) {
	var a memcpyAttributes
	if unsafe.Sizeof(a) != 24 || unsafe.Alignof(a) != 4 || unsafe.Offsetof(a.SrcLocType) != 4 ||
		unsafe.Offsetof(a.DstLocType) != 12 || unsafe.Offsetof(a.Flags) != 20 {
		t.Fatalf("memcpyAttributes: size %d, align %d, offsets %d %d %d; want 24, 4, 4 12 20",
			unsafe.Sizeof(a), unsafe.Alignof(a), unsafe.Offsetof(a.SrcLocType), unsafe.Offsetof(a.DstLocType), unsafe.Offsetof(a.Flags))
	}
}

func TestCopyBatch(t *testing.T) {
	var b CopyBatch
	if err := MemcpyBatchAsync(&b, 0); err != nil {
		t.Fatalf("an empty batch: %v", err)
	}
	b.Add(0x1000, 0x2000, 64)
	b.Add(0x3000, 0x4000, 1<<20)
	if b.Len() != 2 || b.Dst[1] != 0x3000 || b.Src[1] != 0x4000 || b.Size[1] != 1<<20 {
		t.Fatalf("batch %+v", b)
	}
	// The legacy default stream is refused before the driver is asked.
	for _, s := range []Stream{0, 1} {
		if err := MemcpyBatchAsync(&b, s); !kverr.Is(err, kverr.InvalidArgument) || !strings.Contains(err.Error(), "legacy default stream") {
			t.Errorf("stream %d: %v", s, err)
		}
	}
	if err := CheckBatchStream(2); err != nil { // CU_STREAM_PER_THREAD
		t.Errorf("per-thread default stream: %v", err)
	}
	c := cap(b.Dst)
	b.Reset()
	if b.Len() != 0 || cap(b.Dst) != c {
		t.Fatalf("Reset: len %d, cap %d -> %d", b.Len(), c, cap(b.Dst))
	}
	b.Size = append(b.Size, 16)
	if err := MemcpyBatchAsync(&b, 7); !kverr.Is(err, kverr.Internal) {
		t.Errorf("arrays of different lengths: %v", err)
	}
}

// Without a driver the batched copy answers NO_DEVICE, as every entry
// point does; with one it is supported from CUDA 12.8 on.
func TestBatchCopySupported(t *testing.T) {
	err := BatchCopySupported()
	if lerr := Load(); lerr != nil {
		if !kverr.Is(err, kverr.NoDevice) || !errors.Is(err, ErrNoDevice) {
			t.Fatalf("without a driver: %v", err)
		}
		var b CopyBatch
		b.Add(0x1000, 0x2000, 64)
		if err := MemcpyBatchAsync(&b, 7); !kverr.Is(err, kverr.NoDevice) {
			t.Fatalf("a batch without a driver: %v", err)
		}
		return
	}
	v, verr := DriverVersion()
	if verr != nil {
		t.Fatal(verr)
	}
	if (v >= 12080) != (err == nil) {
		t.Fatalf("driver %d: BatchCopySupported = %v", v, err)
	}
	if err != nil && !kverr.Is(err, kverr.Unsupported) {
		t.Fatalf("driver %d: %v, want UNSUPPORTED", v, err)
	}
}

// Both signatures bind: purego accepts their argument kinds and counts
// (it panics at binding time otherwise, which Load would do on a machine
// with a driver). The address is never called.
func TestBatchSignaturesBind(t *testing.T) {
	f13, f12 := cuMemcpyBatchAsync13, cuMemcpyBatchAsync12
	purego.RegisterFunc(&f13, 1)
	purego.RegisterFunc(&f12, 1)
	if f13 == nil || f12 == nil {
		t.Fatal("RegisterFunc left a signature unbound")
	}
}

// memcpy2D is cuda.h's CUDA_MEMCPY2D: 128 bytes, the members at their C
// offsets (size_t and pointers 8 bytes, CUmemorytype 4 and padded to 8).
func TestMemcpy2DLayout(t *testing.T) {
	var p memcpy2D
	if s := unsafe.Sizeof(p); s != 128 {
		t.Fatalf("CUDA_MEMCPY2D is %d bytes, want 128", s)
	}
	for _, f := range []struct {
		name      string
		off, want uintptr
	}{
		{"srcMemoryType", unsafe.Offsetof(p.SrcMemoryType), 16},
		{"srcHost", unsafe.Offsetof(p.SrcHost), 24},
		{"srcDevice", unsafe.Offsetof(p.SrcDevice), 32},
		{"srcPitch", unsafe.Offsetof(p.SrcPitch), 48},
		{"dstMemoryType", unsafe.Offsetof(p.DstMemoryType), 72},
		{"dstHost", unsafe.Offsetof(p.DstHost), 80},
		{"dstDevice", unsafe.Offsetof(p.DstDevice), 88},
		{"dstPitch", unsafe.Offsetof(p.DstPitch), 104},
		{"WidthInBytes", unsafe.Offsetof(p.WidthInBytes), 112},
		{"Height", unsafe.Offsetof(p.Height), 120},
	} {
		if f.off != f.want {
			t.Errorf("CUDA_MEMCPY2D.%s at offset %d, want %d", f.name, f.off, f.want)
		}
	}
}

// A strided copy with a pitch below its width, above the driver's maximum,
// or nothing to copy is refused before the driver is reached.
func TestRowCopyRefusesBadShapes(t *testing.T) {
	var c RowCopy
	host := make([]byte, 64)
	dst := unsafe.Pointer(&host[0])
	for _, tc := range []struct {
		name                            string
		dstPitch, srcPitch, width, rows int64
		src                             DevicePtr
	}{
		{"source pitch below the width", 32, 16, 32, 2, 1 << 20},
		{"host pitch below the width", 16, 32, 32, 2, 1 << 20},
		{"pitch above the maximum", 32, MaxCopyPitch + 1, 32, 2, 1 << 20},
		{"no rows", 32, 32, 32, 0, 1 << 20},
		{"no width", 32, 32, 0, 2, 1 << 20},
		{"null source", 32, 32, 32, 2, 0},
	} {
		if err := c.DeviceToHostAsync(dst, tc.dstPitch, tc.src, tc.srcPitch, tc.width, tc.rows, 0); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("%s: %v, want INVALID_ARGUMENT", tc.name, err)
		}
	}
}
