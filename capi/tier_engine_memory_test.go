package main

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// A host tier over memory the engine hands in: the manager uses it as its
// slots (kvp_manager_host_tier_memory answers it), demotions land in it,
// and destroy leaves it to the engine; a misaligned region, or one without
// a host tier, is refused.
func TestTierABIEngineMemory(t *testing.T) {
	lockThread(t)
	const slots = 16
	buf := newCBuf(slots*tierBytes + 16)
	defer buf.free()
	base := unsafe.Pointer((uintptr(buf.p) + 15) &^ 15)
	cfg := hookTierConfig{numBlocks: 8, blockSize: 4, slots: slots, ahead: 8, blockBytes: tierBytes, mem: base}
	h, st := hookManagerCreateTier(cfg)
	expect(t, "create over the engine's memory", st, kverr.OK)
	mem, slotBytes, n, st := hookHostTierMemory(h)
	expect(t, "host memory", st, kverr.OK)
	if unsafe.Pointer(&mem[0]) != base || slotBytes != tierBytes || n != slots {
		t.Fatalf("host memory %p (%d x %d), want the engine's %p", &mem[0], n, slotBytes, base)
	}
	// Demote a conversation's blocks into the engine's memory.
	conv := tokenRun(17, 300)
	if _, n, st := hookAdmit(h, []int64{1}, [][]int32{conv}, nil); st != 0 || n != 1 {
		t.Fatalf("admit: %d, %s", n, lastError())
	}
	stepFlush(t, h)
	// The step's forward pass ran: the removal keeps the blocks cached.
	markAndRemove(t, h, 1)
	d, _, nd, _, tk, st := hookFlushCopies(h, 8, 8)
	expect(t, "flush", st, kverr.OK)
	for _, op := range d[:nd] {
		copy(mem[int64(op[1])*tierBytes:], bytes.Repeat([]byte{0x5a}, tierBytes))
	}
	if tk != 0 {
		expect(t, "complete", hookCompleteCopies(h, tk, false), kverr.OK)
	}
	if nd != 4 || !bytes.Contains(unsafe.Slice((*byte)(base), slots*tierBytes), bytes.Repeat([]byte{0x5a}, tierBytes)) {
		t.Fatalf("%d demotions into the engine's memory", nd)
	}
	hookManagerDestroy(h)
	// The engine's memory outlives the manager: still there, still holding
	// what was demoted into it.
	if !bytes.Contains(unsafe.Slice((*byte)(base), slots*tierBytes), bytes.Repeat([]byte{0x5a}, tierBytes)) {
		t.Fatal("the engine's memory changed at destroy")
	}

	bad := cfg
	bad.mem = unsafe.Add(base, 8)
	h, st = hookManagerCreateTier(bad)
	expect(t, "misaligned memory", st, kverr.InvalidArgument)
	if h != nil {
		t.Fatal("a refused create made a manager")
	}
	bad = hookTierConfig{numBlocks: 8, blockSize: 4, mem: base}
	_, st = hookManagerCreateTier(bad)
	expect(t, "memory without a host tier", st, kverr.InvalidArgument)
}
