package main

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// sharingHandle is a kvp_manager (block size 16, prefix cache on) holding
// 3 system prompts' worth of sharing: 12 sequences admitted with one of two
// system prompts (544 and 280 tokens), the first group's four with a
// few-shot block after it, and 3 forks of sequence 1; it returns the
// handle and the batch's ids in a scrambled order.
func sharingHandle(t *testing.T) (unsafe.Pointer, []int64) {
	t.Helper()
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 1024, BlockSize: 16, EnablePrefixCache: true})
	if err != nil {
		t.Fatal(err)
	}
	h := hookManagerHandle(m)
	t.Cleanup(func() { hookManagerDestroy(h) })
	r := rand.New(rand.NewPCG(1, 2))
	toks := func(n int) []int32 {
		v := make([]int32, n)
		for i := range v {
			v[i] = r.Int32N(32000)
		}
		return v
	}
	sys := [][]int32{toks(544), toks(280)}
	shots := toks(160)
	var ids []int64
	for id := int64(1); id <= 12; id++ {
		p := slices.Clone(sys[id%2])
		if id%2 == 0 && id <= 8 {
			p = append(p, shots...)
		}
		p = append(p, toks(int(id)*7)...)
		if _, err := m.Admit([]int64{id}, kvmanager.Prompts{Tokens: p, Offsets: []int64{0, int64(len(p))}}, nil); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if _, err := m.Fork(1, []int64{101, 102, 103}, make([]kvmanager.CopyPair, 3)); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, 101, 102, 103)
	ones := make([]int32, len(ids))
	for i := range ones {
		ones[i] = 1
	}
	if err := m.Grow(ids, ones); err != nil {
		t.Fatal(err)
	}
	r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	return h, ids
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

// describePlan is the plan kvp_cascade_plan makes (without its device
// copy) from the tables kvp_manager_describe writes for the same batch.
func describePlan(t *testing.T, h unsafe.Pointer, ids []int64, a *cascadeHookArgs) (*cascadeHookPlan, []int32) {
	t.Helper()
	n := int32(len(ids))
	idb, table, lens, num := cInt64s(ids), newCBuf(4*int(n)*int(a.maxBlocks)), newCBuf(4*int(n)), newCBuf(4)
	defer func() { idb.free(); table.free(); lens.free(); num.free() }()
	if st := hookManagerDescribe(h, idb, n, table, a.maxBlocks, lens, cbuf{}, 0, num); st != 0 {
		t.Fatalf("describe: %s %s", statusName(st), lastError())
	}
	d := *a
	d.batch, d.blockSize, d.stride = n, 16, int64(a.maxBlocks)
	d.table = slices.Clone(unsafe.Slice((*int32)(table.p), int(n)*int(a.maxBlocks)))
	d.lens = slices.Clone(unsafe.Slice((*int32)(lens.p), int(n)))
	d.host = make([]int32, len(a.host))
	p, err := hookPlanWithoutDevice(&d)
	if err != nil {
		t.Fatal(err)
	}
	return p, d.host
}

