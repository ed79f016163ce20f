package main

// Go-typed entry points over the standalone stores' exports, for capi's
// tests (see testhooks.go). Arrays go through C memory, as from a real host.

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

func cUint64s(v []uint64) cbuf {
	b := newCBuf(8 * len(v))
	copy(unsafe.Slice((*uint64)(b.p), len(v)), v)
	return b
}

func hookHostStoreCreate(slots int32, slotBytes int64, reserved int32, structSize uintptr) (unsafe.Pointer, abiStatus) {
	cfg := cStructOf[C.kvp_host_store_config](structSize)
	defer C.free(unsafe.Pointer(cfg))
	cfg.num_slots, cfg.slot_bytes, cfg.reserved = C.int32_t(slots), C.int64_t(slotBytes), C.int32_t(reserved)
	out := (**C.kvp_host_store)(C.calloc(1, C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(out))
	st := kvpgo_host_store_create(cfg, out)
	return unsafe.Pointer(*out), abiStatus(st)
}

func hookHostStoreDestroy(h unsafe.Pointer) { kvpgo_host_store_destroy((*C.kvp_host_store)(h)) }

// hookHostStoreReserve returns the slots and evicted keys; on a failure the
// slots are what the caller's array held before (filled with 99).
func hookHostStoreReserve(h unsafe.Pointer, keys []uint64) ([]int32, []uint64, abiStatus) {
	k := cUint64s(keys)
	defer k.free()
	fill := make([]int32, len(keys))
	for i := range fill {
		fill[i] = 99
	}
	sl, ev, ne := cInt32s(fill), newCBuf(8*len(keys)), newCBuf(4)
	defer sl.free()
	defer ev.free()
	defer ne.free()
	st := kvpgo_host_store_reserve((*C.kvp_host_store)(h), C.int32_t(len(keys)), (*C.uint64_t)(k.p), (*C.int32_t)(sl.p),
		(*C.uint64_t)(ev.p), (*C.int32_t)(ne.p))
	n := int(*(*int32)(ne.p))
	return slices32(sl, len(keys)), append([]uint64(nil), unsafe.Slice((*uint64)(ev.p), len(keys))[:n]...), abiStatus(st)
}

func hookHostStoreKeys(h unsafe.Pointer, op string, keys []uint64, flag int32) (int32, abiStatus) {
	k := cUint64s(keys)
	defer k.free()
	out := newCBuf(4)
	defer out.free()
	hs, n, kp, o := (*C.kvp_host_store)(h), C.int32_t(len(keys)), (*C.uint64_t)(k.p), (*C.int32_t)(out.p)
	if keys == nil { // NULL keys with n = 1
		kp, n = nil, 1
	}
	var st C.kvp_status
	switch op {
	case "complete":
		st = kvpgo_host_store_complete(hs, n, kp, C.int32_t(flag), o)
	case "unpin":
		st = kvpgo_host_store_unpin(hs, n, kp, o)
	case "touch":
		st = kvpgo_host_store_touch(hs, n, kp)
	case "lookup":
		st = kvpgo_host_store_lookup_prefix(hs, n, kp, o)
	case "reset":
		st = kvpgo_host_store_reset(hs, o)
	default:
		panic(op)
	}
	return *(*int32)(out.p), abiStatus(st)
}

func hookHostStorePin(h unsafe.Pointer, keys []uint64) ([]int32, int32, abiStatus) {
	k := cUint64s(keys)
	defer k.free()
	sl, n := newCBuf(4*len(keys)), newCBuf(4)
	defer sl.free()
	defer n.free()
	st := kvpgo_host_store_pin((*C.kvp_host_store)(h), C.int32_t(len(keys)), (*C.uint64_t)(k.p), (*C.int32_t)(sl.p), (*C.int32_t)(n.p))
	return slices32(sl, len(keys)), *(*int32)(n.p), abiStatus(st)
}

func hookHostStoreState(h unsafe.Pointer, keys []uint64) ([]int32, []int32, abiStatus) {
	k := cUint64s(keys)
	defer k.free()
	st, sl := newCBuf(4*len(keys)), newCBuf(4*len(keys))
	defer st.free()
	defer sl.free()
	s := kvpgo_host_store_state((*C.kvp_host_store)(h), C.int32_t(len(keys)), (*C.uint64_t)(k.p), (*C.int32_t)(st.p), (*C.int32_t)(sl.p))
	return slices32(st, len(keys)), slices32(sl, len(keys)), abiStatus(s)
}

// hookHostStoreCopy writes (in) or reads data[i] (split into segs equal
// segments) to or from slots[i]; data is updated on a read.
func hookHostStoreCopy(h unsafe.Pointer, slots []int32, data [][]byte, segs int, in bool) abiStatus {
	sl := cInt32s(slots)
	defer sl.free()
	n := len(slots)
	ptrs, lens := newCBuf(8*n*segs), newCBuf(8*n*segs)
	defer ptrs.free()
	defer lens.free()
	bufs := make([]cbuf, n)
	for i := range n {
		bufs[i] = newCBuf(len(data[i]))
		defer bufs[i].free()
		copy(unsafe.Slice((*byte)(bufs[i].p), len(data[i])), data[i])
		seg := len(data[i]) / segs
		for j := range segs {
			unsafe.Slice((*unsafe.Pointer)(ptrs.p), n*segs)[i*segs+j] = unsafe.Add(bufs[i].p, j*seg)
			unsafe.Slice((*int64)(lens.p), n*segs)[i*segs+j] = int64(seg)
		}
	}
	var st C.kvp_status
	if in {
		st = kvpgo_host_store_write((*C.kvp_host_store)(h), C.int32_t(n), (*C.int32_t)(sl.p), C.int32_t(segs), (*unsafe.Pointer)(ptrs.p), (*C.int64_t)(lens.p))
	} else {
		st = kvpgo_host_store_read((*C.kvp_host_store)(h), C.int32_t(n), (*C.int32_t)(sl.p), C.int32_t(segs), (*unsafe.Pointer)(ptrs.p), (*C.int64_t)(lens.p))
		for i := range n {
			copy(data[i], unsafe.Slice((*byte)(bufs[i].p), len(data[i])))
		}
	}
	return abiStatus(st)
}

// hookHostStoreStats returns reserves, commits, stale, refused_full, resident, pinned.
func hookHostStoreStats(h unsafe.Pointer) ([6]int64, abiStatus) {
	var s C.kvp_host_store_stats
	s.struct_size = C.size_t(unsafe.Sizeof(s))
	st := kvpgo_host_store_stats_get((*C.kvp_host_store)(h), &s)
	return [6]int64{int64(s.reserves), int64(s.commits), int64(s.stale), int64(s.refused_full), int64(s.resident), int64(s.pinned)}, abiStatus(st)
}

func hookSharedStoreCreate(addr, ns string, opTimeoutMS int32) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_shared_store_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_shared_store_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(unsafe.Sizeof(C.kvp_shared_store_config{}))
	if addr != "" {
		cfg.address = C.CString(addr)
		defer C.free(unsafe.Pointer(cfg.address))
	}
	cfg.key_space = C.CString(ns)
	defer C.free(unsafe.Pointer(cfg.key_space))
	cfg.op_timeout_ms = C.int32_t(opTimeoutMS)
	out := (**C.kvp_shared_store)(C.calloc(1, C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(out))
	st := kvpgo_shared_store_create(cfg, out)
	return unsafe.Pointer(*out), abiStatus(st)
}

func hookSharedStoreDestroy(h unsafe.Pointer) { kvpgo_shared_store_destroy((*C.kvp_shared_store)(h)) }

// hookSharedStorePutGet puts data (one segment a key), then gets it back
// into fresh buffers: stored, found and what came back.
func hookSharedStorePutGet(h unsafe.Pointer, keys []uint64, data [][]byte) (int32, []int32, [][]byte, abiStatus) {
	// 16-byte keys: each uint64 little-endian, then 8 bytes of 0x5a.
	k := newCBuf(16 * len(keys))
	defer k.free()
	kb := unsafe.Slice((*byte)(k.p), 16*len(keys))
	for i, v := range keys {
		for j := 0; j < 8; j++ {
			kb[16*i+j] = byte(v >> (8 * j))
			kb[16*i+8+j] = 0x5a
		}
	}
	n := len(keys)
	ptrs, lens, outp := newCBuf(8*n), newCBuf(8*n), newCBuf(8*n)
	defer ptrs.free()
	defer lens.free()
	defer outp.free()
	stored, found := newCBuf(4), newCBuf(4*n)
	defer stored.free()
	defer found.free()
	for i := range n {
		in, out := newCBuf(len(data[i])), newCBuf(len(data[i]))
		defer in.free()
		defer out.free()
		copy(unsafe.Slice((*byte)(in.p), len(data[i])), data[i])
		unsafe.Slice((*unsafe.Pointer)(ptrs.p), n)[i] = in.p
		unsafe.Slice((*unsafe.Pointer)(outp.p), n)[i] = out.p
		unsafe.Slice((*int64)(lens.p), n)[i] = int64(len(data[i]))
	}
	ss := (*C.kvp_shared_store)(h)
	st := kvpgo_shared_store_put(ss, C.int32_t(n), (*C.uint8_t)(k.p), 1, (*unsafe.Pointer)(ptrs.p), (*C.int64_t)(lens.p), (*C.int32_t)(stored.p))
	if st != 0 {
		return 0, nil, nil, abiStatus(st)
	}
	st = kvpgo_shared_store_get(ss, C.int32_t(n), (*C.uint8_t)(k.p), 1, (*unsafe.Pointer)(outp.p), (*C.int64_t)(lens.p), (*C.int32_t)(found.p))
	back := make([][]byte, n)
	for i := range n {
		back[i] = append([]byte(nil), unsafe.Slice((*byte)(unsafe.Slice((*unsafe.Pointer)(outp.p), n)[i]), len(data[i]))...)
	}
	return *(*int32)(stored.p), slices32(found, n), back, abiStatus(st)
}

// Raw entry points of the standalone stores for the ABI fuzz target
// (abi_fuzz_test.go): pointers pass through as given, NULL included.

func rawHostStoreCreate(cfg, out ptr) int {
	return st(kvpgo_host_store_create((*C.kvp_host_store_config)(cfg), (**C.kvp_host_store)(out)))
}
func rawHostStoreDestroy(h ptr) { kvpgo_host_store_destroy((*C.kvp_host_store)(h)) }
func rawHostStoreState(h ptr, n int32, keys, states, slots ptr) int {
	return st(kvpgo_host_store_state((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), (*C.int32_t)(states), (*C.int32_t)(slots)))
}
func rawHostStoreLookupPrefix(h ptr, n int32, keys, matched ptr) int {
	return st(kvpgo_host_store_lookup_prefix((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), (*C.int32_t)(matched)))
}
func rawHostStoreReserve(h ptr, n int32, keys, slots, evicted, numEvicted ptr) int {
	return st(kvpgo_host_store_reserve((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), (*C.int32_t)(slots),
		(*C.uint64_t)(evicted), (*C.int32_t)(numEvicted)))
}
func rawHostStoreComplete(h ptr, n int32, keys ptr, failed int32, num ptr) int {
	return st(kvpgo_host_store_complete((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), C.int32_t(failed), (*C.int32_t)(num)))
}
func rawHostStorePin(h ptr, n int32, keys, slots, num ptr) int {
	return st(kvpgo_host_store_pin((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), (*C.int32_t)(slots), (*C.int32_t)(num)))
}
func rawHostStoreUnpin(h ptr, n int32, keys, num ptr) int {
	return st(kvpgo_host_store_unpin((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys), (*C.int32_t)(num)))
}
func rawHostStoreTouch(h ptr, n int32, keys ptr) int {
	return st(kvpgo_host_store_touch((*C.kvp_host_store)(h), C.int32_t(n), (*C.uint64_t)(keys)))
}
func rawHostStoreReset(h, num ptr) int {
	return st(kvpgo_host_store_reset((*C.kvp_host_store)(h), (*C.int32_t)(num)))
}
func rawHostStoreStats(h, out ptr) int {
	return st(kvpgo_host_store_stats_get((*C.kvp_host_store)(h), (*C.kvp_host_store_stats)(out)))
}
func rawHostStoreMemory(h, base, slotBytes, numSlots ptr) int {
	return st(kvpgo_host_store_memory((*C.kvp_host_store)(h), (*unsafe.Pointer)(base), (*C.int64_t)(slotBytes), (*C.int32_t)(numSlots)))
}
func rawHostStoreWrite(h ptr, n int32, slots ptr, segs int32, ptrs, lens ptr) int {
	return st(kvpgo_host_store_write((*C.kvp_host_store)(h), C.int32_t(n), (*C.int32_t)(slots), C.int32_t(segs),
		(*unsafe.Pointer)(ptrs), (*C.int64_t)(lens)))
}
func rawHostStoreRead(h ptr, n int32, slots ptr, segs int32, ptrs, lens ptr) int {
	return st(kvpgo_host_store_read((*C.kvp_host_store)(h), C.int32_t(n), (*C.int32_t)(slots), C.int32_t(segs),
		(*unsafe.Pointer)(ptrs), (*C.int64_t)(lens)))
}

func rawSharedStoreCreate(cfg, out ptr) int {
	return st(kvpgo_shared_store_create((*C.kvp_shared_store_config)(cfg), (**C.kvp_shared_store)(out)))
}
func rawSharedStoreDestroy(h ptr) { kvpgo_shared_store_destroy((*C.kvp_shared_store)(h)) }
func rawSharedStoreExists(h ptr, n int32, keys, found ptr) int {
	return st(kvpgo_shared_store_exists((*C.kvp_shared_store)(h), C.int32_t(n), (*C.uint8_t)(keys), (*C.int32_t)(found)))
}
func rawSharedStorePut(h ptr, n int32, keys ptr, segs int32, ptrs, lens, stored ptr) int {
	return st(kvpgo_shared_store_put((*C.kvp_shared_store)(h), C.int32_t(n), (*C.uint8_t)(keys), C.int32_t(segs),
		(*unsafe.Pointer)(ptrs), (*C.int64_t)(lens), (*C.int32_t)(stored)))
}
func rawSharedStoreGet(h ptr, n int32, keys ptr, segs int32, ptrs, lens, found ptr) int {
	return st(kvpgo_shared_store_get((*C.kvp_shared_store)(h), C.int32_t(n), (*C.uint8_t)(keys), C.int32_t(segs),
		(*unsafe.Pointer)(ptrs), (*C.int64_t)(lens), (*C.int32_t)(found)))
}
func rawSharedStoreStats(h, out ptr) int {
	return st(kvpgo_shared_store_stats_get((*C.kvp_shared_store)(h), (*C.kvp_shared_store_stats)(out)))
}
