package main

import (
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

func TestAttnABIArgumentChecks(t *testing.T) {
	lockThread(t)
	good := decodeHookArgs{structSize: sizeofPagedDecodeArgs(), dtype: 2, headDim: 128, batch: 2, qHeads: 8, kvHeads: 2,
		numBlocks: 8, blockSize: 16, maxBlocks: 4, q: 0x1000, k: 0x2000, v: 0x3000, table: 0x4000, lens: 0x5000, out: 0x6000}
	expect(t, "null args", hookPagedDecode(&good, true), kverr.NullPointer)
	mod := func(name string, f func(a *decodeHookArgs), want kverr.Code) {
		t.Helper()
		a := good
		f(&a)
		expect(t, name, hookPagedDecode(&a, false), want)
	}
	mod("struct_size", func(a *decodeHookArgs) { a.structSize-- }, kverr.StructSize)
	mod("dtype 9", func(a *decodeHookArgs) { a.dtype = 9 }, kverr.InvalidArgument)
	mod("head_dim 80", func(a *decodeHookArgs) { a.headDim = 80 }, kverr.Unsupported)
	mod("gqa 8/3", func(a *decodeHookArgs) { a.kvHeads = 3 }, kverr.InvalidArgument)
	mod("out 0", func(a *decodeHookArgs) { a.out = 0 }, kverr.NullPointer)
	mod("q_len 17", func(a *decodeHookArgs) { a.qLen = 17 }, kverr.InvalidArgument)
	mod("q_len -1", func(a *decodeHookArgs) { a.qLen = -1 }, kverr.InvalidArgument)
	mod("q_len 4, workspace for one row per sequence", func(a *decodeHookArgs) {
		a.qLen, a.numSplits, a.workspace, a.workspaceBytes = 4, 2, 0x8000, 2*2*8*129*4
	}, kverr.BufferTooSmall)
	mod("workspace small", func(a *decodeHookArgs) { a.numSplits, a.workspace, a.workspaceBytes = 4, 0x8000, 100 }, kverr.BufferTooSmall)
	mod("workspace_bytes huge", func(a *decodeHookArgs) { a.workspaceBytes = 1 << 63 }, kverr.InvalidArgument)
	mod("sinks misaligned", func(a *decodeHookArgs) { a.sinks = 0x7002 }, kverr.InvalidArgument)

	expect(t, "kv_write struct_size", hookKVWrite(8, 1, 64), kverr.StructSize)
	expect(t, "kv_write dtype", hookKVWrite(sizeofKVWriteArgs(), 0, 64), kverr.InvalidArgument)
	expect(t, "merge 9 states", hookMergeStates(9, 0), kverr.InvalidArgument)
	expect(t, "merge reserved", hookMergeStates(2, 5), kverr.InvalidArgument)

	if cuda.Load() != nil {
		// Valid arguments on a machine without a driver: NO_DEVICE, or
		// UNSUPPORTED from a build without the kernels.
		want := kverr.NoDevice
		if !attn.KernelsBuilt() {
			want = kverr.Unsupported
		}
		expect(t, "decode without driver", hookPagedDecode(&good, false), want)
		expect(t, "kv_write without driver", hookKVWrite(sizeofKVWriteArgs(), 1, 64), want)
		expect(t, "merge without driver", hookMergeStates(2, 0), want)
		_, st := hookNumSplits(1, 128, 4, 32, 8, 4096)
		expect(t, "num_splits without driver", st, want)
		v, st := hookCudaAvailable()
		if st != 0 || v != 0 {
			t.Fatalf("kvp_cuda_available without driver: %d, %s", v, statusName(st))
		}
	}
	_, st := hookNumSplits(1, 128, 4, 32, 7, 4096)
	expect(t, "num_splits gqa", st, kverr.InvalidArgument)
}

func TestAttnABIWorkspaceSize(t *testing.T) {
	lockThread(t)
	n, st := hookWorkspaceSize(8, 32, 128, 4, false)
	if st != 0 || n != 4*4*8*32*129 {
		t.Fatalf("workspace size %d, %s %s", n, statusName(st), lastError())
	}
	_, st = hookWorkspaceSize(8, 32, 128, 4, true)
	expect(t, "null out", st, kverr.NullPointer)
	_, st = hookWorkspaceSize(0, 32, 128, 4, false)
	expect(t, "batch 0", st, kverr.InvalidArgument)
	_, st = hookWorkspaceSize(8, 32, 128, 1000, false)
	expect(t, "1000 splits", st, kverr.InvalidArgument)
}

func TestPrefillABIArgumentChecks(t *testing.T) {
	lockThread(t)
	good := sizeofPrefillPlanArgs()
	qo, kv := []int32{0, 3, 4}, []int32{10, 4}
	_, st := hookPrefillPlan(qo, kv, 1<<20, good-8, 0)
	expect(t, "plan struct_size", st, kverr.StructSize)
	_, st = hookPrefillPlan(qo, kv, 1<<20, good, 1)
	expect(t, "plan reserved", st, kverr.InvalidArgument)
	kind, st := hookPrefillPlan([]int32{0, 3, 2}, kv, 1<<20, good, 0)
	expect(t, "decreasing qo_indptr", st, kverr.InvalidArgument)
	if kind != 0 {
		t.Fatalf("a failed plan wrote kind %d", kind)
	}
	_, st = hookPrefillPlan([]int32{0, 11, 12}, kv, 1<<20, good, 0)
	expect(t, "q_len > kv_len", st, kverr.InvalidArgument)
	_, st = hookPrefillPlan(qo, kv, 48, good, 0)
	expect(t, "workspace small", st, kverr.BufferTooSmall)

	expect(t, "run unplanned", hookPrefillRun(0, false), kverr.InvalidArgument)
	expect(t, "run null plan", hookPrefillRun(1, true), kverr.NullPointer)

	n, st := hookPrefillWorkspaceSize(4, 1000, 32, 8, 128)
	if st != 0 || n == 0 {
		t.Fatalf("prefill workspace size %d, %s %s", n, statusName(st), lastError())
	}
	_, st = hookPrefillWorkspaceSize(4, 1000, 32, 8, 100)
	expect(t, "workspace size head_dim", st, kverr.Unsupported)

	if cuda.Load() != nil {
		want := kverr.NoDevice
		if !attn.KernelsBuilt() {
			want = kverr.Unsupported
		}
		_, st = hookPrefillPlan(qo, kv, 1<<20, good, 0)
		expect(t, "plan without driver", st, want)
		expect(t, "run without driver", hookPrefillRun(1, false), want)
	}
}

// The fields appended in 0.6 (sinks in both args structs, window_size in
// kvp_paged_decode_args) reach core/attn from a struct of this header's
// size; an older struct_size leaves them 0 even when the bytes after it
// hold a value; a size that cuts one is no version's size.
func TestAttnArgsAppendedFields(t *testing.T) {
	lockThread(t)
	const sinks, window = 0x7000, 77
	d, p, w, err := hookAppendedOf(sizeofPagedDecodeArgs(), sizeofPagedPrefillArgs(), sinks, window)
	if err != nil || d != sinks || p != sinks || w != window {
		t.Fatalf("whole structs: sinks decoded as %#x and %#x, window_size %d (%v); want %#x, %d", d, p, w, err, sinks, window)
	}
	od, op := sizeofThroughKV()
	if od+16 != sizeofPagedDecodeArgs() || op+8 != sizeofPagedPrefillArgs() || sizeofDecodeThroughSinks() != od+8 {
		t.Fatalf("sinks (and window_size) are not the last fields: sizes %d, %d through kv; %d, %d whole", od, op, sizeofPagedDecodeArgs(), sizeofPagedPrefillArgs())
	}
	d, p, w, err = hookAppendedOf(od, op, sinks, window)
	if err != nil || d != 0 || p != 0 || w != 0 {
		t.Fatalf("0.5 struct_size: sinks decoded as %#x and %#x, window_size %d (%v); want 0", d, p, w, err)
	}
	d, _, w, err = hookAppendedOf(od+8, op, sinks, window)
	if err != nil || d != sinks || w != 0 {
		t.Fatalf("struct_size through sinks: sinks %#x, window_size %d (%v); want %#x, 0", d, w, err, sinks)
	}
	for _, cut := range []uintptr{od + 12, od + 15} {
		if _, _, _, err := hookAppendedOf(cut, op, sinks, window); kverr.CodeOf(err) != kverr.StructSize {
			t.Errorf("struct_size %d, inside window_size's 8 bytes: %v; want STRUCT_SIZE", cut, err)
		}
	}
}
