package main

// Go-typed entry points over the host tier's exports, for capi's tests
// (see testhooks.go). Arrays go through C memory, as from a real host.

/*
#include <stdlib.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// hookTierConfig is a manager config with a host tier, and a shared tier
// when sharedAddr or sharedNS is not nil.
type hookTierConfig struct {
	numBlocks, blockSize, slots, ahead, demoteEvicted int32
	blockBytes                                        int64
	noPrefixCache                                     bool
	events                                            bool    // enable_kv_events
	structSize                                        uintptr // 0: the full struct
	sharedAddr, sharedNS                              *string
	sharedTimeoutMs, sharedPutQueue                   int32
	mem                                               unsafe.Pointer // host_tier_memory (C memory)
}

func hookManagerCreateTier(c hookTierConfig) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_manager_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(unsafe.Sizeof(C.kvp_manager_config{}))
	if c.structSize != 0 {
		cfg.struct_size = C.size_t(c.structSize)
	}
	cfg.num_blocks, cfg.block_size = C.int32_t(c.numBlocks), C.int32_t(c.blockSize)
	if !c.noPrefixCache {
		cfg.enable_prefix_cache = 1
	}
	if c.events {
		cfg.enable_kv_events = 1
	}
	cfg.host_tier_slots, cfg.demote_ahead, cfg.demote_evicted = C.int32_t(c.slots), C.int32_t(c.ahead), C.int32_t(c.demoteEvicted)
	cfg.host_block_bytes = C.int64_t(c.blockBytes)
	cfg.host_tier_memory = c.mem
	if c.sharedAddr != nil {
		cfg.shared_tier_addr = C.CString(*c.sharedAddr)
		defer C.free(unsafe.Pointer(cfg.shared_tier_addr))
	}
	if c.sharedNS != nil {
		cfg.shared_tier_namespace = C.CString(*c.sharedNS)
		defer C.free(unsafe.Pointer(cfg.shared_tier_namespace))
	}
	cfg.shared_tier_timeout_ms, cfg.shared_tier_put_queue = C.int32_t(c.sharedTimeoutMs), C.int32_t(c.sharedPutQueue)
	var out *C.kvp_manager
	st := kvpgo_manager_create(cfg, &out)
	return unsafe.Pointer(out), abiStatus(st)
}

// hookFlushCopies flushes into arrays of maxD and maxR entries (NULL when
// 0); it returns the demotions and reloads as (block, slot) pairs, the
// counts written to num_demote and num_reload, and the ticket.
func hookFlushCopies(h unsafe.Pointer, maxD, maxR int32) (d, r [][2]int32, nd, nr int32, ticket uint64, st abiStatus) {
	var dp, rp *C.kvp_tier_copy
	sz := C.size_t(unsafe.Sizeof(C.kvp_tier_copy{}))
	if maxD > 0 {
		dp = (*C.kvp_tier_copy)(C.calloc(C.size_t(maxD), sz))
		defer C.free(unsafe.Pointer(dp))
	}
	if maxR > 0 {
		rp = (*C.kvp_tier_copy)(C.calloc(C.size_t(maxR), sz))
		defer C.free(unsafe.Pointer(rp))
	}
	var cnd, cnr C.int32_t = -1, -1
	var tk C.uint64_t = 99
	st = abiStatus(kvpgo_manager_flush_copies((*C.kvp_manager)(h), dp, C.int32_t(maxD), &cnd, rp, C.int32_t(maxR), &cnr, &tk))
	if st == 0 {
		for _, o := range unsafe.Slice(dp, max(cnd, 0)) {
			d = append(d, [2]int32{int32(o.block), int32(o.slot)})
		}
		for _, o := range unsafe.Slice(rp, max(cnr, 0)) {
			r = append(r, [2]int32{int32(o.block), int32(o.slot)})
		}
	}
	return d, r, int32(cnd), int32(cnr), uint64(tk), st
}

// hookFlushCopiesNull passes NULL for the chosen outputs.
func hookFlushCopiesNull(h unsafe.Pointer, nullCounts bool, maxD int32) abiStatus {
	var cnd, cnr C.int32_t
	var tk C.uint64_t
	if nullCounts {
		return abiStatus(kvpgo_manager_flush_copies((*C.kvp_manager)(h), nil, 0, nil, nil, 0, &cnr, &tk))
	}
	return abiStatus(kvpgo_manager_flush_copies((*C.kvp_manager)(h), nil, C.int32_t(maxD), &cnd, nil, 0, &cnr, &tk))
}

func hookCompleteCopies(h unsafe.Pointer, ticket uint64, failed bool) abiStatus {
	f := C.int32_t(0)
	if failed {
		f = 1
	}
	return abiStatus(kvpgo_manager_complete_copies((*C.kvp_manager)(h), C.uint64_t(ticket), f))
}

// hookMatchTiers returns each prompt's (gpu, host) tokens.
func hookMatchTiers(h unsafe.Pointer, prompts [][]int32, nullOut bool) ([][2]int32, abiStatus) {
	toks, offs := flat(prompts)
	defer toks.free()
	defer offs.free()
	out := (*C.kvp_tier_match)(C.calloc(C.size_t(len(prompts)+1), C.size_t(unsafe.Sizeof(C.kvp_tier_match{}))))
	defer C.free(unsafe.Pointer(out))
	o := out
	if nullOut {
		o = nil
	}
	st := kvpgo_manager_match_tiers((*C.kvp_manager)(h), C.int32_t(len(prompts)), (*C.int32_t)(toks.p), (*C.int64_t)(offs.p), nil, o)
	res := make([][2]int32, len(prompts))
	for i, m := range unsafe.Slice(out, len(prompts)) {
		res[i] = [2]int32{int32(m.gpu_tokens), int32(m.host_tokens)}
	}
	return res, abiStatus(st)
}

// hookTierStats returns demotions completed, reloads completed, host hit
// tokens, in flight, host resident and host slots.
func hookTierStats(h unsafe.Pointer, structSize uintptr, nullOut bool) ([6]int64, abiStatus) {
	s := (*C.kvp_tier_stats)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_tier_stats{}))))
	defer C.free(unsafe.Pointer(s))
	s.struct_size = C.size_t(structSize)
	p := s
	if nullOut {
		p = nil
	}
	st := kvpgo_manager_tier_stats((*C.kvp_manager)(h), p)
	return [6]int64{int64(s.demotions_completed), int64(s.reloads_completed), int64(s.host_hit_tokens),
		int64(s.in_flight), int64(s.host_resident), int64(s.host_slots)}, abiStatus(st)
}

// hookSharedStats returns the shared tier's stats by field name (the
// header's, less the shared_ prefix).
func hookSharedStats(h unsafe.Pointer, structSize uintptr) (map[string]int64, abiStatus) {
	s := (*C.kvp_tier_stats)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_tier_stats{}))))
	defer C.free(unsafe.Pointer(s))
	s.struct_size = C.size_t(structSize)
	st := kvpgo_manager_tier_stats((*C.kvp_manager)(h), s)
	return map[string]int64{
		"lookups": int64(s.shared_lookups), "hits": int64(s.shared_hits), "misses": int64(s.shared_misses),
		"fetched": int64(s.shared_fetched), "fetch_misses": int64(s.shared_fetch_misses),
		"hit_tokens": int64(s.shared_hit_tokens), "match_tokens": int64(s.shared_match_tokens),
		"puts_queued": int64(s.shared_puts_queued), "puts_done": int64(s.shared_puts_done),
		"puts_present": int64(s.shared_puts_present), "puts_failed": int64(s.shared_puts_failed),
		"puts_dropped": int64(s.shared_puts_dropped), "corrupt": int64(s.shared_corrupt),
		"timeouts": int64(s.shared_timeouts), "errors": int64(s.shared_errors), "skipped": int64(s.shared_skipped),
		"bytes_read": int64(s.shared_bytes_read), "bytes_written": int64(s.shared_bytes_written),
		"queue_len": int64(s.shared_queue_len), "available": int64(s.shared_available),
	}, abiStatus(st)
}

// firstSizeofTierStats is kvp_tier_stats' first released size (through
// reserved), before the shared tier's fields.
func firstSizeofTierStats() uintptr { return unsafe.Offsetof(C.kvp_tier_stats{}.reserved) + 4 }

func sizeofTierStats() uintptr { return unsafe.Sizeof(C.kvp_tier_stats{}) }

func sizeofTierMatch() uintptr { return unsafe.Sizeof(C.kvp_tier_match{}) }

func offsetofTierMatchHost() uintptr { return unsafe.Offsetof(C.kvp_tier_match{}.host_tokens) }

// hookHostTierMemory returns the host tier's region as a Go view, its slot
// size and slot count.
func hookHostTierMemory(h unsafe.Pointer) ([]byte, int64, int32, abiStatus) {
	var base unsafe.Pointer
	var bytes C.int64_t
	var n C.int32_t
	st := abiStatus(kvpgo_manager_host_tier_memory((*C.kvp_manager)(h), &base, &bytes, &n))
	if st != 0 {
		return nil, 0, 0, st
	}
	return unsafe.Slice((*byte)(base), int64(bytes)*int64(n)), int64(bytes), int32(n), st
}
