package attn

// The GPU test that needs the launchers' internals; the kernels' results
// are tested against the oracle in core/attn/attnref. It skips on machines
// without a CUDA driver and device; run it on a GPU machine with
//   go test -c -o .device/attn.test ./core/attn && .device/attn.test -test.run GPU -test.v

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
)

func needGPU(t testing.TB) {
	t.Helper()
	if err := cuda.Load(); err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if n, err := cuda.DeviceCount(); err != nil || n == 0 {
		t.Skipf("no CUDA device (%v)", err)
	}
	if err := Prepare(); err != nil {
		t.Fatalf("loading the kernels: %v", err)
	}
}

// Kernel parameter sizes as the driver reports them equal the Go mirrors.
func TestGPUParamSizes(t *testing.T) {
	needGPU(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("test")
	if err != nil {
		t.Fatal(err)
	}
	for di := range kernelTable {
		for hi := range kernelTable[di] {
			ks := &kernelTable[di][hi]
			for _, k := range []struct {
				k    *cuda.Kernel
				size uintptr
			}{{ks.write, unsafe.Sizeof(kvWriteParams{})}, {ks.decode, unsafe.Sizeof(decodeParams{})},
				{ks.combine, unsafe.Sizeof(decodeParams{})}, {ks.merge, unsafe.Sizeof(mergeParams{})}} {
				n, err := m.ParamSize(k.k)
				if err != nil {
					t.Fatalf("%s: %v", k.k.Name(), err)
				}
				if n != 0 && uintptr(n) != k.size {
					t.Fatalf("%s takes %d bytes; Go passes %d", k.k.Name(), n, k.size)
				}
			}
		}
	}
}
