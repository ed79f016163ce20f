package main

import (
	"fmt"
	"net"
	"testing"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
)

func strp(s string) *string { return &s }

func loopbackPub() hookPubConfig {
	return hookPubConfig{endpoint: strp("tcp://127.0.0.1:0"), replay: strp("tcp://127.0.0.1:0"), bind: 1}
}

func TestPublisherBadInput(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	m, st := hookManagerCreateCached(64, 4, true, 0)
	expect(t, "create manager", st, kverr.OK)
	defer hookManagerDestroy(m)
	plain, st := hookManagerCreateCached(64, 4, false, 0)
	expect(t, "create manager without events", st, kverr.OK)
	defer hookManagerDestroy(plain)

	for _, c := range []struct {
		name string
		m    bool // the manager without events
		mut  func(*hookPubConfig)
		want kverr.Code
	}{
		{"NULL cfg", false, func(c *hookPubConfig) { c.nullCfg = true }, kverr.NullPointer},
		{"NULL out", false, func(c *hookPubConfig) { c.nullOut = true }, kverr.NullPointer},
		{"NULL endpoint", false, func(c *hookPubConfig) { c.endpoint = nil }, kverr.NullPointer},
		{"short struct", false, func(c *hookPubConfig) { c.structSize = 8 }, kverr.StructSize},
		{"garbage struct_size", false, func(c *hookPubConfig) { c.structSize = 1 << 20 }, kverr.StructSize},
		{"no events", true, func(c *hookPubConfig) {}, kverr.InvalidArgument},
		{"bad endpoint", false, func(c *hookPubConfig) { c.endpoint = strp("udp://x:1") }, kverr.InvalidArgument},
		{"bad replay endpoint", false, func(c *hookPubConfig) { c.replay = strp("tcp://noport") }, kverr.InvalidArgument},
		{"unterminated topic", false, func(c *hookPubConfig) { c.unterminatedTopic = true }, kverr.InvalidArgument},
		{"bind mode", false, func(c *hookPubConfig) { c.bind = 3 }, kverr.InvalidArgument},
		{"event format", false, func(c *hookPubConfig) { c.format = -1 }, kverr.InvalidArgument},
		{"hash format", false, func(c *hookPubConfig) { c.hash = 2 }, kverr.InvalidArgument},
		{"dp rank", false, func(c *hookPubConfig) { c.dpRank = -2 }, kverr.InvalidArgument},
		{"hwm", false, func(c *hookPubConfig) { c.hwm = -1 }, kverr.InvalidArgument},
		{"buffer steps", false, func(c *hookPubConfig) { c.bufferSteps = 1 << 30 }, kverr.InvalidArgument},
		{"flush interval", false, func(c *hookPubConfig) { c.flushUS = -5 }, kverr.InvalidArgument},
	} {
		cfg := loopbackPub()
		c.mut(&cfg)
		h := m
		if c.m {
			h = plain
		}
		p, st := hookPublisherCreate(h, cfg)
		expect(t, c.name, st, c.want)
		if p != nil {
			t.Fatalf("%s: a handle came back from a failed create", c.name)
		}
	}
	_, st = hookPublisherCreate(nil, loopbackPub())
	expect(t, "NULL manager", st, kverr.InvalidHandle)
	expect(t, "flush NULL", hookPublisherFlush(nil), kverr.InvalidHandle)
	expect(t, "resync manager handle", hookPublisherResync(m), kverr.InvalidHandle)
	_, st = hookPublisherStats(m, 0, false)
	expect(t, "stats of a manager handle", st, kverr.InvalidHandle)

	p, st := hookPublisherCreate(m, loopbackPub())
	expect(t, "create", st, kverr.OK)
	_, st = hookPublisherCreate(m, loopbackPub())
	expect(t, "second publisher on one manager", st, kverr.InvalidArgument)
	_, st = hookPublisherStats(p, 0, true)
	expect(t, "stats NULL out", st, kverr.NullPointer)
	_, st = hookPublisherStats(p, 12, false)
	expect(t, "stats short struct", st, kverr.StructSize)
	s, st := hookPublisherStats(p, 0, false)
	expect(t, "stats", st, kverr.OK)
	if s[5] == 0 || s[6] == 0 || s[3] != 1 {
		t.Fatalf("stats %v: ports or start snapshot missing", s)
	}
	// A bound port cannot be bound by another publisher.
	m2, _ := hookManagerCreateCached(8, 4, true, 0)
	defer hookManagerDestroy(m2)
	cfg := loopbackPub()
	cfg.endpoint = strp(fmt.Sprintf("tcp://127.0.0.1:%d", s[5]))
	_, st = hookPublisherCreate(m2, cfg)
	expect(t, "port in use", st, kverr.InvalidArgument)
	// Destroy given the manager's handle leaves it alone.
	hookPublisherDestroy(m)
	expect(t, "manager alive", hookManagerCheck(m), kverr.OK)
	hookPublisherDestroy(p)
	hookPublisherDestroy(p) // stale: a no-op
	hookPublisherDestroy(nil)
	expect(t, "flush destroyed", hookPublisherFlush(p), kverr.InvalidHandle)
	p, st = hookPublisherCreate(m, loopbackPub())
	expect(t, "create after destroy", st, kverr.OK)
	hookPublisherDestroy(p)
}

