package main

import (
	"bytes"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/redistest"
)

func newHostStore(t *testing.T, slots int32, slotBytes int64) unsafe.Pointer {
	t.Helper()
	lockThread(t)
	h, st := hookHostStoreCreate(slots, slotBytes, 0, 0)
	expect(t, "create", st, kverr.OK)
	t.Cleanup(func() { hookHostStoreDestroy(h) })
	return h
}

// A block's way through the store: reserved, written in two segments,
// completed, pinned, read back, unpinned.
func TestHostStoreABIRoundTrip(t *testing.T) {
	h := newHostStore(t, 4, 32)
	slots, ev, st := hookHostStoreReserve(h, []uint64{10, 11})
	expect(t, "reserve", st, kverr.OK)
	if !slices.Equal(slots, []int32{0, 1}) || len(ev) != 0 {
		t.Fatalf("slots %v evicted %v", slots, ev)
	}
	data := [][]byte{bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)}
	data[1][31] = 9
	expect(t, "write", hookHostStoreCopy(h, slots, data, 2, true), kverr.OK)
	// Not resident yet: a read is refused, a pin misses.
	expect(t, "read pending", hookHostStoreCopy(h, slots, data, 1, false), kverr.NotFound)
	if _, n, st := hookHostStorePin(h, []uint64{10}); st != 0 || n != 0 {
		t.Fatalf("pin of a pending key: %d %s", n, statusName(st))
	}
	n, st := hookHostStoreKeys(h, "complete", []uint64{10, 11, 12}, 0)
	expect(t, "complete", st, kverr.OK)
	if n != 2 {
		t.Fatalf("completed %d", n)
	}
	states, sl, st := hookHostStoreState(h, []uint64{11, 12})
	expect(t, "state", st, kverr.OK)
	if !slices.Equal(states, []int32{2, 0}) || !slices.Equal(sl, []int32{1, -1}) {
		t.Fatalf("states %v slots %v", states, sl)
	}
	pinned, np, st := hookHostStorePin(h, []uint64{11, 10})
	expect(t, "pin", st, kverr.OK)
	if np != 2 || !slices.Equal(pinned, []int32{1, 0}) {
		t.Fatalf("pinned %v %d", pinned, np)
	}
	back := [][]byte{make([]byte, 32), make([]byte, 32)}
	expect(t, "read", hookHostStoreCopy(h, pinned, back, 4, false), kverr.OK)
	if !bytes.Equal(back[0], data[1]) || !bytes.Equal(back[1], data[0]) {
		t.Fatalf("read back %v", back)
	}
	if n, _ := hookHostStoreKeys(h, "unpin", []uint64{10, 11, 10}, 0); n != 2 {
		t.Fatalf("unpinned %d", n)
	}
	s, st := hookHostStoreStats(h)
	expect(t, "stats", st, kverr.OK)
	// reserves, commits, stale (12 completed, 10 unpinned twice), refused, resident, pinned
	if s != [6]int64{2, 2, 2, 0, 2, 0} {
		t.Fatalf("stats %v", s)
	}
}

// A batch that cannot fit changes nothing and writes nothing to the
// caller's arrays; after a reset the old keys are misses and stale.
func TestHostStoreABIRefusalAndReset(t *testing.T) {
	h := newHostStore(t, 2, 0)
	hookHostStoreReserve(h, []uint64{1, 2})
	slots, _, st := hookHostStoreReserve(h, []uint64{3})
	expect(t, "reserve full", st, kverr.OutOfBlocks)
	if slots[0] != 99 {
		t.Fatal("a refused reserve wrote the caller's array")
	}
	expect(t, "write without memory", hookHostStoreCopy(h, []int32{0}, [][]byte{make([]byte, 8)}, 1, true), kverr.Unsupported)
	if n, st := hookHostStoreKeys(h, "reset", nil, 0); st != 0 || n != 2 {
		t.Fatalf("reset %d %s", n, statusName(st))
	}
	if n, _ := hookHostStoreKeys(h, "complete", []uint64{1, 2}, 0); n != 0 {
		t.Fatal("a completion after reset acted")
	}
	if n, _ := hookHostStoreKeys(h, "lookup", []uint64{1}, 0); n != 0 {
		t.Fatal("lookup after reset hit")
	}
	s, _ := hookHostStoreStats(h)
	if s[2] != 2 || s[3] != 1 {
		t.Fatalf("stale %d refused %d", s[2], s[3])
	}
}

