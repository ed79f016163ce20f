package main

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/internal/redistest"
)

const tierBytes = 32

// tableOf returns sequence id's first n GPU blocks.
func tableOf(t *testing.T, h unsafe.Pointer, id int64, n int32) []int32 {
	t.Helper()
	ids, tbl, lens, num := cInt64s([]int64{id}), newCBuf(4*int(n)), newCBuf(4), newCBuf(4)
	defer ids.free()
	defer tbl.free()
	defer lens.free()
	defer num.free()
	expect(t, "describe", hookManagerDescribe(h, ids, 1, tbl, n, lens, cbuf{}, 0, num), kverr.OK)
	return slices32(tbl, int(n))
}

// kvOfBlock is the fake K/V of a prompt's block i.
func kvOfBlock(i int) []byte { return bytes.Repeat([]byte{byte(0xa0 + i)}, tierBytes) }

// The engine's flow through the ABI: a conversation's cached blocks are
// demoted (the test copies fake GPU memory into the host slots the batch
// names), matched in the host tier, and reloaded into new GPU blocks on
// its return (the test copies the slots back); the blocks then hold the
// conversation's K/V.
func TestTierABIDemotesAndReloads(t *testing.T) {
	lockThread(t)
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, slots: 16, ahead: 8, blockBytes: tierBytes})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	mem, slotBytes, nSlots, st := hookHostTierMemory(h)
	expect(t, "host memory", st, kverr.OK)
	if slotBytes != tierBytes || nSlots != 16 || len(mem) != 16*tierBytes {
		t.Fatalf("host memory: %d slots of %d", nSlots, slotBytes)
	}
	slotMem := func(s int32) []byte { return mem[int64(s)*slotBytes : int64(s+1)*slotBytes] }
	gpu := map[int32][]byte{}

	conv := tokenRun(17, 100) // four full blocks and one token
	matched, n, st := hookAdmit(h, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit", st, kverr.OK)
	if n != 1 || matched[0] != 0 {
		t.Fatalf("admit: %d admitted, matched %v", n, matched)
	}
	stepFlush(t, h)
	tbl := tableOf(t, h, 1, 5)
	for i := range 4 {
		gpu[tbl[i]] = kvOfBlock(i)
	}
	// The forward pass above wrote the blocks: mark_computed, so the
	// removal keeps them cached for the flush to demote.
	markAndRemove(t, h, 1)

	// Arrays too small: BUFFER_TOO_SMALL with the room needed, nothing changed.
	_, _, nd, nr, _, st := hookFlushCopies(h, 1, 0)
	expect(t, "short flush", st, kverr.BufferTooSmall)
	if nd != 4 || nr != 0 {
		t.Fatalf("short flush: need %d %d", nd, nr)
	}
	if s, _ := hookTierStats(h, sizeofTierStats(), false); s[3] != 0 {
		t.Fatalf("short flush changed the tier: %v", s)
	}
	d, r, nd, nr, tk, st := hookFlushCopies(h, 8, 8)
	expect(t, "flush", st, kverr.OK)
	if tk == 0 || nd != 4 || nr != 0 || len(d) != 4 || r != nil {
		t.Fatalf("flush: ticket %d, %d demotions %v, %d reloads", tk, nd, d, nr)
	}
	for _, op := range d {
		copy(slotMem(op[1]), gpu[op[0]])
	}
	if s, _ := hookTierStats(h, sizeofTierStats(), false); s[3] != 4 {
		t.Fatalf("in flight: %v", s)
	}
	expect(t, "complete", hookCompleteCopies(h, tk, false), kverr.OK)
	expect(t, "complete twice", hookCompleteCopies(h, tk, false), kverr.NotFound)
	got, st := hookMatchTiers(h, [][]int32{conv, conv[:5]}, false)
	expect(t, "match tiers", st, kverr.OK)
	if got[0] != [2]int32{0, 16} || got[1] != [2]int32{0, 4} {
		t.Fatalf("match tiers: %v", got)
	}

	// The conversation returns: its four blocks are reloaded.
	clear(gpu)
	matched, _, st = hookAdmit(h, []int64{2}, [][]int32{conv}, nil)
	expect(t, "admit again", st, kverr.OK)
	if matched[0] != 16 {
		t.Fatalf("admit again: matched %d", matched[0])
	}
	d, r, nd, nr, tk, st = hookFlushCopies(h, 8, 8)
	expect(t, "flush reloads", st, kverr.OK)
	if tk == 0 || nd != 0 || nr != 4 {
		t.Fatalf("flush reloads: ticket %d, %d %d", tk, nd, nr)
	}
	for _, op := range r {
		gpu[op[0]] = bytes.Clone(slotMem(op[1]))
	}
	expect(t, "complete reloads", hookCompleteCopies(h, tk, false), kverr.OK)
	tbl = tableOf(t, h, 2, 5)
	for i := range 4 {
		if !bytes.Equal(gpu[tbl[i]], kvOfBlock(i)) {
			t.Fatalf("block %d (GPU block %d) after reload: %x", i, tbl[i], gpu[tbl[i]])
		}
	}
	s, st := hookTierStats(h, sizeofTierStats(), false)
	expect(t, "stats", st, kverr.OK)
	if s != [6]int64{4, 4, 16, 0, 4, 16} {
		t.Fatalf("stats: %v", s)
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
	// Nothing to copy: ticket 0.
	if _, _, nd, nr, tk, st := hookFlushCopies(h, 8, 8); st != 0 || tk != 0 || nd != 0 || nr != 0 {
		t.Fatalf("empty flush: %d %d %d %s", tk, nd, nr, statusName(st))
	}
}

// KV events through the ABI: a committed demotion is a BLOCK_STORED of
// medium CPU with the block's GPU hash, parent and tokens; the GPU's
// events say GPU; clearing the prefix cache re-announces the host tier's
// blocks after its ALL_CLEARED.
func TestTierABIEventsCarryMedium(t *testing.T) {
	lockThread(t)
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, slots: 16, ahead: 8, blockBytes: tierBytes, events: true})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	conv := tokenRun(9, 7) // two full blocks and one token
	_, _, st = hookAdmit(h, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit", st, kverr.OK)
	stepFlush(t, h)
	// The step's forward pass ran: the removal keeps the blocks cached.
	markAndRemove(t, h, 1)
	gpu, st := hookDrain(h, 16, 64, 4, 16)
	expect(t, "drain", st, kverr.OK)
	if len(gpu) != 2 || gpu[0].medium != hookMediumGPU || gpu[1].medium != hookMediumGPU {
		t.Fatalf("admission's events: %+v", gpu)
	}
	_, _, _, _, tk, st := hookFlushCopies(h, 8, 8)
	expect(t, "flush", st, kverr.OK)
	evs, _ := hookDrain(h, 16, 64, 4, 16)
	if len(evs) != 1 || evs[0].kind != hookRemoved || evs[0].medium != hookMediumGPU || len(evs[0].hashes) != 2 {
		t.Fatalf("flush's events: %+v", evs)
	}
	expect(t, "complete", hookCompleteCopies(h, tk, false), kverr.OK)
	evs, _ = hookDrain(h, 16, 64, 4, 16)
	if len(evs) != 2 {
		t.Fatalf("commit's events: %+v", evs)
	}
	for i, ev := range evs {
		if ev.kind != hookStored || ev.medium != hookMediumCPU || ev.hash != gpu[i].hash ||
			ev.parent != gpu[i].parent || !slices.Equal(ev.tokens, gpu[i].tokens) {
			t.Fatalf("CPU event %d: %+v, its GPU event %+v", i, ev, gpu[i])
		}
	}
	_, st = hookClearPrefixCache(h)
	expect(t, "clear", st, kverr.OK)
	evs, _ = hookDrain(h, 16, 64, 4, 16)
	if len(evs) != 3 || evs[0].kind != hookCleared || evs[0].medium != 0 || evs[1].medium != hookMediumCPU || evs[2].medium != hookMediumCPU {
		t.Fatalf("clear: %+v", evs)
	}
}

