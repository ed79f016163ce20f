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
	// The security fields, by name past "shared_tier_" (username,
	// password_env, ..., mac_keys_file), and tls and reserved.
	security              map[string]string
	sharedTLS, sharedResv int32
	writeThrough, slack   int32 // write_through, write_through_slack
}

func hookManagerCreateTier(c hookTierConfig) (unsafe.Pointer, abiStatus) {
	cfg := cStructOf[C.kvp_manager_config](c.structSize)
	defer C.free(unsafe.Pointer(cfg))
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
	for name, p := range map[string]**C.char{
		"username": &cfg.shared_tier_username, "password_env": &cfg.shared_tier_password_env,
		"password_file": &cfg.shared_tier_password_file, "tls_ca_file": &cfg.shared_tier_tls_ca_file,
		"tls_cert_file": &cfg.shared_tier_tls_cert_file, "tls_key_file": &cfg.shared_tier_tls_key_file,
		"tls_server_name": &cfg.shared_tier_tls_server_name, "mac_keys_env": &cfg.shared_tier_mac_keys_env,
		"mac_keys_file": &cfg.shared_tier_mac_keys_file,
	} {
		if v, ok := c.security[name]; ok {
			*p = C.CString(v)
			defer C.free(unsafe.Pointer(*p))
		}
	}
	if n := len(c.security); n > 0 && n != len(securityFieldNames(c.security)) {
		panic("hookManagerCreateTier: an unknown security field")
	}
	cfg.shared_tier_tls, cfg.shared_tier_reserved = C.int32_t(c.sharedTLS), C.int32_t(c.sharedResv)
	cfg.write_through, cfg.write_through_slack = C.int32_t(c.writeThrough), C.int32_t(c.slack)
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
		"auth_failures": int64(s.shared_auth_failures), "tls_failures": int64(s.shared_tls_failures),
		"mac_failures": int64(s.shared_mac_failures),
		"redirects":    int64(s.shared_redirects), "map_reads": int64(s.shared_map_reads),
		"cluster": int64(s.shared_cluster), "primaries": int64(s.shared_primaries),
	}, abiStatus(st)
}

// hookSharedStoreClusterStats returns kvp_shared_store_stats' cluster
// fields: cluster, primaries, map_reads, redirects.
func hookSharedStoreClusterStats(h unsafe.Pointer) ([4]int64, abiStatus) {
	s := cStructOf[C.kvp_shared_store_stats](0)
	defer C.free(unsafe.Pointer(s))
	st := kvpgo_shared_store_stats_get((*C.kvp_shared_store)(h), s)
	return [4]int64{int64(s.cluster), int64(s.primaries), int64(s.map_reads), int64(s.redirects)}, abiStatus(st)
}

// securityFieldNames are the keys of m that name security fields.
func securityFieldNames(m map[string]string) []string {
	var out []string
	for k := range m {
		switch k {
		case "username", "password_env", "password_file", "tls_ca_file", "tls_cert_file", "tls_key_file",
			"tls_server_name", "mac_keys_env", "mac_keys_file":
			out = append(out, k)
		}
	}
	return out
}

// hookSharedStoreCreateSecured creates a shared store with the security
// fields of m (by their names) and tls, reserved2.
func hookSharedStoreCreateSecured(addr, ns string, m map[string]string, tls, reserved2 int32) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_shared_store_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_shared_store_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	cfg.struct_size = C.size_t(unsafe.Sizeof(C.kvp_shared_store_config{}))
	cfg.address, cfg.key_space = C.CString(addr), C.CString(ns)
	defer C.free(unsafe.Pointer(cfg.address))
	defer C.free(unsafe.Pointer(cfg.key_space))
	cfg.op_timeout_ms = 2000
	for name, p := range map[string]**C.char{
		"username": &cfg.username, "password_env": &cfg.password_env, "password_file": &cfg.password_file,
		"tls_ca_file": &cfg.tls_ca_file, "tls_cert_file": &cfg.tls_cert_file, "tls_key_file": &cfg.tls_key_file,
		"tls_server_name": &cfg.tls_server_name, "mac_keys_env": &cfg.mac_keys_env, "mac_keys_file": &cfg.mac_keys_file,
	} {
		if v, ok := m[name]; ok {
			*p = C.CString(v)
			defer C.free(unsafe.Pointer(*p))
		}
	}
	cfg.tls, cfg.reserved2 = C.int32_t(tls), C.int32_t(reserved2)
	var out *C.kvp_shared_store
	st := kvpgo_shared_store_create(cfg, &out)
	return unsafe.Pointer(out), abiStatus(st)
}

