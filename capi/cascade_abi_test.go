package main

import (
	"testing"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// cascadeBatch: 6 sequences of block size 16 sharing a 512-token prompt
// (32 blocks), sequences 0-2 sharing 256 more, each with its own tail.
func cascadeBatch(t *testing.T, maxBatch int32) *cascadeHookArgs {
	const B, cols = 6, 64
	table := make([]int32, B*cols)
	lens := make([]int32, B)
	next := int32(100)
	for s := 0; s < B; s++ {
		for c := 0; c < cols; c++ {
			switch {
			case c < 32:
				table[s*cols+c] = int32(c)
			case c < 48 && s < 3:
				table[s*cols+c] = int32(c + 1000)
			default:
				table[s*cols+c] = next
				next++
			}
		}
		lens[s] = int32(768 + 17*s)
	}
	dev, host, st := hookCascadeWorkspaceSize(maxBatch, 8, 2, 128)
	if st != 0 || dev == 0 || host == 0 {
		t.Fatalf("workspace size: %d %d %s", dev, host, statusName(st))
	}
	return &cascadeHookArgs{structSize: sizeofCascadePlanArgs(), dtype: int32(attn.F16), headDim: 128, qHeads: 8, kvHeads: 2,
		batch: B, maxBatch: maxBatch, blockSize: 16, maxBlocks: cols, stride: cols, table: table, lens: lens,
		seqLensDev: 0x9000, host: make([]int32, host/4), hostBytes: host, workspace: 0x100000, workspaceBytes: dev}
}

// Bad arguments are status codes with messages before any device work.
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
	mod("struct_size small", func(a *cascadeHookArgs) { a.structSize-- }, kverr.StructSize)
	mod("dtype f32", func(a *cascadeHookArgs) { a.dtype = int32(attn.F32) }, kverr.Unsupported)
	mod("head_dim 80", func(a *cascadeHookArgs) { a.headDim = 80 }, kverr.Unsupported)
	mod("flags", func(a *cascadeHookArgs) { a.flags = 4 }, kverr.InvalidArgument)
	mod("heads 8/3", func(a *cascadeHookArgs) { a.kvHeads = 3 }, kverr.InvalidArgument)
	mod("host workspace NULL", func(a *cascadeHookArgs) { a.host = nil }, kverr.NullPointer)
	mod("host workspace small", func(a *cascadeHookArgs) { a.hostBytes -= 4 }, kverr.BufferTooSmall)
	mod("device workspace 0", func(a *cascadeHookArgs) { a.workspace = 0 }, kverr.NullPointer)
	mod("device workspace unaligned", func(a *cascadeHookArgs) { a.workspace += 8 }, kverr.InvalidArgument)
	mod("device workspace small", func(a *cascadeHookArgs) { a.workspaceBytes -= 16 }, kverr.BufferTooSmall)
	mod("seq_lens 0", func(a *cascadeHookArgs) { a.seqLensDev = 0 }, kverr.InvalidArgument)
	mod("host arrays NULL", func(a *cascadeHookArgs) { a.lens = nil }, kverr.NullPointer)
	mod("max_blocks above stride", func(a *cascadeHookArgs) { a.maxBlocks = int32(a.stride) + 1 }, kverr.InvalidArgument)
	mod("batch -1", func(a *cascadeHookArgs) { a.batch = -1 }, kverr.InvalidArgument)
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

// kvp_cascade_update and kvp_paged_cascade on plans made without a device:
// growth within the tails fits, a plan older than its workspaces' latest is
// refused as stale, a plan of another kind or a layer with another block
// size is refused.
func TestCascadeABIUpdateAndStalePlans(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	a := cascadeBatch(t, 8)
	p1, err := hookPlanWithoutDevice(a)
	if err != nil {
		t.Fatal(err)
	}
	if p1.route() != 3 {
		t.Fatalf("route %d, want KVP_ATTN_ROUTE_CASCADE", p1.route())
	}
	if saved, total := p1.saved(); saved != 5*512+2*256 || total == 0 {
		t.Fatalf("saved %d of %d tokens", saved, total)
	}
	lens := append([]int32(nil), a.lens...)
	for i := range lens {
		lens[i] += 10
	}
	fits, st := hookCascadeUpdate(p1, lens, 6)
	if st != 0 || fits != 1 {
		t.Fatalf("growth by 10: fits %d, %s", fits, statusName(st))
	}
	for i := range lens {
		lens[i] += 1000
	}
	if fits, st = hookCascadeUpdate(p1, lens, 6); st != 0 || fits != 0 {
		t.Fatalf("growth by 1010: fits %d, %s", fits, statusName(st))
	}
	_, st = hookCascadeUpdate(p1, lens[:5], 5)
	expect(t, "batch differs", st, kverr.InvalidArgument)
	expect(t, "run with another block size", hookPagedCascade(p1, 32, 64, 0), kverr.InvalidArgument)
	expect(t, "run with a short table", hookPagedCascade(p1, 16, 40, 0), kverr.InvalidArgument)
	expect(t, "run with reserved set", hookPagedCascade(p1, 16, 64, 1), kverr.InvalidArgument)

	// A second plan into the same workspaces makes the first stale.
	if _, err := hookPlanWithoutDevice(a); err != nil {
		t.Fatal(err)
	}
	_, st = hookCascadeUpdate(p1, a.lens, 6)
	expect(t, "stale plan update", st, kverr.InvalidArgument)
	expect(t, "stale plan run", hookPagedCascade(p1, 16, 64, 0), kverr.InvalidArgument)

	p3, _ := hookPlanWithoutDevice(a)
	p3.setKind(1)
	_, st = hookCascadeUpdate(p3, a.lens, 6)
	expect(t, "prefill kind", st, kverr.InvalidArgument)

	// No sharing: the decode route, which always fits.
	b := cascadeBatch(t, 8)
	for i := range b.table {
		b.table[i] = int32(i)
	}
	p4, err := hookPlanWithoutDevice(b)
	if err != nil || p4.route() != 2 {
		t.Fatalf("no sharing: route %d, %v", p4.route(), err)
	}
	if fits, st := hookCascadeUpdate(p4, lens, 6); st != 0 || fits != 1 {
		t.Fatalf("decode route: fits %d, %s", fits, statusName(st))
	}
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
	expect(t, "one byte short", hookCascadePlanSized(a, size-1, 0), kverr.StructSize)
}
