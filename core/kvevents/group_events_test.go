package kvevents

import (
	"bytes"
	"testing"

	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/tinylib/msgp/msgp"
)

// groupEvents: a chain of two blocks in group 0, the same two in group 1
// (a window of 8), one of them removed from group 1 alone, and group 0's
// removal.
func groupEvents() []prefix.Event {
	h := func(b byte) prefix.Hash { return prefix.Hash{b, 15: b} }
	return []prefix.Event{
		{Kind: prefix.BlockStored, Hash: h(1), Tokens: []int32{1, 2}, BlockSize: 2},
		{Kind: prefix.BlockStored, Hash: h(2), Parent: h(1), Tokens: []int32{3, 4}, BlockSize: 2},
		{Kind: prefix.BlockStored, Hash: h(1), Tokens: []int32{1, 2}, BlockSize: 2, Group: 1},
		{Kind: prefix.BlockStored, Hash: h(2), Parent: h(1), Tokens: []int32{3, 4}, BlockSize: 2, Group: 1},
		{Kind: prefix.BlockStored, Hash: h(2), Parent: h(1), Tokens: []int32{3, 4}, BlockSize: 2, Group: 2},
		{Kind: prefix.BlockRemoved, Hashes: []prefix.Hash{h(1)}, Group: 1},
		{Kind: prefix.BlockRemoved, Hashes: []prefix.Hash{h(2), h(1)}},
	}
}

var groupSpecs = []GroupSpec{{Kind: SpecFullAttention}, {Kind: SpecSlidingWindow, SlidingWindow: 8}, {Kind: SpecMamba}}

// rawEvents returns the element counts of a positional batch's events and
// their elements (nil, ints and strings; arrays skipped).
func rawEvents(t *testing.T, p []byte) [][]any {
	t.Helper()
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil || n < 2 {
		t.Fatalf("batch header: %d, %v", n, err)
	}
	if p, err = msgp.Skip(p); err != nil {
		t.Fatal(err)
	}
	ne, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]any
	for range ne {
		nf, q, err := msgp.ReadArrayHeaderBytes(p)
		if err != nil {
			t.Fatal(err)
		}
		p = q
		var fields []any
		for range nf {
			var v any
			switch msgp.NextType(p) {
			case msgp.NilType:
				p, err = msgp.ReadNilBytes(p)
			case msgp.IntType, msgp.UintType:
				v, p, err = msgp.ReadInt64Bytes(p)
			case msgp.StrType:
				v, p, err = msgp.ReadStringBytes(p)
			default:
				v = "?"
				p, err = msgp.Skip(p)
			}
			if err != nil {
				t.Fatal(err)
			}
			fields = append(fields, v)
		}
		out = append(out, fields)
	}
	return out
}

// With groups, every BlockStored and BlockRemoved carries vLLM's group_idx
// and a BlockStored its group's kv_cache_spec_kind and
// kv_cache_spec_sliding_window, at vLLM's places in the positional form
// (BlockStored's 9th field after its tag, BlockRemoved's 3rd, as vLLM's
// kv_events.py orders them); chains merge within a group only; without
// groups none of these fields is sent.
func TestWireGroups(t *testing.T) {
	for _, f := range []Format{FormatMap, FormatArray} {
		e := NewEncoder(Encoding{Format: f, DPRank: -1, Groups: groupSpecs})
		payload := bytes.Clone(e.Encode(1, groupEvents()))
		b, err := Decode(payload)
		if err != nil {
			t.Fatal(err)
		}
		want := []struct {
			kind, hashes int
			group        int64
			spec         string
			window       int64
		}{{KindStored, 2, 0, SpecFullAttention, 0}, {KindStored, 2, 1, SpecSlidingWindow, 8}, {KindStored, 1, 2, SpecMamba, 0},
			{KindRemoved, 1, 1, "", 0}, {KindRemoved, 2, 0, "", 0}}
		if len(b.Events) != len(want) {
			t.Fatalf("format %d: %d events, want %d", f, len(b.Events), len(want))
		}
		for i, w := range want {
			ev := b.Events[i]
			if ev.Kind != w.kind || len(ev.Hashes) != w.hashes || ev.GroupIdx == nil || ev.Group() != w.group {
				t.Fatalf("format %d: event %d %+v, want %+v", f, i, ev, w)
			}
			if (ev.SpecKind == nil) != (w.spec == "") || w.spec != "" && *ev.SpecKind != w.spec ||
				(ev.SlidingWindow == nil) != (w.window == 0) || w.window != 0 && *ev.SlidingWindow != w.window {
				t.Fatalf("format %d: event %d's spec %v %v, want %q %d", f, i, ev.SpecKind, ev.SlidingWindow, w.spec, w.window)
			}
		}
		if f == FormatArray {
			raw := rawEvents(t, payload)
			// [tag, hashes, parent, tokens, block_size, lora_id, medium,
			// lora_name, extra_keys, group_idx, kind(, window)]
			if len(raw[0]) != 11 || raw[0][8] != nil || raw[0][9] != int64(0) || raw[0][10] != SpecFullAttention ||
				len(raw[1]) != 12 || raw[1][9] != int64(1) || raw[1][11] != int64(8) ||
				len(raw[3]) != 4 || raw[3][0] != "BlockRemoved" || raw[3][3] != int64(1) {
				t.Fatalf("positional fields %v", raw)
			}
		}
		plain, err := Decode(bytes.Clone(NewEncoder(Encoding{Format: f, DPRank: -1}).Encode(1, groupEvents()[:2])))
		if err != nil {
			t.Fatal(err)
		}
		if ev := plain.Events[0]; ev.GroupIdx != nil || ev.SpecKind != nil || ev.SlidingWindow != nil {
			t.Fatalf("format %d: an event without groups carries %v %v %v", f, ev.GroupIdx, ev.SpecKind, ev.SlidingWindow)
		}
	}
}

