// Package tiercopy moves KV blocks between the paged caches in GPU memory
// and the slots of a host KV tier: every layer's K and V of each block of a
// step's copy batch (demotions, then reloads) in one kernel launch per
// KVP_TIER_COPY_OPS blocks of each, reading and writing the host slots directly
// through page-locked memory mapped into the device's address space.
//
// Why a kernel and not one cudaMemcpyAsync per block and layer: a step's
// batch is blocks x layers x 2 chunks of tens of kilobytes (a Llama-3-8B
// block of 16 tokens is 64 chunks of 32 KiB), and a copy call per chunk
// costs microseconds of host time each; the kernel takes the whole batch in
// one call, and its many outstanding 16-byte requests fill the host link.
//
// The host slot layout is fixed: slot s holds, for each layer l and tensor
// t (0 K, 1 V), the chunk (l, t) at s*SlotBytes + (l*kv + t)*ChunkBytes,
// so that a slot is one contiguous value (what the shared tier stores).
package tiercopy

import (
	"runtime"
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kimage"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/kernels"
)

// Kernel constants (kernels/kvplug_kernels.h).
const (
	threads = 256   // KVP_TIER_COPY_THREADS
	ctaByte = 16384 // KVP_TIER_COPY_CTA_BYTES
	// OpsPerLaunch is the most blocks one launch copies (KVP_TIER_COPY_OPS).
	OpsPerLaunch = 500
)

var kernel = kimage.Image.Kernel("kvp_tier_copy")

// params mirrors kvp_tier_copy_params, field for field (the c tags name the
// C members; TestParamsLayout compares every offset with the header's).
type params struct {
	Layers       uint64                 `c:"layers"`
	Host         uint64                 `c:"host"`
	SlotBytes    int64                  `c:"slot_bytes"`
	ChunkBytes   int64                  `c:"chunk_bytes"`
	KBlockStride int64                  `c:"k_block_stride"`
	VBlockStride int64                  `c:"v_block_stride"`
	NumLayers    int32                  `c:"num_layers"`
	KV           int32                  `c:"kv"`
	NOps         int32                  `c:"n_ops"`
	NDemote      int32                  `c:"n_demote"`
	Parts        int32                  `c:"parts"`
	NumBlocks    int32                  `c:"num_blocks"`
	NumSlots     int32                  `c:"num_slots"`
	Reserved     int32                  `c:"reserved"`
	Ops          [OpsPerLaunch][2]int32 `c:"ops"`
}

// Layers is an engine's paged KV caches: per layer, the device address of
// block 0 of its K and of its V.
type Layers struct {
	K []cuda.DevicePtr
	// V is nil for caches with one tensor per layer (MLA's latent cache):
	// then only K is copied.
	V []cuda.DevicePtr
	// ChunkBytes is one block of one layer's K (and of V): block_size x
	// kv_heads x head_dim x element size for block-major layouts; a
	// multiple of 16.
	ChunkBytes int64
	// KBlockStride and VBlockStride are the bytes from block b to b+1 in
	// one layer's K and V (>= ChunkBytes; multiples of 16).
	KBlockStride, VBlockStride int64
	// NumBlocks is the blocks per layer; ops naming others are refused.
	NumBlocks int32
}

// KV is 2 with V caches, 1 without.
func (l *Layers) KV() int {
	if l.V == nil {
		return 1
	}
	return 2
}

// SlotBytesNeeded is the host slot size the layout needs.
func (l *Layers) SlotBytesNeeded() int64 { return int64(len(l.K)*l.KV()) * l.ChunkBytes }

