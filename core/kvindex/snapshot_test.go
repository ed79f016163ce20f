package kvindex

import (
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
)

// applyWatch is a backend that notes, at every Apply for the instance
// (every one that when accepts, when set), the state the index shows and
// how many blocks the backend holds for it then: what a reader scoring
// the instance at that moment would use.
type applyWatch struct {
	*Memory
	when  func([]Op) bool
	x     atomic.Pointer[Index]
	mu    sync.Mutex
	state []State
	held  []int
}

func (w *applyWatch) Apply(inst string, ops []Op) error {
	if x := w.x.Load(); x != nil && (w.when == nil || w.when(ops)) {
		st := x.Status()[indexOf(x.Status(), inst)].State
		n := w.Memory.Len(inst)
		w.mu.Lock()
		w.state = append(w.state, st)
		w.held = append(w.held, n)
		w.mu.Unlock()
	}
	return w.Memory.Apply(inst, ops)
}

// startsSnapshot is an applyWatch's when for the applies that begin a
// snapshot: a clear and the blocks after it.
func startsSnapshot(ops []Op) bool { return len(ops) > 1 && ops[0].Kind == OpClear }

// noted returns how many applies were noted since the last take.
func (w *applyWatch) noted() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.state)
}

// take returns what was noted since the last call.
func (w *applyWatch) take() ([]State, []int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, held := w.state, w.held
	w.state, w.held = nil, nil
	return st, held
}

// A snapshot larger than the publisher's MaxBatchEvents spans batches: the
// instance is not fresh while the backend holds part of it, neither after
// a resync nor when a snapshot another subscriber asked for arrives while
// it is fresh, and it is fresh again once the last batch is applied.
func TestNeverFreshOverAPartialSnapshot(t *testing.T) {
	e := newEngine(t, "e0", 256, 16, [2]int{0, 0}, kvevents.Config{MaxBatchEvents: 4, Encoding: kvevents.Encoding{MaxBlocks: 4}})
	t.Cleanup(e.close)
	r := rand.New(rand.NewSource(5))
	var ps [][]int32
	for i := range 10 {
		p := prompt(r, 100+i, 160) // 10 blocks each, no prefix shared
		ps = append(ps, p)
		e.serve(t, p, nil)
	}
	w := &applyWatch{Memory: NewMemory()}
	x, err := New(Config{Instances: []InstanceConfig{e.instance()}, Backend: w})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Close)
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	truth := len(e.src.keys())
	if truth != 100 {
		t.Fatalf("the engine caches %d blocks, 100 expected", truth)
	}
	check := func(what string) {
		t.Helper()
		states, held := w.take()
		partial := 0
		for i, st := range states {
			if st == StateFresh && held[i] < truth {
				t.Fatalf("%s: fresh over %d of %d blocks while the snapshot was applied: states %v, held %v", what, held[i], truth, states, held)
			}
			if st == StateStale && held[i] > 0 && held[i] < truth {
				partial++
			}
		}
		if partial == 0 {
			t.Fatalf("%s: no snapshot applied over several batches: states %v, held %v", what, states, held)
		}
		for _, p := range ps {
			if sc, _ := x.Query(p, nil); sc[0].Tokens != 160 || sc[0].State != StateFresh {
				t.Fatalf("%s: after the snapshot: %+v", what, sc[0])
			}
		}
	}
	w.x.Store(x)
	x.insts[0].resync("test")
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	check("after a resync")

	// Another subscriber's request: the snapshot arrives in sequence.
	snaps, pubSnaps := x.Status()[0].Snapshots, e.pub.Stats().Snapshots
	e.pub.Resync()
	waitFor(t, "the snapshot applied", func() bool {
		e.pub.Flush()
		ps := e.pub.Stats()
		st := x.Status()[0]
		// The publisher counts the snapshot when it is asked for; until its
		// batches are sent the index is level with the publisher's earlier
		// sequence, fresh, and has applied none of them.
		return ps.Snapshots > pubSnaps && w.noted() > 0 && st.NextSeq == ps.NextSeq && st.State == StateFresh
	})
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	check("a snapshot arriving while fresh")
	if got := x.Status()[0].Snapshots; got != snaps {
		t.Fatalf("the index asked for %d more snapshots while one arrived", got-snaps)
	}
}

// snapshotBatches is a scripted stream for one instance: blocks of 16
// tokens, encoded as kvplug's publisher does.
type snapshotBatches struct {
	enc    *kvevents.Encoder
	toks   []int32
	blocks []prefix.Event
}

