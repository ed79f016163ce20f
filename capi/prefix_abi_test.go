package main

import (
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

func newCachedManager(t testing.TB, blocks, bs int32, events bool) unsafe.Pointer {
	t.Helper()
	lockThread(t)
	h, st := hookManagerCreateCached(blocks, bs, events, 0)
	if st != 0 || h == nil {
		t.Fatalf("create: %s %s", statusName(st), lastError())
	}
	return h
}

func seq(from, n int32) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = from + int32(i)
	}
	return t
}

func TestPrefixCacheThroughABI(t *testing.T) {
	const bs = 4
	h := newCachedManager(t, 32, bs, true)
	defer hookManagerDestroy(h)
	sys := seq(100, 8) // two full blocks
	a := append(slices.Clone(sys), 1, 2)
	b := append(slices.Clone(sys), 3, 4, 5)
	salt := []hookKeys{{salt: []byte("tenant-1")}, {salt: []byte("tenant-1")}}

	// One batch: b starts on the blocks a caches in the same call.
	matched, n, st := hookAdmit(h, []int64{1, 2}, [][]int32{a, b}, salt)
	expect(t, "admit", st, kverr.OK)
	if n != 2 || !slices.Equal(matched, []int32{0, 8}) {
		t.Fatalf("admitted %d, matched %v; want 2, [0 8]", n, matched)
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
	// The admission's step: its forward pass computes the blocks.
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)

	// Another tenant shares nothing; the right one matches, with the
	// partial block of a's third block (tokens 1, 2).
	got, st := hookMatch(h, [][]int32{append(slices.Clone(sys), 9), append(slices.Clone(sys), 1, 2, 7)},
		[]hookKeys{{salt: []byte("tenant-2")}, {salt: []byte("tenant-1")}}, true)
	expect(t, "match", st, kverr.OK)
	if got[0] != [3]int32{0, -1, 0} || got[1][0] != 8 {
		t.Fatalf("match: %v", got)
	}

	// Decode a to fill its third block: it is cached.
	expect(t, "grow tokens", hookGrowTokens(h, []int64{1}, []int32{2}, []int32{6, 7}, false), kverr.OK)
	stats, st := hookPrefixStats(h, 0)
	expect(t, "stats", st, kverr.OK)
	if stats[2] != 3 || stats[0] != 4 || stats[1] != 16 {
		t.Fatalf("stats (queries, hits, cached, evictable, evictions) %v; want 4 queries, 16 hit tokens, 3 cached", stats)
	}
	// The decode step's forward pass: Pin covers only computed blocks, and
	// the removal below keeps a's third block cached only once computed.
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)

	id, nb, st := hookPin(h, sys, salt[:1])
	expect(t, "pin", st, kverr.OK)
	if nb != 2 {
		t.Fatalf("pinned %d blocks", nb)
	}
	nb, st = hookSetPriority(h, sys, 3)
	expect(t, "set priority of an unsalted prefix", st, kverr.NotFound)
	if _, st = hookClearPrefixCache(h); st != int(kverr.InvalidArgument) {
		t.Fatalf("clear with live sequences: %s", statusName(st))
	}
	expect(t, "remove", hookManagerRemove(h, cInt64sTmp(t, 1, 2), 2), kverr.OK)
	stats, _ = hookPrefixStats(h, 0)
	if stats[2] != 3 || stats[3] != 1 { // a's third block evictable, the pinned two not
		t.Fatalf("after remove: %v; want 3 cached, 1 evictable", stats)
	}
	expect(t, "unpin", hookUnpin(h, id), kverr.OK)
	expect(t, "unpin twice", hookUnpin(h, id), kverr.NotFound)

	// The events: three blocks stored; the first's hash is the chain's.
	evs, st := hookDrain(h, 64, 1024, 16, 64)
	expect(t, "drain", st, kverr.OK)
	if len(evs) != 3 {
		t.Fatalf("%d events, want 3", len(evs))
	}
	var hs prefix.Hasher
	chain, err := hs.Chain(nil, append(slices.Clone(a), 6, 7), bs, &prefix.Keys{Salt: []byte("tenant-1")})
	if err != nil {
		t.Fatal(err)
	}
	for i, ev := range evs {
		if ev.kind != 1 || ev.hash != chain[i] || (i > 0 && ev.parent != chain[i-1]) {
			t.Fatalf("event %d: kind %d hash %x parent %x; chain says %s", i, ev.kind, ev.hash, ev.parent, chain[i])
		}
	}
	if !slices.Equal(evs[2].tokens, []int32{1, 2, 6, 7}) {
		t.Fatalf("third block's tokens %v", evs[2].tokens)
	}
	if evs, _ := hookDrain(h, 64, 1024, 16, 64); len(evs) != 0 {
		t.Fatalf("a second drain returned %d events", len(evs))
	}

	freed, st := hookClearPrefixCache(h)
	expect(t, "clear", st, kverr.OK)
	if freed != 3 {
		t.Fatalf("clear freed %d", freed)
	}
	evs, _ = hookDrain(h, 4, 0, 0, 0)
	if len(evs) != 1 || evs[0].kind != 3 {
		t.Fatalf("after clear: %+v", evs)
	}
	expect(t, "stats reset", hookPrefixStatsReset(h), kverr.OK)
	if stats, _ = hookPrefixStats(h, 0); stats[0] != 0 || stats[1] != 0 {
		t.Fatalf("after reset: %v", stats)
	}
}

