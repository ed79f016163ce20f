package attn

// Launches of shared-prefix (cascade) attention over a plan that
// core/cascade wrote into the engine's workspaces: the upload of the plan,
// and per layer the attention kernel over the plan's work items followed by
// the merge of each sequence's partial states. The plans are made and run
// in cascadeplan.go and cascaderun.go; these launchers take the plan's
// geometry as plain values.

import (
	"runtime"
	"strconv"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// Launch constants of kvplug_kernels.h, section 5.
const (
	cascadeThreads      = 128 // KVP_CASCADE_THREADS
	cascadeMergeThreads = 128 // KVP_CASCADE_MERGE_THREADS
)

// kvp_cascade_params
type cascadeParams struct {
	KV             pagedKVParams `c:"kv"`
	Q              uint64        `c:"q"`
	SeqLens        uint64        `c:"seq_lens"`
	Out            uint64        `c:"out"`
	LSE            uint64        `c:"lse"`
	Work           uint64        `c:"work"`
	PartOut        uint64        `c:"part_out"`
	PartLSE        uint64        `c:"part_lse"`
	QBatchStride   int64         `c:"q_batch_stride"`
	QHeadStride    int64         `c:"q_head_stride"`
	OutBatchStride int64         `c:"out_batch_stride"`
	OutHeadStride  int64         `c:"out_head_stride"`
	NumQHeads      int32         `c:"num_q_heads"`
	ItemsOff       int32         `c:"items_off"`
	QRowsOff       int32         `c:"qrows_off"`
	SegStartOff    int32         `c:"seg_start_off"`
	SegsOff        int32         `c:"segs_off"`
	MaxBatch       int32         `c:"max_batch"`
	Scale          float32       `c:"scale"`
	RowSeqOff      int32         `c:"rowseq_off"`
	QStartOff      int32         `c:"qstart_off"`
	MaxRows        int32         `c:"max_rows"`
	SkipShared     int32         `c:"skip_shared"`
	Reserved       int32         `c:"reserved"`
}

// cascadeKernels[dtype f16/bf16][head_dim index]: attention, merge, and the
// shared items on Hopper's wgmma mainloop.
var cascadeKernels = func() (t [2][len(headDims)][3]*cuda.Kernel) {
	for di, d := range []DType{F16, BF16} {
		for hi, h := range headDims {
			suffix := "_" + d.String() + "_h" + strconv.Itoa(h)
			t[di][hi] = [3]*cuda.Kernel{image.Kernel("kvp_cascade" + suffix), image.Kernel("kvp_cascade_merge" + suffix),
				image.Kernel("kvp_cascade_sm90" + suffix)}
		}
	}
	return t
}()

// cascadeSharedBytes is kvp_cascade_smem_bytes: the larger of a shared
// item's tile and a decode tail's 16-row decode tile.
func cascadeSharedBytes(headDim int) uint32 {
	stages := uint32(2)
	if headDim <= 64 {
		stages = 3
	}
	D := uint32(headDim)
	tq := uint32(128)
	if headDim > 128 {
		tq = 64
	}
	return max(tq*D*2+stages*64*D*4+(stages+1)*64*8, decodeSharedBytes(F16, headDim))
}

// cascadeBlocksPerSM is how many attention blocks an SM holds at once (as
// the prefill kernel: registers bound h64/h128, shared memory h256).
func cascadeBlocksPerSM(headDim int) int {
	if headDim <= 128 {
		return 2
	}
	return 1
}

// CheckCascadeDType refuses a dtype the cascade kernels are not built for
// (Unsupported): they take f16 and bf16 only.
func CheckCascadeDType(what string, d DType) error {
	if d != F16 && d != BF16 {
		return kverr.Errorf(kverr.Unsupported, "%s: dtype must be KVP_DTYPE_F16 or KVP_DTYPE_BF16: got %d", what, int32(d))
	}
	return nil
}

// CascadeSharedOnHopper reports whether the cascade's shared items run on
// the Hopper (sm_90a) wgmma mainloop on dev: compute capability 9.0, 16-bit
// types, the kernels built for it.
func CascadeSharedOnHopper(dev cuda.Device, d DType, headDim int) bool {
	return prefillMainloop(dev, d, headDim, 0) == MainloopSM90
}

// CascadeSlots is how many cascade attention blocks the current context's
// device runs at once: the planner sizes its KV chunks from it, and the
// attention launch's grid is this many blocks.
func CascadeSlots(headDim int) (int, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("cascade_plan")
	if err != nil {
		return 0, err
	}
	return m.Device().SMs * cascadeBlocksPerSM(headDim), nil
}

// cascadeUpload enqueues copies of host byte ranges [off, off+n) of the
// plan in host into the device workspace dev at the same offsets.
func cascadeUpload(dev cuda.DevicePtr, host []byte, ranges [][2]int64, stream cuda.Stream) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := module("cascade_plan"); err != nil {
		return err
	}
	for _, r := range ranges {
		src := host[r[0] : r[0]+r[1]]
		if err := cuda.CopyToDeviceAsync(dev+cuda.DevicePtr(r[0]), unsafe.Pointer(unsafe.SliceData(src)), len(src), stream); err != nil {
			return err
		}
	}
	return nil
}

