package main

// Go-typed entry points over the event publisher's exports, for capi's
// tests (see testhooks.go). Strings go through C memory, as from a host.

/*
#include <stdlib.h>
#include <string.h>
#include "kvplug.h"
*/
import "C"

import "unsafe"

// hookPubConfig is a kvp_event_publisher_config for the hooks; nil strings
// are NULL, structSize 0 is the full struct.
type hookPubConfig struct {
	endpoint, replay, topic, medium *string
	bind, format, hash, dpRank      int32
	bufferSteps, hwm, maxBatch      int32
	flushUS                         int32
	bufferBytes                     int64
	structSize                      uintptr
	nullCfg, nullOut                bool
	unterminatedTopic               bool // a topic of 2048 bytes with no NUL within 1025
}

func hookStr(s *string) (*C.char, func()) {
	if s == nil {
		return nil, func() {}
	}
	p := C.CString(*s)
	return p, func() { C.free(unsafe.Pointer(p)) }
}

func hookPublisherCreate(m unsafe.Pointer, c hookPubConfig) (unsafe.Pointer, abiStatus) {
	cfg := (*C.kvp_event_publisher_config)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kvp_event_publisher_config{}))))
	defer C.free(unsafe.Pointer(cfg))
	if c.structSize == 0 {
		c.structSize = unsafe.Sizeof(C.kvp_event_publisher_config{})
	}
	cfg.struct_size = C.size_t(c.structSize)
	var frees []func()
	defer func() {
		for _, f := range frees {
			f()
		}
	}()
	for _, f := range []struct {
		s   *string
		dst **C.char
	}{{c.endpoint, &cfg.endpoint}, {c.replay, &cfg.replay_endpoint}, {c.topic, &cfg.topic}, {c.medium, &cfg.medium}} {
		p, free := hookStr(f.s)
		*f.dst = p
		frees = append(frees, free)
	}
	if c.unterminatedTopic {
		p := C.malloc(2048)
		C.memset(p, 'x', 2048)
		cfg.topic = (*C.char)(p)
		frees = append(frees, func() { C.free(p) })
	}
	cfg.bind_mode = C.int32_t(c.bind)
	cfg.event_format = C.int32_t(c.format)
	cfg.hash_format = C.int32_t(c.hash)
	cfg.data_parallel_rank = C.int32_t(c.dpRank)
	cfg.buffer_steps = C.int32_t(c.bufferSteps)
	cfg.hwm = C.int32_t(c.hwm)
	cfg.max_batch_events = C.int32_t(c.maxBatch)
	cfg.flush_interval_us = C.int32_t(c.flushUS)
	cfg.buffer_bytes = C.int64_t(c.bufferBytes)
	var out *C.kvp_event_publisher
	pcfg, pout := cfg, &out
	if c.nullCfg {
		pcfg = nil
	}
	if c.nullOut {
		pout = nil
	}
	st := kvpgo_event_publisher_create((*C.kvp_manager)(m), pcfg, pout)
	return unsafe.Pointer(out), abiStatus(st)
}

func hookPublisherDestroy(p unsafe.Pointer) {
	kvpgo_event_publisher_destroy((*C.kvp_event_publisher)(p))
}

func hookPublisherFlush(p unsafe.Pointer) abiStatus {
	return abiStatus(kvpgo_event_publisher_flush((*C.kvp_event_publisher)(p)))
}

func hookPublisherResync(p unsafe.Pointer) abiStatus {
	return abiStatus(kvpgo_event_publisher_resync((*C.kvp_event_publisher)(p)))
}

// hookPublisherStats returns batches, events, dropped sends, snapshots,
// subscribers, the PUB port and the replay port.
func hookPublisherStats(p unsafe.Pointer, structSize uintptr, null bool) ([7]int64, abiStatus) {
	s := C.kvp_event_publisher_stats{struct_size: C.size_t(structSize)}
	if structSize == 0 {
		s.struct_size = C.size_t(unsafe.Sizeof(s))
	}
	ps := &s
	if null {
		ps = nil
	}
	st := kvpgo_event_publisher_stats_get((*C.kvp_event_publisher)(p), ps)
	return [7]int64{int64(s.batches), int64(s.events), int64(s.dropped_sends), int64(s.snapshots),
		int64(s.subscribers), int64(s.pub_port), int64(s.replay_port)}, abiStatus(st)
}

func sizeofPublisherConfig() uintptr { return unsafe.Sizeof(C.kvp_event_publisher_config{}) }
