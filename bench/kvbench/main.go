// Command kvbench measures the KV event path: what publishing costs an
// engine's scheduler step and how many events a publisher sends; how many
// events per second the cluster prefix index applies (in memory and into
// Valkey/Redis); and the latency of an index query for a 4096-token prompt
// over 16 instances.
//
//	go run ./bench/kvbench [-valkey host:port] [-steps 2000]
package main

import (
	"flag"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvindex"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbench:", err)
		os.Exit(1)
	}
}

func pct(d []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func mean(d []time.Duration) time.Duration {
	var t time.Duration
	for _, x := range d {
		t += x
	}
	return t / time.Duration(len(d))
}

// steps runs a scheduler loop on a manager: each step admits 4 new
// requests (512-token prompts, half of them sharing a 256-token prefix),
// grows 64 running ones by one token each (with the tokens) and finishes
// the 4 oldest; it returns each step's duration and the events produced.
type stepper struct {
	m       *kvmanager.Manager
	r       *rand.Rand
	running []int64
	next    int64
}

func (s *stepper) steps(steps int) []time.Duration {
	m, r := s.m, s.r
	shared := make([]int32, 256)
	for i := range shared {
		shared[i] = int32(i)
	}
	running, next := s.running, s.next
	defer func() { s.running, s.next = running, next }()
	out := make([]time.Duration, 0, steps)
	prompts := make([]int32, 0, 4*512)
	offs := make([]int64, 5)
	ids := make([]int64, 4)
	ones := make([]int32, 0, 128)
	toks := make([]int32, 0, 128)
	for range steps {
		prompts = prompts[:0]
		for i := range 4 {
			if i%2 == 0 {
				prompts = append(prompts, shared...)
			} else {
				for range 256 {
					prompts = append(prompts, int32(r.Intn(32000)))
				}
			}
			for range 256 {
				prompts = append(prompts, int32(r.Intn(32000)))
			}
			offs[i+1] = int64(len(prompts))
			ids[i] = next
			next++
		}
		ones, toks = ones[:0], toks[:0]
		for range running {
			ones = append(ones, 1)
			toks = append(toks, int32(r.Intn(32000)))
		}
		start := time.Now()
		n, err := m.Admit(ids, kvmanager.Prompts{Tokens: prompts, Offsets: offs}, nil)
		must(err)
		if len(running) > 0 {
			must(m.GrowTokens(running, ones, toks))
		}
		running = append(running, ids[:n]...)
		m.MarkComputed() // the step's forward pass
		if len(running) > 64 {
			must(m.Remove(running[:len(running)-64]))
			running = append(running[:0], running[len(running)-64:]...)
		}
		out = append(out, time.Since(start))
	}
	return out
}

// timedSource times each drain: the time the engine's calls may wait for
// the manager's lock because of the publisher.
type timedSource struct {
	kvevents.Source
	mu sync.Mutex
	d  []time.Duration
}

func (s *timedSource) Drain() ([]prefix.Event, error) {
	t0 := time.Now()
	evs, err := s.Source.Drain()
	if len(evs) > 0 {
		s.mu.Lock()
		s.d = append(s.d, time.Since(t0))
		s.mu.Unlock()
	}
	return evs, err
}

func newManager(events bool) *kvmanager.Manager {
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 8192, BlockSize: 16, EnablePrefixCache: true, EnableKVEvents: events})
	must(err)
	return m
}