// The plan from the manager is kvp_cascade_plan's plan of the described
// tables: the same kvp_attn_plan (but for the host workspace's address) and
// the same host workspace word for word; kvp_cascade_plan is given the
// batch, the manager's block size, the table width and the caller's
// workspaces. The host-only plan (no workspaces) has the same summary and
// cannot be updated or run.
func TestManagerCascadePlanEqualsDescribe(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	h, ids := sharingHandle(t)
	for _, cols := range []int32{64, 200} {
		for _, flags := range []int32{0, 1} {
			a := managerArgs(t, len(ids), cols)
			a.flags = flags
			want, wantWS := describePlan(t, h, ids, a)

			var seen hookCascadeSeen
			restore := hookPlanDeviceWithoutDevice(&seen)
			got, st := hookManagerCascadePlan(h, ids, int32(len(ids)), a, nil, false, false)
			restore()
			if st != 0 {
				t.Fatalf("cols %d: %s %s", cols, statusName(st), lastError())
			}
			if seen.calls != 1 || seen.batch != int32(len(ids)) || seen.blockSize != 16 || seen.mbps != cols || seen.stride != int64(cols) ||
				seen.hostWS != unsafe.Pointer(&a.host[0]) || seen.workspace != a.workspace || seen.seqLens != a.seqLensDev || !seen.tableNonNil || !seen.lensNonNil {
				t.Fatalf("cols %d: kvp_cascade_plan was given %+v", cols, seen)
			}
			gf, wf := got.fields(), want.fields()
			if gf.Reserved[0] != uint64(uintptr(unsafe.Pointer(&a.host[0]))) {
				t.Fatalf("the plan names host workspace %#x", gf.Reserved[0])
			}
			gf.Reserved[0], wf.Reserved[0] = 0, 0
			if gf != wf {
				t.Fatalf("cols %d flags %d: plans differ:\nmanager  %+v\ndescribe %+v", cols, flags, gf, wf)
			}
			if !slices.Equal(a.host, wantWS) {
				t.Fatalf("cols %d flags %d: host workspaces differ", cols, flags)
			}
			if wf.Reserved[4] < 3*544 || (flags == 1 && wf.Route != 3) {
				t.Fatalf("cols %d flags %d: the batch's sharing was not found: %+v", cols, flags, wf)
			}

			// Host only: no workspaces, no device; the same summary.
			ho := *a
			ho.host, ho.hostBytes, ho.workspace, ho.workspaceBytes, ho.seqLensDev = nil, 0, 0, 0, 0
			hp, st := hookManagerCascadePlan(h, ids, int32(len(ids)), &ho, nil, false, false)
			if st != 0 {
				t.Fatalf("host only: %s %s", statusName(st), lastError())
			}
			hf := hp.fields()
			if hf.Kind != wf.Kind || hf.Route != wf.Route || hf.Batch != wf.Batch || hf.MaxKV != wf.MaxKV || hf.Items != wf.Items ||
				hf.Reserved[2] != wf.Reserved[2] || hf.Reserved[4] != wf.Reserved[4] || hf.Reserved[5] != wf.Reserved[5] ||
				uint32(hf.Reserved[3]) != uint32(wf.Reserved[3]) {
				t.Fatalf("host only: %+v, device plan %+v", hf, wf)
			}
			if hf.Grid != 0 || hf.Workspace != 0 || hf.KVLens != 0 || hf.Reserved[0] != 0 || hf.Reserved[1] != 0 {
				t.Fatalf("host-only plan names device memory: %+v", hf)
			}
			_, st = hookCascadeUpdate(hp, make([]int32, len(ids)), int32(len(ids)))
			expect(t, "update of a host-only plan", st, kverr.InvalidArgument)
			expect(t, "run of a host-only plan", hookPagedCascade(hp, 16, cols, 0), kverr.InvalidArgument)
		}
	}
	// An empty batch plans on the decode route.
	a := managerArgs(t, 0, 8)
	a.host, a.hostBytes, a.workspace, a.workspaceBytes = nil, 0, 0, 0
	p, st := hookManagerCascadePlan(h, nil, 0, a, nil, false, false)
	if st != 0 || p.fields().Batch != 0 || p.route() != 2 {
		t.Fatalf("empty batch: %s %+v", statusName(st), p.fields())
	}
}

