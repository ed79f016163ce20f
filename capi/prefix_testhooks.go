package main

// Go-typed entry points over the prefix cache's exports, for capi's tests
// (see testhooks.go). Arrays go through C memory, as from a real host.

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// hookManagerCreateCached creates a manager with the prefix cache and,
// with events, KV events; structSize 0 means the full struct.
func hookManagerCreateCached(numBlocks, blockSize int32, events bool, structSize uintptr) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_manager_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	if structSize == 0 {
		structSize = unsafe.Sizeof(C.kvp_manager_config{})
	}
	cfg.struct_size = C.size_t(structSize)
	cfg.num_blocks = C.int32_t(numBlocks)
	cfg.block_size = C.int32_t(blockSize)
	cfg.enable_prefix_cache = 1
	if events {
		cfg.enable_kv_events = 1
	}
	var out *C.kvp_manager
	st := kvpgo_manager_create(cfg, &out)
	return unsafe.Pointer(out), abiStatus(st)
}

// hookKeys is a prompt's keys for the hooks: salt and multimodal items.
type hookKeys struct {
	adapter uint64
	salt    []byte
	mm      [][3]int32 // offset, length, hash seed (every hash byte)
	nullMM  bool       // pass num_mm with a NULL mm
	numMM   int32      // overrides len(mm) when nonzero
}

// cKeys builds a kvp_prefix_keys array in C memory; free with the returned
// function.
func cKeys(ks []hookKeys) (*C.kvp_prefix_keys, func()) {
	if ks == nil {
		return nil, func() {}
	}
	arr := (*C.kvp_prefix_keys)(C.calloc(C.size_t(len(ks)), C.size_t(unsafe.Sizeof(C.kvp_prefix_keys{}))))
	frees := []unsafe.Pointer{unsafe.Pointer(arr)}
	view := unsafe.Slice(arr, len(ks))
	for i, k := range ks {
		view[i].adapter = C.uint64_t(k.adapter)
		if len(k.salt) > 0 {
			p := C.malloc(C.size_t(len(k.salt)))
			C.memcpy(p, unsafe.Pointer(&k.salt[0]), C.size_t(len(k.salt)))
			view[i].salt = (*C.uint8_t)(p)
			view[i].salt_len = C.int32_t(len(k.salt))
			frees = append(frees, p)
		}
		if len(k.mm) > 0 && !k.nullMM {
			p := (*C.kvp_mm_item)(C.calloc(C.size_t(len(k.mm)), C.size_t(unsafe.Sizeof(C.kvp_mm_item{}))))
			items := unsafe.Slice(p, len(k.mm))
			for j, m := range k.mm {
				items[j].offset, items[j].length = C.int32_t(m[0]), C.int32_t(m[1])
				for b := range items[j].hash {
					items[j].hash[b] = C.uint8_t(m[2])
				}
			}
			view[i].mm = p
			frees = append(frees, unsafe.Pointer(p))
		}
		view[i].num_mm = C.int32_t(len(k.mm))
		if k.numMM != 0 {
			view[i].num_mm = C.int32_t(k.numMM)
		}
	}
	return arr, func() {
		for _, p := range frees {
			C.free(p)
		}
	}
}

// flat lays prompts out as the ABI's tokens and token_offsets.
func flat(prompts [][]int32) (cbuf, cbuf) {
	var toks []int32
	offs := []int64{0}
	for _, p := range prompts {
		toks = append(toks, p...)
		offs = append(offs, int64(len(toks)))
	}
	return cInt32s(toks), cInt64s(offs)
}

// hookAdmit admits prompts as sequences ids; it returns matched tokens,
// the number admitted and the status.
func hookAdmit(h unsafe.Pointer, ids []int64, prompts [][]int32, keys []hookKeys) ([]int32, int32, abiStatus) {
	cids := cInt64s(ids)
	defer cids.free()
	toks, offs := flat(prompts)
	defer toks.free()
	defer offs.free()
	ck, freeKeys := cKeys(keys)
	defer freeKeys()
	matched := newCBuf(4 * len(ids))
	defer matched.free()
	var admitted C.int32_t = -1
	st := kvpgo_manager_admit((*C.kvp_manager)(h), (*C.int64_t)(cids.p), C.int32_t(len(ids)), (*C.int32_t)(toks.p),
		(*C.int64_t)(offs.p), ck, (*C.int32_t)(matched.p), &admitted)
	return slices32(matched, len(ids)), int32(admitted), abiStatus(st)
}

