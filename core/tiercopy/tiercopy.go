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
// and, for a cache with per-block scales (e4m3 with one scale per token and
// kv head), the block's scales of (l, t) after all of them, at s*SlotBytes +
// layers*kv*ChunkBytes + (l*kv + t)*ScaleChunkBytes, so that a slot is one
// contiguous value (what the shared tier stores) and a block never moves
// without its scales.
//
// Demotions may instead go through the copy engines (Options.Stores,
// StoreCopyEngine). Where a block's chunks of every layer and tensor sit at
// one pitch in one GPU allocation (a cache allocated as one tensor [layers]
// [K, V][blocks][...], as kvplug.hf's), a block is one strided copy
// (cuMemcpy2DAsync: its chunks are the rows, the slot holds them back to
// back); otherwise one cuMemcpyBatchAsync call a batch, a copy per block,
// layer and tensor, which costs the driver about half a microsecond a copy.
// One allocation: a cache whose memory is several mappings (core/vmem, or
// torch's expandable segments) takes the batched copy, as does a pitch above
// cuda.MaxCopyPitch. The kernel copies a batch faster alone, but its thread
// blocks share the SMs with whatever runs beside it; stores of a
// write-through tier run on a side stream during the step's forward pass,
// where the copy engines leave the SMs to the step. Reloads always use the
// kernel: they sit ahead of the step's attention, where only their speed
// counts.
package tiercopy

import (
	"fmt"
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

	// KScale and VScale are, for a cache with per-block scales, per layer
	// the device address of block 0's scales of K and of V (nil: no such
	// scales; VScale with V only). ScaleChunkBytes is one block's scales of
	// one layer's K (a multiple of 16), ScaleBlockStride the bytes from
	// block b's to b+1's (>= ScaleChunkBytes, a multiple of 16).
	KScale, VScale                    []cuda.DevicePtr
	ScaleChunkBytes, ScaleBlockStride int64
}

// KV is 2 with V caches, 1 without.
func (l *Layers) KV() int {
	if l.V == nil {
		return 1
	}
	return 2
}

// kvBytes is the part of a host slot that holds the K/V chunks; the
// scales (if any) follow it.
func (l *Layers) kvBytes() int64 { return int64(len(l.K)*l.KV()) * l.ChunkBytes }

// SlotBytesNeeded is the host slot size the layout needs.
func (l *Layers) SlotBytesNeeded() int64 {
	n := l.kvBytes()
	if l.KScale != nil {
		n += int64(len(l.K)*l.KV()) * l.ScaleChunkBytes
	}
	return n
}

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
	if err := l.validateScales(); err != nil {
		return err
	}
	for t, ptrs := range [][]cuda.DevicePtr{l.K, l.V, l.KScale, l.VScale} {
		for i, p := range ptrs {
			if p == 0 || uint64(p)%16 != 0 {
				return kverr.Errorf(kverr.InvalidArgument, "tier copy: layer %d's %s address must be non-zero and 16-byte aligned: got %#x",
					i, []string{"K", "V", "K scale", "V scale"}[t], uint64(p))
			}
		}
	}
	return nil
}

// validateScales checks the per-block scales: one array per cache tensor,
// each block's scales one chunk the kernel copies in 16-byte pieces.
func (l *Layers) validateScales() error {
	if l.KScale == nil {
		if l.VScale != nil || l.ScaleChunkBytes != 0 || l.ScaleBlockStride != 0 {
			return kverr.Errorf(kverr.InvalidArgument, "tier copy: V scales, a scale chunk or a scale stride without K scales")
		}
		return nil
	}
	if len(l.KScale) != len(l.K) || (l.V != nil) != (l.VScale != nil) || (l.VScale != nil && len(l.VScale) != len(l.V)) {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: %d K layers, %d V layers, but %d K scale and %d V scale arrays (one a cache tensor)",
			len(l.K), len(l.V), len(l.KScale), len(l.VScale))
	}
	if l.ScaleChunkBytes < 16 || l.ScaleChunkBytes%16 != 0 || l.ScaleChunkBytes > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: a block's scales are copied as one chunk of a multiple of 16 bytes: got %d (block_size x kv_heads x 4 must be a multiple of 16)", l.ScaleChunkBytes)
	}
	if s := l.ScaleBlockStride; s < l.ScaleChunkBytes || s%16 != 0 || s > 1<<40 {
		return kverr.Errorf(kverr.InvalidArgument, "tier copy: the scales' block stride must be a multiple of 16 in [%d, 2^40]: got %d", l.ScaleChunkBytes, s)
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
			"tier copy: slot_bytes must be a multiple of 16, at least the layout's %d (%d layers x %d tensors x (%d bytes + %d of scales)), and slots x slot_bytes <= 2^46: got %d",
			need, len(l.K), l.KV(), l.ChunkBytes, l.ScaleChunkBytes, h.SlotBytes)
	}
	return nil
}