// A publisher of a manager with layer groups sends every group's blocks:
// a window's blocks evicted alone go out as group 1's BlockRemoved while
// group 0 keeps them, and a subscriber's per-group sets match the
// manager's.
func TestPublishGroupEvents(t *testing.T) {
	const bs, w = 4, 8
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 40, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true,
		Groups: []kvmanager.Group{{Kind: kvmanager.FullAttention}, {Kind: kvmanager.SlidingWindow, Window: w}}})
	if err != nil {
		t.Fatal(err)
	}
	src, err := ManagerSource(m)
	if err != nil {
		t.Fatal(err)
	}
	p := startPub(t, src, Config{Encoding: Encoding{DPRank: -1}})
	s := subscribe(t, p, "")
	admit := func(id int64, toks []int32) {
		if n, err := m.Admit([]int64{id}, kvmanager.Prompts{Tokens: toks, Offsets: []int64{0, int64(len(toks))}}, nil); err != nil || n != 1 {
			t.Fatalf("admit %d: %d, %v", id, n, err)
		}
	}
	admit(1, seqTokens(0, 40)) // 10 blocks a group
	if err := m.GrowTokens([]int64{1}, []int32{1}, []int32{99}); err != nil {
		t.Fatal(err)
	}
	m.MarkComputed()
	if err := m.Remove([]int64{1}); err != nil {
		t.Fatal(err)
	}
	admit(2, seqTokens(1000, 48)) // evicts 4 of group 1's blocks behind the first conversation's window
	sets := map[int64]map[Key]bool{0: {}, 1: {}}
	alone := 0
	for len(sets[0]) < 22 || len(sets[1]) < 18 || alone < 4 {
		_, b := recvBatch(t, p, s)
		for _, ev := range b.Events {
			g := ev.Group()
			if ev.Kind != KindCleared && ev.GroupIdx == nil || g < 0 || g > 1 {
				t.Fatalf("event %+v: group_idx %v", ev, ev.GroupIdx)
			}
			switch ev.Kind {
			case KindStored:
				want := map[int64]string{0: SpecFullAttention, 1: SpecSlidingWindow}[g]
				if ev.SpecKind == nil || *ev.SpecKind != want || (g == 1) != (ev.SlidingWindow != nil && *ev.SlidingWindow == w) {
					t.Fatalf("group %d's stored event: kind %v, window %v", g, ev.SpecKind, ev.SlidingWindow)
				}
				for _, h := range ev.Hashes {
					sets[g][h] = true
				}
			case KindRemoved:
				for _, h := range ev.Hashes {
					if g == 1 && sets[0][h] {
						alone++
					}
					delete(sets[g], h)
				}
			case KindCleared:
				sets = map[int64]map[Key]bool{0: {}, 1: {}}
			}
		}
	}
	if len(sets[0]) != 22 || len(sets[1]) != 18 || alone != 4 {
		t.Fatalf("the events say %d and %d blocks, %d removed alone; want 22, 18 and 4", len(sets[0]), len(sets[1]), alone)
	}
	for h := range sets[1] {
		if !sets[0][h] {
			t.Fatalf("group 1 keeps %x, which group 0 does not", h)
		}
	}
	if src.(GroupedSource).GroupSpecs()[1] != (GroupSpec{Kind: SpecSlidingWindow, SlidingWindow: w}) {
		t.Fatalf("specs %+v", src.(GroupedSource).GroupSpecs())
	}
	plain, err := kvmanager.New(kvmanager.Config{NumBlocks: 8, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	ps, err := ManagerSource(plain)
	if err != nil {
		t.Fatal(err)
	}
	if specs := ps.(GroupedSource).GroupSpecs(); specs != nil {
		t.Fatalf("a manager without groups has specs %+v", specs)
	}
}
