package kvindex

import (
	"bytes"
	"encoding/binary"
	"math/rand"
	"slices"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

// engineKey is a block's name as another engine would give it: nothing
// the index can compute from a prompt.
func engineKey(i int) kvevents.Key {
	var k kvevents.Key
	binary.BigEndian.PutUint64(k[8:], uint64(i)*0x9e3779b97f4a7c15+7)
	return k
}

func i64s(v []int32) []int64 {
	out := make([]int64, len(v))
	for i, t := range v {
		out[i] = int64(t)
	}
	return out
}

// A foreign engine's chain, stored in two events with its own hashes,
// translates into exactly the hashes a query computes for the prompt,
// adapter and salt included; hash-only events of a lower tier and
// removals follow the engine's names.
func TestTranslatorRebuildsQueryHashes(t *testing.T) {
	const bs = 16
	r := rand.New(rand.NewSource(7))
	toks := make([]int32, 4*bs)
	for i := range toks {
		toks[i] = int32(r.Intn(50000))
	}
	keys := &prefix.Keys{Adapter: 3, Salt: []byte("tenant-a")}
	var h prefix.Hasher
	want, err := h.Chain(nil, toks, bs, keys)
	if err != nil {
		t.Fatal(err)
	}
	lora, loraID := "ad-3", int64(3)
	xl := newTranslator(bs)
	gpu, cpu := prefix.MediumGPU, prefix.MediumCPU
	got, skipped := xl.stored(&kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(0), engineKey(1)},
		Tokens: i64s(toks[:2*bs]), BlockSize: bs, LoRAID: &loraID, LoRAName: &lora,
		ExtraKeys: []any{[]any{lora, "tenant-a"}, []any{lora}}}, gpu)
	parent := engineKey(1)
	more, skipped2 := xl.stored(&kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(2), engineKey(3)},
		Parent: &parent, Tokens: i64s(toks[2*bs:]), BlockSize: bs, LoRAID: &loraID, LoRAName: &lora}, gpu)
	got = append(got, more...)
	if skipped+skipped2 != 0 || len(got) != 4 {
		t.Fatalf("translated %d blocks, skipped %d", len(got), skipped+skipped2)
	}
	for i := range want {
		if got[i] != kvevents.Key(want[i]) {
			t.Fatalf("block %d: translated %x, a query hashes %x", i, got[i], want[i])
		}
	}
	// Without the salt the first block is another block: the chain differs.
	xl2 := newTranslator(bs)
	unsalted, _ := xl2.stored(&kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(0)},
		Tokens: i64s(toks[:bs]), BlockSize: bs, LoRAID: &loraID}, gpu)
	if len(unsalted) != 1 || unsalted[0] == got[0] {
		t.Fatal("the salt did not enter the first block")
	}

	// SGLang sends the salt in its own field.
	salt := "tenant-a"
	sg, _ := newTranslator(bs).stored(&kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(0), engineKey(1)},
		Tokens: i64s(toks[:2*bs]), BlockSize: bs, LoRAID: &loraID, CacheSalt: &salt}, gpu)
	if !slices.Equal(sg, got[:2]) {
		t.Fatalf("cache_salt field: %x, want %x", sg, got[:2])
	}

	// The CPU tier takes blocks 2 and 3 by name only (vLLM's offloading).
	cpuKeys, sk := xl.stored(&kvevents.DecodedEvent{Kind: kvevents.KindStored, Hashes: []kvevents.Key{engineKey(2), engineKey(3), engineKey(99)}}, cpu)
	if sk != 1 || !slices.Equal(cpuKeys, got[2:]) {
		t.Fatalf("hash-only store: %x, skipped %d", cpuKeys, sk)
	}
	// Gone from the GPU, block 2 stays known while the CPU holds it.
	rm, _ := xl.removed(&kvevents.DecodedEvent{Kind: kvevents.KindRemoved, Hashes: []kvevents.Key{engineKey(2), engineKey(3), engineKey(98)}}, gpu)
	if !slices.Equal(rm, got[2:]) || xl.size() != 4 {
		t.Fatalf("removed %x, %d known", rm, xl.size())
	}
	rm, _ = xl.removed(&kvevents.DecodedEvent{Kind: kvevents.KindRemoved, Hashes: []kvevents.Key{engineKey(3)}}, cpu)
	if len(rm) != 1 || rm[0] != got[3] || xl.size() != 3 {
		t.Fatalf("removed %x, %d known", rm, xl.size())
	}

	// What cannot be translated is skipped, with its descendants.
	unknown := engineKey(1000)
	mm := []any{[]any{"0123abcd", int64(2)}}
	for name, ev := range map[string]*kvevents.DecodedEvent{
		"unknown parent":      {Hashes: []kvevents.Key{engineKey(10), engineKey(11)}, Parent: &unknown, Tokens: i64s(toks[:2*bs]), BlockSize: bs},
		"other block size":    {Hashes: []kvevents.Key{engineKey(10)}, Tokens: i64s(toks[:8]), BlockSize: 8},
		"multimodal keys":     {Hashes: []kvevents.Key{engineKey(10)}, Tokens: i64s(toks[:bs]), BlockSize: bs, ExtraKeys: mm},
		"salt past the first": {Hashes: []kvevents.Key{engineKey(10)}, Parent: &parent, Tokens: i64s(toks[:bs]), BlockSize: bs, ExtraKeys: []any{[]any{"s"}}},
		"token beyond int32":  {Hashes: []kvevents.Key{engineKey(10)}, Tokens: append(i64s(toks[:bs-1]), 1<<40), BlockSize: bs},
	} {
		n := xl.size()
		ks, sk := xl.stored(ev, gpu)
		if len(ks) != 0 || sk != len(ev.Hashes) || xl.size() != n {
			t.Errorf("%s: translated %d, skipped %d, %d known (was %d)", name, len(ks), sk, xl.size(), n)
		}
	}
	xl.reset()
	if xl.size() != 0 {
		t.Fatal("reset kept blocks")
	}
}

