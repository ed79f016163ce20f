package main

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/limits"
)

// The standalone host store at the ABI (include/kvplug.h, "standalone host
// store"): a host.Pool of its own, driven by key through the pool's
// batched calls (core/kvtier/host/keyed.go), for engines that keep their
// own GPU block manager.

// hostStore is a kvp_host_store handle's object.
type hostStore struct {
	pool      *host.Pool
	mem       unsafe.Pointer // C memory; nil without memory
	slotBytes int64          // 0 without memory
	slots     int32
	// copying is held shared by each write and read from its slots' check
	// to the end of its copies, and exclusively by reset and destroy: a
	// reset waits for the copies that checked a slot before it, and a
	// destroy (on another thread) never frees the memory under one.
	copying   sync.RWMutex
	destroyed bool // under copying: a call that took the handle before its destroy finds it gone
}

var (
	hostStoreConfigStruct = structOf[C.kvp_host_store_config]("kvp_host_store_config", 0)
	hostStoreStatsStruct  = structOf[C.kvp_host_store_stats]("kvp_host_store_stats", 0)
)

// Segments of one key in write/read/put/get: a bound on the scatter list.
const maxSegments = 4096

func onHostStore(h *C.kvp_host_store, f func(*hostStore) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), "kvp_host_store", f)
}

// onHostStoreKeys is the shape of the store's calls on a batch of keys:
// under onHostStore's rules, the caller's n keys are checked and viewed by
// storeKeysOf's rules (name, when not "", is the output array the call
// requires; outNil, it is NULL) and given to f with the store.
func onHostStoreKeys(h *C.kvp_host_store, op string, n C.int32_t, keys *C.uint64_t, name string, outNil bool,
	f func(hs *hostStore, ks []uint64) error) C.kvp_status {
	return onHostStore(h, func(hs *hostStore) error {
		ks, err := storeKeysOf[uint64](op, n, unsafe.Pointer(keys), name, outNil)
		if err != nil {
			return err
		}
		return f(hs, ks)
	})
}

//export kvpgo_host_store_create
func kvpgo_host_store_create(cfg *C.kvp_host_store_config, out **C.kvp_host_store) C.kvp_status {
	const op = "kvp_host_store_create"
	return createHandle(op, cfg, unsafe.Pointer(out), hostStoreConfigStruct, func(c *C.kvp_host_store_config) (any, error) {
		if c.reserved != 0 {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: cfg.reserved must be 0: got %d", op, int32(c.reserved))
		}
		slots, bytes := int64(c.num_slots), int64(c.slot_bytes)
		if slots < 1 || slots > limits.TierSlots {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: num_slots must be in [1, 2^30]: got %d", op, slots)
		}
		if bytes < 0 || bytes > limits.TierBytes/slots {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: slot_bytes must be >= 0 and num_slots * slot_bytes <= 2^46: got %d slots of %d bytes", op, slots, bytes)
		}
		hs := &hostStore{slotBytes: bytes, slots: int32(slots)}
		mem := &cMemory{}
		cfgPool := host.Config{Slots: int(slots), BlockBytes: int(bytes), Alloc: mem}
		if bytes == 0 {
			// Bookkeeping only: the pool needs a size; one Go byte per slot.
			cfgPool = host.Config{Slots: int(slots), BlockBytes: 1}
		}
		p, err := host.New(cfgPool)
		if err != nil {
			mem.Release()
			return nil, kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		hs.pool, hs.mem = p, mem.p
		return hs, nil
	})
}

//export kvpgo_host_store_destroy
func kvpgo_host_store_destroy(h *C.kvp_host_store) {
	destroy(unsafe.Pointer(h), func(hs *hostStore) {
		hs.copying.Lock() // a write or read that took the handle before it went finishes first
		defer hs.copying.Unlock()
		hs.destroyed = true
		hs.pool.Reset() // the caller guarantees no device copy uses the memory any more
		_ = hs.pool.Close()
		if hs.mem != nil {
			C.free(hs.mem)
			hs.mem = nil
		}
	})
}

//export kvpgo_host_store_state
func kvpgo_host_store_state(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, states *C.int32_t, slots *C.int32_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_state", n, keys, "states", states == nil, func(hs *hostStore, ks []uint64) error {
		st := slice[int32](unsafe.Pointer(states), n)
		sl := slice[int32](unsafe.Pointer(slots), n)
		for i, k := range ks {
			s, state := hs.pool.State(k)
			st[i] = int32(state)
			if sl != nil {
				sl[i] = int32(s)
			}
		}
		return nil
	})
}

//export kvpgo_host_store_lookup_prefix
func kvpgo_host_store_lookup_prefix(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, matched *C.int32_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_lookup_prefix", n, keys, "matched", matched == nil, func(hs *hostStore, ks []uint64) error {
		*matched = C.int32_t(hs.pool.Lookup(ks))
		return nil
	})
}

