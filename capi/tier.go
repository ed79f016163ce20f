package main

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/limits"
)

// The host KV tier at the ABI (include/kvplug.h, "Host KV tier"): the
// manager's tier (core/kvtier) makes its host pool in C memory that this
// file allocates (or in the engine's, kvp_manager_config.host_tier_memory)
// and releases it at kvp_manager_destroy (Manager.Close); the engine drives
// the copies through kvmanager.FlushCopiesTo.

// cMemory is a host pool's memory from calloc, so that the region may be
// handed to C (a Go pointer may not be kept by C), freed when its owner (a
// manager's tier, or a standalone host store) releases it; or the
// engine's (engine), never freed here.
type cMemory struct {
	p      unsafe.Pointer
	engine bool
}

func (a *cMemory) Alloc(size int) ([]byte, error) {
	if !a.engine {
		if a.p = C.calloc(1, C.size_t(size)); a.p == nil {
			return nil, kverr.Errorf(kverr.OutOfMemory, "calloc of %d bytes failed", size)
		}
	}
	return unsafe.Slice((*byte)(a.p), size), nil
}

func (a *cMemory) Release() {
	if !a.engine && a.p != nil {
		C.free(a.p)
		a.p = nil
	}
}

// hostTierOf validates the config's host tier fields and translates them;
// nil, nil when the config has none. The tier allocates its memory in
// kvmanager.New, once every field is checked.
func hostTierOf(c *C.kvp_manager_config) (*kvmanager.HostTier, error) {
	if c.demote_evicted != 0 && c.demote_evicted != 1 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.demote_evicted must be 0 or 1: got %d", int32(c.demote_evicted))
	}
	slots, bytes, ahead := int64(c.host_tier_slots), int64(c.host_block_bytes), int64(c.demote_ahead)
	if slots == 0 {
		if c.host_tier_memory != nil {
			return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.host_tier_memory needs a host tier (host_tier_slots > 0)")
		}
		if bytes != 0 || ahead != 0 || c.demote_evicted != 0 || c.write_through != 0 || c.write_through_slack != 0 {
			return nil, kverr.Errorf(kverr.InvalidArgument,
				"kvp_manager_config: host_block_bytes (%d), demote_ahead (%d), demote_evicted (%d), write_through (%d) and write_through_slack (%d) need a host tier (host_tier_slots > 0)",
				bytes, ahead, int32(c.demote_evicted), int32(c.write_through), int32(c.write_through_slack))
		}
		return nil, nil
	}
	if slots < 0 || slots > limits.TierSlots {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.host_tier_slots must be in [0, 2^30]: got %d", slots)
	}
	if bytes < 1 || bytes > limits.TierBytes/slots {
		return nil, kverr.Errorf(kverr.InvalidArgument,
			"kvp_manager_config.host_block_bytes must be >= 1 with a host tier, and host_tier_slots * host_block_bytes <= 2^46: got %d slots of %d bytes", slots, bytes)
	}
	if nb := int64(c.num_blocks); ahead < 0 || ahead > nb {
		// The core refuses it too (kvtier.New); this names the field.
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.demote_ahead must be in [0, num_blocks = %d]: got %d", nb, ahead)
	}
	if nb, wt := int64(c.num_blocks), int64(c.write_through); wt < 0 || wt > nb {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.write_through must be in [0, num_blocks = %d]: got %d", nb, wt)
	}
	if uintptr(c.host_tier_memory)%16 != 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config.host_tier_memory must be 16-byte aligned: got %p", c.host_tier_memory)
	}
	// No copier: the engine drives the copies (kvp_manager_flush_copies).
	return &kvmanager.HostTier{Slots: int(slots), BlockBytes: int(bytes),
		Memory:      &cMemory{p: c.host_tier_memory, engine: c.host_tier_memory != nil},
		DemoteAhead: int(ahead), DemoteEvicted: c.demote_evicted != 0, WriteThrough: int(c.write_through),
		WriteThroughSlack: int(c.write_through_slack)}, nil // its range: kvtier.New
}