func (l *Layers) validate() error {
	n := len(l.K)
	if err := limits.Range("tier copy: num_layers", n, 1, limits.TierLayers); err != nil {
		return err
	}
	if l.V != nil && len(l.V) != n {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: %d K layers but %d V layers", n, len(l.V))
	}
	if l.ChunkBytes < 16 || l.ChunkBytes%16 != 0 || l.ChunkBytes > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: block_bytes must be a positive multiple of 16 up to 2^30: got %d", l.ChunkBytes)
	}
	strides := []int64{l.KBlockStride}
	if l.V != nil {
		strides = append(strides, l.VBlockStride)
	}
	for i, s := range strides {
		if s < l.ChunkBytes || s%16 != 0 || s > 1<<40 {
			return kverr.Errorf(kverr.InvalidArgument, "tier copy: %s_block_stride must be a multiple of 16 in [block_bytes, 2^40]: got %d (block_bytes %d)",
				[]string{"k", "v"}[i], s, l.ChunkBytes)
		}
	}
	if l.NumBlocks < 1 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: num_blocks must be >= 1: got %d", l.NumBlocks)
	}
	for t, ptrs := range [][]cuda.DevicePtr{l.K, l.V} {
		for i, p := range ptrs {
			if p == 0 || uint64(p)%16 != 0 {
				return kverr.Errorf(kverr.InvalidArgument, "tier copy: layer %d's %s address must be non-zero and 16-byte aligned: got %#x",
					i, []string{"K", "V"}[t], uint64(p))
			}
		}
	}
	return nil
}

// Host is the host tier's memory: NumSlots slots of SlotBytes at Base.
type Host struct {
	Base      unsafe.Pointer
	SlotBytes int64
	NumSlots  int32
}

func (h *Host) validate(l *Layers) error {
	if h.Base == nil || uintptr(h.Base)%16 != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: the host memory must be non-NULL and 16-byte aligned: got %p", h.Base)
	}
	if h.NumSlots < 1 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: num_slots must be >= 1: got %d", h.NumSlots)
	}
	need := l.SlotBytesNeeded()
	if h.SlotBytes < need || h.SlotBytes%16 != 0 || h.SlotBytes > limits.TierBytes/int64(h.NumSlots) {
		return kverr.Errorf(kverr.InvalidArgument,
			"tier copy: slot_bytes must be a multiple of 16, at least the layout's %d (%d layers x %d tensors x %d bytes), and slots x slot_bytes <= 2^46: got %d",
			need, len(l.K), l.KV(), l.ChunkBytes, h.SlotBytes)
	}
	return nil
}

// Op is one block's copy: GPU block Block and host slot Slot.
type Op struct{ Block, Slot int32 }

// Copier runs tier copies for one KV layout and one host region, in the
// CUDA context it was created in. Safe for concurrent use.
type Copier struct {
	mu        sync.Mutex
	layers    Layers
	host      Host
	kv        int
	parts     int64
	perOp     int64 // thread blocks per op: layers x tensors x parts
	perLaunch int
	ctx       cuda.Context
	table     cuda.DevicePtr // uint64 [layers][2], device memory
	reg       cuda.HostRegistration
	closed    bool
}

// New registers the host region (page-locked and mapped; memory the engine
// registered already is used as it is) and uploads the layer table, in the
// calling thread's CUDA context.
func New(l Layers, h Host) (*Copier, error) {
	if err := l.validate(); err != nil {
		return nil, err
	}
	if err := h.validate(&l); err != nil {
		return nil, err
	}
	if !kernels.Built() {
		return nil, kverr.Errorf(kverr.Unsupported, "tier copy: this kvplug library was built without its CUDA kernels (no kernels/%s at build time, or KERNELS=off)", kernels.FatbinPath)
	}
	c := &Copier{layers: l, host: h, kv: l.KV()}
	c.layers.K = append([]cuda.DevicePtr(nil), l.K...)
	if l.V != nil {
		c.layers.V = append([]cuda.DevicePtr(nil), l.V...)
	}
	c.parts = (l.ChunkBytes + ctaByte - 1) / ctaByte
	c.perOp = int64(len(l.K)*c.kv) * c.parts
	c.perLaunch = int(min(int64(OpsPerLaunch), (1<<31-1)/c.perOp))
	if c.perLaunch < 1 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "tier copy: one block of %d layers x %d bytes needs more than 2^31 thread blocks", len(l.K), l.ChunkBytes)
	}

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := cuda.Bind()
	if err != nil {
		return nil, err
	}
	c.ctx = ctx
	table := make([]uint64, 2*len(l.K))
	for i := range l.K {
		table[2*i] = uint64(l.K[i])
		if l.V != nil {
			table[2*i+1] = uint64(l.V[i])
		}
	}
	tb := unsafe.Slice((*byte)(unsafe.Pointer(&table[0])), 8*len(table))
	if c.table, err = cuda.MemAlloc(len(tb)); err != nil {
		return nil, err
	}
	if err = cuda.CopyToDevice(c.table, tb); err == nil {
		c.reg, err = cuda.RegisterHost(h.Base, int(h.SlotBytes*int64(h.NumSlots)))
	}
	if err != nil {
		cuda.MemFree(c.table)
		return nil, err
	}
	return c, nil
}

