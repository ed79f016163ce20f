package attn

import (
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cascade"
	"github.com/kvplug/kvplug/core/cascade/cascadetest"
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// noDevice plans as the GPU would with cascade.DefaultSlots, but enqueues
// nothing: the plan is in the host workspace only. It counts the plans that
// reached the device step.
type noDevice struct{ plans *int }

func (d noDevice) open(DType, int) (int, bool, error) {
	*d.plans++
	return cascade.DefaultSlots, false, nil
}

func (noDevice) planPrefill(*PrefillPlanArgs, cuda.Stream) (PrefillPlan, error) {
	return PrefillPlan{}, nil
}

func (noDevice) upload(cuda.DevicePtr, []byte, [][2]int64, cuda.Stream) error { return nil }

func (noDevice) hopper(DType, int) bool { return false }

// withoutDevice makes the test's plans without a GPU and returns the count
// of plans that reached the device step.
func withoutDevice(t *testing.T) *int {
	old := cascadeDev
	n := new(int)
	cascadeDev = noDevice{plans: n}
	t.Cleanup(func() { cascadeDev = old })
	return n
}

// testBatch is a batch's host arrays and the CascadePlanArgs over them:
// Batch sequences, the first HostWorkspaceBytes of host the host workspace.
type testBatch struct {
	CascadePlanArgs
	Batch                 int
	HostWorkspaceBytes    uint64
	table, lens, qo, host []int32
}

// wordBytes is the memory of s as bytes (nil for nil).
func wordBytes(s []int32, n uint64) []byte {
	if s == nil {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), n)
}

// args is b's CascadePlanArgs over its host arrays.
func (b *testBatch) args() *CascadePlanArgs {
	a := b.CascadePlanArgs
	a.BlockTable, a.QOIndptr = b.table, b.qo
	if b.lens != nil {
		a.SeqLens = b.lens[:b.Batch]
	}
	a.HostWorkspace = wordBytes(b.host, b.HostWorkspaceBytes)
	return &a
}

// cascadeBatch is cascadetest.SharedPrefixBatch with workspaces for maxBatch.
func cascadeBatch(t *testing.T, maxBatch int) *testBatch {
	table, lens, B, cols := cascadetest.SharedPrefixBatch()
	dev, host, err := cascade.WorkspaceSizes(maxBatch, maxBatch, 8, 2, 128)
	if err != nil || dev == 0 || host == 0 {
		t.Fatalf("workspace size: %d %d %v", dev, host, err)
	}
	return &testBatch{CascadePlanArgs: CascadePlanArgs{DType: F16, HeadDim: 128, NumQHeads: 8, NumKVHeads: 2,
		MaxBatch: maxBatch, BlockSize: 16, MaxBlocksPerSeq: cols, BlockTableStride: int64(cols),
		SeqLensDev: 0x9000, Workspace: 0x100000, WorkspaceBytes: dev},
		Batch: B, HostWorkspaceBytes: uint64(host), table: table, lens: lens, host: make([]int32, host/4)}
}

// cascadePrefillBatch: cascadeBatch's 6 sequences, each with 40-90 new
// query tokens at the end of its length (after the shared runs).
func cascadePrefillBatch(t *testing.T, maxBatch, maxTokens int) *testBatch {
	b := cascadeBatch(t, maxBatch)
	b.qo = make([]int32, b.Batch+1)
	for s := 0; s < b.Batch; s++ {
		b.qo[s+1] = b.qo[s] + 40 + 10*int32(s)
	}
	dev, host, err := cascade.WorkspaceSizes(maxBatch, maxTokens, 8, 2, 128)
	if err != nil {
		t.Fatalf("prefill workspace size: %v", err)
	}
	b.MaxTokens, b.QOIndptrDev = maxTokens, 0xa000
	b.host, b.HostWorkspaceBytes, b.WorkspaceBytes = make([]int32, host/4), uint64(host), dev
	return b
}

