package prefix

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/testtok"
)

// The reference model: a map from a prefix's identity, spelled out as a
// string of every block's tokens and keys (no hashing, no tree), to the
// block that caches it, with the eviction policy computed by brute force.

type refBlock struct {
	key, parentKey string
	block          int32
	depth          int
	tokens         []int32
	adapter        uint64
	salt           string
	mm             []BlockMM
	lock, pin      int
	prio           int32
	last           uint64
	pending        bool // inserted since the last commit
}

type refModel struct {
	bs     int
	blocks map[string]*refBlock
	byID   map[int32]*refBlock
	clock  uint64
	pins   map[PinID][]string
}

func newRef(bs int) *refModel {
	return &refModel{bs: bs, blocks: map[string]*refBlock{}, byID: map[int32]*refBlock{}, pins: map[PinID][]string{}}
}

// blockRepr spells out block i of a prompt: what its hash covers.
func blockRepr(tokens []int32, keys *Keys, i, bs int) (string, []BlockMM, string) {
	var mm []BlockMM
	for _, it := range keys.MM {
		if int(it.Offset) < (i+1)*bs && int(it.Offset)+int(it.Length) > i*bs {
			mm = append(mm, BlockMM{Offset: it.Offset - int32(i*bs), Hash: it.Hash})
		}
	}
	salt := ""
	if i == 0 {
		salt = string(keys.Salt)
	}
	return fmt.Sprintf("[%v a%d m%v s%q]", tokens[i*bs:(i+1)*bs], keys.Adapter, mm, salt), mm, salt
}

func (r *refModel) keyOf(tokens []int32, keys *Keys, n int) string {
	var b strings.Builder
	for i := range n {
		s, _, _ := blockRepr(tokens, keys, i, r.bs)
		b.WriteString(s)
	}
	return b.String()
}

// chain returns the cached blocks of a prompt's first maxBlocks full blocks.
func (r *refModel) chain(tokens []int32, keys *Keys, maxBlocks int) []*refBlock {
	var out []*refBlock
	for i := 1; i <= maxBlocks; i++ {
		b, ok := r.blocks[r.keyOf(tokens, keys, i)]
		if !ok {
			break
		}
		out = append(out, b)
	}
	return out
}

func (r *refModel) match(tokens []int32, keys *Keys) (MatchResult, []*refBlock) {
	r.clock++
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / r.bs
	}
	path := r.chain(tokens, keys, limit)
	res := MatchResult{PartialBlock: -1, Tokens: len(path) * r.bs}
	for _, b := range path {
		b.last = r.clock
		res.Blocks = append(res.Blocks, b.block)
	}
	// Partial: the children of the last matched prefix.
	parentKey := r.keyOf(tokens, keys, len(path))
	start := len(path) * r.bs
	avail := min(r.bs, len(tokens)-1-start)
	if avail > 0 {
		var promptMM []BlockMM
		for _, it := range keys.MM {
			if int(it.Offset) < start+r.bs && int(it.Offset)+int(it.Length) > start {
				promptMM = append(promptMM, BlockMM{Offset: it.Offset - int32(start), Hash: it.Hash})
			}
		}
		salt := ""
		if start == 0 {
			salt = string(keys.Salt)
		}
		var best *refBlock
		bestK := 0
		for _, c := range r.blocks {
			if c.parentKey != parentKey || c.adapter != keys.Adapter || c.salt != salt {
				continue
			}
			k := 0
			for k < avail && c.tokens[k] == tokens[start+k] {
				k++
			}
			for _, e := range c.mm {
				if !slices.Contains(promptMM, e) {
					k = min(k, int(max(e.Offset, 0)))
				}
			}
			for _, e := range promptMM {
				if !slices.Contains(c.mm, e) {
					k = min(k, int(max(e.Offset, 0)))
				}
			}
			if k == 0 {
				continue
			}
			if best == nil || k > bestK || (k == bestK && (c.last > best.last || (c.last == best.last && c.block < best.block))) {
				best, bestK = c, k
			}
		}
		if best != nil {
			res.PartialBlock, res.PartialTokens = best.block, bestK
		}
	}
	return res, path
}

