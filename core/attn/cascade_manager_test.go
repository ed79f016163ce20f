package attn

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/kvmanager/kvmtest"
)

// planFromManager is kvp_manager_cascade_plan's path below the C ABI: the
// manager's tables and lengths for ids gathered, then planned.
func planFromManager(m *kvmanager.Manager, ids []int64, a *CascadePlanArgs) (CascadePlan, error) {
	var in cascade.Input
	var sc kvmanager.CascadeScratch
	if err := m.CascadeInput(ids, a.MaxBlocksPerSeq, &in, &sc); err != nil {
		return CascadePlan{}, kverr.Wrap(kverr.CodeOf(err), err, "kvp_manager_cascade_plan")
	}
	return PlanCascadeInput(a, &in, 0)
}

// samePlan reports whether two plans are equal but for their host
// workspaces.
func samePlan(a, b CascadePlan) bool {
	a.HostWorkspace, b.HostWorkspace = nil, nil
	return reflect.DeepEqual(a, b)
}

// managerArgs are args for planning a manager's batch into fresh
// workspaces (fake device addresses), with max_blocks_per_seq cols.
func managerArgs(t *testing.T, cols int) *testBatch {
	dev, host, err := cascade.WorkspaceSizes(16, 16, 8, 2, 128)
	if err != nil {
		t.Fatal(err)
	}
	return &testBatch{CascadePlanArgs: CascadePlanArgs{DType: F16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2,
		MaxBatch: 16, MaxBlocksPerSeq: cols, SeqLensDev: 0x9000,
		Workspace: 0x100000, WorkspaceBytes: dev}, HostWorkspaceBytes: uint64(host), host: make([]int32, host/4)}
}

// hostOnly is b without workspaces or device arrays.
func hostOnly(b *testBatch) *testBatch {
	h := *b
	h.host, h.HostWorkspaceBytes, h.Workspace, h.WorkspaceBytes, h.SeqLensDev, h.QOIndptrDev = nil, 0, 0, 0, 0, 0
	return &h
}

// describePlan is the plan PlanCascade makes from the tables m.Describe
// writes for the same batch, and its host workspace.
func describePlan(t *testing.T, m *kvmanager.Manager, ids []int64, b *testBatch) (CascadePlan, []int32) {
	t.Helper()
	n, cols := len(ids), b.MaxBlocksPerSeq
	d := *b
	d.table, d.lens = make([]int32, n*cols), make([]int32, n)
	if _, err := m.Describe(ids, cols, d.table, d.lens, nil); err != nil {
		t.Fatalf("describe: %v", err)
	}
	d.Batch, d.BlockSize, d.BlockTableStride = n, 16, int64(cols)
	d.host = make([]int32, len(b.host))
	p, err := PlanCascade(d.args(), 0)
	if err != nil {
		t.Fatal(err)
	}
	return p, d.host
}

