package attn

import (
	"runtime"
	"strconv"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kimage"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/kernels"
)

// image is the library's one kernel image (shared with the tier copy).
var image = kimage.Image

// kernelSet is the kernels of one (dtype, head_dim) instantiation.
type kernelSet struct {
	write, decode, combine, merge, prefill *cuda.Kernel
	prefillSM90                            *cuda.Kernel // nil for f32
	writeE4M3, decodeE4M3, prefillE4M3     *cuda.Kernel // over an e4m3 cache; nil for f32
	prefillSM90E4M3                        *cuda.Kernel // the Hopper mainloop over an e4m3 cache; nil for f32
	prefillSM90FP8                         *cuda.Kernel // FP8 Q/K/V on the Hopper mainloop; head_dim 128 only
}

// prefillPlanKernel writes a prefill plan's work list (one kernel for every
// dtype and head_dim).
var prefillPlanKernel = image.Kernel("kvp_prefill_plan")

var headDims = [...]int{64, 128, 256}

// kernelTable[dtype-1][head_dim index]
var kernelTable = func() (t [3][len(headDims)]kernelSet) {
	for di, d := range []DType{F16, BF16, F32} {
		for hi, h := range headDims {
			suffix := "_" + d.String() + "_h" + strconv.Itoa(h)
			t[di][hi] = kernelSet{
				write:   image.Kernel("kvp_kv_write" + suffix),
				decode:  image.Kernel("kvp_paged_decode" + suffix),
				combine: image.Kernel("kvp_paged_decode_combine" + suffix),
				merge:   image.Kernel("kvp_merge_states" + suffix),
				prefill: image.Kernel("kvp_paged_prefill" + suffix),
			}
			if d.Size() == 2 {
				t[di][hi].prefillSM90 = image.Kernel("kvp_paged_prefill_sm90" + suffix)
				e4m3 := "_" + d.String() + "_e4m3_h" + strconv.Itoa(h)
				t[di][hi].writeE4M3 = image.Kernel("kvp_kv_write" + e4m3)
				t[di][hi].decodeE4M3 = image.Kernel("kvp_paged_decode" + e4m3)
				t[di][hi].prefillE4M3 = image.Kernel("kvp_paged_prefill" + e4m3)
				t[di][hi].prefillSM90E4M3 = image.Kernel("kvp_paged_prefill_sm90" + e4m3)
				if h == fp8QKVHeadDim {
					t[di][hi].prefillSM90FP8 = image.Kernel("kvp_paged_prefill_sm90_" + d.String() + "_e4m3_qkv_h" + strconv.Itoa(h))
				}
			}
		}
	}
	return t
}()

func kernelsFor(d DType, headDim int) *kernelSet {
	hi := 0
	for i, h := range headDims {
		if h == headDim {
			hi = i
		}
	}
	return &kernelTable[d-1][hi]
}

// KVWriteArgs is a KV write on device memory: key and value (dtype) per
// KVWriteLayout, the caches, and slot_mapping (int32 [num_tokens]).
type KVWriteArgs struct {
	KVWriteLayout           // with the caches' pointers
	Key, Value, SlotMapping cuda.DevicePtr
}

// PagedDecodeArgs is a paged decode launch on device memory.
type PagedDecodeArgs struct {
	DecodeLayout // with the caches' and the block table's pointers
	Q            cuda.DevicePtr
	SeqLens      cuda.DevicePtr // int32 [batch]
	Out          cuda.DevicePtr
	LSE          cuda.DevicePtr // float32 [batch, num_q_heads]; 0: not wanted
	// Sinks is the attention sinks, float32 [num_q_heads] (one natural-log
	// logit per q head, added to the softmax denominator only), or 0 for
	// none; lse is then the log of the whole denominator.
	Sinks cuda.DevicePtr

	// Workspace for split-KV partial results: float32, 16-byte aligned,
	// WorkspaceSize(batch, num_q_heads, head_dim, splits) bytes. 0 allowed
	// when only one split runs.
	Workspace      cuda.DevicePtr
	WorkspaceBytes int64

	// NumSplits: 0 lets Plan choose (within what the workspace holds); n >= 1
	// forces n chunks per sequence.
	NumSplits int
	// MaxSeqLen bounds seq_lens for the split heuristic (the host cannot read
	// the device's seq_lens without a sync); 0 means max_blocks_per_seq *
	// block_size.
	MaxSeqLen int
	// WindowSize: 0, no window; w > 0, the new token at position pos sees
	// only positions [pos - w + 1, pos] (a sliding-window layer); table
	// entries before every new token's window may be -1 (skipped or masked).
	WindowSize int
}

// windowLeft is the kernels' form of the window: -1 for none.
func (a *PagedDecodeArgs) windowLeft() int { return a.WindowSize - 1 }