// hookAdmitRaw passes the admit arguments through as given.
func hookAdmitRaw(h unsafe.Pointer, ids cbuf, n int32, toks, offs cbuf, numAdmitted bool) abiStatus {
	var admitted C.int32_t
	p := &admitted
	if !numAdmitted {
		p = nil
	}
	return abiStatus(kvpgo_manager_admit((*C.kvp_manager)(h), (*C.int64_t)(ids.p), C.int32_t(n), (*C.int32_t)(toks.p),
		(*C.int64_t)(offs.p), nil, nil, p))
}

func slices32(b cbuf, n int) []int32 {
	out := make([]int32, n)
	copy(out, unsafe.Slice((*int32)(b.p), n))
	return out
}

func hookGrowTokens(h unsafe.Pointer, ids []int64, counts []int32, tokens []int32, nullTokens bool) abiStatus {
	cids, ccounts, ctoks := cInt64s(ids), cInt32s(counts), cInt32s(tokens)
	defer cids.free()
	defer ccounts.free()
	defer ctoks.free()
	tp := (*C.int32_t)(ctoks.p)
	if nullTokens {
		tp = nil
	}
	return abiStatus(kvpgo_manager_grow_tokens((*C.kvp_manager)(h), (*C.int64_t)(cids.p), (*C.int32_t)(ccounts.p), C.int32_t(len(ids)), tp))
}

// hookMatch returns each prompt's (matched, partial block, partial tokens).
func hookMatch(h unsafe.Pointer, prompts [][]int32, keys []hookKeys, partial bool) ([][3]int32, abiStatus) {
	toks, offs := flat(prompts)
	defer toks.free()
	defer offs.free()
	ck, freeKeys := cKeys(keys)
	defer freeKeys()
	out := (*C.kvp_prefix_match)(C.calloc(C.size_t(len(prompts)), C.size_t(unsafe.Sizeof(C.kvp_prefix_match{}))))
	defer C.free(unsafe.Pointer(out))
	want := C.int32_t(0)
	if partial {
		want = 1
	}
	st := kvpgo_manager_match((*C.kvp_manager)(h), C.int32_t(len(prompts)), (*C.int32_t)(toks.p), (*C.int64_t)(offs.p), ck, want, out)
	res := make([][3]int32, len(prompts))
	for i, m := range unsafe.Slice(out, len(prompts)) {
		res[i] = [3]int32{int32(m.matched_tokens), int32(m.partial_block), int32(m.partial_tokens)}
	}
	return res, abiStatus(st)
}

// hookMatchBlocks returns each prompt's (matched, block tokens); nullOut
// passes a NULL out.
func hookMatchBlocks(h unsafe.Pointer, prompts [][]int32, nullOut bool) ([][2]int32, abiStatus) {
	toks, offs := flat(prompts)
	defer toks.free()
	defer offs.free()
	out := (*C.kvp_block_match)(C.calloc(C.size_t(max(len(prompts), 1)), C.size_t(unsafe.Sizeof(C.kvp_block_match{}))))
	defer C.free(unsafe.Pointer(out))
	if nullOut {
		out = nil
	}
	st := kvpgo_manager_match_blocks((*C.kvp_manager)(h), C.int32_t(len(prompts)), (*C.int32_t)(toks.p), (*C.int64_t)(offs.p), nil, out)
	res := make([][2]int32, len(prompts))
	if out != nil {
		for i, m := range unsafe.Slice(out, len(prompts)) {
			res[i] = [2]int32{int32(m.matched_tokens), int32(m.block_tokens)}
		}
	}
	return res, abiStatus(st)
}

// hookMatchRoom returns each prompt's room; nullOut passes a NULL room.
func hookMatchRoom(h unsafe.Pointer, prompts [][]int32, nullOut bool) ([]int32, abiStatus) {
	toks, offs := flat(prompts)
	defer toks.free()
	defer offs.free()
	out := (*C.int32_t)(C.calloc(C.size_t(max(len(prompts), 1)), 4))
	defer C.free(unsafe.Pointer(out))
	if nullOut {
		out = nil
	}
	st := kvpgo_manager_match_room((*C.kvp_manager)(h), C.int32_t(len(prompts)), (*C.int32_t)(toks.p), (*C.int64_t)(offs.p), nil, out)
	res := make([]int32, len(prompts))
	if out != nil {
		for i, r := range unsafe.Slice(out, len(prompts)) {
			res[i] = int32(r)
		}
	}
	return res, abiStatus(st)
}