//export kvpgo_host_store_reserve
func kvpgo_host_store_reserve(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, slots *C.int32_t,
	evicted *C.uint64_t, numEvicted *C.int32_t) C.kvp_status {
	const op = "kvp_host_store_reserve"
	return onHostStoreKeys(h, op, n, keys, "", false, func(hs *hostStore, ks []uint64) error {
		if slots == nil || evicted == nil || numEvicted == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: slots, evicted and num_evicted must not be NULL", op)
		}
		// host.Slot is an int32, and ReserveKeys writes nothing until the
		// whole batch fits: a refusal leaves the caller's arrays as they were.
		ne, err := hs.pool.ReserveKeys(ks, slice[host.Slot](unsafe.Pointer(slots), n),
			slice[uint64](unsafe.Pointer(evicted), n))
		if err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		*numEvicted = C.int32_t(ne)
		return nil
	})
}

//export kvpgo_host_store_complete
func kvpgo_host_store_complete(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, failed C.int32_t, num *C.int32_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_complete", n, keys, "", false, func(hs *hostStore, ks []uint64) error {
		done := hs.pool.CompleteKeys(ks, failed != 0)
		if num != nil {
			*num = C.int32_t(done)
		}
		return nil
	})
}

//export kvpgo_host_store_pin
func kvpgo_host_store_pin(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, slots *C.int32_t, num *C.int32_t) C.kvp_status {
	const op = "kvp_host_store_pin"
	return onHostStoreKeys(h, op, n, keys, "slots", slots == nil, func(hs *hostStore, ks []uint64) error {
		// As in reserve: PinKeys writes the int32 slots only once its
		// checks pass.
		pinned, err := hs.pool.PinKeys(ks, slice[host.Slot](unsafe.Pointer(slots), n))
		if err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		if num != nil {
			*num = C.int32_t(pinned)
		}
		return nil
	})
}

//export kvpgo_host_store_unpin
func kvpgo_host_store_unpin(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, num *C.int32_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_unpin", n, keys, "", false, func(hs *hostStore, ks []uint64) error {
		done := hs.pool.UnpinKeys(ks)
		if num != nil {
			*num = C.int32_t(done)
		}
		return nil
	})
}

//export kvpgo_host_store_touch
func kvpgo_host_store_touch(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_touch", n, keys, "", false, func(hs *hostStore, ks []uint64) error {
		hs.pool.TouchKeys(ks)
		return nil
	})
}

//export kvpgo_host_store_reset
func kvpgo_host_store_reset(h *C.kvp_host_store, num *C.int32_t) C.kvp_status {
	return onHostStore(h, func(hs *hostStore) error {
		hs.copying.Lock()
		defer hs.copying.Unlock()
		if hs.destroyed {
			return kverr.Errorf(kverr.InvalidHandle, "kvp_host_store_reset: the store was destroyed during the call")
		}
		dropped := hs.pool.Reset()
		if num != nil {
			*num = C.int32_t(dropped)
		}
		return nil
	})
}

//export kvpgo_host_store_stats_get
func kvpgo_host_store_stats_get(h *C.kvp_host_store, out *C.kvp_host_store_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), "kvp_host_store", "kvp_host_store_stats_get", out, hostStoreStatsStruct, func(hs *hostStore) (v C.kvp_host_store_stats) {
		s := hs.pool.Stats()
		v.reserves = C.int64_t(s.Demotions)
		v.commits = C.int64_t(s.Commits)
		v.aborts = C.int64_t(s.Aborts)
		v.refused_full = C.int64_t(s.SkippedFull)
		v.skipped_present = C.int64_t(s.SkippedPresent)
		v.evictions = C.int64_t(s.Evictions)
		v.hits = C.int64_t(s.Hits)
		v.misses = C.int64_t(s.Misses)
		v.stale = C.int64_t(s.Stale)
		v.resets = C.int64_t(s.Resets)
		v.num_slots = C.int32_t(s.Slots)
		v.resident = C.int32_t(s.Resident)
		v.pending = C.int32_t(s.Reserved)
		v.pinned = C.int32_t(s.Pinned)
		return v
	})
}

//export kvpgo_host_store_memory
func kvpgo_host_store_memory(h *C.kvp_host_store, base *unsafe.Pointer, slotBytes *C.int64_t, numSlots *C.int32_t) C.kvp_status {
	return onHostStore(h, func(hs *hostStore) error {
		if base != nil {
			*base = hs.mem
		}
		if slotBytes != nil {
			*slotBytes = C.int64_t(hs.slotBytes)
		}
		if numSlots != nil {
			*numSlots = C.int32_t(hs.slots)
		}
		return nil
	})
}