// Every bad input gets its status and a message, and changes nothing.
func TestTierABIRefusals(t *testing.T) {
	lockThread(t)
	ok := hookTierConfig{numBlocks: 8, blockSize: 4, slots: 4, ahead: 2, blockBytes: 16}
	live, _ := hookLiveHandles(false)
	for name, c := range map[string]hookTierConfig{
		"no prefix cache":         {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, noPrefixCache: true},
		"no block bytes":          {numBlocks: 8, blockSize: 4, slots: 4},
		"slots < 0":               {numBlocks: 8, blockSize: 4, slots: -1, blockBytes: 16},
		"too large":               {numBlocks: 8, blockSize: 4, slots: 1 << 20, blockBytes: 1 << 27},
		"ahead > blocks":          {numBlocks: 8, blockSize: 4, slots: 4, ahead: 9, blockBytes: 16},
		"ahead < 0":               {numBlocks: 8, blockSize: 4, slots: 4, ahead: -1, blockBytes: 16},
		"bytes, no tier":          {numBlocks: 8, blockSize: 4, blockBytes: 16},
		"demote_evicted 2":        {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, demoteEvicted: 2},
		"demote_evicted, no tier": {numBlocks: 8, blockSize: 4, demoteEvicted: 1},
		"write_through > blocks":  {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, writeThrough: 9},
		"write_through < 0":       {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, writeThrough: -1},
		"write_through, no tier":  {numBlocks: 8, blockSize: 4, writeThrough: 1},
		"slack > blocks":          {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, writeThrough: 1, slack: 9},
		"slack < 0":               {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, writeThrough: 1, slack: -1},
		"slack, no write_through": {numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16, slack: 1},
		"slack, no tier":          {numBlocks: 8, blockSize: 4, slack: 1},
	} {
		h, st := hookManagerCreateTier(c)
		expect(t, name, st, kverr.InvalidArgument)
		if h != nil {
			t.Fatalf("%s: a handle", name)
		}
	}
	if n, _ := hookLiveHandles(false); n != live {
		t.Fatalf("refused creates left %d handles", n-live)
	}
	// A config of the first released size has no host tier.
	h0, st := hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, structSize: 16})
	expect(t, "old config", st, kverr.OK)
	defer hookManagerDestroy(h0)
	_, _, _, _, _, st = hookFlushCopies(h0, 4, 4)
	expect(t, "flush without tier", st, kverr.InvalidArgument)
	expect(t, "complete without tier", hookCompleteCopies(h0, 1, false), kverr.InvalidArgument)
	_, _, _, st = hookHostTierMemory(h0)
	expect(t, "memory without tier", st, kverr.InvalidArgument)
	if s, st := hookTierStats(h0, sizeofTierStats(), false); st != 0 || s != [6]int64{} {
		t.Fatalf("stats without tier: %v %s", s, statusName(st))
	}
	if m, st := hookMatchTiers(h0, [][]int32{{1, 2, 3, 4, 5}}, false); st != 0 || m[0] != [2]int32{} {
		t.Fatalf("match without tier: %v %s", m, statusName(st))
	}

	h, st := hookManagerCreateTier(ok)
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	expect(t, "flush NULL counts", hookFlushCopiesNull(h, true, 0), kverr.NullPointer)
	expect(t, "flush NULL demote with max", hookFlushCopiesNull(h, false, 2), kverr.NullPointer)
	_, _, _, _, _, st = hookFlushCopies(h, -1, 0)
	expect(t, "flush max < 0", st, kverr.InvalidArgument)
	expect(t, "complete unknown", hookCompleteCopies(h, 7, false), kverr.NotFound)
	_, st = hookMatchTiers(h, [][]int32{{1, 2}}, true)
	expect(t, "match NULL out", st, kverr.NullPointer)
	_, st = hookTierStats(h, 0, false)
	expect(t, "stats struct_size 0", st, kverr.StructSize)
	_, st = hookTierStats(h, sizeofTierStats(), true)
	expect(t, "stats NULL", st, kverr.NullPointer)
	expect(t, "NULL handle", hookCompleteCopies(nil, 1, false), kverr.InvalidHandle)
}

