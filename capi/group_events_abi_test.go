package main

import (
	"slices"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvevents"
)

// groupEventsWorkload runs, on a manager of 40 blocks of 4 tokens with a
// full-attention group and a window of 8 tokens: a conversation of 10
// blocks that decodes a token (its window slides past 8 blocks), ends,
// and a prompt of 12 blocks that evicts 4 of those window blocks alone.
func groupEventsWorkload(t *testing.T, h unsafe.Pointer) {
	t.Helper()
	if _, n, st := hookAdmit(h, []int64{1}, [][]int32{seq(0, 40)}, nil); st != 0 || n != 1 {
		t.Fatalf("admit 1: %d, %s %s", n, statusName(st), lastError())
	}
	expect(t, "grow tokens", hookGrowTokens(h, []int64{1}, []int32{1}, []int32{99}, false), kverr.OK)
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	expect(t, "remove 1", hookManagerRemove(h, cInt64sTmp(t, 1), 1), kverr.OK)
	if _, n, st := hookAdmit(h, []int64{2}, [][]int32{seq(1000, 48)}, nil); st != 0 || n != 1 {
		t.Fatalf("admit 2: %d, %s %s", n, statusName(st), lastError())
	}
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	expect(t, "remove 2", hookManagerRemove(h, cInt64sTmp(t, 2), 1), kverr.OK)
	expect(t, "check", hookManagerCheck(h), kverr.OK)
}

// groupEventsConfig is the manager of these tests: 40 blocks of 4 tokens,
// the prefix cache and KV events on.
func groupEventsConfig(groups []testGroup) hookGroupsConfig {
	return hookGroupsConfig{numBlocks: 40, blockSize: 4, groups: groups, n: int32(len(groups)), prefixCache: true, events: true}
}

func TestDrainGroupEventsABI(t *testing.T) {
	lockThread(t)
	if size, evSize, ev, group, reserved := kvGroupEventLayout(); ev != 0 || group != evSize || reserved != evSize+4 || size != evSize+8 {
		t.Fatalf("kvp_kv_group_event: size %d, event at %d, group at %d, reserved at %d (kvp_kv_event %d)", size, ev, group, reserved, evSize)
	}
	groups := []testGroup{{kind: 0}, {kind: 1, window: 8}}
	h, st := hookManagerCreateGroups(groupEventsConfig(groups))
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	groupEventsWorkload(t, h)

	_, st = hookDrainGroups(h, 4, 64, 0, 4, true)
	expect(t, "NULL events", st, kverr.NullPointer)
	_, st = hookDrainGroups(h, 0, 64, 0, 4, false)
	expect(t, "max_events 0", st, kverr.InvalidArgument)
	_, st = hookDrainGroups(h, 4, 64, -1, 4, false)
	expect(t, "max_mm -1", st, kverr.InvalidArgument)
	_, st = hookDrainGroups(nil, 4, 64, 0, 4, false)
	expect(t, "NULL manager", st, kverr.InvalidHandle)
	_, st = hookNextGroupEventSize(nil)
	expect(t, "next size of a NULL manager", st, kverr.InvalidHandle)
	before, st := hookNextGroupEventSize(h)
	expect(t, "next group event size", st, kverr.OK)
	if before != [3]int32{4, 0, 0} {
		t.Fatalf("next group event size %v, want a stored block's [4 0 0]", before)
	}
	_, st = hookDrainGroups(h, 4, 3, 0, 4, false)
	expect(t, "tokens below a block", st, kverr.BufferTooSmall)
	if after, _ := hookNextGroupEventSize(h); after != before {
		t.Fatalf("a refused drain changed the next event: %v, then %v", before, after)
	}

	sets := [2]map[[16]byte]bool{{}, {}}
	alone, removals := 0, 0
	for {
		evs, st := hookDrainGroups(h, 3, 8, 0, 2, false)
		expect(t, "drain group events", st, kverr.OK)
		if len(evs) == 0 {
			break
		}
		for _, ev := range evs {
			if ev.group < 0 || ev.group > 1 || ev.reserved != 0 || ev.medium != 0 {
				t.Fatalf("event %+v: group %d, reserved %d, medium %d", ev.hookEvent, ev.group, ev.reserved, ev.medium)
			}
			set := sets[ev.group]
			switch ev.kind {
			case hookStored:
				if set[ev.hash] || ev.group == 1 && !sets[0][ev.hash] || len(ev.tokens) != 4 {
					t.Fatalf("group %d stores %x (stored %v, in group 0 %v) with %d tokens", ev.group, ev.hash, set[ev.hash], sets[0][ev.hash], len(ev.tokens))
				}
				set[ev.hash] = true
			case hookRemoved:
				for _, hs := range ev.hashes {
					if !set[hs] {
						t.Fatalf("group %d removes %x, not stored", ev.group, hs)
					}
					if ev.group == 1 && sets[0][hs] {
						alone++
					}
					delete(set, hs)
					removals++
				}
			default:
				t.Fatalf("event kind %d", ev.kind)
			}
		}
	}
	if len(sets[0]) != 22 || len(sets[1]) != 18 || alone != 4 || removals != 4 {
		t.Fatalf("group 0 keeps %d blocks, group 1 %d, %d of %d removals alone; want 22, 18, 4 of 4", len(sets[0]), len(sets[1]), alone, removals)
	}
	if size, _ := hookNextGroupEventSize(h); size != [3]int32{} {
		t.Fatalf("drained, yet next group event size %v", size)
	}
	if cached, _ := hookPrefixStats(h, 0); cached[2] != 22 {
		t.Fatalf("the cache holds %d blocks, the events say 22", cached[2])
	}

	// The same run drained with kvp_manager_drain_events: group 0's events
	// only, the others passed over and gone.
	h2, st := hookManagerCreateGroups(groupEventsConfig(groups))
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h2)
	groupEventsWorkload(t, h2)
	old := map[[16]byte]bool{}
	for {
		evs, st := hookDrain(h2, 3, 8, 0, 2)
		expect(t, "drain events", st, kverr.OK)
		if len(evs) == 0 {
			break
		}
		for _, ev := range evs {
			if ev.kind != hookStored || old[ev.hash] || !sets[0][ev.hash] {
				t.Fatalf("the old drain gave %+v (stored before %v)", ev, old[ev.hash])
			}
			old[ev.hash] = true
		}
	}
	if len(old) != 22 {
		t.Fatalf("the old drain reported %d blocks, want group 0's 22", len(old))
	}
	if evs, _ := hookDrainGroups(h2, 4, 64, 0, 4, false); len(evs) != 0 {
		t.Fatalf("after the old drain, %d events of other groups are left", len(evs))
	}
}

