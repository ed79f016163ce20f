package main

import (
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/kvmanager/kvmtest"
)

// sharingHandle is a kvp_manager (block size 16, prefix cache on) holding
// 3 system prompts' worth of sharing: 12 sequences admitted with one of two
// system prompts (544 and 280 tokens), the first group's four with a
// few-shot block after it, and 3 forks of sequence 1; it returns the
// handle, its manager and the batch's ids in a scrambled order.
func sharingHandle(t *testing.T) (unsafe.Pointer, *kvmanager.Manager, []int64) {
	t.Helper()
	m, ids := kvmtest.SharingManager(t)
	h := hookManagerHandle(m)
	t.Cleanup(func() { hookManagerDestroy(h) })
	return h, m, ids
}

// managerArgs are kvp_cascade_plan_args for planning ids from a manager
// into fresh workspaces (fake device addresses; no device is touched by the
// replaced planner), with max_blocks_per_seq cols.
func managerArgs(t *testing.T, n int, cols int32) *cascadeHookArgs {
	dev, host, st := hookCascadeWorkspaceSize(16, 8, 2, 128)
	if st != 0 {
		t.Fatal(statusName(st))
	}
	return &cascadeHookArgs{structSize: sizeofCascadePlanArgs(), dtype: int32(attn.F16), headDim: 128, qHeads: 8, kvHeads: 2,
		maxBatch: 16, maxBlocks: cols, seqLensDev: 0x9000, host: make([]int32, host/4), hostBytes: host,
		workspace: 0x100000, workspaceBytes: dev}
}

// kvp_manager_cascade_plan is the manager's gather (CascadeInput) and
// core/attn.PlanCascadeInput (whose plans are tested there) over the
// decoded args: the host-only plan it
// writes is the core's plan of the same manager and args, encoded, with or
// without varlen queries; it names no workspace, so the update and run
// exports refuse it.
func TestManagerCascadePlanTranslation(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	h, m, ids := sharingHandle(t)
	n := int32(len(ids))
	qo := make([]int32, n+1)
	for i := range ids {
		qo[i+1] = qo[i] + 1 + int32(i%3)
	}
	for _, q := range [][]int32{nil, qo} {
		for _, flags := range []int32{0, 1} {
			a := managerArgs(t, len(ids), 64)
			a.flags, a.qo = flags, q
			a.host, a.hostBytes, a.workspace, a.workspaceBytes, a.seqLensDev = nil, 0, 0, 0, 0
			got, st := hookManagerCascadePlan(h, ids, n, a, nil, false, false)
			if st != 0 {
				t.Fatalf("%s %s", statusName(st), lastError())
			}
			core := attn.CascadePlanArgs{DType: attn.F16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2, MaxBatch: 16,
				MaxBlocksPerSeq: 64, Flags: int(flags), QOIndptr: q}
			var in cascade.Input
			if err := m.CascadeInput(ids, 64, &in, new(kvmanager.CascadeScratch)); err != nil {
				t.Fatal(err)
			}
			p, err := attn.PlanCascadeInput(&core, &in, 0)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := hookPlanStruct(&p)
			if got.fields() != want.fields() {
				t.Fatalf("qo %v flags %d: the export wrote\n%+v\nthe core planned\n%+v", q != nil, flags, got.fields(), want.fields())
			}
			if f := got.fields(); f.Batch != n || f.Reserved[4] != uint64(p.SavedTokens) || f.Reserved[4] == 0 || f.Reserved[0] != 0 {
				t.Fatalf("qo %v flags %d: %+v", q != nil, flags, f)
			}
			_, st = hookCascadeUpdate(got, make([]int32, n), n)
			expect(t, "update of a host-only plan", st, kverr.InvalidArgument)
			expect(t, "run of a host-only plan", hookPagedCascade(got, 16, 64, 0), kverr.InvalidArgument)
		}
	}
	// An empty batch (seq_ids NULL) plans on the decode route.
	a := managerArgs(t, 0, 8)
	a.host, a.hostBytes, a.workspace, a.workspaceBytes = nil, 0, 0, 0
	p, st := hookManagerCascadePlan(h, nil, 0, a, nil, false, false)
	if st != 0 || p.fields().Batch != 0 || p.route() != 2 {
		t.Fatalf("empty batch: %s %+v", statusName(st), p.fields())
	}
}

