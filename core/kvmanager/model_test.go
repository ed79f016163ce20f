package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// The reference model: plain maps. A sequence's blocks are abstract
// identities (a counter), shared by forked children exactly as the manager
// should share physical blocks; the test checks that identities and physical
// blocks correspond one to one.
type modelSeq struct {
	length, fresh int
	blocks        []int
}

type model struct {
	numBlocks, bs int
	seqs          map[int64]*modelSeq
	refs          map[int]int // identity -> number of sequences holding it
	next          int
}

func (md *model) blocksFor(n int) int { return (n + md.bs - 1) / md.bs }
func (md *model) free() int           { return md.numBlocks - len(md.refs) }

func (md *model) newBlocks(s *modelSeq, k int) {
	for range k {
		md.next++
		s.blocks = append(s.blocks, md.next)
		md.refs[md.next] = 1
	}
}

func (md *model) add(id int64, n int) kverr.Code {
	switch {
	case n < 1 || n > MaxPromptLen:
		return kverr.InvalidArgument
	case md.seqs[id] != nil:
		return kverr.DuplicateSequence
	case md.blocksFor(n) > md.free():
		return kverr.OutOfBlocks
	}
	s := &modelSeq{length: n, fresh: n}
	md.newBlocks(s, md.blocksFor(n))
	md.seqs[id] = s
	return kverr.OK
}

func (md *model) grow(ids []int64, counts []int32) kverr.Code {
	if len(ids) < 1 || len(ids) != len(counts) {
		return kverr.InvalidArgument
	}
	for _, c := range counts {
		if c < 0 || c > MaxGrowTokens {
			return kverr.InvalidArgument
		}
	}
	seen := map[int64]bool{}
	need := 0
	for i, id := range ids {
		s := md.seqs[id]
		switch {
		case s == nil:
			return kverr.UnknownSequence
		case seen[id]:
			return kverr.DuplicateSequence
		}
		seen[id] = true
		need += md.blocksFor(s.length+int(counts[i])) - len(s.blocks)
	}
	if need > md.free() {
		return kverr.OutOfBlocks
	}
	for i, id := range ids {
		s := md.seqs[id]
		s.length += int(counts[i])
		s.fresh = int(counts[i])
		md.newBlocks(s, md.blocksFor(s.length)-len(s.blocks))
	}
	return kverr.OK
}

func (md *model) fork(parent int64, children []int64, copyCap int) (kverr.Code, int) {
	p := md.seqs[parent]
	if len(children) < 1 {
		return kverr.InvalidArgument, 0
	}
	if p == nil {
		return kverr.UnknownSequence, 0
	}
	for _, c := range children {
		if md.seqs[c] != nil {
			return kverr.DuplicateSequence, 0
		}
	}
	seen := map[int64]bool{}
	for _, c := range children {
		if seen[c] {
			return kverr.DuplicateSequence, 0
		}
		seen[c] = true
	}
	full := p.length / md.bs
	partial := p.length%md.bs != 0
	if partial && copyCap < len(children) {
		return kverr.BufferTooSmall, 0
	}
	if partial && len(children) > md.free() {
		return kverr.OutOfBlocks, 0
	}
	for _, c := range children {
		s := &modelSeq{length: p.length, blocks: slices.Clone(p.blocks[:full])}
		for _, b := range s.blocks {
			md.refs[b]++
		}
		if partial {
			md.newBlocks(s, 1)
		}
		md.seqs[c] = s
	}
	if partial {
		return kverr.OK, len(children)
	}
	return kverr.OK, 0
}

func (md *model) remove(ids []int64) kverr.Code {
	if len(ids) < 1 {
		return kverr.InvalidArgument
	}
	seen := map[int64]bool{}
	for _, id := range ids {
		switch {
		case md.seqs[id] == nil:
			return kverr.UnknownSequence
		case seen[id]:
			return kverr.DuplicateSequence
		}
		seen[id] = true
	}
	for _, id := range ids {
		for _, b := range md.seqs[id].blocks {
			if md.refs[b]--; md.refs[b] == 0 {
				delete(md.refs, b)
			}
		}
		delete(md.seqs, id)
	}
	return kverr.OK
}

