package kvindex

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
)

// teeSource hands a manager's events to the publisher and applies them to
// an EventIndex: the instance's true set of cached blocks, as the index
// should end up with.
type teeSource struct {
	src   kvevents.Source
	mu    sync.Mutex
	truth *prefix.EventIndex
	err   error
}

func (s *teeSource) Drain() ([]prefix.Event, error) {
	// The lock spans the drain too: once the manager's queue reads empty, a
	// test that asks for keys() waits for these events to be in the truth,
	// rather than seeing the old truth equal to the old index and calling
	// the two converged.
	s.mu.Lock()
	defer s.mu.Unlock()
	evs, err := s.src.Drain()
	for _, ev := range evs {
		if e := s.truth.Apply(ev); e != nil && s.err == nil {
			s.err = e
		}
	}
	return evs, err
}

func (s *teeSource) Snapshot() error { return s.src.Snapshot() }

func (s *teeSource) keys() map[kvevents.Key]bool { return s.keysIn(prefix.MediumGPU) }

func (s *teeSource) keysIn(md prefix.Medium) map[kvevents.Key]bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[kvevents.Key]bool{}
	for _, h := range s.truth.HashesIn(md, nil) {
		out[kvevents.Key(h)] = true
	}
	return out
}

// engine is one instance: a manager and its publisher.
type engine struct {
	pool  *host.Pool
	name  string
	m     *kvmanager.Manager
	src   *teeSource
	pub   *kvevents.Publisher
	ports [2]int // PUB, ROUTER
	next  int64
}

// nopCopier accepts every batch: the tests' engines have no K/V to copy.
type nopCopier struct{}

func (nopCopier) Copy(kvmanager.CopyBatch) error { return nil }

func newEngine(t testing.TB, name string, blocks, bs int, ports [2]int, cfg kvevents.Config) *engine {
	return newTierEngine(t, name, blocks, bs, 0, ports, cfg)
}

// newTierEngine is newEngine with a host tier of hostSlots slots (none
// when 0) that demotes ahead up to all the GPU's blocks.
func newTierEngine(t testing.TB, name string, blocks, bs, hostSlots int, ports [2]int, cfg kvevents.Config) *engine {
	t.Helper()
	mc := kvmanager.Config{NumBlocks: blocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true}
	var pool *host.Pool
	if hostSlots > 0 {
		var err error
		pool, err = host.New(host.Config{Slots: hostSlots, BlockBytes: 8})
		if err != nil {
			t.Fatal(err)
		}
		mc.HostTier = &kvmanager.HostTier{Pool: pool, Copier: nopCopier{}, DemoteAhead: blocks}
	}
	m, err := kvmanager.New(mc)
	if err != nil {
		t.Fatal(err)
	}
	ms, err := kvevents.ManagerSource(m)
	if err != nil {
		t.Fatal(err)
	}
	e := &engine{name: name, m: m, pool: pool, src: &teeSource{src: ms, truth: prefix.NewEventIndex()}}
	cfg.Endpoint = fmt.Sprintf("tcp://127.0.0.1:%d", ports[0])
	cfg.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", ports[1])
	cfg.Bind = kvevents.BindListen
	cfg.Topic = "kv@" + name
	for try := 0; ; try++ {
		e.pub, err = kvevents.Start(e.src, cfg)
		if err == nil || try == 50 {
			break
		}
		time.Sleep(20 * time.Millisecond) // a restarted engine's old port may linger
	}
	if err != nil {
		t.Fatal(err)
	}
	e.ports = [2]int{e.pub.PubAddr().(*net.TCPAddr).Port, e.pub.ReplayAddr().(*net.TCPAddr).Port}
	return e
}

func (e *engine) close() { e.pub.Close() }

func (e *engine) instance() InstanceConfig {
	return InstanceConfig{
		Name:           e.name,
		Endpoint:       fmt.Sprintf("tcp://127.0.0.1:%d", e.ports[0]),
		ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", e.ports[1]),
		Topic:          "kv@" + e.name,
	}
}

// serve admits a prompt and finishes it at once: its blocks stay cached.
// A prompt that does not fit is skipped.
func (e *engine) serve(t testing.TB, prompt []int32, keys *prefix.Keys) {
	t.Helper()
	e.next++
	p := kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}
	if keys != nil {
		p.Keys = []prefix.Keys{*keys}
	}
	n, err := e.m.Admit([]int64{e.next}, p, nil)
	if err != nil {
		t.Fatal(err)
	}
	if e.pool != nil {
		// The admission's step: its flush comes before the forward pass
		// writes the new blocks, which are demotable from the next one.
		e.demote(t)
	}
	e.m.MarkComputed() // the step's forward pass: the blocks stay cached
	if n == 1 {
		if err := e.m.Remove([]int64{e.next}); err != nil {
			t.Fatal(err)
		}
	}
}

