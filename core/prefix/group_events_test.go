package prefix

import (
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// groupSet is a GroupSource: blocks[g] are the cached blocks group g keeps
// a block with.
type groupSet struct{ blocks [][]int32 }

func (s *groupSet) NumGroups() int { return len(s.blocks) }
func (s *groupSet) GroupLen() int {
	n := 0
	for _, b := range s.blocks[1:] {
		n += len(b)
	}
	return n
}
func (s *groupSet) GroupHolds(g int, block int32) bool { return slices.Contains(s.blocks[g], block) }

// A layer group's events carry its cached block's fields under its group;
// snapshots list the groups' blocks after the cache's; EventIndex keeps
// each group as a set, and LastRemoved names what an eviction removed.
func TestGroupEvents(t *testing.T) {
	x := newIndex(t, 2, 16, true)
	keys := &Keys{Adapter: 5}
	held := cache(t, x, seq(0, 6), keys, 3, 4, 5)
	chain := chainOf(t, seq(0, 6), 2, keys)
	src := &groupSet{blocks: [][]int32{nil, {4, 5}, {5}}}
	x.SetGroupSource(src)
	must(t, x.RecordGroupStored(1, 4))
	must(t, x.RecordGroupStored(1, 5))
	must(t, x.RecordGroupStored(2, 5))
	for _, bad := range []struct {
		g     int
		block int32
	}{{0, 4}, {-1, 4}, {1, 9}} {
		if err := x.RecordGroupStored(bad.g, bad.block); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Fatalf("RecordGroupStored(%d, %d): %v", bad.g, bad.block, err)
		}
	}
	if err := x.RecordGroupRemoved(0, chain[:1]); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("RecordGroupRemoved(0): %v", err)
	}
	evs := x.DrainEvents(0)
	if len(evs) != 6 {
		t.Fatalf("%d events, want 3 of the cache and 3 of its groups", len(evs))
	}
	for i, want := range []struct {
		group int
		hash  Hash
	}{{0, chain[0]}, {0, chain[1]}, {0, chain[2]}, {1, chain[1]}, {1, chain[2]}, {2, chain[2]}} {
		ev := evs[i]
		if ev.Kind != BlockStored || ev.Group != want.group || ev.Hash != want.hash || ev.Adapter != 5 || len(ev.Tokens) != 2 {
			t.Fatalf("event %d: %+v, want group %d's BlockStored of %s", i, ev, want.group, want.hash)
		}
	}
	if evs[4].Parent != chain[1] || !slices.Equal(evs[4].Tokens, seq(4, 2)) {
		t.Fatalf("group 1's event of block 5 has parent %s, tokens %v: block 5's own", evs[4].Parent, evs[4].Tokens)
	}
	r := NewEventIndex()
	applyAll(t, r, evs)
	if r.Len() != 3 || r.LenGroup(1) != 2 || r.LenGroup(2) != 1 || !r.ContainsGroup(2, chain[2]) || r.ContainsGroup(2, chain[1]) {
		t.Fatalf("replay: %d blocks, %d and %d in groups 1 and 2", r.Len(), r.LenGroup(1), r.LenGroup(2))
	}
	// A group's block removed alone: its cached block stays.
	must(t, x.RecordGroupRemoved(1, chain[1:2]))
	applyAll(t, r, x.DrainEvents(0))
	if !r.Contains(chain[1]) || r.ContainsGroup(1, chain[1]) {
		t.Fatal("group 1's removal touched group 0")
	}
	if err := r.Apply(Event{Kind: BlockRemoved, Group: 1, Hashes: chain[1:2]}); err == nil {
		t.Fatal("a group's block removed twice")
	}
	if err := r.Apply(Event{Kind: BlockStored, Group: 2, Hash: chain[2]}); err == nil {
		t.Fatal("a group's block stored twice")
	}
	if err := r.Apply(Event{Kind: BlockStored, Group: 1, Medium: MediumCPU, Hash: chain[0]}); err == nil {
		t.Fatal("a group's block on the CPU")
	}
	// A snapshot lists every group's blocks after the cache's.
	src.blocks[1] = []int32{5}
	x.RequestSnapshot()
	if st := x.Stats(); st.PendingEvents != 1+3+2 {
		t.Fatalf("%d events pending for the snapshot, want 6", st.PendingEvents)
	}
	evs = x.DrainEvents(0)
	var groups []int
	for _, ev := range evs[1:] {
		groups = append(groups, ev.Group)
	}
	if evs[0].Kind != AllCleared || !slices.Equal(groups, []int{0, 0, 0, 1, 2}) {
		t.Fatalf("snapshot: %v, groups %v", evs[0].Kind, groups)
	}
	r = NewEventIndex()
	applyAll(t, r, evs)
	if r.LenGroup(1) != 1 || r.LenGroup(2) != 1 {
		t.Fatalf("snapshot replayed: %d and %d", r.LenGroup(1), r.LenGroup(2))
	}
	// AllCleared forgets the groups too.
	must(t, r.Apply(Event{Kind: AllCleared}))
	if r.LenGroup(1) != 0 || r.LenGroup(2) != 0 {
		t.Fatal("AllCleared left groups' blocks")
	}
	// LastRemoved: the evicted blocks' hashes, in Evict's order.
	unlock(t, x, held...)
	got := evict(t, x, 2)
	if !slices.Equal(got, []int32{5, 4}) || !slices.Equal(x.LastRemoved(), []Hash{chain[2], chain[1]}) {
		t.Fatalf("evicted %v, last removed %v", got, x.LastRemoved())
	}
	off := newIndex(t, 2, 16, false)
	cache(t, off, seq(0, 2), nil, 1)
	off.SetGroupSource(src)
	must(t, off.RecordGroupStored(1, 1))
	if off.DrainEvents(0) != nil || off.LastRemoved() != nil {
		t.Fatal("group events recorded while events are off")
	}
}
