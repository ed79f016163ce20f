package cuda_test

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/gputest"
)

// Without a driver every entry point answers NO_DEVICE with the loader's
// message, which is right only on a machine with no NVIDIA device
// (internal/gputest); with one, the basic calls work.
func TestNoDeviceOrBasics(t *testing.T) {
	if err := cuda.Load(); err != nil {
		if !errors.Is(err, cuda.ErrNoDevice) {
			t.Fatalf("Load: %v does not wrap ErrNoDevice", err)
		}
		if cuda.Available() {
			t.Fatal("Available without a driver")
		}
		for name, err := range map[string]error{
			"DeviceCount": second(cuda.DeviceCount()),
			"DeviceInfo":  second(cuda.DeviceInfo(0)),
			"MemAlloc":    second(cuda.MemAlloc(16)),
			"Bind":        second(cuda.Bind()),
			"Synchronize": cuda.Synchronize(),
		} {
			if !kverr.Is(err, kverr.NoDevice) || !errors.Is(err, cuda.ErrNoDevice) {
				t.Errorf("%s: %v, want NO_DEVICE wrapping ErrNoDevice", name, err)
			}
		}
		im := cuda.NewImage("test", func() ([]byte, error) { return []byte{1}, nil })
		if _, err := im.Module(); !kverr.Is(err, kverr.NoDevice) {
			t.Errorf("Image.Module: %v", err)
		}
		if perr := gputest.Probe(); !errors.Is(perr, gputest.ErrAbsent) {
			t.Fatal(perr)
		}
		if gputest.Required() {
			t.Fatalf("%s=1, but the CUDA driver does not load: %v", gputest.RequireEnv, err)
		}
		return
	}
	gputest.Need(t)
	n, err := cuda.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	d, err := cuda.DeviceInfo(0)
	if err != nil || d.SMs < 1 || d.Major < 1 || d.SharedPerBlockOptin < d.SharedPerBlock {
		t.Fatalf("cuda.DeviceInfo(0) = %+v, %v", d, err)
	}
	if _, err := cuda.DeviceInfo(n); !kverr.Is(err, kverr.NoDevice) {
		t.Fatalf("cuda.DeviceInfo(%d): %v", n, err)
	}
	if _, err := cuda.MemAlloc(0); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("cuda.MemAlloc(0): %v", err)
	}
	p, err := cuda.MemAlloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.MemFree(p)
	src := bytes.Repeat([]byte{1, 2, 3, 4, 5}, 1000)
	if err := cuda.CopyToDevice(p, src); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if err := cuda.CopyFromDevice(got, p); err != nil || !bytes.Equal(got, src) {
		t.Fatalf("round trip: %v", err)
	}
	if err := cuda.Memset16(p, 0xabcd, 4); err != nil {
		t.Fatal(err)
	}
	cuda.CopyFromDevice(got[:10], p)
	if !bytes.Equal(got[:10], []byte{0xcd, 0xab, 0xcd, 0xab, 0xcd, 0xab, 0xcd, 0xab, 4, 5}) {
		t.Fatalf("memset16: % x", got[:10])
	}
	// An image that is not a fatbin fails to load with a CUDA error, kept
	// for later calls in the same context.
	im := cuda.NewImage("garbage", func() ([]byte, error) { return []byte("not a fatbin"), nil })
	k := im.Kernel("nothing")
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	_, err1 := im.Module()
	m, err2 := im.Module()
	if !kverr.Is(err1, kverr.CUDA) || err2 == nil || m == nil {
		t.Fatalf("garbage image: %v / %v", err1, err2)
	}
	var params struct{ a, b uint64 }
	if err := cuda.Launch(m, k, cuda.LaunchConfig{Grid: cuda.Dim3{1, 1, 1}, Block: cuda.Dim3{1, 1, 1}}, 0, &params); err == nil {
		t.Fatal("launch from a module that failed to load succeeded")
	}
	// An empty image: a build without kernels.
	empty := cuda.NewImage("empty", func() ([]byte, error) { return nil, nil })
	if _, err := empty.Module(); !kverr.Is(err, kverr.Unsupported) {
		t.Fatalf("empty image: %v", err)
	}
}

func second[T any](_ T, err error) error { return err }
