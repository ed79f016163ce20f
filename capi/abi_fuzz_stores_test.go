package main

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// FuzzABI's part for the standalone stores (setup flag storesFlag): a host
// store driven with arbitrary keys, counts, slots and scatter lists, and a
// shared store whose server is down (port 1: every call a fault, refused at
// once, or skipped in the backoff window). The store calls are ops
// numOps ... numOps+numStoreOps-1 of call.

// storesFlag in the setup's flags byte adds the stores.
const storesFlag = 0x40

// numStoreOps is the number of store calls storeCall knows.
const numStoreOps = 21

// hostStoreCounterFields are kvp_host_store_stats' counters, which never
// decrease.
var hostStoreCounterFields = []string{"reserves", "commits", "aborts", "refused_full", "skipped_present", "evictions",
	"hits", "misses", "stale", "resets"}

// refusedFull is refused_full's index in hostStoreCounterFields.
const refusedFull = 3

// sharedStoreCounterFields are kvp_shared_store_stats' counters; with the
// server down, those of sharedStoreZeroFields stay 0.
var sharedStoreCounterFields = []string{"hits", "misses", "stores", "corrupt", "timeouts", "errors", "skipped",
	"bytes_read", "bytes_written"}
var sharedStoreZeroFields = map[string]bool{"hits": true, "stores": true, "corrupt": true, "bytes_read": true,
	"bytes_written": true}

// A call against the down server is bounded by its op_timeout_ms (50); a
// call that takes longer than this fails the run.
const sharedCallBound = 2 * time.Second

// hostStoreSeed: a host store of 4 slots of 16 bytes: keys reserved,
// written, completed, found, pinned, read back, unpinned, touched; more
// reserves (repeats, eviction), memory and stats; the shared store's
// exists, put and get against the down server; a reset and the stale
// completes and missing pins after it; a new store created, reserved,
// written and completed; a shared store created. (Found by building the
// input call by call, each chunk kept when its call succeeded.)
var hostStoreSeed = []byte{
	64, 8, 4, 3, 1, 69, 12, 92, 5, 16, 8, 11, 14, 7, 15, 174, 9, 10, 14, 10, 78, 10, 157, 67, 58, 8, 16, 5, 13,
	195, 165, 222, 10, 111, 14, 165, 15, 71, 8, 130, 6, 154, 32, 5, 12, 9, 10, 7, 15, 136, 43, 14, 13, 9, 198,
	14, 5, 11, 68, 11, 6, 12, 179, 160, 9, 10, 72, 10, 8, 94, 6, 6, 5, 255, 13, 198, 109, 224, 5, 79, 70, 108,
	14, 152, 16, 14, 13, 7, 5, 154, 37, 6, 12, 124, 67, 8, 7, 14, 174, 5, 118, 8, 14, 10, 103, 73, 6, 5, 162,
	157, 7, 83, 11, 14, 7, 81, 158, 6, 221, 14, 15, 43, 12, 74, 65, 7, 13, 12, 11, 167, 14, 7, 15, 197, 5, 6,
	81, 16, 7, 78, 70, 11, 7, 11, 27, 7, 13, 114, 9, 11, 26, 6, 70, 8, 6, 12, 13, 107, 5, 174, 5, 9, 77, 136,
	12, 11, 6, 76, 5, 10, 6, 82, 10, 118, 14, 5, 11, 9, 19, 7, 28, 143, 7, 128, 16, 44, 128, 122, 101, 124, 5,
	9, 170, 8, 198, 247, 8, 10, 14, 13, 148, 13, 60, 68, 15, 6, 8, 13, 71, 7, 13, 10, 116, 47, 96, 112, 84, 6,
	79, 143, 7, 15, 15, 10, 182, 83, 10, 13, 14, 16, 8, 120, 5, 15, 135, 8, 214, 24, 6, 16, 6, 13, 139, 15, 8,
	1, 143, 142, 219, 50, 9, 7, 8, 5, 105, 34, 10, 8, 14, 11, 5, 11, 11, 7, 43, 9, 206, 11, 12, 76, 136, 176, 5,
	8, 9, 7, 9, 6, 84, 14, 12, 12, 102, 16, 16, 10, 9, 16, 236, 6, 14, 47, 13, 7, 75, 13, 231, 7, 7, 61, 159,
	204, 98, 97, 116, 10, 75, 11, 13, 71, 58, 9, 13, 8, 199, 41, 181, 15, 144, 7, 15, 16, 8, 155, 216, 10, 14,
	5, 16, 9, 3, 10, 72, 7, 9, 8, 9, 240, 28, 11, 16, 9, 8, 13, 14, 16, 127, 167, 65, 5, 5, 14, 157, 5, 13, 71,
	15, 70, 15, 14, 14, 154, 15, 11, 6, 157, 10, 231, 6, 9, 9, 78, 8, 55, 7, 9, 11, 8, 5, 7, 12, 156, 177, 102,
	203, 8, 14, 10, 71, 14, 16, 14, 6, 8, 6, 12, 5, 15, 11, 5, 172, 11, 8, 111, 12, 80, 254, 15, 28, 127, 213,
	9, 9, 49, 185, 10, 14, 150, 8, 13, 13, 136, 85, 174, 14, 16,
}

