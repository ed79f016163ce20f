package kvmanager

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/testtok"
)

// The tests of the computed-K/V contract (computed.go): an engine that
// removes sequences between the calls that fill their blocks and the
// forward pass is never served K/V that no forward pass computed.

// promptsOf is a batch of prompts without keys.
func promptsOf(ps ...[]int32) Prompts {
	var p Prompts
	p.Offsets = append(p.Offsets, 0)
	for _, t := range ps {
		p.Tokens = append(p.Tokens, t...)
		p.Offsets = append(p.Offsets, int64(len(p.Tokens)))
	}
	return p
}

func iota32(start, n int) []int32 { return testtok.Iota(start, n) }

// The reproducer: a request admitted and removed before its
// forward pass leaves nothing a later prompt matches; after
// MarkComputed, the same sequence of calls keeps its blocks.
func TestRemoveBeforeForwardMatchesNothing(t *testing.T) {
	m := newCached(t, 64, 16, false)
	p := iota32(100, 80)
	matched := make([]int32, 1)
	if n, err := m.Admit([]int64{1}, promptsOf(p), matched); err != nil || n != 1 || matched[0] != 0 {
		t.Fatalf("admit 1: %d %v %v", n, err, matched)
	}
	if st := m.PrefixStats(); st.PendingBlocks != 5 {
		t.Fatalf("after admit: %d uncomputed blocks, want 5", st.PendingBlocks)
	}
	if err := m.Remove([]int64{1}); err != nil {
		t.Fatal(err)
	}
	if n, err := m.Admit([]int64{2}, promptsOf(p), matched); err != nil || n != 1 || matched[0] != 0 {
		t.Fatalf("admit 2 after a removal before the forward pass: %d %v matched %v, want 0", n, err, matched)
	}
	st := m.PrefixStats()
	if st.DroppedPending != 5 || st.CachedBlocks != 5 {
		t.Fatalf("stats %+v: want 5 dropped, 5 cached (sequence 2's)", st)
	}
	m.MarkComputed()
	if err := m.Remove([]int64{2}); err != nil {
		t.Fatal(err)
	}
	if n, err := m.Admit([]int64{3}, promptsOf(p), matched); err != nil || n != 1 || matched[0] != 64 {
		t.Fatalf("admit 3 after a computed step: %d %v matched %v, want 64", n, err, matched)
	}
	mustCheck(t, m)
}