// layer is one layer's contiguous tensors at fake addresses for plan p,
// with blockSize and maxBlocks columns of block table.
func layer(p *CascadePlan, blockSize, maxBlocks int) *PagedPrefillArgs {
	D, qh, kvh := int64(p.HeadDim), int64(p.NumQHeads), int64(p.NumKVHeads)
	return &PagedPrefillArgs{PrefillLayout: PrefillLayout{
		QTokenStride: qh * D, QHeadStride: D, OutTokenStride: qh * D, OutHeadStride: D, PagedKV: PagedKV{NumBlocks: 1 << 20, BlockSize: blockSize,
			CacheBlockStride: int64(blockSize) * kvh * D, CacheTokenStride: kvh * D, CacheHeadStride: D,
			MaxBlocksPerSeq: maxBlocks, BlockTableStride: int64(maxBlocks),
			KCache: 0x20000, VCache: 0x30000, BlockTable: 0x40000}},
		Q: 0x10000, Out: 0x50000}
}

func expect(t *testing.T, name string, err error, want kverr.Code) {
	t.Helper()
	if got := kverr.CodeOf(err); got != want {
		t.Errorf("%s: %v (%v), want %v", name, got, err, want)
	}
}

// Bad arguments are errors before any device work.
func TestPlanArgumentChecks(t *testing.T) {
	good := cascadeBatch(t, 8)
	mod := func(name string, f func(b *testBatch), want kverr.Code) {
		t.Helper()
		b := *good
		f(&b)
		_, err := PlanCascade(b.args(), 0)
		expect(t, name, err, want)
	}
	mod("qo_indptr_host without qo_indptr", func(b *testBatch) { b.qo = make([]int32, b.Batch+1) }, kverr.InvalidArgument)
	mod("qo_indptr unaligned", func(b *testBatch) { b.qo, b.QOIndptrDev = make([]int32, b.Batch+1), 0x9002 }, kverr.InvalidArgument)
	mod("max_tokens below max_batch", func(b *testBatch) { b.MaxTokens = b.MaxBatch - 1 }, kverr.InvalidArgument)
	mod("dtype f32", func(b *testBatch) { b.DType = F32 }, kverr.Unsupported)
	mod("head_dim 80", func(b *testBatch) { b.HeadDim = 80 }, kverr.Unsupported)
	mod("flags", func(b *testBatch) { b.Flags = 2 }, kverr.InvalidArgument)
	mod("heads 8/3", func(b *testBatch) { b.NumKVHeads = 3 }, kverr.InvalidArgument)
	mod("host workspace NULL", func(b *testBatch) { b.host = nil }, kverr.NullPointer)
	mod("host workspace small", func(b *testBatch) { b.HostWorkspaceBytes -= 4 }, kverr.BufferTooSmall)
	mod("device workspace 0", func(b *testBatch) { b.Workspace = 0 }, kverr.NullPointer)
	mod("device workspace unaligned", func(b *testBatch) { b.Workspace += 8 }, kverr.InvalidArgument)
	mod("device workspace small", func(b *testBatch) { b.WorkspaceBytes -= 16 }, kverr.BufferTooSmall)
	mod("seq_lens 0", func(b *testBatch) { b.SeqLensDev = 0 }, kverr.InvalidArgument)
	mod("host table NULL", func(b *testBatch) { b.table = nil }, kverr.NullPointer)
	mod("max_blocks above stride", func(b *testBatch) { b.MaxBlocksPerSeq = int(b.BlockTableStride) + 1 }, kverr.InvalidArgument)
	mod("stride 2^31", func(b *testBatch) { b.BlockTableStride = 1 << 31 }, kverr.InvalidArgument)
	mod("block table short", func(b *testBatch) { b.table = b.table[:len(b.table)-1] }, kverr.InvalidArgument)
	mod("qo_indptr_host short", func(b *testBatch) { b.qo, b.QOIndptrDev = make([]int32, b.Batch), 0x9000 }, kverr.InvalidArgument)
	if _, _, err := cascade.WorkspaceSizes(0, 0, 8, 2, 128); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Errorf("workspace size max_batch 0: %v", err)
	}
	if cuda.Load() != nil {
		want := kverr.NoDevice
		if !KernelsBuilt() {
			want = kverr.Unsupported
		}
		_, err := PlanCascade(good.args(), 0)
		expect(t, "plan without driver", err, want)
	}
}