// maxAddrLen bounds a server address: kvp_manager_config.shared_tier_addr
// (and the length read of the namespace, which the core bounds at 64) and
// kvp_shared_store_config.address.
const maxAddrLen = 1024

// sharedTierOf translates and checks the config's shared tier fields;
// nil, nil when it has none.
func sharedTierOf(c *C.kvp_manager_config) (*kvmanager.SharedTier, error) {
	sec := sharedSecurityFields{
		username: c.shared_tier_username, passwordEnv: c.shared_tier_password_env, passwordFile: c.shared_tier_password_file,
		caFile: c.shared_tier_tls_ca_file, certFile: c.shared_tier_tls_cert_file, keyFile: c.shared_tier_tls_key_file,
		serverName: c.shared_tier_tls_server_name, macKeysEnv: c.shared_tier_mac_keys_env, macKeysFile: c.shared_tier_mac_keys_file,
		tls: c.shared_tier_tls, reserved: c.shared_tier_reserved, prefix: "shared_tier_", structName: "kvp_manager_config", reservedName: "reserved",
	}
	if c.shared_tier_addr == nil {
		if c.shared_tier_namespace != nil || c.shared_tier_timeout_ms != 0 || c.shared_tier_put_queue != 0 {
			return nil, kverr.Errorf(kverr.InvalidArgument,
				"kvp_manager_config: shared_tier_namespace, shared_tier_timeout_ms (%d) and shared_tier_put_queue (%d) need a shared tier (shared_tier_addr)",
				int32(c.shared_tier_timeout_ms), int32(c.shared_tier_put_queue))
		}
		if sec.any() {
			return nil, kverr.Errorf(kverr.InvalidArgument,
				"kvp_manager_config: the shared tier's security fields (shared_tier_username ... shared_tier_tls, shared_tier_reserved) need a shared tier (shared_tier_addr)")
		}
		return nil, nil
	}
	if c.host_tier_slots == 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config: a shared tier (shared_tier_addr) needs a host tier (host_tier_slots > 0)")
	}
	addr, err := boundedString(c.shared_tier_addr, "kvp_manager_config.shared_tier_addr")
	if err != nil {
		return nil, err
	}
	var ns string
	if c.shared_tier_namespace != nil {
		if ns, err = boundedString(c.shared_tier_namespace, "kvp_manager_config.shared_tier_namespace"); err != nil {
			return nil, err
		}
	}
	security, err := sec.translate()
	if err != nil {
		return nil, err
	}
	sh := &kvmanager.SharedTier{
		Addr:      addr,
		Namespace: ns,
		OpTimeout: time.Duration(c.shared_tier_timeout_ms) * time.Millisecond,
		PutQueue:  int(c.shared_tier_put_queue),
		Username:  security.username,
		Password:  security.password,
		TLS:       security.tls,
		MACKeys:   security.macKeys,
	}
	if err := sh.Check(); err != nil {
		return nil, kverr.Wrap(kverr.CodeOf(err), err, "kvp_manager_config")
	}
	return sh, nil
}

// boundedString copies a NUL-terminated C string of at most maxAddrLen
// bytes.
func boundedString(p *C.char, what string) (string, error) {
	n := int(C.strnlen(p, maxAddrLen+1))
	if n > maxAddrLen {
		return "", kverr.Errorf(kverr.InvalidArgument, "%s is longer than %d bytes", what, maxAddrLen)
	}
	return C.GoStringN(p, C.int(n)), nil
}

// tierOf returns manager m's host pool; an error when it has none.
func tierOf(m *kvmanager.Manager, op string) (*host.Pool, error) {
	if p := m.HostTierPool(); p != nil {
		return p, nil
	}
	return nil, kverr.Errorf(kverr.InvalidArgument, "%s: the manager has no host tier (host_tier_slots 0)", op)
}