func mustCheck(t testing.TB, m *Manager) {
	t.Helper()
	if err := m.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// A sequence that shares the uncomputed blocks of one admitted earlier in
// the same step (a match, or a fork) keeps its filler: the filler's
// removal fails with InUse, changing nothing, and succeeds in one batch
// with the sharer, or after MarkComputed. A decode token that fills a
// block (GrowTokens) is uncomputed the same way.
func TestRemoveOfSharedUncomputedBlocks(t *testing.T) {
	m := newCached(t, 32, 4, false)
	p := iota32(0, 10)
	matched := make([]int32, 2)
	if n, err := m.Admit([]int64{1, 2}, promptsOf(p, append(slices.Clone(p[:8]), 77, 78, 79)), matched); err != nil || n != 2 {
		t.Fatal(n, err)
	}
	if matched[1] != 8 {
		t.Fatalf("same-step sharing: sequence 2 matched %d, want 8", matched[1])
	}
	before := m.Stats()
	err := m.Remove([]int64{1})
	if !kverr.Is(err, kverr.InUse) || !strings.Contains(err.Error(), "sequence 2") {
		t.Fatalf("removing the filler of blocks sequence 2 shares: %v, want InUse naming sequence 2", err)
	}
	if after := m.Stats(); after != before {
		t.Fatalf("a refused remove changed the manager: %+v -> %+v", before, after)
	}
	mustCheck(t, m)
	if err := m.Remove([]int64{2, 1}); err != nil {
		t.Fatalf("removing filler and sharer together: %v", err)
	}
	if st := m.PrefixStats(); st.CachedBlocks != 0 || m.Stats().FreeBlocks != 32 {
		t.Fatalf("after removing both: %+v %+v", st, m.Stats())
	}
	mustCheck(t, m)

	// A fork shares its parent's uncomputed full blocks.
	if _, err := m.Admit([]int64{3}, promptsOf(p), nil); err != nil {
		t.Fatal(err)
	}
	copies := make([]CopyPair, 1)
	if _, err := m.Fork(3, []int64{4}, copies); err != nil {
		t.Fatal(err)
	}
	if err := m.Remove([]int64{3}); !kverr.Is(err, kverr.InUse) {
		t.Fatalf("removing a parent whose child shares its uncomputed blocks: %v", err)
	}
	m.MarkComputed()
	if err := m.Remove([]int64{3}); err != nil {
		t.Fatalf("after MarkComputed: %v", err)
	}
	// A decode token that fills block 2 of sequence 4 (10 + 2 = 12 tokens).
	if err := m.GrowTokens([]int64{4}, []int32{2}, []int32{10, 11}); err != nil {
		t.Fatal(err)
	}
	if st := m.PrefixStats(); st.PendingBlocks != 1 || st.CachedBlocks != 3 {
		t.Fatalf("after the decode fill: %+v", st)
	}
	if err := m.Remove([]int64{4}); err != nil {
		t.Fatal(err)
	}
	if st := m.PrefixStats(); st.CachedBlocks != 2 || st.PendingBlocks != 0 || st.DroppedPending != 2+1 {
		t.Fatalf("after removing the decoder: %+v; want its 2 computed blocks cached, the filled one dropped", st)
	}
	mustCheck(t, m)
}

// slotSim is an engine over a Manager, run against an oracle of what each
// token slot holds: the GPU pool's memory is one digest per slot, the
// digest of the token prefix whose K/V the forward pass computed there
// (a token's K/V depends on every token before it). Host slots hold the
// same digests, copied by the tier copies as an engine performs them.
// Every step's attention reads every live sequence's slots and checks
// each against the digest of the sequence's own prefix: any K/V served
// that no forward pass computed for that prefix fails the test.
type slotSim struct {
	t      *testing.T
	rng    *rand.Rand
	m      *Manager
	bs     int
	mem    []uint64 // per pool slot; 0: never written
	hostP  *host.Pool
	seqs   map[int64]*simReq
	order  []int64 // live ids, admission order
	nextID int64
	shared [][]int32
	step   int
	newIDs []int64 // admitted or forked this step, in order

	served, dropped, refused, preempts, aborted int
}

type simReq struct {
	toks   []int32
	digest []uint64 // digest[p]: of toks[:p+1]
	fresh  int      // new tokens this step: the forward pass computes them
	target int      // finished at this length
}

func (r *simReq) push(toks ...int32) {
	for _, t := range toks {
		d := uint64(14695981039346656037)
		if n := len(r.digest); n > 0 {
			d = r.digest[n-1]
		}
		d = (d ^ uint64(uint32(t))) * 1099511628211
		d ^= d >> 29
		r.toks = append(r.toks, t)
		r.digest = append(r.digest, d|1) // never 0, the unwritten slot
	}
}

// Copy is the tier copier: the copies run at once, which is the engine's
// stream order (a batch before the step's forward pass).
func (s *slotSim) Copy(b CopyBatch) error {
	for _, op := range b.Demote {
		dst := s.hostP.Bytes(op.Slot)
		for r := range s.bs {
			binary.LittleEndian.PutUint64(dst[8*r:], s.mem[int(op.Block)*s.bs+r])
		}
	}
	for _, op := range b.Reload {
		src := s.hostP.Bytes(op.Slot)
		for r := range s.bs {
			s.mem[int(op.Block)*s.bs+r] = binary.LittleEndian.Uint64(src[8*r:])
		}
	}
	return nil
}

func newSlotSim(t *testing.T, seed uint64, bs, numBlocks int, tier, demoteEvicted, writeThrough bool) *slotSim {
	s := &slotSim{t: t, rng: rand.New(rand.NewPCG(seed, 7)), bs: bs, mem: make([]uint64, numBlocks*bs), seqs: map[int64]*simReq{}}
	cfg := Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true}
	if tier {
		p, err := host.New(host.Config{Slots: numBlocks, BlockBytes: 8 * bs})
		if err != nil {
			t.Fatal(err)
		}
		s.hostP = p
		cfg.HostTier = &HostTier{Pool: p, Copier: s, DemoteAhead: numBlocks / 4, DemoteEvicted: demoteEvicted}
		if writeThrough { // copies, no moves
			cfg.HostTier.DemoteAhead, cfg.HostTier.WriteThrough = 0, 1+int(seed%4)*2
		}
	}
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.m = m
	for range 3 {
		s.shared = append(s.shared, s.tokens(bs*(1+s.rng.IntN(4))+s.rng.IntN(bs)))
	}
	return s
}

func (s *slotSim) tokens(n int) []int32 { return testtok.Rand(s.rng, n, 4) }