// insert mirrors Insert of block i of a prompt; dup reports a cached one.
func (r *refModel) insert(tokens []int32, keys *Keys, i int, id int32) (block int32, dup bool) {
	r.clock++
	key := r.keyOf(tokens, keys, i+1)
	if b, ok := r.blocks[key]; ok {
		b.lock++
		b.last = r.clock
		return b.block, true
	}
	_, mm, salt := blockRepr(tokens, keys, i, r.bs)
	b := &refBlock{
		key: key, parentKey: r.keyOf(tokens, keys, i), block: id, depth: i + 1,
		tokens: slices.Clone(tokens[i*r.bs : (i+1)*r.bs]), adapter: keys.Adapter, salt: salt, mm: mm,
		lock: 1, last: r.clock, pending: true,
	}
	r.blocks[key] = b
	r.byID[id] = b
	return id, false
}

func (r *refModel) unlock(ids []int32) {
	r.clock++
	for _, id := range ids {
		b := r.byID[id]
		b.lock--
		b.last = r.clock
	}
}

func (r *refModel) hasChild(key string) bool {
	for _, b := range r.blocks {
		if b.parentKey == key {
			return true
		}
	}
	return false
}

func (r *refModel) evict(n int) []int32 {
	var out []int32
	for len(out) < n {
		var best *refBlock
		for _, b := range r.blocks {
			if b.lock > 0 || b.pin > 0 || r.hasChild(b.key) {
				continue
			}
			if best == nil || b.prio < best.prio ||
				(b.prio == best.prio && (b.last < best.last ||
					(b.last == best.last && (b.depth > best.depth ||
						(b.depth == best.depth && b.block < best.block))))) {
				best = b
			}
		}
		if best == nil {
			break
		}
		delete(r.blocks, best.key)
		delete(r.byID, best.block)
		out = append(out, best.block)
	}
	return out
}

// simSeq is a running sequence: the blocks it locks, and of those the
// ones it inserted itself (not found cached).
type simSeq struct{ held, own []int32 }

// sim is an engine driving an Index and the model in lockstep: a pool of
// block ids, running sequences holding locks, pins, events.
type sim struct {
	t      *testing.T
	rng    *rand.Rand
	x      *Index
	ref    *refModel
	free   []int32
	seqs   []simSeq
	pinIDs []PinID
	replay *EventIndex
	sys    [][]int32
	mmHash [2]Hash
}

func newSim(t *testing.T, seed uint64, bs, numBlocks, maxEvents int) *sim {
	x, err := New(Config{BlockSize: bs, NumBlocks: numBlocks, EnableEvents: true, MaxPendingEvents: maxEvents})
	if err != nil {
		t.Fatal(err)
	}
	s := &sim{t: t, rng: rand.New(rand.NewPCG(seed, 99)), x: x, ref: newRef(bs), replay: NewEventIndex()}
	for i := numBlocks - 1; i >= 0; i-- {
		s.free = append(s.free, int32(i))
	}
	for range 4 {
		s.sys = append(s.sys, s.tokens(s.rng.IntN(3*bs+1)))
	}
	s.mmHash = [2]Hash{Sum([]byte("m0")), Sum([]byte("m1"))}
	return s
}

// tokens draws from a small alphabet so prompts collide and share.
func (s *sim) tokens(n int) []int32 { return testtok.Rand(s.rng, n, 3) }

// takeOne removes one element of *list, drawn by r, and returns it; false
// when the list is empty.
func takeOne[T any](r *rand.Rand, list *[]T) (T, bool) {
	var v T
	if len(*list) == 0 {
		return v, false
	}
	j := r.IntN(len(*list))
	v = (*list)[j]
	*list = slices.Delete(*list, j, j+1)
	return v, true
}

func (s *sim) prompt() ([]int32, *Keys) {
	p := append(slices.Clone(s.sys[s.rng.IntN(len(s.sys))]), s.tokens(s.rng.IntN(3*s.x.bs))...)
	if len(p) == 0 {
		p = s.tokens(1)
	}
	k := &Keys{}
	if s.rng.IntN(4) == 0 {
		k.Adapter = 5
	}
	if s.rng.IntN(4) == 0 {
		k.Salt = []byte("t1")
	}
	if s.rng.IntN(4) == 0 {
		off := int32(s.rng.IntN(len(p)))
		n := int32(1 + s.rng.IntN(len(p)-int(off)))
		k.MM = append(k.MM, MMItem{Offset: off, Length: n, Hash: s.mmHash[s.rng.IntN(2)]})
		if end := off + n; int(end) < len(p) && s.rng.IntN(2) == 0 {
			k.MM = append(k.MM, MMItem{Offset: end, Length: 1, Hash: s.mmHash[s.rng.IntN(2)]})
		}
	}
	return p, k
}

