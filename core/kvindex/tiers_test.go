package kvindex

import (
	"math/rand"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
)

func key(b byte) kvevents.Key { return kvevents.Key{15: b} }

func keys(bs ...byte) []kvevents.Key {
	out := make([]kvevents.Key, len(bs))
	for i, b := range bs {
		out[i] = key(b)
	}
	return out
}

// A backend keeps each medium's keys apart and counts a chain's GPU
// prefix, then its CPU continuation, then its shared one.
func testBackendMedia(t *testing.T, be Backend) {
	t.Helper()
	gpu, cpu, shared := prefix.MediumGPU, prefix.MediumCPU, prefix.MediumShared
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(be.Apply("a", []Op{
		{Kind: OpAdd, Medium: gpu, Keys: keys(1, 2)},
		{Kind: OpAdd, Medium: cpu, Keys: keys(1, 2, 3, 4, 6)},
		{Kind: OpAdd, Medium: shared, Keys: keys(5, 7)},
		{Kind: OpAdd, Medium: 9, Keys: keys(8)}, // an unknown medium: ignored
	}))
	must(be.Apply("b", []Op{{Kind: OpAdd, Keys: keys(1, 2, 3)}}))
	for _, c := range []struct {
		chain []byte
		a, b  Held
	}{
		{[]byte{1, 2, 3, 4, 5, 6, 7}, Held{2, 2, 1}, Held{3, 0, 0}}, // 6 follows a shared block: not counted
		{[]byte{3, 4, 5}, Held{0, 2, 1}, Held{1, 0, 0}},
		{[]byte{1, 5, 3}, Held{1, 0, 1}, Held{1, 0, 0}},
		{[]byte{8}, Held{}, Held{}},
		{nil, Held{}, Held{}},
	} {
		got, err := be.Match([]string{"a", "b", "c"}, [][]kvevents.Key{keys(c.chain...), keys(c.chain...), keys(c.chain...)})
		must(err)
		if got[0] != c.a || got[1] != c.b || got[2] != (Held{}) {
			t.Errorf("chain %v: %+v, want %+v %+v", c.chain, got, c.a, c.b)
		}
	}
	// Removing a block from one medium leaves it on the others; clearing
	// clears every medium.
	must(be.Apply("a", []Op{{Kind: OpRemove, Medium: gpu, Keys: keys(2)}, {Kind: OpRemove, Medium: cpu, Keys: keys(1, 9)}}))
	got, err := be.Match([]string{"a"}, [][]kvevents.Key{keys(1, 2, 3)})
	must(err)
	if got[0] != (Held{1, 2, 0}) {
		t.Fatalf("after removals: %+v", got[0])
	}
	must(be.Apply("a", []Op{{Kind: OpClear}}))
	got, err = be.Match([]string{"a", "b"}, [][]kvevents.Key{keys(1, 3, 5), keys(1)})
	must(err)
	if got[0] != (Held{}) || got[1] != (Held{1, 0, 0}) {
		t.Fatalf("after clear: %+v", got)
	}
}

func TestMemoryBackendMedia(t *testing.T) {
	m := NewMemory()
	testBackendMedia(t, m)
	if m.Len("b") != 3 || m.LenIn("b", prefix.MediumCPU) != 0 {
		t.Fatal("Len")
	}
}

