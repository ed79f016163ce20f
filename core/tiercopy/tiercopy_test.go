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
		_, err := New(l, h)
		if kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Errorf("%s: New gave %v, want InvalidArgument", name, err)
		}
	}
	many := goodLayers()
	many.K = make([]cuda.DevicePtr, 1025)
	if _, err := New(many, host); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Errorf("1025 layers: %v", err)
	}
}

// TestGPURoundTrip demotes random blocks of every layer's K and V into host
// slots, checks the slot bytes against the caches, poisons the caches and
// reloads the slots into other blocks, then checks those blocks. 1203 ops
// take three launches. It skips only where there is no NVIDIA device
// (internal/gputest). Run on a GPU machine with
//
//	go test -c -o .device/tiercopy.test ./core/tiercopy && KVPLUG_REQUIRE_GPU=1 .device/tiercopy.test -test.run GPU -test.v
func TestGPURoundTrip(t *testing.T) {
	gputest.Need(t)
	for _, tc := range []struct {
		name          string
		layers, chunk int
		kOnly         bool
		ops           int
	}{
		{"llama-like", 4, 32768, false, 40},
		{"small-chunks-many-ops", 2, 48, false, 1203},
		{"k-only", 3, 20000, true, 17},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := 2
			if tc.kOnly {
				kv = 1
			}
			const blocks = 1300
			stride := int64(tc.chunk + 32) // a gap between blocks, never copied
			rng := rand.New(rand.NewPCG(uint64(tc.layers), uint64(tc.chunk)))
			cache := make([][]byte, tc.layers*kv) // per (layer, tensor)
			ptrs := make([]cuda.DevicePtr, tc.layers*kv)
			for i := range cache {
				cache[i] = make([]byte, int64(blocks)*stride)
				for j := range cache[i] {
					cache[i][j] = byte(rng.Uint32())
				}
				p, err := cuda.MemAlloc(len(cache[i]))
				if err != nil {
					t.Fatal(err)
				}
				defer cuda.MemFree(p)
				if err := cuda.CopyToDevice(p, cache[i]); err != nil {
					t.Fatal(err)
				}
				ptrs[i] = p
			}
			l := Layers{ChunkBytes: int64(tc.chunk), KBlockStride: stride, VBlockStride: stride, NumBlocks: blocks}
			for layer := 0; layer < tc.layers; layer++ {
				l.K = append(l.K, ptrs[layer*kv])
				if !tc.kOnly {
					l.V = append(l.V, ptrs[layer*kv+1])
				}
			}
			slotBytes := l.SlotBytesNeeded() + 16
			slots := tc.ops + 3
			mem := alignedHost(int(slotBytes) * slots)
			for i := range mem {
				mem[i] = 0xEE // poison
			}
			c, err := New(l, Host{Base: unsafe.Pointer(&mem[0]), SlotBytes: slotBytes, NumSlots: int32(slots)})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()

			perm := rng.Perm(blocks)
			demote := make([]Op, tc.ops)
			for i := range demote {
				demote[i] = Op{Block: int32(perm[i]), Slot: int32(slots - 1 - i)}
			}
			// An op out of range fails the whole call before any launch.
			bad := append(append([]Op(nil), demote...), Op{Block: blocks, Slot: 0})
			if err := c.Run(bad, nil, 0); kverr.CodeOf(err) != kverr.InvalidArgument {
				t.Fatalf("out-of-range op: %v", err)
			}
			if err := c.Run(demote, nil, 0); err != nil {
				t.Fatal(err)
			}
			if err := cuda.StreamSynchronize(0); err != nil {
				t.Fatal(err)
			}
			chunk := func(i, b int) []byte { return cache[i][int64(b)*stride : int64(b)*stride+int64(tc.chunk)] }
			for i, o := range demote {
				slot := mem[int64(o.Slot)*slotBytes : int64(o.Slot+1)*slotBytes]
				for j := range cache {
					got := slot[int64(j)*int64(tc.chunk) : int64(j+1)*int64(tc.chunk)]
					if !bytes.Equal(got, chunk(j, int(o.Block))) {
						t.Fatalf("demote op %d (block %d -> slot %d): tensor %d differs", i, o.Block, o.Slot, j)
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
			poison := bytes.Repeat([]byte{0xA5}, tc.chunk)
			for _, o := range reload {
				for j := range cache {
					copy(chunk(j, int(o.Block)), poison)
				}
			}
			for j := range cache {
				if err := cuda.CopyToDevice(ptrs[j], cache[j]); err != nil {
					t.Fatal(err)
				}
			}
			if err := c.Run(nil, reload, 0); err != nil {
				t.Fatal(err)
			}
			for j := range cache {
				got := make([]byte, len(cache[j]))
				if err := cuda.CopyFromDevice(got, ptrs[j]); err != nil {
					t.Fatal(err)
				}
				want := append([]byte(nil), cache[j]...)
				for _, o := range reload {
					slot := mem[int64(o.Slot)*slotBytes:]
					copy(want[int64(o.Block)*stride:int64(o.Block)*stride+int64(tc.chunk)], slot[int64(j)*int64(tc.chunk):int64(j+1)*int64(tc.chunk)])
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("tensor %d after the reloads differs from the expected cache (other blocks and the gaps must be untouched)", j)
				}
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			if err := c.Run(demote, nil, 0); kverr.CodeOf(err) != kverr.InvalidHandle {
				t.Fatalf("Run after Close: %v", err)
			}
		})
	}
}
