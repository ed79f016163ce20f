package vmem

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/gputest"
)

// GPU tests: they skip only on machines with no NVIDIA device and fail on
// any other CUDA error (internal/gputest). Build with
// `go test -c -o .device/vmem.test ./core/vmem` and run with
// `KVPLUG_REQUIRE_GPU=1 .device/vmem.test -test.run CUDA -test.v` on the GPU
// machine.

func newCUDADriver(t *testing.T) *CUDA {
	t.Helper()
	gputest.Need(t)
	d, err := NewCUDA(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

func TestCUDADriverMapsDeviceMemory(t *testing.T) {
	d := newCUDADriver(t)
	g := d.Granularity()
	t.Logf("granularity %d bytes", g)
	if g <= 0 || g%(64<<10) != 0 {
		t.Fatalf("granularity %d", g)
	}
	base, err := d.Reserve(4 * g)
	if err != nil {
		t.Fatal(err)
	}
	p := newPage(t, d, g)
	mapPage(t, d, base+uintptr(g), g, p)
	want := make([]byte, g)
	for i := range want {
		want[i] = byte(i*13 + 1)
	}
	if err := d.VMM().CopyToDevice(uint64(base)+uint64(g), want); err != nil {
		t.Fatal(err)
	}
	// The page keeps its contents when mapped at another address.
	unmap(t, d, base+uintptr(g), g)
	mapPage(t, d, base+uintptr(3*g), g, p)
	got := make([]byte, g)
	if err := d.VMM().CopyFromDevice(got, uint64(base)+uint64(3*g)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("page contents changed across unmap and remap")
	}
	// Errors carry the CUDA code. (A bogus page handle is not one: the
	// driver does not validate handles and may crash on one.)
	if err := d.Map(base+4096, g, p); !kverr.Is(err, kverr.CUDA) {
		t.Fatalf("map at a misaligned address: %v", err)
	}
	unmap(t, d, base+uintptr(3*g), g)
	if err := d.ReleasePage(p); err != nil {
		t.Fatal(err)
	}
	if err := d.FreeReservation(base, 4*g); err != nil {
		t.Fatal(err)
	}
}

func TestCUDACacheStepsAndReadsBack(t *testing.T) {
	d := newCUDADriver(t)
	cfg := Config{Layers: 4, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, MaxBatch: 4, MaxContext: 4096,
		BudgetBytes: 1 << 30, LookaheadTokens: 4}
	c, err := New(cfg, d)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	}()
	tpp := int(c.Layout().PageSize / c.Layout().TokenStride)
	a, _ := c.Alloc()
	b, _ := c.Alloc()
	if err := c.Step([]int32{int32(a), int32(b)}, []int32{int32(tpp - 2), int32(2*tpp + 5)}); err != nil {
		t.Fatal(err)
	}
	row := int(c.Layout().TokenStride)
	tokAddr := func(buf, slot, tok int) uint64 {
		return uint64(c.bases[buf]) + uint64(int64(slot)*c.Layout().SlotStride) + uint64(tok*row)
	}
	fill := func(buf, slot, tok int) []byte {
		x := make([]byte, row)
		for i := range x {
			x[i] = byte(buf*31 + slot*7 + tok + i)
		}
		return x
	}
	type tk struct{ buf, slot, tok int }
	var written []tk
	for buf := 0; buf < c.nbuf; buf++ {
		for _, w := range []tk{{buf, a, 0}, {buf, a, tpp - 3}, {buf, b, tpp}, {buf, b, 2*tpp + 4}} {
			if err := d.VMM().CopyToDevice(tokAddr(w.buf, w.slot, w.tok), fill(w.buf, w.slot, w.tok)); err != nil {
				t.Fatal(err)
			}
			written = append(written, w)
		}
	}
	// A decode loop across a page boundary, background mapping ahead.
	for ctx := tpp - 2; ctx <= tpp+20; ctx++ {
		c.WaitBackground()
		if err := c.Step([]int32{int32(a), int32(b)}, []int32{int32(ctx), int32(2*tpp + 5)}); err != nil {
			t.Fatal(err)
		}
		for buf := 0; buf < c.nbuf; buf++ {
			if err := d.VMM().CopyToDevice(tokAddr(buf, a, ctx-1), fill(buf, a, ctx-1)); err != nil {
				t.Fatalf("token %d: %v", ctx-1, err)
			}
		}
	}
	got := make([]byte, row)
	for _, w := range written {
		if err := d.VMM().CopyFromDevice(got, tokAddr(w.buf, w.slot, w.tok)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, fill(w.buf, w.slot, w.tok)) {
			t.Fatalf("tensor %d slot %d token %d changed", w.buf, w.slot, w.tok)
		}
	}
	st := c.Stats()
	t.Logf("stats %+v", st)
	if st.BackgroundErrors != 0 || st.MapCalls == 0 {
		t.Fatalf("stats %+v", st)
	}
	// Reuse and trim on the device.
	if err := c.Free(a); err != nil {
		t.Fatal(err)
	}
	if err := c.Free(b); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := c.Trim(); err != nil {
		t.Fatal(err)
	}
	t.Logf("trim of %d bytes took %v", st.MappedBytes, time.Since(start))
	if st := c.Stats(); st.HeldBytes != 0 {
		t.Fatalf("held %d bytes after trim", st.HeldBytes)
	}
}