// Update and Run on plans made without a device: growth within the tails
// fits, a plan older than its workspaces' latest is refused as stale, a
// plan of another kind or a layer with another block size is refused.
func TestUpdateAndStalePlans(t *testing.T) {
	withoutDevice(t)
	b := cascadeBatch(t, 8)
	b.Flags = CascadeNoDecodeRoute // a batch this small routes to plain decode by the cost model
	p1, err := PlanCascade(b.args(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if p1.Route != cascade.RouteCascade {
		t.Fatalf("route %d, want the cascade route", p1.Route)
	}
	if p1.SavedTokens != 5*512+2*256 || p1.TotalTokens == 0 {
		t.Fatalf("saved %d of %d tokens", p1.SavedTokens, p1.TotalTokens)
	}
	lens := append([]int32(nil), b.lens...)
	for i := range lens {
		lens[i] += 10
	}
	if fits, err := UpdateCascade(&p1, lens[:6]); err != nil || !fits {
		t.Fatalf("growth by 10: fits %v, %v", fits, err)
	}
	for i := range lens {
		lens[i] += 1000
	}
	if fits, err := UpdateCascade(&p1, lens[:6]); err != nil || fits {
		t.Fatalf("growth by 1010: fits %v, %v", fits, err)
	}
	_, err = UpdateCascade(&p1, lens[:5])
	expect(t, "batch differs", err, kverr.InvalidArgument)
	expect(t, "run with another block size", PagedCascade(&p1, layer(&p1, 32, 64), 0), kverr.InvalidArgument)
	expect(t, "run with a short table", PagedCascade(&p1, layer(&p1, 16, 40), 0), kverr.InvalidArgument)

	// A second plan into the same workspaces makes the first stale.
	if _, err := PlanCascade(b.args(), 0); err != nil {
		t.Fatal(err)
	}
	_, err = UpdateCascade(&p1, b.lens[:6])
	expect(t, "stale plan update", err, kverr.InvalidArgument)
	expect(t, "stale plan run", PagedCascade(&p1, layer(&p1, 16, 64), 0), kverr.InvalidArgument)

	p3, _ := PlanCascade(b.args(), 0)
	p3.Kind = KindPrefill
	_, err = UpdateCascade(&p3, b.lens[:6])
	expect(t, "prefill kind", err, kverr.InvalidArgument)

	// No sharing: the decode route, which always fits.
	c := cascadeBatch(t, 8)
	for i := range c.table {
		c.table[i] = int32(i)
	}
	p4, err := PlanCascade(c.args(), 0)
	if err != nil || p4.Route != cascade.RouteDecode {
		t.Fatalf("no sharing: route %d, %v", p4.Route, err)
	}
	if fits, err := UpdateCascade(&p4, lens[:6]); err != nil || !fits {
		t.Fatalf("decode route: fits %v, %v", fits, err)
	}
}

// Varlen queries: the workspace sizes, plans of prompts sharing a prefix
// (cascade route, rows and longest query in the plan, never absorbed by
// Update), plans without sharing (the prefill route), and the run's checks.
func TestPrefillPlans(t *testing.T) {
	withoutDevice(t)
	dd, dh, err := cascade.WorkspaceSizes(8, 8, 8, 2, 128)
	pd, ph, err2 := cascade.WorkspaceSizes(8, 8, 8, 2, 128)
	if err != nil || err2 != nil || dd != pd || dh != ph {
		t.Fatalf("max_tokens = max_batch: %d/%d vs %d/%d (%v %v)", pd, ph, dd, dh, err, err2)
	}
	if bd, bh, err := cascade.WorkspaceSizes(8, 4096, 8, 2, 128); err != nil || bd <= dd || bh <= dh {
		t.Fatalf("max_tokens 4096: %d/%d (%v)", bd, bh, err)
	}
	_, _, err = cascade.WorkspaceSizes(8, 7, 8, 2, 128)
	expect(t, "max_tokens below max_batch", err, kverr.InvalidArgument)

	b := cascadePrefillBatch(t, 8, 4096)
	b.Flags = CascadeNoDecodeRoute // prompts this short route to the prefill kernel by the cost model
	p, err := PlanCascade(b.args(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if p.Route != cascade.RouteCascade || p.TotalQ != int(b.qo[6]) || p.MaxQLen != 90 {
		t.Fatalf("prompts sharing a prefix: route %d, rows %d, max_q_len %d", p.Route, p.TotalQ, p.MaxQLen)
	}
	// The 256-token run of sequences 0-2 reaches past their first query
	// tokens: only its whole blocks before them may be shared.
	if p.SavedTokens != 5*512 && p.SavedTokens != 5*512+2*208 {
		t.Fatalf("saved %d tokens", p.SavedTokens)
	}
	if fits, err := UpdateCascade(&p, b.lens[:6]); err != nil || fits {
		t.Fatalf("update of a prefill plan: fits %v, %v", fits, err)
	}
	expect(t, "run with another block size", PagedCascade(&p, layer(&p, 32, 64), 0), kverr.InvalidArgument)
	expect(t, "run with a short table", PagedCascade(&p, layer(&p, 16, 40), 0), kverr.InvalidArgument)

	// Too few query rows in the workspaces for the batch's: refused.
	small := cascadePrefillBatch(t, 8, 100)
	if _, err := PlanCascade(small.args(), 0); kverr.CodeOf(err) != kverr.BufferTooSmall {
		t.Fatalf("rows above max_tokens: %v", err)
	}

	// No sharing: the prefill route.
	c := cascadePrefillBatch(t, 8, 4096)
	for i := range c.table {
		c.table[i] = int32(i)
	}
	pc, err := PlanCascade(c.args(), 0)
	if err != nil || pc.Route != cascade.RoutePrefill {
		t.Fatalf("no sharing: route %d, %v", pc.Route, err)
	}
	expect(t, "prefill route, another block size", PagedCascade(&pc, layer(&pc, 32, 64), 0), kverr.InvalidArgument)
	if fits, err := UpdateCascade(&pc, c.lens[:6]); err != nil || fits {
		t.Fatalf("update of a prefill-route plan: fits %v, %v", fits, err)
	}
}

// The upload covers the header and used items always, and on the cascade
// route the plan's other regions, in ranges merged across small gaps.
func TestUploadRanges(t *testing.T) {
	withoutDevice(t)
	b := cascadeBatch(t, 8)
	b.Flags = CascadeNoDecodeRoute
	p, err := PlanCascade(b.args(), 0)
	if err != nil {
		t.Fatal(err)
	}
	l, err := cascade.NewLayout(8, 8, 2, 128)
	if err != nil {
		t.Fatal(err)
	}
	s, err := cascade.Header(b.host, &l)
	if err != nil || s.Route != p.Route {
		t.Fatalf("header: %+v %v", s, err)
	}
	r := uploadRanges(&l, b.host, s)
	if r[0][0] != 0 || r[0][1] < 4*int64(l.Items+s.Items*cascade.ItemInts) {
		t.Fatalf("the first range %v misses the items", r[0])
	}
	last := r[len(r)-1]
	if last[0]+last[1] != 4*int64(l.QStart+s.Batch+1) {
		t.Fatalf("the last range %v does not end at the query starts (%d words)", last, l.QStart+s.Batch+1)
	}
	for i := 1; i < len(r); i++ {
		if gap := r[i][0] - (r[i-1][0] + r[i-1][1]); gap <= 4*1024 {
			t.Fatalf("ranges %v and %v are %d bytes apart: one copy", r[i-1], r[i], gap)
		}
	}
	s.Route = cascade.RouteDecode
	if r := uploadRanges(&l, b.host, s); len(r) != 1 {
		t.Fatalf("decode route: %v", r)
	}
}
