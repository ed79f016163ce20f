package main

// Test entry points for the struct-evolution rule: each builds a valid
// struct of this library's version in a buffer large enough for any size
// tried, then sets struct_size and calls the real export.

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// structBuf is a zeroed C buffer of n bytes.
type structBuf struct {
	p unsafe.Pointer
	n uintptr
}

func newStructBuf(n uintptr) structBuf { return structBuf{C.calloc(1, C.size_t(n)), n} }
func (b structBuf) free()              { C.free(b.p) }
func (b structBuf) bytes() []byte      { return unsafe.Slice((*byte)(b.p), b.n) }

// structSizes is this library's (first, size) of a struct, by name.
func structSizes(name string) (first, size uintptr) {
	for _, s := range abiStructs {
		if s.name == name {
			return s.first, s.size
		}
	}
	panic("unknown struct " + name)
}

// hookCreateWithConfig creates a manager ("kvp_manager_config") or a host
// vcache ("kvp_vcache_config") from buf, whose first size bytes hold a valid
// config (the caller may have changed bytes past that). It destroys what it
// made and returns the status.
func hookCreateWithConfig(name string, buf structBuf, structSize uintptr) abiStatus {
	switch name {
	case "kvp_manager_config":
		cfg := (*C.kvp_manager_config)(buf.p)
		cfg.num_blocks, cfg.block_size = 8, 16
		cfg.struct_size = C.size_t(structSize)
		var out *C.kvp_manager
		st := kvpgo_manager_create(cfg, &out)
		kvpgo_manager_destroy(out)
		return abiStatus(st)
	case "kvp_vcache_config":
		cfg := (*C.kvp_vcache_config)(buf.p)
		cfg.backend = C.KVP_VMEM_HOST
		cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.max_batch, cfg.max_context = 1, 1, 64, 1, 64
		cfg.budget_bytes = 1 << 20
		cfg.no_background = 1
		cfg.struct_size = C.size_t(structSize)
		var out *C.kvp_vcache
		st := kvpgo_vcache_create(cfg, &out)
		kvpgo_vcache_destroy(out)
		return abiStatus(st)
	}
	panic("not a config: " + name)
}

// hookStatsInto fills the output struct `name` in buf (struct_size set to
// structSize, the rest as the caller left it) from a fresh manager or vcache.
func hookStatsInto(name string, buf structBuf, structSize uintptr) abiStatus {
	*(*C.size_t)(buf.p) = C.size_t(structSize)
	switch name {
	case "kvp_manager_stats", "kvp_prefix_stats":
		cfg := C.kvp_manager_config{struct_size: C.size_t(unsafe.Sizeof(C.kvp_manager_config{})), num_blocks: 8, block_size: 16, enable_prefix_cache: 1}
		var m *C.kvp_manager
		if st := kvpgo_manager_create(&cfg, &m); st != C.KVP_OK {
			return abiStatus(st)
		}
		defer kvpgo_manager_destroy(m)
		if name == "kvp_manager_stats" {
			return abiStatus(kvpgo_manager_stats_get(m, (*C.kvp_manager_stats)(buf.p)))
		}
		return abiStatus(kvpgo_manager_prefix_stats(m, (*C.kvp_prefix_stats)(buf.p)))
	case "kvp_tier_stats":
		cfg := C.kvp_manager_config{struct_size: C.size_t(unsafe.Sizeof(C.kvp_manager_config{})), num_blocks: 8, block_size: 16,
			enable_prefix_cache: 1, host_tier_slots: 4, host_block_bytes: 64}
		var m *C.kvp_manager
		if st := kvpgo_manager_create(&cfg, &m); st != C.KVP_OK {
			return abiStatus(st)
		}
		defer kvpgo_manager_destroy(m)
		return abiStatus(kvpgo_manager_tier_stats(m, (*C.kvp_tier_stats)(buf.p)))
	case "kvp_vcache_stats":
		cfg := C.kvp_vcache_config{struct_size: C.size_t(unsafe.Sizeof(C.kvp_vcache_config{})), backend: C.KVP_VMEM_HOST,
			num_layers: 1, num_kv_heads: 1, head_dim: 64, max_batch: 1, max_context: 64, budget_bytes: 1 << 20, no_background: 1}
		var vc *C.kvp_vcache
		if st := kvpgo_vcache_create(&cfg, &vc); st != C.KVP_OK {
			return abiStatus(st)
		}
		defer kvpgo_vcache_destroy(vc)
		return abiStatus(kvpgo_vcache_stats_get(vc, (*C.kvp_vcache_stats)(buf.p)))
	}
	panic("not an output struct: " + name)
}
