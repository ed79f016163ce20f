// Command kvroute is the routing demo: several kvplug managers (engine
// instances in one process, each publishing its KV events on ZMQ in vLLM's
// format) serve one multi-tenant, multi-turn trace; a router sends every
// request to an instance, either at random or by asking the cluster prefix
// index (core/kvindex, fed by the instances' event streams) which instance
// holds the longest prefix of the prompt. It prints each policy's prefix
// hit rate: the share of prompt tokens the chosen instance had cached.
//
//	go run ./bench/kvroute [-instances 3] [-tenants 12] [-requests 600] [-valkey host:port]
package main

import (
	"flag"
	"fmt"
	"math/rand"
	"os"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvindex"
	"github.com/kvplug/kvplug/core/kvmanager"
)

type request struct {
	tenant int
	prompt []int32
	output []int32
}

// trace builds the workload: each tenant has a system prompt and a few
// conversations; each turn's prompt is the conversation so far (system
// prompt, earlier turns and answers) plus a new user message, so turns of
// one conversation, and conversations of one tenant, share prefixes.
func trace(r *rand.Rand, tenants, requests int) []request {
	type conv struct {
		tenant  int
		history []int32
	}
	sys := make([][]int32, tenants)
	for t := range sys {
		n := 256 + r.Intn(768)
		for range n {
			sys[t] = append(sys[t], int32(r.Intn(32000)))
		}
	}
	var convs []*conv
	var out []request
	for len(out) < requests {
		// Start a conversation now and then, or go on with one.
		if len(convs) == 0 || r.Float64() < 0.3 {
			t := r.Intn(tenants)
			convs = append(convs, &conv{tenant: t, history: append([]int32(nil), sys[t]...)})
		}
		c := convs[r.Intn(len(convs))]
		for range 32 + r.Intn(96) {
			c.history = append(c.history, int32(r.Intn(32000)))
		}
		ans := make([]int32, 32+r.Intn(128))
		for i := range ans {
			ans[i] = int32(r.Intn(32000))
		}
		out = append(out, request{tenant: c.tenant, prompt: append([]int32(nil), c.history...), output: ans})
		c.history = append(c.history, ans...)
		if len(c.history) > 6000 {
			c.history = append([]int32(nil), sys[c.tenant]...)
		}
	}
	return out
}

type instance struct {
	m   *kvmanager.Manager
	pub *kvevents.Publisher
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvroute:", err)
		os.Exit(1)
	}
}