// CascadeRunArgs is one layer's run of a cascade plan: the layer's tensors
// (DecodeLayout: Batch sequences, q and out [Rows, num_q_heads, head_dim]
// with QBatchStride / OutBatchStride between rows, the cache, the block
// table) and where the plan's regions sit in the device workspace.
type CascadeRunArgs struct {
	DecodeLayout     // with the caches' and the block table's pointers
	Rows         int // query rows (total_q); 0: Batch (decode)
	Q            cuda.DevicePtr
	SeqLens      cuda.DevicePtr // int32 [batch]: tails end here
	Out          cuda.DevicePtr
	LSE          cuda.DevicePtr // float32 [batch, num_q_heads]; 0: not wanted

	Workspace      cuda.DevicePtr // the plan at offset 0
	WorkspaceBytes int64
	// Byte offsets of the partial states in the workspace, and of the plan
	// regions in int32 words.
	PartOut, PartLSE                                               int64
	ItemsOff, QRowsOff, SegStartOff, SegsOff, RowSeqOff, QStartOff int
	MaxBatch, MaxRows                                              int // the workspace's capacities (MaxRows 0: MaxBatch)
	// SM80 runs every item on the sm_80 kernels even on a Hopper device
	// (tests: a plan cut for the wgmma mainloop must run there too).
	SM80 bool
}