// hostStoreBareSeed: a bookkeeping-only host store (4 slots, no memory):
// reserves, completes, touches, pins, unpins, a lookup and a reset, then a
// write refused (no memory).
var hostStoreBareSeed = []byte{
	64, 8, 4, 3, 0, 69, 7, 224, 11, 103, 182, 44, 12, 13, 177, 5, 9, 234, 16, 71, 5, 12, 121, 9, 10, 16, 5, 5,
	69, 7, 12, 7, 14, 9, 16, 9, 7, 145, 71, 12, 15, 14, 16, 15, 11, 14, 13, 211, 15, 9, 10, 246, 16, 8, 14, 209,
	14, 199, 74, 5, 255, 74, 14, 10, 105, 12, 8, 14, 114, 9, 36, 10, 125, 5, 12, 70, 5, 13, 15, 55, 17, 159, 10,
	9, 5, 6, 9, 72, 12, 8, 9, 11, 164, 31, 197, 234, 97, 9, 103, 13, 69, 124, 12, 14, 12, 10, 11, 10, 10, 249,
	73, 200, 39, 6, 59, 9, 6, 15, 9, 13, 248, 49, 15, 10, 9, 71, 9, 53, 14, 10, 13, 9, 11, 190, 10, 5, 144, 14,
	7, 212, 11, 9, 20, 8, 13, 14, 68, 43, 5, 172, 7, 5, 76, 15, 7, 175, 11, 5, 11, 14, 6, 12, 158, 7, 75, 229,
	8, 73, 11, 8, 9, 13, 11, 9, 11, 12, 5, 165, 8, 78, 8, 199, 13, 13, 157, 5, 210, 15, 12, 13, 186, 5, 46, 5,
	61, 9,
}

// storeSetup creates the current host store (slots and bytes from the next
// two bytes), the current shared store (port 1, short timeouts and
// backoff) and a destroyed one of each.
func (fz *abiFuzz) storeSetup() {
	slots := int32(fz.small(8)) + 1
	bytes := []int64{0, 16, 24, 64}[fz.small(4)]
	fz.hs = fz.newHostStore(slots, bytes)
	fz.hsSlots, fz.hsBytes = slots, bytes
	fz.hsCounters = make([]int64, len(hostStoreCounterFields))
	fz.staleHS = fz.newHostStore(2, 0)
	rawHostStoreDestroy(fz.staleHS)
	fz.ss = fz.newSharedStore()
	fz.ssCounters = make([]int64, len(sharedStoreCounterFields))
	fz.staleSS = fz.newSharedStore()
	rawSharedStoreDestroy(fz.staleSS)
	fz.stores = true
}

func (fz *abiFuzz) newHostStore(slots int32, bytes int64) ptr {
	const name = "kvp_host_store_config"
	cfg := fz.alloc(int(cLayouts[name].size))
	setField(cfg, name, "struct_size", int64(cLayouts[name].size))
	setField(cfg, name, "num_slots", int64(slots))
	setField(cfg, name, "slot_bytes", bytes)
	out := fz.alloc(8)
	if st := rawHostStoreCreate(cfg, out); st != 0 {
		fz.t.Fatalf("setup host store (%d slots of %d bytes): %s", slots, bytes, lastError())
	}
	return *(*ptr)(out)
}

func (fz *abiFuzz) cString(v string) ptr {
	p := fz.alloc(len(v) + 1)
	copy(unsafe.Slice((*byte)(p), len(v)), v)
	return p
}

func (fz *abiFuzz) newSharedStore() ptr {
	const name = "kvp_shared_store_config"
	l := cLayouts[name]
	cfg := fz.alloc(int(l.size))
	setField(cfg, name, "struct_size", int64(l.size))
	*(*ptr)(unsafe.Add(cfg, l.fields["address"].off)) = fz.cString("127.0.0.1:1")
	*(*ptr)(unsafe.Add(cfg, l.fields["key_space"].off)) = fz.cString("fuzz")
	setField(cfg, name, "dial_timeout_ms", 50)
	setField(cfg, name, "op_timeout_ms", 50)
	setField(cfg, name, "backoff_ms", 5)
	setField(cfg, name, "max_backoff_ms", 20)
	out := fz.alloc(8)
	if st := rawSharedStoreCreate(cfg, out); st != 0 {
		fz.t.Fatalf("setup shared store: %s", lastError())
	}
	return *(*ptr)(out)
}