//export kvpgo_manager_flush_copies
func kvpgo_manager_flush_copies(h *C.kvp_manager, demote *C.kvp_tier_copy, maxDemote C.int32_t, numDemote *C.int32_t,
	reload *C.kvp_tier_copy, maxReload C.int32_t, numReload *C.int32_t, ticket *C.uint64_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		const op = "kvp_manager_flush_copies"
		if numDemote == nil || numReload == nil || ticket == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: num_demote, num_reload and ticket must not be NULL", op)
		}
		if maxDemote < 0 || maxReload < 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: max_demote and max_reload must be >= 0: got %d and %d", op, int32(maxDemote), int32(maxReload))
		}
		if (demote == nil && maxDemote > 0) || (reload == nil && maxReload > 0) {
			return kverr.Errorf(kverr.NullPointer, "%s: demote or reload is NULL with a max > 0 (max_demote %d, max_reload %d)", op, int32(maxDemote), int32(maxReload))
		}
		if _, err := tierOf(m, op); err != nil {
			return err
		}
		// The core's ops carry the block's hash: taken into slices of the
		// batch's length (not of the caller's room, which may be any
		// int32), then written to the caller's arrays.
		tk, d, r, needD, needR, err := m.FlushCopiesWithin(int(maxDemote), int(maxReload))
		if kverr.Is(err, kverr.BufferTooSmall) {
			*numDemote, *numReload = C.int32_t(needD), C.int32_t(needR)
			return kverr.Wrap(kverr.BufferTooSmall, err, op)
		}
		if err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		nd, nr := len(d), len(r)
		if nd > 0 {
			out := unsafe.Slice(demote, nd)
			for i, o := range d {
				out[i] = C.kvp_tier_copy{block: C.int32_t(o.Block), slot: C.int32_t(o.Slot)}
			}
		}
		if nr > 0 {
			out := unsafe.Slice(reload, nr)
			for i, o := range r {
				out[i] = C.kvp_tier_copy{block: C.int32_t(o.Block), slot: C.int32_t(o.Slot)}
			}
		}
		*numDemote, *numReload, *ticket = C.int32_t(nd), C.int32_t(nr), C.uint64_t(tk)
		return nil
	})
}

//export kvpgo_manager_complete_copies
func kvpgo_manager_complete_copies(h *C.kvp_manager, ticket C.uint64_t, failed C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := m.CompleteCopies(uint64(ticket), failed != 0); err != nil {
			return kverr.Wrap(kverr.CodeOf(err), err, "kvp_manager_complete_copies")
		}
		return nil
	})
}

//export kvpgo_manager_match_tiers
func kvpgo_manager_match_tiers(h *C.kvp_manager, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, out *C.kvp_tier_match) C.kvp_status {
	// kvp_tier_match and kvmanager.TierMatch are both two int32s
	// (tier_abi_test.go checks).
	return onPrompts(h, "kvp_manager_match_tiers", n, tokens, offsets, keys, unsafe.Pointer(out), (*kvmanager.Manager).MatchTiers)
}

