package main

// Go-typed entry points over the layer groups' KV event exports, for
// capi's tests (see testhooks.go). Arrays go through C memory, as from a
// real host.

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// hookGroupEvent is a drained group event: the event with its variable
// parts resolved, its group and its reserved word.
type hookGroupEvent struct {
	hookEvent
	group, reserved int32
}

// hookDrainGroups calls kvp_manager_drain_group_events with the given
// capacities; nullEvents passes events NULL. The events' array is filled
// with 0x5a first, so that a field left unwritten shows.
func hookDrainGroups(h unsafe.Pointer, maxEvents, maxTokens, maxMM, maxHashes int32, nullEvents bool) ([]hookGroupEvent, abiStatus) {
	size := C.size_t(unsafe.Sizeof(C.kvp_kv_group_event{}))
	raw := C.malloc(C.size_t(max(maxEvents, 1)) * size)
	defer C.free(raw)
	for i, b := 0, unsafe.Slice((*byte)(raw), int(max(maxEvents, 1))*int(size)); i < len(b); i++ {
		b[i] = 0x5a
	}
	evs := (*C.kvp_kv_group_event)(raw)
	if nullEvents {
		evs = nil
	}
	bufs := newEventBufs(maxTokens, maxMM, maxHashes)
	defer bufs.free()
	var n C.int32_t = -1
	st := kvpgo_manager_drain_group_events((*C.kvp_manager)(h), evs, C.int32_t(maxEvents), (*C.int32_t)(bufs.toks.p), C.int32_t(maxTokens),
		(*C.kvp_block_mm)(bufs.mm.p), C.int32_t(maxMM), (*C.uint8_t)(bufs.hashes.p), C.int32_t(maxHashes), &n)
	if st != C.KVP_OK {
		return nil, abiStatus(st)
	}
	var out []hookGroupEvent
	for _, g := range unsafe.Slice((*C.kvp_kv_group_event)(raw), int(n)) {
		out = append(out, hookGroupEvent{hookEvent: bufs.decode(g.event), group: int32(g.group), reserved: int32(g.reserved)})
	}
	return out, abiStatus(st)
}

// hookNextGroupEventSize returns the room (tokens, mm, hashes) the oldest
// pending event of any group needs.
func hookNextGroupEventSize(h unsafe.Pointer) ([3]int32, abiStatus) {
	var tok, mm, hs C.int32_t = -1, -1, -1
	st := kvpgo_manager_next_group_event_size((*C.kvp_manager)(h), &tok, &mm, &hs)
	return [3]int32{int32(tok), int32(mm), int32(hs)}, abiStatus(st)
}

// kvGroupEventLayout returns sizeof(kvp_kv_group_event), sizeof(kvp_kv_event)
// and the offsets of the group event's event, group and reserved fields.
func kvGroupEventLayout() (size, eventSize, event, group, reserved uintptr) {
	var g C.kvp_kv_group_event
	return unsafe.Sizeof(g), unsafe.Sizeof(C.kvp_kv_event{}), unsafe.Offsetof(g.event), unsafe.Offsetof(g.group), unsafe.Offsetof(g.reserved)
}

// The layer groups' event exports with raw arguments, for FuzzABI.
func rawManagerDrainGroupEvents(m, events ptr, maxEvents int32, tokens ptr, maxTokens int32, mm ptr, maxMM int32,
	hashes ptr, maxHashes int32, num ptr) int {
	return st(kvpgo_manager_drain_group_events((*C.kvp_manager)(m), (*C.kvp_kv_group_event)(events), C.int32_t(maxEvents),
		(*C.int32_t)(tokens), C.int32_t(maxTokens), (*C.kvp_block_mm)(mm), C.int32_t(maxMM), (*C.uint8_t)(hashes), C.int32_t(maxHashes),
		(*C.int32_t)(num)))
}
func rawManagerNextGroupEventSize(m, tokens, mm, hashes ptr) int {
	return st(kvpgo_manager_next_group_event_size((*C.kvp_manager)(m), (*C.int32_t)(tokens), (*C.int32_t)(mm), (*C.int32_t)(hashes)))
}