func (fz *abiFuzz) closeStores() {
	rawHostStoreDestroy(fz.hs)
	rawSharedStoreDestroy(fz.ss)
	fz.hs, fz.ss = nil, nil
}

// storeHandle picks the handle a store call gets: mostly the current store
// of its kind, else NULL, junk, a destroyed one, the manager or the other
// kind of store.
func (fz *abiFuzz) storeHandle(host bool) ptr {
	if host {
		return fz.pickHandle(16, fz.hs, fz.staleHS, fz.m, fz.ss)
	}
	return fz.pickHandle(16, fz.ss, fz.staleSS, fz.m, fz.hs)
}

// storeKey is one of a few small keys (repeats, keys dropped by a reset
// coming back) or now and then an arbitrary one.
func (fz *abiFuzz) storeKey() int64 {
	if fz.r.u8()%8 == 0 {
		return fz.i64()
	}
	return int64(fz.small(12))
}

// hostKeys is a host store call's handle (storeHandle) and keys
// (storeKeys), picked in that order.
func (fz *abiFuzz) hostKeys() (ptr, ptr, int32, int) {
	h := fz.storeHandle(true)
	keys, cnt, n := fz.storeKeys()
	return h, keys, cnt, n
}

// storeKeys is n keys and their count (see count), the array NULL 1 in 10.
func (fz *abiFuzz) storeKeys() (ptr, int32, int) {
	n := 1 + fz.small(6)
	return fz.array(n, 8, fz.storeKey), fz.count(n), n
}

// filled is room for n int32 outputs preset to v, or NULL (1 in 12).
func (fz *abiFuzz) filled(n int, v int32) ptr {
	p := fz.outp(4 * max(n, 1))
	if p != nil {
		for i := range max(n, 1) {
			*(*int32)(unsafe.Add(p, 4*i)) = v
		}
	}
	return p
}

func int32s(p ptr, n int) []int32 {
	if p == nil {
		return nil
	}
	return append([]int32(nil), unsafe.Slice((*int32)(p), n)...)
}

const unset = int32(0x5a5a5a5a)

// segs is a scatter list's segments per item: 1 to 3, or an invalid count.
func (fz *abiFuzz) segs() int32 {
	if fz.r.u8()%8 == 0 {
		return []int32{0, -1, 4097, math.MaxInt32, math.MinInt32}[fz.small(5)]
	}
	return int32(fz.small(3)) + 1
}

// scatter builds the ptrs and lens of n items of segs segments, each item's
// lengths summing to total (when >= 0; else small arbitrary ones), now and
// then one perturbed (off by one, negative, 0) or a pointer NULL; each
// segment points at C memory of its length filled with fill. Either array
// may be NULL. Arrays hold n * segs entries when segs is valid (the
// library reads nothing of them otherwise).
func (fz *abiFuzz) scatter(n int, segs int32, total int64, fill byte) (ptrs, lens ptr, bufs [][]byte) {
	m := 1
	if segs >= 1 && segs <= 3 {
		m = n * int(segs)
	}
	ptrs, lens = fz.alloc(8*m), fz.alloc(8*m)
	ps, ls := unsafe.Slice((*ptr)(ptrs), m), unsafe.Slice((*int64)(lens), m)
	g := max(int(segs), 1)
	for i := range m {
		var l int64
		if total >= 0 {
			l = total / int64(g)
			if i%g == g-1 {
				l = total - l*int64(g-1)
			}
		} else {
			l = int64(fz.small(48))
		}
		if fz.r.u8()%10 == 0 {
			l = []int64{l + 1, l - 1, -1, 0, math.MinInt64}[fz.small(5)]
		}
		ls[i] = l
		if fz.r.u8()%16 == 0 {
			continue // NULL
		}
		b := fz.alloc(int(max(l, 1)))
		s := unsafe.Slice((*byte)(b), max(l, 1))
		for j := range s {
			s[j] = fill
		}
		ps[i], bufs = b, append(bufs, s)
	}
	switch fz.r.u8() % 16 {
	case 0:
		ptrs = nil
	case 1:
		lens = nil
	}
	return ptrs, lens, bufs
}