func (s *sim) fatalf(format string, args ...any) {
	s.t.Helper()
	s.t.Fatalf(format, args...)
}

func (s *sim) evict(n int) []int32 {
	got := s.x.Evict(nil, n)
	want := s.ref.evict(n)
	if !slices.Equal(got, want) {
		s.fatalf("evict %d: got %v, want %v", n, got, want)
	}
	s.free = append(s.free, got...)
	return got
}

func (s *sim) admit() {
	p, k := s.prompt()
	got, err := s.x.Match(nil, p, k, true)
	if err != nil {
		s.fatalf("match: %v", err)
	}
	want, _ := s.ref.match(p, k)
	if !slices.Equal(got.Blocks, want.Blocks) || got.Tokens != want.Tokens ||
		got.PartialBlock != want.PartialBlock || got.PartialTokens != want.PartialTokens {
		s.fatalf("match %v %+v:\n got %+v\nwant %+v", p, *k, got, want)
	}
	if err := s.x.Lock(got.Blocks); err != nil {
		s.fatalf("lock: %v", err)
	}
	for _, id := range got.Blocks {
		s.ref.byID[id].lock++
	}
	held := slices.Clone(got.Blocks)
	var own []int32
	parent := got.Last
	for i := len(got.Blocks); (i+1)*s.x.bs <= len(p); i++ {
		if len(s.free) == 0 && len(s.evict(1)) == 0 {
			break // out of blocks: the sequence keeps what it has
		}
		id := s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
		res, err := s.x.Insert(parent, p[i*s.x.bs:(i+1)*s.x.bs], k, id)
		if err != nil {
			s.fatalf("insert block %d: %v", i, err)
		}
		wb, wdup := s.ref.insert(p, k, i, id)
		if res.Block != wb || res.Dup != wdup {
			s.fatalf("insert block %d: got %+v, want block %d dup %v", i, res, wb, wdup)
		}
		if res.Dup && res.Block != id {
			s.free = append(s.free, id)
		}
		if !res.Dup {
			own = append(own, id)
		}
		held = append(held, res.Block)
		parent = res.Hash
	}
	s.seqs = append(s.seqs, simSeq{held: held, own: own})
}

// retire releases one to three sequences in one Unlock, as a batched
// retire does: their blocks share a tick, so depth breaks the ties.
func (s *sim) retire() {
	var ids []int32
	for range 1 + s.rng.IntN(3) {
		sq, ok := takeOne(s.rng, &s.seqs)
		if !ok {
			break
		}
		ids = append(ids, sq.held...)
	}
	if err := s.x.Unlock(ids); err != nil {
		s.fatalf("unlock %v: %v", ids, err)
	}
	s.ref.unlock(ids)
}

// commit marks every block computed.
func (s *sim) commit() {
	s.x.Commit()
	for _, b := range s.ref.byID {
		b.pending = false
	}
	if s.x.Pending() != 0 {
		s.fatalf("%d blocks pending after commit", s.x.Pending())
	}
}

// abort retires one sequence before its forward pass: it unlocks its
// blocks and drops those it inserted that are still pending, with every
// block below them. Blocks other sequences lock go too (the index
// reports their locks); the sim then forgets them in those sequences
// and frees them, as the index no longer knows them.
func (s *sim) abort() {
	sq, ok := takeOne(s.rng, &s.seqs)
	if !ok {
		return
	}
	if err := s.x.Unlock(sq.held); err != nil {
		s.fatalf("unlock %v: %v", sq.held, err)
	}
	s.ref.unlock(sq.held)
	// The model's drop: own pending blocks and everything below them.
	gone := map[string]bool{}
	for _, id := range sq.own {
		if b, ok := s.ref.byID[id]; ok && b.pending {
			gone[b.key] = true
		}
	}
	for changed := true; changed; {
		changed = false
		for _, b := range s.ref.blocks {
			if !gone[b.key] && gone[b.parentKey] {
				gone[b.key] = true
				changed = true
			}
		}
	}
	got, err := s.x.DropPending(sq.own, nil)
	if err != nil {
		s.fatalf("drop pending %v: %v", sq.own, err)
	}
	if len(got) != len(gone) {
		s.fatalf("drop pending %v: dropped %v, the model drops %d blocks", sq.own, got, len(gone))
	}
	for k, d := range got {
		b, ok := s.ref.byID[d.Block]
		if !ok || !gone[b.key] || int(d.Locks) != b.lock {
			s.fatalf("drop pending: dropped %+v, model %+v", d, b)
		}
		if k > 0 && s.ref.byID[got[k-1].Block].depth < b.depth {
			s.fatalf("drop pending: %v is not deepest first", got)
		}
	}
	for _, d := range got {
		b := s.ref.byID[d.Block]
		delete(s.ref.blocks, b.key)
		delete(s.ref.byID, d.Block)
		for i := range s.seqs {
			s.seqs[i].held = slices.DeleteFunc(s.seqs[i].held, func(id int32) bool { return id == d.Block })
		}
		s.free = append(s.free, d.Block)
	}
}

