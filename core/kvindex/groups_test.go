package kvindex

import (
	"testing"

	"github.com/kvplug/kvplug/core/kvevents"
)

// A hybrid model's events (vLLM's group_idx): the index keeps group 0's
// blocks, and another group's events under the same hashes, a window's
// block removed alone among them, leave it as it is.
func TestApplyBatchPassesOverOtherGroups(t *testing.T) {
	x := startIndex(t, Config{})
	in := &instance{cfg: InstanceConfig{Name: "e", BlockSize: 16}, x: x, nextSeq: 0}
	x.insts, x.byName["e"] = append(x.insts, in), in
	g := func(v int64) *int64 { return &v }
	b := &kvevents.Batch{Events: []kvevents.DecodedEvent{
		{Kind: kvevents.KindStored, Hashes: keys(1, 2), Tokens: make([]int64, 32), BlockSize: 16, GroupIdx: g(0)},
		{Kind: kvevents.KindStored, Hashes: keys(1, 2), Tokens: make([]int64, 32), BlockSize: 16, GroupIdx: g(1)},
		{Kind: kvevents.KindRemoved, Hashes: keys(1), GroupIdx: g(1)},
		{Kind: kvevents.KindStored, Hashes: keys(3), Tokens: make([]int64, 16), BlockSize: 16},
	}}
	if !in.applyBatch(0, b, false) {
		t.Fatal("batch refused")
	}
	got, _ := x.be.Match([]string{"e"}, [][]kvevents.Key{keys(1, 2, 3)})
	if got[0] != (Held{3, 0, 0}) || in.lastErr != "" {
		t.Fatalf("held %+v, error %q", got[0], in.lastErr)
	}
}