// foreignSource publishes a kvplug manager's events under other block
// names, as vLLM's publisher would send its engine's: the hashes are
// renamed, tokens and parents kept.
type foreignSource struct{ *teeSource }

func foreignName(h prefix.Hash) prefix.Hash {
	return prefix.Sum(append([]byte("engine-own-hash:"), h[:]...))
}

func (s foreignSource) Drain() ([]prefix.Event, error) {
	evs, err := s.teeSource.Drain()
	for i := range evs {
		ev := &evs[i]
		if !ev.Hash.IsZero() {
			ev.Hash = foreignName(ev.Hash)
		}
		if !ev.Parent.IsZero() {
			ev.Parent = foreignName(ev.Parent)
		}
		for j := range ev.Hashes {
			ev.Hashes[j] = foreignName(ev.Hashes[j])
		}
	}
	return evs, err
}

// An index routes instances whose publishers send their engine's own
// hashes and no snapshots: each instance's score is its engine's own
// match, and the best instance is the one holding the prompt's prefix.
// Configured as kvplug's, the same instance scores nothing.
func TestIndexRoutesForeignEngines(t *testing.T) {
	es := make([]*engine, 2)
	for i := range es {
		es[i] = newEngine(t, []string{"v0", "v1"}[i], 64, 16, [2]int{}, kvevents.Config{Encoding: kvevents.Encoding{Hashes: kvevents.HashInt64}})
		t.Cleanup(es[i].close)
	}
	// Restart each publisher on a renaming source (newEngine wired the
	// manager's own).
	for _, e := range es {
		e.pub.Close()
		var err error
		for try := 0; ; try++ {
			e.pub, err = kvevents.Start(foreignSource{e.src}, kvevents.Config{
				Endpoint: e.instance().Endpoint, ReplayEndpoint: e.instance().ReplayEndpoint, Bind: kvevents.BindListen,
				Topic: "kv@" + e.name, Encoding: kvevents.Encoding{Hashes: kvevents.HashInt64}})
			if err == nil || try == 50 {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	ics := instancesOf(es)
	for i := range ics {
		ics[i].Engine = EngineVLLM
	}
	x := startIndex(t, Config{Instances: ics, BlockSize: 16})
	for _, ic := range ics {
		waitState(t, x, ic.Name, StateFresh)
	}
	r := rand.New(rand.NewSource(3))
	for i, e := range es {
		// Until the subscription is live, a batch may pass unseen.
		waitFor(t, e.name+"'s first batch", func() bool {
			e.serve(t, prompt(r, 10+i, 96), nil)
			e.pub.Flush()
			return x.Status()[i].Batches > 0
		})
	}
	prompts := serveTrace(t, es, r, 30, 5, 150)
	// The index's sets are the engines' true sets under kvplug's hashes.
	waitConverged(t, x, es, 10*time.Second)
	for i, e := range es {
		if n := x.Status()[i].TranslatedBlocks; n != len(e.src.keys()) {
			t.Fatalf("%s: %d engine blocks known, %d cached", e.name, n, len(e.src.keys()))
		}
	}
	routed := 0
	for _, p := range prompts {
		scores, wants := queryMatchesEngines(t, x, es, p)
		bestWant, bestTokens := "", 0
		for i, want := range wants {
			if want > bestTokens {
				bestWant, bestTokens = es[i].name, want
			}
		}
		if bestTokens > 0 && scores[0].Tokens != scores[1].Tokens {
			if Best(scores) != bestWant {
				t.Fatalf("best %q, the prefix is on %q: %+v", Best(scores), bestWant, scores)
			}
			routed++
		}
	}
	if routed == 0 {
		t.Fatal("no prompt told the instances apart")
	}
	st := x.Status()
	if st[0].Engine != EngineVLLM || st[0].Untranslated != 0 || st[0].Snapshots != 0 {
		t.Fatalf("status %+v", st[0])
	}

	// The same publisher read as kvplug's: its hashes are no query's.
	ics[0].Engine = ""
	y := startIndex(t, Config{Instances: ics[:1], BlockSize: 16})
	es[0].pub.Resync() // a snapshot, for the kvplug-mode instance to start from
	waitState(t, y, ics[0].Name, StateFresh)
	p := prompt(r, 1, 200)
	es[0].serve(t, p, nil)
	es[0].pub.Flush()
	waitFor(t, "the kvplug-mode index to take the blocks", func() bool {
		return es[0].m.PrefixStats().PendingEvents == 0 && len(setOf(t, y.be, es[0].name)) == len(es[0].src.keys())
	})
	if s, _ := y.Query(p, nil); s[0].Tokens != 0 {
		t.Fatalf("foreign hashes matched a query: %+v", s)
	}
}

// An index that joins a foreign engine's stream after its replay buffer
// dropped the first batches starts from what it sees: blocks stored
// later are routed, earlier ones under-reported, never over-reported.
func TestForeignEngineJoinedMidStream(t *testing.T) {
	e := newEngine(t, "v0", 64, 16, [2]int{}, kvevents.Config{})
	t.Cleanup(e.close)
	e.pub.Close()
	var err error
	for try := 0; ; try++ {
		e.pub, err = kvevents.Start(foreignSource{e.src}, kvevents.Config{
			Endpoint: e.instance().Endpoint, ReplayEndpoint: e.instance().ReplayEndpoint, Bind: kvevents.BindListen,
			Topic: "kv@" + e.name, BufferSteps: 1})
		if err == nil || try == 50 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewSource(4))
	early := prompt(r, 1, 160)
	e.serve(t, early, nil)
	// A live sequence on early keeps its blocks cached while the loop below
	// publishes new blocks until the index has joined (as many rounds as
	// the subscription takes): ext must continue a chain stored before the
	// index joined, which an eviction of early's blocks would turn into a
	// fresh chain.
	e.next++
	if _, err := e.m.Admit([]int64{e.next}, kvmanager.Prompts{Tokens: early, Offsets: []int64{0, int64(len(early))}}, nil); err != nil {
		t.Fatal(err)
	}
	e.m.MarkComputed()
	e.serve(t, prompt(r, 2, 160), nil)
	e.pub.Flush()
	// Flush only wakes the publisher: the index must subscribe after these
	// batches went out, or it would see the stream from its start.
	published := e.pub.Stats().Events
	waitFor(t, "the early batches published", func() bool {
		time.Sleep(10 * time.Millisecond)
		n := e.pub.Stats().Events
		done := n > 0 && n == published
		published = n
		return done
	})
	ic := e.instance()
	ic.Engine = EngineSGLang
	x := startIndex(t, Config{Instances: []InstanceConfig{ic}, BlockSize: 16})
	// Fresh once connected: its set is empty until batches come.
	waitState(t, x, ic.Name, StateFresh)
	var err2 error
	waitFor(t, "the index to start from a later batch", func() bool {
		e.serve(t, prompt(r, 4, 96), nil) // new blocks, so a batch, until one is seen
		e.pub.Flush()
		return x.Status()[0].Batches > 0
	})
	late := prompt(r, 3, 160)                                    // all new: routed
	ext := append(slices.Clone(early[:64]), prompt(r, 5, 96)...) // continues a chain stored before the index joined
	e.serve(t, late, nil)
	e.serve(t, ext, nil)
	e.pub.Flush()
	waitFor(t, "the late prompt's blocks", func() bool {
		s, err := x.Query(late, nil)
		err2 = err
		return err != nil || s[0].Tokens == 160
	})
	if err2 != nil {
		t.Fatal(err2)
	}
	waitFor(t, "the continued chain to be counted untranslated", func() bool { return x.Status()[0].Untranslated >= 6 })
	st := x.Status()[0]
	if st.JoinedMidStream != 1 || st.Engine != EngineSGLang {
		t.Fatalf("status %+v", st)
	}
	var buf bytes.Buffer
	if err := x.WriteMetrics(&buf); err != nil {
		t.Fatal(err)
	}
	mt := parseMetrics(t, &buf)
	if mt[`kvindex_joined_mid_stream_total{instance="v0"}`] != 1 || mt[`kvindex_untranslated_blocks_total{instance="v0"}`] != float64(st.Untranslated) {
		t.Fatalf("metrics: joined %v, untranslated %v (status %d)", mt[`kvindex_joined_mid_stream_total{instance="v0"}`],
			mt[`kvindex_untranslated_blocks_total{instance="v0"}`], st.Untranslated)
	}
	for _, p := range [][]int32{early, ext} {
		if s, _ := x.Query(p, nil); s[0].Tokens != 0 {
			t.Fatalf("a chain stored before the index joined: %d tokens (the engine holds %d)", s[0].Tokens, e.match(t, p, nil))
		}
	}
}