// slotsFor is n slot numbers: mostly in range (often those the last reserve
// or pin handed out), else -1 or arbitrary. NULL 1 in 10.
func (fz *abiFuzz) slotsFor(n int) ptr {
	return fz.array(n, 4, func() int64 {
		switch b := fz.r.u8() % 8; {
		case b < 3 && len(fz.hsHanded) > 0:
			return int64(fz.hsHanded[fz.small(len(fz.hsHanded))])
		case b == 6:
			return []int64{-1, int64(fz.hsSlots), math.MaxInt32, math.MinInt32}[fz.small(4)]
		case b == 7:
			return fz.i64()
		}
		return int64(fz.small(int(fz.hsSlots)))
	})
}

// storeCall makes the store call numbered op; as call.
func (fz *abiFuzz) storeCall(op uint8) (string, int) {
	switch op {
	case 0:
		return fz.createHostStore()
	case 1:
		h := fz.storeHandle(true)
		if h == fz.hs && h != nil {
			return "kvp_host_store_destroy", -1 // the current one stays
		}
		rawHostStoreDestroy(h) // a no-op on anything but a host store
		return "kvp_host_store_destroy", -1
	case 2:
		h, keys, cnt, n := fz.hostKeys()
		states, slots := fz.filled(n, unset), fz.filled(n, unset)
		st := rawHostStoreState(h, cnt, keys, states, slots)
		if st == 0 && h == fz.hs {
			ss, sl := int32s(states, n), int32s(slots, n)
			for i, s := range ss {
				if s < 0 || s > 2 || (sl != nil && ((s == 0) != (sl[i] == -1) || sl[i] < -1 || sl[i] >= fz.hsSlots)) {
					fz.t.Fatalf("kvp_host_store_state: states %v slots %v with %d slots", ss, sl, fz.hsSlots)
				}
			}
		}
		return "kvp_host_store_state", st
	case 3:
		h, keys, cnt, n := fz.hostKeys()
		matched := fz.filled(1, unset)
		st := rawHostStoreLookupPrefix(h, cnt, keys, matched)
		if st == 0 && h == fz.hs {
			if m := *(*int32)(matched); m < 0 || int(m) > n {
				fz.t.Fatalf("kvp_host_store_lookup_prefix matched %d of %d", m, n)
			}
		}
		return "kvp_host_store_lookup_prefix", st
	case 4, 5:
		return fz.hostReserve()
	case 6:
		h, keys, cnt, n := fz.hostKeys()
		failed := int32(0)
		if fz.r.u8()%4 == 0 {
			failed = fz.i32()
		}
		num := fz.filled(1, unset)
		st := rawHostStoreComplete(h, cnt, keys, failed, num)
		if st == 0 && h == fz.hs && num != nil {
			if c := *(*int32)(num); c < 0 || int(c) > n {
				fz.t.Fatalf("kvp_host_store_complete completed %d of %d", c, n)
			}
		}
		return "kvp_host_store_complete", st
	case 7:
		h, keys, cnt, n := fz.hostKeys()
		slots, num := fz.filled(n, unset), fz.filled(1, unset)
		st := rawHostStorePin(h, cnt, keys, slots, num)
		if st == 0 && h == fz.hs {
			pinned := int32(0)
			for _, s := range int32s(slots, n) {
				if s < -1 || s >= fz.hsSlots {
					fz.t.Fatalf("kvp_host_store_pin: slot %d of %d", s, fz.hsSlots)
				}
				if s >= 0 {
					pinned++
					fz.hsHanded = append(fz.hsHanded, s)
				}
			}
			if num != nil && *(*int32)(num) != pinned {
				fz.t.Fatalf("kvp_host_store_pin: num_pinned %d, %d slots", *(*int32)(num), pinned)
			}
		}
		return "kvp_host_store_pin", st
	case 8:
		h, keys, cnt, n := fz.hostKeys()
		num := fz.filled(1, unset)
		st := rawHostStoreUnpin(h, cnt, keys, num)
		if st == 0 && h == fz.hs && num != nil {
			if c := *(*int32)(num); c < 0 || int(c) > n {
				fz.t.Fatalf("kvp_host_store_unpin unpinned %d of %d", c, n)
			}
		}
		return "kvp_host_store_unpin", st
	case 9:
		keys, cnt, _ := fz.storeKeys()
		return "kvp_host_store_touch", rawHostStoreTouch(fz.storeHandle(true), cnt, keys)
	case 10:
		h := fz.storeHandle(true)
		num := fz.filled(1, unset)
		st := rawHostStoreReset(h, num)
		if st == 0 && h == fz.hs {
			if num != nil && (*(*int32)(num) < 0 || *(*int32)(num) > fz.hsSlots) {
				fz.t.Fatalf("kvp_host_store_reset dropped %d of %d", *(*int32)(num), fz.hsSlots)
			}
			if g := fz.hostStoreStats()[len(hostStoreCounterFields)+1:]; g[0]+g[1]+g[2] != 0 {
				fz.t.Fatalf("after kvp_host_store_reset: resident, pending, pinned %v", g)
			}
			fz.hsHanded = nil
		}
		return "kvp_host_store_reset", st
	case 11:
		return "kvp_host_store_stats_get", rawHostStoreStats(fz.storeHandle(true), fz.outStruct("kvp_host_store_stats"))
	case 12:
		h, base, bytes, slots := fz.storeHandle(true), fz.outp(8), fz.outp(8), fz.outp(4)
		st := rawHostStoreMemory(h, base, bytes, slots)
		if st == 0 && h == fz.hs {
			if (base != nil && (*(*ptr)(base) == nil) != (fz.hsBytes == 0)) || (bytes != nil && *(*int64)(bytes) != fz.hsBytes) ||
				(slots != nil && *(*int32)(slots) != fz.hsSlots) {
				fz.t.Fatalf("kvp_host_store_memory: wrong region for %d slots of %d bytes", fz.hsSlots, fz.hsBytes)
			}
		}
		return "kvp_host_store_memory", st
	case 13, 14:
		h := fz.storeHandle(true)
		n := 1 + fz.small(3)
		slots := fz.slotsFor(n)
		segs := fz.segs()
		total := fz.hsBytes
		if fz.r.u8()%8 == 0 {
			total = int64(fz.small(40))
		}
		ptrs, lens, _ := fz.scatter(n, segs, total, byte(op))
		cnt := fz.count(n)
		name := "kvp_host_store_write"
		var st int
		if op == 13 {
			st = rawHostStoreWrite(h, cnt, slots, segs, ptrs, lens)
		} else {
			name = "kvp_host_store_read"
			st = rawHostStoreRead(h, cnt, slots, segs, ptrs, lens)
		}
		if st == 0 && h == fz.hs && fz.hsBytes == 0 {
			fz.t.Fatalf("%s succeeded on a store without memory", name)
		}
		return name, st
	case 15:
		return fz.createSharedStore()
	case 16:
		h := fz.storeHandle(false)
		if h == fz.ss && h != nil {
			return "kvp_shared_store_destroy", -1
		}
		rawSharedStoreDestroy(h)
		return "kvp_shared_store_destroy", -1
	case 17, 18, 19:
		return fz.sharedCall(op)
	case 20:
		return "kvp_shared_store_stats_get", rawSharedStoreStats(fz.storeHandle(false), fz.outStruct("kvp_shared_store_stats"))
	}
	panic(fmt.Sprintf("no store call numbered %d", op))
}

