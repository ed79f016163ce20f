package main

import (
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

func TestLayerGroupsABI(t *testing.T) {
	lockThread(t)
	full, win, state := testGroup{kind: 0}, testGroup{kind: 1, window: 5}, testGroup{kind: 2, stateBytes: 256}
	groups := []testGroup{full, win, state}
	for _, c := range []struct {
		name       string
		groups     []testGroup
		n          int32
		null       bool
		maxLen     int32
		blockBytes int64
		cache      bool
		want       kverr.Code
	}{
		{"count without array", groups, 3, true, 0, 1024, false, kverr.InvalidArgument},
		{"array without count", groups, 0, false, 0, 1024, false, kverr.InvalidArgument},
		{"too many", groups, 65, false, 0, 1024, false, kverr.InvalidArgument},
		{"kind out of range", []testGroup{full, {kind: 300}}, 2, false, 0, 0, false, kverr.InvalidArgument},
		{"window past the context", groups, 3, false, 5, 1024, false, kverr.InvalidArgument},
		{"state past a block", groups, 3, false, 0, 255, false, kverr.InvalidArgument},
		{"first group windowed", []testGroup{win, full}, 2, false, 0, 0, false, kverr.InvalidArgument},
		{"cached states without checkpoints", groups, 3, false, 0, 1024, true, kverr.InvalidArgument},
		{"reserved", []testGroup{full, {kind: 2, stateBytes: 8, checkpoint: 1, spare: 1}}, 2, false, 0, 1024, true, kverr.InvalidArgument},
	} {
		h, st := hookManagerCreateGroups(hookGroupsConfig{numBlocks: 64, blockSize: 4, groups: c.groups, n: c.n, nullGroups: c.null,
			maxModelLen: c.maxLen, blockBytes: c.blockBytes, prefixCache: c.cache})
		expect(t, c.name, st, c.want)
		if h != nil {
			t.Fatalf("%s: a handle came back from a failed create", c.name)
		}
	}
	live, _ := hookLiveHandles(false)
	h, st := hookManagerCreateGroups(hookGroupsConfig{numBlocks: 64, blockSize: 4, groups: groups, n: 3, maxModelLen: 6, blockBytes: 1024})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	if now, _ := hookLiveHandles(false); now != live+1 {
		t.Fatalf("live handles %d -> %d", live, now)
	}
	expect(t, "add", hookManagerAdd(h, 7, 9), kverr.OK)
	ids := cInt64s([]int64{7})
	defer ids.free()
	one := cInt32s([]int32{1})
	defer one.free()
	expect(t, "grow", hookManagerGrow(h, ids, one, 1), kverr.OK)
	if _, _, _, st := hookDescribeGroups(h, []int64{7}, 2, 4, 8); st != abiStatus(kverr.InvalidArgument) {
		t.Fatalf("describe with 2 of 3 groups: %s", statusName(st))
	}
	if _, _, _, st := hookDescribeGroups(h, []int64{7}, 3, 2, 8); st != abiStatus(kverr.BufferTooSmall) {
		t.Fatalf("describe into 2 columns: %s", statusName(st))
	}
	tables, slots, ns, st := hookDescribeGroups(h, []int64{7}, 3, 4, 8)
	expect(t, "describe groups", st, kverr.OK)
	// Length 10 after the grow from 9: the window of 5 reads from token 5
	// (block 1), so block 0 of group 1 is gone; group 2 is one state.
	if ns != 1 || tables[1][0] != -1 || tables[1][1] < 0 || tables[1][2] < 0 || tables[1][3] != -1 ||
		tables[2][0] < 0 || tables[2][1] != -1 || tables[0][0] < 0 || tables[0][2] < 0 || tables[0][3] != -1 {
		t.Fatalf("tables %v, %d slots", tables, ns)
	}
	for g := range 2 {
		if slots[g][0] != tables[g][2]*4+1 {
			t.Fatalf("group %d slot %d, table %v", g, slots[g][0], tables[g])
		}
	}
	gb, n, st := hookGroupBlocks(h, 2)
	if st != abiStatus(kverr.BufferTooSmall) || n != 3 {
		t.Fatalf("group blocks into 2: %s, %d groups", statusName(st), n)
	}
	gb, n, st = hookGroupBlocks(h, 3)
	expect(t, "group blocks", st, kverr.OK)
	if n != 3 || gb[0] != 3 || gb[1] != 2 || gb[2] != 1 {
		t.Fatalf("group blocks %v (%d groups)", gb, n)
	}
	// A manager without groups has one.
	plain := newManager(t, 8, 4)
	defer hookManagerDestroy(plain)
	if gb, n, st := hookGroupBlocks(plain, 1); st != 0 || n != 1 || gb[0] != 0 {
		t.Fatalf("plain manager: %v %d %s", gb, n, statusName(st))
	}
}

// A recurrent group in the prefix cache: mark_computed queues a
// checkpoint's copy, take_copies hands it out (a capacity of 0 takes none),
// and a hit's state copy follows it.
func TestTakeCopiesABI(t *testing.T) {
	lockThread(t)
	groups := []testGroup{{kind: 0}, {kind: 2, stateBytes: 64, checkpoint: 1}}
	h, st := hookManagerCreateGroups(hookGroupsConfig{numBlocks: 32, blockSize: 4, groups: groups, n: 2, blockBytes: 64, prefixCache: true})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	if _, _, st := hookTakeCopies(h, 2, true); st != abiStatus(kverr.NullPointer) {
		t.Fatalf("NULL out with a capacity: %s", statusName(st))
	}
	if _, _, st := hookTakeCopies(h, -1, false); st != abiStatus(kverr.InvalidArgument) {
		t.Fatalf("capacity -1: %s", statusName(st))
	}
	if got, left, st := hookTakeCopies(h, 0, true); st != 0 || len(got) != 0 || left != 0 {
		t.Fatalf("first take: %v %d %s", got, left, statusName(st))
	}
	toks := []int32{1, 2, 3, 4, 5, 6, 7, 8}
	if _, n, st := hookAdmit(h, []int64{1}, [][]int32{toks}, nil); st != 0 || n != 1 {
		t.Fatalf("admit: %d admitted, %s %s", n, statusName(st), lastError())
	}
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	if got, left, _ := hookTakeCopies(h, 0, true); len(got) != 0 || left != 1 {
		t.Fatalf("capacity 0: %v, %d left", got, left)
	}
	got, left, st := hookTakeCopies(h, 4, false)
	if st != 0 || len(got) != 1 || left != 0 || got[0][0] == got[0][1] {
		t.Fatalf("checkpoint copy: %v, %d left, %s", got, left, statusName(st))
	}
}