// verify compares the manager with the model: stats, every sequence's table,
// length and new-token slots, the identity <-> block correspondence, and slot
// uniqueness across live sequences.
func (md *model) verify(t *testing.T, m *Manager, where string) {
	t.Helper()
	if err := m.CheckInvariants(); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	var tokens, waste int64
	shared := 0
	for _, r := range md.refs {
		if r > 1 {
			shared++
		}
	}
	for _, s := range md.seqs {
		tokens += int64(s.length)
		waste += int64(len(s.blocks)*md.bs - s.length)
	}
	st := m.Stats()
	want := Stats{
		NumBlocks: md.numBlocks, BlockSize: md.bs, FreeBlocks: md.free(), UsedBlocks: len(md.refs),
		PeakUsedBlocks: st.PeakUsedBlocks, SharedBlocks: shared, NumSeqs: len(md.seqs), NumTokens: tokens,
		AllocatedSlots: int64(len(md.refs) * md.bs), InternalWaste: waste,
	}
	if want.AllocatedSlots > 0 {
		want.Fragmentation = float64(waste) / float64(want.AllocatedSlots)
	}
	if st != want || st.PeakUsedBlocks < st.UsedBlocks {
		t.Fatalf("%s: stats\n%+v, model\n%+v", where, st, want)
	}

	v := describeAll(t, m)
	if !slices.Equal(v.ids, sortedKeys(md.seqs)) {
		t.Fatalf("%s: live %v, model %v", where, v.ids, sortedKeys(md.seqs))
	}
	physOf := map[int]int32{}
	identOf := map[int32]int{}
	type owner struct {
		id  int64
		pos int
	}
	slotOwner := map[int32]owner{}
	k := 0
	for i, id := range v.ids {
		s := md.seqs[id]
		row := v.table[i*v.max : (i+1)*v.max]
		if int(v.lens[i]) != s.length {
			t.Fatalf("%s: sequence %d length %d, model %d", where, id, v.lens[i], s.length)
		}
		for j, b := range row {
			if j >= len(s.blocks) {
				if b != -1 {
					t.Fatalf("%s: sequence %d row %v not padded after %d blocks", where, id, row, len(s.blocks))
				}
				continue
			}
			if b < 0 || int(b) >= md.numBlocks {
				t.Fatalf("%s: sequence %d holds block %d", where, id, b)
			}
			ident := s.blocks[j]
			if p, ok := physOf[ident]; ok && p != b {
				t.Fatalf("%s: shared block %d is %d in one sequence, %d in another", where, ident, p, b)
			}
			if o, ok := identOf[b]; ok && o != ident {
				t.Fatalf("%s: block %d holds two distinct model blocks", where, b)
			}
			physOf[ident], identOf[b] = b, ident
		}
		for pos := range s.length {
			slot := row[pos/md.bs]*int32(md.bs) + int32(pos%md.bs)
			if o, ok := slotOwner[slot]; ok {
				// Only a token of a shared block, at the same position, may
				// map to a slot twice.
				if md.refs[s.blocks[pos/md.bs]] < 2 || o.pos != pos {
					t.Fatalf("%s: slot %d holds token %d of %d and token %d of %d", where, slot, o.pos, o.id, pos, id)
				}
			}
			slotOwner[slot] = owner{id, pos}
			if pos >= s.length-s.fresh {
				if k >= len(v.slots) || v.slots[k] != slot {
					t.Fatalf("%s: sequence %d new token %d: slot mapping %v at %d, want %d", where, id, pos, v.slots, k, slot)
				}
				k++
			}
		}
	}
	if k != len(v.slots) {
		t.Fatalf("%s: %d slots described, model has %d new tokens", where, len(v.slots), k)
	}
}