// run serves the trace with one policy and returns the hit rate and each
// instance's request count.
func run(policy string, reqs []request, n, blocks, bs int, valkey string, seed int64) (float64, []int) {
	insts := make([]instance, n)
	var cfgs []kvindex.InstanceConfig
	for i := range insts {
		m, err := kvmanager.New(kvmanager.Config{NumBlocks: blocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true})
		must(err)
		src, err := kvevents.ManagerSource(m)
		must(err)
		pub, err := kvevents.Start(src, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0",
			Bind: kvevents.BindListen, Topic: fmt.Sprintf("kv@i%d@demo", i)})
		must(err)
		insts[i] = instance{m, pub}
		cfgs = append(cfgs, kvindex.InstanceConfig{Name: fmt.Sprintf("i%d", i), Endpoint: "tcp://" + pub.PubAddr().String(),
			ReplayEndpoint: "tcp://" + pub.ReplayAddr().String(), BlockSize: bs})
	}
	var be kvindex.Backend = kvindex.NewMemory()
	if valkey != "" {
		v, err := kvindex.NewValkey(valkey, fmt.Sprintf("kvroute-%d-%s", time.Now().UnixNano(), policy), 2*time.Second)
		must(err)
		be = v
	}
	x, err := kvindex.New(kvindex.Config{Instances: cfgs, BlockSize: bs, Backend: be})
	must(err)
	defer func() {
		x.Close()
		_ = be.Close()
		for _, in := range insts {
			in.pub.Close()
		}
	}()
	// Wait until the index has every instance's start snapshot.
	for deadline := time.Now().Add(10 * time.Second); ; {
		ok := true
		for _, s := range x.Status() {
			ok = ok && !s.Stale
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			must(fmt.Errorf("the index did not sync: %+v", x.Status()))
		}
		time.Sleep(5 * time.Millisecond)
	}
	r := rand.New(rand.NewSource(seed))
	load := make([]int, n)
	var hit, total int64
	matched := make([]int32, 1)
	for k, q := range reqs {
		var target int
		switch policy {
		case "random":
			target = r.Intn(n)
		case "kv-aware":
			scores, err := x.Query(q.prompt, nil)
			must(err)
			// The highest score (the longest cached prefix, weighted by
			// tier); ties (no hit anywhere, say) go to the least loaded
			// instance.
			target = 0
			for i, s := range scores {
				if s.Score > scores[target].Score || (s.Score == scores[target].Score && load[i] < load[target]) {
					target = i
				}
			}
		}
		in := insts[target]
		id := int64(k)
		admitted, err := in.m.Admit([]int64{id}, kvmanager.Prompts{Tokens: q.prompt, Offsets: []int64{0, int64(len(q.prompt))}}, matched)
		must(err)
		if admitted == 0 {
			must(fmt.Errorf("request %d (%d tokens) does not fit an instance of %d blocks", k, len(q.prompt), blocks))
		}
		in.m.MarkComputed() // the prefill's forward pass
		load[target]++
		hit += int64(matched[0])
		total += int64(len(q.prompt))
		// Decode the answer token by token, then finish.
		for _, tok := range q.output {
			must(in.m.GrowTokens([]int64{id}, []int32{1}, []int32{tok}))
			in.m.MarkComputed() // each step's forward pass
		}
		must(in.m.Remove([]int64{id}))
		// The router's view follows the engines within the time between
		// requests of a real deployment (milliseconds): publish now and let
		// the index apply the batch before the next request is routed.
		in.pub.Flush()
		waitApplied(x, insts)
	}
	return float64(hit) / float64(total), load
}

// waitApplied waits (at most 100 ms) until the index applied every batch
// the publishers sent.
func waitApplied(x *kvindex.Index, insts []instance) {
	deadline := time.Now().Add(100 * time.Millisecond)
	for time.Now().Before(deadline) {
		st := x.Status()
		ok := true
		for i, in := range insts {
			if in.pub.Stats().NextSeq != st[i].NextSeq || in.m.PrefixStats().PendingEvents > 0 {
				ok = false
			}
		}
		if ok {
			return
		}
		time.Sleep(50 * time.Microsecond)
	}
}

func main() {
	n := flag.Int("instances", 3, "engine instances")
	tenants := flag.Int("tenants", 12, "tenants (each with its own system prompt)")
	requests := flag.Int("requests", 600, "requests in the trace")
	blocks := flag.Int("blocks", 1024, "KV blocks per instance")
	bs := flag.Int("block-size", 16, "tokens per block")
	valkey := flag.String("valkey", "", "Valkey/Redis address for the index (default: in memory)")
	seed := flag.Int64("seed", 1, "trace seed")
	flag.Parse()
	reqs := trace(rand.New(rand.NewSource(*seed)), *tenants, *requests)
	tokens := 0
	for _, q := range reqs {
		tokens += len(q.prompt)
	}
	backend := "in-memory index"
	if *valkey != "" {
		backend = "Valkey index at " + *valkey
	}
	fmt.Printf("trace: %d requests of %d tenants, %d prompt tokens; %d instances of %d blocks x %d tokens; %s\n",
		len(reqs), *tenants, tokens, *n, *blocks, *bs, backend)
	for _, policy := range []string{"random", "kv-aware"} {
		start := time.Now()
		rate, load := run(policy, reqs, *n, *blocks, *bs, *valkey, *seed)
		fmt.Printf("%-9s prefix hit rate %5.1f%%  requests per instance %v  (%.1f s)\n", policy, 100*rate, load, time.Since(start).Seconds())
	}
}