// The old and the new drain pass each other's events in order: group 0's
// events taken by kvp_manager_drain_events leave the group drain the
// others that came after them.
func TestDrainGroupEventsInterleavedABI(t *testing.T) {
	lockThread(t)
	h, st := hookManagerCreateGroups(groupEventsConfig([]testGroup{{kind: 0}, {kind: 1, window: 8}}))
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	if _, n, st := hookAdmit(h, []int64{1}, [][]int32{seq(0, 9)}, nil); st != 0 || n != 1 {
		t.Fatalf("admit: %d, %s", n, statusName(st))
	}
	// Pending: group 0's two blocks, then group 1's.
	evs, st := hookDrain(h, 1, 8, 0, 0)
	expect(t, "old drain", st, kverr.OK)
	if len(evs) != 1 || evs[0].kind != hookStored {
		t.Fatalf("old drain: %+v", evs)
	}
	size, _ := hookNextEventSize(h)
	gsize, _ := hookNextGroupEventSize(h)
	if size != [3]int32{4, 0, 0} || gsize != [3]int32{4, 0, 0} {
		t.Fatalf("next sizes %v and %v", size, gsize)
	}
	got, st := hookDrainGroups(h, 8, 64, 0, 4, false)
	expect(t, "group drain", st, kverr.OK)
	var groups []int32
	for _, ev := range got {
		groups = append(groups, ev.group)
	}
	if !slices.Equal(groups, []int32{0, 1, 1}) || got[0].hash == evs[0].hash || got[1].hash != evs[0].hash {
		t.Fatalf("group drain after the old one: groups %v", groups)
	}
}

