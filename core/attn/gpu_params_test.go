package attn

// The GPU test that needs the launchers' internals; the kernels' results
// are tested against the oracle in core/attn/attnref. It skips only on
// machines with no NVIDIA device (internal/gputest); run it on a GPU machine
// with
//   go test -c -o .device/attn.test ./core/attn && KVPLUG_REQUIRE_GPU=1 .device/attn.test -test.run GPU -test.v

import (
	"runtime"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/internal/gputest"
)

func needGPU(t testing.TB) {
	t.Helper()
	gputest.NeedKernels(t, Prepare)
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
				{ks.combine, unsafe.Sizeof(decodeParams{})}, {ks.merge, unsafe.Sizeof(mergeParams{})},
				{ks.writeE4M3, unsafe.Sizeof(kvWriteParams{})}, {ks.decodeE4M3, unsafe.Sizeof(decodeParams{})},
				{ks.prefillE4M3, unsafe.Sizeof(prefillParams{})}} {
				if k.k == nil {
					continue // f32: no e4m3 kernels
				}
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
