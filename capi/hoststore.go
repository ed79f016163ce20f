package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/kvtier/hoststore"
	"github.com/kvplug/kvplug/core/limits"
)

// The standalone host store at the ABI (include/kvplug.h, "standalone host
// store"): a hoststore.Store, whose memory this file allocates in C
// (cMemory, tier.go), since the caller keeps its address.

var (
	hostStoreConfigStruct = structOf[C.kvp_host_store_config]("kvp_host_store_config", 0)
	hostStoreStatsStruct  = structOf[C.kvp_host_store_stats]("kvp_host_store_stats", 0)
)

func onHostStore(h *C.kvp_host_store, f func(*hoststore.Store) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), "kvp_host_store", f)
}

// onHostStoreKeys is the shape of the store's calls on a batch of keys:
// under onHostStore's rules, the caller's n keys are checked and viewed by
// storeKeysOf's rules (name, when not "", is the output array the call
// requires; outNil, it is NULL) and given to f with the store.
func onHostStoreKeys(h *C.kvp_host_store, op string, n C.int32_t, keys *C.uint64_t, name string, outNil bool,
	f func(hs *hoststore.Store, ks []uint64) error) C.kvp_status {
	return onHostStore(h, func(hs *hoststore.Store) error {
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
		hs, err := hoststore.New(hoststore.Config{Slots: int(slots), SlotBytes: int(bytes), Memory: &cMemory{}})
		if err != nil {
			return nil, kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		return hs, nil
	})
}

//export kvpgo_host_store_destroy
func kvpgo_host_store_destroy(h *C.kvp_host_store) {
	destroy(unsafe.Pointer(h), (*hoststore.Store).Close)
}

//export kvpgo_host_store_state
func kvpgo_host_store_state(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, states *C.int32_t, slots *C.int32_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_state", n, keys, "states", states == nil, func(hs *hoststore.Store, ks []uint64) error {
		st := slice[int32](unsafe.Pointer(states), n)
		sl := slice[int32](unsafe.Pointer(slots), n)
		for i, k := range ks {
			s, state := hs.State(k)
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
	return onHostStoreKeys(h, "kvp_host_store_lookup_prefix", n, keys, "matched", matched == nil, func(hs *hoststore.Store, ks []uint64) error {
		*matched = C.int32_t(hs.Lookup(ks))
		return nil
	})
}

//export kvpgo_host_store_reserve
func kvpgo_host_store_reserve(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, slots *C.int32_t,
	evicted *C.uint64_t, numEvicted *C.int32_t) C.kvp_status {
	const op = "kvp_host_store_reserve"
	return onHostStoreKeys(h, op, n, keys, "", false, func(hs *hoststore.Store, ks []uint64) error {
		if slots == nil || evicted == nil || numEvicted == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: slots, evicted and num_evicted must not be NULL", op)
		}
		// host.Slot is an int32, and ReserveKeys writes nothing until the
		// whole batch fits: a refusal leaves the caller's arrays as they were.
		ne, err := hs.ReserveKeys(ks, slice[host.Slot](unsafe.Pointer(slots), n),
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
	return onHostStoreKeys(h, "kvp_host_store_complete", n, keys, "", false, func(hs *hoststore.Store, ks []uint64) error {
		done := hs.CompleteKeys(ks, failed != 0)
		if num != nil {
			*num = C.int32_t(done)
		}
		return nil
	})
}

//export kvpgo_host_store_pin
func kvpgo_host_store_pin(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t, slots *C.int32_t, num *C.int32_t) C.kvp_status {
	const op = "kvp_host_store_pin"
	return onHostStoreKeys(h, op, n, keys, "slots", slots == nil, func(hs *hoststore.Store, ks []uint64) error {
		// As in reserve: PinKeys writes the int32 slots only once its
		// checks pass.
		pinned, err := hs.PinKeys(ks, slice[host.Slot](unsafe.Pointer(slots), n))
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
	return onHostStoreKeys(h, "kvp_host_store_unpin", n, keys, "", false, func(hs *hoststore.Store, ks []uint64) error {
		done := hs.UnpinKeys(ks)
		if num != nil {
			*num = C.int32_t(done)
		}
		return nil
	})
}

//export kvpgo_host_store_touch
func kvpgo_host_store_touch(h *C.kvp_host_store, n C.int32_t, keys *C.uint64_t) C.kvp_status {
	return onHostStoreKeys(h, "kvp_host_store_touch", n, keys, "", false, func(hs *hoststore.Store, ks []uint64) error {
		hs.TouchKeys(ks)
		return nil
	})
}

//export kvpgo_host_store_reset
func kvpgo_host_store_reset(h *C.kvp_host_store, num *C.int32_t) C.kvp_status {
	return onHostStore(h, func(hs *hoststore.Store) error {
		dropped, err := hs.Reset()
		if err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, "kvp_host_store_reset")
		}
		if num != nil {
			*num = C.int32_t(dropped)
		}
		return nil
	})
}

//export kvpgo_host_store_stats_get
func kvpgo_host_store_stats_get(h *C.kvp_host_store, out *C.kvp_host_store_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), "kvp_host_store", "kvp_host_store_stats_get", out, hostStoreStatsStruct, func(hs *hoststore.Store) C.kvp_host_store_stats {
		return hostStoreStatsOf(hs.Stats())
	})
}

// hostStoreStatsOf is the ABI's names for the pool's counters: a reserve
// is a demotion in the pool's terms, a refusal a skip.
func hostStoreStatsOf(s host.Stats) (v C.kvp_host_store_stats) {
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
}

//export kvpgo_host_store_memory
func kvpgo_host_store_memory(h *C.kvp_host_store, base *unsafe.Pointer, slotBytes *C.int64_t, numSlots *C.int32_t) C.kvp_status {
	return onHostStore(h, func(hs *hoststore.Store) error {
		if base != nil {
			*base = unsafe.Pointer(unsafe.SliceData(hs.Memory()))
		}
		if slotBytes != nil {
			*slotBytes = C.int64_t(hs.SlotBytes())
		}
		if numSlots != nil {
			*numSlots = C.int32_t(hs.Slots())
		}
		return nil
	})
}

// scatterOf checks a scatter list's count of keys n, its segments a key
// segs and its arrays, and views them: ptrs[i*segs+j] with length
// lens[i*segs+j]. The segments themselves are Segments.Check's.
func scatterOf(op string, n, segs C.int32_t, ptrs *unsafe.Pointer, lens *C.int64_t) (hoststore.Segments, error) {
	if err := checkCount(n, op+": n"); err != nil {
		return hoststore.Segments{}, err
	}
	if segs < 1 || segs > hoststore.MaxSegments || int64(n)*int64(segs) > limits.Batch {
		return hoststore.Segments{}, kverr.Errorf(kverr.InvalidArgument, "%s: segs must be in [1, %d] and n * segs <= 2^20: got %d segments of %d keys",
			op, hoststore.MaxSegments, int32(segs), int32(n))
	}
	if ptrs == nil || lens == nil {
		return hoststore.Segments{}, kverr.Errorf(kverr.NullPointer, "%s: ptrs and lens must not be NULL", op)
	}
	m := n * segs
	return hoststore.Segments{Per: int(segs), Ptrs: slice[unsafe.Pointer](unsafe.Pointer(ptrs), m),
		Lens: slice[int64](unsafe.Pointer(lens), m)}, nil
}

// segmentsOf is scatterOf with the segments checked (Segments.Check; total,
// when >= 0, is the length every key's segments must add up to), for the
// shared store's put and get.
func segmentsOf(op string, n, segs C.int32_t, ptrs *unsafe.Pointer, lens *C.int64_t, total int64) ([]unsafe.Pointer, []int64, error) {
	g, err := scatterOf(op, n, segs, ptrs, lens)
	if err != nil {
		return nil, nil, err
	}
	if err := g.Check(total); err != nil {
		return nil, nil, kverr.Wrap(kverr.CodeOf(err), err, "%s", op)
	}
	return g.Ptrs, g.Lens, nil
}

// hostCopy is kvp_host_store_write (in) and kvp_host_store_read. The store
// converts the arguments (the closure) only once it has found itself open
// and with memory, whose errors come first.
func hostCopy(h *C.kvp_host_store, op string, n C.int32_t, slots *C.int32_t, segs C.int32_t, ptrs *unsafe.Pointer,
	lens *C.int64_t, in bool) C.kvp_status {
	return onHostStore(h, func(hs *hoststore.Store) error {
		batch := func() (hoststore.Batch, error) {
			if slots == nil {
				return hoststore.Batch{}, kverr.Errorf(kverr.NullPointer, "%s: slots must not be NULL", op)
			}
			g, err := scatterOf(op, n, segs, ptrs, lens)
			if err != nil {
				return hoststore.Batch{}, err
			}
			// host.Slot is an int32: the caller's slots are viewed in place.
			return hoststore.Batch{Slots: slice[host.Slot](unsafe.Pointer(slots), n), Segments: g}, nil
		}
		if in {
			return hs.Write(op, batch)
		}
		return hs.Read(op, batch)
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
