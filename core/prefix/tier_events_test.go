package prefix

import (
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// fakeTier is a TierSource over a fixed list.
type fakeTier struct{ blocks []TierBlock }

func (f *fakeTier) TierLen() int { return len(f.blocks) }
func (f *fakeTier) AppendTierBlocks(dst []TierBlock) []TierBlock {
	return append(dst, f.blocks...)
}

func TestMediumNames(t *testing.T) {
	for m, name := range map[Medium]string{MediumGPU: "GPU", MediumCPU: "CPU", MediumShared: "SHARED"} {
		if m.String() != name {
			t.Errorf("%d: %q", m, m.String())
		}
		if got, ok := ParseMedium(name); !ok || got != m {
			t.Errorf("ParseMedium(%q) = %v, %v", name, got, ok)
		}
	}
	if m, ok := ParseMedium("cpu"); !ok || m != MediumCPU {
		t.Error("a lower-case name")
	}
	if _, ok := ParseMedium("DISK"); ok {
		t.Error("an unknown name parsed")
	}
	if Medium(7).String() != "Medium(7)" {
		t.Error(Medium(7).String())
	}
}

// EvictBlocks evicts what Evict would, in the same order, and describes
// each block as its BlockStored did.
func TestEvictBlocksDescribes(t *testing.T) {
	a, b, c := newIndex(t, 4, 16, true), newIndex(t, 4, 16, true), newIndex(t, 4, 16, true)
	keys := &Keys{Adapter: 3, MM: []MMItem{{Offset: 2, Length: 4, Hash: Hash{5}}}}
	p := seq(0, 16)
	for _, x := range []*Index{a, b, c} {
		unlock(t, x, cache(t, x, p, keys, 3, 5, 7, 9)...)
	}
	stored := b.DrainEvents(0)
	a.DrainEvents(0)
	want := evict(t, a, 3)
	info, toks := b.EvictBlocks([]EvictedBlock{{Block: -1}}, []int32{-1}, 3, true)
	check(t, b)
	if len(info) != 4 || info[0].Block != -1 || len(toks) != 1+3*4 {
		t.Fatalf("EvictBlocks appended %d blocks, %d tokens", len(info)-1, len(toks)-1)
	}
	for k, e := range info[1:] {
		w := stored[3-k] // deepest first
		if e.Block != want[k] || e.Hash != w.Hash || e.Parent != w.Parent || e.Adapter != 3 ||
			!slices.Equal(e.MM, w.MM) || !slices.Equal(toks[1+4*k:1+4*(k+1)], w.Tokens) {
			t.Fatalf("block %d: %+v, want %+v (block %d)", k, e, w, want[k])
		}
	}
	if !slices.EqualFunc(a.DrainEvents(0), b.DrainEvents(0), func(x, y Event) bool { return x.Kind == y.Kind && slices.Equal(x.Hashes, y.Hashes) }) {
		t.Fatal("EvictBlocks and Evict recorded different events")
	}
	// Without tokens: the same blocks, described alike, and toks untouched.
	cinfo, ctoks := c.EvictBlocks(nil, []int32{-1}, 3, false)
	check(t, c)
	if !slices.EqualFunc(cinfo, info[1:], func(x, y EvictedBlock) bool {
		return x.Block == y.Block && x.Hash == y.Hash && x.Parent == y.Parent && x.Adapter == y.Adapter && slices.Equal(x.MM, y.MM)
	}) || !slices.Equal(ctoks, []int32{-1}) {
		t.Fatalf("EvictBlocks without tokens: %+v, %v", cinfo, ctoks)
	}
}

// Tier events share the queue with the index's own, in order; snapshots
// and Clear list the tier source's blocks after the GPU's.
func TestTierEventsInQueue(t *testing.T) {
	x, err := New(Config{BlockSize: 2, NumBlocks: 4, EnableEvents: true, MaxPendingEvents: 1, TierBlocks: 3})
	if err != nil {
		t.Fatal(err)
	}
	if x.events.limit != 4+3+1 {
		t.Fatalf("limit %d", x.events.limit)
	}
	src := &fakeTier{}
	x.SetTierSource(src)
	tb := TierBlock{Medium: MediumCPU, Hash: Hash{1}, Parent: Hash{2}, Adapter: 4, Tokens: []int32{7, 8}, MM: []BlockMM{{Offset: 1, Hash: Hash{3}}}}
	if err := x.RecordTierStored(&tb); err != nil {
		t.Fatal(err)
	}
	unlock(t, x, cache(t, x, seq(0, 2), nil, 0)...)
	if err := x.RecordTierRemoved(MediumCPU, []Hash{{1}}); err != nil {
		t.Fatal(err)
	}
	evs := x.DrainEvents(0)
	if len(evs) != 3 || evs[0].Medium != MediumCPU || evs[0].Hash != tb.Hash || evs[0].Parent != tb.Parent ||
		evs[0].Adapter != 4 || evs[0].BlockSize != 2 || !slices.Equal(evs[0].Tokens, tb.Tokens) || !slices.Equal(evs[0].MM, tb.MM) ||
		evs[1].Medium != MediumGPU || evs[2].Kind != BlockRemoved || evs[2].Medium != MediumCPU || !slices.Equal(evs[2].Hashes, []Hash{{1}}) {
		t.Fatalf("events %+v", evs)
	}
	r := NewEventIndex()
	applyAll(t, r, evs)
	if r.LenIn(MediumCPU) != 0 || r.Len() != 1 {
		t.Fatalf("view: GPU %d, CPU %d", r.Len(), r.LenIn(MediumCPU))
	}

	// Bad arguments record nothing.
	for _, bad := range []TierBlock{{Medium: MediumGPU, Tokens: []int32{1, 2}}, {Medium: 9, Tokens: []int32{1, 2}}, {Medium: MediumCPU, Tokens: []int32{1}}} {
		if err := x.RecordTierStored(&bad); !kverr.Is(err, kverr.InvalidArgument) {
			t.Fatalf("%+v: %v", bad, err)
		}
	}
	if err := x.RecordTierRemoved(MediumGPU, []Hash{{1}}); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatal(err)
	}
	if x.Stats().PendingEvents != 0 {
		t.Fatal("a refused event was recorded")
	}

	// A snapshot: AllCleared, the GPU's blocks, the source's.
	src.blocks = []TierBlock{tb, {Medium: MediumShared, Hash: Hash{6}, Tokens: []int32{1, 2}}}
	x.RequestSnapshot()
	evs = x.DrainEvents(0)
	if len(evs) != 4 || evs[0].Kind != AllCleared || evs[1].Medium != MediumGPU || evs[2].Medium != MediumCPU || evs[3].Medium != MediumShared {
		t.Fatalf("snapshot %+v", evs)
	}
	applyAll(t, r, evs)
	if r.Len() != 1 || !r.ContainsIn(MediumCPU, Hash{1}) || !r.ContainsIn(MediumShared, Hash{6}) || r.ContainsIn(MediumGPU, Hash{1}) {
		t.Fatal("the snapshot did not rebuild every medium")
	}

	// A full queue: resync, counted with the tier's blocks.
	for i := range 9 {
		b := tb
		b.Hash = Hash{byte(10 + i)}
		if err := x.RecordTierStored(&b); err != nil {
			t.Fatal(err)
		}
	}
	if st := x.Stats(); st.EventsDropped == 0 || st.PendingEvents != 1+1+2 {
		t.Fatalf("after overflow: %+v", st)
	}
	applyAll(t, r, x.DrainEvents(0))

	// Clear: AllCleared, then the tier's blocks.
	if _, err := x.Clear(nil); err != nil {
		t.Fatal(err)
	}
	evs = x.DrainEvents(0)
	if len(evs) != 3 || evs[0].Kind != AllCleared || evs[1].Medium != MediumCPU || evs[2].Medium != MediumShared {
		t.Fatalf("clear %+v", evs)
	}
	applyAll(t, r, evs)
	if r.Len() != 0 || r.LenIn(MediumCPU) != 1 || r.LenIn(MediumShared) != 1 {
		t.Fatal("clear's view")
	}
}