//export kvpgo_manager_tier_stats
func kvpgo_manager_tier_stats(h *C.kvp_manager, out *C.kvp_tier_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), managerName, "kvp_manager_tier_stats", out, tierStatsStruct, func(m *kvmanager.Manager) (v C.kvp_tier_stats) {
		s := m.TierStats()
		v.demotions_queued = C.int64_t(s.DemotionsQueued)
		v.demotions_completed = C.int64_t(s.DemotionsCompleted)
		v.demotions_failed = C.int64_t(s.DemotionsFailed)
		v.skipped_full = C.int64_t(s.SkippedFull)
		v.skipped_present = C.int64_t(s.SkippedPresent)
		v.evicted_undemoted = C.int64_t(s.EvictedUndemoted)
		v.reloads = C.int64_t(s.Reloads)
		v.reloads_completed = C.int64_t(s.ReloadsCompleted)
		v.reloads_failed = C.int64_t(s.ReloadsFailed)
		v.host_hit_tokens = C.int64_t(s.HostHitTokens)
		v.match_queries = C.int64_t(s.MatchQueries)
		v.match_gpu_tokens = C.int64_t(s.MatchGPUTokens)
		v.match_host_tokens = C.int64_t(s.MatchHostTokens)
		v.host_evictions = C.int64_t(s.Host.Evictions)
		v.host_hits = C.int64_t(s.Host.Hits)
		v.host_misses = C.int64_t(s.Host.Misses)
		v.in_flight = C.int32_t(s.InFlight)
		v.host_slots = C.int32_t(s.Host.Slots)
		v.host_resident = C.int32_t(s.Host.Resident)
		v.host_reserved = C.int32_t(s.Host.Reserved)
		v.host_pinned = C.int32_t(s.Host.Pinned)
		sh := &s.Shared
		v.shared_lookups = C.int64_t(sh.Lookups)
		v.shared_hits = C.int64_t(sh.Hits)
		v.shared_misses = C.int64_t(sh.Misses)
		v.shared_fetched = C.int64_t(sh.Fetched)
		v.shared_fetch_misses = C.int64_t(sh.FetchMisses)
		v.shared_hit_tokens = C.int64_t(sh.HitTokens)
		v.shared_match_tokens = C.int64_t(sh.MatchTokens)
		v.shared_puts_queued = C.int64_t(sh.PutsQueued)
		v.shared_puts_done = C.int64_t(sh.PutsDone)
		v.shared_puts_present = C.int64_t(sh.PutsPresent)
		v.shared_puts_failed = C.int64_t(sh.PutsFailed)
		v.shared_puts_dropped = C.int64_t(sh.PutsDropped)
		v.shared_corrupt = C.int64_t(sh.Corrupt)
		v.shared_timeouts = C.int64_t(sh.Timeouts)
		v.shared_errors = C.int64_t(sh.Errors)
		v.shared_skipped = C.int64_t(sh.Skipped)
		v.shared_bytes_read = C.int64_t(sh.BytesRead)
		v.shared_bytes_written = C.int64_t(sh.BytesWritten)
		v.shared_queue_len = C.int32_t(sh.QueueLen)
		v.shared_auth_failures = C.int64_t(sh.AuthFailures)
		v.shared_tls_failures = C.int64_t(sh.TLSFailures)
		v.shared_mac_failures = C.int64_t(sh.MACFailures)
		v.shared_redirects, v.shared_map_reads, v.shared_primaries = C.int64_t(sh.Redirects), C.int64_t(sh.MapReads), C.int32_t(sh.Primaries)
		if sh.Cluster {
			v.shared_cluster = 1
		}
		v.write_through_stored = C.int64_t(s.WriteThroughStored)
		v.write_through_lost = C.int64_t(s.WriteThroughLost)
		v.write_through_queue = C.int32_t(s.WriteThroughQueue)
		v.shared_remembered = C.int64_t(sh.Remembered)
		if sh.Available {
			v.shared_available = 1
		}
		return v
	})
}

//export kvpgo_manager_host_tier_memory
func kvpgo_manager_host_tier_memory(h *C.kvp_manager, base *unsafe.Pointer, slotBytes *C.int64_t, numSlots *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		p, err := tierOf(m, "kvp_manager_host_tier_memory")
		if err != nil {
			return err
		}
		if base != nil {
			*base = unsafe.Pointer(unsafe.SliceData(p.Memory()))
		}
		if slotBytes != nil {
			*slotBytes = C.int64_t(p.BlockBytes())
		}
		if numSlots != nil {
			*numSlots = C.int32_t(p.Stats().Slots)
		}
		return nil
	})
}
