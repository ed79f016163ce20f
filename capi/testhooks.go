package main

// Go-typed entry points over the exports, for capi's own tests and fuzz
// targets (test files cannot use cgo). They call the real exported
// functions, so the tests exercise the same argument checks a C host hits.

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
#include "glue.h"

// The exports this file's C calls (kvplug.h leaves them out here).
extern kvp_status kvpgo_manager_check(kvp_manager *m);
extern kvp_status kvpgo_live_handles(int64_t *out);
extern kvp_status kvpgo_set_logger(kvp_log_fn fn, void *user, int level);

// A log callback that breaks the header's rule and calls back into kvplug:
// on the handle given as user, and a call with no handle. It records what
// those calls returned, and whether a line ended in a line ending.
static int reentry_lines, reentry_check, reentry_live, reentry_newline;
static char reentry_msg[256];

static void reentry_log(void *user, int level, const char *msg) {
  (void)level;
  reentry_lines++;
  size_t n = strlen(msg);
  if (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) reentry_newline = 1;
  reentry_check = kvpgo_manager_check((kvp_manager *)user);
  strncpy(reentry_msg, kvp_last_error(), sizeof reentry_msg - 1);
  int64_t live = 0;
  reentry_live = kvpgo_live_handles(&live);
}

static int set_reentry_logger(void *user) {
  reentry_lines = reentry_newline = 0;
  reentry_check = reentry_live = -1;
  reentry_msg[0] = 0;
  return kvpgo_set_logger(reentry_log, user, KVP_LOG_DEBUG);
}

static const char *reentry_result(int out[4]) {
  out[0] = reentry_lines;
  out[1] = reentry_check;
  out[2] = reentry_live;
  out[3] = reentry_newline;
  return reentry_msg;
}
*/
import "C"

import "unsafe"

type abiStatus = int

// cbuf is C memory for a test's arrays: the exports receive C pointers, as
// from a real host (Go memory passed through C and back is not allowed to be
// retained, and the checker would flag some uses).
type cbuf struct{ p unsafe.Pointer }

// cStructOf is a versioned C struct T as a C caller makes one: zeroed C
// memory whose first field, struct_size, holds size (0: T's size, a caller
// built against this header). The caller frees it.
func cStructOf[T any](size uintptr) *T {
	if size == 0 {
		size = unsafe.Sizeof(*new(T))
	}
	p := C.calloc(1, C.size_t(unsafe.Sizeof(*new(T))))
	*(*C.size_t)(p) = C.size_t(size)
	return (*T)(p)
}

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
	st := kvpgo_manager_create(c, o)
	return unsafe.Pointer(*out), abiStatus(st)
}

func hookManagerDestroy(h unsafe.Pointer) { kvpgo_manager_destroy((*C.kvp_manager)(h)) }

func hookManagerAdd(h unsafe.Pointer, id int64, n int32) abiStatus {
	return abiStatus(kvpgo_manager_add((*C.kvp_manager)(h), C.int64_t(id), C.int32_t(n)))
}

func hookManagerGrow(h unsafe.Pointer, ids cbuf, counts cbuf, n int32) abiStatus {
	return abiStatus(kvpgo_manager_grow((*C.kvp_manager)(h), (*C.int64_t)(ids.p), (*C.int32_t)(counts.p), C.int32_t(n)))
}

func hookManagerRemove(h unsafe.Pointer, ids cbuf, n int32) abiStatus {
	return abiStatus(kvpgo_manager_remove((*C.kvp_manager)(h), (*C.int64_t)(ids.p), C.int32_t(n)))
}

func hookManagerFork(h unsafe.Pointer, parent int64, children cbuf, n int32, copies cbuf, maxCopies int32, numCopies cbuf) abiStatus {
	return abiStatus(kvpgo_manager_fork((*C.kvp_manager)(h), C.int64_t(parent), (*C.int64_t)(children.p), C.int32_t(n),
		(*C.kvp_block_copy)(copies.p), C.int32_t(maxCopies), (*C.int32_t)(numCopies.p)))
}

func hookManagerDescribe(h unsafe.Pointer, ids cbuf, n int32, table cbuf, maxBlocks int32, lens cbuf, slots cbuf, slotCap int32, numSlots cbuf) abiStatus {
	return abiStatus(kvpgo_manager_describe((*C.kvp_manager)(h), (*C.int64_t)(ids.p), C.int32_t(n),
		(*C.int32_t)(table.p), C.int32_t(maxBlocks), (*C.int32_t)(lens.p), (*C.int32_t)(slots.p),
		C.int32_t(slotCap), (*C.int32_t)(numSlots.p)))
}

