package tiercopy

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/gputest"
)

func goodLayers() Layers {
	return Layers{
		K: []cuda.DevicePtr{0x1000, 0x2000}, V: []cuda.DevicePtr{0x3000, 0x4000},
		ChunkBytes: 64, KBlockStride: 64, VBlockStride: 128, NumBlocks: 8,
	}
}

// alignedHost returns n bytes of Go memory starting on a 16-byte boundary.
func alignedHost(n int) []byte {
	b := make([]byte, n+16)
	off := (16 - int(uintptr(unsafe.Pointer(&b[0]))%16)) % 16
	return b[off : off+n]
}

func TestValidate(t *testing.T) {
	mem := alignedHost(4 * 256)
	host := Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: 256, NumSlots: 4}
	l := goodLayers()
	if err := l.validate(); err != nil {
		t.Fatal(err)
	}
	if err := host.validate(&l); err != nil {
		t.Fatal(err)
	}
	if got := l.SlotBytesNeeded(); got != 256 {
		t.Fatalf("SlotBytesNeeded = %d, want 2 layers x 2 x 64", got)
	}
	kOnly := goodLayers()
	kOnly.V = nil
	if kOnly.KV() != 1 || kOnly.SlotBytesNeeded() != 128 || kOnly.validate() != nil {
		t.Fatalf("K-only layout: kv %d, slot bytes %d, %v", kOnly.KV(), kOnly.SlotBytesNeeded(), kOnly.validate())
	}
	bad := map[string]func(l *Layers, h *Host){
		"no layers":          func(l *Layers, h *Host) { l.K = nil },
		"V count":            func(l *Layers, h *Host) { l.V = l.V[:1] },
		"chunk 0":            func(l *Layers, h *Host) { l.ChunkBytes = 0 },
		"chunk unaligned":    func(l *Layers, h *Host) { l.ChunkBytes = 40 },
		"k stride < chunk":   func(l *Layers, h *Host) { l.KBlockStride = 32 },
		"v stride unaligned": func(l *Layers, h *Host) { l.VBlockStride = 136 },
		"no blocks":          func(l *Layers, h *Host) { l.NumBlocks = 0 },
		"null K":             func(l *Layers, h *Host) { l.K[1] = 0 },
		"unaligned V":        func(l *Layers, h *Host) { l.V[0] = 0x3008 },
		"slot too small":     func(l *Layers, h *Host) { h.SlotBytes = 240 },
		"slot unaligned":     func(l *Layers, h *Host) { h.SlotBytes = 264 },
		"no slots":           func(l *Layers, h *Host) { h.NumSlots = 0 },
		"null host":          func(l *Layers, h *Host) { h.Base = nil },
		"unaligned host":     func(l *Layers, h *Host) { h.Base = unsafe.Pointer(&mem[8]) },
	}
	for name, f := range bad {
		l, h := goodLayers(), host
		f(&l, &h)
		_, err := New(l, h, Options{})
		if kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("%s: New gave %v, want InvalidArgument", name, err)
		}
	}
	scaled := func() Layers {
		l := goodLayers()
		l.KScale, l.VScale = []cuda.DevicePtr{0x5000, 0x6000}, []cuda.DevicePtr{0x7000, 0x8000}
		l.ScaleChunkBytes, l.ScaleBlockStride = 16, 32
		return l
	}
	if sl := scaled(); sl.validate() != nil || sl.SlotBytesNeeded() != 256+4*16 {
		t.Fatalf("scaled layout: %v, slot bytes %d, want 256 + 2 layers x 2 x 16", sl.validate(), sl.SlotBytesNeeded())
	}
	if err := host.validate(func() *Layers { l := scaled(); return &l }()); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Errorf("a slot without room for the scales: %v", err)
	}
	badScales := map[string]func(l *Layers){
		"scale chunk 8":           func(l *Layers) { l.ScaleChunkBytes = 8 },
		"scale chunk unaligned":   func(l *Layers) { l.ScaleChunkBytes = 24; l.ScaleBlockStride = 48 },
		"scale stride < chunk":    func(l *Layers) { l.ScaleBlockStride = 0 },
		"scale count":             func(l *Layers) { l.KScale = l.KScale[:1] },
		"V scales without V":      func(l *Layers) { l.V = nil },
		"K scales without V ones": func(l *Layers) { l.VScale = nil },
		"V scales without K ones": func(l *Layers) { l.KScale = nil },
		"unaligned scale":         func(l *Layers) { l.VScale[1] = 0x8004 },
		"null scale":              func(l *Layers) { l.KScale[0] = 0 },
	}
	for name, f := range badScales {
		l := scaled()
		f(&l)
		if err := l.validate(); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("%s: validate gave %v, want InvalidArgument", name, err)
		}
	}
	many := goodLayers()
	many.K = make([]cuda.DevicePtr, 1025)
	if _, err := New(many, host, Options{}); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Errorf("1025 layers: %v", err)
	}
}

