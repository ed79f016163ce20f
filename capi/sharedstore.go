package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/core/limits"
)

// The standalone shared store at the ABI (include/kvplug.h, "standalone
// shared store"): a valkey.Tier of its own. Every fault of the server is
// the tier's business (misses and skipped stores, counted); what fails here
// is bad arguments only.

var (
	sharedStoreConfigStruct = structOf[C.kvp_shared_store_config]("kvp_shared_store_config", unsafe.Offsetof(C.kvp_shared_store_config{}.reserved)+4)
	sharedStoreStatsStruct  = structOf[C.kvp_shared_store_stats]("kvp_shared_store_stats", unsafe.Offsetof(C.kvp_shared_store_stats{}.reserved)+4)
)

func onSharedStore(h *C.kvp_shared_store, f func(*valkey.Tier) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), "kvp_shared_store", f)
}

//export kvpgo_shared_store_create
func kvpgo_shared_store_create(cfg *C.kvp_shared_store_config, out **C.kvp_shared_store) C.kvp_status {
	const op = "kvp_shared_store_create"
	return createHandle(op, cfg, unsafe.Pointer(out), sharedStoreConfigStruct, func(c *C.kvp_shared_store_config) (any, error) {
		if c.address == nil || c.key_space == nil {
			return nil, kverr.Errorf(kverr.NullPointer, "%s: cfg.address and cfg.key_space must not be NULL", op)
		}
		if c.reserved != 0 {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: cfg.reserved must be 0: got %d", op, int32(c.reserved))
		}
		addr, ok := cString(c.address, maxAddrLen)
		if !ok {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: cfg.address is longer than %d bytes (or not NUL-terminated)", op, maxAddrLen)
		}
		ns, ok := cString(c.key_space, 64)
		if !ok {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: cfg.key_space is longer than 64 bytes (or not NUL-terminated)", op)
		}
		// Negative sizes and durations are valkey.Config.Check's to refuse
		// (InvalidArgument); the one bound it has not is a block's size.
		if c.block_bytes > limits.SharedBlockBytes {
			return nil, kverr.Errorf(kverr.InvalidArgument, "%s: cfg.block_bytes must be in [0, 2^40]: got %d", op, int64(c.block_bytes))
		}
		sec := sharedSecurityFields{
			username: c.username, passwordEnv: c.password_env, passwordFile: c.password_file,
			caFile: c.tls_ca_file, certFile: c.tls_cert_file, keyFile: c.tls_key_file, serverName: c.tls_server_name,
			macKeysEnv: c.mac_keys_env, macKeysFile: c.mac_keys_file, tls: c.tls, reserved: c.reserved2,
			structName: "kvp_shared_store_config", reservedName: "reserved2",
		}
		security, err := sec.translate()
		if err != nil {
			return nil, kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		ms := func(v C.int32_t) time.Duration { return time.Duration(v) * time.Millisecond }
		vc := valkey.Config{
			Addr: addr, Namespace: ns, Fingerprint: uint64(c.fingerprint), BlockBytes: int(c.block_bytes),
			DialTimeout: ms(c.dial_timeout_ms), OpTimeout: ms(c.op_timeout_ms), TTL: ms(c.ttl_ms),
			Backoff: ms(c.backoff_ms), MaxBackoff: ms(c.max_backoff_ms),
		}
		security.apply(&vc)
		t, err := valkey.New(vc)
		if err != nil {
			return nil, kverr.Wrap(kverr.CodeOf(err), err, op)
		}
		return t, nil
	})
}

//export kvpgo_shared_store_destroy
func kvpgo_shared_store_destroy(h *C.kvp_shared_store) {
	destroy(unsafe.Pointer(h), func(t *valkey.Tier) { _ = t.Close() })
}

//export kvpgo_shared_store_exists
func kvpgo_shared_store_exists(h *C.kvp_shared_store, n C.int32_t, keys *C.uint8_t, found *C.int32_t) C.kvp_status {
	return onSharedStore(h, func(t *valkey.Tier) error {
		const op = "kvp_shared_store_exists"
		ks, err := storeKeysOf[valkey.Hash](op, n, unsafe.Pointer(keys), "found", found == nil)
		if err != nil {
			return err
		}
		putFlags(slice[int32](unsafe.Pointer(found), n), t.Exists(ks))
		return nil
	})
}

// putFlags writes found[i] as the caller's int32 flags (0 or 1).
func putFlags(out []int32, found []bool) {
	for i, ok := range found {
		out[i] = 0
		if ok {
			out[i] = 1
		}
	}
}

// sharedBatch reads a put's or get's keys and their segments (segs per
// key, key i's at [i*segs, (i+1)*segs)).
func sharedBatch(op string, n C.int32_t, keys *C.uint8_t, segs C.int32_t, ptrs *unsafe.Pointer,
	lens *C.int64_t) ([]valkey.Hash, []unsafe.Pointer, []int64, error) {
	ks, err := storeKeysOf[valkey.Hash](op, n, unsafe.Pointer(keys), "", false)
	if err != nil {
		return nil, nil, nil, err
	}
	ps, ls, err := segmentsOf(op, n, segs, ptrs, lens, -1)
	return ks, ps, ls, err
}

// valueSize is the bytes of key i's segments.
func valueSize(ls []int64, i, segs int) int64 {
	size := int64(0)
	for _, l := range ls[i*segs : (i+1)*segs] {
		size += l
	}
	return size
}

//export kvpgo_shared_store_put
func kvpgo_shared_store_put(h *C.kvp_shared_store, n C.int32_t, keys *C.uint8_t, segs C.int32_t, ptrs *unsafe.Pointer,
	lens *C.int64_t, stored *C.int32_t) C.kvp_status {
	return onSharedStore(h, func(t *valkey.Tier) error {
		ks, ps, ls, err := sharedBatch("kvp_shared_store_put", n, keys, segs, ptrs, lens)
		if err != nil {
			return err
		}
		// One segment: the tier reads the caller's memory in place. More:
		// the key's segments are gathered into one payload first.
		g := int(segs)
		payloads := make([][]byte, len(ks))
		for i := range ks {
			if g == 1 {
				payloads[i] = unsafe.Slice((*byte)(ps[i]), int(ls[i]))
				continue
			}
			p := make([]byte, 0, valueSize(ls, i, g))
			for j := 0; j < g; j++ {
				if ls[i*g+j] > 0 {
					p = append(p, unsafe.Slice((*byte)(ps[i*g+j]), int(ls[i*g+j]))...)
				}
			}
			payloads[i] = p
		}
		n := t.Put(ks, payloads)
		if stored != nil {
			*stored = C.int32_t(n)
		}
		return nil
	})
}

//export kvpgo_shared_store_get
func kvpgo_shared_store_get(h *C.kvp_shared_store, n C.int32_t, keys *C.uint8_t, segs C.int32_t, ptrs *unsafe.Pointer,
	lens *C.int64_t, found *C.int32_t) C.kvp_status {
	return onSharedStore(h, func(t *valkey.Tier) error {
		const op = "kvp_shared_store_get"
		ks, ps, ls, err := sharedBatch(op, n, keys, segs, ptrs, lens)
		if err != nil {
			return err
		}
		if found == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: found must not be NULL", op)
		}
		// Key i's segments, viewed in place: the tier copies each value
		// straight into the caller's memory.
		g := int(segs)
		views := make([][]byte, len(ps))
		for k, p := range ps {
			views[k] = unsafe.Slice((*byte)(p), int(ls[k]))
		}
		dst := make([][][]byte, len(ks))
		for i := range ks {
			dst[i] = views[i*g : (i+1)*g : (i+1)*g]
		}
		putFlags(slice[int32](unsafe.Pointer(found), n), t.GetSegments(ks, dst))
		return nil
	})
}