// The plan from the manager is PlanCascade's plan of the described tables:
// the same plan (but for the host workspace's address) and the same host
// workspace word for word, planned once. The host-only plan (no
// workspaces) has the same summary and cannot be updated or run.
func TestPlanFromManagerEqualsDescribe(t *testing.T) {
	plans := withoutDevice(t)
	m, ids := kvmtest.SharingManager(t)
	for _, cols := range []int{64, 200} {
		for _, flags := range []int{0, CascadeNoDecodeRoute} {
			b := managerArgs(t, cols)
			b.Flags = flags
			want, wantWS := describePlan(t, m, ids, b)

			*plans = 0
			got, err := planFromManager(m, ids, b.args())
			if err != nil {
				t.Fatalf("cols %d: %v", cols, err)
			}
			if *plans != 1 || unsafe.Pointer(unsafe.SliceData(got.HostWorkspace)) != unsafe.Pointer(&b.host[0]) || got.Workspace != b.Workspace || got.KVLens != b.SeqLensDev {
				t.Fatalf("cols %d: %d plans, into %p %#x with lengths %#x", cols, *plans, got.HostWorkspace, got.Workspace, got.KVLens)
			}
			if !samePlan(got, want) {
				t.Fatalf("cols %d flags %d: plans differ:\nmanager  %+v\ndescribe %+v", cols, flags, got, want)
			}
			if !slices.Equal(b.host, wantWS) {
				t.Fatalf("cols %d flags %d: host workspaces differ", cols, flags)
			}
			if want.SavedTokens < 3*544 || (flags == 1 && want.Route != cascade.RouteCascade) {
				t.Fatalf("cols %d flags %d: the batch's sharing was not found: %+v", cols, flags, want)
			}

			// Host only: no workspaces, no device; the same summary.
			hp, err := planFromManager(m, ids, hostOnly(b).args())
			if err != nil {
				t.Fatalf("host only: %v", err)
			}
			if hp.Kind != want.Kind || hp.Route != want.Route || hp.Batch != want.Batch || hp.MaxKVLen != want.MaxKVLen ||
				hp.NumItems != want.NumItems || hp.MaxBatch != want.MaxBatch || hp.BlockSize != want.BlockSize ||
				hp.SavedTokens != want.SavedTokens || hp.TotalTokens != want.TotalTokens || hp.Parts != want.Parts {
				t.Fatalf("host only: %+v, device plan %+v", hp, want)
			}
			if hp.Grid != 0 || hp.Workspace != 0 || hp.KVLens != 0 || hp.HostWorkspace != nil {
				t.Fatalf("host-only plan names device memory: %+v", hp)
			}
			lens := make([]int32, len(ids))
			_, err = UpdateCascade(&hp, lens)
			expect(t, "update of a host-only plan", err, kverr.InvalidArgument)
			expect(t, "run of a host-only plan", PagedCascade(&hp, layer(&hp, 16, cols), 0), kverr.InvalidArgument)
		}
	}
	// An empty batch plans on the decode route.
	p, err := planFromManager(m, nil, hostOnly(managerArgs(t, 8)).args())
	if err != nil || p.Batch != 0 || p.Route != cascade.RouteDecode {
		t.Fatalf("empty batch: %v %+v", err, p)
	}
}

// Bad arguments are errors whose messages name kvp_manager_cascade_plan,
// and a failed call leaves the workspaces as they were; the checks PlanCascade
// makes for the device path are its own.
func TestPlanFromManagerErrors(t *testing.T) {
	m, ids := kvmtest.SharingManager(t)
	n := len(ids)
	try := func(name string, ids []int64, b *testBatch, want kverr.Code) {
		t.Helper()
		ws := slices.Clone(b.host)
		_, err := planFromManager(m, ids, b.args())
		expect(t, name, err, want)
		if err != nil && !strings.HasPrefix(err.Error(), "kvp_manager_cascade_plan: ") {
			t.Errorf("%s: message %q does not name the call", name, err)
		}
		if !slices.Equal(ws, b.host) {
			t.Errorf("%s: a failed call wrote the host workspace", name)
		}
	}
	good := func() *testBatch { return managerArgs(t, 64) }
	// mod tries a change of the good args on the device path (when device
	// is set: PlanCascade checks it before touching the device) and on the
	// host-only path (when host is set).
	const device, host, both = 1, 2, 3
	mod := func(name string, paths int, f func(b *testBatch), want kverr.Code) {
		t.Helper()
		b := good()
		f(b)
		if paths&device != 0 {
			try(name, ids, b, want)
		}
		if paths&host != 0 {
			try(name+" (host only)", ids, hostOnly(b), want)
		}
	}
	// (NULL ids, n out of range and a batch other than n are the C ABI's
	// checks: capi's tests.)
	try("unknown id", append(slices.Clone(ids), 999), good(), kverr.UnknownSequence)
	mod("table too narrow", both, func(b *testBatch) { b.MaxBlocksPerSeq = 8 }, kverr.BufferTooSmall)
	mod("max_blocks 0", both, func(b *testBatch) { b.MaxBlocksPerSeq = 0 }, kverr.InvalidArgument)
	mod("host table given", both, func(b *testBatch) { b.table = []int32{1} }, kverr.InvalidArgument)
	mod("host lens given", both, func(b *testBatch) { b.lens = []int32{1} }, kverr.InvalidArgument)
	mod("block size differs", both, func(b *testBatch) { b.BlockSize = 32 }, kverr.InvalidArgument)
	mod("max_tokens below the batch capacity", both, func(b *testBatch) { b.MaxTokens = 4 }, kverr.InvalidArgument)
	mod("qo_indptr decreasing", host, func(b *testBatch) {
		b.qo = make([]int32, n+1)
		b.qo[1] = 2
	}, kverr.InvalidArgument)
	mod("dtype f32", both, func(b *testBatch) { b.DType = F32 }, kverr.Unsupported)
	mod("head_dim 80", both, func(b *testBatch) { b.HeadDim = 80 }, kverr.Unsupported)
	mod("heads 8/3", both, func(b *testBatch) { b.NumKVHeads = 3 }, kverr.InvalidArgument)
	mod("flags", both, func(b *testBatch) { b.Flags = 2 }, kverr.InvalidArgument)
	mod("headroom -1", host, func(b *testBatch) { b.Headroom = -1 }, kverr.InvalidArgument)
	mod("max_batch below the batch", host, func(b *testBatch) { b.MaxBatch = 4 }, kverr.BufferTooSmall)
	// The device path's own checks (PlanCascade's, before any device work),
	// with the message naming this call.
	mod("device workspace small", device, func(b *testBatch) { b.WorkspaceBytes -= 16 }, kverr.BufferTooSmall)
	mod("host workspace without device workspace", device, func(b *testBatch) { b.Workspace = 0 }, kverr.NullPointer)
	mod("device seq_lens 0", device, func(b *testBatch) { b.SeqLensDev = 0 }, kverr.InvalidArgument)
	if cuda.Load() != nil {
		want := kverr.NoDevice
		if !KernelsBuilt() {
			want = kverr.Unsupported
		}
		try("plan without driver", ids, good(), want)
	}
}