// TestGPURoundTrip demotes random blocks of every layer's K and V (and,
// for an e4m3-like layout, their per-block scales) into host slots, checks
// the slot bytes against the caches at the documented offsets, poisons the
// caches and reloads the slots into other blocks, then checks those blocks,
// with each store engine (the kernel; the copy engines, which refuse the
// legacy default stream). 1203 ops take three launches a region, or three
// batched copies. Last, one call demotes a block and reloads another slot
// into it: the slot gets the block's bytes from before the reload. It
// skips only where there is no NVIDIA device (internal/gputest). Run on a
// GPU machine with
//
//	go test -c -o .device/tiercopy.test ./core/tiercopy && KVPLUG_REQUIRE_GPU=1 .device/tiercopy.test -test.run GPU -test.v
func TestGPURoundTrip(t *testing.T) {
	gputest.Need(t)
	for _, tc := range []roundTripCase{
		{"llama-like", 4, 32768, 0, false, 40, false},
		{"small-chunks-many-ops", 2, 48, 0, false, 1203, false},
		{"k-only", 3, 20000, 0, true, 17, false},
		{"e4m3-with-scales", 3, 16384, 512, false, 700, false},
		{"e4m3-k-only-scales", 2, 2048, 16, true, 33, false},
		{"one-tensor", 4, 32768, 0, false, 40, true},
		{"one-tensor-e4m3", 3, 16384, 512, false, 700, true},
		{"one-tensor-k-only", 3, 2048, 0, true, 33, true},
	} {
		for _, stores := range []StoreEngine{StoreKernel, StoreCopyEngine} {
			t.Run(tc.name+"/"+stores.String(), func(t *testing.T) { roundTrip(t, tc, stores) })
		}
	}
}

type roundTripCase struct {
	name                 string
	layers, chunk, scale int // scale: a block's scales of one tensor (0: none)
	kOnly                bool
	ops                  int
	// oneTensor: each region's arrays are parts of one allocation,
	// [layers][K, V][blocks] (one pitch between them); else one allocation
	// an array.
	oneTensor bool
}