func TestValkeyBackendMedia(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	defer srv.Stop()
	v, err := NewValkey(srv.Addr(), "kvmedia", time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	testBackendMedia(t, v)
	if n, err := v.Len("b"); err != nil || n != 3 {
		t.Fatal(n, err)
	}
}

// Events decoded from any producer: a medium named in any case, none
// (the GPU), vLLM's hash-only CPU blocks, and an unknown medium (ignored,
// counted).
func TestApplyBatchMedia(t *testing.T) {
	x := startIndex(t, Config{})
	in := &instance{cfg: InstanceConfig{Name: "e", BlockSize: 16}, x: x, nextSeq: 0}
	x.insts, x.byName["e"] = append(x.insts, in), in
	str := func(s string) *string { return &s }
	b := &kvevents.Batch{Events: []kvevents.DecodedEvent{
		{Kind: kvevents.KindStored, Hashes: keys(1, 2), Tokens: make([]int64, 32), BlockSize: 16},
		{Kind: kvevents.KindStored, Hashes: keys(3), Medium: str("cpu")}, // vLLM's offloaded form: no tokens
		{Kind: kvevents.KindStored, Hashes: keys(4), Medium: str("SHARED")},
		{Kind: kvevents.KindStored, Hashes: keys(5), Medium: str("DISK")},
		{Kind: kvevents.KindRemoved, Hashes: keys(3), Medium: str("DISK")},
	}}
	if !in.applyBatch(0, b, false) {
		t.Fatal("batch refused")
	}
	got, _ := x.be.Match([]string{"e"}, [][]kvevents.Key{keys(1, 2, 3, 4, 5)})
	if got[0] != (Held{2, 1, 1}) || in.unknownMedium.Load() != 2 || in.lastErr != "" {
		t.Fatalf("held %+v, unknown %d, error %q", got[0], in.unknownMedium.Load(), in.lastErr)
	}
	if st := x.Status(); st[0].UnknownMedium != 2 {
		t.Fatalf("status %+v", st[0])
	}
	for _, w := range []float64{1.5, 2} {
		if _, err := New(Config{CPUWeight: w}); err == nil {
			t.Fatalf("CPU weight %v accepted", w)
		}
	}
}

// Two engines, one with a host tier: the index reports each one's GPU
// prefix and CPU continuation as the engine itself matches them
// (MatchTiers), and ranks by the weighted score.
func TestIndexScoresTiers(t *testing.T) {
	e0 := newTierEngine(t, "e0", 16, 16, 32, [2]int{0, 0}, kvevents.Config{})
	t.Cleanup(e0.close)
	e1 := newEngine(t, "e1", 16, 16, [2]int{0, 0}, kvevents.Config{})
	t.Cleanup(e1.close)
	es := []*engine{e0, e1}
	x := startIndex(t, Config{Instances: instancesOf(es)})
	r := rand.New(rand.NewSource(11))
	p := prompt(r, 1, 10*16+1) // ten full blocks and a token
	e0.serve(t, p, nil)
	e0.demote(t) // all ten to the host tier
	e1.serve(t, p[:6*16+1], nil)
	waitConverged(t, x, es, 10*time.Second)
	if m := e0.matchTiers(t, p); m.GPU != 0 || m.Host != 160 {
		t.Fatalf("e0 matches %+v", m)
	}
	sc, err := x.Query(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	want0 := Score{Instance: "e0", Tokens: 160, Blocks: 10, CPUTokens: 160, Score: 0.75 * 160, State: StateFresh}
	want1 := Score{Instance: "e1", Tokens: 96, Blocks: 6, GPUTokens: 96, Score: 96, State: StateFresh}
	if sc[0] != want0 || sc[1] != want1 || Best(sc) != "e0" {
		t.Fatalf("scores %+v, want %+v %+v", sc, want0, want1)
	}
	// A router replica that weighs reloads lower prefers e1's GPU hit; one
	// that counts them for nothing sees e0 hold no GPU prefix.
	for w, best := range map[float64]string{0.5: "e1", -1: "e1", 1: "e0"} {
		ro, err := New(Config{Instances: instancesOf(es), Backend: x.be, ReadOnly: true, CPUWeight: w})
		if err != nil {
			t.Fatal(err)
		}
		sc, err := ro.Query(p, nil)
		if err != nil || Best(sc) != best || sc[0].CPUTokens != 160 {
			t.Fatalf("CPU weight %v: %+v %v", w, sc, err)
		}
		ro.Close()
	}
	// A returning prefix is reloaded: its blocks are on both tiers and
	// count on the GPU, the rest continues on the CPU.
	e0.next++
	if n, err := e0.m.Admit([]int64{e0.next}, kvmanager.Prompts{Tokens: p[:3*16+1], Offsets: []int64{0, 3*16 + 1}}, nil); err != nil || n != 1 {
		t.Fatal(n, err)
	}
	e0.demote(t) // completes the reloads
	waitConverged(t, x, es, 10*time.Second)
	sc, _ = x.Query(p, nil)
	if m := e0.matchTiers(t, p); sc[0].GPUTokens != 48 || sc[0].CPUTokens != 112 || int(m.GPU) != 48 || int(m.Host) != 112 {
		t.Fatalf("after the reload: %+v, the engine %+v", sc[0], m)
	}
}

// Engines with host tiers under a random load: the index follows both
// tiers of each (waitConverged compares them with the events' truth) and
// answers per tier as the engines do.
func TestIndexFollowsTieredEngines(t *testing.T) {
	var es []*engine
	for i := range 2 {
		e := newTierEngine(t, []string{"e0", "e1"}[i], 24, 16, 12+8*i, [2]int{0, 0}, kvevents.Config{})
		t.Cleanup(e.close)
		es = append(es, e)
	}
	x := startIndex(t, Config{Instances: instancesOf(es)})
	r := rand.New(rand.NewSource(12))
	var prompts [][]int32
	for i := range 80 {
		n := 65 + r.Intn(200) // past the 64-token system prompt
		if n%16 == 0 {
			n++ // the engine never counts the last token: keep it in a partial block
		}
		p := prompt(r, i%5, n)
		prompts = append(prompts, p)
		e := es[i%2]
		e.serve(t, p, nil)
		if r.Intn(3) > 0 {
			e.demote(t)
		}
	}
	waitConverged(t, x, es, 20*time.Second)
	cpu := 0
	for _, p := range prompts {
		sc, err := x.Query(p, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i, e := range es {
			m := e.matchTiers(t, p)
			if sc[i].GPUTokens != int(m.GPU) || sc[i].CPUTokens != int(m.Host) {
				t.Fatalf("%s: index %+v, engine %+v", e.name, sc[i], m)
			}
			cpu += sc[i].CPUTokens
		}
	}
	if cpu == 0 {
		t.Fatal("no prompt continued on a host tier: the test tested nothing")
	}
	for _, e := range es {
		if e.m.TierStats().Host.Evictions == 0 {
			t.Fatalf("%s: no host eviction", e.name)
		}
	}
}
