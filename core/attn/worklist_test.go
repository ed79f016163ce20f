package attn

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// The fingerprint follows what the plan kernel writes: the same arguments
// and batch give the same one; another batch, split count or mainloop's
// tile, another.
func TestWorkListFingerprint(t *testing.T) {
	pp := prefillPlanParams{QOIndptr: 0x1000, KVLens: 0x2000, Work: 0x3000, Batch: 2, Group: 4, TotalQ: 7,
		MaxItems: 3, TileQ: 64, NumSplits: 1}
	qo, kv := []int32{0, 3, 7}, []int32{10, 9}
	f := workListOf(&pp, qo, kv)
	if f == 0 || f != workListOf(&pp, []int32{0, 3, 7}, []int32{10, 9}) {
		t.Fatalf("fingerprint %#x, not repeatable", f)
	}
	moved := pp // the same values in other device arrays: the same list
	moved.QOIndptr, moved.KVLens = 0x5000, 0x6000
	if workListOf(&moved, qo, kv) != f {
		t.Fatal("the device arrays' addresses changed the fingerprint")
	}
	other := pp
	other.TileQ = 128
	split := pp
	split.NumSplits = 2
	for name, g := range map[string]uint64{
		"another tile":        workListOf(&other, qo, kv),
		"another split count": workListOf(&split, qo, kv),
		"another kv_lens":     workListOf(&pp, qo, []int32{10, 8}),
		"another qo_indptr":   workListOf(&pp, []int32{0, 4, 7}, kv),
	} {
		if g == f {
			t.Errorf("%s: the same fingerprint %#x", name, f)
		}
	}
}

// A run of a prefill plan whose workspace was since planned into for
// another work list is refused (INVALID_ARGUMENT, "stale plan"); with its
// own list recorded there again (the same batch planned again), or without
// a fingerprint, or on the decode route, it goes on to the run's other
// checks.
func TestStalePrefillPlanRefused(t *testing.T) {
	const ws = cuda.DevicePtr(0x7f0000100000)
	p := PrefillPlan{Kind: KindPrefill, Route: RoutePrefill, NumItems: 4, Workspace: ws, WorkList: 0xaaaa}
	stale := func(p *PrefillPlan) bool {
		err := PagedPrefill(p, &PagedPrefillArgs{}, 0)
		var e *kverr.Error
		return errors.As(err, &e) && e.Code == kverr.InvalidArgument && strings.Contains(err.Error(), "stale plan")
	}
	recordWorkList(ws, 0xbbbb)
	if !stale(&p) {
		t.Fatal("a plan whose workspace holds another list ran on")
	}
	recordWorkList(ws, 0xaaaa)
	if stale(&p) {
		t.Fatal("a plan whose list its workspace holds was refused")
	}
	recordWorkList(ws, 0xbbbb)
	unmarked, decode := p, p
	unmarked.WorkList = 0
	decode.Route, decode.NumItems = RouteDecode, 0
	if stale(&unmarked) || stale(&decode) {
		t.Fatal("a plan without a fingerprint, or on the decode route, was refused as stale")
	}
	other := p
	other.Workspace = ws + 1<<20
	if stale(&other) {
		t.Fatal("a plan of a workspace without a record was refused")
	}
}

// A decode launch's split partials overwrite a work list at the start of
// the workspace: the list's plan is refused after it, and a workspace that
// no plan recorded gains no record.
func TestPartialsMakePlanStale(t *testing.T) {
	const ws = cuda.DevicePtr(0x7f0000300000)
	p := PrefillPlan{Kind: KindPrefill, Route: RoutePrefill, NumItems: 4, Workspace: ws, WorkList: 0xcccc}
	recordWorkList(ws, p.WorkList)
	if err := checkWorkList("paged_prefill", &p); err != nil {
		t.Fatalf("the plan whose list its workspace holds: %v", err)
	}
	notePartials(ws)
	err := checkWorkList("paged_prefill", &p)
	var e *kverr.Error
	if !errors.As(err, &e) || e.Code != kverr.InvalidArgument || !strings.Contains(err.Error(), "stale plan") {
		t.Fatalf("a plan whose list split partials overwrote: %v, want a stale plan", err)
	}
	const fresh = cuda.DevicePtr(0x7f0000500000)
	notePartials(fresh)
	workLists.Lock()
	_, ok := workLists.of[fresh]
	workLists.Unlock()
	if ok {
		t.Fatal("partials in a workspace without a record added one")
	}
}