func (s *slotSim) fatalf(format string, args ...any) {
	s.t.Helper()
	s.t.Fatalf("step %d: "+format, append([]any{s.step}, args...)...)
}

// admit admits one to three requests, each a shared prefix and a tail.
func (s *slotSim) admit() {
	n := 1 + s.rng.IntN(3)
	var ids []int64
	var ps [][]int32
	// Now and then a burst of requests under a prefix never seen: they
	// share blocks none of them has computed yet.
	burst := []int32(nil)
	if s.rng.IntN(6) == 0 {
		n = 2 + s.rng.IntN(2)
		burst = s.tokens(s.bs * (2 + s.rng.IntN(3)))
	}
	for range n {
		head := s.shared[s.rng.IntN(len(s.shared))]
		if burst != nil {
			head = burst
		}
		p := append(slices.Clone(head), s.tokens(1+s.rng.IntN(2*s.bs))...)
		s.nextID++
		ids = append(ids, s.nextID)
		ps = append(ps, p)
	}
	matched := make([]int32, n)
	got, err := s.m.Admit(ids, promptsOf(ps...), matched)
	if err != nil {
		s.fatalf("admit: %v", err)
	}
	for i := range got {
		r := &simReq{fresh: len(ps[i]) - int(matched[i]), target: len(ps[i]) + s.rng.IntN(3*s.bs)}
		r.push(ps[i]...)
		s.seqs[ids[i]] = r
		s.order = append(s.order, ids[i])
		s.newIDs = append(s.newIDs, ids[i])
	}
}

// grow extends the sequences that were running before the step by a
// decode token or a prefill chunk; when the pool is short it preempts.
func (s *slotSim) grow(running []int64) {
	var ids []int64
	var counts []int32
	var toks []int32
	var add [][]int32
	for _, id := range running {
		r, ok := s.seqs[id]
		if !ok || r.fresh > 0 {
			continue
		}
		k := 1
		if s.rng.IntN(4) == 0 {
			k = 1 + s.rng.IntN(2*s.bs)
		}
		t := s.tokens(k)
		ids = append(ids, id)
		counts = append(counts, int32(k))
		toks = append(toks, t...)
		add = append(add, t)
	}
	for {
		if len(ids) == 0 {
			return
		}
		err := s.m.GrowTokens(ids, counts, toks)
		if err == nil {
			break
		}
		if !kverr.Is(err, kverr.OutOfBlocks) {
			s.fatalf("grow tokens: %v", err)
		}
		// Preempt and retry without the preempted, as a scheduler does.
		s.preempt(true)
		var keep []int
		for i, id := range ids {
			if _, ok := s.seqs[id]; ok {
				keep = append(keep, i)
			}
		}
		var ids2 []int64
		var counts2 []int32
		var toks2 []int32
		var add2 [][]int32
		for _, i := range keep {
			ids2 = append(ids2, ids[i])
			counts2 = append(counts2, counts[i])
			toks2 = append(toks2, add[i]...)
			add2 = append(add2, add[i])
		}
		ids, counts, toks, add = ids2, counts2, toks2, add2
	}
	for i, id := range ids {
		s.seqs[id].push(add[i]...)
		s.seqs[id].fresh = len(add[i])
	}
}

// preempt removes one live sequence before the forward pass: the most
// recent (lifo) or any. If sequences admitted later in the step share its
// uncomputed blocks, the remove is refused (InUse, nothing changed) and
// the scheduler removes the victim with every sequence admitted after it
// in this step (all of this step's, for a victim admitted before it).
func (s *slotSim) preempt(lifo bool) {
	if len(s.order) == 0 {
		return
	}
	victim := s.order[len(s.order)-1]
	if !lifo {
		victim = s.order[s.rng.IntN(len(s.order))]
		if len(s.newIDs) > 1 && s.rng.IntN(2) == 0 {
			victim = s.newIDs[s.rng.IntN(len(s.newIDs)-1)] // one admitted earlier this step
		}
	}
	before := s.m.Stats()
	err := s.m.Remove([]int64{victim})
	batch := []int64{victim}
	if kverr.Is(err, kverr.InUse) {
		s.refused++
		if lifo {
			s.fatalf("removing the most recent sequence %d was refused: %v", victim, err)
		}
		if after := s.m.Stats(); after != before {
			s.fatalf("a refused remove changed the manager: %+v -> %+v", before, after)
		}
		// The sharers are sequences admitted this step after the
		// victim's fill: after its admission, or (a running victim whose
		// decode token filled a block) any of this step's.
		if k := slices.Index(s.newIDs, victim); k >= 0 {
			batch = append(batch, s.newIDs[k+1:]...)
		} else {
			batch = append(batch, s.newIDs...)
		}
		err = s.m.Remove(batch)
	}
	if err != nil {
		s.fatalf("remove %v: %v", batch, err)
	}
	s.preempts += len(batch)
	s.forget(batch)
}