// hostReserve reserves arbitrary keys: on success the slots are distinct
// and in range (-1 for keys held or repeated), on a failure the caller's
// arrays are as they were.
func (fz *abiFuzz) hostReserve() (string, int) {
	h, keys, cnt, n := fz.hostKeys()
	slots := fz.filled(n, unset)
	evicted := fz.outp(8 * n)
	numEvicted := fz.filled(1, unset)
	st := rawHostStoreReserve(h, cnt, keys, slots, evicted, numEvicted)
	sl := int32s(slots, n)
	if st != 0 {
		for _, s := range sl {
			if s != unset {
				fz.t.Fatalf("kvp_host_store_reserve failed (%s) and wrote slots %v", statusName(st), sl)
			}
		}
		if numEvicted != nil && *(*int32)(numEvicted) != unset {
			fz.t.Fatalf("kvp_host_store_reserve failed (%s) and wrote num_evicted", statusName(st))
		}
		return "kvp_host_store_reserve", st
	}
	if h != fz.hs {
		return "kvp_host_store_reserve", st
	}
	seen := map[int32]bool{}
	for _, s := range sl {
		if s == -1 {
			continue
		}
		if s < 0 || s >= fz.hsSlots || seen[s] {
			fz.t.Fatalf("kvp_host_store_reserve: slots %v with %d slots", sl, fz.hsSlots)
		}
		seen[s] = true
		fz.hsHanded = append(fz.hsHanded, s)
	}
	if ne := *(*int32)(numEvicted); ne < 0 || int(ne) > n {
		fz.t.Fatalf("kvp_host_store_reserve: %d evicted of %d keys", ne, n)
	}
	if len(fz.hsHanded) > 32 {
		fz.hsHanded = fz.hsHanded[len(fz.hsHanded)-32:]
	}
	return "kvp_host_store_reserve", st
}