// Run enqueues the copies on stream (a stream of the copier's context):
// demotions (block -> slot) and reloads (slot -> block), the demotions in
// launches of their own ahead of the reloads' (a reload may overwrite a
// block that a demotion of the batch reads). It returns once
// they are enqueued; the engine records an event after it and reports the
// batch complete when the event has completed. Every op is checked before
// anything is launched: a bad one fails the call with nothing enqueued.
// The slices are only read during the call.
func (c *Copier) Run(demote, reload []Op, stream cuda.Stream) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return kverr.Errorf(kverr.InvalidHandle, "tier copy: the copier is destroyed")
	}
	for k, ops := range [][]Op{demote, reload} {
		for i, o := range ops {
			if o.Block < 0 || o.Block >= c.layers.NumBlocks || o.Slot < 0 || o.Slot >= c.host.NumSlots {
				return kverr.Errorf(kverr.InvalidArgument, "tier copy: %s op %d = {block %d, slot %d} is out of range (%d blocks, %d slots)",
					[]string{"demote", "reload"}[k], i, o.Block, o.Slot, c.layers.NumBlocks, c.host.NumSlots)
			}
		}
	}
	n := len(demote) + len(reload)
	if n == 0 {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := kimage.Image.Module()
	if err != nil {
		return err
	}
	if m.Context() != c.ctx {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: the calling thread's CUDA context is not the one the copier was created in")
	}
	p := params{
		Layers: uint64(c.table), Host: uint64(c.reg.Device),
		SlotBytes: c.host.SlotBytes, ChunkBytes: c.layers.ChunkBytes,
		KBlockStride: c.layers.KBlockStride, VBlockStride: c.layers.VBlockStride,
		NumLayers: int32(len(c.layers.K)), KV: int32(c.kv), Parts: int32(c.parts),
		NumBlocks: c.layers.NumBlocks, NumSlots: c.host.NumSlots,
	}
	// The demotions' launches before the reloads': a launch's ops run
	// concurrently, and a reload may write a GPU block that a demotion of
	// the same batch reads (a block evicted and allocated anew in the
	// step, the manager's DemoteEvicted); stream order puts the reads
	// first.
	for k, ops := range [][]Op{demote, reload} {
		for first := 0; first < len(ops); first += c.perLaunch {
			cnt := min(c.perLaunch, len(ops)-first)
			p.NOps, p.NDemote = int32(cnt), 0
			if k == 0 {
				p.NDemote = int32(cnt)
			}
			for i, o := range ops[first : first+cnt] {
				p.Ops[i] = [2]int32{o.Block, o.Slot}
			}
			cfg := cuda.LaunchConfig{Grid: cuda.Dim3{X: uint32(int64(cnt) * c.perOp), Y: 1, Z: 1}, Block: cuda.Dim3{X: threads, Y: 1, Z: 1}}
			if err := cuda.Launch(m, kernel, cfg, stream, &p); err != nil {
				return err
			}
		}
	}
	return nil
}

// Close unregisters the host region (when New registered it) and frees
// the layer table. No copy may be in flight. Closing twice is a no-op.
func (c *Copier) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.reg.Unregister()
	if e := cuda.MemFree(c.table); err == nil {
		err = e
	}
	return err
}