// coversPath checks the result of a call over a prompt's cached prefix
// (what: Pin, SetPriority) whose model path is path: NotFound when
// nothing of it is cached, else all of it (n blocks). It reports whether
// the path is not empty.
func (s *sim) coversPath(what string, path []*refBlock, n int, err error) bool {
	s.t.Helper()
	if len(path) == 0 {
		if kverr.CodeOf(err) != kverr.NotFound {
			s.fatalf("%s of an uncached prefix: %v", what, err)
		}
		return false
	}
	if err != nil || n != len(path) {
		s.fatalf("%s: %d blocks, %v; want %d", what, n, err, len(path))
	}
	return true
}

func (s *sim) pin() {
	p, k := s.prompt()
	id, n, err := s.x.Pin(p, k)
	path := s.ref.chain(p, k, len(p)/s.x.bs)
	for i, b := range path {
		if b.pending { // a pin covers computed blocks only
			path = path[:i]
			break
		}
	}
	if !s.coversPath("pin", path, n, err) {
		return
	}
	var keys []string
	for _, b := range path {
		b.pin++
		keys = append(keys, b.key)
	}
	s.ref.pins[id] = keys
	s.pinIDs = append(s.pinIDs, id)
}

func (s *sim) unpin() {
	id, ok := takeOne(s.rng, &s.pinIDs)
	if !ok {
		return
	}
	if err := s.x.Unpin(id); err != nil {
		s.fatalf("unpin %d: %v", id, err)
	}
	for _, key := range s.ref.pins[id] {
		s.ref.blocks[key].pin--
	}
	delete(s.ref.pins, id)
	if err := s.x.Unpin(id); kverr.CodeOf(err) != kverr.NotFound {
		s.fatalf("second unpin %d: %v", id, err)
	}
}

func (s *sim) setPriority() {
	p, k := s.prompt()
	prio := int32(s.rng.IntN(4) - 1)
	n, err := s.x.SetPriority(p, k, prio)
	path := s.ref.chain(p, k, len(p)/s.x.bs)
	if !s.coversPath("set priority", path, n, err) {
		return
	}
	for _, b := range path {
		b.prio = prio
	}
}

func (s *sim) clear() {
	ids, err := s.x.Clear(nil)
	locked := false
	for _, b := range s.ref.byID {
		locked = locked || b.lock > 0
	}
	if locked {
		if err == nil || len(ids) != 0 {
			s.fatalf("clear with running sequences: %v, %v", ids, err)
		}
		return
	}
	if err != nil {
		s.fatalf("clear: %v", err)
	}
	want := make([]int32, 0, len(s.ref.byID))
	for id := range s.ref.byID {
		want = append(want, id)
	}
	slices.Sort(want)
	slices.Sort(ids)
	if !slices.Equal(ids, want) {
		s.fatalf("clear: got %v, want %v", ids, want)
	}
	s.free = append(s.free, ids...)
	s.ref.blocks, s.ref.byID, s.ref.pins = map[string]*refBlock{}, map[int32]*refBlock{}, map[PinID][]string{}
	s.pinIDs = nil
}

// badUnlock tries an unlock that must fail and change nothing.
func (s *sim) badUnlock() {
	for id, b := range s.ref.byID {
		ids := slices.Repeat([]int32{id}, b.lock+1)
		if err := s.x.Unlock(ids); err == nil {
			s.fatalf("unlock of block %d %d times (lock %d): no error", id, len(ids), b.lock)
		}
		return
	}
}