// hookSharedStoreSecurityStats returns a shared store's auth, TLS and MAC
// failures, and its errors and corrupt values.
func hookSharedStoreSecurityStats(h unsafe.Pointer, structSize uintptr) ([5]int64, abiStatus) {
	s := (*C.kvp_shared_store_stats)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_shared_store_stats{}))))
	defer C.free(unsafe.Pointer(s))
	s.struct_size = C.size_t(structSize)
	st := kvpgo_shared_store_stats_get((*C.kvp_shared_store)(h), s)
	return [5]int64{int64(s.auth_failures), int64(s.tls_failures), int64(s.mac_failures), int64(s.errors), int64(s.corrupt)}, abiStatus(st)
}

func firstSizeofSharedStoreStats() uintptr {
	return unsafe.Offsetof(C.kvp_shared_store_stats{}.reserved) + 4
}

func sizeofSharedStoreStats() uintptr { return unsafe.Sizeof(C.kvp_shared_store_stats{}) }

// firstSizeofTierStats is kvp_tier_stats' first released size (through
// reserved), before the shared tier's fields.
func firstSizeofTierStats() uintptr { return unsafe.Offsetof(C.kvp_tier_stats{}.reserved) + 4 }

func sizeofTierStats() uintptr { return unsafe.Sizeof(C.kvp_tier_stats{}) }

// hookWriteThroughStats returns kvp_tier_stats' write-through fields:
// stored, lost, queue.
func hookWriteThroughStats(h unsafe.Pointer) ([3]int64, abiStatus) {
	s := cStructOf[C.kvp_tier_stats](0)
	defer C.free(unsafe.Pointer(s))
	st := kvpgo_manager_tier_stats((*C.kvp_manager)(h), s)
	return [3]int64{int64(s.write_through_stored), int64(s.write_through_lost), int64(s.write_through_queue)}, abiStatus(st)
}

// offsetofTierStatsAuth is where kvp_tier_stats' shared security counters
// begin: a caller's struct_size that ends there is one from before them.
func offsetofTierStatsAuth() uintptr { return unsafe.Offsetof(C.kvp_tier_stats{}.shared_auth_failures) }

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

// hookSharedStoreGetOnly gets keys (laid out as hookSharedStorePutGet's)
// into fresh buffers of size bytes: found and what came back.
func hookSharedStoreGetOnly(h unsafe.Pointer, keys []uint64, size int) (int32, []int32, [][]byte, abiStatus) {
	n := len(keys)
	k := newCBuf(16 * n)
	defer k.free()
	kb := unsafe.Slice((*byte)(k.p), 16*n)
	for i, v := range keys {
		for j := 0; j < 8; j++ {
			kb[16*i+j] = byte(v >> (8 * j))
			kb[16*i+8+j] = 0x5a
		}
	}
	lens, outp, found := newCBuf(8*n), newCBuf(8*n), newCBuf(4*n)
	defer lens.free()
	defer outp.free()
	defer found.free()
	for i := range n {
		out := newCBuf(size)
		defer out.free()
		unsafe.Slice((*unsafe.Pointer)(outp.p), n)[i] = out.p
		unsafe.Slice((*int64)(lens.p), n)[i] = int64(size)
	}
	st := kvpgo_shared_store_get((*C.kvp_shared_store)(h), C.int32_t(n), (*C.uint8_t)(k.p), 1, (*unsafe.Pointer)(outp.p),
		(*C.int64_t)(lens.p), (*C.int32_t)(found.p))
	back := make([][]byte, n)
	for i := range n {
		back[i] = append([]byte(nil), unsafe.Slice((*byte)(unsafe.Slice((*unsafe.Pointer)(outp.p), n)[i]), size)...)
	}
	return 0, slices32(found, n), back, abiStatus(st)
}