// CascadeRun enqueues the attention and merge kernels of a cascade plan on
// stream. Both grids depend only on the device, the head shape and the
// workspace's capacity, so a captured pair serves every later plan in the
// same workspace.
func CascadeRun(a *CascadeRunArgs, stream cuda.Stream) error {
	const what = "paged_cascade"
	if _, err := a.validate(); err != nil {
		return err
	}
	rows, maxRows := a.Rows, a.MaxRows
	if rows == 0 {
		rows = a.Batch
	}
	if maxRows == 0 {
		maxRows = a.MaxBatch
	}
	if rows > maxRows || maxRows > 1<<24 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d query rows above the workspace's capacity of %d", what, rows, maxRows)
	}
	if rows != a.Batch {
		// q and out hold rows, not sequences: check their extents as such.
		dl := a.DecodeLayout
		dl.Batch = rows
		if _, err := dl.validate(); err != nil {
			return err
		}
	}
	if err := CheckCascadeDType(what, a.DType); err != nil {
		return err
	}
	if a.MaxBatch < a.Batch || a.MaxBatch < 1 || a.PartOut <= 0 || a.PartLSE <= a.PartOut || a.PartLSE > a.WorkspaceBytes ||
		a.PartOut%16 != 0 || a.PartLSE%4 != 0 || min(a.ItemsOff, a.QRowsOff, a.SegStartOff, a.SegsOff, a.RowSeqOff, a.QStartOff) < 0 ||
		int64(max(a.ItemsOff, a.QRowsOff, a.SegStartOff, a.SegsOff, a.RowSeqOff, a.QStartOff))*4 >= a.PartOut {
		return kverr.Errorf(kverr.InvalidArgument, "%s: the plan's workspace geometry is inconsistent (not written by kvp_cascade_plan?)", what)
	}
	if a.Batch > 0 {
		if err := firstErr(
			checkTensor(what+": q", a.Q),
			a.PagedKV.checkPointers(what, true),
			checkIndex(what+": seq_lens", a.SeqLens),
			checkTensor(what+": out", a.Out),
			aligned(what+": lse", 4, a.LSE),
			checkTensor(what+": workspace", a.Workspace),
		); err != nil {
			return err
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module(what)
	if err != nil || a.Batch == 0 {
		return err
	}
	p := cascadeParams{
		KV: a.PagedKV.params(a.DType, a.NumKVHeads),
		Q:  uint64(a.Q), SeqLens: uint64(a.SeqLens), Out: uint64(a.Out), LSE: uint64(a.LSE), Work: uint64(a.Workspace),
		PartOut: uint64(a.Workspace) + uint64(a.PartOut), PartLSE: uint64(a.Workspace) + uint64(a.PartLSE),
		QBatchStride: a.QBatchStride, QHeadStride: a.QHeadStride,
		OutBatchStride: a.OutBatchStride, OutHeadStride: a.OutHeadStride,
		NumQHeads: int32(a.NumQHeads),
		ItemsOff:  int32(a.ItemsOff), QRowsOff: int32(a.QRowsOff), SegStartOff: int32(a.SegStartOff), SegsOff: int32(a.SegsOff),
		MaxBatch: int32(a.MaxBatch), Scale: SoftmaxScale(a.Scale, a.HeadDim),
		RowSeqOff: int32(a.RowSeqOff), QStartOff: int32(a.QStartOff), MaxRows: int32(maxRows),
	}
	di := 0
	if a.DType == BF16 {
		di = 1
	}
	hi := 0
	for i, h := range headDims {
		if h == a.HeadDim {
			hi = i
		}
	}
	ks := cascadeKernels[di][hi]
	sms := m.Device().SMs
	if !a.SM80 && CascadeSharedOnHopper(m.Device(), a.DType, a.HeadDim) {
		// The shared items (and the long tails of a plan cut for it) on the
		// wgmma mainloop first (one block per SM), then the rest; launched
		// whatever the plan holds, so that a captured run serves every
		// later plan.
		hcfg := cuda.LaunchConfig{
			Grid:   cuda.Dim3{X: uint32(sms), Y: 1, Z: 1},
			Block:  cuda.Dim3{X: prefillSM90Threads, Y: 1, Z: 1},
			Shared: prefillSM90SharedBytes(a.DType, a.HeadDim),
		}
		if err := cuda.Launch(m, ks[2], hcfg, stream, &p); err != nil {
			return err
		}
		p.SkipShared = 1
	}
	cfg := cuda.LaunchConfig{
		Grid:   cuda.Dim3{X: uint32(sms * cascadeBlocksPerSM(a.HeadDim)), Y: 1, Z: 1},
		Block:  cuda.Dim3{X: cascadeThreads, Y: 1, Z: 1},
		Shared: cascadeSharedBytes(a.HeadDim),
	}
	if err := cuda.Launch(m, ks[0], cfg, stream, &p); err != nil {
		return err
	}
	// The merge grid depends on the capacity only (graph capture).
	mrows := int64(maxRows) * int64(a.NumQHeads)
	cfg = cuda.LaunchConfig{
		Grid:  cuda.Dim3{X: uint32(min(ceilDiv64(mrows, cascadeMergeThreads/32), int64(sms)*16)), Y: 1, Z: 1},
		Block: cuda.Dim3{X: cascadeMergeThreads, Y: 1, Z: 1},
	}
	return cuda.Launch(m, ks[1], cfg, stream, &p)
}