// demote runs a step's tier copies to completion: every cached block
// that no sequence holds goes to the host tier (as far as it has room).
func (e *engine) demote(t testing.TB) {
	t.Helper()
	tk, _, err := e.m.FlushCopies()
	if err != nil {
		t.Fatal(err)
	}
	if tk != 0 {
		if err := e.m.CompleteCopies(tk, false); err != nil {
			t.Fatal(err)
		}
	}
}

// matchTiers is the engine's own answer per tier (never counting the
// prompt's last token).
func (e *engine) matchTiers(t testing.TB, prompt []int32) kvmanager.TierMatch {
	out := make([]kvmanager.TierMatch, 1)
	if err := e.m.MatchTiers(kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}, out); err != nil {
		t.Fatal(err)
	}
	return out[0]
}

// match is the engine's own answer: its longest cached prefix in full
// blocks (the manager never counts a prompt's last token).
func (e *engine) match(t testing.TB, prompt []int32, keys *prefix.Keys) int {
	p := kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}
	if keys != nil {
		p.Keys = []prefix.Keys{*keys}
	}
	out := make([]kvmanager.MatchInfo, 1)
	if err := e.m.Match(p, false, out); err != nil {
		t.Fatal(err)
	}
	return int(out[0].Tokens)
}

// setOf returns the keys the backend holds for an instance on the GPU.
func setOf(t testing.TB, be Backend, inst string) map[kvevents.Key]bool {
	return setIn(t, be, inst, prefix.MediumGPU)
}

// setIn returns the keys the backend holds for an instance on medium md.
func setIn(t testing.TB, be Backend, inst string, md prefix.Medium) map[kvevents.Key]bool {
	t.Helper()
	out := map[kvevents.Key]bool{}
	switch b := be.(type) {
	case *flakyBackend:
		return setIn(t, b.Memory, inst, md)
	case *applyWatch:
		return setIn(t, b.Memory, inst, md)
	case *Memory:
		b.mu.RLock()
		for k, v := range b.sets[inst] {
			if v&(1<<md) != 0 {
				out[k] = true
			}
		}
		b.mu.RUnlock()
	case *Valkey:
		r, err := b.c.Do([][][]byte{{[]byte("SMEMBERS"), b.keyIn(inst, md)}})
		if err != nil {
			return nil
		}
		arr, _ := r[0].([]any)
		for _, m := range arr {
			var k kvevents.Key
			copy(k[:], m.([]byte))
			out[k] = true
		}
	}
	return out
}