//export kvpgo_shared_store_stats_get
func kvpgo_shared_store_stats_get(h *C.kvp_shared_store, out *C.kvp_shared_store_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), "kvp_shared_store", "kvp_shared_store_stats_get", out, sharedStoreStatsStruct, func(t *valkey.Tier) (v C.kvp_shared_store_stats) {
		s := t.Stats()
		v.hits, v.misses, v.stores, v.corrupt = C.int64_t(s.Hits), C.int64_t(s.Misses), C.int64_t(s.Stores), C.int64_t(s.Corrupt)
		v.timeouts, v.errors, v.skipped = C.int64_t(s.Timeouts), C.int64_t(s.Errors), C.int64_t(s.Skipped)
		v.bytes_read, v.bytes_written = C.int64_t(s.BytesRead), C.int64_t(s.BytesWritten)
		v.auth_failures, v.tls_failures, v.mac_failures = C.int64_t(s.AuthFailures), C.int64_t(s.TLSFailures), C.int64_t(s.MACFailures)
		v.redirects, v.map_reads, v.primaries = C.int64_t(s.Redirects), C.int64_t(s.MapReads), C.int32_t(s.Primaries)
		if s.Cluster {
			v.cluster = 1
		}
		if s.Available {
			v.available = 1
		}
		return v
	})
}
