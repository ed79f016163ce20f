package main

// Go-typed entry points over the layer-group exports, for capi's tests.

/*
#include <stdlib.h>
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import "unsafe"

// testGroup is a kvp_layer_group in Go's types.
type testGroup struct {
	kind, window      int32
	stateBytes        int64
	checkpoint, spare int32 // checkpoint_every, reserved
}

// cLayerGroups builds groups as a kvp_layer_group array in C memory, at
// least one element long so that a test can pass an empty list through a
// non-NULL pointer; free with C.free.
func cLayerGroups(groups []testGroup) *C.kvp_layer_group {
	arr := (*C.kvp_layer_group)(C.calloc(C.size_t(max(len(groups), 1)), C.size_t(unsafe.Sizeof(C.kvp_layer_group{}))))
	elems := unsafe.Slice(arr, max(len(groups), 1))
	for i, g := range groups {
		elems[i].kind, elems[i].window, elems[i].state_bytes = C.int32_t(g.kind), C.int32_t(g.window), C.int64_t(g.stateBytes)
		elems[i].checkpoint_every, elems[i].reserved = C.int32_t(g.checkpoint), C.int32_t(g.spare)
	}
	return arr
}

// hookGroupsConfig is a manager config with layer groups: groups as the
// array (NULL with nullGroups) and n as its count, which may disagree with
// len(groups); the fields left zero stay zero in the C struct.
type hookGroupsConfig struct {
	numBlocks, blockSize int32
	groups               []testGroup
	n                    int32
	nullGroups           bool
	maxModelLen          int32
	blockBytes           int64
	prefixCache, events  bool // enable_prefix_cache, enable_kv_events
}

func hookManagerCreateGroups(c hookGroupsConfig) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_manager_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))
	cfg.num_blocks, cfg.block_size = C.int32_t(c.numBlocks), C.int32_t(c.blockSize)
	if c.prefixCache {
		cfg.enable_prefix_cache = 1
	}
	if c.events {
		cfg.enable_kv_events = 1
	}
	arr := cLayerGroups(c.groups)
	defer C.free(unsafe.Pointer(arr))
	if !c.nullGroups {
		cfg.layer_groups = arr
	}
	cfg.num_layer_groups = C.int32_t(c.n)
	cfg.max_model_len = C.int32_t(c.maxModelLen)
	cfg.block_bytes = C.int64_t(c.blockBytes)
	var out *C.kvp_manager
	st := kvpgo_manager_create(cfg, &out)
	return unsafe.Pointer(out), abiStatus(st)
}

// hookDescribeGroups calls kvp_manager_describe_groups for ids with
// numGroups buffers of each kind (tables: n*maxBlocks; slots: slotCap),
// and returns them with the slot count.
func hookDescribeGroups(h unsafe.Pointer, ids []int64, numGroups, maxBlocks, slotCap int32) (tables, slots [][]int32, numSlots int32, st abiStatus) {
	n := len(ids)
	cids := cInt64s(ids)
	defer cids.free()
	ptrs := C.calloc(C.size_t(2*max(numGroups, 1)), C.size_t(unsafe.Sizeof(uintptr(0))))
	defer C.free(ptrs)
	tp := unsafe.Slice((**C.int32_t)(ptrs), 2*max(numGroups, 1))
	bufs := make([]cbuf, 0, 2*numGroups)
	for g := range int(numGroups) {
		tb, sb := newCBuf(4*n*int(maxBlocks)), newCBuf(4*int(max(slotCap, 1)))
		bufs = append(bufs, tb, sb)
		tp[g], tp[int(numGroups)+g] = (*C.int32_t)(tb.p), (*C.int32_t)(sb.p)
	}
	defer func() {
		for _, b := range bufs {
			b.free()
		}
	}()
	var ns C.int32_t
	st = abiStatus(kvpgo_manager_describe_groups((*C.kvp_manager)(h), (*C.int64_t)(cids.p), C.int32_t(n), C.int32_t(numGroups),
		&tp[0], C.int32_t(maxBlocks), nil, &tp[numGroups], C.int32_t(slotCap), &ns))
	for g := range int(numGroups) {
		tables = append(tables, append([]int32(nil), unsafe.Slice((*int32)(bufs[2*g].p), n*int(maxBlocks))...))
		slots = append(slots, append([]int32(nil), unsafe.Slice((*int32)(bufs[2*g+1].p), int(max(slotCap, 1)))...))
	}
	return tables, slots, int32(ns), st
}

// hookGroupBlocks calls kvp_manager_group_blocks with capacity entries.
func hookGroupBlocks(h unsafe.Pointer, capacity int32) ([]int32, int32, abiStatus) {
	out := newCBuf(4 * int(max(capacity, 1)))
	defer out.free()
	var n C.int32_t
	st := kvpgo_manager_group_blocks((*C.kvp_manager)(h), (*C.int32_t)(out.p), C.int32_t(capacity), &n)
	return append([]int32(nil), unsafe.Slice((*int32)(out.p), int(max(capacity, 0)))...), int32(n), abiStatus(st)
}

// hookTakeCopies calls kvp_manager_take_copies with capacity entries
// (nullOut: out NULL) and returns the copies, the count left and the status.
func hookTakeCopies(h unsafe.Pointer, capacity int32, nullOut bool) ([][2]int32, int32, abiStatus) {
	out := newCBuf(8 * int(max(capacity, 1)))
	defer out.free()
	p := (*C.kvp_block_copy)(out.p)
	if nullOut {
		p = nil
	}
	var n, left C.int32_t
	st := kvpgo_manager_take_copies((*C.kvp_manager)(h), p, C.int32_t(capacity), &n, &left)
	pairs := make([][2]int32, int(n))
	for i := range pairs {
		e := unsafe.Slice(p, int(n))[i]
		pairs[i] = [2]int32{int32(e.src), int32(e.dst)}
	}
	return pairs, int32(left), abiStatus(st)
}

// The layer-group exports with raw arguments, for FuzzABI.
func rawManagerDescribeGroups(m, ids ptr, n, numGroups int32, tables ptr, maxBlocks int32, lens, slots ptr, slotCap int32, numSlots ptr) int {
	return st(kvpgo_manager_describe_groups((*C.kvp_manager)(m), (*C.int64_t)(ids), C.int32_t(n), C.int32_t(numGroups),
		(**C.int32_t)(tables), C.int32_t(maxBlocks), (*C.int32_t)(lens), (**C.int32_t)(slots), C.int32_t(slotCap), (*C.int32_t)(numSlots)))
}
func rawManagerGroupBlocks(m, out ptr, capacity int32, num ptr) int {
	return st(kvpgo_manager_group_blocks((*C.kvp_manager)(m), (*C.int32_t)(out), C.int32_t(capacity), (*C.int32_t)(num)))
}
func rawManagerTakeCopies(m, out ptr, capacity int32, num, left ptr) int {
	return st(kvpgo_manager_take_copies((*C.kvp_manager)(m), (*C.kvp_block_copy)(out), C.int32_t(capacity), (*C.int32_t)(num), (*C.int32_t)(left)))
}