// Without layer groups kvp_manager_drain_group_events gives what
// kvp_manager_drain_events gives, every event of group 0; without events
// both new calls refuse.
func TestDrainGroupEventsWithoutGroupsABI(t *testing.T) {
	run := func(group bool) []hookGroupEvent {
		h := newCachedManager(t, 16, 4, true)
		defer hookManagerDestroy(h)
		if _, _, st := hookAdmit(h, []int64{1}, [][]int32{seq(0, 21)}, nil); st != 0 {
			t.Fatal(statusName(st))
		}
		expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
		expect(t, "remove", hookManagerRemove(h, cInt64sTmp(t, 1), 1), kverr.OK)
		if _, _, st := hookAdmit(h, []int64{2}, [][]int32{seq(500, 60)}, nil); st != 0 {
			t.Fatal(statusName(st))
		}
		var out []hookGroupEvent
		for {
			var evs []hookGroupEvent
			if group {
				var st abiStatus
				evs, st = hookDrainGroups(h, 2, 8, 0, 3, false)
				expect(t, "group drain", st, kverr.OK)
			} else {
				plain, st := hookDrain(h, 2, 8, 0, 3)
				expect(t, "drain", st, kverr.OK)
				for _, e := range plain {
					evs = append(evs, hookGroupEvent{hookEvent: e})
				}
			}
			if len(evs) == 0 {
				return out
			}
			out = append(out, evs...)
		}
	}
	a, b := run(false), run(true)
	if len(a) == 0 || len(a) != len(b) {
		t.Fatalf("%d events from the old drain, %d from the group drain", len(a), len(b))
	}
	for i := range a {
		if a[i].kind != b[i].kind || a[i].hash != b[i].hash || !slices.Equal(a[i].hashes, b[i].hashes) || b[i].group != 0 || b[i].reserved != 0 {
			t.Fatalf("event %d: %+v and %+v", i, a[i], b[i])
		}
	}
	off := newCachedManager(t, 8, 4, false)
	defer hookManagerDestroy(off)
	_, st := hookDrainGroups(off, 4, 16, 0, 0, false)
	expect(t, "group drain without events", st, kverr.InvalidArgument)
	_, st = hookNextGroupEventSize(off)
	expect(t, "next group event size without events", st, kverr.InvalidArgument)
}

// A publisher of a manager with layer groups sends every group's events
// with vLLM's group_idx, and a BlockStored with its group's spec; the
// window's blocks evicted alone go out as group 1's removals.
func TestPublisherPublishesGroupEvents(t *testing.T) {
	lockThread(t)
	m, st := hookManagerCreateGroups(groupEventsConfig([]testGroup{{kind: 0}, {kind: 1, window: 8}}))
	expect(t, "create manager", st, kverr.OK)
	defer hookManagerDestroy(m)
	cfg := loopbackPub()
	cfg.format = 1 // positional: group_idx in vLLM's place
	cfg.flushUS = 60_000_000
	p, st := hookPublisherCreate(m, cfg)
	expect(t, "create", st, kverr.OK)
	defer hookPublisherDestroy(p)
	sub, _, _ := subscribe(t, p, "")
	defer sub.Close()
	groupEventsWorkload(t, m)
	expect(t, "flush", hookPublisherFlush(p), kverr.OK)
	sets := [2]map[kvevents.Key]bool{{}, {}}
	alone := 0
	for len(sets[0]) < 22 || len(sets[1]) < 18 || alone < 4 {
		_, b := recvBatch(t, sub)
		for _, ev := range b.Events {
			g := ev.Group()
			if ev.Kind == kvevents.KindCleared || ev.GroupIdx == nil || g < 0 || g > 1 {
				t.Fatalf("event %+v", ev)
			}
			switch ev.Kind {
			case kvevents.KindStored:
				if want := []string{kvevents.SpecFullAttention, kvevents.SpecSlidingWindow}[g]; ev.SpecKind == nil || *ev.SpecKind != want ||
					(g == 1) != (ev.SlidingWindow != nil && *ev.SlidingWindow == 8) {
					t.Fatalf("group %d's BlockStored: kind %v, window %v", g, ev.SpecKind, ev.SlidingWindow)
				}
				for _, h := range ev.Hashes {
					sets[g][h] = true
				}
			case kvevents.KindRemoved:
				for _, h := range ev.Hashes {
					if g == 1 && sets[0][h] {
						alone++
					}
					delete(sets[g], h)
				}
			}
		}
	}
	if len(sets[0]) != 22 || len(sets[1]) != 18 || alone != 4 {
		t.Fatalf("the wire says %d and %d blocks, %d removed alone", len(sets[0]), len(sets[1]), alone)
	}
}