// hookManagerStats returns the fields the tests compare, or the status.
func hookManagerStats(h unsafe.Pointer, structSize uintptr) ([4]int64, abiStatus) {
	// The caller's struct is as large as its struct_size says (a newer
	// header's), and the library zeroes the bytes past its own version.
	buf := newCBuf(int(max(structSize, unsafe.Sizeof(C.kvp_manager_stats{}))))
	defer buf.free()
	s := (*C.kvp_manager_stats)(buf.p)
	s.struct_size = C.size_t(structSize)
	st := kvpgo_manager_stats_get((*C.kvp_manager)(h), s)
	return [4]int64{int64(s.free_blocks), int64(s.used_blocks), int64(s.num_seqs), int64(s.num_tokens)}, abiStatus(st)
}

func hookManagerCheck(h unsafe.Pointer) abiStatus {
	return abiStatus(kvpgo_manager_check((*C.kvp_manager)(h)))
}

func sizeofManagerConfig() uintptr { return unsafe.Sizeof(C.kvp_manager_config{}) }
func sizeofManagerStats() uintptr  { return unsafe.Sizeof(C.kvp_manager_stats{}) }

// hookSetReentryLogger installs the callback that calls into kvplug, with
// user = h (NULL: the default, silent logger again).
func hookSetReentryLogger(h unsafe.Pointer) abiStatus {
	if h == nil {
		return abiStatus(kvpgo_set_logger(nil, nil, C.KVP_LOG_OFF))
	}
	return abiStatus(C.set_reentry_logger(h))
}

// reentryResult is what the re-entering callback saw.
type reentryResult struct {
	lines, check, live int
	newline            bool
	msg                string
}

func hookReentryResult() reentryResult {
	var out [4]C.int
	msg := C.GoString(C.reentry_result(&out[0]))
	return reentryResult{lines: int(out[0]), check: int(out[1]), live: int(out[2]), newline: out[3] != 0, msg: msg}
}

func hookLiveHandles(null bool) (int64, abiStatus) {
	var n C.int64_t = -1
	p := &n
	if null {
		p = nil
	}
	st := kvpgo_live_handles(p)
	return int64(n), abiStatus(st)
}

// hookVcacheCreate creates a host-backend cache without background mapping.
func hookVcacheCreate(layers, kvHeads, headDim, maxBatch, maxContext int32, budget int64) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_vcache_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_vcache_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(unsafe.Sizeof(C.kvp_vcache_config{}))
	cfg.backend = C.KVP_VMEM_HOST
	cfg.num_layers, cfg.num_kv_heads, cfg.head_dim = C.int32_t(layers), C.int32_t(kvHeads), C.int32_t(headDim)
	cfg.dtype_bytes = 2
	cfg.max_batch, cfg.max_context = C.int32_t(maxBatch), C.int32_t(maxContext)
	cfg.budget_bytes = C.int64_t(budget)
	cfg.no_background = 1
	var out *C.kvp_vcache
	st := kvpgo_vcache_create(cfg, &out)
	return unsafe.Pointer(out), abiStatus(st)
}

func hookVcacheDestroy(h unsafe.Pointer) { kvpgo_vcache_destroy((*C.kvp_vcache)(h)) }

func hookVcacheAlloc(h unsafe.Pointer) (int32, abiStatus) {
	var s C.int32_t = -1
	st := kvpgo_vcache_alloc_slot((*C.kvp_vcache)(h), &s)
	return int32(s), abiStatus(st)
}

func hookVcacheStep(h unsafe.Pointer, slots, ctxLens []int32) abiStatus {
	cs, cc := cInt32s(slots), cInt32s(ctxLens)
	defer cs.free()
	defer cc.free()
	return abiStatus(kvpgo_vcache_step((*C.kvp_vcache)(h), (*C.int32_t)(cs.p), (*C.int32_t)(cc.p), C.int32_t(len(slots))))
}

// hookVcacheMapped returns mapped_bytes and active_slots from the stats.
func hookVcacheMapped(h unsafe.Pointer) (int64, int32, abiStatus) {
	var s C.kvp_vcache_stats
	s.struct_size = C.size_t(unsafe.Sizeof(s))
	st := kvpgo_vcache_stats_get((*C.kvp_vcache)(h), &s)
	return int64(s.mapped_bytes), int32(s.active_slots), abiStatus(st)
}