// Bad arguments are status codes with messages that name the call, and a
// failed call leaves the plan struct and the workspaces as they were: the
// handle and the struct rules are the export's, a check of the core comes
// through with its code.
func TestManagerCascadePlanErrors(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	h, _, ids := sharingHandle(t)
	n := int32(len(ids))
	prev := hookPlanSentinel()
	try := func(name string, hnd unsafe.Pointer, ids []int64, n int32, a *cascadeHookArgs, nullArgs, nullPlan bool, want kverr.Code) {
		t.Helper()
		ws := slices.Clone(a.host)
		p, st := hookManagerCascadePlan(hnd, ids, n, a, prev, nullArgs, nullPlan)
		expect(t, name, st, want)
		if want == kverr.InvalidHandle {
			return
		}
		if msg := lastError(); !strings.HasPrefix(msg, "kvp_manager_cascade_plan: ") && !strings.HasPrefix(msg, "kvp_cascade_plan_args") && !strings.HasPrefix(msg, "kvp_attn_plan") {
			t.Errorf("%s: message %q does not name the call", name, msg)
		}
		if p.fields() != prev.fields() {
			t.Errorf("%s: a failed call wrote the plan", name)
		}
		if !slices.Equal(ws, a.host) {
			t.Errorf("%s: a failed call wrote the host workspace", name)
		}
	}
	good := func() *cascadeHookArgs { return managerArgs(t, len(ids), 64) }
	try("NULL handle", nil, ids, n, good(), false, false, kverr.InvalidHandle)
	try("NULL args", h, ids, n, good(), true, false, kverr.NullPointer)
	try("NULL plan", h, ids, n, good(), false, true, kverr.NullPointer)
	try("NULL ids", h, nil, n, good(), false, false, kverr.NullPointer)
	try("n -1", h, ids, -1, good(), false, false, kverr.InvalidArgument)
	try("n 65536", h, ids, 65536, good(), false, false, kverr.InvalidArgument)
	batch := good()
	batch.batch = n - 1
	try("batch differs", h, ids, n, batch, false, false, kverr.InvalidArgument)
	try("unknown id", h, append(slices.Clone(ids), 999), n+1, good(), false, false, kverr.UnknownSequence)
	for _, hostOnly := range []bool{false, true} {
		mod := func(name string, f func(a *cascadeHookArgs), want kverr.Code) {
			t.Helper()
			a := good()
			f(a)
			if hostOnly {
				a.host, a.hostBytes, a.workspace, a.workspaceBytes = nil, 0, 0, 0
				name += " (host only)"
			}
			try(name, h, ids, n, a, false, false, want)
		}
		mod("struct_size below the first release", func(a *cascadeHookArgs) { a.structSize = firstCascadePlanArgsSize() - 1 }, kverr.StructSize)
		mod("reserved set", func(a *cascadeHookArgs) { a.reserved = 1 }, kverr.InvalidArgument)
		mod("host table given", func(a *cascadeHookArgs) { a.table = []int32{1} }, kverr.InvalidArgument)
		mod("host lengths given", func(a *cascadeHookArgs) { a.lens = []int32{1} }, kverr.InvalidArgument)
		mod("dtype f32", func(a *cascadeHookArgs) { a.dtype = int32(attn.F32) }, kverr.Unsupported)
		mod("table too narrow", func(a *cascadeHookArgs) { a.maxBlocks = 8 }, kverr.BufferTooSmall)
	}
	// A wrong handle type.
	_, st := hookManagerCascadePlan(unsafe.Pointer(prev), ids, n, good(), nil, false, false)
	expect(t, "foreign pointer", st, kverr.InvalidHandle)
}
