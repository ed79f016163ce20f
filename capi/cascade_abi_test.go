package main

import (
	"reflect"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade/cascadetest"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// cascadeBatch is cascadetest.SharedPrefixBatch with workspaces for maxBatch.
func cascadeBatch(t *testing.T, maxBatch int32) *cascadeHookArgs {
	table, lens, B, cols := cascadetest.SharedPrefixBatch()
	dev, host, st := hookCascadeWorkspaceSize(maxBatch, 8, 2, 128)
	if st != 0 || dev == 0 || host == 0 {
		t.Fatalf("workspace size: %d %d %s", dev, host, statusName(st))
	}
	return &cascadeHookArgs{structSize: sizeofCascadePlanArgs(), dtype: int32(attn.F16), headDim: 128, qHeads: 8, kvHeads: 2,
		batch: int32(B), maxBatch: maxBatch, blockSize: 16, maxBlocks: int32(cols), stride: int64(cols), table: table, lens: lens,
		seqLensDev: 0x9000, host: make([]int32, host/4), hostBytes: host, workspace: 0x100000, workspaceBytes: dev}
}

// Bad arguments are status codes with messages before any device work: the
// checks are core/attn's (tested there); here, each field of the C
// struct reaches its check, and the struct's own rules (NULL, struct_size,
// reserved) are the export's.
func TestCascadeABIArgumentChecks(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	good := cascadeBatch(t, 8)
	_, st := hookCascadePlan(good, true)
	expect(t, "null args", st, kverr.NullPointer)
	mod := func(name string, f func(a *cascadeHookArgs), want kverr.Code) {
		a := *good
		f(&a)
		_, st := hookCascadePlan(&a, false)
		expect(t, name, st, want)
	}
	mod("struct_size small", func(a *cascadeHookArgs) { a.structSize = firstCascadePlanArgsSize() - 1 }, kverr.StructSize)
	mod("reserved set", func(a *cascadeHookArgs) { a.reserved = 1 }, kverr.InvalidArgument)
	mod("qo_indptr_host without qo_indptr", func(a *cascadeHookArgs) { a.qo = make([]int32, a.batch+1) }, kverr.InvalidArgument)
	mod("qo_indptr unaligned", func(a *cascadeHookArgs) { a.qo, a.qoDev = make([]int32, a.batch+1), 0x9002 }, kverr.InvalidArgument)
	mod("max_tokens below max_batch", func(a *cascadeHookArgs) { a.maxTokens = a.maxBatch - 1 }, kverr.InvalidArgument)
	mod("dtype f32", func(a *cascadeHookArgs) { a.dtype = int32(attn.F32) }, kverr.Unsupported)
	mod("head_dim 80", func(a *cascadeHookArgs) { a.headDim = 80 }, kverr.Unsupported)
	mod("flags", func(a *cascadeHookArgs) { a.flags = 2 }, kverr.InvalidArgument)
	mod("heads 8/3", func(a *cascadeHookArgs) { a.kvHeads = 3 }, kverr.InvalidArgument)
	mod("host workspace NULL", func(a *cascadeHookArgs) { a.host = nil }, kverr.NullPointer)
	mod("host workspace small", func(a *cascadeHookArgs) { a.hostBytes -= 4 }, kverr.BufferTooSmall)
	mod("device workspace 0", func(a *cascadeHookArgs) { a.workspace = 0 }, kverr.NullPointer)
	mod("device workspace small", func(a *cascadeHookArgs) { a.workspaceBytes -= 16 }, kverr.BufferTooSmall)
	mod("seq_lens 0", func(a *cascadeHookArgs) { a.seqLensDev = 0 }, kverr.InvalidArgument)
	mod("host arrays NULL", func(a *cascadeHookArgs) { a.lens = nil }, kverr.NullPointer)
	mod("max_blocks above stride", func(a *cascadeHookArgs) { a.maxBlocks = int32(a.stride) + 1 }, kverr.InvalidArgument)
	mod("batch -1", func(a *cascadeHookArgs) { a.batch = -1 }, kverr.InvalidArgument)
	mod("batch above KVP_MAX_ATTN_BATCH", func(a *cascadeHookArgs) { a.batch = limits.AttnBatch + 1 }, kverr.InvalidArgument)
	mod("stride 2^31", func(a *cascadeHookArgs) { a.stride = 1 << 31 }, kverr.InvalidArgument)
	mod("host workspace bytes above KVP_MAX_BYTES", func(a *cascadeHookArgs) { a.hostBytes = limits.Bytes + 1 }, kverr.InvalidArgument)
	mod("device workspace bytes above KVP_MAX_BYTES", func(a *cascadeHookArgs) { a.workspaceBytes = limits.Bytes + 1 }, kverr.InvalidArgument)
	_, _, st = hookCascadeWorkspaceSize(0, 8, 2, 128)
	expect(t, "workspace size max_batch 0", st, kverr.InvalidArgument)
	if cuda.Load() != nil {
		want := kverr.NoDevice
		if !attn.KernelsBuilt() {
			want = kverr.Unsupported
		}
		_, st := hookCascadePlan(good, false)
		expect(t, "plan without driver", st, want)
	}
}

// A plan's kvp_attn_plan is core/attn's cascade plan field for field, the
// plan-state words where the header documents them; kvp_cascade_update and
// kvp_paged_cascade decode it back to the same plan, and their own struct
// rules refuse before the core is reached (the plans' logic is tested in
// core/attn).
func TestCascadeABIPlanTranslation(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	host := make([]byte, 32)
	want := attn.CascadePlan{
		PrefillPlan: attn.PrefillPlan{Kind: attn.KindCascade, Route: 3,
			PrefillShape: attn.PrefillShape{DType: attn.BF16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2, WindowLeft: -1},
			Batch:        6, TotalQ: 300, MaxQLen: 90, MaxKVLen: 900, NumItems: 40, Grid: 264, NumSplits: 0,
			Workspace: 0x100000, WorkspaceBytes: 1 << 20, KVLens: 0x9000},
		CascadeState: attn.CascadeState{HostWorkspace: host, MaxBatch: 8, BlockSize: 16,
			Parts: 30, Gen: 5, SavedTokens: 3072, TotalTokens: 5000},
	}
	p, st := hookPlanStruct(&want)
	if st != 0 {
		t.Fatal(statusName(st))
	}
	f := p.fields()
	if f.Kind != 2 || f.Route != 3 || f.Batch != 6 || f.TotalQ != 300 || f.MaxQ != 90 || f.MaxKV != 900 || f.Items != 40 || f.Grid != 264 ||
		f.Workspace != 0x100000 || f.WorkspaceBytes != 1<<20 || f.KVLens != 0x9000 {
		t.Fatalf("fields %+v", f)
	}
	if f.Reserved != [6]uint64{uint64(uintptr(unsafe.Pointer(&host[0]))), 32, 8 | 16<<32, 30 | 5<<32, 3072, 5000} {
		t.Fatalf("plan-state words %#x", f.Reserved)
	}
	got, err := p.plan()
	if err != nil || !reflect.DeepEqual(got, want) || unsafe.SliceData(got.HostWorkspace) != &host[0] {
		t.Fatalf("decoded %+v (%v), want %+v", got, err, want)
	}
	for name, w := range planStateWords {
		if w[0] != w[1] {
			t.Errorf("%s is %d in the header, word %d in core/attn", name, w[0], w[1])
		}
	}
	// Every field of the state, at the edges of its word.
	s := attn.CascadeState{HostWorkspace: host[:16], MaxBatch: 65535, BlockSize: 32, Parts: 9, Gen: -2, SavedTokens: 1 << 40, TotalTokens: 3}
	w, sback := hookCascadeStateRoundTrip(&s)
	if w != [6]uint64{uint64(uintptr(unsafe.Pointer(&host[0]))), 16, 65535 | 32<<32, 9 | uint64(uint32(0xfffffffe))<<32, 1 << 40, 3} {
		t.Fatalf("words %#x", w)
	}
	if !reflect.DeepEqual(sback, s) || unsafe.SliceData(sback.HostWorkspace) != &host[0] {
		t.Fatalf("state %+v, want %+v", sback, s)
	}

	// A prefill plan's state is its mainloop.
	pp := want.PrefillPlan
	pp.Kind, pp.Mainloop = attn.KindPrefill, attn.MainloopSM90
	words, back, err := hookPrefillPlanRoundTrip(&pp)
	if err != nil || back != pp || words != [6]uint64{attn.MainloopSM90} {
		t.Fatalf("prefill plan: words %v, read back %+v (%v), want %+v", words, back, err, pp)
	}

	// The exports' own refusals.
	sentinel := hookPlanSentinel()
	expect(t, "run with reserved set", hookPagedCascade(sentinel, 16, 64, 1), kverr.InvalidArgument)
	_, st = hookCascadeUpdate(sentinel, nil, 3)
	expect(t, "update with NULL lengths", st, kverr.NullPointer)
	// A plan of another kind reaches the core's check through the struct.
	sentinel.setKind(1)
	_, st = hookCascadeUpdate(sentinel, make([]int32, 99), 99)
	expect(t, "update of a prefill plan", st, kverr.InvalidArgument)
	expect(t, "run of a prefill plan", hookPagedCascade(sentinel, 16, 64, 0), kverr.InvalidArgument)
}

// The struct-evolution rule: a newer header's larger kvp_cascade_plan_args
// is read when its extra bytes are 0 (the call reaches the dtype check) and
// refused when one is set.
func TestCascadeABIStructVersions(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	a := cascadeBatch(t, 8)
	a.dtype = int32(attn.F32)
	size := sizeofCascadePlanArgs()
	expect(t, "newer header, new fields 0", hookCascadePlanSized(a, size+32, 0), kverr.Unsupported)
	expect(t, "newer header, a new field set", hookCascadePlanSized(a, size+32, 1), kverr.StructSize)
	expect(t, "this library's size", hookCascadePlanSized(a, size, 1), kverr.Unsupported)
	expect(t, "one byte short of this library's size", hookCascadePlanSized(a, size-1, 0), kverr.Unsupported)
	first := firstCascadePlanArgsSize()
	expect(t, "the first released size", hookCascadePlanSized(a, first, 0), kverr.Unsupported)
	expect(t, "one byte short of the first released size", hookCascadePlanSized(a, first-1, 0), kverr.StructSize)

	// A host of the first release passes 112 bytes: the appended fields
	// (qo_indptr_host, qo_indptr, max_tokens, reserved) take their defaults
	// whatever lies past them, so its garbage there is no varlen request.
	if first != 112 {
		t.Fatalf("kvp_cascade_plan_args's first released size is %d; the header says 112", first)
	}
	b := cascadeBatch(t, 8)
	b.structSize = first
	b.qo, b.reserved = make([]int32, b.batch+1), 9 // read: INVALID_ARGUMENT; ignored: the device is reached
	_, st := hookCascadePlan(b, false)
	if kverr.Code(st) == kverr.InvalidArgument || kverr.Code(st) == kverr.StructSize {
		t.Fatalf("first-release struct: the appended fields were read: %s", statusName(st))
	}
}

// The workspace sizes of varlen batches: max_tokens = max_batch is the
// decode size, more query rows need more, fewer than max_batch are refused.
func TestCascadeABIPrefillWorkspaceSize(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	dd, dh, st := hookCascadeWorkspaceSize(8, 8, 2, 128)
	pd, ph, st2 := hookCascadePrefillWorkspaceSize(8, 8, 8, 2, 128)
	if st != 0 || st2 != 0 || dd != pd || dh != ph {
		t.Fatalf("max_tokens = max_batch: %d/%d vs %d/%d (%s %s)", pd, ph, dd, dh, statusName(st), statusName(st2))
	}
	if bd, bh, st := hookCascadePrefillWorkspaceSize(8, 4096, 8, 2, 128); st != 0 || bd <= dd || bh <= dh {
		t.Fatalf("max_tokens 4096: %d/%d (%s)", bd, bh, statusName(st))
	}
	_, _, st = hookCascadePrefillWorkspaceSize(8, 7, 8, 2, 128)
	expect(t, "max_tokens below max_batch", st, kverr.InvalidArgument)
}

// Host arrays and sizes no caller memory can have: an array that would run
// past the end of the address space, a host workspace size of 2^62 bytes.
// Each is refused with a status (or planned over the bytes that exist),
// never a recovered panic.
func TestCascadePlanImpossibleHostMemory(t *testing.T) {
	lockThread(t)
	const name = "kvp_cascade_plan_args"
	l := cLayouts[name]
	args, plan := newCBuf(int(l.size)), newCBuf(int(cLayouts["kvp_attn_plan"].size))
	defer args.free()
	defer plan.free()
	lens, ws := cInt32s([]int32{40, 40}), newCBuf(1<<16)
	defer lens.free()
	defer ws.free()
	table := cInt32s([]int32{0, 1, 2, 3, 4, 5})
	defer table.free()
	reset := func() {
		clear(unsafe.Slice((*byte)(args.p), l.size))
		clear(unsafe.Slice((*byte)(plan.p), cLayouts["kvp_attn_plan"].size))
		*(*uintptr)(plan.p) = cLayouts["kvp_attn_plan"].size
		for f, v := range map[string]int64{"struct_size": int64(l.size), "dtype": 1, "head_dim": 128, "num_q_heads": 8,
			"num_kv_heads": 2, "batch": 2, "block_size": 16, "max_blocks_per_seq": 3,
			"block_table_host": int64(uintptr(table.p)), "seq_lens_host": int64(uintptr(lens.p)),
			"host_workspace": int64(uintptr(ws.p)), "host_workspace_bytes": 1 << 16} {
			setField(args.p, name, f, v)
		}
	}
	const top = -5 // the address 2^64 - 5: one int32 fits before the end, two do not
	for _, c := range []struct {
		field string
		v     int64
		want  kverr.Code
	}{
		{"qo_indptr_host", top, kverr.InvalidArgument},
		{"seq_lens_host", top, kverr.InvalidArgument},
		{"block_table_host", top, kverr.InvalidArgument},
		{"host_workspace_bytes", 1 << 62, 0},
	} {
		reset()
		setField(args.p, name, c.field, c.v)
		st := rawCascadePlan(args.p, plan.p)
		if st == int(kverr.Internal) || (c.want != 0 && st != int(c.want)) {
			t.Errorf("%s = %#x: status %d (%s), want %v", c.field, c.v, st, lastError(), c.want)
		}
	}
}