func roundTrip(t *testing.T, tc roundTripCase, stores StoreEngine) {
	kv := 2
	if tc.kOnly {
		kv = 1
	}
	const blocks = 1300
	rng := rand.New(rand.NewPCG(uint64(tc.layers), uint64(tc.chunk)))
	// One device array per (region, layer, tensor): the K/V chunks,
	// then the scales; a gap of 32 bytes between blocks, never copied.
	type array struct {
		host          []byte
		ptr           cuda.DevicePtr
		chunk, stride int64
		slotOff       int64 // its chunk's offset in a host slot
	}
	var arrays []array
	l := Layers{NumBlocks: blocks}
	regions := []int64{int64(tc.chunk)}
	if tc.scale > 0 {
		regions = append(regions, int64(tc.scale))
	}
	var off int64
	for ri, chunk := range regions {
		stride := chunk + 32
		var whole cuda.DevicePtr // the region's one allocation (oneTensor)
		if tc.oneTensor {
			var err error
			if whole, err = cuda.MemAlloc(tc.layers * kv * blocks * int(stride)); err != nil {
				t.Fatal(err)
			}
			defer cuda.MemFree(whole)
		}
		for layer := 0; layer < tc.layers; layer++ {
			for tt := 0; tt < kv; tt++ {
				a := array{host: make([]byte, int64(blocks)*stride), chunk: chunk, stride: stride, slotOff: off}
				off += chunk
				for j := range a.host {
					a.host[j] = byte(rng.Uint32())
				}
				p := whole + cuda.DevicePtr(int64(layer*kv+tt)*int64(blocks)*stride)
				if !tc.oneTensor {
					var err error
					if p, err = cuda.MemAlloc(len(a.host)); err != nil {
						t.Fatal(err)
					}
					defer cuda.MemFree(p)
				}
				if err := cuda.CopyToDevice(p, a.host); err != nil {
					t.Fatal(err)
				}
				a.ptr = p
				arrays = append(arrays, a)
				dst := [][]*[]cuda.DevicePtr{{&l.K, &l.V}, {&l.KScale, &l.VScale}}[ri][tt]
				*dst = append(*dst, p)
			}
		}
		if ri == 0 {
			l.ChunkBytes, l.KBlockStride, l.VBlockStride = chunk, stride, stride
		} else {
			l.ScaleChunkBytes, l.ScaleBlockStride = chunk, stride
		}
	}
	slotBytes := l.SlotBytesNeeded() + 16
	if slotBytes-16 != off {
		t.Fatalf("SlotBytesNeeded %d, want the regions' %d", slotBytes-16, off)
	}
	slots := tc.ops + 3
	mem := alignedHost(int(slotBytes) * slots)
	for i := range mem {
		mem[i] = 0xEE // poison
	}
	c, err := New(l, Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: slotBytes, NumSlots: int32(slots)}, Options{Stores: stores})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.storeOps = min(c.storeOps, OpsPerLaunch)
	stream, err := cuda.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.StreamDestroy(stream)

	perm := rng.Perm(blocks)
	demote := make([]Op, tc.ops)
	for i := range demote {
		demote[i] = Op{Block: int32(perm[i]), Slot: int32(slots - 1 - i)}
	}
	// An op out of range fails the whole call before any launch.
	bad := append(append([]Op(nil), demote...), Op{Block: blocks, Slot: 0})
	if err := c.Run(bad, nil, stream); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("out-of-range op: %v", err)
	}
	if err := c.Run(demote, nil, 0); (stores == StoreCopyEngine) != (kverr.CodeOf(err) == kverr.InvalidArgument) {
		t.Fatalf("stores by %s on the legacy default stream: %v", stores, err)
	}
	if err := cuda.StreamSynchronize(0); err != nil {
		t.Fatal(err)
	}
	for i := range mem {
		mem[i] = 0xEE
	}
	if err := c.Run(demote, nil, stream); err != nil {
		t.Fatal(err)
	}
	if err := cuda.StreamSynchronize(stream); err != nil {
		t.Fatal(err)
	}
	// The stores went by the engine asked for: with StoreCopyEngine, every
	// demotion as a strided copy a region whose chunks sit at one pitch (a
	// one-tensor layout's every region) and in batched copies for the
	// others; none with the kernel.
	var wantRows, wantBatched int64
	if stores == StoreCopyEngine {
		for _, r := range c.regions {
			if r.pitch != 0 {
				wantRows += int64(len(demote))
			} else {
				wantBatched = int64(len(demote))
			}
			if tc.oneTensor && r.pitch != int64(blocks)*(r.chunk+32) {
				t.Fatalf("a one-tensor region's pitch is %d, want %d", r.pitch, int64(blocks)*(r.chunk+32))
			}
		}
	}
	if c.rowStores != wantRows || c.batchedStores != wantBatched {
		t.Fatalf("stores by %s: %d strided copies and %d demotions by batched copies, want %d and %d",
			stores, c.rowStores, c.batchedStores, wantRows, wantBatched)
	}
	chunk := func(a *array, b int) []byte { return a.host[int64(b)*a.stride : int64(b)*a.stride+a.chunk] }
	for i, o := range demote {
		slot := mem[int64(o.Slot)*slotBytes : int64(o.Slot+1)*slotBytes]
		for j := range arrays {
			a := &arrays[j]
			if !bytes.Equal(slot[a.slotOff:a.slotOff+a.chunk], chunk(a, int(o.Block))) {
				t.Fatalf("demote op %d (block %d -> slot %d): array %d differs", i, o.Block, o.Slot, j)
			}
		}
		if !bytes.Equal(slot[l.SlotBytesNeeded():], bytes.Repeat([]byte{0xEE}, 16)) {
			t.Fatalf("demote op %d wrote past the layout's bytes", i)
		}
	}
	// Reload every slot into other blocks, poisoned first.
	reload := make([]Op, tc.ops)
	for i := range reload {
		reload[i] = Op{Block: int32(perm[blocks-1-i]), Slot: demote[i].Slot}
	}
	for j := range arrays {
		a := &arrays[j]
		for _, o := range reload {
			copy(chunk(a, int(o.Block)), bytes.Repeat([]byte{0xA5}, int(a.chunk)))
		}
		if err := cuda.CopyToDevice(a.ptr, a.host); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Run(nil, reload, stream); err != nil {
		t.Fatal(err)
	}
	if err := cuda.StreamSynchronize(stream); err != nil {
		t.Fatal(err)
	}
	for j := range arrays {
		a := &arrays[j]
		got := make([]byte, len(a.host))
		if err := cuda.CopyFromDevice(got, a.ptr); err != nil {
			t.Fatal(err)
		}
		want := append([]byte(nil), a.host...)
		for _, o := range reload {
			slot := mem[int64(o.Slot)*slotBytes:]
			copy(want[int64(o.Block)*a.stride:int64(o.Block)*a.stride+a.chunk], slot[a.slotOff:a.slotOff+a.chunk])
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("array %d after the reloads differs from the expected cache (other blocks and the gaps must be untouched)", j)
		}
	}
	for j := range arrays {
		a := &arrays[j]
		if err := cuda.CopyFromDevice(a.host, a.ptr); err != nil {
			t.Fatal(err)
		}
	}
	// One call: block x to the free slot 0, and slot 3 into block x.
	x := reload[0].Block
	if err := c.Run([]Op{{Block: x, Slot: 0}}, []Op{{Block: x, Slot: 3}}, stream); err != nil {
		t.Fatal(err)
	}
	if err := cuda.StreamSynchronize(stream); err != nil {
		t.Fatal(err)
	}
	for j := range arrays {
		a := &arrays[j]
		got := make([]byte, a.chunk)
		if err := cuda.CopyFromDevice(got, a.ptr+cuda.DevicePtr(int64(x)*a.stride)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(mem[a.slotOff:a.slotOff+a.chunk], chunk(a, int(x))) {
			t.Fatalf("array %d: the slot demoted in the reload's call holds other bytes than the block had before it", j)
		}
		if !bytes.Equal(got, mem[3*slotBytes+a.slotOff:3*slotBytes+a.slotOff+a.chunk]) {
			t.Fatalf("array %d: block %d after the reload differs from slot 3", j, x)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Run(demote, nil, stream); kverr.CodeOf(err) != kverr.InvalidHandle {
		t.Fatalf("Run after Close: %v", err)
	}
}

// The copy engines' batch of a demotion list: per op, per region (the K/V
// chunks, then the scales), per layer, K then V, one copy of the block's
// chunk (base + block x stride) to its place in the slot (the package
// comment's offsets), in that order; a K-only layout copies K alone.
func TestStoreBatch(t *testing.T) {
	mem := alignedHost(6 * 320)
	base := cuda.DevicePtr(uintptr(unsafe.Pointer(&mem[0])))
	l := goodLayers()
	l.KScale, l.VScale = []cuda.DevicePtr{0x5000, 0x6000}, []cuda.DevicePtr{0x7000, 0x8000}
	l.ScaleChunkBytes, l.ScaleBlockStride = 16, 32
	h := Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: 320, NumSlots: 6}
	c, err := newCopier(l, h, Options{Stores: StoreCopyEngine})
	if err != nil {
		t.Fatal(err)
	}
	if want := maxBatchCopies / 8; c.storeOps != want {
		t.Fatalf("storeOps = %d, want %d (8 copies a block)", c.storeOps, want)
	}
	ops := []Op{{Block: 3, Slot: 5}, {Block: 0, Slot: 0}, {Block: 7, Slot: 2}}
	var b cuda.CopyBatch
	c.appendStores(&b, ops)
	type cp struct {
		dst, src cuda.DevicePtr
		n        uintptr
	}
	var want []cp
	for _, o := range ops {
		slot := base + cuda.DevicePtr(int64(o.Slot)*h.SlotBytes)
		for layer := range 2 {
			want = append(want,
				cp{slot + cuda.DevicePtr((layer*2+0)*64), l.K[layer] + cuda.DevicePtr(int64(o.Block)*l.KBlockStride), 64},
				cp{slot + cuda.DevicePtr((layer*2+1)*64), l.V[layer] + cuda.DevicePtr(int64(o.Block)*l.VBlockStride), 64})
		}
		for layer := range 2 {
			want = append(want,
				cp{slot + 256 + cuda.DevicePtr((layer*2+0)*16), l.KScale[layer] + cuda.DevicePtr(int64(o.Block)*32), 16},
				cp{slot + 256 + cuda.DevicePtr((layer*2+1)*16), l.VScale[layer] + cuda.DevicePtr(int64(o.Block)*32), 16})
		}
	}
	if b.Len() != len(want) {
		t.Fatalf("%d copies, want %d", b.Len(), len(want))
	}
	for i, w := range want {
		if got := (cp{b.Dst[i], b.Src[i], b.Size[i]}); got != w {
			t.Errorf("copy %d = {dst %#x, src %#x, %d}, want {dst %#x, src %#x, %d}", i, got.dst, got.src, got.n, w.dst, w.src, w.n)
		}
	}
	// The copier's tables are its own: the caller's slices may change.
	l.K[0], l.KScale[1] = 0x9000, 0xa000
	b.Reset()
	c.appendStores(&b, ops[:1])
	if b.Src[0] != 0x1000+3*64 || b.Src[6] != 0x6000+3*32 {
		t.Fatalf("the batch follows the caller's slices after New: %#x %#x", b.Src[0], b.Src[6])
	}

	kOnly := goodLayers()
	kOnly.K, kOnly.V = []cuda.DevicePtr{0x2000, 0x1000}, nil // at no single pitch: batched
	c, err = newCopier(kOnly, Host{Base: h.Base, SlotBytes: 128, NumSlots: 6}, Options{Stores: StoreCopyEngine})
	if err != nil {
		t.Fatal(err)
	}
	b.Reset()
	c.appendStores(&b, []Op{{Block: 1, Slot: 4}})
	if b.Len() != 2 || b.Dst[1] != base+4*128+64 || b.Src[1] != 0x1000+64 {
		t.Fatalf("K-only: %d copies, second {dst %#x, src %#x}", b.Len(), b.Dst[1], b.Src[1])
	}

	// K/V chunks at one pitch (one tensor [layers][K, V][blocks]) go as
	// strided copies: the batch holds only the scales, which sit apart.
	one := goodLayers()
	one.K, one.V = []cuda.DevicePtr{0x10000, 0x10400}, []cuda.DevicePtr{0x10200, 0x10600}
	one.VBlockStride = one.KBlockStride
	one.KScale, one.VScale = l.KScale, l.VScale
	one.ScaleChunkBytes, one.ScaleBlockStride = 16, 32
	c, err = newCopier(one, h, Options{Stores: StoreCopyEngine})
	if err != nil {
		t.Fatal(err)
	}
	if c.regions[0].pitch != 0x200 || c.regions[1].pitch != 0 {
		t.Fatalf("pitches %d and %d, want 512 (K/V) and 0 (scales)", c.regions[0].pitch, c.regions[1].pitch)
	}
	if want := maxBatchCopies / 4; c.storeOps != want {
		t.Fatalf("storeOps = %d, want %d (4 batched copies a block)", c.storeOps, want)
	}
	b.Reset()
	c.appendStores(&b, []Op{{Block: 3, Slot: 5}})
	if b.Len() != 4 || b.Dst[0] != base+5*320+256 || b.Src[0] != l.KScale[0]+3*32 {
		t.Fatalf("with strided K/V: %d batched copies, the first {dst %#x, src %#x}", b.Len(), b.Dst[0], b.Src[0])
	}
	// The strided copies themselves: per region, the block's layer-0 K
	// chunk as the first row, 2 layers x K, V rows at the pitch, into the
	// slot at the region's offset (the scales after the 256 K/V bytes).
	one.KScale, one.VScale = []cuda.DevicePtr{0x20000, 0x20100}, []cuda.DevicePtr{0x20080, 0x20180}
	c, err = newCopier(one, h, Options{Stores: StoreCopyEngine})
	if err != nil {
		t.Fatal(err)
	}
	if c.regions[1].pitch != 0x80 || c.storeOps != maxBatchCopies {
		t.Fatalf("scales at one pitch: pitch %d, storeOps %d", c.regions[1].pitch, c.storeOps)
	}
	for ri, want := range []rowCopy{
		{src: 0x10000 + 3*64, hostOff: 5*320 + 0, rows: 4},
		{src: 0x20000 + 3*32, hostOff: 5*320 + 256, rows: 4},
	} {
		if got := c.rowCopyOf(Op{Block: 3, Slot: 5}, &c.regions[ri]); got != want {
			t.Errorf("region %d: strided copy %+v, want %+v", ri, got, want)
		}
	}
	b.Reset()
	c.appendStores(&b, []Op{{Block: 3, Slot: 5}})
	if b.Len() != 0 {
		t.Fatalf("every region strided, yet %d batched copies", b.Len())
	}
}

// A region's chunks go as one strided copy only where every (layer,
// tensor) chunk of a block sits at one pitch, in increasing order, no
// closer than a chunk and no farther than a strided copy takes, with one
// block stride for K and V.
func TestRowPitch(t *testing.T) {
	p := func(v ...uint64) []cuda.DevicePtr {
		out := make([]cuda.DevicePtr, len(v))
		for i, x := range v {
			out[i] = cuda.DevicePtr(x)
		}
		return out
	}
	for _, tc := range []struct {
		name          string
		k, v          []cuda.DevicePtr
		chunk, ks, vs int64
		want          int64
	}{
		{"one tensor [layers][K, V]", p(0x1000, 0x3000, 0x5000), p(0x2000, 0x4000, 0x6000), 64, 64, 64, 0x1000},
		{"K only", p(0x1000, 0x1100, 0x1200), nil, 256, 256, 0, 0x100},
		{"one row", p(0x1000), nil, 64, 64, 0, 64},
		{"K and V strides differ", p(0x1000, 0x3000), p(0x2000, 0x4000), 64, 64, 128, 0},
		{"uneven spacing", p(0x1000, 0x3000, 0x5100), p(0x2000, 0x4000, 0x6100), 64, 64, 64, 0},
		{"V before K", p(0x2000, 0x4000), p(0x1000, 0x3000), 64, 64, 64, 0},
		{"decreasing", p(0x3000, 0x2000, 0x1000), nil, 64, 64, 0, 0},
		{"rows overlap", p(0x1000, 0x1020, 0x1040), nil, 64, 64, 0, 0},
		{"pitch past the maximum", p(0x1000, 0x1000+1<<31), nil, 64, 64, 0, 0},
	} {
		if got := rowPitch(tc.k, tc.v, tc.chunk, tc.ks, tc.vs); got != tc.want {
			t.Errorf("%s: pitch %d, want %d", tc.name, got, tc.want)
		}
	}
}

// A store engine is one of the two; the copy engines refuse the legacy
// default stream before anything is enqueued, and a copier for them is
// refused where the driver (or the kernels, which reloads use) is missing.
func TestStoreEngineOptions(t *testing.T) {
	mem := alignedHost(4 * 256)
	host := Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: 256, NumSlots: 4}
	if _, err := New(goodLayers(), host, Options{Stores: 2}); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Errorf("store engine 2: %v", err)
	}
	if StoreKernel.String() != "kernel" || StoreCopyEngine.String() != "copy-engine" {
		t.Errorf("names %q %q", StoreKernel, StoreCopyEngine)
	}
	c, err := newCopier(goodLayers(), host, Options{Stores: StoreCopyEngine})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []cuda.Stream{0, 1} {
		if err := c.Run([]Op{{Block: 1, Slot: 1}}, nil, s); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("stores by the copy engines on stream %d: %v", s, err)
		}
	}
	if cuda.Load() != nil {
		_, err := New(goodLayers(), host, Options{Stores: StoreCopyEngine})
		if code := kverr.CodeOf(err); code != kverr.Unsupported && code != kverr.NoDevice {
			t.Errorf("a copy-engine copier without a driver: %v", err)
		}
	}
}