// decodeReadLen is the most tokens the decode kernel reads of one sequence
// of at most maxLen tokens, for the choice of splits: maxLen, or with a
// window of windowSize the window of each of qLen new tokens plus the part
// of the tile that the first of them falls in.
func decodeReadLen(maxLen, windowSize, qLen int) int {
	if windowSize <= 0 {
		return maxLen
	}
	return min(maxLen, windowSize+max(qLen, 1)-1+decodeTile)
}

// MergeArgs merges NumStates states on device memory: V[i] (dtype) and S[i]
// (float32 lse) for i < NumStates, into Out and, when non-zero, OutLSE.
type MergeArgs struct {
	MergeLayout
	V, S        [maxMergeStates]cuda.DevicePtr
	Out, OutLSE cuda.DevicePtr
}

// MaxMergeStates is the most states one MergeStates call merges.
const MaxMergeStates = maxMergeStates

func nonNull(what string, ptrs ...cuda.DevicePtr) error {
	for _, p := range ptrs {
		if p == 0 {
			return kverr.Errorf(kverr.NullPointer, "%s must not be 0", what)
		}
	}
	return nil
}

func aligned(what string, align uint64, p cuda.DevicePtr) error {
	if uint64(p)%align != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "%s must be %d-byte aligned: got %#x", what, align, uint64(p))
	}
	return nil
}

// checkTensor: non-null and 16-byte aligned (the kernels' vector rule).
func checkTensor(what string, p cuda.DevicePtr) error {
	if err := nonNull(what, p); err != nil {
		return err
	}
	return aligned(what, 16, p)
}

// checkIndex: non-null and 4-byte aligned (int32 and float32 arrays).
func checkIndex(what string, p cuda.DevicePtr) error {
	if err := nonNull(what, p); err != nil {
		return err
	}
	return aligned(what, 4, p)
}

// errNoKernels is the answer of every launch in a build without the fatbin.
// It is checked before the device, so a machine with neither a GPU nor the
// kernels is told what its build lacks.
func errNoKernels(what string) error {
	return kverr.Errorf(kverr.Unsupported,
		"%s: this kvplug library was built without its CUDA kernels (no kernels/%s at build time, or KERNELS=off); "+
			"rebuild it with `make` in a kvplug checkout, which compiles them with nvcc "+
			"(fetched from PyPI into .tools/cuda when the machine has none)", what, kernels.FatbinPath)
}

// kernelsBuilt reports whether this build carries the CUDA kernels; a
// variable so that tests can take the kernels away.
var kernelsBuilt = kernels.Built

// KernelsBuilt reports whether this build carries the CUDA kernels.
func KernelsBuilt() bool { return kernelsBuilt() }

// module returns the kernels' module in the calling thread's context. The
// caller has locked its OS thread.
func module(what string) (*cuda.Module, error) {
	if !kernelsBuilt() {
		return nil, errNoKernels(what)
	}
	return image.Module()
}