func newSnapshotBatches(t *testing.T, n int) *snapshotBatches {
	s := &snapshotBatches{enc: kvevents.NewEncoder(kvevents.Encoding{DPRank: -1}), toks: make([]int32, 16*n)}
	for i := range s.toks {
		s.toks[i] = int32(1000 + i)
	}
	var h prefix.Hasher
	hs, err := h.Chain(nil, s.toks, 16, nil)
	if err != nil {
		t.Fatal(err)
	}
	var parent prefix.Hash
	for i, hh := range hs {
		s.blocks = append(s.blocks, prefix.Event{Kind: prefix.BlockStored, Hash: hh, Parent: parent, Tokens: s.toks[i*16 : (i+1)*16], BlockSize: 16})
		parent = hh
	}
	return s
}

// msg is batch seq of evs, followed by rest batches that complete it.
func (s *snapshotBatches) msg(seq int64, rest int, evs ...prefix.Event) kvevents.Message {
	return kvevents.Message{Seq: seq, Payload: append([]byte(nil), s.enc.EncodeSnapshot(0, evs, rest)...)}
}

func cleared(evs ...prefix.Event) []prefix.Event {
	return append([]prefix.Event{{Kind: prefix.AllCleared}}, evs...)
}

// The index follows a snapshot's extent batch by batch: stale until its
// last batch, also when one comes while fresh; a gap in the middle
// restarts the wait for a snapshot; a clear without the extent (vLLM's,
// an older kvplug's) is whole at once, and ends a pending one.
func TestSnapshotExtentKeepsTheInstanceStale(t *testing.T) {
	x, err := New(Config{Instances: []InstanceConfig{{Name: "e0", Endpoint: "tcp://127.0.0.1:1"}}, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	in := x.insts[0]
	in.stale, in.nextSeq = true, -1 // connected, waiting for a snapshot
	s := newSnapshotBatches(t, 10)
	b := s.blocks
	want := func(step string, st State, tokens int) {
		t.Helper()
		sc, _ := x.Query(s.toks, nil)
		held := x.be.(*Memory).Len("e0")
		if sc[0].State != st || st == StateFresh && sc[0].Tokens != tokens {
			t.Fatalf("%s: %+v (backend holds %d blocks); want %s with %d tokens", step, sc[0], held, st, tokens)
		}
	}
	all := 16 * len(b)

	// A batch of a snapshot's middle is no way in.
	in.handle(s.msg(9, 0, b[4:8]...))
	want("a snapshot's middle batch", StateStale, 0)
	in.handle(s.msg(10, 2, cleared(b[:4]...)...))
	want("first of 3 batches", StateStale, 0)
	in.handle(s.msg(11, 0, b[4:8]...))
	want("second of 3 batches", StateStale, 0)
	in.handle(s.msg(12, 0, b[8:]...))
	want("last of 3 batches", StateFresh, all)

	// Another subscriber's snapshot, in sequence while fresh.
	in.handle(s.msg(13, 1, cleared(b[:5]...)...))
	want("first of 2 batches while fresh", StateStale, 0)
	in.handle(s.msg(14, 0, b[5:]...))
	want("last of 2 batches while fresh", StateFresh, all)

	// A gap in the middle that cannot be replayed: resynchronised, and
	// stale until a snapshot comes whole.
	in.handle(s.msg(15, 2, cleared(b[:3]...)...))
	in.handle(s.msg(17, 0, b[6:]...))
	want("gap in a snapshot", StateStale, 0)
	if in.nextSeq != -1 || in.snapEnd != 0 {
		t.Fatalf("after the gap: next %d, snapshot end %d", in.nextSeq, in.snapEnd)
	}
	in.handle(s.msg(18, 0, b[:2]...))
	want("after the gap", StateStale, 0)
	// A snapshot in one batch, without the extent: fresh at once.
	in.handle(s.msg(19, 0, cleared(b...)...))
	want("a snapshot of one batch", StateFresh, all)

	// A clear without the extent ends a pending snapshot: its set is
	// whole with its own batch.
	in.handle(s.msg(20, 5, cleared(b[:1]...)...))
	want("a snapshot of 6 batches", StateStale, 0)
	in.handle(s.msg(21, 0, cleared(b...)...))
	want("a whole snapshot after it", StateFresh, all)

	// A later snapshot restarts a pending one's count.
	in.handle(s.msg(22, 1, cleared(b[:1]...)...))
	in.handle(s.msg(23, 2, cleared(b[:2]...)...))
	in.handle(s.msg(24, 0, b[2:5]...))
	want("the later snapshot's second batch", StateStale, 0)
	in.handle(s.msg(25, 0, b[5:]...))
	want("the later snapshot's last batch", StateFresh, all)

	// The publisher restarts (sequence back to 0) mid-snapshot: its first
	// batch is the way in again.
	in.handle(s.msg(26, 3, cleared(b[:1]...)...))
	in.handle(s.msg(0, 1, cleared(b[:7]...)...))
	want("a restarted publisher's first batch", StateStale, 0)
	in.handle(s.msg(1, 0, b[7:]...))
	want("a restarted publisher's snapshot", StateFresh, all)
}
