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
	mod("struct_size small", func(a *cascadeHookArgs) { a.structSize = firstCascadePlanArgsSize() - 1 }, kverr.StructSize)
	mod("reserved set", func(a *cascadeHookArgs) { a.reserved = 1 }, kverr.InvalidArgument)
	mod("qo_indptr_host without qo_indptr", func(a *cascadeHookArgs) { a.qo = make([]int32, a.batch+1) }, kverr.InvalidArgument)
	mod("qo_indptr unaligned", func(a *cascadeHookArgs) { a.qo, a.qoDev = make([]int32, a.batch+1), 0x9002 }, kverr.InvalidArgument)
	mod("max_tokens below max_batch", func(a *cascadeHookArgs) { a.maxTokens = a.maxBatch - 1 }, kverr.InvalidArgument)
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
	a.flags = 1 // a batch this small routes to plain decode by the cost model
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

// cascadePrefillBatch: cascadeBatch's 6 sequences, each with 40-90 new
// query tokens at the end of its length (after the shared runs).
func cascadePrefillBatch(t *testing.T, maxBatch, maxTokens int32) *cascadeHookArgs {
	a := cascadeBatch(t, maxBatch)
	a.qo = make([]int32, a.batch+1)
	for s := int32(0); s < a.batch; s++ {
		a.qo[s+1] = a.qo[s] + 40 + 10*s
	}
	dev, host, st := hookCascadePrefillWorkspaceSize(maxBatch, maxTokens, 8, 2, 128)
	if st != 0 {
		t.Fatalf("prefill workspace size: %s", statusName(st))
	}
	a.maxTokens, a.qoDev = maxTokens, 0xa000
	a.host, a.hostBytes, a.workspaceBytes = make([]int32, host/4), host, dev
	return a
}

// Varlen queries: the workspace sizes, plans of prompts sharing a prefix
// (cascade route, rows and longest query in the plan, never absorbed by
// update), plans without sharing (the prefill route), and the run's checks.
func TestCascadeABIPrefill(t *testing.T) {
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

	a := cascadePrefillBatch(t, 8, 4096)
	a.flags = 1 // prompts this short route to the prefill kernel by the cost model
	p, err := hookPlanWithoutDevice(a)
	if err != nil {
		t.Fatal(err)
	}
	if rows, maxQ := p.rows(); p.route() != 3 || rows != a.qo[6] || maxQ != 90 {
		t.Fatalf("prompts sharing a prefix: route %d, rows %d, max_q_len %d", p.route(), rows, maxQ)
	}
	// The 256-token run of sequences 0-2 reaches past their first query
	// tokens: only its whole blocks before them may be shared.
	if saved, _ := p.saved(); saved != 5*512 && saved != 5*512+2*208 {
		t.Fatalf("saved %d tokens", saved)
	}
	if fits, st := hookCascadeUpdate(p, a.lens, 6); st != 0 || fits != 0 {
		t.Fatalf("update of a prefill plan: fits %d, %s", fits, statusName(st))
	}
	expect(t, "run with another block size", hookPagedCascade(p, 32, 64, 0), kverr.InvalidArgument)
	expect(t, "run with a short table", hookPagedCascade(p, 16, 40, 0), kverr.InvalidArgument)

	// Too few query rows in the workspaces for the batch's: refused.
	small := cascadePrefillBatch(t, 8, 100)
	if _, err := hookPlanWithoutDevice(small); kverr.CodeOf(err) != kverr.BufferTooSmall {
		t.Fatalf("rows above max_tokens: %v", err)
	}

	// No sharing: the prefill route.
	b := cascadePrefillBatch(t, 8, 4096)
	for i := range b.table {
		b.table[i] = int32(i)
	}
	pb, err := hookPlanWithoutDevice(b)
	if err != nil || pb.route() != 1 {
		t.Fatalf("no sharing: route %d, %v", pb.route(), err)
	}
	expect(t, "prefill route, another block size", hookPagedCascade(pb, 32, 64, 0), kverr.InvalidArgument)
	if fits, st := hookCascadeUpdate(pb, b.lens, 6); st != 0 || fits != 0 {
		t.Fatalf("update of a prefill-route plan: fits %d, %s", fits, statusName(st))
	}
}