// benchPublish: the engine's step time with events off, and with a
// publisher (one subscriber reading) on, in alternating rounds so that
// drift of the machine hits both alike; events per second published.
func benchPublish(steps int) {
	mOff := newManager(false)
	m := newManager(true)
	ms, err := kvevents.ManagerSource(m)
	must(err)
	src := &timedSource{Source: ms}
	pub, err := kvevents.Start(src, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: kvevents.BindListen, ReplayEndpoint: "tcp://127.0.0.1:0"})
	must(err)
	sub, err := kvevents.DialSub("tcp://"+pub.PubAddr().String(), "", time.Second)
	must(err)
	var received atomic.Int64
	go func() {
		for {
			_ = sub.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := sub.Recv(); err != nil {
				return
			}
			received.Add(1)
		}
	}()
	time.Sleep(100 * time.Millisecond)
	sOff := &stepper{m: mOff, r: rand.New(rand.NewSource(1))}
	sOn := &stepper{m: m, r: rand.New(rand.NewSource(1))}
	var off, on []time.Duration
	var wall time.Duration
	const rounds = 10
	sOff.steps(100) // warm up
	sOn.steps(100)
	for range rounds {
		off = append(off, sOff.steps(steps/rounds)...)
		t0 := time.Now()
		on = append(on, sOn.steps(steps/rounds)...)
		wall += time.Since(t0)
	}
	pub.Flush()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st := pub.Stats(); st.NextSeq > 0 && received.Load() >= st.NextSeq-st.DroppedSends && m.PrefixStats().PendingEvents == 0 {
			break
		}
	}
	st := pub.Stats()
	pub.Close()
	sub.Close()
	fmt.Printf("engine step (admit 4 x 512 tokens, grow 64 by one token, finish 4), %d steps each:\n", len(on))
	fmt.Printf("  events off:            mean %v  p50 %v  p99 %v\n", mean(off), pct(off, 0.5), pct(off, 0.99))
	fmt.Printf("  publisher on:          mean %v  p50 %v  p99 %v\n", mean(on), pct(on, 0.5), pct(on, 0.99))
	fmt.Printf("  added per step:        mean %v  p50 %v  p99 %v\n", mean(on)-mean(off), pct(on, 0.5)-pct(off, 0.5), pct(on, 0.99)-pct(off, 0.99))
	src.mu.Lock()
	fmt.Printf("  the publisher's drains (the manager's lock held): %d, mean %v  p99 %v  max %v\n",
		len(src.d), mean(src.d), pct(src.d, 0.99), pct(src.d, 1))
	src.mu.Unlock()
	fmt.Printf("  published: %d events in %d batches (%.1f MB; subscriber received %d batches, drops %d) during %.2f s of steps: %.0f events/s\n",
		st.Events, st.Batches, float64(st.Bytes)/1e6, received.Load(), st.DroppedSends, wall.Seconds(), float64(st.Events)/wall.Seconds())

	// Throughput: as fast as the manager produces events: prompts of 256
	// blocks of 16 tokens, cached, then evicted by the next ones.
	m2, err := kvmanager.New(kvmanager.Config{NumBlocks: 1 << 16, BlockSize: 16, EnablePrefixCache: true, EnableKVEvents: true})
	must(err)
	src2, err := kvevents.ManagerSource(m2)
	must(err)
	pub2, err := kvevents.Start(src2, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: kvevents.BindListen})
	must(err)
	r := rand.New(rand.NewSource(2))
	prompt := make([]int32, 16*256)
	t0 := time.Now()
	for i := int64(0); time.Since(t0) < 3*time.Second; i++ {
		for j := range prompt {
			prompt[j] = int32(r.Intn(32000))
		}
		_, err := m2.Admit([]int64{i}, kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}, nil)
		must(err)
		m2.MarkComputed()
		must(m2.Remove([]int64{i}))
	}
	pub2.Flush()
	time.Sleep(300 * time.Millisecond)
	wall = time.Since(t0)
	st = pub2.Stats()
	pub2.Close()
	fmt.Printf("  publisher throughput (no subscriber; 256-block prompts admitted and evicted): %.0f events/s, %.0f batches/s, %.1f MB/s\n",
		float64(st.Events)/wall.Seconds(), float64(st.Batches)/wall.Seconds(), float64(st.Bytes)/1e6/wall.Seconds())
}