// segmentsOf validates a scatter list of n keys of segs segments each and
// views it: ptrs[i*segs+j] with length lens[i*segs+j]. total, when >= 0,
// is the length every key's segments must add up to.
func segmentsOf(op string, n, segs C.int32_t, ptrs *unsafe.Pointer, lens *C.int64_t, total int64) ([]unsafe.Pointer, []int64, error) {
	if err := checkCount(n, op+": n"); err != nil {
		return nil, nil, err
	}
	if segs < 1 || segs > maxSegments || int64(n)*int64(segs) > 1<<20 {
		return nil, nil, kverr.Errorf(kverr.InvalidArgument, "%s: segs must be in [1, %d] and n * segs <= 2^20: got %d segments of %d keys", op, maxSegments, int32(segs), int32(n))
	}
	if ptrs == nil || lens == nil {
		return nil, nil, kverr.Errorf(kverr.NullPointer, "%s: ptrs and lens must not be NULL", op)
	}
	m := C.int32_t(int64(n) * int64(segs))
	ps := slice[unsafe.Pointer](unsafe.Pointer(ptrs), m)
	ls := slice[int64](unsafe.Pointer(lens), m)
	for i := 0; i < int(n); i++ {
		sum := int64(0)
		for j := 0; j < int(segs); j++ {
			l := ls[i*int(segs)+j]
			if l < 0 || l > limits.TierBytes {
				return nil, nil, kverr.Errorf(kverr.InvalidArgument, "%s: lens[%d] is %d", op, i*int(segs)+j, l)
			}
			if l > 0 && ps[i*int(segs)+j] == nil {
				return nil, nil, kverr.Errorf(kverr.NullPointer, "%s: ptrs[%d] is NULL with a length of %d", op, i*int(segs)+j, l)
			}
			sum += l
		}
		if total >= 0 && sum != total {
			return nil, nil, kverr.Errorf(kverr.InvalidArgument, "%s: key %d's segments total %d bytes, not the slot's %d", op, i, sum, total)
		}
	}
	return ps, ls, nil
}

// hostCopy is kvp_host_store_write (in) and kvp_host_store_read.
func hostCopy(h *C.kvp_host_store, op string, n C.int32_t, slots *C.int32_t, segs C.int32_t, ptrs *unsafe.Pointer,
	lens *C.int64_t, in bool) C.kvp_status {
	return onHostStore(h, func(hs *hostStore) error {
		hs.copying.RLock()
		defer hs.copying.RUnlock()
		if hs.destroyed {
			return kverr.Errorf(kverr.InvalidHandle, "%s: the store was destroyed during the call", op)
		}
		if hs.mem == nil {
			return kverr.Errorf(kverr.Unsupported, "%s: the store has no memory (slot_bytes 0)", op)
		}
		if slots == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: slots must not be NULL", op)
		}
		ps, ls, err := segmentsOf(op, n, segs, ptrs, lens, hs.slotBytes)
		if err != nil {
			return err
		}
		sl := slice[int32](unsafe.Pointer(slots), n)
		want := host.Resident
		if in {
			want = host.Pending
		}
		for i, s := range sl {
			if s < 0 || s >= hs.slots {
				return kverr.Errorf(kverr.InvalidArgument, "%s: slots[%d] = %d is out of range [0, %d)", op, i, s, hs.slots)
			}
			k, ok := hs.pool.Hash(host.Slot(s))
			if _, state := hs.pool.State(k); !ok || state != want {
				what := "resident"
				if in {
					what = "pending (reserved and not completed)"
				}
				return kverr.Errorf(kverr.NotFound, "%s: slot %d is not %s", op, s, what)
			}
		}
		g := int(segs)
		for i, s := range sl {
			off := uintptr(int64(s) * hs.slotBytes)
			for j := 0; j < g; j++ {
				l := ls[i*g+j]
				if l == 0 {
					continue
				}
				slot := unsafe.Add(hs.mem, off)
				if in {
					C.memcpy(slot, ps[i*g+j], C.size_t(l))
				} else {
					C.memcpy(ps[i*g+j], slot, C.size_t(l))
				}
				off += uintptr(l)
			}
		}
		return nil
	})
}

//export kvpgo_host_store_write
func kvpgo_host_store_write(h *C.kvp_host_store, n C.int32_t, slots *C.int32_t, segs C.int32_t, ptrs *unsafe.Pointer, lens *C.int64_t) (st C.kvp_status) {
	return hostCopy(h, "kvp_host_store_write", n, slots, segs, ptrs, lens, true)
}

//export kvpgo_host_store_read
func kvpgo_host_store_read(h *C.kvp_host_store, n C.int32_t, slots *C.int32_t, segs C.int32_t, ptrs *unsafe.Pointer, lens *C.int64_t) (st C.kvp_status) {
	return hostCopy(h, "kvp_host_store_read", n, slots, segs, ptrs, lens, false)
}

// The standalone stores' versioned structs join the table the struct rule
// is applied from (structs.go).
func init() {
	abiStructs = append(abiStructs, hostStoreConfigStruct, hostStoreStatsStruct, sharedStoreConfigStruct, sharedStoreStatsStruct)
}
