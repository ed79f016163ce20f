package prefix

import (
	"slices"
	"testing"
)

func applyAll(t *testing.T, r *EventIndex, evs []Event) {
	t.Helper()
	for _, ev := range evs {
		if err := r.Apply(ev); err != nil {
			t.Fatal(err)
		}
	}
}

func sameSet(t *testing.T, r *EventIndex, x *Index) {
	t.Helper()
	if r.Len() != x.Len() {
		t.Fatalf("replay holds %d blocks, index %d", r.Len(), x.Len())
	}
	for _, h := range x.CachedHashes(nil) {
		if !r.Contains(h) {
			t.Fatalf("replay lacks %s", h)
		}
	}
}

func TestEventsOffByDefault(t *testing.T) {
	x := newIndex(t, 2, 8, false)
	cache(t, x, seq(0, 4), nil, 0, 1)
	if evs := x.DrainEvents(0); evs != nil || x.Stats().PendingEvents != 0 {
		t.Fatalf("events recorded while off: %v", evs)
	}
}

func TestEventFields(t *testing.T) {
	x := newIndex(t, 4, 8, true)
	img := Sum([]byte("img"))
	keys := &Keys{Adapter: 9, Salt: []byte("s"), MM: []MMItem{{Offset: 2, Length: 4, Hash: img}}}
	held := cache(t, x, seq(10, 8), keys, 3, 5)
	evs := x.DrainEvents(0)
	if len(evs) != 2 {
		t.Fatalf("%d events, want 2", len(evs))
	}
	chain := chainOf(t, seq(10, 8), 4, keys)
	want := []Event{
		{Kind: BlockStored, Hash: chain[0], Tokens: seq(10, 4), BlockSize: 4, Adapter: 9, MM: []BlockMM{{Offset: 2, Hash: img}}},
		{Kind: BlockStored, Hash: chain[1], Parent: chain[0], Tokens: seq(14, 4), BlockSize: 4, Adapter: 9, MM: []BlockMM{{Offset: -2, Hash: img}}},
	}
	for i := range want {
		g, w := evs[i], want[i]
		if g.Kind != w.Kind || g.Hash != w.Hash || g.Parent != w.Parent || !slices.Equal(g.Tokens, w.Tokens) ||
			g.BlockSize != w.BlockSize || g.Adapter != w.Adapter || !slices.Equal(g.MM, w.MM) || g.Hashes != nil {
			t.Errorf("event %d:\n got %+v\nwant %+v", i, g, w)
		}
	}
	// The caller owns the events: scribbling on them changes nothing.
	evs[0].Tokens[0] = -1
	evs[0].Tokens = append(evs[0].Tokens, 7)
	if evs[1].Tokens[0] != 14 {
		t.Fatal("events share token memory")
	}
	unlock(t, x, held...)
	evict(t, x, 2)
	evs = x.DrainEvents(0)
	if len(evs) != 1 || evs[0].Kind != BlockRemoved || !slices.Equal(evs[0].Hashes, []Hash{chain[1], chain[0]}) {
		t.Fatalf("removal: %+v", evs)
	}
	if x.DrainEvents(0) != nil {
		t.Fatal("drained twice")
	}
}

func TestDrainInBatches(t *testing.T) {
	x := newIndex(t, 1, 64, true)
	r := NewEventIndex()
	for round := range 20 {
		held := cache(t, x, seq(int32(round%3*100), 10), nil, seq(int32(round%3*10), 10)...)
		unlock(t, x, held...)
		evict(t, x, round%4)
		for _, ev := range x.DrainEvents(3) {
			if err := r.Apply(ev); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
		check(t, x)
	}
	applyAll(t, r, x.DrainEvents(0))
	sameSet(t, r, x)
	if x.Stats().EventsDropped != 0 {
		t.Fatal("events dropped below the limit")
	}
	// The queue compacted as it went: it holds no more than what is pending.
	if n := len(x.events.q); n > 64 {
		t.Fatalf("event queue kept %d slots", n)
	}
}

func TestEventOverflowResyncs(t *testing.T) {
	x, err := New(Config{BlockSize: 1, NumBlocks: 8, EnableEvents: true, MaxPendingEvents: 1}) // raised to 9
	if err != nil {
		t.Fatal(err)
	}
	r := NewEventIndex()
	a := cache(t, x, seq(0, 4), nil, 0, 1, 2, 3)
	applyAll(t, r, x.DrainEvents(0))
	unlock(t, x, a...)
	evict(t, x, 4)                                            // 1 event
	b := cache(t, x, seq(10, 8), nil, 7, 6, 5, 4, 3, 2, 1, 0) // 8 more: the queue is full
	if st := x.Stats(); st.EventsDropped != 0 || st.PendingEvents != 9 {
		t.Fatalf("at the limit: %+v", st)
	}
	unlock(t, x, b...)
	evict(t, x, 3) // the 10th event: the queue is discarded
	evict(t, x, 1) // recorded nowhere: the snapshot covers it
	if st := x.Stats(); st.EventsDropped != 11 || st.PendingEvents != 1+4 {
		t.Fatalf("after overflow: %+v", st)
	}
	check(t, x)
	evs := x.DrainEvents(2)
	if len(evs) != 2 || evs[0].Kind != AllCleared || evs[1].Kind != BlockStored || !evs[1].Parent.IsZero() {
		t.Fatalf("resync: %+v", evs)
	}
	applyAll(t, r, evs)
	applyAll(t, r, x.DrainEvents(0))
	sameSet(t, r, x)
	// Recording resumed.
	evict(t, x, 1)
	applyAll(t, r, x.DrainEvents(0))
	sameSet(t, r, x)
	check(t, x)
}

func TestReplayRejectsInconsistentStreams(t *testing.T) {
	h1, h2 := Sum([]byte("1")), Sum([]byte("2"))
	r := NewEventIndex()
	must := func(ev Event) {
		t.Helper()
		if err := r.Apply(ev); err != nil {
			t.Fatal(err)
		}
	}
	must(Event{Kind: BlockStored, Hash: h1})
	must(Event{Kind: BlockStored, Hash: h2, Parent: h1})
	for _, ev := range []Event{
		{Kind: BlockStored, Hash: h1},                          // twice
		{Kind: BlockStored, Hash: Sum(nil), Parent: Sum(nil)},  // unknown parent
		{Kind: BlockRemoved, Hashes: []Hash{h1}},               // parent before child
		{Kind: BlockRemoved, Hashes: []Hash{h2, h2}},           // twice
		{Kind: BlockRemoved, Hashes: []Hash{Sum([]byte("3"))}}, // unknown
		{Kind: 0},
	} {
		if err := r.Apply(ev); err == nil {
			t.Errorf("%v %v accepted", ev.Kind, ev.Hashes)
		}
	}
	if r.Len() != 2 {
		t.Fatalf("a rejected event changed the index: %d blocks", r.Len())
	}
	must(Event{Kind: BlockRemoved, Hashes: []Hash{h2, h1}})
	must(Event{Kind: BlockStored, Hash: h1})
	must(Event{Kind: AllCleared})
	if r.Len() != 0 {
		t.Fatal("AllCleared left blocks")
	}
}