// The events of admissions reach a subscriber in vLLM's format, their
// hashes those core/prefix computes.
func TestPublisherPublishesAdmissions(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	m, st := hookManagerCreateCached(64, 4, true, 0)
	expect(t, "create manager", st, kverr.OK)
	defer hookManagerDestroy(m)
	cfg := loopbackPub()
	cfg.topic = strp("kv@i0@m")
	cfg.hash = 1
	cfg.dpRank = 2
	cfg.flushUS = 60_000_000 // published by flush only
	p, st := hookPublisherCreate(m, cfg)
	expect(t, "create", st, kverr.OK)
	defer hookPublisherDestroy(p)
	sub, _, _ := subscribe(t, p, "kv@i0")
	defer sub.Close()
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	keys := []hookKeys{{adapter: 5, salt: []byte("tenant")}}
	_, n, st := hookAdmit(m, []int64{1}, [][]int32{prompt}, keys)
	expect(t, "admit", st, kverr.OK)
	if n != 1 {
		t.Fatalf("admitted %d", n)
	}
	expect(t, "flush", hookPublisherFlush(p), kverr.OK)
	var stored *kvevents.DecodedEvent
	for stored == nil {
		msg, b := recvBatch(t, sub)
		if msg.Topic != "kv@i0@m" || b.DPRank == nil || *b.DPRank != 2 {
			t.Fatalf("topic %q dp rank %v", msg.Topic, b.DPRank)
		}
		for i := range b.Events {
			if b.Events[i].Kind == kvevents.KindStored {
				stored = &b.Events[i]
			}
		}
	}
	var hs prefix.Hasher
	want, err := hs.Chain(nil, prompt, 4, &prefix.Keys{Adapter: 5, Salt: []byte("tenant")})
	if err != nil {
		t.Fatal(err)
	}
	if len(stored.Hashes) != 2 || stored.Hashes[0] != kvevents.KeyOf(want[0], kvevents.HashInt64) || stored.Hashes[1] != kvevents.KeyOf(want[1], kvevents.HashInt64) {
		t.Fatalf("hashes %x, want %x", stored.Hashes, want)
	}
	if *stored.LoRAID != 5 || len(stored.Tokens) != 8 || stored.Tokens[7] != 8 {
		t.Fatalf("stored %+v", stored)
	}
	// Every snapshot subscribed asked for was taken before the admission's
	// batch was published: the count moves by the resync alone.
	before, _ := hookPublisherStats(p, 0, false)
	expect(t, "resync", hookPublisherResync(p), kverr.OK)
	deadline := time.Now().Add(5 * time.Second)
	var s [7]int64
	for {
		if s, _ = hookPublisherStats(p, 0, false); s[3] == before[3]+1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshots %d after a resync, %d before", s[3], before[3])
		}
		time.Sleep(time.Millisecond)
	}
	if s[0] < 1 || s[1] < 2 {
		t.Fatalf("stats %v", s)
	}
}

// data_parallel_rank -1: batches of two elements, as vLLM sent before it
// had a data-parallel rank; the default, 0, is sent as vLLM sends it.
func TestPublisherDPRank(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	for _, omit := range []bool{false, true} {
		m, st := hookManagerCreateCached(16, 4, true, 0)
		expect(t, "create manager", st, kverr.OK)
		cfg := loopbackPub()
		cfg.flushUS = 60_000_000
		if omit {
			cfg.dpRank = -1
		}
		p, st := hookPublisherCreate(m, cfg)
		expect(t, "create", st, kverr.OK)
		sub, msg, b := subscribe(t, p, "")
		if omit != (b.DPRank == nil) || (!omit && *b.DPRank != 0) || (omit && msg.Payload[0] != 0x92) {
			t.Fatalf("omit %v: rank %v, header %#x", omit, b.DPRank, msg.Payload[0])
		}
		sub.Close()
		hookPublisherDestroy(p)
		hookManagerDestroy(m)
	}
}