func (s *slotSim) forget(ids []int64) {
	for _, id := range ids {
		delete(s.seqs, id)
		s.order = slices.DeleteFunc(s.order, func(x int64) bool { return x == id })
		s.newIDs = slices.DeleteFunc(s.newIDs, func(x int64) bool { return x == id })
	}
}

// forward writes the K/V of every new token, then reads every live
// sequence's slots as attention does and checks them.
func (s *slotSim) forward() {
	if len(s.order) == 0 {
		return
	}
	ids := slices.Clone(s.order)
	maxBlocks := 1
	for _, id := range ids {
		maxBlocks = max(maxBlocks, (len(s.seqs[id].toks)+s.bs-1)/s.bs)
	}
	table := make([]int32, len(ids)*maxBlocks)
	lens := make([]int32, len(ids))
	slots := make([]int32, 1<<16)
	n, err := s.m.Describe(ids, maxBlocks, table, lens, slots)
	if err != nil {
		s.fatalf("describe: %v", err)
	}
	k := 0
	for _, id := range ids {
		r := s.seqs[id]
		for p := len(r.toks) - r.fresh; p < len(r.toks); p++ {
			s.mem[slots[k]] = r.digest[p]
			k++
		}
	}
	if k != n {
		s.fatalf("describe reports %d slots, the engine computes %d new tokens", n, k)
	}
	for i, id := range ids {
		r := s.seqs[id]
		if int(lens[i]) != len(r.toks) {
			s.fatalf("sequence %d: length %d, engine's %d", id, lens[i], len(r.toks))
		}
		row := table[i*maxBlocks:]
		for p := range r.toks {
			slot := int(row[p/s.bs])*s.bs + p%s.bs
			if s.mem[slot] != r.digest[p] {
				s.fatalf("sequence %d reads token %d from slot %d, which holds K/V no forward pass computed for its prefix (%x, want %x)",
					id, p, slot, s.mem[slot], r.digest[p])
			}
			s.served++
		}
	}
}

func (s *slotSim) flush() {
	if s.hostP == nil {
		return
	}
	tk, _, err := s.m.FlushCopies()
	if err != nil {
		s.fatalf("flush copies: %v", err)
	}
	if tk != 0 {
		if err := s.m.CompleteCopies(tk, false); err != nil {
			s.fatalf("complete copies: %v", err)
		}
	}
}

// runStep is one engine step: the scheduler's calls in a random order,
// preemptions among them, the tier flush, and then either the forward
// pass and MarkComputed, or (rarely) an abandoned step that removes
// every sequence with new tokens.
func (s *slotSim) runStep() {
	s.step++
	s.newIDs = s.newIDs[:0]
	running := slices.Clone(s.order)
	for _, id := range running {
		s.seqs[id].fresh = 0
	}
	ops := []int{0, 0, 1, 2, 3}
	s.rng.Shuffle(len(ops), func(i, j int) { ops[i], ops[j] = ops[j], ops[i] })
	for _, op := range ops {
		switch op {
		case 0:
			s.admit()
		case 1:
			s.grow(running)
		case 2:
			if s.rng.IntN(2) == 0 {
				s.preempt(s.rng.IntN(2) == 0)
			}
		case 3:
			if s.rng.IntN(4) == 0 && len(s.newIDs) > 0 {
				// A client disconnects right after admission.
				s.preempt(false)
			}
		}
		mustCheck(s.t, s.m)
	}
	s.flush()
	if s.rng.IntN(20) == 0 {
		var gone []int64
		for _, id := range s.order {
			if s.seqs[id].fresh > 0 {
				gone = append(gone, id)
			}
		}
		if len(gone) > 0 {
			if err := s.m.Remove(gone); err != nil {
				s.fatalf("abandoning the step: remove %v: %v", gone, err)
			}
			s.aborted += len(gone)
			s.forget(gone)
		}
		return
	}
	s.forward()
	s.m.MarkComputed()
	var done []int64
	for _, id := range s.order {
		if len(s.seqs[id].toks) >= s.seqs[id].target {
			done = append(done, id)
		}
	}
	if len(done) > 0 {
		if err := s.m.Remove(done); err != nil {
			s.fatalf("remove finished %v: %v", done, err)
		}
		s.forget(done)
	}
	mustCheck(s.t, s.m)
}