// cInt64sTmp is cInt64s freed at the end of the test.
func cInt64sTmp(t *testing.T, v ...int64) cbuf {
	b := cInt64s(v)
	t.Cleanup(b.free)
	return b
}

func TestPrefixABIBadInput(t *testing.T) {
	const bs = 4
	h := newCachedManager(t, 8, bs, true)
	defer hookManagerDestroy(h)
	_, _, st := hookAdmit(h, []int64{1}, [][]int32{seq(0, 9)}, nil)
	expect(t, "admit", st, kverr.OK)
	before, _ := hookManagerStats(h, sizeofManagerStats())
	pstats, _ := hookPrefixStats(h, 0)

	ids := cInt64sTmp(t, 5)
	toks := cInt32s(seq(0, 4))
	defer toks.free()
	offs := cInt64s([]int64{0, 4})
	defer offs.free()
	bad := cInt64s([]int64{3, 2})
	defer bad.free()
	huge := cInt64s([]int64{0, 1 << 40})
	defer huge.free()
	null := cbuf{}
	expect(t, "admit NULL ids", hookAdmitRaw(h, null, 1, toks, offs, true), kverr.NullPointer)
	expect(t, "admit NULL num_admitted", hookAdmitRaw(h, ids, 1, toks, offs, false), kverr.NullPointer)
	expect(t, "admit NULL offsets", hookAdmitRaw(h, ids, 1, toks, null, true), kverr.NullPointer)
	expect(t, "admit NULL tokens", hookAdmitRaw(h, ids, 1, null, offs, true), kverr.NullPointer)
	expect(t, "admit n 0", hookAdmitRaw(h, ids, 0, toks, offs, true), kverr.InvalidArgument)
	expect(t, "admit offsets decrease", hookAdmitRaw(h, ids, 1, toks, bad, true), kverr.InvalidArgument)
	expect(t, "admit offsets past 2^30 a prompt", hookAdmitRaw(h, ids, 1, toks, huge, true), kverr.InvalidArgument)
	_, _, st = hookAdmit(h, []int64{1}, [][]int32{seq(0, 3)}, nil)
	expect(t, "admit a live id", st, kverr.DuplicateSequence)
	_, _, st = hookAdmit(h, []int64{6}, [][]int32{seq(0, 3)}, []hookKeys{{salt: make([]byte, 1025)}})
	expect(t, "admit salt too long", st, kverr.InvalidArgument)
	_, _, st = hookAdmit(h, []int64{6}, [][]int32{seq(0, 3)}, []hookKeys{{mm: [][3]int32{{0, 1, 7}}, nullMM: true}})
	expect(t, "admit NULL mm", st, kverr.NullPointer)
	_, _, st = hookAdmit(h, []int64{6}, [][]int32{seq(0, 3)}, []hookKeys{{mm: [][3]int32{{1, 1, 7}, {0, 1, 8}}}})
	expect(t, "admit mm out of order", st, kverr.InvalidArgument)
	_, _, st = hookAdmit(h, []int64{6}, [][]int32{seq(0, 3)}, []hookKeys{{mm: [][3]int32{{0, 1, 7}}, numMM: -1}})
	expect(t, "admit negative num_mm", st, kverr.InvalidArgument)
	expect(t, "grow tokens NULL tokens", hookGrowTokens(h, []int64{1}, []int32{2}, []int32{1, 2}, true), kverr.NullPointer)
	expect(t, "grow tokens unknown id", hookGrowTokens(h, []int64{9}, []int32{2}, []int32{1, 2}, false), kverr.UnknownSequence)
	expect(t, "grow tokens past the pool", hookGrowTokens(h, []int64{1}, []int32{40}, seq(0, 40), false), kverr.OutOfBlocks)
	_, _, st = hookPin(h, seq(50, 8), nil)
	expect(t, "pin an uncached prefix", st, kverr.NotFound)
	expect(t, "unpin unknown", hookUnpin(h, 12345), kverr.NotFound)
	_, st = hookPrefixStats(h, 8)
	expect(t, "prefix stats struct_size too small", st, kverr.StructSize)
	_, st = hookDrain(h, 0, 16, 0, 0)
	expect(t, "drain max_events 0", st, kverr.InvalidArgument)
	_, st = hookDrain(h, 4, bs-1, 0, 0)
	expect(t, "drain tokens too small", st, kverr.BufferTooSmall)
	// Nothing changed, and the events are all still there.
	after, _ := hookManagerStats(h, sizeofManagerStats())
	pafter, _ := hookPrefixStats(h, 0)
	if after != before || pafter != pstats {
		t.Fatalf("bad input changed the manager: %v -> %v, %v -> %v", before, after, pstats, pafter)
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
	if evs, _ := hookDrain(h, 8, 64, 0, 0); len(evs) != 2 {
		t.Fatalf("%d events after failed calls, want 2", len(evs))
	}
}

// The header's chunked-prefill flow through the ABI: the first chunk ends
// inside an image whose item admit takes whole; the image's blocks are
// cached with it.
func TestPrefixABIChunkedPrefillThroughAnImage(t *testing.T) {
	const bs = 16
	h := newCachedManager(t, 64, bs, false)
	defer hookManagerDestroy(h)
	p := append(seq(0, 48), make([]int32, 32)...) // placeholders at [48, 80)
	for i := 48; i < 80; i++ {
		p[i] = -1
	}
	p = append(p, seq(100, 10)...)
	img := []hookKeys{{mm: [][3]int32{{48, 32, 0x11}}}}
	_, n, st := hookAdmit(h, []int64{1}, [][]int32{p[:40]}, img)
	expect(t, "admit a chunk that ends inside an image", st, kverr.OK)
	if n != 1 {
		t.Fatalf("admitted %d", n)
	}
	expect(t, "grow tokens", hookGrowTokens(h, []int64{1}, []int32{50}, p[40:], false), kverr.OK)
	got, st := hookMatch(h, [][]int32{p, p, p}, []hookKeys{{}, img[0], {mm: [][3]int32{{48, 32, 0x22}}}}, false)
	expect(t, "match", st, kverr.OK)
	if got[0][0] != 48 || got[1][0] != 80 || got[2][0] != 48 {
		t.Fatalf("matched text-only %d, the image %d, another image %d; want 48, 80, 48", got[0][0], got[1][0], got[2][0])
	}

	// Items for tokens to come; refusals change nothing.
	_, _, st = hookAdmit(h, []int64{2}, [][]int32{seq(500, 20)}, nil)
	expect(t, "admit", st, kverr.OK)
	expect(t, "add items NULL", hookAddMMItems(h, 2, [][3]int32{{20, 4, 1}}, true, 0), kverr.NullPointer)
	expect(t, "add items count -1", hookAddMMItems(h, 2, [][3]int32{{20, 4, 1}}, false, -1), kverr.InvalidArgument)
	expect(t, "add items count past 2^20", hookAddMMItems(h, 2, [][3]int32{{20, 4, 1}}, false, 1<<20+1), kverr.InvalidArgument)
	expect(t, "add items unknown sequence", hookAddMMItems(h, 9, [][3]int32{{20, 4, 1}}, false, 0), kverr.UnknownSequence)
	expect(t, "add items inside a full block", hookAddMMItems(h, 2, [][3]int32{{15, 4, 1}}, false, 0), kverr.InvalidArgument)
	expect(t, "add no items", hookAddMMItems(h, 2, nil, false, 0), kverr.OK)
	expect(t, "add items", hookAddMMItems(h, 2, [][3]int32{{16, 20, 1}}, false, 0), kverr.OK)
	expect(t, "grow tokens", hookGrowTokens(h, []int64{2}, []int32{20}, seq(520, 20), false), kverr.OK)
	whole := append(seq(500, 20), seq(520, 20)...)
	got, _ = hookMatch(h, [][]int32{whole, whole}, []hookKeys{{}, {mm: [][3]int32{{16, 20, 1}}}}, false)
	if got[0][0] != 16 || got[1][0] != 32 {
		t.Fatalf("after add items: text-only matched %d, with the item %d; want 16, 32", got[0][0], got[1][0])
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
}

// A stored block with more multimodal entries than a drain's buffers hold
// is reported whole once they are grown to next_event_size's answer.
func TestPrefixABIDrainsBlocksOfAnySize(t *testing.T) {
	const bs = 2048
	h := newCachedManager(t, 4, bs, true)
	defer hookManagerDestroy(h)
	keys := hookKeys{}
	for i := range int32(1100) {
		keys.mm = append(keys.mm, [3]int32{i, 1, 7})
	}
	_, _, st := hookAdmit(h, []int64{1}, [][]int32{seq(0, bs+1)}, []hookKeys{keys})
	expect(t, "admit", st, kverr.OK)
	_, st = hookDrain(h, 16, 4*bs, 1024, 16)
	expect(t, "drain into 1024 entries", st, kverr.BufferTooSmall)
	if msg := lastError(); !strings.Contains(msg, "1100 multimodal entries (the mm buffer holds 1024)") {
		t.Fatalf("the message does not say which buffer: %q", msg)
	}
	size, st := hookNextEventSize(h)
	expect(t, "next event size", st, kverr.OK)
	if size != [3]int32{bs, 1100, 0} {
		t.Fatalf("next event size %v, want [%d 1100 0]", size, bs)
	}
	evs, st := hookDrain(h, 16, size[0], size[1], 16)
	expect(t, "drain", st, kverr.OK)
	if len(evs) != 1 || evs[0].mm != 1100 || len(evs[0].tokens) != bs {
		t.Fatalf("drained %d events, the first with %d entries", len(evs), evs[0].mm)
	}
	if size, _ = hookNextEventSize(h); size != [3]int32{} {
		t.Fatalf("nothing pending, yet next event size %v", size)
	}
	off := newCachedManager(t, 4, 4, false)
	defer hookManagerDestroy(off)
	_, st = hookNextEventSize(off)
	expect(t, "next event size without events", st, kverr.InvalidArgument)
}

func TestManagerConfigOfTheFirstVersion(t *testing.T) {
	// A host built when the config ended at block_size gets no cache.
	first := unsafe.Sizeof(uintptr(0)) + 8
	h, st := hookManagerCreateCached(8, 4, false, first)
	expect(t, "create with the first config's size", st, kverr.OK)
	defer hookManagerDestroy(h)
	matched, n, st := hookAdmit(h, []int64{1, 2}, [][]int32{seq(0, 9), seq(0, 9)}, nil)
	expect(t, "admit without cache", st, kverr.OK)
	if n != 2 || matched[1] != 0 {
		t.Fatalf("admitted %d, matched %v: a cache is on", n, matched)
	}
	_, _, st = hookPin(h, seq(0, 8), nil)
	expect(t, "pin without cache", st, kverr.InvalidArgument)
	_, st = hookDrain(h, 4, 16, 0, 0)
	expect(t, "drain without events", st, kverr.InvalidArgument)
}

// FuzzPrefixABI drives admit, match, grow_tokens, pin and remove with
// arbitrary prompts, offsets and keys: every call returns a known status
// with a message on failure, and the invariants hold after each.
func FuzzPrefixABI(f *testing.F) {
	f.Add([]byte{0, 3, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 1})
	f.Add([]byte{0, 1, 200, 1, 1, 1, 1, 1, 3, 0, 2, 4, 4, 1, 1})
	// A remove refused with KVP_ERR_IN_USE (a sharer of blocks no forward
	// pass computed yet), a status the check once did not know.
	f.Add([]byte("0010000000000010000000000000000000000010000000000000000000000071000000000001200000000001000000000000000020000000000100010000000000190000000000000000010011000000000100&000070A\"1710000000000000101710000020CA"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := byteReader(data)
		bs := int32(r.u8()%5) + 1
		h := newCachedManager(t, 24, bs, r.u8()%2 == 0)
		defer hookManagerDestroy(h)
		prompt := func() []int32 {
			p := make([]int32, r.u8()%20)
			for i := range p {
				p[i] = int32(r.u8() % 4)
			}
			return p
		}
		keys := func() []hookKeys {
			switch r.u8() % 4 {
			case 0:
				return nil
			case 1:
				return []hookKeys{{salt: []byte{r.u8()}}}
			case 2:
				return []hookKeys{{adapter: uint64(r.u8() % 2)}}
			}
			return []hookKeys{{mm: [][3]int32{{int32(r.u8() % 8), int32(r.u8()%4) - 1, 1}}}}
		}
		for !r.done() {
			op := r.u8() % 8
			var st abiStatus
			switch op {
			case 0:
				_, _, st = hookAdmit(h, []int64{int64(r.u8() % 6)}, [][]int32{prompt()}, keys())
			case 1:
				_, st = hookMatch(h, [][]int32{prompt()}, keys(), r.u8()%2 == 0)
			case 2:
				c := int32(r.u8()%9) - 1
				st = hookGrowTokens(h, []int64{int64(r.u8() % 6)}, []int32{c}, seq(0, max(c, 0)), false)
			case 3:
				st = hookManagerRemove(h, cInt64sTmp(t, int64(r.u8()%6)), 1)
			case 4:
				var id uint64
				id, _, st = hookPin(h, prompt(), keys())
				if st == 0 && r.u8()%2 == 0 {
					st = hookUnpin(h, id)
				}
			case 5:
				_, st = hookDrain(h, int32(r.u8()%4), int32(r.u8()%12), 2, int32(r.u8()%3))
			case 6:
				st = hookAddMMItems(h, int64(r.u8()%6), [][3]int32{{int32(r.u8() % 24), int32(r.u8()%4) - 1, 2}}, r.u8()%8 == 0, 0)
			case 7:
				_, st = hookNextEventSize(h)
			}
			fuzzCheck(t, h, op, st)
		}
	})
}

// systemPromptRunning is a manager of 32 blocks of 4 tokens with the
// prefix cache, and sequence 1 running on a system prompt of 2 blocks and 2
// tokens more, computed (3 blocks).
func systemPromptRunning(t *testing.T) (unsafe.Pointer, []int32) {
	h := newCachedManager(t, 32, 4, true)
	sys := seq(100, 8)
	_, n, st := hookAdmit(h, []int64{1}, [][]int32{append(slices.Clone(sys), 1, 2)}, nil)
	expect(t, "admit", st, kverr.OK)
	if n != 1 {
		t.Fatalf("admitted %d", n)
	}
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	return h, sys
}

// kvp_manager_match_blocks writes kvmanager.BlockMatch's layout: a
// manager without groups answers its hit twice; NULL out is refused.
func TestMatchBlocksThroughABI(t *testing.T) {
	var bm kvmanager.BlockMatch
	if offsetofBlockMatchBlocks() != unsafe.Offsetof(bm.BlockTokens) {
		t.Fatalf("kvp_block_match's block_tokens at %d, kvmanager.BlockMatch's at %d", offsetofBlockMatchBlocks(), unsafe.Offsetof(bm.BlockTokens))
	}
	h, sys := systemPromptRunning(t)
	defer hookManagerDestroy(h)
	got, st := hookMatchBlocks(h, [][]int32{append(slices.Clone(sys), 9), {5}}, false)
	expect(t, "match blocks", st, kverr.OK)
	if got[0] != [2]int32{8, 8} || got[1] != [2]int32{0, 0} {
		t.Fatalf("match blocks: %v, want [8 8] and [0 0]", got)
	}
	_, st = hookMatchBlocks(h, [][]int32{sys}, true)
	expect(t, "match blocks NULL out", st, kverr.NullPointer)
}

// kvp_manager_match_room: a hit that a running sequence holds costs
// nothing, one that nothing holds its blocks; NULL room is refused.
func TestMatchRoomThroughABI(t *testing.T) {
	h, sys := systemPromptRunning(t)
	defer hookManagerDestroy(h)
	got, st := hookMatchRoom(h, [][]int32{append(slices.Clone(sys), 9), {5}}, false)
	expect(t, "match room", st, kverr.OK)
	if got[0] != 29 || got[1] != 29 {
		t.Fatalf("match room while seq 1 runs: %v, want [29 29]", got)
	}
	expect(t, "remove", hookManagerRemove(h, cInt64sTmp(t, 1), 1), kverr.OK)
	got, st = hookMatchRoom(h, [][]int32{append(slices.Clone(sys), 9), {5}}, false)
	expect(t, "match room", st, kverr.OK)
	if got[0] != 30 || got[1] != 32 {
		t.Fatalf("match room after seq 1: %v, want [30 32]", got)
	}
	_, st = hookMatchRoom(h, [][]int32{sys}, true)
	expect(t, "match room NULL room", st, kverr.NullPointer)
}