// hostStoreStats returns the current host store's counters (in the order
// of hostStoreCounterFields), then num_slots, resident, pending, pinned.
func (fz *abiFuzz) hostStoreStats() []int64 {
	return fz.readStats("kvp_host_store_stats", rawHostStoreStats, fz.hs, hostStoreCounterFields,
		[]string{"num_slots", "resident", "pending", "pinned"})
}

// sharedStoreStats returns the current shared store's counters (in the
// order of sharedStoreCounterFields).
func (fz *abiFuzz) sharedStoreStats() []int64 {
	return fz.readStats("kvp_shared_store_stats", rawSharedStoreStats, fz.ss, sharedStoreCounterFields, nil)
}

// storeSnapshot is what a caller can observe of the current stores: every
// field of their stats but the host store's refused_full (a reserve
// refused for room counts its keys there, as the header says; checkStores
// checks that nothing else moves it) and the shared store's available (a
// clock's).
func (fz *abiFuzz) storeSnapshot(b *bytes.Buffer) {
	if !fz.stores {
		return
	}
	for i, x := range fz.hostStoreStats() {
		if i == refusedFull {
			continue
		}
		b.Write(unsafe.Slice((*byte)(unsafe.Pointer(&x)), 8))
	}
	for _, x := range fz.sharedStoreStats() {
		b.Write(unsafe.Slice((*byte)(unsafe.Pointer(&x)), 8))
	}
}

// checkStores checks the stores' stats after a call: counters never
// decrease; the host store's gauges stay within its slots (pending slots
// are pinned, pinned ones resident or pending); the shared store never
// stored or found anything.
func (fz *abiFuzz) checkStores(name string) {
	if !fz.stores {
		return
	}
	v := fz.hostStoreStats()
	n := len(hostStoreCounterFields)
	for i, f := range hostStoreCounterFields {
		if v[i] < fz.hsCounters[i] {
			fz.t.Fatalf("after %s: host store stat %s went from %d to %d", name, f, fz.hsCounters[i], v[i])
		}
	}
	slots, resident, pending, pinned := v[n], v[n+1], v[n+2], v[n+3]
	if slots != int64(fz.hsSlots) || resident < 0 || pending < 0 || resident+pending > slots || pinned < pending ||
		pinned > resident+pending {
		fz.t.Fatalf("after %s: host store gauges %v with %d slots", name, v[n:], fz.hsSlots)
	}
	if v[refusedFull] != fz.hsCounters[refusedFull] && (name != "kvp_host_store_reserve" || fz.lastStatus != int(kverr.OutOfBlocks)) {
		fz.t.Fatalf("after %s (%s): refused_full went from %d to %d", name, statusName(fz.lastStatus), fz.hsCounters[refusedFull], v[refusedFull])
	}
	fz.hsCounters = v[:n]
	s := fz.sharedStoreStats()
	for i, f := range sharedStoreCounterFields {
		if s[i] < fz.ssCounters[i] || (sharedStoreZeroFields[f] && s[i] != 0) {
			fz.t.Fatalf("after %s: shared store stat %s went from %d to %d (the server is down)", name, f, fz.ssCounters[i], s[i])
		}
	}
	fz.ssCounters = s
}