// Op is one block's copy: GPU block Block and host slot Slot.
type Op struct{ Block, Slot int32 }

// StoreEngine is what copies a batch's demotions (GPU block -> host slot).
type StoreEngine int32

const (
	// StoreKernel copies demotions with the tier copy kernel, as reloads.
	StoreKernel StoreEngine = iota
	// StoreCopyEngine enqueues demotions on the copy engines (a strided
	// copy a block and region where the rows allow, else batched copies of
	// up to maxBatchCopies copies a call; the package comment says when),
	// leaving the SMs to the kernels of other streams. Needs a CUDA 12.8
	// or newer driver, and a stream other than the legacy default stream.
	StoreCopyEngine
)

func (e StoreEngine) String() string {
	switch e {
	case StoreKernel:
		return "kernel"
	case StoreCopyEngine:
		return "copy-engine"
	}
	return fmt.Sprintf("StoreEngine(%d)", int32(e))
}

// Options are a copier's settings; the zero value is the default.
type Options struct {
	Stores StoreEngine
}

// maxBatchCopies bounds the copies of one cuMemcpyBatchAsync call, and so
// the copier's batch arrays (24 bytes a copy): a batch of more demotions
// is split into calls of whole blocks.
const maxBatchCopies = 1 << 16

// Copier runs tier copies for one KV layout and one host region, in the
// CUDA context it was created in. Safe for concurrent use.
type Copier struct {
	mu        sync.Mutex
	layers    Layers
	host      Host
	kv        int
	regions   []region // the K/V chunks, then the scales (if any)
	perLaunch int
	ctx       cuda.Context
	reg       cuda.HostRegistration
	closed    bool

	stores   StoreEngine
	storeOps int            // demotions per batched copy call (StoreCopyEngine)
	batch    cuda.CopyBatch // the batched copy's arrays, reused from Run to Run
	// batchedStores counts the demotions enqueued by batched copies (tests:
	// the copy engines, not the kernel, took them).
	batchedStores int64
	// rowStores counts the (demotion, region) pairs enqueued as strided
	// copies (tests, likewise).
	rowStores int64
	rows      cuda.RowCopy // the strided copy's arguments, reused from Run to Run
}

// region is one launch's share of a block: a chunk per (layer, tensor)
// from the device arrays of table to the host slot's bytes at hostOff.
type region struct {
	table            cuda.DevicePtr   // uint64 [layers][2], device memory
	k, v             []cuda.DevicePtr // the same table on the host, for the batched copy (v nil: K only)
	chunk, kStride   int64
	vStride, hostOff int64
	rows             int64 // a block's chunks: layers x tensors
	parts, perOp     int64 // thread blocks per chunk, and per op (rows x parts)
	// pitch is the bytes from one (layer, tensor) chunk of a block to the
	// next, layer-major, K before V, when it is one for the whole region
	// (then a block's demotion by the copy engines is one strided copy);
	// 0 when it is not.
	pitch int64
}

// rowPitch returns the pitch at which a block's chunks of every layer and
// tensor (layer-major, K then V) sit in GPU memory, or 0 when they sit at no
// single pitch: K and V with different block strides, chunks that are not
// evenly spaced in increasing order, a pitch below the chunk (rows that
// overlap) or above what a strided copy takes.
func rowPitch(k, v []cuda.DevicePtr, chunk, kStride, vStride int64) int64 {
	rows := make([]cuda.DevicePtr, 0, 2*len(k))
	for l := range k {
		rows = append(rows, k[l])
		if v != nil {
			rows = append(rows, v[l])
		}
	}
	if v != nil && kStride != vStride {
		return 0
	}
	if len(rows) == 1 {
		return chunk
	}
	if rows[1] <= rows[0] {
		return 0
	}
	p := int64(rows[1] - rows[0])
	if p < chunk || p > cuda.MaxCopyPitch {
		return 0
	}
	for i, r := range rows {
		if r < rows[0] || int64(r-rows[0]) != int64(i)*p {
			return 0
		}
	}
	return p
}