// KVWrite scatters this step's K and V into the paged caches on stream.
func KVWrite(a *KVWriteArgs, stream cuda.Stream) error {
	if _, err := a.validate(); err != nil {
		return err
	}
	if a.NumTokens > 0 {
		if err := firstErr(
			checkTensor("kv_write: key", a.Key),
			checkTensor("kv_write: value", a.Value),
			a.PagedKV.checkPointers("kv_write", false),
			checkIndex("kv_write: slot_mapping", a.SlotMapping),
			a.PagedKV.checkWrittenApart("kv_write"),
		); err != nil {
			return err
		}
	}
	vec := int64(16 / a.DType.Size())
	blocks := ceilDiv64(int64(a.NumTokens)*int64(a.NumKVHeads)*int64(a.HeadDim)/vec, kvWriteThreads)
	if blocks > 1<<31-1 {
		return kverr.Errorf(kverr.InvalidArgument, "kv_write: %d tokens of %d heads need more than 2^31 blocks; write them in parts", a.NumTokens, a.NumKVHeads)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("kv_write")
	if err != nil || a.NumTokens == 0 {
		return err
	}
	p := kvWriteParams{
		KV:  a.PagedKV.params(a.DType, a.NumKVHeads),
		Key: uint64(a.Key), Value: uint64(a.Value), SlotMapping: uint64(a.SlotMapping),
		KeyTokenStride: a.KeyTokenStride, KeyHeadStride: a.KeyHeadStride,
		ValueTokenStride: a.ValueTokenStride, ValueHeadStride: a.ValueHeadStride,
		NumTokens: int32(a.NumTokens),
	}
	cfg := cuda.LaunchConfig{Grid: cuda.Dim3{X: uint32(blocks), Y: 1, Z: 1}, Block: cuda.Dim3{X: kvWriteThreads, Y: 1, Z: 1}}
	ks := kernelsFor(a.DType, a.HeadDim)
	k := ks.write
	if a.E4M3() {
		k = ks.writeE4M3 // same grid: a thread per 8 elements
	}
	return cuda.Launch(m, k, cfg, stream, &p)
}

// PagedDecode runs decode attention over the paged caches on stream: one
// launch, or with split-KV a partial launch and a combine launch.
func PagedDecode(a *PagedDecodeArgs, stream cuda.Stream) error {
	if _, err := a.validate(); err != nil {
		return err
	}
	if err := inRange("paged_decode: num_splits", a.NumSplits, 0, MaxSplits); err != nil {
		return err
	}
	if a.MaxSeqLen < 0 {
		return kverr.Errorf(kverr.InvalidArgument, "paged_decode: max_seq_len must not be negative: got %d", a.MaxSeqLen)
	}
	if err := inRange("paged_decode: window_size", a.WindowSize, 0, maxPrefillTokens); err != nil {
		return err
	}
	if a.WorkspaceBytes < 0 {
		return kverr.Errorf(kverr.InvalidArgument, "paged_decode: workspace_bytes must not be negative: got %d", a.WorkspaceBytes)
	}
	if a.Batch > 0 {
		if err := firstErr(
			checkTensor("paged_decode: q", a.Q),
			a.PagedKV.checkPointers("paged_decode", true),
			checkIndex("paged_decode: seq_lens", a.SeqLens),
			checkTensor("paged_decode: out", a.Out),
			aligned("paged_decode: lse", 4, a.LSE),
			aligned("paged_decode: sinks", 4, a.Sinks),
			aligned("paged_decode: workspace", 16, a.Workspace),
		); err != nil {
			return err
		}
	}
	if a.NumSplits > 1 {
		if err := a.checkWorkspace(a.NumSplits); err != nil {
			return err
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("paged_decode")
	if err != nil || a.Batch == 0 {
		return err
	}
	splits := a.NumSplits
	if splits == 0 {
		maxLen := a.MaxSeqLen
		if maxLen == 0 {
			maxLen = a.MaxBlocksPerSeq * a.BlockSize
		}
		splits = decodeSplits(m.Device().SMs, a.DType, a.HeadDim, a.Batch, a.NumQHeads, a.NumKVHeads, decodeReadLen(maxLen, a.WindowSize, a.QLen), a.QLen, a.E4M3())
		// Never more splits than the workspace holds (none without one).
		splits = fitSplits(splits, a.Workspace, a.WorkspaceBytes, a.Rows(), a.NumQHeads, a.HeadDim)
	}
	return a.launch(m, splits, 0, 0, stream)
}

// launch runs the decode kernel (and with splits > 1 the combine) of a
// checked a on stream. qIndptr != 0 (q_len 1): sequence b's row of q and
// out is qIndptr[b] (below qRows), and sequences of another query count are
// skipped.
func (a *PagedDecodeArgs) launch(m *cuda.Module, splits int, qIndptr cuda.DevicePtr, qRows int, stream cuda.Stream) error {
	group := a.NumQHeads / a.NumKVHeads
	p := decodeParams{
		KV: a.PagedKV.params(a.DType, a.NumKVHeads),
		Q:  uint64(a.Q), SeqLens: uint64(a.SeqLens),
		Out: uint64(a.Out), LSE: uint64(a.LSE), Workspace: uint64(a.Workspace),
		QBatchStride: a.QBatchStride, QHeadStride: a.QHeadStride,
		OutBatchStride: a.OutBatchStride, OutHeadStride: a.OutHeadStride,
		Batch: int32(a.Batch), NumQHeads: int32(a.NumQHeads),
		NumSplits: int32(splits), Scale: SoftmaxScale(a.Scale, a.HeadDim), QLen: int32(a.qLen()),
		QIndptr: uint64(qIndptr), QRows: int32(qRows), Sinks: uint64(a.Sinks),
		WindowLeft: int32(a.windowLeft()),
	}
	ks := kernelsFor(a.DType, a.HeadDim)
	cfg := cuda.LaunchConfig{
		Grid:   cuda.Dim3{X: uint32(a.NumKVHeads * ceilDiv(group, decodeHeadsPer(a.QLen))), Y: uint32(a.Batch), Z: uint32(splits)},
		Block:  cuda.Dim3{X: decodeThreads, Y: 1, Z: 1},
		Shared: decodeSharedBytes(a.DType, a.HeadDim),
	}
	decode := ks.decode
	if a.E4M3() {
		decode, cfg.Shared = ks.decodeE4M3, decodeSharedBytesE4M3(a.HeadDim)
	}
	if err := cuda.Launch(m, decode, cfg, stream, &p); err != nil || splits == 1 {
		return err
	}
	notePartials(a.Workspace) // its partials now lie where a prefill plan's work list may have
	cfg = cuda.LaunchConfig{
		Grid:  cuda.Dim3{X: uint32(ceilDiv(a.Rows()*a.NumQHeads, combineThreads/32)), Y: 1, Z: 1},
		Block: cuda.Dim3{X: combineThreads, Y: 1, Z: 1},
	}
	return cuda.Launch(m, ks.combine, cfg, stream, &p)
}

func (a *PagedDecodeArgs) checkWorkspace(splits int) error {
	need := workspaceBytes(a.Rows(), a.NumQHeads, a.HeadDim, splits)
	if a.Workspace == 0 {
		return kverr.Errorf(kverr.NullPointer, "paged_decode: %d splits need a workspace of %d bytes; workspace is 0", splits, need)
	}
	if a.WorkspaceBytes < need {
		return kverr.Errorf(kverr.BufferTooSmall, "paged_decode: %d splits of batch %d need a workspace of %d bytes; workspace_bytes is %d", splits, a.Batch, need, a.WorkspaceBytes)
	}
	return nil
}

// MergeStates merges attention states on stream.
func MergeStates(a *MergeArgs, stream cuda.Stream) error {
	if _, err := a.validate(a.OutLSE != 0); err != nil {
		return err
	}
	if a.NumTokens > 0 {
		for i := 0; i < a.NumStates; i++ {
			if err := firstErr(checkTensor("merge_states: v[i]", a.V[i]), checkIndex("merge_states: s[i]", a.S[i])); err != nil {
				return err
			}
		}
		if err := firstErr(checkTensor("merge_states: out", a.Out), aligned("merge_states: out_lse", 4, a.OutLSE)); err != nil {
			return err
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("merge_states")
	if err != nil || a.NumTokens == 0 {
		return err
	}
	p := mergeParams{
		Out: uint64(a.Out), OutLSE: uint64(a.OutLSE),
		VTokenStride: a.VTokenStride, VHeadStride: a.VHeadStride,
		STokenStride: a.STokenStride, SHeadStride: a.SHeadStride,
		OutTokenStride: a.OutTokenStride, OutHeadStride: a.OutHeadStride,
		OutLSETokenStride: a.OutLSETokenStride, OutLSEHeadStride: a.OutLSEHeadStride,
		NumStates: int32(a.NumStates), NumTokens: int32(a.NumTokens), NumHeads: int32(a.NumHeads),
	}
	for i := 0; i < a.NumStates; i++ {
		p.V[i], p.S[i] = uint64(a.V[i]), uint64(a.S[i])
	}
	cfg := cuda.LaunchConfig{
		Grid:  cuda.Dim3{X: uint32(ceilDiv(a.NumTokens*a.NumHeads, mergeThreads/32)), Y: 1, Z: 1},
		Block: cuda.Dim3{X: mergeThreads, Y: 1, Z: 1},
	}
	return cuda.Launch(m, kernelsFor(a.DType, a.HeadDim).merge, cfg, stream, &p)
}

// Prepare loads the kernels into the calling thread's current context (or
// device 0's primary context), resolves every kernel and raises the decode
// kernels' shared-memory limits now, so that launches make no driver call
// but cuLaunchKernel: call it before capturing a CUDA graph. Kernels the
// device cannot run (too little shared memory) are left to report
// UNSUPPORTED when launched.
func Prepare() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := module("attn_prepare")
	if err != nil {
		return err
	}
	for di, d := range []DType{F16, BF16, F32} {
		for hi, h := range headDims {
			ks := &kernelTable[di][hi]
			for _, k := range []*cuda.Kernel{ks.write, ks.combine, ks.merge} {
				if err := m.Prepare(k, 0); err != nil {
					return err
				}
			}
			if err := m.Prepare(ks.decode, decodeSharedBytes(d, h)); err != nil && !kverr.Is(err, kverr.Unsupported) {
				return err
			}
			if ks.writeE4M3 != nil {
				if err := m.Prepare(ks.writeE4M3, 0); err != nil {
					return err
				}
				if err := m.Prepare(ks.decodeE4M3, decodeSharedBytesE4M3(h)); err != nil && !kverr.Is(err, kverr.Unsupported) {
					return err
				}
				if err := m.Prepare(ks.prefillE4M3, prefillSharedBytesE4M3(h)); err != nil && !kverr.Is(err, kverr.Unsupported) {
					return err
				}
			}
			if err := m.Prepare(ks.prefill, prefillSharedBytes(d, h)); err != nil && !kverr.Is(err, kverr.Unsupported) {
				return err
			}
		}
	}
	return m.Prepare(prefillPlanKernel, 0)
}

func ceilDiv64(a, b int64) int64 { return (a + b - 1) / b }