// kvp_tier_match is viewed as kvmanager.TierMatch.
func TestTierMatchLayout(t *testing.T) {
	var m kvmanager.TierMatch
	if sizeofTierMatch() != unsafe.Sizeof(m) || offsetofTierMatchHost() != unsafe.Offsetof(m.Host) {
		t.Fatalf("kvp_tier_match (%d bytes, host at %d) is not kvmanager.TierMatch", sizeofTierMatch(), offsetofTierMatchHost())
	}
}

// stepFlush is the step's flush after an admission (before its forward
// pass, which writes the blocks): nothing to copy here. flush_copies
// never demotes a block allocated since the previous flush, so a test
// that demotes the blocks of a sequence it admitted and removed runs it
// in between, as an engine's step would; the test then calls
// mark_computed after the forward pass, since a removal before it drops
// the sequence's blocks from the cache.
func stepFlush(t *testing.T, h unsafe.Pointer) {
	t.Helper()
	_, _, _, _, tk, st := hookFlushCopies(h, 8, 8)
	expect(t, "the step's flush", st, kverr.OK)
	if tk != 0 {
		t.Fatalf("the step's flush handed out batch %d", tk)
	}
}

// tokenRun is n tokens counting up from first.
func tokenRun(n int, first int32) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = first + int32(i)
	}
	return toks
}

