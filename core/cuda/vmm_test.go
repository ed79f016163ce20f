package cuda

import (
	"testing"
	"unsafe"
)

// The VMM structs must match cuda.h (CUDA 11.2 through 13) on LP64:
// CUmemAllocationProp is 32 bytes with location at 8, win32HandleMetaData at
// 16 and allocFlags at 24; CUmemAccessDesc is 12 bytes with flags at 8.
func TestVMMStructLayout(t *testing.T) {
	var p memAllocationProp
	var a memAccessDesc
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(CUmemLocation)", unsafe.Sizeof(memLocation{}), 8},
		{"sizeof(CUmemAllocationProp)", unsafe.Sizeof(p), 32},
		{"offsetof(location)", unsafe.Offsetof(p.Location), 8},
		{"offsetof(win32HandleMetaData)", unsafe.Offsetof(p.Win32HandleMetaData), 16},
		{"offsetof(allocFlags.compressionType)", unsafe.Offsetof(p.CompressionType), 24},
		{"offsetof(allocFlags.gpuDirectRDMACapable)", unsafe.Offsetof(p.GPUDirectRDMACapable), 25},
		{"offsetof(allocFlags.usage)", unsafe.Offsetof(p.Usage), 26},
		{"sizeof(CUmemAccessDesc)", unsafe.Sizeof(a), 12},
		{"offsetof(CUmemAccessDesc.flags)", unsafe.Offsetof(a.Flags), 8},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}