// New registers the host region (page-locked and mapped; memory the engine
// registered already is used as it is) and uploads the layer table, in the
// calling thread's CUDA context. With o.Stores StoreCopyEngine it refuses,
// UNSUPPORTED, a driver without the batched copy.
func New(l Layers, h Host, o Options) (*Copier, error) {
	c, err := newCopier(l, h, o)
	if err != nil {
		return nil, err
	}
	if !kernels.Built() {
		return nil, kverr.Errorf(kverr.Unsupported, "tier copy: this kvplug library was built without its CUDA kernels (no kernels/%s at build time, or KERNELS=off)", kernels.FatbinPath)
	}
	if c.stores == StoreCopyEngine {
		if err := cuda.BatchCopySupported(); err != nil {
			return nil, kverr.Wrap(kverr.CodeOf(err), err, "tier copy: stores by the copy engines")
		}
	}

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := cuda.Bind()
	if err != nil {
		return nil, err
	}
	c.ctx = ctx
	if c.stores == StoreCopyEngine {
		c.oneAllocationRows()
	}
	for i := range c.regions {
		r := &c.regions[i]
		if r.table, err = uploadTable(r.k, r.v); err != nil {
			c.freeTables()
			return nil, err
		}
	}
	if c.reg, err = cuda.RegisterHost(h.Base, int(h.SlotBytes*int64(h.NumSlots))); err != nil {
		c.freeTables()
		return nil, err
	}
	return c, nil
}

// newCopier checks the layout, the host region and the options and plans
// the copies, touching no device.
func newCopier(l Layers, h Host, o Options) (*Copier, error) {
	if err := l.validate(); err != nil {
		return nil, err
	}
	if err := h.validate(&l); err != nil {
		return nil, err
	}
	if o.Stores != StoreKernel && o.Stores != StoreCopyEngine {
		return nil, kverr.Errorf(kverr.InvalidArgument, "tier copy: unknown store engine %d", int32(o.Stores))
	}
	c := &Copier{layers: l, host: h, kv: l.KV(), stores: o.Stores}
	clone := func(p []cuda.DevicePtr) []cuda.DevicePtr {
		if p == nil {
			return nil
		}
		return append([]cuda.DevicePtr(nil), p...)
	}
	c.layers.K, c.layers.V = clone(l.K), clone(l.V)
	c.layers.KScale, c.layers.VScale = clone(l.KScale), clone(l.VScale)
	c.regions = []region{{k: c.layers.K, v: c.layers.V, chunk: l.ChunkBytes, kStride: l.KBlockStride, vStride: l.VBlockStride}}
	if l.KScale != nil {
		c.regions = append(c.regions, region{k: c.layers.KScale, v: c.layers.VScale,
			chunk: l.ScaleChunkBytes, kStride: l.ScaleBlockStride, vStride: l.ScaleBlockStride, hostOff: l.kvBytes()})
	}
	c.perLaunch = OpsPerLaunch
	for i := range c.regions {
		r := &c.regions[i]
		r.parts = (r.chunk + ctaByte - 1) / ctaByte
		r.rows = int64(len(l.K) * c.kv)
		r.perOp = r.rows * r.parts
		c.perLaunch = int(min(int64(c.perLaunch), (1<<31-1)/r.perOp))
		if c.stores == StoreCopyEngine {
			r.pitch = rowPitch(r.k, r.v, r.chunk, r.kStride, r.vStride)
		}
	}
	if c.perLaunch < 1 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "tier copy: one block of %d layers x %d bytes needs more than 2^31 thread blocks", len(l.K), l.ChunkBytes)
	}
	c.planBatches()
	return c, nil
}