func (s *sim) drain() {
	for {
		max := 0
		if s.rng.IntN(2) == 0 {
			max = 1 + s.rng.IntN(8)
		}
		evs := s.x.DrainEvents(max)
		if len(evs) == 0 {
			return
		}
		for _, ev := range evs {
			if err := s.replay.Apply(ev); err != nil {
				s.fatalf("replay: %v", err)
			}
		}
		if s.rng.IntN(3) == 0 {
			return // leave some pending
		}
	}
}

func (s *sim) check() {
	if err := s.x.CheckInvariants(); err != nil {
		s.fatalf("%v", err)
	}
	if s.x.Len() != len(s.ref.blocks) {
		s.fatalf("index caches %d blocks, model %d", s.x.Len(), len(s.ref.blocks))
	}
	for id, b := range s.ref.byID {
		i := s.x.byBlock[id]
		if i == nilNode {
			s.fatalf("block %d is not cached", id)
		}
		n := &s.x.nodes[i]
		if b.pending != s.x.IsPending(id) {
			s.fatalf("block %d: pending %v in the index, %v in the model", id, s.x.IsPending(id), b.pending)
		}
		if int(n.lock) != b.lock || int(n.pin) != b.pin || n.prio != b.prio || n.last != b.last || int(n.depth) != b.depth {
			s.fatalf("block %d: index %v prio %d last %d, model lock %d pin %d prio %d last %d depth %d",
				id, *n, n.prio, n.last, b.lock, b.pin, b.prio, b.last, b.depth)
		}
	}
	// Evictable: blocks with no lock or pin on themselves or a descendant.
	held := map[string]bool{}
	for _, b := range s.ref.blocks {
		if b.lock > 0 || b.pin > 0 {
			for k := b; k != nil && !held[k.key]; k = s.ref.blocks[k.parentKey] {
				held[k.key] = true
			}
		}
	}
	if got, want := s.x.Evictable(), len(s.ref.blocks)-len(held); got != want {
		s.fatalf("evictable %d, model %d", got, want)
	}
	if len(s.free)+len(s.ref.byID) != len(s.x.byBlock) {
		s.fatalf("%d free + %d cached != %d blocks: a block leaked", len(s.free), len(s.ref.byID), len(s.x.byBlock))
	}
}

// checkReplay drains everything and compares the replayed set.
func (s *sim) checkReplay() {
	for _, ev := range s.x.DrainEvents(0) {
		if err := s.replay.Apply(ev); err != nil {
			s.fatalf("replay: %v", err)
		}
	}
	got := s.replay.Hashes(nil)
	want := s.x.CachedHashes(nil)
	slices.SortFunc(got, func(a, b Hash) int { return strings.Compare(a.String(), b.String()) })
	slices.SortFunc(want, func(a, b Hash) int { return strings.Compare(a.String(), b.String()) })
	if !slices.Equal(got, want) {
		s.fatalf("replayed events give %d blocks, the index caches %d", len(got), len(want))
	}
}

func TestModel(t *testing.T) {
	steps := 4000
	if testing.Short() {
		steps = 1000
	}
	for seed := range uint64(6) {
		bs := []int{1, 2, 4}[seed%3]
		maxEvents := 0
		if seed%2 == 1 {
			maxEvents = 1 // raised to numBlocks+1: overflows and resyncs often
		}
		t.Run(fmt.Sprintf("seed%d_bs%d", seed, bs), func(t *testing.T) {
			s := newSim(t, seed, bs, 40, maxEvents)
			for range steps {
				switch r := s.rng.IntN(100); {
				case r < 35:
					s.admit()
				case r < 65:
					s.retire()
				case r < 70:
					s.abort()
				case r < 75:
					s.commit()
				case r < 80:
					s.evict(1 + s.rng.IntN(4))
				case r < 84:
					s.pin()
				case r < 88:
					s.unpin()
				case r < 91:
					s.setPriority()
				case r < 92:
					s.clear()
				case r < 94:
					s.badUnlock()
				default:
					s.drain()
				}
				s.check()
			}
			s.checkReplay()
			t.Logf("%+v pins %d", s.x.Stats(), len(s.pinIDs))
			if st := s.x.Stats(); st.Inserts == 0 || st.HitTokens == 0 || st.Evictions == 0 || st.Dedups == 0 || (bs > 1 && st.PartialTokens == 0) || st.DroppedPending == 0 {
				t.Fatalf("the walk missed a path: %+v", st)
			}
			if maxEvents == 1 && s.x.Stats().EventsDropped == 0 {
				t.Fatal("the small event queue never overflowed")
			}
		})
	}
}