// markAndRemove marks the blocks of h's last step computed (its forward
// pass ran), then removes request id: its blocks stay cached.
func markAndRemove(t *testing.T, h unsafe.Pointer, id int64) {
	t.Helper()
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	ids := cInt64s([]int64{id})
	defer ids.free()
	expect(t, "remove", hookManagerRemove(h, ids, 1), kverr.OK)
}

// demoteThroughABI admits conv on h, writes its four blocks' fake K/V
// into the host slots of their demotions, and completes the batch.
func demoteThroughABI(t *testing.T, h unsafe.Pointer, id int64, conv []int32) {
	t.Helper()
	mem, slotBytes, _, st := hookHostTierMemory(h)
	expect(t, "host memory", st, kverr.OK)
	_, _, st = hookAdmit(h, []int64{id}, [][]int32{conv}, nil)
	expect(t, "admit", st, kverr.OK)
	stepFlush(t, h)
	tbl := tableOf(t, h, id, 5)
	gpu := map[int32][]byte{}
	for i := range 4 {
		gpu[tbl[i]] = kvOfBlock(i)
	}
	// The forward pass above wrote the blocks: mark_computed, so the
	// removal keeps them cached for the flush to demote.
	markAndRemove(t, h, id)
	d, _, _, _, tk, st := hookFlushCopies(h, 8, 8)
	expect(t, "flush", st, kverr.OK)
	if len(d) != 4 {
		t.Fatalf("flush: %d demotions", len(d))
	}
	for _, op := range d {
		copy(mem[int64(op[1])*slotBytes:int64(op[1]+1)*slotBytes], gpu[op[0]])
	}
	expect(t, "complete", hookCompleteCopies(h, tk, false), kverr.OK)
}