// planBatches sets how many demotions one batched copy call takes: its
// copies are a block's chunks of the regions that strided copies do not
// take.
func (c *Copier) planBatches() {
	copiesPerOp := 0
	for _, r := range c.regions {
		if r.pitch == 0 {
			copiesPerOp += int(r.rows)
		}
	}
	c.storeOps = max(1, maxBatchCopies/max(1, copiesPerOp))
}

// oneAllocationRows keeps the strided copy for the regions whose rows, over
// every block, lie in one device allocation (the driver refuses a strided
// copy across allocations, which can sit at one pitch by chance); the
// others' stores go as batched copies. Runs in the copier's context.
func (c *Copier) oneAllocationRows() {
	for i := range c.regions {
		r := &c.regions[i]
		if r.pitch == 0 {
			continue
		}
		// The span from block 0's first row to the last block's last row;
		// a span past 2^62 is no single allocation (and would overflow).
		span, ok := int64(0), r.kStride <= (1<<62)/int64(c.layers.NumBlocks)
		if ok {
			span = (r.rows-1)*r.pitch + int64(c.layers.NumBlocks-1)*r.kStride + r.chunk
		}
		base, size, err := cuda.AllocationRange(r.k[0])
		if !ok || err != nil || uint64(r.k[0])-uint64(base)+uint64(span) > uint64(size) {
			r.pitch = 0
		}
	}
	c.planBatches()
}

// appendStores appends to b the batched copies of demotions ops: per op,
// region, layer and tensor, the chunk of the GPU block to its place in the
// host slot, for the regions whose chunks sit at no single pitch (the
// others go as strided copies). The host slots are addressed by their host
// address, which the driver knows as registered host memory (unified
// addressing).
func (c *Copier) appendStores(b *cuda.CopyBatch, ops []Op) {
	host := cuda.DevicePtr(uintptr(c.host.Base))
	for _, o := range ops {
		slot := host + cuda.DevicePtr(int64(o.Slot)*c.host.SlotBytes)
		for ri := range c.regions {
			r := &c.regions[ri]
			if r.pitch != 0 {
				continue
			}
			dst := slot + cuda.DevicePtr(r.hostOff)
			for l := range r.k {
				b.Add(dst, r.k[l]+cuda.DevicePtr(int64(o.Block)*r.kStride), r.chunk)
				dst += cuda.DevicePtr(r.chunk)
				if r.v != nil {
					b.Add(dst, r.v[l]+cuda.DevicePtr(int64(o.Block)*r.vStride), r.chunk)
					dst += cuda.DevicePtr(r.chunk)
				}
			}
		}
	}
}

// uploadTable copies a region's layer table, uint64 [layers][2] (K, V; V 0
// without V arrays), into device memory.
func uploadTable(k, v []cuda.DevicePtr) (cuda.DevicePtr, error) {
	table := make([]uint64, 2*len(k))
	for i := range k {
		table[2*i] = uint64(k[i])
		if v != nil {
			table[2*i+1] = uint64(v[i])
		}
	}
	tb := unsafe.Slice((*byte)(unsafe.Pointer(&table[0])), 8*len(table))
	d, err := cuda.MemAlloc(len(tb))
	if err != nil {
		return 0, err
	}
	if err := cuda.CopyToDevice(d, tb); err != nil {
		cuda.MemFree(d)
		return 0, err
	}
	return d, nil
}

// freeTables frees the regions' layer tables; the first error is returned.
func (c *Copier) freeTables() error {
	var first error
	for i := range c.regions {
		if c.regions[i].table != 0 {
			if err := cuda.MemFree(c.regions[i].table); first == nil {
				first = err
			}
			c.regions[i].table = 0
		}
	}
	return first
}

