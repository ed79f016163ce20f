package gputest

import (
	"errors"
	"math"
	"slices"
	"testing"
)

func TestClassify(t *testing.T) {
	noDriver := func() error { return errors.New("cannot load libcuda.so.1") }
	loaded := func() error { return nil }
	devices := func(n int, err error) func() (int, error) { return func() (int, error) { return n, err } }
	node := []string{"/dev/nvidia0"}
	for _, c := range []struct {
		name   string
		nodes  []string
		load   func() error
		count  func() (int, error)
		absent bool // the error wraps ErrAbsent: the test may skip
		ok     bool // a device can be used
	}{
		{"no driver, no device node", nil, noDriver, devices(0, nil), true, false},
		{"no driver, a device node", node, noDriver, devices(0, nil), false, false},
		{"driver, no device, no node", nil, loaded, devices(0, nil), true, false},
		{"driver, no device, a node", node, loaded, devices(0, nil), false, false},
		{"driver whose count fails", nil, loaded, devices(0, errors.New("CUDA_ERROR_UNKNOWN")), false, false},
		{"driver whose count fails, a node", node, loaded, devices(0, errors.New("CUDA_ERROR_UNKNOWN")), false, false},
		{"a device", node, loaded, devices(1, nil), false, true},
	} {
		err := classify(c.nodes, c.load, c.count)
		if (err == nil) != c.ok || errors.Is(err, ErrAbsent) != c.absent {
			t.Errorf("%s: %v; want usable %v, absent %v", c.name, err, c.ok, c.absent)
		}
	}
}

func TestRequired(t *testing.T) {
	for v, want := range map[string]bool{"1": true, "": false, "0": false, "yes": false} {
		t.Setenv(RequireEnv, v)
		if Required() != want {
			t.Errorf("%s=%q: Required() = %v", RequireEnv, v, !want)
		}
	}
}

func TestHostBytes(t *testing.T) {
	f := []float32{1.5, -2, float32(math.Inf(-1))}
	if got := F32s(Float32Bytes(f)); !slices.Equal(got, f) {
		t.Fatalf("F32s(Float32Bytes(%v)) = %v", f, got)
	}
	i := []int32{1, -1, 1 << 30}
	if b := Int32Bytes(i); len(b) != 12 || b[0] != 1 || b[4] != 0xff || b[11] != 0x40 {
		t.Fatalf("Int32Bytes(%v) = %x", i, b)
	}
	if Int32Bytes(nil) != nil || Float32Bytes(nil) != nil {
		t.Fatal("the bytes of an empty slice are not nil")
	}
}