// Two managers through the ABI share one server: the blocks one demoted
// are stored (destroy writes the queue out) and the other admits the
// conversation with them reloaded, holding the first one's K/V; the
// shared tier's counters appear past kvp_tier_stats' first size only.
func TestSharedTierABI(t *testing.T) {
	lockThread(t)
	srv := redistest.Start(t, redistest.Find(t), 0)
	addr, ns := srv.Addr(), "abi-test.bs4"
	cfg := hookTierConfig{numBlocks: 8, blockSize: 4, slots: 16, ahead: 8, blockBytes: tierBytes,
		sharedAddr: &addr, sharedNS: &ns, sharedTimeoutMs: 2000}
	conv := tokenRun(17, 300)
	a, st := hookManagerCreateTier(cfg)
	expect(t, "create A", st, kverr.OK)
	demoteThroughABI(t, a, 1, conv)
	hookManagerDestroy(a) // writes the queue out

	b, st := hookManagerCreateTier(cfg)
	expect(t, "create B", st, kverr.OK)
	defer hookManagerDestroy(b)
	got, st := hookMatchTiers(b, [][]int32{conv}, false)
	expect(t, "match tiers", st, kverr.OK)
	if got[0] != [2]int32{0, 16} {
		t.Fatalf("B's match: %v", got)
	}
	matched, _, st := hookAdmit(b, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit B", st, kverr.OK)
	if matched[0] != 16 {
		t.Fatalf("B matched %d tokens", matched[0])
	}
	mem, slotBytes, _, _ := hookHostTierMemory(b)
	_, r, _, _, tk, st := hookFlushCopies(b, 8, 8)
	expect(t, "flush reloads", st, kverr.OK)
	gpu := map[int32][]byte{}
	for _, op := range r {
		gpu[op[0]] = bytes.Clone(mem[int64(op[1])*slotBytes : int64(op[1]+1)*slotBytes])
	}
	expect(t, "complete reloads", hookCompleteCopies(b, tk, false), kverr.OK)
	tbl := tableOf(t, b, 1, 5)
	for i := range 4 {
		if !bytes.Equal(gpu[tbl[i]], kvOfBlock(i)) {
			t.Fatalf("block %d (GPU block %d) after the reload: %x", i, tbl[i], gpu[tbl[i]])
		}
	}
	s, st := hookSharedStats(b, sizeofTierStats())
	expect(t, "stats", st, kverr.OK)
	if s["lookups"] != 1 || s["hits"] != 4 || s["fetched"] != 4 || s["match_tokens"] != 16 || s["hit_tokens"] != 0 ||
		s["available"] != 1 || s["errors"]+s["timeouts"]+s["skipped"]+s["corrupt"] != 0 || s["bytes_read"] != 4*(48+tierBytes) {
		t.Fatalf("B's shared stats: %v", s)
	}
	// A caller of the first released size gets none of them.
	s, st = hookSharedStats(b, firstSizeofTierStats())
	expect(t, "stats at the first size", st, kverr.OK)
	for k, v := range s {
		if v != 0 {
			t.Fatalf("shared stat %s written past the caller's struct_size: %d", k, v)
		}
	}
}

// A shared tier with the server down: admissions go on, counted.
func TestSharedTierABIServerDown(t *testing.T) {
	lockThread(t)
	addr, ns := fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t)), "abi-test.bs4"
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 8, blockSize: 4, slots: 16, ahead: 8, blockBytes: tierBytes,
		sharedAddr: &addr, sharedNS: &ns, sharedTimeoutMs: 100})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	conv := make([]int32, 17)
	demoteThroughABI(t, h, 1, conv)
	matched, _, st := hookAdmit(h, []int64{2}, [][]int32{append(conv, 1, 2, 3, 4)}, nil)
	expect(t, "admit", st, kverr.OK)
	if matched[0] != 16 {
		t.Fatalf("matched %d tokens: want the host tier's 16", matched[0])
	}
	s, _ := hookSharedStats(h, sizeofTierStats())
	// The admission's lookup fails once; the stores' own EXISTS, on their
	// own thread, may have failed before it (a breaker a path).
	if f := s["errors"] + s["timeouts"]; f < 1 || f > 2 || s["skipped"] < 1 || s["available"] != 0 || s["fetched"] != 0 {
		t.Fatalf("shared stats: %v", s)
	}
}

// Bad shared tier fields: INVALID_ARGUMENT with a message, no handle.
func TestSharedTierABIRefusals(t *testing.T) {
	lockThread(t)
	addr, ns, empty, bad, long := "127.0.0.1:1", "m.bs4", "", "meta-llama/x", strings.Repeat("a", 1025)
	tier := hookTierConfig{numBlocks: 8, blockSize: 4, slots: 4, blockBytes: 16}
	with := func(f func(*hookTierConfig)) hookTierConfig { c := tier; f(&c); return c }
	live, _ := hookLiveHandles(false)
	for name, c := range map[string]hookTierConfig{
		"no host tier":          {numBlocks: 8, blockSize: 4, sharedAddr: &addr, sharedNS: &ns},
		"namespace, no addr":    with(func(c *hookTierConfig) { c.sharedNS = &ns }),
		"timeout, no addr":      with(func(c *hookTierConfig) { c.sharedTimeoutMs = 5 }),
		"queue, no addr":        with(func(c *hookTierConfig) { c.sharedPutQueue = 5 }),
		"no namespace":          with(func(c *hookTierConfig) { c.sharedAddr = &addr }),
		"empty namespace":       with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS = &addr, &empty }),
		"namespace with /":      with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS = &addr, &bad }),
		"namespace too long":    with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS = &addr, &long }),
		"empty address":         with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS = &empty, &ns }),
		"address too long":      with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS = &long, &ns }),
		"timeout < 0":           with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.sharedTimeoutMs = &addr, &ns, -1 }),
		"timeout over 1 min":    with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.sharedTimeoutMs = &addr, &ns, 60001 }),
		"put queue < 0":         with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.sharedPutQueue = &addr, &ns, -1 }),
		"put queue over 2^20":   with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.sharedPutQueue = &addr, &ns, 1<<20+1 }),
		"host tier bad as ever": with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.ahead = &addr, &ns, -1 }),
	} {
		h, st := hookManagerCreateTier(c)
		expect(t, name, st, kverr.InvalidArgument)
		if h != nil || lastError() == "" {
			t.Fatalf("%s: a handle, or no message", name)
		}
	}
	if n, _ := hookLiveHandles(false); n != live {
		t.Fatalf("refused creates left %d handles", n-live)
	}
	h, st := hookManagerCreateTier(with(func(c *hookTierConfig) { c.sharedAddr, c.sharedNS, c.sharedPutQueue = &addr, &ns, 1<<20 }))
	expect(t, "the largest queue", st, kverr.OK)
	hookManagerDestroy(h)
}