// Run enqueues the copies on stream (a stream of the copier's context):
// demotions (block -> slot) and reloads (slot -> block), the demotions in
// launches (or batched copies) of their own ahead of the reloads' (a
// reload may overwrite a block that a demotion of the batch reads). It
// returns once they are enqueued; the engine records an event after it
// and reports the batch complete when the event has completed. Every op,
// and with StoreCopyEngine the stream (not the legacy default stream), is
// checked before anything is enqueued: a bad one fails the call with
// nothing enqueued. The slices are only read during the call.
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
	byCopyEngine := c.stores == StoreCopyEngine && len(demote) > 0
	if byCopyEngine { // (an old driver was refused by New)
		if err := cuda.CheckBatchStream(stream); err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, "tier copy: stores by the copy engines")
		}
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
		SlotBytes: c.host.SlotBytes, NumLayers: int32(len(c.layers.K)), KV: int32(c.kv),
		NumBlocks: c.layers.NumBlocks, NumSlots: c.host.NumSlots,
	}
	// The demotions before the reloads: a launch's ops run concurrently,
	// and a reload may write a GPU block that a demotion of the same batch
	// reads (a block evicted and allocated anew in the step, the manager's
	// DemoteEvicted); stream order puts the reads first. With
	// StoreCopyEngine the demotions are batched copies on the stream,
	// ordered before the reloads' launches as a launch would be.
	launched := [][]Op{demote, reload}
	if byCopyEngine {
		if err := c.storeByCopyEngines(demote, stream); err != nil {
			return err
		}
		launched[0] = nil
	}
	// Each region (the K/V chunks, the scales) is a launch of its own over
	// the same ops: the kernel copies one chunk size per launch.
	for k, ops := range launched {
		for first := 0; first < len(ops); first += c.perLaunch {
			cnt := min(c.perLaunch, len(ops)-first)
			p.NOps, p.NDemote = int32(cnt), 0
			if k == 0 {
				p.NDemote = int32(cnt)
			}
			for i, o := range ops[first : first+cnt] {
				p.Ops[i] = [2]int32{o.Block, o.Slot}
			}
			for _, r := range c.regions {
				p.Layers, p.Host = uint64(r.table), uint64(c.reg.Device)+uint64(r.hostOff)
				p.ChunkBytes, p.KBlockStride, p.VBlockStride, p.Parts = r.chunk, r.kStride, r.vStride, int32(r.parts)
				cfg := cuda.LaunchConfig{Grid: cuda.Dim3{X: uint32(int64(cnt) * r.perOp), Y: 1, Z: 1}, Block: cuda.Dim3{X: threads, Y: 1, Z: 1}}
				if err := cuda.Launch(m, kernel, cfg, stream, &p); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// rowCopy is one demotion's strided copy of one region: rows rows of the
// region's chunk, from src at the region's pitch to the host slot's bytes
// at hostOff from the host base, back to back.
type rowCopy struct {
	src     cuda.DevicePtr
	hostOff int64
	rows    int64
}

// rowCopyOf plans op o's strided copy of region r (r.pitch != 0): the
// block's first row (layer 0's K) and its place in the slot.
func (c *Copier) rowCopyOf(o Op, r *region) rowCopy {
	return rowCopy{
		src:     r.k[0] + cuda.DevicePtr(int64(o.Block)*r.kStride),
		hostOff: int64(o.Slot)*c.host.SlotBytes + r.hostOff,
		rows:    r.rows,
	}
}

// storeByCopyEngines enqueues demotions on the copy engines: a strided
// copy per op and region whose chunks sit at one pitch, batched copies of
// whole blocks for the other regions.
func (c *Copier) storeByCopyEngines(demote []Op, stream cuda.Stream) error {
	const what = "tier copy: stores by the copy engines"
	batched := false
	for ri := range c.regions {
		r := &c.regions[ri]
		if r.pitch == 0 {
			batched = true
			continue
		}
		for _, o := range demote {
			rc := c.rowCopyOf(o, r)
			if err := c.rows.DeviceToHostAsync(unsafe.Add(c.host.Base, rc.hostOff), r.chunk, rc.src, r.pitch, r.chunk, rc.rows, stream); err != nil {
				return kverr.Wrap(kverr.CodeOf(err), err, what)
			}
		}
		c.rowStores += int64(len(demote))
	}
	if !batched {
		return nil
	}
	for first := 0; first < len(demote); first += c.storeOps {
		ops := demote[first:min(first+c.storeOps, len(demote))]
		c.batch.Reset()
		c.appendStores(&c.batch, ops)
		if err := cuda.MemcpyBatchAsync(&c.batch, stream); err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, what)
		}
		c.batchedStores += int64(len(ops))
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
	if e := c.freeTables(); err == nil {
		err = e
	}
	return err
}