// The oracle's checks of tier events: stored once, removed while stored.
func TestEventIndexTiers(t *testing.T) {
	r := NewEventIndex()
	st := func(m Medium, h byte) Event {
		return Event{Kind: BlockStored, Medium: m, Hash: Hash{h}, Parent: Hash{99}}
	}
	rm := func(m Medium, hs ...byte) Event {
		ev := Event{Kind: BlockRemoved, Medium: m}
		for _, h := range hs {
			ev.Hashes = append(ev.Hashes, Hash{h})
		}
		return ev
	}
	// A CPU block's parent need not be known anywhere.
	applyAll(t, r, []Event{st(MediumCPU, 1), st(MediumCPU, 2), st(MediumShared, 1)})
	for _, bad := range []Event{st(MediumCPU, 1), rm(MediumCPU, 3), rm(MediumCPU, 1, 1), rm(MediumGPU, 1), {Kind: BlockStored, Medium: 5}} {
		if err := r.Apply(bad); err == nil {
			t.Fatalf("%+v accepted", bad)
		}
	}
	applyAll(t, r, []Event{rm(MediumCPU, 2, 1)})
	if r.LenIn(MediumCPU) != 0 || r.LenIn(MediumShared) != 1 || len(r.HashesIn(MediumShared, nil)) != 1 {
		t.Fatal("tier sets")
	}
}
