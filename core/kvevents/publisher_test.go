package kvevents

import (
	"encoding/binary"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/testtok"
)

// indexSource is a prefix.Index behind a lock, as a manager holds one.
type indexSource struct {
	mu     sync.Mutex
	x      *prefix.Index
	nextID int32
	free   []int32 // evicted block ids, reused first
}

func newIndexSource(t testing.TB, blocks, bs int) *indexSource {
	t.Helper()
	x, err := prefix.New(prefix.Config{BlockSize: bs, NumBlocks: blocks, EnableEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	return &indexSource{x: x}
}

func (s *indexSource) Drain() ([]prefix.Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.x.DrainEvents(0), nil
}

func (s *indexSource) Snapshot() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.x.RequestSnapshot()
	return nil
}

// insert caches every full block of tokens under keys and unlocks them
// (evictable), returning their hashes.
func (s *indexSource) insert(t testing.TB, tokens []int32, keys *prefix.Keys) []prefix.Hash {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	bs := s.x.BlockSize()
	var parent prefix.Hash
	var out []prefix.Hash
	for i := 0; i+bs <= len(tokens); i += bs {
		id := s.nextID
		if len(s.free) > 0 {
			id = s.free[len(s.free)-1]
		}
		r, err := s.x.Insert(parent, tokens[i:i+bs], keys, id)
		if err != nil {
			t.Fatal(err)
		}
		if !r.Dup {
			if len(s.free) > 0 {
				s.free = s.free[:len(s.free)-1]
			} else {
				s.nextID++
			}
		}
		if err := s.x.Unlock([]int32{r.Block}); err != nil {
			t.Fatal(err)
		}
		parent = r.Hash
		out = append(out, r.Hash)
	}
	return out
}

func (s *indexSource) evict(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.free = s.x.Evict(s.free, n)
}

func seqTokens(start, n int) []int32 { return testtok.Iota(start, n) }

func startPub(t *testing.T, src Source, cfg Config) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
		cfg.Bind = BindListen
	}
	if cfg.FlushInterval == 0 {
		// Tests publish with Flush, after their subscriptions arrived.
		cfg.FlushInterval = time.Minute
	}
	p, err := Start(src, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func ep(a net.Addr) string { return "tcp://" + a.String() }

// recvBatch flushes p and receives and decodes one batch, failing after a
// timeout.
func recvBatch(t *testing.T, p *Publisher, s *SubConn) (Message, *Batch) {
	t.Helper()
	p.Flush()
	return recvDecoded(t, s)
}

// recvDecoded receives and decodes one batch, failing after a timeout.
func recvDecoded(t *testing.T, s *SubConn) (Message, *Batch) {
	t.Helper()
	_ = s.SetDeadline(time.Now().Add(5 * time.Second))
	m, err := s.Recv()
	if err != nil {
		t.Fatal(err)
	}
	b, err := Decode(m.Payload)
	if err != nil {
		t.Fatal(err)
	}
	return m, b
}

// subscribe connects and waits until the publisher has the subscription
// (a batch published before it arrives is not sent: ZMQ's slow joiner).
func subscribe(t *testing.T, p *Publisher, topic string) *SubConn {
	t.Helper()
	s, err := DialSub(ep(p.PubAddr()), topic, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	deadline := time.Now().Add(5 * time.Second)
	for {
		p.pub.mu.Lock()
		ok := false
		for pr := range p.pub.conns {
			ok = ok || pr.subscribed(topic)
		}
		p.pub.mu.Unlock()
		if ok {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatal("subscription never arrived")
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestPublishWireFormat(t *testing.T) {
	src := newIndexSource(t, 64, 4)
	p := startPub(t, src, Config{Topic: "kv@a@m", ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: Encoding{DPRank: -1}})
	s := subscribe(t, p, "kv@a")
	// The snapshot taken at start (an empty cache) is batch 0.
	m, b := recvBatch(t, p, s)
	if m.Topic != "kv@a@m" || m.Seq != 0 || len(b.Events) != 1 || b.Events[0].Kind != KindCleared || b.DPRank != nil {
		t.Fatalf("first batch: topic %q seq %d events %+v", m.Topic, m.Seq, b.Events)
	}
	mmHash := prefix.Hash{0xab}
	keys := &prefix.Keys{Adapter: 7, MM: []prefix.MMItem{{Offset: 2, Length: 5, Hash: mmHash}}}
	hs := src.insert(t, seqTokens(100, 12), keys)
	m, b = recvBatch(t, p, s)
	if m.Seq != 1 || len(b.Events) != 1 {
		t.Fatalf("batch 1: seq %d, %d events", m.Seq, len(b.Events))
	}
	ev := b.Events[0]
	if ev.Kind != KindStored || len(ev.Hashes) != 3 || ev.Parent != nil || ev.BlockSize != 4 || len(ev.Tokens) != 12 {
		t.Fatalf("stored event %+v", ev)
	}
	for i, h := range hs {
		if ev.Hashes[i] != Key(h) {
			t.Fatalf("hash %d: %x, want %x", i, ev.Hashes[i], h)
		}
	}
	if ev.Tokens[0] != 100 || ev.Tokens[11] != 111 || ev.LoRAID == nil || *ev.LoRAID != 7 || ev.Medium == nil || *ev.Medium != "GPU" || ev.LoRAName != nil {
		t.Fatalf("stored fields %+v", ev)
	}
	// The item spans positions 2..6: blocks 0 (offset 2) and 1 (offset -2).
	if len(ev.ExtraKeys) != 3 || ev.ExtraKeys[2] != nil {
		t.Fatalf("extra keys %#v", ev.ExtraKeys)
	}
	e1 := ev.ExtraKeys[1].([]any)[0].([]any)
	if e1[0] != mmHash.String() || e1[1] != int64(-2) {
		t.Fatalf("block 1's extra key %#v", e1)
	}
	src.evict(3)
	_, b = recvBatch(t, p, s)
	if len(b.Events) != 1 || b.Events[0].Kind != KindRemoved || len(b.Events[0].Hashes) != 3 || b.Events[0].Hashes[0] != Key(hs[2]) {
		t.Fatalf("removed batch %+v", b.Events)
	}
	if st := p.Stats(); st.Batches != 3 || st.NextSeq != 3 || st.Subscribers != 1 || st.BufferedSteps != 3 {
		t.Fatalf("stats %+v", st)
	}
}

func TestArrayFormatAndIntHashes(t *testing.T) {
	src := newIndexSource(t, 64, 2)
	p := startPub(t, src, Config{Encoding: Encoding{Format: FormatArray, Hashes: HashInt64, DPRank: 3, Medium: "CPU"}})
	s := subscribe(t, p, "")
	recvBatch(t, p, s)
	hs := src.insert(t, seqTokens(0, 4), nil)
	m, b := recvBatch(t, p, s)
	// Positional: [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name].
	if m.Payload[0] != 0x93 || b.DPRank == nil || *b.DPRank != 3 {
		t.Fatalf("batch header %x, dp rank %v", m.Payload[:2], b.DPRank)
	}
	ev := b.Events[0]
	if ev.HashFormat != HashInt64 || ev.Hashes[1] != KeyOf(hs[1], HashInt64) || *ev.Medium != "CPU" || ev.LoRAID != nil {
		t.Fatalf("event %+v", ev)
	}
	if binary.BigEndian.Uint64(ev.Hashes[0][8:]) != binary.BigEndian.Uint64(hs[0][8:]) {
		t.Fatal("int hash is not the hash's last 8 bytes")
	}
}

// TestTopicFilter publishes batches while subscribers of other topics are
// connected: none of those batches may reach them. The filter's test is
// that the first batch such a subscriber sees, once it also subscribes to
// the publisher's topic, is the one published after that; a batch that
// leaked before it would arrive first (each subscriber's stream is in
// order), so the check waits on no timeout.
func TestTopicFilter(t *testing.T) {
	src := newIndexSource(t, 16, 2)
	p := startPub(t, src, Config{Topic: "kv@b@m"})
	in := subscribe(t, p, "kv@b")
	// Another topic, and a topic of which the publisher's is only a prefix.
	var outs []*SubConn
	for _, topic := range []string{"kv@a", "kv@b@m@x"} {
		s, err := DialSub(ep(p.PubAddr()), topic, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		waitSubscribed(t, p, topic, 1)
		outs = append(outs, s)
	}
	m, _ := recvBatch(t, p, in) // the snapshot at start
	if m.Seq != 0 || m.Topic != "kv@b@m" {
		t.Fatalf("subscriber of the topic: first batch seq %d topic %q", m.Seq, m.Topic)
	}
	src.insert(t, seqTokens(0, 2), nil)
	if m, _ := recvBatch(t, p, in); m.Seq != 1 {
		t.Fatalf("subscriber of the topic: second batch seq %d", m.Seq)
	}
	// broadcast holds the server's lock while it queues a batch to every
	// peer, so once the lock is free batch 1 has been offered to all of
	// them; only then do the others subscribe to the topic too.
	p.pub.mu.Lock()
	p.pub.mu.Unlock()
	for _, s := range outs {
		if _, err := s.z.c.Write(appendMessage(nil, append([]byte{1}, "kv@b@m"...))); err != nil {
			t.Fatal(err)
		}
	}
	waitSubscribed(t, p, "kv@b@m", len(outs))
	src.insert(t, seqTokens(10, 2), nil)
	if m, _ := recvBatch(t, p, in); m.Seq != 2 {
		t.Fatalf("subscriber of the topic: third batch seq %d", m.Seq)
	}
	for i, s := range outs {
		_ = s.SetDeadline(time.Now().Add(5 * time.Second))
		m, err := s.Recv()
		if err != nil {
			t.Fatalf("subscriber %d: %v", i, err)
		}
		if m.Seq != 2 {
			t.Fatalf("subscriber %d of another topic received batch %d, published before it subscribed to %q", i, m.Seq, "kv@b@m")
		}
	}
	if st := p.Stats(); st.Batches != 3 || st.DroppedSends != 0 || st.Subscribers != 3 {
		t.Fatalf("stats %+v", st)
	}
}

// waitSubscribed waits until n of p's subscribers hold exactly topic in
// their subscriptions (read directly, not through the filter under test).
func waitSubscribed(t *testing.T, p *Publisher, topic string, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		p.pub.mu.Lock()
		got := 0
		for pr := range p.pub.conns {
			pr.mu.Lock()
			if _, ok := pr.topics[topic]; ok {
				got++
			}
			pr.mu.Unlock()
		}
		p.pub.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d subscriptions to %q arrived", got, n, topic)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

func TestReplayAndSnapshotRequest(t *testing.T) {
	src := newIndexSource(t, 64, 2)
	p := startPub(t, src, Config{Topic: "t", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 3})
	s := subscribe(t, p, "")
	recvBatch(t, p, s)
	for i := range 5 {
		src.insert(t, seqTokens(10*i, 2), nil)
		recvBatch(t, p, s)
	}
	// Batches 0..5 were published; the buffer keeps the last three.
	got, err := Replay(ep(p.ReplayAddr()), 1, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].Seq != 3 || got[2].Seq != 5 || got[0].Topic != "t" {
		t.Fatalf("replay from 1: %d batches %+v", len(got), got)
	}
	if b, err := Decode(got[2].Payload); err != nil || b.Events[0].Kind != KindStored {
		t.Fatalf("replayed payload: %v %v", b, err)
	}
	if got, err := Replay(ep(p.ReplayAddr()), 99, 5*time.Second); err != nil || len(got) != 0 {
		t.Fatalf("replay past the end: %v %v", got, err)
	}
	// The gap 1..2 is lost: ask for a snapshot, which comes on PUB.
	if err := RequestSnapshot(ep(p.ReplayAddr()), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	_, b := recvBatch(t, p, s)
	if b.Events[0].Kind != KindCleared {
		t.Fatalf("snapshot starts with %+v", b.Events[0])
	}
	stored := 0
	for _, e := range b.Events[1:] {
		stored += len(e.Hashes)
	}
	if stored != 5 {
		t.Fatalf("snapshot stores %d blocks, 5 cached", stored)
	}
	if st := p.Stats(); st.ReplayReqs != 3 || st.ReplayBatches != 3 || st.Snapshots != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// A subscriber that never reads costs a bounded queue, and its drops are
// counted; another subscriber still gets every batch (or replays what its
// own queue dropped); publishing goes on throughout.
func TestSlowSubscriberDropsCounted(t *testing.T) {
	const bs = 16384 // one block per batch, ~80 KB on the wire
	src := newIndexSource(t, 4, bs)
	p := startPub(t, src, Config{HWM: 4, MaxBatchEvents: 1, ReplayEndpoint: "tcp://127.0.0.1:0", FlushInterval: time.Millisecond})
	// The stalled subscriber: handshakes and subscribes, then never reads.
	stalled, err := DialSub(ep(p.PubAddr()), "", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	good := subscribe(t, p, "")
	const rounds = 300
	done := make(chan struct{})
	go func() {
		defer close(done)
		block := make([]int32, bs)
		for i := range rounds {
			for j := range block {
				block[j] = int32(1<<20 + i*bs + j)
			}
			src.insert(t, block, nil)
			src.evict(1)
		}
	}()
	seen := int64(-1) // the first batch received sets it
	deadline := time.Now().Add(60 * time.Second)
	finished := false
	for !finished {
		select {
		case <-done:
			// Read on until the publisher has sent the last event.
			finished = p.Stats().Events >= 2*rounds
		default:
		}
		_ = good.SetDeadline(time.Now().Add(200 * time.Millisecond))
		m, err := good.Recv()
		if err != nil {
			if !isTimeout(err) {
				t.Fatal(err)
			}
			continue
		}
		if seen >= 0 && m.Seq != seen+1 {
			// This reader may fall behind too: its gap must be replayable.
			rep, err := Replay(ep(p.ReplayAddr()), seen+1, 5*time.Second)
			if err != nil || len(rep) == 0 || rep[0].Seq != seen+1 {
				t.Fatalf("gap %d..%d not replayable: %v", seen+1, m.Seq, err)
			}
		}
		seen = m.Seq
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v after 60 s", p.Stats())
		}
	}
	for p.Stats().Events < 2*rounds && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	st := p.Stats()
	// What the good reader's own queue dropped at the end, it replays.
	if rep, err := Replay(ep(p.ReplayAddr()), seen+1, 5*time.Second); err != nil || (len(rep) > 0 && rep[len(rep)-1].Seq != st.NextSeq-1) {
		t.Fatalf("tail replay from %d: %d batches, %v (stats %+v)", seen+1, len(rep), err, st)
	}
	if st.Events < 2*rounds || st.DroppedSends == 0 {
		t.Fatalf("stats %+v: the stalled subscriber's drops are not counted", st)
	}
}

func TestConfigErrors(t *testing.T) {
	src := newIndexSource(t, 4, 1)
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "endpoint must be given"},
		{Config{Endpoint: "inproc://x"}, "only tcp://HOST:PORT and ipc:///PATH"},
		{Config{Endpoint: "tcp://nohostport"}, "missing port"},
		{Config{Endpoint: "tcp://127.0.0.1:0", HWM: -1}, "hwm"},
		{Config{Endpoint: "tcp://127.0.0.1:0", Bind: 5}, "bind mode"},
		{Config{Endpoint: "tcp://127.0.0.1:0", Topic: strings.Repeat("x", 2000)}, "topic"},
		{Config{Endpoint: "tcp://127.0.0.1:0", Encoding: Encoding{Format: 9}}, "event format"},
		{Config{Endpoint: "tcp://127.0.0.1:0", Encoding: Encoding{Hashes: 9}}, "hash format"},
	} {
		if _, err := Start(src, c.cfg); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err %v, want %q", c.cfg, err, c.want)
		}
	}
	// A taken port is an error, and nothing stays bound.
	p := startPub(t, src, Config{})
	_, err := Start(src, Config{Endpoint: ep(p.PubAddr()), Bind: BindListen})
	if err == nil || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("second bind: %v", err)
	}
	_, err = Start(src, Config{Endpoint: "tcp://127.0.0.1:0", Bind: BindListen, ReplayEndpoint: ep(p.PubAddr())})
	if err == nil {
		t.Fatal("a taken replay port was accepted")
	}
}

// Connect mode: the subscriber binds (as llm-d's indexer does) and the
// publisher dials it.
func TestConnectMode(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	src := newIndexSource(t, 8, 2)
	p := startPub(t, src, Config{Endpoint: "tcp://" + ln.Addr().String(), Bind: BindVLLM})
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	z, err := handshake(c, "SUB", true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(appendMessage(nil, []byte{1})); err != nil {
		t.Fatal(err)
	}
	s := &SubConn{z: z}
	defer s.Close()
	waitSubscribed(t, p, "", 1)
	src.insert(t, seqTokens(0, 2), nil)
	waitStored(t, p, s)
}

// Hostile peers: a huge announced frame, garbage, a wrong socket type; the
// publisher drops them and keeps serving.
func TestHostilePeers(t *testing.T) {
	src := newIndexSource(t, 8, 2)
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	for _, addr := range []net.Addr{p.PubAddr(), p.ReplayAddr()} {
		// Garbage instead of a greeting.
		c, err := net.Dial("tcp", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write([]byte(strings.Repeat("GET / HTTP/1.1\r\n", 8)))
		c.Close()
		// A valid handshake, then a frame announcing 2^62 bytes.
		c, err = net.Dial("tcp", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		typ := "SUB"
		if addr == p.ReplayAddr() {
			typ = "DEALER"
		}
		if _, err := handshake(c, typ, false); err != nil {
			t.Fatal(err)
		}
		hdr := []byte{flagLong, 0x40, 0, 0, 0, 0, 0, 0, 0}
		_, _ = c.Write(hdr)
		buf := make([]byte, 1)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		for {
			if _, err := c.Read(buf); err != nil {
				break // closed by the publisher
			}
		}
		c.Close()
		// A PUB peer where a SUB is expected.
		c, err = net.Dial("tcp", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := handshake(c, "PUB", false); err == nil && addr == p.PubAddr() {
			// The publisher refuses after READY; our side may succeed
			// first, then the connection is closed.
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Read(buf); err == nil {
				t.Fatal("a PUB peer was kept")
			}
		}
		c.Close()
	}
	s := subscribe(t, p, "")
	src.insert(t, seqTokens(0, 2), nil)
	waitStored(t, p, s)
}

// waitStored receives batches until one stores a block.
func waitStored(t *testing.T, p *Publisher, s *SubConn) {
	t.Helper()
	for {
		_, b := recvBatch(t, p, s)
		for _, e := range b.Events {
			if e.Kind == KindStored {
				return
			}
		}
	}
}

func TestCloseFlushesPending(t *testing.T) {
	src := newIndexSource(t, 8, 2)
	p := startPub(t, src, Config{FlushInterval: time.Minute})
	s := subscribe(t, p, "")
	src.insert(t, seqTokens(0, 2), nil)
	p.Close()
	_, b := recvDecoded(t, s)
	if b.Events[0].Kind != KindCleared {
		t.Fatalf("first %+v", b.Events)
	}
	// The start snapshot and the insert were pending together: one batch.
	if len(b.Events) != 2 || b.Events[1].Kind != KindStored {
		t.Fatalf("pending event not flushed at close: %+v", b.Events)
	}
}

// ipc:// endpoints are Unix sockets; a stale socket file of a dead
// process does not stop a new bind, and Close removes the file.
func TestIPCEndpoints(t *testing.T) {
	dir := t.TempDir()
	pubPath, repPath := dir+"/pub.sock", dir+"/replay.sock"
	stale, err := net.Listen("unix", pubPath)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close() // leaves the file, as a crashed process would
	src := newIndexSource(t, 8, 2)
	p, err := Start(src, Config{Endpoint: "ipc://" + pubPath, ReplayEndpoint: "ipc://" + repPath, FlushInterval: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	s, err := DialSub("ipc://"+pubPath, "", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitSubscribed(t, p, "", 1)
	src.insert(t, seqTokens(0, 2), nil)
	waitStored(t, p, s)
	if got, err := Replay("ipc://"+repPath, 0, 5*time.Second); err != nil || len(got) != 1 || got[0].Seq != 0 {
		t.Fatalf("replay over ipc: %v %v", got, err)
	}
	p.Close()
	if _, err := net.Dial("unix", pubPath); err == nil {
		t.Fatal("the socket is still served after Close")
	}
}