// subscribe connects a subscriber, to the topics that start with topic,
// to publisher p's endpoint (the port it bound, read from its stats) and
// returns it once p's batches reach it, with subscribed's last batch; the
// caller closes it.
func subscribe(t *testing.T, p unsafe.Pointer, topic string) (*kvevents.SubConn, kvevents.Message, *kvevents.Batch) {
	t.Helper()
	s, _ := hookPublisherStats(p, 0, false)
	sub, err := kvevents.DialSub(fmt.Sprintf("tcp://127.0.0.1:%d", s[5]), topic, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	msg, b := subscribed(t, p, sub)
	return sub, msg, b
}

// subscribed returns once publisher p's batches reach sub, with the last
// batch it read. ZMQ tells a subscriber nothing of its subscription's
// arrival, and a batch published before it arrives is not sent to it (the
// slow joiner); so this publishes snapshots (resync, flush) until one
// reaches sub, then reads up to the last one published: sub's next batch
// is the test's. Every batch after a received one is received too, in order.
func subscribed(t *testing.T, p unsafe.Pointer, sub *kvevents.SubConn) (kvevents.Message, *kvevents.Batch) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, _ := hookPublisherStats(p, 0, false)
		expect(t, "resync", hookPublisherResync(p), kverr.OK)
		expect(t, "flush", hookPublisherFlush(p), kverr.OK)
		last := waitBatches(t, p, s[0]+1) - 1
		_ = sub.SetDeadline(time.Now().Add(200 * time.Millisecond))
		msg, err := sub.Recv()
		if err == nil {
			for msg.Seq != last {
				msg, _ = recvBatch(t, sub)
			}
			b, err := kvevents.Decode(msg.Payload)
			if err != nil {
				t.Fatal(err)
			}
			return msg, b
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber: its subscription never arrived")
		}
	}
}

// waitBatches waits until publisher p has published n batches, and returns
// how many it has.
func waitBatches(t *testing.T, p unsafe.Pointer, n int64) int64 {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s, _ := hookPublisherStats(p, 0, false)
		if s[0] >= n {
			return s[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d batches published, %d expected", s[0], n)
		}
		time.Sleep(time.Millisecond)
	}
}

// recvBatch receives one message (within 5 s) and decodes its batch.
func recvBatch(t *testing.T, sub *kvevents.SubConn) (kvevents.Message, *kvevents.Batch) {
	t.Helper()
	_ = sub.SetDeadline(time.Now().Add(5 * time.Second))
	msg, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	b, err := kvevents.Decode(msg.Payload)
	if err != nil {
		t.Fatal(err)
	}
	return msg, b
}

// bind_mode keeps the header's meanings: 0 is vLLM's rule (a wildcard
// endpoint binds, a host and port connects), 1 binds, 2 connects.
func TestPublisherBindModes(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	subscriber := fmt.Sprintf("tcp://%s", ln.Addr())
	for _, c := range []struct {
		endpoint string
		bind     int32
		binds    bool
	}{
		{"tcp://*:0", 0, true},
		{subscriber, 0, false},
		{"tcp://127.0.0.1:0", 1, true},
		{subscriber, 2, false},
	} {
		m, st := hookManagerCreateCached(16, 4, true, 0)
		expect(t, "create manager", st, kverr.OK)
		cfg := loopbackPub()
		cfg.endpoint, cfg.bind = strp(c.endpoint), c.bind
		p, st := hookPublisherCreate(m, cfg)
		expect(t, fmt.Sprintf("create %s bind_mode %d", c.endpoint, c.bind), st, kverr.OK)
		s, _ := hookPublisherStats(p, 0, false)
		if (s[5] != 0) != c.binds {
			t.Errorf("%s bind_mode %d: pub_port %d, binds want %v", c.endpoint, c.bind, s[5], c.binds)
		}
		if !c.binds {
			// It dials the subscriber's bound socket.
			_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
			conn, err := ln.Accept()
			if err != nil {
				t.Fatalf("%s bind_mode %d: the publisher never connected: %v", c.endpoint, c.bind, err)
			}
			conn.Close()
		}
		hookPublisherDestroy(p)
		hookManagerDestroy(m)
	}
}