// Varlen queries (new prompts or chunks mixed with decode rows) pass
// through: the plan from the manager with QOIndptr is PlanCascade's of
// the described tables with the same offsets, on the device path and, for
// the summary, host only.
func TestPlanFromManagerVarlenEqualsDescribe(t *testing.T) {
	withoutDevice(t)
	m, ids := kvmtest.SharingManager(t)
	n := len(ids)
	lens := make([]int32, n)
	if _, err := m.Describe(ids, 0, nil, lens, nil); err != nil {
		t.Fatalf("describe: %v", err)
	}
	qo := make([]int32, n+1)
	for i := range ids {
		q := int32(1) // decode rows, and every third a chunk of up to 40 tokens
		if i%3 == 0 {
			q = min(lens[i], int32(5+13*i%40))
		}
		qo[i+1] = qo[i] + q
	}
	maxTokens := int(qo[n]) + 8
	dev, host, err := cascade.WorkspaceSizes(16, maxTokens, 8, 2, 128)
	if err != nil {
		t.Fatal(err)
	}
	for _, flags := range []int{0, CascadeNoDecodeRoute} {
		b := &testBatch{CascadePlanArgs: CascadePlanArgs{DType: F16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2,
			MaxBatch: 16, MaxBlocksPerSeq: 64, SeqLensDev: 0x9000,
			Workspace: 0x100000, WorkspaceBytes: dev, Flags: flags, QOIndptrDev: 0xA000, MaxTokens: maxTokens},
			HostWorkspaceBytes: uint64(host), host: make([]int32, host/4), qo: qo}
		want, wantWS := describePlan(t, m, ids, b)
		got, err := planFromManager(m, ids, b.args())
		if err != nil {
			t.Fatalf("flags %d: %v", flags, err)
		}
		if !samePlan(got, want) || !slices.Equal(b.host, wantWS) {
			t.Fatalf("flags %d: plans differ:\nmanager  %+v\ndescribe %+v", flags, got, want)
		}
		if want.TotalQ != int(qo[n]) || want.MaxQLen < 2 {
			t.Fatalf("flags %d: the plan has %d query rows (max %d); %d given", flags, want.TotalQ, want.MaxQLen, qo[n])
		}
		hp, err := planFromManager(m, ids, hostOnly(b).args())
		if err != nil {
			t.Fatalf("host only, flags %d: %v", flags, err)
		}
		if hp.Route != want.Route || hp.TotalQ != want.TotalQ || hp.MaxQLen != want.MaxQLen || hp.MaxKVLen != want.MaxKVLen ||
			hp.SavedTokens != want.SavedTokens || hp.TotalTokens != want.TotalTokens {
			t.Fatalf("host only, flags %d: %+v, device plan %+v", flags, hp, want)
		}
	}
}