// createHostStore creates a store from an arbitrary config: valid ones
// small (up to 64 slots of up to 4 KiB), invalid ones anywhere. A full-size
// config is accepted exactly when valid, refused with INVALID_ARGUMENT
// otherwise; a refusal leaves no handle. An accepted store becomes the
// current one.
func (fz *abiFuzz) createHostStore() (string, int) {
	const name = "kvp_host_store_config"
	l := cLayouts[name]
	cfg := fz.structBuf(name)
	size := *(*uintptr)(cfg)
	var slots int32
	var bytes int64
	var reserved int32
	if size >= l.size && size <= 1<<16 {
		switch fz.small(4) {
		case 0, 1:
			slots = int32(fz.small(8)) + 1
		case 2:
			slots = []int32{0, -1, 1<<30 + 1, math.MinInt32, math.MaxInt32}[fz.small(5)]
		default:
			if slots = fz.i32(); slots > 64 && slots <= 1<<30 {
				slots = slots%64 + 1
			}
		}
		valid := slots >= 1 && slots <= 1<<30
		switch fz.small(4) {
		case 0:
			bytes = 0
		case 1:
			bytes = 8 * int64(fz.small(8)+1)
		case 2:
			bytes = []int64{-1, math.MinInt64, 1<<46 + 1, math.MaxInt64}[fz.small(4)]
			if valid && fz.r.u8()%2 == 0 {
				bytes = (1<<46)/int64(slots) + 1
			}
		default:
			if bytes = fz.i64(); bytes > 4096 && valid && bytes <= (1<<46)/int64(slots) {
				bytes %= 4096
			}
		}
		if fz.r.u8()%8 == 0 {
			reserved = fz.i32()
		}
		setField(cfg, name, "num_slots", int64(slots))
		setField(cfg, name, "slot_bytes", bytes)
		setField(cfg, name, "reserved", int64(reserved))
	}
	bad := reserved != 0 || slots < 1 || slots > 1<<30 || bytes < 0 || bytes > (1<<46)/max(int64(slots), 1)
	cfg, out := fz.createArgs(cfg)
	live := fz.liveHandles()
	st := rawHostStoreCreate(cfg, out)
	if st == 0 {
		if bad {
			fz.t.Fatalf("kvp_host_store_create accepted %d slots of %d bytes, reserved %d", slots, bytes, reserved)
		}
		rawHostStoreDestroy(fz.hs)
		fz.hs = *(*ptr)(out)
		fz.hsSlots, fz.hsBytes, fz.hsHanded = slots, bytes, nil
		fz.hsCounters = make([]int64, len(hostStoreCounterFields))
		return "kvp_host_store_create", st
	}
	fz.createFailed("kvp_host_store_create", live, out)
	if cfg != nil && out != nil && size == l.size {
		if want := map[bool]int{true: int(kverr.InvalidArgument), false: 0}[bad]; st != want {
			fz.t.Fatalf("kvp_host_store_create of %d slots of %d bytes, reserved %d: %s (%s)", slots, bytes, reserved,
				statusName(st), lastError())
		}
	}
	return "kvp_host_store_create", st
}

// createSharedStore creates a client from an arbitrary config and destroys
// it at once (the current one keeps its short timeouts): a full-size
// config is refused with NULL_POINTER for a NULL string, INVALID_ARGUMENT
// for a bad field, and otherwise accepted (an empty address may go either
// way); a refusal leaves no handle.
func (fz *abiFuzz) createSharedStore() (string, int) {
	const name = "kvp_shared_store_config"
	l := cLayouts[name]
	cfg := fz.structBuf(name)
	size := *(*uintptr)(cfg)
	addrs := []string{"127.0.0.1:1", "", strings.Repeat("a", 1025), "localhost:1"}
	nss := []string{"fuzz", "", "bad/x", strings.Repeat("n", 65), "a.b-c_D9", "sp ace"}
	ai, ni := fz.small(len(addrs)+1), fz.small(len(nss)+1) // the last: NULL
	var times [5]int64
	var blockBytes, reserved int64
	if size >= l.size && size <= 1<<16 {
		str := func(v []string, i int) ptr {
			if i == len(v) {
				return nil
			}
			return fz.cString(v[i])
		}
		*(*ptr)(unsafe.Add(cfg, l.fields["address"].off)) = str(addrs, ai)
		*(*ptr)(unsafe.Add(cfg, l.fields["key_space"].off)) = str(nss, ni)
		for i, f := range []string{"dial_timeout_ms", "op_timeout_ms", "ttl_ms", "backoff_ms", "max_backoff_ms"} {
			if fz.r.u8()%6 == 0 {
				times[i] = int64(fz.i32())
			}
			setField(cfg, name, f, times[i])
		}
		blockBytes = []int64{0, 64, -1, 1<<40 + 1, fz.i64()}[fz.small(5)]
		setField(cfg, name, "block_bytes", blockBytes)
		setField(cfg, name, "fingerprint", fz.i64())
		if fz.r.u8()%8 == 0 {
			reserved = int64(fz.i32())
		}
		setField(cfg, name, "reserved", reserved)
	}
	nullStr := ai == len(addrs) || ni == len(nss)
	bad := reserved != 0 || ai == 2 || (ni != 0 && ni != 4) || blockBytes < 0 || blockBytes > 1<<40
	for _, v := range times {
		bad = bad || v < 0
	}
	cfg, out := fz.createArgs(cfg)
	live := fz.liveHandles()
	st := rawSharedStoreCreate(cfg, out)
	if st == 0 {
		if nullStr || bad {
			fz.t.Fatalf("kvp_shared_store_create accepted a bad config (address %d, key space %d, times %v, block_bytes %d, reserved %d)",
				ai, ni, times, blockBytes, reserved)
		}
		rawSharedStoreDestroy(*(*ptr)(out))
		if after := fz.liveHandles(); after != live {
			fz.t.Fatalf("kvp_shared_store_create and destroy: %d live handles before, %d after", live, after)
		}
		return "kvp_shared_store_create", st
	}
	fz.createFailed("kvp_shared_store_create", live, out)
	if cfg != nil && out != nil && size == l.size {
		want := 0
		switch {
		case nullStr:
			want = int(kverr.NullPointer)
		case bad:
			want = int(kverr.InvalidArgument)
		case ai == 1: // an empty address: refused or not
			want = st
		}
		if st != want {
			fz.t.Fatalf("kvp_shared_store_create (address %d, key space %d, times %v, block_bytes %d, reserved %d): %s (%s)",
				ai, ni, times, blockBytes, reserved, statusName(st), lastError())
		}
	}
	return "kvp_shared_store_create", st
}