// benchIndexUpdates: events per second the index applies end to end
// (publisher -> ZMQ -> decode -> backend), and the backend alone.
func benchIndexUpdates(name string, be kvindex.Backend) {
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 1 << 16, BlockSize: 16, EnablePrefixCache: true, EnableKVEvents: true})
	must(err)
	src, err := kvevents.ManagerSource(m)
	must(err)
	pub, err := kvevents.Start(src, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", Bind: kvevents.BindListen, ReplayEndpoint: "tcp://127.0.0.1:0", HWM: 1 << 20})
	must(err)
	x, err := kvindex.New(kvindex.Config{Backend: be, Instances: []kvindex.InstanceConfig{{Name: "e0",
		Endpoint: "tcp://" + pub.PubAddr().String(), ReplayEndpoint: "tcp://" + pub.ReplayAddr().String()}}})
	must(err)
	for x.Status()[0].Stale {
		time.Sleep(time.Millisecond)
	}
	r := rand.New(rand.NewSource(3))
	prompt := make([]int32, 16*256)
	var produced int64
	t0 := time.Now()
	for i := int64(0); time.Since(t0) < 3*time.Second; i++ {
		for j := range prompt {
			prompt[j] = int32(r.Intn(32000))
		}
		_, err := m.Admit([]int64{i}, kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}, nil)
		must(err)
		m.MarkComputed()
		must(m.Remove([]int64{i}))
		produced += 256
		// Keep the producer within reach of the index: the figure is the
		// index's rate, not the size of a backlog.
		for produced-x.Updates() > 1<<16 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	pub.Flush()
	for deadline := time.Now().Add(30 * time.Second); x.Status()[0].NextSeq < pub.Stats().NextSeq && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	wall := time.Since(t0)
	st := x.Status()[0]
	blocks := pub.Stats().Events
	fmt.Printf("  %s: %d blocks stored or removed through publisher, ZMQ and index in %.2f s: %.0f block updates/s (%d batches, %d gaps, %d resyncs)\n",
		name, blocks, wall.Seconds(), float64(blocks)/wall.Seconds(), st.Batches, st.Gaps, st.Resyncs-1)
	x.Close()
	pub.Close()
	// The backend alone: batches of 256 new keys then their removal.
	keys := make([]kvevents.Key, 256)
	n := 0
	t0 = time.Now()
	for time.Since(t0) < 2*time.Second {
		for i := range keys {
			r.Read(keys[i][:])
		}
		must(be.Apply("bench", []kvindex.Op{{Kind: kvindex.OpAdd, Keys: keys}}))
		must(be.Apply("bench", []kvindex.Op{{Kind: kvindex.OpRemove, Keys: keys}}))
		n += 512
	}
	fmt.Printf("  %s backend alone (Apply of 256-key batches): %.0f key updates/s\n", name, float64(n)/time.Since(t0).Seconds())
}

// benchQuery: a 4096-token prompt over 16 instances, each holding a
// different share of it.
func benchQuery(name string, be kvindex.Backend) {
	r := rand.New(rand.NewSource(4))
	prompt := make([]int32, 4096)
	for i := range prompt {
		prompt[i] = int32(r.Intn(32000))
	}
	var h prefix.Hasher
	hs, err := h.Chain(nil, prompt, 16, nil)
	must(err)
	// An index with 16 instances and no subscriptions: the sets are
	// written directly, each instance holding the first 16*i blocks and
	// 10000 other blocks.
	var cfgs []kvindex.InstanceConfig
	for i := range 16 {
		name := fmt.Sprintf("q%d", i)
		keys := make([]kvevents.Key, 0, 10000+len(hs))
		for j := range hs[:16*i] {
			keys = append(keys, kvevents.Key(hs[j]))
		}
		for range 10000 {
			var k kvevents.Key
			r.Read(k[:])
			keys = append(keys, k)
		}
		must(be.Apply(name, []kvindex.Op{{Kind: kvindex.OpClear}, {Kind: kvindex.OpAdd, Keys: keys}}))
		cfgs = append(cfgs, kvindex.InstanceConfig{Name: name, Endpoint: "tcp://127.0.0.1:1"})
	}
	x, err := kvindex.New(kvindex.Config{Backend: be, Instances: cfgs, ReadOnly: true})
	must(err)
	var lat []time.Duration
	for range 2000 {
		t0 := time.Now()
		sc, err := x.Query(prompt, nil)
		lat = append(lat, time.Since(t0))
		must(err)
		if sc[15].Blocks != 240 || sc[3].Blocks != 48 {
			must(fmt.Errorf("query answered %+v", sc))
		}
	}
	t0 := time.Now()
	for range 200 {
		_, err := h.Chain(hs[:0], prompt, 16, nil)
		must(err)
	}
	hashing := time.Since(t0) / 200
	fmt.Printf("  %s: 4096-token prompt over 16 instances: mean %v  p50 %v  p99 %v (hashing the prompt's 256 blocks: %v)\n",
		name, mean(lat), pct(lat, 0.5), pct(lat, 0.99), hashing)
}

func main() {
	valkey := flag.String("valkey", "", "Valkey/Redis address for the index figures (host:port)")
	steps := flag.Int("steps", 2000, "engine steps for the publishing figure")
	flag.Parse()
	fmt.Println("== publishing")
	benchPublish(*steps)
	fmt.Println("== index updates")
	benchIndexUpdates("memory", kvindex.NewMemory())
	var v *kvindex.Valkey
	if *valkey != "" {
		var err error
		v, err = kvindex.NewValkey(*valkey, fmt.Sprintf("kvbench-%d", time.Now().UnixNano()), 5*time.Second)
		must(err)
		benchIndexUpdates("valkey", v)
	}
	fmt.Println("== queries")
	benchQuery("memory", kvindex.NewMemory())
	if v != nil {
		benchQuery("valkey", v)
	}
}
