package main

import (
	"math"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// kvp_manager_flush_copies sizes its scratch by the batch, not by the
// caller's stated room: max_demote and max_reload of INT32_MAX (arrays of
// that many entries would be 64 GiB of scratch, where the batch is four
// copies) flush the batch, and a batch past a small scratch is flushed
// whole as well.
func TestFlushCopiesScratchFollowsTheBatch(t *testing.T) {
	lockThread(t)
	for _, blocks := range []int{4, 300} {
		h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 2 * int32(blocks), blockSize: 4, slots: 2 * int32(blocks),
			ahead: 2 * int32(blocks), blockBytes: 32})
		expect(t, "create", st, kverr.OK)
		_, _, st = hookAdmit(h, []int64{1}, [][]int32{tokenRun(4*blocks+1, 1)}, nil)
		expect(t, "admit", st, kverr.OK)
		sz := int(cLayouts["kvp_tier_copy"].size)
		d, r := newCBuf(2*blocks*sz), newCBuf(2*blocks*sz) // the room the batch may need; INT32_MAX stated
		nd, nr, tk := newCBuf(4), newCBuf(4), newCBuf(8)
		flush := func(what string) {
			got := rawManagerFlushCopies(h, d.p, math.MaxInt32, nd.p, r.p, math.MaxInt32, nr.p, tk.p)
			if got != int(kverr.OK) {
				t.Fatalf("%d blocks, %s: flush with room INT32_MAX: %s (%s)", blocks, what, statusName(abiStatus(got)), lastError())
			}
		}
		flush("the step's flush")
		if *(*uint64)(tk.p) != 0 {
			t.Fatalf("the step's flush handed out batch %d", *(*uint64)(tk.p))
		}
		markAndRemove(t, h, 1)
		flush("the demotions")
		if n := *(*int32)(nd.p); n != int32(blocks) {
			t.Fatalf("flush: %d demotions, want %d", n, blocks)
		}
		expect(t, "complete", hookCompleteCopies(h, *(*uint64)(tk.p), false), kverr.OK)
		for _, b := range []cbuf{d, r, nd, nr, tk} {
			b.free()
		}
		hookManagerDestroy(h)
	}
}
