package main

/*
#include <string.h>
#include "kvplug.h"
*/
import "C"

import (
	"net"
	"sync"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// eventPublisher is a kvp_event_publisher handle's object.
type eventPublisher struct {
	p *kvevents.Publisher
	m *kvmanager.Manager
}

// publishers maps a manager to its publisher: two consumers of one
// manager's events would each see part of the stream.
var (
	publishersMu sync.Mutex
	publishers   = map[*kvmanager.Manager]*eventPublisher{}
)

// cString reads a NUL-terminated C string of at most max bytes ("" for
// NULL); ok is false when no terminator comes within max+1 bytes.
func cString(p *C.char, max int) (string, bool) {
	if p == nil {
		return "", true
	}
	n := int(C.strnlen(p, C.size_t(max+1)))
	if n > max {
		return "", false
	}
	return C.GoStringN(p, C.int(n)), true
}

// onPublisher is an export on a kvp_event_publisher handle (onHandle).
func onPublisher(h *C.kvp_event_publisher, f func(*eventPublisher) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), "kvp_event_publisher", f)
}

//export kvpgo_event_publisher_create
func kvpgo_event_publisher_create(mh *C.kvp_manager, cfg *C.kvp_event_publisher_config, out **C.kvp_event_publisher) (st C.kvp_status) {
	defer guard(&st)
	const op = "kvp_event_publisher_create"
	var c C.kvp_event_publisher_config
	if err := configIn(op, cfg, out == nil, eventPublisherConfigStruct, &c); err != nil {
		return fail(err)
	}
	m, err := managerOf(mh)
	if err != nil {
		return fail(err)
	}
	if c.endpoint == nil {
		return failf(kverr.NullPointer, "%s: cfg.endpoint must not be NULL (e.g. \"tcp://*:5557\")", op)
	}
	strs := [4]string{}
	for i, f := range []struct {
		p    *C.char
		name string
		max  int
	}{{c.endpoint, "endpoint", kvevents.MaxEndpointLen}, {c.replay_endpoint, "replay_endpoint", kvevents.MaxEndpointLen},
		{c.topic, "topic", kvevents.MaxTopicLen}, {c.medium, "medium", kvevents.MaxMediumLen}} {
		s, ok := cString(f.p, f.max)
		if !ok {
			return failf(kverr.InvalidArgument, "%s: cfg.%s is longer than %d bytes (or not NUL-terminated)", op, f.name, f.max)
		}
		strs[i] = s
	}
	// kvevents checks the interval too (its bound, this one); here the
	// message names the C field.
	if maxUS := kvevents.MaxFlushInterval.Microseconds(); c.flush_interval_us < 0 || int64(c.flush_interval_us) > maxUS {
		return failf(kverr.InvalidArgument, "%s: flush_interval_us must be in [0, %d]: got %d", op, maxUS, int32(c.flush_interval_us))
	}
	if c.data_parallel_rank < -1 {
		return failf(kverr.InvalidArgument, "%s: data_parallel_rank must be >= -1: got %d", op, int32(c.data_parallel_rank))
	}
	dpRank := int(c.data_parallel_rank) // -1: left out of every batch
	// The header's bind_mode 0 is vLLM's rule (bind a wildcard or ipc
	// endpoint, connect to any other) and must stay so: by the struct rule
	// a field's 0 keeps its meaning within a major version, and released
	// hosts that leave it 0 with tcp://HOST:PORT rely on connecting. Go's
	// Config binds by default (BindDefault), so the modes are mapped; the
	// Python binding passes KVP_EVENTS_BIND unless told otherwise.
	var bind int
	switch c.bind_mode {
	case C.KVP_EVENTS_BIND_VLLM:
		bind = kvevents.BindVLLM
	case C.KVP_EVENTS_BIND:
		bind = kvevents.BindListen
	case C.KVP_EVENTS_CONNECT:
		bind = kvevents.BindConnect
	default:
		return failf(kverr.InvalidArgument, "%s: bind_mode must be KVP_EVENTS_BIND_VLLM (0), KVP_EVENTS_BIND (1) or KVP_EVENTS_CONNECT (2): got %d",
			op, int32(c.bind_mode))
	}
	kc := kvevents.Config{
		Endpoint:       strs[0],
		ReplayEndpoint: strs[1],
		Topic:          strs[2],
		Bind:           bind,
		BufferSteps:    int(c.buffer_steps),
		BufferBytes:    int64(c.buffer_bytes),
		HWM:            int(c.hwm),
		MaxBatchEvents: int(c.max_batch_events),
		FlushInterval:  time.Duration(c.flush_interval_us) * time.Microsecond,
		Encoding: kvevents.Encoding{
			Format: kvevents.Format(c.event_format),
			Hashes: kvevents.HashFormat(c.hash_format),
			Medium: strs[3],
			DPRank: dpRank,
		},
	}
	src, err := kvevents.ManagerSource(m)
	if err != nil {
		return fail(err)
	}
	// Held across Start so that two racing creates on one manager cannot
	// both succeed; Start binds sockets, which does not block for long.
	publishersMu.Lock()
	defer publishersMu.Unlock()
	if _, dup := publishers[m]; dup {
		return failf(kverr.InvalidArgument, "%s: the manager has a publisher already; destroy it first", op)
	}
	p, err := kvevents.Start(src, kc)
	if err != nil {
		return fail(err)
	}
	ep := &eventPublisher{p: p, m: m}
	publishers[m] = ep
	*out = (*C.kvp_event_publisher)(newHandle(ep))
	return C.KVP_OK
}

