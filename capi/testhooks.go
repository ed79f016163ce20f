package main

// Go-typed entry points over the exports, for capi's own tests and fuzz
// targets (test files cannot use cgo). They call the real exported
// functions, so the tests exercise the same argument checks a C host hits.

/*
#include <stdlib.h>
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import "unsafe"

type abiStatus = int

// cbuf is C memory for a test's arrays: the exports receive C pointers, as
// from a real host (Go memory passed through C and back is not allowed to be
// retained, and the checker would flag some uses).
type cbuf struct{ p unsafe.Pointer }

func newCBuf(bytes int) cbuf {
	if bytes <= 0 {
		bytes = 1
	}
	return cbuf{C.calloc(C.size_t(bytes), 1)}
}

func (b cbuf) free() { C.free(b.p) }

func cInt64s(v []int64) cbuf {
	b := newCBuf(8 * len(v))
	copy(unsafe.Slice((*int64)(b.p), len(v)), v)
	return b
}

func cInt32s(v []int32) cbuf {
	b := newCBuf(4 * len(v))
	copy(unsafe.Slice((*int32)(b.p), len(v)), v)
	return b
}

func lastError() string { return C.GoString(C.kvp_last_error()) }

func statusName(st abiStatus) string { return C.GoString(C.kvp_status_string(C.kvp_status(st))) }

func hookManagerCreate(structSize uintptr, numBlocks, blockSize int32, nullCfg, nullOut bool) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_manager_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(structSize)
	cfg.num_blocks = C.int32_t(numBlocks)
	cfg.block_size = C.int32_t(blockSize)
	out := (**C.kvp_manager)(C.calloc(1, C.size_t(unsafe.Sizeof(uintptr(0)))))
	defer C.free(unsafe.Pointer(out))
	c, o := cfg, out
	if nullCfg {
		c = nil
	}
	if nullOut {
		o = nil
	}
	st := kvp_manager_create(c, o)
	return unsafe.Pointer(*out), abiStatus(st)
}

func hookManagerDestroy(h unsafe.Pointer) { kvp_manager_destroy((*C.kvp_manager)(h)) }

func hookManagerAdd(h unsafe.Pointer, id int64, n int32) abiStatus {
	return abiStatus(kvp_manager_add((*C.kvp_manager)(h), C.int64_t(id), C.int32_t(n)))
}

func hookManagerGrow(h unsafe.Pointer, ids cbuf, counts cbuf, n int32) abiStatus {
	return abiStatus(kvp_manager_grow((*C.kvp_manager)(h), (*C.int64_t)(ids.p), (*C.int32_t)(counts.p), C.int32_t(n)))
}

func hookManagerRemove(h unsafe.Pointer, ids cbuf, n int32) abiStatus {
	return abiStatus(kvp_manager_remove((*C.kvp_manager)(h), (*C.int64_t)(ids.p), C.int32_t(n)))
}

func hookManagerFork(h unsafe.Pointer, parent int64, children cbuf, n int32, copies cbuf, maxCopies int32, numCopies cbuf) abiStatus {
	return abiStatus(kvp_manager_fork((*C.kvp_manager)(h), C.int64_t(parent), (*C.int64_t)(children.p), C.int32_t(n),
		(*C.kvp_block_copy)(copies.p), C.int32_t(maxCopies), (*C.int32_t)(numCopies.p)))
}

func hookManagerDescribe(h unsafe.Pointer, ids cbuf, n int32, table cbuf, maxBlocks int32, lens cbuf, slots cbuf, slotCap int32, numSlots cbuf) abiStatus {
	return abiStatus(kvp_manager_describe((*C.kvp_manager)(h), (*C.int64_t)(ids.p), C.int32_t(n),
		(*C.int32_t)(table.p), C.int32_t(maxBlocks), (*C.int32_t)(lens.p), (*C.int32_t)(slots.p),
		C.int32_t(slotCap), (*C.int32_t)(numSlots.p)))
}

// hookManagerStats returns the fields the tests compare, or the status.
func hookManagerStats(h unsafe.Pointer, structSize uintptr) ([4]int64, abiStatus) {
	var s C.kvp_manager_stats
	s.struct_size = C.size_t(structSize)
	st := kvp_manager_stats_get((*C.kvp_manager)(h), &s)
	return [4]int64{int64(s.free_blocks), int64(s.used_blocks), int64(s.num_seqs), int64(s.num_tokens)}, abiStatus(st)
}

func hookManagerCheck(h unsafe.Pointer) abiStatus {
	return abiStatus(kvp_manager_check((*C.kvp_manager)(h)))
}

func sizeofManagerConfig() uintptr { return unsafe.Sizeof(C.kvp_manager_config{}) }
func sizeofManagerStats() uintptr  { return unsafe.Sizeof(C.kvp_manager_stats{}) }