func TestHostStoreABIArgumentChecks(t *testing.T) {
	lockThread(t)
	for _, c := range []struct {
		slots     int32
		bytes     int64
		reserved  int32
		size      uintptr
		want      kverr.Code
		errorText string
	}{
		{0, 8, 0, 0, kverr.InvalidArgument, "num_slots"},
		{4, -1, 0, 0, kverr.InvalidArgument, "slot_bytes"},
		{1 << 30, 1 << 20, 0, 0, kverr.InvalidArgument, "slot_bytes"},
		{4, 8, 1, 0, kverr.InvalidArgument, "reserved"},
		{4, 8, 0, 4, kverr.StructSize, "struct_size"},
	} {
		h, st := hookHostStoreCreate(c.slots, c.bytes, c.reserved, c.size)
		expect(t, fmt.Sprintf("create %+v", c), st, c.want)
		if h != nil {
			t.Fatal("a failed create returned a handle")
		}
	}
	h := newHostStore(t, 2, 8)
	if _, st := hookHostStoreKeys(h, "touch", nil, 0); st != int(kverr.NullPointer) {
		t.Fatalf("NULL keys: %s", statusName(st))
	}
	if _, st := hookHostStoreKeys(h, "touch", []uint64{}, 0); st != int(kverr.InvalidArgument) {
		t.Fatalf("n = 0: %s", statusName(st))
	}
	hookHostStoreReserve(h, []uint64{5})
	expect(t, "write short", hookHostStoreCopy(h, []int32{0}, [][]byte{make([]byte, 6)}, 1, true), kverr.InvalidArgument)
	expect(t, "write out of range", hookHostStoreCopy(h, []int32{7}, [][]byte{make([]byte, 8)}, 1, true), kverr.InvalidArgument)
	hookHostStoreDestroy(h)
	if _, st := hookHostStoreKeys(h, "reset", nil, 0); st != int(kverr.InvalidHandle) {
		t.Fatalf("destroyed handle: %s", statusName(st))
	}
}

func TestSharedStoreABI(t *testing.T) {
	lockThread(t)
	if _, st := hookSharedStoreCreate("", "ns", 0); st != int(kverr.NullPointer) {
		t.Fatalf("no address: %s", statusName(st))
	}
	if _, st := hookSharedStoreCreate("127.0.0.1:1", "a b", 0); st != int(kverr.InvalidArgument) {
		t.Fatalf("bad key space: %s", statusName(st))
	}
	// Down: misses, nothing stored, no error.
	h, st := hookSharedStoreCreate(fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t)), "down", 50)
	expect(t, "create", st, kverr.OK)
	stored, found, _, st := hookSharedStorePutGet(h, []uint64{1}, [][]byte{[]byte("abc")})
	expect(t, "put/get down", st, kverr.OK)
	if stored != 0 || found[0] != 0 {
		t.Fatalf("stored %d found %v", stored, found)
	}
	hookSharedStoreDestroy(h)

	srv := redistest.Start(t, redistest.Find(t), 0)
	h, st = hookSharedStoreCreate(srv.Addr(), "up", 0)
	expect(t, "create", st, kverr.OK)
	defer hookSharedStoreDestroy(h)
	data := [][]byte{[]byte("first block"), []byte("second block")}
	stored, found, back, st := hookSharedStorePutGet(h, []uint64{7, 8}, data)
	expect(t, "put/get", st, kverr.OK)
	if stored != 2 || !slices.Equal(found, []int32{1, 1}) || !bytes.Equal(back[1], data[1]) {
		t.Fatalf("stored %d found %v back %q", stored, found, back)
	}
}

// A destroy or a reset on another thread never frees or reuses memory under
// a read in progress: each read either finishes with the block's bytes or is
// told the store is gone (INVALID_HANDLE); none crashes or reads freed
// memory (the race detector and the C allocator would see it).
func TestHostStoreDestroyWaitsForReads(t *testing.T) {
	lockThread(t)
	for round := range 20 {
		const slotBytes = 1 << 20 // a large copy, so that the destroy meets one in progress
		h, st := hookHostStoreCreate(2, slotBytes, 0, 0)
		expect(t, "create", st, kverr.OK)
		slots, _, st := hookHostStoreReserve(h, []uint64{7})
		expect(t, "reserve", st, kverr.OK)
		want := bytes.Repeat([]byte{byte(round + 1)}, slotBytes)
		expect(t, "write", hookHostStoreCopy(h, slots, [][]byte{want}, 1, true), kverr.OK)
		if _, st := hookHostStoreKeys(h, "complete", []uint64{7}, 0); st != 0 {
			t.Fatalf("complete: %s", statusName(st))
		}
		if round%2 == 1 {
			// The reset side: it waits for the reads that checked the slot before it.
			defer hookHostStoreDestroy(h)
		}
		var wg sync.WaitGroup
		errs := make(chan string, 8)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				for range 8 {
					got := [][]byte{make([]byte, slotBytes)}
					switch st := hookHostStoreCopy(h, slots, got, 4, false); kverr.Code(int32(st)) {
					case kverr.OK:
						if !bytes.Equal(got[0], want) {
							errs <- "a read finished with bytes that are not the block's"
							return
						}
					case kverr.InvalidHandle, kverr.NotFound: // destroyed, or reset (the key gone)
					default:
						errs <- "read: " + statusName(st)
						return
					}
				}
			}()
		}
		if round%2 == 0 {
			hookHostStoreDestroy(h)
		} else {
			_, st := hookHostStoreKeys(h, "reset", nil, 0)
			if st != 0 {
				t.Fatalf("reset: %s", statusName(st))
			}
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Fatal(e)
		}
	}
}