func sortedKeys(m map[int64]*modelSeq) []int64 {
	ids := make([]int64, 0, len(m))
	for id := range m {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// TestManagerAgainstModel drives a Manager and the model with the same random
// operations, valid and invalid, and checks after every step that they agree
// (failed calls must change nothing) and that the invariants hold.
func TestManagerAgainstModel(t *testing.T) {
	for _, c := range []struct{ bs, numBlocks int }{{1, 64}, {16, 40}, {64, 24}} {
		for seed := uint64(1); seed <= 4; seed++ {
			t.Run(fmt.Sprintf("bs%d/seed%d", c.bs, seed), func(t *testing.T) {
				runModel(t, c.bs, c.numBlocks, seed, 1000)
			})
		}
	}
}

func runModel(t *testing.T, bs, numBlocks int, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, uint64(bs)))
	m := newMgr(t, numBlocks, bs)
	md := &model{numBlocks: numBlocks, bs: bs, seqs: map[int64]*modelSeq{}, refs: map[int]int{}}
	const idRange = 12 // small, so that ids collide and go unknown
	randID := func() int64 { return int64(rng.IntN(idRange)) }
	live := func() []int64 { return sortedKeys(md.seqs) }
	// batch picks mostly live ids; now and then an unknown or repeated one.
	var last []int64
	batch := func() []int64 {
		if len(last) > 0 && rng.IntN(3) == 0 {
			// The same batch again, as a scheduler's steps do (the manager
			// memoises it).
			return slices.Clone(last)
		}
		l := live()
		n := rng.IntN(4) + 1
		ids := make([]int64, 0, n)
		for range n {
			switch {
			case len(l) == 0 || rng.IntN(12) == 0:
				ids = append(ids, randID())
			default:
				ids = append(ids, l[rng.IntN(len(l))])
			}
		}
		if rng.IntN(3) != 0 { // usually drop repeats
			ids = slices.Compact(slices.Sorted(slices.Values(ids)))
			rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
		}
		last = ids
		return ids
	}
	tokens := func() int {
		switch rng.IntN(20) {
		case 0:
			return -rng.IntN(3)
		case 1:
			return MaxGrowTokens + 1
		}
		if rng.IntN(2) == 0 {
			return rng.IntN(3)
		}
		return rng.IntN(6 * bs)
	}
	outcomes := map[string]int{} // "grow KVP_OK" -> count
	defer func() {
		// The run must have exercised successes and the main failures, or
		// it proves little.
		for _, k := range []string{"add KVP_OK", "gro KVP_OK", "for KVP_OK", "rem KVP_OK", "des KVP_OK",
			"add KVP_ERR_DUPLICATE_SEQUENCE", "gro KVP_ERR_UNKNOWN_SEQUENCE", "gro KVP_ERR_OUT_OF_BLOCKS",
			"gro KVP_ERR_INVALID_ARGUMENT", "rem KVP_ERR_UNKNOWN_SEQUENCE", "des KVP_ERR_BUFFER_TOO_SMALL"} {
			if outcomes[k] == 0 && !t.Failed() {
				t.Errorf("no %q in %d steps: %v", k, steps, outcomes)
			}
		}
		t.Logf("outcomes: %v", outcomes)
	}()
	for step := range steps {
		before := describeAll(t, m)
		var got error
		var want kverr.Code
		var op string
		switch r := rng.IntN(100); {
		case r < 20:
			id, n := randID(), rng.IntN(8*bs)+1
			if rng.IntN(15) == 0 {
				n = []int{0, -1, MaxPromptLen + 1}[rng.IntN(3)]
			}
			op = fmt.Sprintf("add(%d, %d)", id, n)
			want, got = md.add(id, n), m.Add(id, n)
		case r < 60:
			ids := batch()
			counts := make([]int32, len(ids))
			for i := range counts {
				counts[i] = int32(tokens())
			}
			op = fmt.Sprintf("grow(%v, %v)", ids, counts)
			want, got = md.grow(ids, counts), m.Grow(ids, counts)
		case r < 72:
			parent := randID()
			if l := live(); len(l) > 0 && rng.IntN(4) != 0 {
				parent = l[rng.IntN(len(l))]
			}
			children := make([]int64, rng.IntN(3)+1)
			for i := range children {
				children[i] = randID()
			}
			copyCap := len(children)
			if rng.IntN(6) == 0 {
				copyCap = rng.IntN(len(children))
			}
			copies := make([]CopyPair, copyCap)
			op = fmt.Sprintf("fork(%d, %v, cap %d)", parent, children, copyCap)
			var wantN int
			want, wantN = md.fork(parent, children, copyCap)
			var n int
			n, got = m.Fork(parent, children, copies)
			if got == nil {
				if n != wantN {
					t.Fatalf("step %d %s: %d copies, model %d", step, op, n, wantN)
				}
				// Each copy's source is the parent's last block, its
				// destination the child's last block.
				pl := before.table[slices.Index(before.ids, parent)*before.max+md.blocksFor(md.seqs[parent].length)-1]
				for i := range n {
					row := blocksOf(t, m, children[i], len(md.seqs[children[i]].blocks))
					if copies[i] != (CopyPair{pl, row[len(row)-1]}) {
						t.Fatalf("step %d %s: copy %d is %v, want {%d %d}", step, op, i, copies[i], pl, row[len(row)-1])
					}
				}
			}
		case r < 80:
			ids := batch()
			op = fmt.Sprintf("remove(%v)", ids)
			want, got = md.remove(ids), m.Remove(ids)
		default:
			// A describe of a random batch with random buffer sizes.
			ids := batch()
			op = fmt.Sprintf("describe(%v)", ids)
			want = kverr.OK
			maxBlocks, totalNew := 1, 0
			for _, id := range ids {
				if s := md.seqs[id]; s != nil {
					maxBlocks = max(maxBlocks, len(s.blocks))
					totalNew += s.fresh
				} else if want == kverr.OK {
					want = kverr.UnknownSequence
				}
			}
			if rng.IntN(5) == 0 && maxBlocks > 1 && want == kverr.OK {
				maxBlocks--
				want = kverr.BufferTooSmall
			}
			slotCap := totalNew
			if rng.IntN(5) == 0 && totalNew > 0 {
				slotCap = rng.IntN(totalNew)
				if want == kverr.OK {
					want = kverr.BufferTooSmall
				}
			}
			var n int
			n, got = m.Describe(ids, maxBlocks, make([]int32, len(ids)*maxBlocks), make([]int32, len(ids)), make([]int32, slotCap))
			if got == nil && n != totalNew {
				t.Fatalf("step %d %s: %d slots, model %d", step, op, n, totalNew)
			}
		}
		where := fmt.Sprintf("seed %d step %d %s", seed, step, op)
		outcomes[op[:3]+" "+want.String()]++
		if kverr.CodeOf(got) != want {
			t.Fatalf("%s: got %v (%s), model says %s", where, got, kverr.CodeOf(got), want)
		}
		if got != nil || op[:3] == "des" {
			if after := describeAll(t, m); after.String() != before.String() {
				t.Fatalf("%s: a failed or read-only call changed the manager:\n%v\n->\n%v", where, before, after)
			}
		}
		md.verify(t, m, where)
	}
}