// offsetofBlockMatchBlocks is where kvp_block_match's block_tokens lies.
func offsetofBlockMatchBlocks() uintptr { return unsafe.Offsetof(C.kvp_block_match{}.block_tokens) }

func hookPin(h unsafe.Pointer, tokens []int32, keys []hookKeys) (uint64, int32, abiStatus) {
	t := cInt32s(tokens)
	defer t.free()
	ck, freeKeys := cKeys(keys)
	defer freeKeys()
	var id C.uint64_t
	var n C.int32_t
	st := kvpgo_manager_pin((*C.kvp_manager)(h), (*C.int32_t)(t.p), C.int32_t(len(tokens)), ck, &id, &n)
	return uint64(id), int32(n), abiStatus(st)
}

func hookUnpin(h unsafe.Pointer, id uint64) abiStatus {
	return abiStatus(kvpgo_manager_unpin((*C.kvp_manager)(h), C.uint64_t(id)))
}

func hookSetPriority(h unsafe.Pointer, tokens []int32, prio int32) (int32, abiStatus) {
	t := cInt32s(tokens)
	defer t.free()
	var n C.int32_t
	st := kvpgo_manager_set_priority((*C.kvp_manager)(h), (*C.int32_t)(t.p), C.int32_t(len(tokens)), nil, C.int32_t(prio), &n)
	return int32(n), abiStatus(st)
}

// hookPrefixStats returns queries, hit tokens, cached, evictable blocks,
// evictions.
func hookPrefixStats(h unsafe.Pointer, structSize uintptr) ([5]int64, abiStatus) {
	var s C.kvp_prefix_stats
	if structSize == 0 {
		structSize = unsafe.Sizeof(s)
	}
	s.struct_size = C.size_t(structSize)
	st := kvpgo_manager_prefix_stats((*C.kvp_manager)(h), &s)
	return [5]int64{int64(s.queries), int64(s.hit_tokens), int64(s.cached_blocks), int64(s.evictable_blocks), int64(s.evictions)}, abiStatus(st)
}

func hookPrefixStatsReset(h unsafe.Pointer) abiStatus {
	return abiStatus(kvpgo_manager_prefix_stats_reset((*C.kvp_manager)(h)))
}

func hookClearPrefixCache(h unsafe.Pointer) (int32, abiStatus) {
	var n C.int32_t = -1
	st := kvpgo_manager_clear_prefix_cache((*C.kvp_manager)(h), &n)
	return int32(n), abiStatus(st)
}

// The header's event kinds and media, for the tests (which cannot use C).
const (
	hookStored       = int32(C.KVP_KV_EVENT_BLOCK_STORED)
	hookRemoved      = int32(C.KVP_KV_EVENT_BLOCKS_REMOVED)
	hookCleared      = int32(C.KVP_KV_EVENT_ALL_CLEARED)
	hookMediumGPU    = int32(C.KVP_MEDIUM_GPU)
	hookMediumCPU    = int32(C.KVP_MEDIUM_CPU)
	hookMediumShared = int32(C.KVP_MEDIUM_SHARED)
)

// hookEvent is a drained event with its variable parts resolved.
type hookEvent struct {
	kind         int32
	medium       int32
	hash, parent [16]byte
	tokens       []int32
	mm           int
	hashes       [][16]byte
}

// eventBufs is the C memory a drain writes its events' variable parts to
// (tokens, multimodal items, removed hashes), with the token and hash
// capacities it was made for; the plain and the group drains both decode
// through it.
type eventBufs struct {
	toks, mm, hashes     cbuf
	maxTokens, maxHashes int32
}

func newEventBufs(maxTokens, maxMM, maxHashes int32) eventBufs {
	return eventBufs{
		toks:      newCBuf(4 * int(maxTokens)),
		mm:        newCBuf(int(unsafe.Sizeof(C.kvp_block_mm{})) * int(maxMM)),
		hashes:    newCBuf(16 * int(maxHashes)),
		maxTokens: maxTokens, maxHashes: maxHashes,
	}
}

