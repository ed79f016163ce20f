package main

// GPU test of kvp_manager_cascade_plan through the real kvp_cascade_plan:
// the plan struct, the host workspace and the device workspace (the
// uploaded plan) equal those of kvp_cascade_plan over the tables
// kvp_manager_describe writes. Skips without a CUDA driver and device; on
// a GPU machine:
//   go test -c -o .device/capi.test ./capi && .device/capi.test -test.run GPU -test.v

import (
	"slices"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/cuda"
)

func TestManagerCascadePlanGPU(t *testing.T) {
	lockThread(t) // the CUDA context and kvp_last_error are per thread
	if err := cuda.Load(); err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if n, err := cuda.DeviceCount(); err != nil || n == 0 {
		t.Skipf("no CUDA device (%v)", err)
	}
	if err := attn.Prepare(); err != nil {
		t.Fatalf("loading the kernels: %v", err)
	}
	h, _, ids := sharingHandle(t)
	n := int32(len(ids))
	const cols = 96
	devBytes, hostBytes, st := hookCascadeWorkspaceSize(n+2, 8, 2, 128)
	if st != 0 {
		t.Fatal(statusName(st))
	}
	alloc := func(bytes int) cuda.DevicePtr {
		p, err := cuda.MemAlloc(bytes)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cuda.MemFree(p) })
		if err := cuda.CopyToDevice(p, make([]byte, bytes)); err != nil { // zeroed: unwritten regions compare equal
			t.Fatal(err)
		}
		return p
	}
	hostWS := func() []int32 { // C memory, zeroed, as a host would pass
		b := newCBuf(int(hostBytes))
		t.Cleanup(b.free)
		return unsafe.Slice((*int32)(b.p), hostBytes/4)
	}

	// The described tables and lengths, and the device lengths.
	idb, table, lens, num := cInt64s(ids), newCBuf(4*int(n)*cols), newCBuf(4*int(n)), newCBuf(4)
	defer func() { idb.free(); table.free(); lens.free(); num.free() }()
	if st := hookManagerDescribe(h, idb, n, table, cols, lens, cbuf{}, 0, num); st != 0 {
		t.Fatalf("describe: %s %s", statusName(st), lastError())
	}
	lensH := unsafe.Slice((*int32)(lens.p), n)
	lensD := alloc(4 * int(n))
	if err := cuda.CopyToDevice(lensD, unsafe.Slice((*byte)(lens.p), 4*int(n))); err != nil {
		t.Fatal(err)
	}

	for _, flags := range []int32{0, 1} {
		wsA, wsB := alloc(int(devBytes)), alloc(int(devBytes))
		hostA, hostB := hostWS(), hostWS()
		a := &cascadeHookArgs{structSize: sizeofCascadePlanArgs(), dtype: int32(attn.F16), headDim: 128, qHeads: 8, kvHeads: 2,
			batch: n, maxBatch: n + 2, blockSize: 16, maxBlocks: cols, stride: cols,
			table: unsafe.Slice((*int32)(table.p), int(n)*cols), lens: lensH, seqLensDev: uint64(lensD),
			host: hostA, hostBytes: hostBytes, workspace: uint64(wsA), workspaceBytes: devBytes, flags: flags}
		pa, st := hookCascadePlan(a, false)
		if st != 0 {
			t.Fatalf("kvp_cascade_plan: %s %s", statusName(st), lastError())
		}
		b := *a
		b.batch, b.blockSize, b.stride, b.table, b.lens = 0, 0, 0, nil, nil
		b.host, b.workspace = hostB, uint64(wsB)
		pb, st := hookManagerCascadePlan(h, ids, n, &b, nil, false, false)
		if st != 0 {
			t.Fatalf("kvp_manager_cascade_plan: %s %s", statusName(st), lastError())
		}
		if err := cuda.Synchronize(); err != nil {
			t.Fatal(err)
		}
		fa, fb := pa.fields(), pb.fields()
		if fa.Workspace != uint64(wsA) || fb.Workspace != uint64(wsB) {
			t.Fatalf("workspaces %#x %#x", fa.Workspace, fb.Workspace)
		}
		fa.Workspace, fb.Workspace, fa.Reserved[0], fb.Reserved[0] = 0, 0, 0, 0
		if fa != fb {
			t.Fatalf("flags %d: plans differ:\ndescribe %+v\nmanager  %+v", flags, fa, fb)
		}
		if !slices.Equal(hostA, hostB) {
			t.Fatalf("flags %d: host workspaces differ", flags)
		}
		da, db := make([]byte, devBytes), make([]byte, devBytes)
		if err := cuda.CopyFromDevice(da, wsA); err != nil {
			t.Fatal(err)
		}
		if err := cuda.CopyFromDevice(db, wsB); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(da, db) {
			t.Fatalf("flags %d: device workspaces differ", flags)
		}
		// The sharing is found either way; the cascade route is certain only
		// under NO_DECODE_ROUTE (elsewhere the cost model decides).
		if fa.Reserved[4] < 3*544 || (flags == 1 && (fa.Route != 3 || fa.Grid == 0)) {
			t.Fatalf("flags %d: the sharing was not planned: %+v", flags, fa)
		}
	}
}