// Write-through through the ABI: computed blocks are handed out as copies
// (the batch's demote list) at most write_through a flush, and stay in the
// GPU prefix cache: a later admission matches them on the GPU.
func TestTierABIWriteThrough(t *testing.T) {
	lockThread(t)
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 16, blockSize: 4, slots: 8, blockBytes: 16, writeThrough: 2})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	conv := tokenRun(13, 100) // three full blocks
	_, _, st = hookAdmit(h, []int64{1}, [][]int32{conv}, nil)
	expect(t, "admit", st, kverr.OK)
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	if s, st := hookWriteThroughStats(h); st != 0 || s != [3]int64{0, 0, 3} {
		t.Fatalf("after the mark: %v %s, want 3 queued", s, statusName(st))
	}
	d, r, nd, nr, ticket, st := hookFlushCopies(h, 4, 4)
	expect(t, "flush", st, kverr.OK)
	if nd != 2 || nr != 0 || len(d) != 2 || len(r) != 0 || ticket == 0 {
		t.Fatalf("flush: %d demote copies %v, %d reloads, ticket %d; want the 2 a flush", nd, d, nr, ticket)
	}
	expect(t, "complete", hookCompleteCopies(h, ticket, false), kverr.OK)
	if s, _ := hookWriteThroughStats(h); s != [3]int64{2, 0, 1} {
		t.Fatalf("after the first batch: %v", s)
	}
	ids := cInt64s([]int64{1})
	defer ids.free()
	expect(t, "remove", hookManagerRemove(h, ids, 1), kverr.OK)
	matched, _, st := hookAdmit(h, []int64{2}, [][]int32{conv}, nil)
	expect(t, "admit again", st, kverr.OK)
	if matched[0] != 12 {
		t.Fatalf("admit after the stores matched %d tokens, want 12 on the GPU", matched[0])
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
}

// A write-through slack through the ABI: while the pool's free blocks
// exceed it, flush_copies hands out no store and the computed blocks stay
// queued; once allocations bring the free blocks to the slack, the oldest
// are stored, write_through a flush.
func TestTierABIWriteThroughSlack(t *testing.T) {
	lockThread(t)
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 16, blockSize: 4, slots: 8, blockBytes: 16, writeThrough: 2, slack: 10})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	_, _, st = hookAdmit(h, []int64{1}, [][]int32{tokenRun(13, 100)}, nil) // 4 blocks: 12 free
	expect(t, "admit", st, kverr.OK)
	expect(t, "mark computed", hookManagerMarkComputed(h), kverr.OK)
	_, _, nd, _, ticket, st := hookFlushCopies(h, 4, 4)
	expect(t, "flush", st, kverr.OK)
	if nd != 0 || ticket != 0 {
		t.Fatalf("flush with 12 free blocks, slack 10: %d stores, ticket %d; want none", nd, ticket)
	}
	if s, _ := hookWriteThroughStats(h); s != [3]int64{0, 0, 3} {
		t.Fatalf("after the held flush: %v, want 3 queued", s)
	}
	_, _, st = hookAdmit(h, []int64{2}, [][]int32{tokenRun(5, 500)}, nil) // 2 blocks: 10 free
	expect(t, "admit", st, kverr.OK)
	d, _, nd, _, ticket, st := hookFlushCopies(h, 4, 4)
	expect(t, "flush", st, kverr.OK)
	if nd != 2 || ticket == 0 {
		t.Fatalf("flush with 10 free blocks, slack 10: %d stores %v, ticket %d; want 2", nd, d, ticket)
	}
	expect(t, "complete", hookCompleteCopies(h, ticket, false), kverr.OK)
	if s, _ := hookWriteThroughStats(h); s != [3]int64{2, 0, 1} {
		t.Fatalf("after the first stores: %v", s)
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)
}