// The randomized model: admissions, decode and chunk growth, preemption
// and aborts at random points within steps (the removed sequences'
// uncomputed blocks never served, by the GPU cache or the host tier),
// against the slot oracle.
func TestComputedKVModel(t *testing.T) {
	steps := 1500
	if testing.Short() {
		steps = 400
	}
	for seed := range uint64(12) {
		bs := []int{1, 2, 4}[seed%3]
		tier := seed%3 != 0
		writeThrough := tier && seed >= 9
		demoteEvicted := seed%3 == 2 && !writeThrough
		t.Run(fmt.Sprintf("seed%d_bs%d_tier%v_evicted%v_through%v", seed, bs, tier, demoteEvicted, writeThrough), func(t *testing.T) {
			s := newSlotSim(t, seed, bs, 48/bs*2, tier, demoteEvicted, writeThrough)
			for range steps {
				s.runStep()
			}
			ps := s.m.PrefixStats()
			ts := s.m.TierStats()
			t.Logf("served %d slots; preempted %d (refused %d), abandoned %d; prefix %+v; host reloads %d", s.served, s.preempts, s.refused, s.aborted, ps, ts.Reloads)
			if ps.HitTokens == 0 || ps.DroppedPending == 0 || s.preempts == 0 || s.refused == 0 || s.aborted == 0 {
				t.Fatalf("the walk missed a path: hits %d, dropped %d, preempts %d, refused %d, aborted %d", ps.HitTokens, ps.DroppedPending, s.preempts, s.refused, s.aborted)
			}
			if tier && ts.Reloads == 0 {
				t.Fatalf("the host tier never reloaded: %+v", ts)
			}
			if writeThrough && (ts.WriteThroughStored == 0 || ts.DemotionsQueued != 0) {
				t.Fatalf("write-through stored nothing, or moved blocks: %+v", ts)
			}
		})
	}
}

// The prefix's chained hash is not what the oracle checks: the digests
// are the engine's own, so a test that passes does not depend on the
// cache's hashing being right. This guards the oracle itself: a slot
// written for another prefix is caught.
func TestSlotOracleCatchesForeignKV(t *testing.T) {
	var a, b simReq
	a.push(1, 2, 3)
	b.push(9, 2, 3)
	for p := range 3 {
		if a.digest[p] == b.digest[p] {
			t.Fatalf("digest of position %d does not depend on the tokens before it", p)
		}
	}
	_ = prefix.Hash{}
}

// BenchmarkMarkComputed is the engine's per-step mark: alone (it is
// O(1), whatever the step filled), and in a decode step of 256 sequences
// (grow_tokens by one token each, a sixteenth of them filling a block),
// without and with the mark, whose difference is the mark's cost in a step.
func BenchmarkMarkComputed(b *testing.B) {
	const n = 256
	setup := func(b *testing.B) (*Manager, []int64, []int32, []int32) {
		m, err := New(Config{NumBlocks: 1 << 16, BlockSize: 16, EnablePrefixCache: true})
		if err != nil {
			b.Fatal(err)
		}
		ids := make([]int64, n)
		ps := make([][]int32, n)
		for i := range ids {
			ids[i] = int64(i)
			ps[i] = iota32(1000*i, 1+i%16)
		}
		if got, err := m.Admit(ids, promptsOf(ps...), nil); err != nil || got != n {
			b.Fatal(got, err)
		}
		counts := make([]int32, n)
		for i := range counts {
			counts[i] = 1
		}
		return m, ids, counts, iota32(7, n)
	}
	b.Run("mark", func(b *testing.B) {
		m, _, _, _ := setup(b)
		for b.Loop() {
			m.MarkComputed()
		}
	})
	for _, mark := range []bool{false, true} {
		b.Run(fmt.Sprintf("decode_step_256_mark_%v", mark), func(b *testing.B) {
			m, ids, counts, toks := setup(b)
			k := 0
			for b.Loop() {
				if k++; k == 3000 { // the pool holds 4096 steps
					b.StopTimer()
					m, ids, counts, toks = setup(b)
					k = 0
					b.StartTimer()
				}
				if err := m.GrowTokens(ids, counts, toks); err != nil {
					b.Fatal(err)
				}
				if mark {
					m.MarkComputed()
				}
			}
		})
	}
}