// sharedCall is exists (17), put (18) or get (19) on arbitrary keys and
// scatter lists against the down server: within sharedCallBound, nothing
// found or stored, a get's buffers untouched.
func (fz *abiFuzz) sharedCall(op uint8) (string, int) {
	h := fz.storeHandle(false)
	n := 1 + fz.small(4)
	var keys ptr
	if fz.r.u8()%10 != 0 {
		keys = fz.alloc(16 * n)
		for i := range 16 * n {
			*(*byte)(unsafe.Add(keys, i)) = byte(fz.small(4))
		}
	}
	cnt := fz.count(n)
	out := fz.filled(n, unset)
	var name string
	var st int
	var bufs [][]byte
	start := time.Now()
	switch op {
	case 17:
		name = "kvp_shared_store_exists"
		st = rawSharedStoreExists(h, cnt, keys, out)
	case 18:
		name = "kvp_shared_store_put"
		segs := fz.segs()
		ptrs, lens, _ := fz.scatter(n, segs, -1, 0x11)
		st = rawSharedStorePut(h, cnt, keys, segs, ptrs, lens, out)
	default:
		name = "kvp_shared_store_get"
		segs := fz.segs()
		var ptrs, lens ptr
		ptrs, lens, bufs = fz.scatter(n, segs, -1, 0xa5)
		st = rawSharedStoreGet(h, cnt, keys, segs, ptrs, lens, out)
	}
	if d := time.Since(start); d > sharedCallBound {
		fz.t.Fatalf("%s against a server that is down took %v", name, d)
	}
	if st == 0 && h == fz.ss && out != nil {
		m := n
		if op == 18 {
			m = 1 // num_stored
		}
		for _, v := range int32s(out, m) {
			if v != 0 {
				fz.t.Fatalf("%s against a server that is down: %v", name, int32s(out, m))
			}
		}
	}
	for _, b := range bufs {
		if !bytes.Equal(b, bytes.Repeat([]byte{0xa5}, len(b))) {
			fz.t.Fatalf("%s against a server that is down wrote the caller's buffers (%s)", name, statusName(st))
		}
	}
	return name, st
}

// The store seeds reach the calls they were built for, with success: the
// plain test run's FuzzABI exercises the stores' paths, not only their
// argument checks.
func TestFuzzABIStoreSeeds(t *testing.T) {
	lockThread(t)
	for _, c := range []struct {
		name string
		seed []byte
		want map[string]int
	}{
		{"memory", hostStoreSeed, map[string]int{"kvp_host_store_reserve": 4, "kvp_host_store_write": 2,
			"kvp_host_store_complete": 3, "kvp_host_store_lookup_prefix": 1, "kvp_host_store_pin": 2, "kvp_host_store_read": 1,
			"kvp_host_store_state": 1, "kvp_host_store_unpin": 1, "kvp_host_store_touch": 1, "kvp_host_store_memory": 1,
			"kvp_host_store_stats_get": 1, "kvp_host_store_reset": 1, "kvp_host_store_create": 1, "kvp_shared_store_exists": 1,
			"kvp_shared_store_put": 1, "kvp_shared_store_get": 1, "kvp_shared_store_create": 1, "kvp_shared_store_stats_get": 1}},
		{"bare", hostStoreBareSeed, map[string]int{"kvp_host_store_reserve": 4, "kvp_host_store_complete": 3,
			"kvp_host_store_touch": 1, "kvp_host_store_pin": 1, "kvp_host_store_unpin": 2, "kvp_host_store_lookup_prefix": 1,
			"kvp_host_store_reset": 1}},
	} {
		fz := &abiFuzz{t: t, r: byteReader(c.seed), junk: newCBuf(64), gpu: cuda.Available(), ok: map[string]int{}}
		fz.setup()
		for i := 0; !fz.r.done() && i < 64; i++ {
			fz.step()
		}
		fz.close()
		for name, n := range c.want {
			if fz.ok[name] < n {
				t.Errorf("%s seed: %d successful %s, want %d (all: %v)", c.name, fz.ok[name], name, n, fz.ok)
			}
		}
	}
}