// Bad arguments are status codes with messages that name the call, and a
// failed call leaves the plan struct and the workspaces as they were; the
// checks kvp_cascade_plan makes for the device path are its own.
func TestManagerCascadePlanErrors(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	h, ids := sharingHandle(t)
	n := int32(len(ids))
	prev := hookPlanSentinel()
	try := func(name string, hnd unsafe.Pointer, ids []int64, n int32, a *cascadeHookArgs, nullArgs, nullPlan bool, want kverr.Code) {
		t.Helper()
		var ws []int32
		if a != nil {
			ws = slices.Clone(a.host)
		}
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
		if a != nil && !slices.Equal(ws, a.host) {
			t.Errorf("%s: a failed call wrote the host workspace", name)
		}
	}
	good := func() *cascadeHookArgs { return managerArgs(t, len(ids), 64) }
	// mod tries a change of the good args on the device path (when device
	// is set: kvp_cascade_plan checks it before touching the device) and
	// on the host-only path (when host is set).
	const device, host, both = 1, 2, 3
	mod := func(name string, paths int, f func(a *cascadeHookArgs), want kverr.Code) {
		t.Helper()
		a := good()
		f(a)
		if paths&device != 0 {
			try(name, h, ids, n, a, false, false, want)
		}
		if paths&host != 0 {
			a.host, a.hostBytes, a.workspace, a.workspaceBytes = nil, 0, 0, 0
			try(name+" (host only)", h, ids, n, a, false, false, want)
		}
	}
	try("NULL handle", nil, ids, n, good(), false, false, kverr.InvalidHandle)
	try("NULL args", h, ids, n, good(), true, false, kverr.NullPointer)
	try("NULL plan", h, ids, n, good(), false, true, kverr.NullPointer)
	try("NULL ids", h, nil, n, good(), false, false, kverr.NullPointer)
	try("n -1", h, ids, -1, good(), false, false, kverr.InvalidArgument)
	try("n 65536", h, ids, 65536, good(), false, false, kverr.InvalidArgument)
	try("unknown id", h, append(slices.Clone(ids), 999), n+1, good(), false, false, kverr.UnknownSequence)
	mod("table too narrow", both, func(a *cascadeHookArgs) { a.maxBlocks = 8 }, kverr.BufferTooSmall)
	mod("max_blocks 0", both, func(a *cascadeHookArgs) { a.maxBlocks = 0 }, kverr.InvalidArgument)
	mod("host table given", both, func(a *cascadeHookArgs) { a.table = []int32{1} }, kverr.InvalidArgument)
	mod("host lens given", both, func(a *cascadeHookArgs) { a.lens = []int32{1} }, kverr.InvalidArgument)
	mod("batch differs", both, func(a *cascadeHookArgs) { a.batch = n - 1 }, kverr.InvalidArgument)
	mod("block size differs", both, func(a *cascadeHookArgs) { a.blockSize = 32 }, kverr.InvalidArgument)
	mod("struct_size below the first release", both, func(a *cascadeHookArgs) { a.structSize = firstCascadePlanArgsSize() - 1 }, kverr.StructSize)
	mod("reserved set", both, func(a *cascadeHookArgs) { a.reserved = 1 }, kverr.InvalidArgument)
	mod("max_tokens below the batch capacity", both, func(a *cascadeHookArgs) { a.maxTokens = 4 }, kverr.InvalidArgument)
	mod("qo_indptr decreasing", host, func(a *cascadeHookArgs) {
		a.qo = make([]int32, n+1)
		a.qo[1] = 2
	}, kverr.InvalidArgument)
	mod("dtype f32", both, func(a *cascadeHookArgs) { a.dtype = int32(attn.F32) }, kverr.Unsupported)
	mod("head_dim 80", both, func(a *cascadeHookArgs) { a.headDim = 80 }, kverr.Unsupported)
	mod("heads 8/3", both, func(a *cascadeHookArgs) { a.kvHeads = 3 }, kverr.InvalidArgument)
	mod("flags", both, func(a *cascadeHookArgs) { a.flags = 4 }, kverr.InvalidArgument)
	mod("headroom -1", host, func(a *cascadeHookArgs) { a.headroom = -1 }, kverr.InvalidArgument)
	mod("max_batch below the batch", host, func(a *cascadeHookArgs) { a.maxBatch = 4 }, kverr.BufferTooSmall)
	// The device path's own checks (kvp_cascade_plan's, before any device
	// work), with the message naming this call.
	mod("device workspace small", device, func(a *cascadeHookArgs) { a.workspaceBytes -= 16 }, kverr.BufferTooSmall)
	mod("host workspace without device workspace", device, func(a *cascadeHookArgs) { a.workspace = 0 }, kverr.NullPointer)
	mod("device seq_lens 0", device, func(a *cascadeHookArgs) { a.seqLensDev = 0 }, kverr.InvalidArgument)
	if cuda.Load() != nil {
		want := kverr.NoDevice
		if !attn.KernelsBuilt() {
			want = kverr.Unsupported
		}
		try("plan without driver", h, ids, n, good(), false, false, want)
	}
	// A wrong handle type and a destroyed handle.
	_, st := hookManagerCascadePlan(unsafe.Pointer(prev), ids, n, good(), nil, false, false)
	expect(t, "foreign pointer", st, kverr.InvalidHandle)
}

