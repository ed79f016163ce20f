package kvindex

import (
	"math"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
)

// eventually polls cond for up to d; whether it came to hold.
func eventually(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// leftSetCleared runs the sequence in which a writer index leaves an
// instance's set behind: writer 1 follows e0 into the backend, closes
// (a deploy, a crash), and e0 exits while no writer runs. Writer 2 then
// starts on the same backend and cannot reach e0: it must clear e0's set,
// or a read-only router of the backend keeps routing to the dead engine.
// newBE gives each index its own client of the one backend; held reads
// how many GPU blocks the backend holds for e0.
func leftSetCleared(t *testing.T, newBE func() Backend, held func() int) {
	e := newEngine(t, "e0", 64, 16, [2]int{0, 0}, kvevents.Config{})
	x1, err := New(Config{Instances: []InstanceConfig{e.instance()}, Backend: newBE()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x1.Close) // (closed below: a second Close does nothing)
	p := prompt(rand.New(rand.NewSource(1)), 1, 160)
	e.serve(t, p, nil)
	waitConverged(t, x1, []*engine{e}, 10*time.Second)
	x1.Close()
	e.close()
	if held() == 0 {
		t.Fatal("the first writer's set is gone before the second starts: the test shows nothing")
	}
	x2 := startIndex(t, Config{Instances: []InstanceConfig{e.instance()}, Backend: newBE()})
	reader, err := New(Config{Instances: []InstanceConfig{e.instance()}, Backend: newBE(), ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if !eventually(5*time.Second, func() bool { return held() == 0 }) {
		sc, _ := reader.Query(p, nil)
		t.Fatalf("writer 2 says %s, yet the backend still holds %d of e0's blocks: a reader scores %+v, best %q",
			x2.Status()[0].State, held(), sc[0], Best(sc))
	}
	if st := x2.Status()[0]; st.State != StateDown {
		t.Fatalf("writer 2: %+v", st)
	}
	if sc, err := reader.Query(p, nil); err != nil || sc[0].Tokens != 0 || sc[0].Score != 0 {
		t.Fatalf("a reader still routes to the dead engine: %+v %v", sc, err)
	}
}

// A writer index that starts while an instance is unreachable clears the
// set an earlier writer left for it in the shared backend: read-only
// routers stop routing to it, as they do when a running writer sees the
// instance go down.
func TestWriterStartClearsAnUnreachableInstancesLeftSet(t *testing.T) {
	mem := NewMemory()
	leftSetCleared(t, func() Backend { return mem }, func() int { return mem.Len("e0") })
}

// The same on a Valkey server, each index with its own client.
func TestWriterStartClearsAnUnreachableInstancesLeftSetValkey(t *testing.T) {
	bin := redistest.Find(t)
	srv := redistest.Start(t, bin, 0)
	defer srv.Stop()
	newBE := func() *Valkey {
		be, err := NewValkey(srv.Addr(), "recovery", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { be.Close() })
		return be
	}
	probe := newBE()
	leftSetCleared(t, func() Backend { return newBE() }, func() int {
		n, err := probe.Len("e0")
		if err != nil {
			t.Fatal(err)
		}
		return n
	})
}

// A Valkey server restarted from a copy of its data (an RDB) taken while
// an instance was up brings back the set the writer cleared when the
// instance went down; the writer clears it again, though the instance
// stays unreachable, so routers reading the server stop using it.
func TestDownInstanceSetClearedAgainAfterTheBackendRestarts(t *testing.T) {
	bin := redistest.Find(t)
	dir := t.TempDir()
	srv := redistest.Start(t, bin, 0, "--dir", dir, "--dbfilename", "recovery.rdb")
	defer func() { srv.Stop() }()
	be, err := NewValkey(srv.Addr(), "recovery", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	held := func() int {
		n, _ := be.Len("e0") // an error (the server restarting) reads as 0: cond checks again
		return n
	}
	e := newEngine(t, "e0", 64, 16, [2]int{0, 0}, kvevents.Config{})
	x := startIndex(t, Config{Instances: []InstanceConfig{e.instance()}, Backend: be})
	p := prompt(rand.New(rand.NewSource(1)), 1, 160)
	e.serve(t, p, nil)
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	redistest.Cmd(t, srv.Addr(), "SET", "recovery:marker", "1")
	redistest.Cmd(t, srv.Addr(), "SAVE")
	e.close()
	waitState(t, x, "e0", StateDown)
	waitFor(t, "the down instance's set cleared", func() bool { return held() == 0 })
	srv.Stop()
	srv = redistest.Start(t, bin, srv.Port, "--dir", dir, "--dbfilename", "recovery.rdb")
	if v, ok := redistest.Cmd(t, srv.Addr(), "GET", "recovery:marker").([]byte); !ok || string(v) != "1" {
		t.Fatalf("the server did not load its RDB (marker %v): the test shows nothing", v)
	}
	if !eventually(8*time.Second, func() bool {
		n, err := be.Len("e0")
		return err == nil && n == 0
	}) {
		t.Fatalf("the restarted server holds %d blocks of the down instance (generation %d, writer says %s)",
			held(), be.Generation(), x.Status()[0].State)
	}
	rbe, err := NewValkey(srv.Addr(), "recovery", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer rbe.Close()
	reader, err := New(Config{Instances: []InstanceConfig{e.instance()}, Backend: rbe, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if sc, err := reader.Query(p, nil); err != nil || sc[0].Tokens != 0 || sc[0].Score != 0 {
		t.Fatalf("a reader routes to the down instance: %+v %v", sc, err)
	}
	if st := x.Status()[0]; st.State != StateDown {
		t.Fatalf("writer: %+v", st)
	}
}

// chainEvents returns a snapshot (AllCleared and toks' blocks of 16) and
// the blocks' hashes.
func chainEvents(toks []int32) ([]prefix.Event, []prefix.Hash) {
	var h prefix.Hasher
	hs, _ := h.Chain(nil, toks, 16, nil)
	evs := []prefix.Event{{Kind: prefix.AllCleared}}
	var parent prefix.Hash
	for i, hh := range hs {
		evs = append(evs, prefix.Event{Kind: prefix.BlockStored, Hash: hh, Parent: parent, Tokens: toks[i*16 : (i+1)*16], BlockSize: 16})
		parent = hh
	}
	return evs, hs
}

// A batch numbered 2^63-1, or past it (read as negative), is a faulty
// publisher's: the index never applies it, so the next batch number
// cannot wrap and leave the instance fresh while it passes over every
// batch but snapshots (deaf to evictions). It is counted as a bad batch
// and the instance is stale, of either kind of engine, until its
// publisher's sequence restarts.
func TestSequenceNumberPastTheEndIsAPublisherFault(t *testing.T) {
	enc := kvevents.NewEncoder(kvevents.Encoding{DPRank: -1})
	batch := func(seq int64, evs []prefix.Event) kvevents.Message {
		return kvevents.Message{Seq: seq, Payload: append([]byte(nil), enc.Encode(0, evs)...)}
	}
	toks := make([]int32, 32)
	for i := range toks {
		toks[i] = int32(i + 7)
	}
	snap, hs := chainEvents(toks)
	removal := []prefix.Event{{Kind: prefix.BlockRemoved, Hashes: hs}}

	t.Run("kvplug", func(t *testing.T) {
		mem := NewMemory()
		x, err := New(Config{Instances: []InstanceConfig{{Name: "e0", Endpoint: "tcp://127.0.0.1:1"}}, ReadOnly: true, Backend: mem})
		if err != nil {
			t.Fatal(err)
		}
		in := x.insts[0]
		in.stale, in.nextSeq = true, -1 // connected, waiting for its snapshot
		in.handle(batch(math.MaxInt64, snap))
		in.handle(batch(math.MinInt64, removal)) // 2^63 on the wire: the batch after
		sc, _ := x.Query(toks, nil)
		st := x.Status()[0]
		if sc[0].State != StateStale || sc[0].Tokens != 0 || mem.Len("e0") != 0 {
			t.Fatalf("after a snapshot numbered 2^63-1 and the batch after it: %+v, %d blocks held, next seq %d",
				sc[0], mem.Len("e0"), st.NextSeq)
		}
		if st.BadBatches != 2 || !strings.Contains(st.LastError, "sequence number") {
			t.Fatalf("status %+v", st)
		}
		// The publisher restarts: its snapshot, numbered 0, starts the set.
		in.handle(batch(0, snap))
		if sc, _ := x.Query(toks, nil); sc[0].State != StateFresh || sc[0].Tokens != 32 {
			t.Fatalf("after the publisher's restart: %+v", sc[0])
		}
		// A fresh set is cleared by a batch numbered past the end.
		in.handle(batch(-5, removal))
		if sc, _ := x.Query(toks, nil); sc[0].State != StateStale || mem.Len("e0") != 0 || x.Status()[0].Resyncs != 1 {
			t.Fatalf("a fresh instance after a batch numbered 2^64-5: %+v, %d blocks held, status %+v", sc[0], mem.Len("e0"), x.Status()[0])
		}
	})

	t.Run("foreign", func(t *testing.T) {
		mem := NewMemory()
		x, in := foreignInstance(t, mem, "")
		stored := snap[1:] // a vLLM publisher's stores (the index's hashes as its names)
		in.handle(batch(0, stored))
		if sc, _ := x.Query(toks, nil); sc[0].State != StateFresh || sc[0].Tokens != 32 {
			t.Fatalf("before: %+v", sc[0])
		}
		in.handle(batch(math.MaxInt64, removal))
		in.handle(batch(math.MinInt64, stored))
		sc, _ := x.Query(toks, nil)
		if st := x.Status()[0]; sc[0].State != StateStale || mem.Len("v0") != 0 || st.BadBatches != 2 || st.TranslatedBlocks != 0 {
			t.Fatalf("after batches numbered 2^63-1 and 2^63: %+v, %d blocks held, status %+v", sc[0], mem.Len("v0"), st)
		}
		in.handle(batch(0, stored))
		if sc, _ := x.Query(toks, nil); sc[0].State != StateFresh || sc[0].Tokens != 32 {
			t.Fatalf("after the publisher's restart: %+v", sc[0])
		}
	})
}

// foreignInstance adds a vLLM instance at endpoint (a closed one when "")
// to a new index on be that subscribes to nothing: the test hands it its
// batches, as run would after connecting.
func foreignInstance(t *testing.T, be Backend, replay string) (*Index, *instance) {
	t.Helper()
	x, err := New(Config{Backend: be})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Close)
	in := &instance{cfg: InstanceConfig{Name: "v0", Endpoint: "tcp://127.0.0.1:1", ReplayEndpoint: replay, BlockSize: 16, Engine: EngineVLLM},
		x: x, nextSeq: -1, xl: newTranslator(16), format: kvevents.HashBytes}
	x.insts, x.byName["v0"] = append(x.insts, in), in
	in.resync("connected") // what run does on connecting
	return x, in
}

// scriptedSource is a Source whose events the test pushes, and which
// sends no snapshots (as vLLM's publisher).
type scriptedSource struct {
	mu  sync.Mutex
	evs []prefix.Event
}

func (s *scriptedSource) push(evs ...prefix.Event) {
	s.mu.Lock()
	s.evs = append(s.evs, evs...)
	s.mu.Unlock()
}

func (s *scriptedSource) Drain() ([]prefix.Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.evs
	s.evs = nil
	return out, nil
}

func (s *scriptedSource) Snapshot() error { return nil }

// queryOnApply runs after each Apply once it is set.
type queryOnApply struct {
	*Memory
	after func()
}

func (q *queryOnApply) Apply(inst string, ops []Op) error {
	err := q.Memory.Apply(inst, ops)
	if q.after != nil {
		q.after()
	}
	return err
}

// A vLLM/SGLang instance that starts its set from a batch past 0 replays
// its publisher's earlier batches first: they store blocks the engine
// evicted later in the stream, so the instance is stale until the replay
// reaches the batch it started from, and fresh once that batch is
// applied, as it is when the earlier batches are gone (joined mid-stream).
func TestForeignCatchUpReplayIsNotScored(t *testing.T) {
	src := &scriptedSource{}
	pub, err := kvevents.Start(src, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", FlushInterval: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	publish := func(evs ...prefix.Event) {
		n := pub.Stats().NextSeq
		src.push(evs...)
		pub.Flush()
		waitFor(t, "the batch published", func() bool { return pub.Stats().NextSeq > n })
	}
	evicted := make([]int32, 32)
	for i := range evicted {
		evicted[i] = int32(1000 + i)
	}
	stored, hs := chainEvents(evicted) // the index's hashes serve as the engine's names
	publish(stored[1:]...)
	publish(prefix.Event{Kind: prefix.BlockRemoved, Hashes: []prefix.Hash{hs[1], hs[0]}})
	live := make([]int32, 16)
	liveEvs, _ := chainEvents(live)
	publish(liveEvs[1:]...)
	msgs, err := kvevents.Replay("tcp://"+pub.ReplayAddr().String(), 0, time.Second)
	if err != nil || len(msgs) != 3 {
		t.Fatalf("replay: %d batches, %v", len(msgs), err)
	}

	for _, replay := range []bool{true, false} {
		be := &queryOnApply{Memory: NewMemory()}
		ep := ""
		if replay {
			ep = "tcp://" + pub.ReplayAddr().String()
		}
		x, in := foreignInstance(t, be, ep)
		var states []State
		be.after = func() {
			sc, _ := x.Query(evicted, nil)
			states = append(states, sc[0].State)
			if sc[0].State == StateFresh && sc[0].Tokens > 0 {
				t.Errorf("replay %v: fresh, scoring %d tokens of blocks the engine evicted before batch 2", replay, sc[0].Tokens)
			}
		}
		in.handle(msgs[2]) // the first live batch the index sees
		be.after = nil
		sc, _ := x.Query(live, nil)
		st := x.Status()[0]
		if sc[0].State != StateFresh || sc[0].Tokens != 16 || st.NextSeq != 3 {
			t.Fatalf("replay %v: after catching up: %+v, status %+v", replay, sc[0], st)
		}
		if sc, _ := x.Query(evicted, nil); sc[0].Tokens != 0 {
			t.Fatalf("replay %v: the evicted blocks are scored: %+v", replay, sc[0])
		}
		if replay && (st.Replayed != 2 || st.JoinedMidStream != 0 || !slicesContain(states, StateStale)) {
			t.Fatalf("replayed: status %+v, states seen at each apply %v", st, states)
		}
		if !replay && st.JoinedMidStream != 1 {
			t.Fatalf("joined mid-stream: status %+v", st)
		}
	}
}

func slicesContain(s []State, v State) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// A vLLM/SGLang BlockStored that names its LoRA adapter only by lora_name
// (lora_id None, which vLLM marks deprecated) is not indexed: without the
// id no query finds the adapter's blocks, and indexed without it they
// would pass for the base model's, routing base-model prompts to an
// engine that holds only the adapter's. It is counted untranslated, the
// instance's error saying why; with its lora_id it is the adapter's.
func TestForeignLoRABlockWithoutItsIDIsNotIndexed(t *testing.T) {
	toks := make([]int32, 16)
	for i := range toks {
		toks[i] = int32(i + 5)
	}
	name := "ad-7"
	ev := func(id *int64) kvevents.DecodedEvent {
		return kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(1)},
			Tokens: i64s(toks), BlockSize: 16, LoRAID: id, LoRAName: &name, ExtraKeys: []any{[]any{name}}}
	}
	var h prefix.Hasher
	base, _ := h.Chain(nil, toks, 16, nil)
	adapter, _ := h.Chain(nil, toks, 16, &prefix.Keys{Adapter: 7})

	zero := int64(0)
	for _, id := range []*int64{nil, &zero} {
		e := ev(id)
		if k, skipped := newTranslator(16).stored(&e, prefix.MediumGPU); len(k) != 0 || skipped != 1 {
			t.Fatalf("lora_id %v: translated %x (the base model's %x), skipped %d", id, k, kvevents.Key(base[0]), skipped)
		}
	}
	seven := int64(7)
	e := ev(&seven)
	if k, skipped := newTranslator(16).stored(&e, prefix.MediumGPU); len(k) != 1 || k[0] != kvevents.Key(adapter[0]) || skipped != 0 {
		t.Fatalf("lora_id 7: translated %x, want the adapter's %x", k, kvevents.Key(adapter[0]))
	}

	// Through an instance: counted, and said.
	x, in := foreignInstance(t, NewMemory(), "")
	if !in.applyBatch(0, &kvevents.Batch{Events: []kvevents.DecodedEvent{ev(nil)}}, false) {
		t.Fatal("batch refused")
	}
	st := x.Status()[0]
	if st.Untranslated != 1 || st.TranslatedBlocks != 0 || !strings.Contains(st.LastError, "lora_id") || !strings.Contains(st.LastError, name) {
		t.Fatalf("status %+v", st)
	}
	if sc, _ := x.Query(toks, nil); sc[0].Tokens != 0 {
		t.Fatalf("a base-model prompt scores the adapter's block: %+v", sc[0])
	}
}
