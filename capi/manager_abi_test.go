package main

import (
	"encoding/binary"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// lockThread keeps the test on one OS thread: kvp_last_error is the
// calling thread's, and a goroutine that moved between a failing call and
// the lastError() after it would read another thread's (empty) message.
func lockThread(t testing.TB) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

func newManager(t testing.TB, blocks, bs int32) unsafe.Pointer {
	t.Helper()
	lockThread(t)
	h, st := hookManagerCreate(sizeofManagerConfig(), blocks, bs, false, false)
	if st != 0 || h == nil {
		t.Fatalf("create: %s %s", statusName(st), lastError())
	}
	return h
}

// expect asserts a status code and that a failure comes with a message.
func expect(t *testing.T, name string, got abiStatus, want kverr.Code) {
	t.Helper()
	if got != int(want) {
		t.Fatalf("%s: status %s, want %s (%s)", name, statusName(got), want, lastError())
	}
	if want != kverr.OK && lastError() == "" {
		t.Fatalf("%s: failed without a message", name)
	}
}

func TestStatusNamesMatchCore(t *testing.T) {
	for c := kverr.OK; c <= kverr.Internal; c++ {
		if got := statusName(int(c)); got != c.String() {
			t.Errorf("kvp_status_string(%d) = %s, core says %s", c, got, c)
		}
	}
	if got := statusName(99); got != "KVP_ERR_UNKNOWN_STATUS" {
		t.Errorf("unknown status named %q", got)
	}
}

func TestManagerBadInput(t *testing.T) {
	lockThread(t)
	cfgSize := sizeofManagerConfig()
	_, st := hookManagerCreate(cfgSize, 8, 16, true, false)
	expect(t, "create NULL cfg", st, kverr.NullPointer)
	_, st = hookManagerCreate(cfgSize, 8, 16, false, true)
	expect(t, "create NULL out", st, kverr.NullPointer)
	_, st = hookManagerCreate(15, 8, 16, false, false)
	expect(t, "create struct_size short of block_size", st, kverr.StructSize)
	// Sizes from a newer header: TestStructVersions.
	_, st = hookManagerCreate(cfgSize, 0, 16, false, false)
	expect(t, "create zero blocks", st, kverr.InvalidArgument)
	_, st = hookManagerCreate(cfgSize, -5, 16, false, false)
	expect(t, "create negative blocks", st, kverr.InvalidArgument)
	_, st = hookManagerCreate(cfgSize, 8, -1, false, false)
	expect(t, "create negative block_size", st, kverr.InvalidArgument)

	h := newManager(t, 8, 4)
	defer hookManagerDestroy(h)
	expect(t, "add", hookManagerAdd(h, 1, 10), kverr.OK) // 3 blocks
	before, _ := hookManagerStats(h, sizeofManagerStats())

	ids := cInt64s([]int64{1})
	defer ids.free()
	one := cInt32s([]int32{1})
	defer one.free()
	null := cbuf{}

	expect(t, "NULL handle", hookManagerAdd(nil, 2, 1), kverr.InvalidHandle)
	expect(t, "foreign handle", hookManagerAdd(unsafe.Pointer(ids.p), 2, 1), kverr.InvalidHandle)
	expect(t, "add zero prompt", hookManagerAdd(h, 2, 0), kverr.InvalidArgument)
	expect(t, "add negative prompt", hookManagerAdd(h, 2, -1), kverr.InvalidArgument)
	expect(t, "add duplicate id", hookManagerAdd(h, 1, 1), kverr.DuplicateSequence)
	expect(t, "add too few blocks", hookManagerAdd(h, 2, 4*6), kverr.OutOfBlocks)
	expect(t, "grow NULL ids", hookManagerGrow(h, null, one, 1), kverr.NullPointer)
	expect(t, "grow NULL counts", hookManagerGrow(h, ids, null, 1), kverr.NullPointer)
	expect(t, "grow zero count", hookManagerGrow(h, ids, one, 0), kverr.InvalidArgument)
	expect(t, "grow negative count", hookManagerGrow(h, ids, one, -3), kverr.InvalidArgument)
	expect(t, "grow huge count", hookManagerGrow(h, ids, one, 1<<30), kverr.InvalidArgument)
	neg := cInt32s([]int32{-1})
	defer neg.free()
	expect(t, "grow negative tokens", hookManagerGrow(h, ids, neg, 1), kverr.InvalidArgument)
	unknown := cInt64s([]int64{42})
	defer unknown.free()
	expect(t, "grow unknown id", hookManagerGrow(h, unknown, one, 1), kverr.UnknownSequence)
	dup := cInt64s([]int64{1, 1})
	defer dup.free()
	two := cInt32s([]int32{1, 1})
	defer two.free()
	expect(t, "grow id twice", hookManagerGrow(h, dup, two, 2), kverr.DuplicateSequence)
	many := cInt32s([]int32{100})
	defer many.free()
	expect(t, "grow too few blocks", hookManagerGrow(h, ids, many, 1), kverr.OutOfBlocks)
	expect(t, "remove unknown", hookManagerRemove(h, unknown, 1), kverr.UnknownSequence)
	expect(t, "remove NULL ids", hookManagerRemove(h, null, 1), kverr.NullPointer)
	expect(t, "remove id twice", hookManagerRemove(h, dup, 2), kverr.DuplicateSequence)

	n := cInt32s([]int32{0})
	defer n.free()
	expect(t, "describe NULL num_slots", hookManagerDescribe(h, ids, 1, null, 0, null, null, 0, null), kverr.NullPointer)
	tbl := cInt32s(make([]int32, 2))
	defer tbl.free()
	expect(t, "describe table too narrow", hookManagerDescribe(h, ids, 1, tbl, 2, null, null, 0, n), kverr.BufferTooSmall)
	expect(t, "describe zero max_blocks", hookManagerDescribe(h, ids, 1, tbl, 0, null, null, 0, n), kverr.InvalidArgument)
	slots := cInt32s(make([]int32, 4))
	defer slots.free()
	expect(t, "describe slots too small", hookManagerDescribe(h, ids, 1, null, 0, null, slots, 4, n), kverr.BufferTooSmall)
	expect(t, "describe negative capacity", hookManagerDescribe(h, ids, 1, null, 0, null, slots, -1, n), kverr.InvalidArgument)
	_, st = hookManagerStats(h, 4)
	expect(t, "stats tiny struct_size", st, kverr.StructSize)

	after, st := hookManagerStats(h, sizeofManagerStats())
	expect(t, "stats", st, kverr.OK)
	if after != before {
		t.Fatalf("failed calls changed the manager: %v -> %v", before, after)
	}
	expect(t, "check", hookManagerCheck(h), kverr.OK)

	expect(t, "remove", hookManagerRemove(h, ids, 1), kverr.OK)
	expect(t, "double remove", hookManagerRemove(h, ids, 1), kverr.UnknownSequence)
	hookManagerDestroy(h)
	expect(t, "use after destroy", hookManagerAdd(h, 3, 1), kverr.InvalidHandle)
	if !strings.Contains(lastError(), "not live") {
		t.Errorf("use after destroy message: %q", lastError())
	}
	hookManagerDestroy(nil) // must be a no-op
}

func TestManagerDescribeThroughABI(t *testing.T) {
	h := newManager(t, 16, 4)
	defer hookManagerDestroy(h)
	expect(t, "add", hookManagerAdd(h, 7, 6), kverr.OK)
	ids := cInt64s([]int64{7})
	defer ids.free()
	tbl, lens, slots, n := newCBuf(4*4), newCBuf(4), newCBuf(4*8), newCBuf(4)
	defer func() { tbl.free(); lens.free(); slots.free(); n.free() }()
	expect(t, "describe", hookManagerDescribe(h, ids, 1, tbl, 4, lens, slots, 8, n), kverr.OK)
	row := unsafe.Slice((*int32)(tbl.p), 4)
	if got := *(*int32)(lens.p); got != 6 {
		t.Fatalf("seq_len = %d, want 6", got)
	}
	if got := *(*int32)(n.p); got != 6 {
		t.Fatalf("num_slots = %d, want 6", got)
	}
	if row[2] != -1 || row[3] != -1 {
		t.Fatalf("row not padded with -1: %v", row)
	}
	s := unsafe.Slice((*int32)(slots.p), 6)
	for i, v := range s {
		want := row[i/4]*4 + int32(i%4)
		if v != want {
			t.Fatalf("slot %d = %d, want %d (row %v)", i, v, want, row)
		}
	}
}

// FuzzManagerABI drives the manager's exports with arbitrary arguments: NULL
// pointers, any struct_size, counts of any sign and size, unknown ids. Every
// call must return a known status (never KVP_ERR_INTERNAL: that is a bug),
// a failure must carry a message, and the manager's invariants must hold
// after every call.
func FuzzManagerABI(f *testing.F) {
	f.Add([]byte{0, 1, 5, 0, 0, 0, 2, 1, 1, 0, 0, 0, 4, 1})
	f.Add([]byte{3, 200, 9, 9, 9, 9, 1, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2})
	// Stats with a struct_size of 100, a newer header's: the library zeroes
	// the caller's bytes past its own struct, so the struct must be that large.
	f.Add([]byte("\x10\x00\t\t\x00\x00\t\x05d0"))
	f.Fuzz(func(t *testing.T, data []byte) {
		lockThread(t)
		r := byteReader(data)
		bs := int32(r.u8()%17) + 1
		h := newManager(t, 64, bs)
		defer hookManagerDestroy(h)
		for !r.done() {
			op := r.u8() % 6
			var st abiStatus
			switch op {
			case 0:
				st = hookManagerAdd(h, int64(r.u8()%8), r.i32()%200)
			case 1, 2, 3, 4:
				n := int(r.u8() % 5)
				ids := make([]int64, n)
				counts := make([]int32, n)
				for i := range ids {
					ids[i] = int64(r.u8() % 8)
					counts[i] = r.i32() % 40
				}
				idb, cb := cInt64s(ids), cInt32s(counts)
				if r.u8()%8 == 0 {
					idb.free()
					idb = cbuf{}
				}
				// A count is either the buffers' true length or an invalid one.
				cnt := int32(n)
				if r.u8()%4 == 0 {
					cnt = []int32{0, -1, -1 << 31, limits.Batch + 1}[r.u8()%4]
				}
				switch op {
				case 1:
					st = hookManagerGrow(h, idb, cb, cnt)
				case 2:
					st = hookManagerRemove(h, idb, cnt)
				case 3:
					maxBlocks := r.i32() % 80
					tbl := newCBuf(4 * n * max(int(maxBlocks), 0))
					lens := newCBuf(4 * n)
					capSlots := r.i32() % 400
					slots := newCBuf(4 * max(int(capSlots), 0))
					num := newCBuf(4)
					st = hookManagerDescribe(h, idb, cnt, tbl, maxBlocks, lens, slots, capSlots, num)
					tbl.free()
					lens.free()
					slots.free()
					num.free()
				case 4:
					copies := newCBuf(8 * n)
					num := newCBuf(4)
					st = hookManagerFork(h, int64(r.u8()%8), idb, cnt, copies, int32(n), num)
					copies.free()
					num.free()
				}
				if idb.p != nil {
					idb.free()
				}
				cb.free()
			case 5:
				_, st = hookManagerStats(h, uintptr(r.u8()))
			}
			fuzzCheck(t, h, op, st)
		}
	})
}

// fuzzCheck asserts what every fuzzed call must do: return a known status
// (never KVP_ERR_INTERNAL: that is a bug), carry a message when it fails,
// and leave the manager's invariants intact.
func fuzzCheck(t *testing.T, h unsafe.Pointer, op uint8, st abiStatus) {
	t.Helper()
	if st == int(kverr.Internal) || st < 0 || !strings.HasPrefix(kverr.Code(st).String(), "KVP_") {
		t.Fatalf("op %d returned %s: %s", op, statusName(st), lastError())
	}
	if st != 0 && lastError() == "" {
		t.Fatalf("op %d failed with %s and no message", op, statusName(st))
	}
	if st := hookManagerCheck(h); st != 0 {
		t.Fatalf("invariants broken after op %d: %s", op, lastError())
	}
}

type reader struct {
	b []byte
}

func byteReader(b []byte) *reader { return &reader{b} }
func (r *reader) done() bool      { return len(r.b) == 0 }
func (r *reader) u8() uint8 {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}
func (r *reader) i32() int32 {
	if len(r.b) < 4 {
		return int32(r.u8())
	}
	v := int32(binary.LittleEndian.Uint32(r.b))
	r.b = r.b[4:]
	return v
}