func sameSet(a, b map[kvevents.Key]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

// waitConverged waits until the index holds every engine's true set and
// no instance is stale.
func waitConverged(t *testing.T, x *Index, engines []*engine, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok := true
		for _, e := range engines {
			e.pub.Flush()
		}
		for i, e := range engines {
			st := x.Status()
			// Pending events are not in the truth yet: wait for the drain.
			if e.m.PrefixStats().PendingEvents > 0 || st[indexOf(st, e.name)].Stale || !sameSet(setOf(t, x.be, e.name), e.src.keys()) ||
				!sameSet(setIn(t, x.be, e.name, prefix.MediumCPU), e.src.keysIn(prefix.MediumCPU)) {
				ok = false
				_ = i
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			for _, e := range engines {
				t.Logf("%s: index %d keys, truth %d", e.name, len(setOf(t, x.be, e.name)), len(e.src.keys()))
			}
			t.Fatalf("not converged after %v: %+v", within, x.Status())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// serveTrace serves n prompts round-robin over the engines: prompts of
// 100 tokens and up to extra more, each opening with one of tenants'
// system prompts.
func serveTrace(t *testing.T, es []*engine, r *rand.Rand, n, tenants, extra int) [][]int32 {
	t.Helper()
	var prompts [][]int32
	for i := range n {
		p := prompt(r, i%tenants, 100+r.Intn(extra))
		prompts = append(prompts, p)
		es[i%len(es)].serve(t, p, nil)
	}
	return prompts
}

// queryMatchesEngines queries the index for p and checks each instance's
// tokens against its engine's own match; it returns the scores and each
// engine's match.
func queryMatchesEngines(t *testing.T, x *Index, es []*engine, p []int32) ([]Score, []int) {
	t.Helper()
	scores, err := x.Query(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	wants := make([]int, len(es))
	for i, e := range es {
		want := e.match(t, p, nil)
		wants[i] = want
		// The engine's match stops before the prompt's last token; the
		// index counts every cached full block.
		if got := scores[i].Tokens; got != want && !(got == want+16 && got == len(p)/16*16 && len(p)%16 == 0) {
			t.Fatalf("%s: index says %d tokens, the engine %d (prompt of %d)", e.name, got, want, len(p))
		}
	}
	return scores, wants
}

// startIndex starts an index the test closes when it ends.
func startIndex(t *testing.T, cfg Config) *Index {
	t.Helper()
	x, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Close)
	return x
}

func indexOf(st []InstanceStatus, name string) int {
	for i, s := range st {
		if s.Name == name {
			return i
		}
	}
	return -1
}

func prompt(r *rand.Rand, sys int, n int) []int32 {
	out := make([]int32, 0, n)
	for i := range 64 { // a system prompt shared by a tenant's requests
		out = append(out, int32(sys*1000+i))
	}
	for len(out) < n {
		out = append(out, int32(r.Intn(30000)))
	}
	return out
}

func startEngines(t *testing.T, n int, blocks int) []*engine {
	t.Helper()
	var es []*engine
	for i := range n {
		e := newEngine(t, fmt.Sprintf("e%d", i), blocks, 16, [2]int{0, 0}, kvevents.Config{})
		t.Cleanup(e.close)
		es = append(es, e)
	}
	return es
}

func instancesOf(es []*engine) []InstanceConfig {
	var out []InstanceConfig
	for _, e := range es {
		out = append(out, e.instance())
	}
	return out
}

// The index follows three engines under eviction pressure and answers each
// instance's longest cached prefix as the engine itself does.
func TestIndexFollowsEngines(t *testing.T) {
	es := startEngines(t, 3, 64)
	x := startIndex(t, Config{Instances: instancesOf(es), BlockSize: 16})
	r := rand.New(rand.NewSource(1))
	prompts := serveTrace(t, es, r, 60, 4, 200)
	waitConverged(t, x, es, 10*time.Second)
	for _, p := range prompts {
		queryMatchesEngines(t, x, es, p)
	}
	// Keys: the same tokens under a salt are another prefix.
	salted := &prefix.Keys{Salt: []byte("tenant-b"), Adapter: 9}
	es[1].serve(t, prompts[0], salted)
	waitConverged(t, x, es, 10*time.Second)
	scores, err := x.Query(prompts[0], salted)
	if err != nil {
		t.Fatal(err)
	}
	if scores[1].Tokens != es[1].match(t, prompts[0], salted) || scores[1].Tokens == 0 || Best(scores) != "e1" {
		t.Fatalf("salted query %+v", scores)
	}
}

// An engine that restarts (a new manager, sequence numbers from 0) is
// followed: the index ends with the new engine's set.
func TestIndexInstanceRestart(t *testing.T) {
	es := startEngines(t, 2, 64)
	x := startIndex(t, Config{Instances: instancesOf(es)})
	r := rand.New(rand.NewSource(2))
	for i := range 20 {
		es[i%2].serve(t, prompt(r, i, 200), nil)
	}
	waitConverged(t, x, es, 10*time.Second)
	old := es[0]
	old.close()
	es[0] = newEngine(t, "e0", 64, 16, old.ports, kvevents.Config{})
	t.Cleanup(es[0].close)
	p := prompt(r, 99, 160)
	es[0].serve(t, p, nil)
	waitConverged(t, x, es, 10*time.Second)
	scores, _ := x.Query(p, nil)
	if scores[0].Tokens != 160 {
		t.Fatalf("after the restart: %+v", scores)
	}
	if st := x.Status(); st[0].Resyncs < 2 {
		t.Fatalf("the restart was not noticed: %+v", st[0])
	}
}

// Missed ranges: a gap the publisher still holds is replayed; an older one
// ends in a snapshot. Batches are handed to the instance directly, so the
// test chooses what the subscriber misses.
func TestIndexMissedRanges(t *testing.T) {
	e := newEngine(t, "e0", 256, 16, [2]int{0, 0}, kvevents.Config{BufferSteps: 4, FlushInterval: time.Minute})
	defer e.close()
	x, err := New(Config{}) // no subscriptions of its own
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	in := &instance{cfg: e.instance(), x: x, nextSeq: -1, stale: true}
	in.cfg.BlockSize = 16
	x.insts, x.byName[in.cfg.Name] = append(x.insts, in), in
	sub, err := kvevents.DialSub(in.cfg.Endpoint, "", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	recv := func() kvevents.Message {
		e.pub.Flush()
		_ = sub.SetDeadline(time.Now().Add(5 * time.Second))
		m, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	r := rand.New(rand.NewSource(3))
	// missThen has the engine publish missed batches the instance never
	// sees, then one more (a prompt under system prompt sys) it handles.
	missThen := func(missed, sys int) {
		for range missed {
			e.serve(t, prompt(r, r.Intn(1000), 64), nil)
			recv()
		}
		e.serve(t, prompt(r, sys, 64), nil)
		in.handle(recv())
	}
	in.handle(e.subscribed(t, sub)) // a snapshot
	if in.stale {
		t.Fatal("stale after a snapshot")
	}
	// Miss batches 1 and 2; batch 3 reveals the gap, replay fills it.
	missThen(3, 5000)
	if in.stale || in.gaps.Load() != 1 || in.replayed.Load() != 3 {
		t.Fatalf("replayable gap: stale %v gaps %d replayed %d", in.stale, in.gaps.Load(), in.replayed.Load())
	}
	if !sameSet(setOf(t, x.be, "e0"), e.src.keys()) {
		t.Fatal("the replayed gap left the set wrong")
	}
	// Miss more than the buffer holds: the instance goes stale, asks for a
	// snapshot and is whole again once it arrives.
	missThen(6, 6000)
	if !in.stale || in.snapshots.Load() != 1 {
		t.Fatalf("an unreplayable gap: stale %v snapshots %d", in.stale, in.snapshots.Load())
	}
	if sc, _ := x.Query(prompt(r, 6000, 64), nil); !sc[0].Stale || sc[0].Tokens != 0 {
		t.Fatalf("a stale instance scored %+v", sc[0])
	}
	in.handle(recv()) // the snapshot
	if in.stale || !sameSet(setOf(t, x.be, "e0"), e.src.keys()) {
		t.Fatal("the snapshot did not rebuild the set")
	}
	// Hostile or broken batches: counted, the instance resyncs, nothing
	// crashes.
	granted := e.pub.Stats().Snapshots
	for _, bad := range [][]byte{nil, {0xc1}, {0x92, 0xcb}, bytes.Repeat([]byte{0xdd, 0xff, 0xff, 0xff, 0xff}, 8)} {
		in.handle(kvevents.Message{Seq: in.nextSeq, Payload: bad})
	}
	if in.badBatches.Load() != 4 || !in.stale {
		t.Fatalf("bad batches %d, stale %v", in.badBatches.Load(), in.stale)
	}
	// A publisher grants one snapshot request a second and drops the rest,
	// so the resync's requests may all come too soon after the last
	// snapshot: ask until one is granted.
	deadline := time.Now().Add(10 * time.Second)
	for e.pub.Stats().Snapshots == granted {
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot granted in 10 s: %+v", e.pub.Stats())
		}
		time.Sleep(20 * time.Millisecond)
		in.requestSnapshot()
	}
	in.handle(recv())
	if in.stale || !sameSet(setOf(t, x.be, "e0"), e.src.keys()) {
		t.Fatal("no recovery after bad batches")
	}
}

// The Valkey backend under load, with the server restarted (and its data
// lost) in the middle: the index notices and converges back.
func TestIndexValkeyRestartUnderLoad(t *testing.T) {
	bin := redistest.Find(t)
	srv := redistest.Start(t, bin, 0)
	defer func() { srv.Stop() }()
	be, err := NewValkey(srv.Addr(), "kvtest", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	es := startEngines(t, 3, 128)
	x := startIndex(t, Config{Instances: instancesOf(es), Backend: be})
	r := rand.New(rand.NewSource(4))
	var mu sync.Mutex
	var served atomic.Int64
	load := func(n int, stop <-chan struct{}) {
		for i := 0; i < n || n < 0; i++ {
			select {
			case <-stop:
				return
			default:
			}
			mu.Lock()
			p := prompt(r, i%7, 100+r.Intn(300))
			mu.Unlock()
			es[i%3].serve(t, p, nil)
			served.Add(1)
		}
	}
	load(100, nil)
	waitConverged(t, x, es, 20*time.Second)
	// Load runs until the server has been stopped while the index wrote to
	// it and restarted, and has served more after that.
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		load(-1, stop)
	}()
	waitFor(t, "load before the stop", func() bool { return served.Load() >= 120 })
	errs := backendErrors(x)
	srv.Stop()
	waitFor(t, "the index failing to write", func() bool { return backendErrors(x) > errs })
	srv = redistest.Start(t, bin, srv.Port)
	after := served.Load()
	waitFor(t, "load after the restart", func() bool { return served.Load() >= after+50 })
	close(stop)
	<-done
	waitConverged(t, x, es, 20*time.Second)
	if be.Generation() == 0 {
		t.Fatal("the restart was not noticed")
	}
	p := prompt(r, 3, 300)
	es[2].serve(t, p, nil)
	waitConverged(t, x, es, 10*time.Second)
	if sc, err := x.Query(p, nil); err != nil || sc[2].Tokens != 288 || Best(sc) != "e2" {
		t.Fatalf("after the restart: %+v %v", sc, err)
	}
}

// waitFor polls cond until it holds, failing the test after 20 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 20 s for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func backendErrors(x *Index) int64 {
	var n int64
	for _, s := range x.Status() {
		n += s.BackendErrors
	}
	return n
}

// subscribed returns once e's batches reach sub, with the last batch it
// read. ZMQ tells a subscriber nothing of its subscription's arrival, and a
// batch published before it arrives is not sent to it (the slow joiner); so
// this publishes snapshots until one reaches sub, then reads up to the last
// one published. Every batch after a received one is received too, in order.
func (e *engine) subscribed(t *testing.T, sub *kvevents.SubConn) kvevents.Message {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := e.pub.Stats().Batches
		e.pub.Resync()
		waitFor(t, "the snapshot's batch", func() bool { return e.pub.Stats().Batches > n })
		last := e.pub.Stats().NextSeq - 1
		_ = sub.SetDeadline(time.Now().Add(200 * time.Millisecond))
		m, err := sub.Recv()
		if err == nil {
			for m.Seq != last {
				_ = sub.SetDeadline(time.Now().Add(5 * time.Second))
				if m, err = sub.Recv(); err != nil {
					t.Fatal(err)
				}
			}
			return m
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber: its subscription never arrived")
		}
	}
}

func TestHTTP(t *testing.T) {
	es := startEngines(t, 2, 64)
	x := startIndex(t, Config{Instances: instancesOf(es)})
	r := rand.New(rand.NewSource(5))
	p := prompt(r, 1, 100)
	keys := &prefix.Keys{Salt: []byte{1, 2}, MM: []prefix.MMItem{{Offset: 10, Length: 20, Hash: prefix.Hash{7}}}}
	es[1].serve(t, p, keys)
	waitConverged(t, x, es, 10*time.Second)
	srv := httptest.NewServer(x.Handler())
	defer srv.Close()
	body := fmt.Sprintf(`{"tokens": %s, "salt": "0102", "mm": [{"offset": 10, "length": 20, "hash": "%s"}]}`, jsonInts(p), prefix.Hash{7})
	resp, err := http.Post(srv.URL+"/v1/score", "application/json", bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	var qr QueryResponse
	if err := json.NewDecoder(resp.Body).Decode(&qr); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d, %v", resp.StatusCode, err)
	}
	resp.Body.Close()
	if qr.Best != "e1" || qr.Scores[1].Tokens != 96 || qr.Scores[0].Tokens != 0 {
		t.Fatalf("response %+v", qr)
	}
	if s := qr.Scores[1]; s.GPUTokens != 96 || s.CPUTokens != 0 || s.Score != 96 || qr.Weights != (Weights{CPU: 0.75, Shared: 0.25}) {
		t.Fatalf("response %+v", qr)
	}
	for _, bad := range []string{`{"tokens": [1], "salt": "zz"}`, `{"tokens": "x"}`, `{"tokenz": [1]}`,
		`{"tokens": [1], "mm": [{"offset": -1, "length": 1, "hash": "00000000000000000000000000000000"}]}`} {
		resp, err := http.Post(srv.URL+"/v1/score", "application/json", bytes.NewBufferString(bad))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s: status %d", bad, resp.StatusCode)
		}
	}
	resp, err = http.Get(srv.URL + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz %v %v", resp.StatusCode, err)
	}
	resp.Body.Close()
}

func jsonInts(v []int32) string {
	b, _ := json.Marshal(v)
	return string(b)
}