// Varlen queries (new prompts or chunks mixed with decode rows) pass
// through: the plan from the manager with qo_indptr_host is
// kvp_cascade_plan's of the described tables with the same offsets, on the
// device path and, for the summary, host only.
func TestManagerCascadePlanVarlenEqualsDescribe(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	h, ids := sharingHandle(t)
	n := int32(len(ids))
	lens := make([]int32, n)
	idb, lb, num := cInt64s(ids), newCBuf(4*int(n)), newCBuf(4)
	defer func() { idb.free(); lb.free(); num.free() }()
	if st := hookManagerDescribe(h, idb, n, cbuf{}, 0, lb, cbuf{}, 0, num); st != 0 {
		t.Fatalf("describe: %s %s", statusName(st), lastError())
	}
	copy(lens, unsafe.Slice((*int32)(lb.p), n))
	qo := make([]int32, n+1)
	for i := range ids {
		q := int32(1) // decode rows, and every third a chunk of up to 40 tokens
		if i%3 == 0 {
			q = min(lens[i], int32(5+13*i%40))
		}
		qo[i+1] = qo[i] + q
	}
	maxTokens := qo[n] + 8
	dev, host, st := hookCascadePrefillWorkspaceSize(16, maxTokens, 8, 2, 128)
	if st != 0 {
		t.Fatal(statusName(st))
	}
	for _, flags := range []int32{0, 1} {
		a := &cascadeHookArgs{structSize: sizeofCascadePlanArgs(), dtype: int32(attn.F16), headDim: 128, qHeads: 8, kvHeads: 2,
			maxBatch: 16, maxBlocks: 64, seqLensDev: 0x9000, host: make([]int32, host/4), hostBytes: host,
			workspace: 0x100000, workspaceBytes: dev, flags: flags, qo: qo, qoDev: 0xA000, maxTokens: maxTokens}
		want, wantWS := describePlan(t, h, ids, a)
		var seen hookCascadeSeen
		restore := hookPlanDeviceWithoutDevice(&seen)
		got, st := hookManagerCascadePlan(h, ids, n, a, nil, false, false)
		restore()
		if st != 0 {
			t.Fatalf("flags %d: %s %s", flags, statusName(st), lastError())
		}
		gf, wf := got.fields(), want.fields()
		gf.Reserved[0], wf.Reserved[0] = 0, 0
		if gf != wf || !slices.Equal(a.host, wantWS) {
			t.Fatalf("flags %d: plans differ:\nmanager  %+v\ndescribe %+v", flags, gf, wf)
		}
		if tq, mq := want.rows(); tq != qo[n] || mq < 2 {
			t.Fatalf("flags %d: the plan has %d query rows (max %d); %d given", flags, tq, mq, qo[n])
		}
		ho := *a
		ho.host, ho.hostBytes, ho.workspace, ho.workspaceBytes, ho.seqLensDev, ho.qoDev = nil, 0, 0, 0, 0, 0
		hp, st := hookManagerCascadePlan(h, ids, n, &ho, nil, false, false)
		if st != 0 {
			t.Fatalf("host only, flags %d: %s %s", flags, statusName(st), lastError())
		}
		hf := hp.fields()
		if hf.Route != wf.Route || hf.TotalQ != wf.TotalQ || hf.MaxQ != wf.MaxQ || hf.MaxKV != wf.MaxKV ||
			hf.Reserved[4] != wf.Reserved[4] || hf.Reserved[5] != wf.Reserved[5] {
			t.Fatalf("host only, flags %d: %+v, device plan %+v", flags, hf, wf)
		}
	}
}