//export kvpgo_event_publisher_destroy
func kvpgo_event_publisher_destroy(h *C.kvp_event_publisher) {
	destroy(unsafe.Pointer(h), func(ep *eventPublisher) {
		ep.p.Close()
		publishersMu.Lock()
		delete(publishers, ep.m)
		publishersMu.Unlock()
	})
}

//export kvpgo_event_publisher_flush
func kvpgo_event_publisher_flush(h *C.kvp_event_publisher) C.kvp_status {
	return onPublisher(h, func(ep *eventPublisher) error {
		ep.p.Flush()
		return nil
	})
}

//export kvpgo_event_publisher_resync
func kvpgo_event_publisher_resync(h *C.kvp_event_publisher) C.kvp_status {
	return onPublisher(h, func(ep *eventPublisher) error {
		ep.p.Resync()
		return nil
	})
}

func tcpPort(a net.Addr) C.int32_t {
	if t, ok := a.(*net.TCPAddr); ok {
		return C.int32_t(t.Port)
	}
	return 0
}

//export kvpgo_event_publisher_stats_get
func kvpgo_event_publisher_stats_get(h *C.kvp_event_publisher, out *C.kvp_event_publisher_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), "kvp_event_publisher", "kvp_event_publisher_stats_get", out, eventPublisherStatsStruct, func(ep *eventPublisher) (v C.kvp_event_publisher_stats) {
		s := ep.p.Stats()
		v = C.kvp_event_publisher_stats{
			batches:          C.int64_t(s.Batches),
			events:           C.int64_t(s.Events),
			bytes:            C.int64_t(s.Bytes),
			dropped_sends:    C.int64_t(s.DroppedSends),
			replay_requests:  C.int64_t(s.ReplayReqs),
			replay_batches:   C.int64_t(s.ReplayBatches),
			snapshots:        C.int64_t(s.Snapshots),
			source_errors:    C.int64_t(s.SourceErrors),
			buffered_batches: C.int64_t(s.BufferedSteps),
			buffered_bytes:   C.int64_t(s.BufferedBytes),
			subscribers:      C.int32_t(s.Subscribers),
			pub_port:         tcpPort(ep.p.PubAddr()),
			replay_port:      tcpPort(ep.p.ReplayAddr()),
		}
		return v
	})
}
