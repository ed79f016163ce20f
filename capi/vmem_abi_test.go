package main

import (
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

func liveHandles(t *testing.T) int64 {
	t.Helper()
	n, st := hookLiveHandles(false)
	expect(t, "kvp_live_handles", st, kverr.OK)
	return n
}

func TestLiveHandlesCountsCreatesAndDestroys(t *testing.T) {
	lockThread(t)
	_, st := hookLiveHandles(true)
	expect(t, "kvp_live_handles(NULL)", st, kverr.NullPointer)
	before := liveHandles(t)
	m := newManager(t, 8, 4)
	vc, st := hookVcacheCreate(1, 1, 64, 2, 64, 1<<20)
	expect(t, "vcache create", st, kverr.OK)
	if got := liveHandles(t); got != before+2 {
		t.Fatalf("%d live handles after two creates, want %d", got, before+2)
	}
	hookManagerDestroy(m)
	hookVcacheDestroy(vc)
	hookVcacheDestroy(vc) // a second destroy is a no-op
	if got := liveHandles(t); got != before {
		t.Fatalf("%d live handles after the destroys, want %d", got, before)
	}
}

// A destroy function given a handle of another type leaves it alone: the
// object stays registered and usable, and its own destroy still works.
func TestDestroyChecksTheHandleType(t *testing.T) {
	lockThread(t)
	before := liveHandles(t)
	m := newManager(t, 8, 4)
	vc, st := hookVcacheCreate(1, 1, 64, 2, 64, 1<<20)
	expect(t, "vcache create", st, kverr.OK)

	hookManagerDestroy(vc)
	hookVcacheDestroy(m)
	if got := liveHandles(t); got != before+2 {
		t.Fatalf("a destroy of the wrong type dropped a handle: %d live, want %d", got, before+2)
	}
	slot, st := hookVcacheAlloc(vc)
	expect(t, "alloc on a vcache passed to kvp_manager_destroy", st, kverr.OK)
	expect(t, "step", hookVcacheStep(vc, []int32{slot}, []int32{64}), kverr.OK)
	expect(t, "add on a manager passed to kvp_vcache_destroy", hookManagerAdd(m, 1, 4), kverr.OK)
	expect(t, "check", hookManagerCheck(m), kverr.OK)

	// Pointers that were never handles, and NULL, change nothing either.
	junk := newCBuf(64)
	defer junk.free()
	hookManagerDestroy(junk.p)
	hookVcacheDestroy(junk.p)
	hookManagerDestroy(nil)
	hookVcacheDestroy(nil)
	hookManagerDestroy(unsafe.Add(m, 1))
	if got := liveHandles(t); got != before+2 {
		t.Fatalf("%d live handles after destroys of junk, want %d", got, before+2)
	}

	hookManagerDestroy(m)
	hookVcacheDestroy(vc)
	if got := liveHandles(t); got != before {
		t.Fatalf("%d live handles after the real destroys, want %d", got, before)
	}
	expect(t, "add after destroy", hookManagerAdd(m, 2, 4), kverr.InvalidHandle)
	_, st = hookVcacheAlloc(vc)
	expect(t, "alloc after destroy", st, kverr.InvalidHandle)
}

// 40000 tokens of 4 KiB each: 40000 pages in each tensor, far past what one
// kernel mapping a page would allow.
func TestVcacheHostLongContextThroughTheABI(t *testing.T) {
	lockThread(t)
	vc, st := hookVcacheCreate(1, 8, 256, 1, 40000, 1<<30)
	expect(t, "create", st, kverr.OK)
	defer hookVcacheDestroy(vc)
	slot, st := hookVcacheAlloc(vc)
	expect(t, "alloc", st, kverr.OK)
	expect(t, "step to 40000 tokens", hookVcacheStep(vc, []int32{slot}, []int32{40000}), kverr.OK)
	mapped, active, st := hookVcacheMapped(vc)
	expect(t, "stats", st, kverr.OK)
	if mapped != 2*40000*4096 || active != 1 {
		t.Fatalf("mapped %d bytes with %d active slots, want %d and 1", mapped, active, 2*40000*4096)
	}
}

// A log callback that calls back into kvplug gets an error status for that
// call instead of deadlocking on the lock held by the code that logged.
func TestLogCallbackReentryFailsInsteadOfDeadlocking(t *testing.T) {
	lockThread(t)
	m, st := hookManagerCreateCached(4, 4, false, 0)
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(m)
	expect(t, "set logger", hookSetReentryLogger(m), kverr.OK)
	defer hookSetReentryLogger(nil)

	// A live sequence holds the whole pool, so the next prompt does not fit
	// now: admit logs "pool full" holding the manager's lock.
	if _, n, st := hookAdmit(m, []int64{9}, [][]int32{make([]int32, 16)}, nil); st != 0 || n != 1 {
		t.Fatalf("filling the pool: %d admitted, status %d", n, st)
	}
	done := make(chan abiStatus, 1)
	go func() {
		_, n, st := hookAdmit(m, []int64{1}, [][]int32{make([]int32, 8)}, nil)
		if st == 0 && n != 0 {
			st = -1
		}
		done <- st
	}()
	select {
	case st := <-done:
		expect(t, "admit", st, kverr.OK)
	case <-time.After(20 * time.Second):
		t.Fatal("admit deadlocked in its log callback")
	}
	r := hookReentryResult()
	if r.lines == 0 {
		t.Fatal("no log line reached the callback")
	}
	if r.check != int(kverr.Unsupported) || r.live != int(kverr.Unsupported) || !strings.Contains(r.msg, "log callback") {
		t.Fatalf("calls from the callback: check %s, live_handles %s, message %q; want UNSUPPORTED",
			statusName(r.check), statusName(r.live), r.msg)
	}
	if r.newline {
		t.Fatal("a log line ended in a line ending")
	}
	// Outside the callback the same calls work.
	expect(t, "check outside the callback", hookManagerCheck(m), kverr.OK)
	liveHandles(t)
}

func TestManagerNumBlocksMessageNamesTheLimit(t *testing.T) {
	lockThread(t)
	_, st := hookManagerCreate(sizeofManagerConfig(), 1<<26+1, 1, false, false)
	expect(t, "create 2^26+1 blocks", st, kverr.InvalidArgument)
	if !strings.Contains(lastError(), "[1, 2^26]") {
		t.Fatalf("message %q does not name the limit [1, 2^26]", lastError())
	}
}