func (b eventBufs) free() {
	b.toks.free()
	b.mm.free()
	b.hashes.free()
}

// decode resolves e's variable parts from the buffers.
func (b eventBufs) decode(e C.kvp_kv_event) hookEvent {
	ev := hookEvent{kind: int32(e.kind), medium: int32(e.medium), mm: int(e.num_mm)}
	ev.hash = *(*[16]byte)(unsafe.Pointer(&e.hash))
	ev.parent = *(*[16]byte)(unsafe.Pointer(&e.parent))
	if e.kind == C.KVP_KV_EVENT_BLOCK_STORED {
		tv := unsafe.Slice((*int32)(b.toks.p), max(b.maxTokens, 1))
		ev.tokens = append([]int32(nil), tv[e.tokens_offset:e.tokens_offset+e.block_size]...)
	}
	if e.kind == C.KVP_KV_EVENT_BLOCKS_REMOVED {
		hv := unsafe.Slice((*[16]byte)(b.hashes.p), max(b.maxHashes, 1))
		ev.hashes = append([][16]byte(nil), hv[e.hashes_offset:e.hashes_offset+e.num_hashes]...)
	}
	return ev
}

// hookDrain drains with the given capacities.
func hookDrain(h unsafe.Pointer, maxEvents, maxTokens, maxMM, maxHashes int32) ([]hookEvent, abiStatus) {
	evs := (*C.kvp_kv_event)(C.calloc(C.size_t(max(maxEvents, 1)), C.size_t(unsafe.Sizeof(C.kvp_kv_event{}))))
	defer C.free(unsafe.Pointer(evs))
	bufs := newEventBufs(maxTokens, maxMM, maxHashes)
	defer bufs.free()
	var n C.int32_t = -1
	st := kvpgo_manager_drain_events((*C.kvp_manager)(h), evs, C.int32_t(maxEvents), (*C.int32_t)(bufs.toks.p), C.int32_t(maxTokens),
		(*C.kvp_block_mm)(bufs.mm.p), C.int32_t(maxMM), (*C.uint8_t)(bufs.hashes.p), C.int32_t(maxHashes), &n)
	if st != C.KVP_OK {
		return nil, abiStatus(st)
	}
	var out []hookEvent
	for _, e := range unsafe.Slice(evs, int(n)) {
		out = append(out, bufs.decode(e))
	}
	return out, abiStatus(st)
}

func sizeofPrefixStats() uintptr { return unsafe.Sizeof(C.kvp_prefix_stats{}) }

// hookAddMMItems passes items (offset, length, hash seed) for seqID; with
// nullItems the pointer is NULL, and numItems overrides len(items) when
// nonzero.
func hookAddMMItems(h unsafe.Pointer, seqID int64, items [][3]int32, nullItems bool, numItems int32) abiStatus {
	var p *C.kvp_mm_item
	if len(items) > 0 && !nullItems {
		p = (*C.kvp_mm_item)(C.calloc(C.size_t(len(items)), C.size_t(unsafe.Sizeof(C.kvp_mm_item{}))))
		defer C.free(unsafe.Pointer(p))
		view := unsafe.Slice(p, len(items))
		for j, m := range items {
			view[j].offset, view[j].length = C.int32_t(m[0]), C.int32_t(m[1])
			for b := range view[j].hash {
				view[j].hash[b] = C.uint8_t(m[2])
			}
		}
	}
	n := C.int32_t(len(items))
	if numItems != 0 {
		n = C.int32_t(numItems)
	}
	return abiStatus(kvpgo_manager_add_mm_items((*C.kvp_manager)(h), C.int64_t(seqID), p, n))
}

// hookNextEventSize returns the room (tokens, mm, hashes) the oldest
// pending event needs.
func hookNextEventSize(h unsafe.Pointer) ([3]int32, abiStatus) {
	var tok, mm, hs C.int32_t = -1, -1, -1
	st := kvpgo_manager_next_event_size((*C.kvp_manager)(h), &tok, &mm, &hs)
	return [3]int32{int32(tok), int32(mm), int32(hs)}, abiStatus(st)
}

// hookManagerMarkComputed is kvp_manager_mark_computed: the step's forward
// pass ran, so the blocks filled so far are computed.
func hookManagerMarkComputed(h unsafe.Pointer) abiStatus {
	return abiStatus(kvpgo_manager_mark_computed((*C.kvp_manager)(h)))
}
