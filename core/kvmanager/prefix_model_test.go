package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
)

// The prefix cache's reference model: a dict from chained block hash (the
// identity of a prefix of full blocks) to the block that caches it. It
// predicts what every call matches, when it runs out of blocks, how many
// blocks it evicts and which blocks it stores; it learns which blocks were
// evicted from the manager's KV events, and checks that each was
// evictable. Block ids are learned from Describe and checked for
// consistency.

type pnode struct {
	block   int32 // -1 until learned
	parent  prefix.Hash
	holders int // live sequences whose table holds the block
	pins    int
}

type pseq struct {
	tokens    []int32 // all tokens while cacheable; the known prefix after
	keys      *prefix.Keys
	cacheable bool
	length    int
	blocks    []int32 // learned from Describe after every call
}

type pmodel struct {
	t         *testing.T
	m         *Manager
	bs        int
	numBlocks int
	seqs      map[int64]*pseq
	cached    map[prefix.Hash]*pnode
	pins      map[uint64][]prefix.Hash
	replay    *prefix.EventIndex
	hasher    prefix.Hasher
	events    []prefix.Event // drained, not yet explained
	learn     []learnAt      // new nodes whose block is the owner's table entry
}

type learnAt struct {
	h   prefix.Hash
	seq int64
	pos int
}

func (md *pmodel) chain(tokens []int32, keys *prefix.Keys) []prefix.Hash {
	c, err := md.hasher.Chain(nil, tokens, md.bs, keys)
	if err != nil {
		md.t.Fatal(err)
	}
	return c
}

// held returns the cached hashes a holder or pin keeps, with their
// ancestors.
func (md *pmodel) held() map[prefix.Hash]bool {
	h := map[prefix.Hash]bool{}
	for k, n := range md.cached {
		if n.holders > 0 || n.pins > 0 {
			for ; !k.IsZero() && !h[k]; k = md.cached[k].parent {
				h[k] = true
			}
		}
	}
	return h
}

// free is the pool's free count: blocks neither held by a sequence nor cached.
func (md *pmodel) free() int {
	used := map[int32]bool{}
	for _, s := range md.seqs {
		for _, b := range s.blocks {
			used[b] = true
		}
	}
	for _, n := range md.cached {
		used[n.block] = true
	}
	return md.numBlocks - len(used)
}

// matchLen returns how many full blocks of a prompt are cached, up to the
// block before the one holding its last token.
func (md *pmodel) matchLen(chain []prefix.Hash, promptLen int) int {
	k := 0
	for k < (promptLen-1)/md.bs && md.cached[chain[k]] != nil {
		k++
	}
	return k
}

// next pops the oldest unexplained event.
func (md *pmodel) next(where string) prefix.Event {
	if len(md.events) == 0 {
		md.t.Fatalf("%s: an event was expected, none is pending", where)
	}
	ev := md.events[0]
	md.events = md.events[1:]
	if err := md.replay.Apply(ev); err != nil {
		md.t.Fatalf("%s: event %v does not replay: %v", where, ev.Kind, err)
	}
	return ev
}

// evicted explains the eviction of want blocks: one BlockRemoved event
// naming that many blocks, each evictable given held.
func (md *pmodel) evicted(where string, want int, held map[prefix.Hash]bool) {
	if want <= 0 {
		return
	}
	ev := md.next(where)
	if ev.Kind != prefix.BlockRemoved || len(ev.Hashes) != want {
		md.t.Fatalf("%s: want %d blocks evicted, got a %v event of %d", where, want, ev.Kind, len(ev.Hashes))
	}
	for _, h := range ev.Hashes {
		n := md.cached[h]
		if n == nil || held[h] || n.holders > 0 || n.pins > 0 {
			md.t.Fatalf("%s: evicted %s, which was not evictable (%+v, held %v)", where, h, n, held[h])
		}
		delete(md.cached, h)
	}
}

// insert predicts the insertion of seq id's full blocks [from, to): a
// stored event for each new one; a duplicate stays private; a missing
// parent makes the sequence private from there on.
func (md *pmodel) insert(where string, id int64, s *pseq, from, to int) {
	if !s.cacheable || from >= to {
		return
	}
	chain := md.chain(s.tokens, s.keys)
	for i := from; i < to; i++ {
		var parent prefix.Hash
		if i > 0 {
			parent = chain[i-1]
			if md.cached[parent] == nil {
				s.cacheable = false
				s.tokens = s.tokens[:i*md.bs]
				return
			}
		}
		if md.cached[chain[i]] != nil {
			continue // a duplicate: the sequence's block stays private
		}
		ev := md.next(where)
		if ev.Kind != prefix.BlockStored || ev.Hash != chain[i] || ev.Parent != parent {
			md.t.Fatalf("%s: want block %d of sequence %d stored as %s, got %v %s", where, i, id, chain[i], ev.Kind, ev.Hash)
		}
		md.cached[chain[i]] = &pnode{block: -1, parent: parent, holders: 1}
		md.learn = append(md.learn, learnAt{chain[i], id, i})
	}
}

func (md *pmodel) drain() {
	evs, err := md.m.DrainEvents(NoEventLimits)
	if err != nil {
		md.t.Fatal(err)
	}
	md.events = evs
}

func (md *pmodel) admit(ids []int64, prompts [][]int32, keys []*prefix.Keys) {
	p := Prompts{Offsets: []int64{0}}
	anyKeys := false
	for i, t := range prompts {
		p.Tokens = append(p.Tokens, t...)
		p.Offsets = append(p.Offsets, int64(len(p.Tokens)))
		anyKeys = anyKeys || keys[i] != nil
	}
	if anyKeys {
		for _, k := range keys {
			if k == nil {
				k = &prefix.Keys{}
			}
			p.Keys = append(p.Keys, *k)
		}
	}
	matched := make([]int32, len(ids))
	n, err := md.m.Admit(ids, p, matched)
	if err != nil {
		md.t.Fatalf("admit: %v", err)
	}
	md.drain()
	free := md.free()
	for i, id := range ids {
		where := fmt.Sprintf("admit %d (%d of %d)", id, i, len(ids))
		chain := md.chain(prompts[i], keys[i])
		k := md.matchLen(chain, len(prompts[i]))
		held := md.held()
		nowHeld := 0
		for _, h := range chain[:k] {
			if !held[h] {
				nowHeld++
			}
		}
		need := (len(prompts[i])+md.bs-1)/md.bs - k
		if need > free+len(md.cached)-len(held)-nowHeld {
			if n != i {
				md.t.Fatalf("%s: admitted %d; the model says it stops at %d", where, n, i)
			}
			break
		}
		if i >= n {
			md.t.Fatalf("%s: admitted only %d; the model says this one fits", where, n)
		}
		if int(matched[i]) != k*md.bs {
			md.t.Fatalf("%s: matched %d tokens, the model says %d", where, matched[i], k*md.bs)
		}
		for _, h := range chain[:k] {
			held[h] = true
			md.cached[h].holders++
		}
		md.evicted(where, need-free, held)
		free = max(free-need, 0)
		s := &pseq{tokens: slices.Clone(prompts[i]), keys: keys[i].Clone(), cacheable: true, length: len(prompts[i])}
		md.seqs[id] = s
		md.insert(where, id, s, k, len(prompts[i])/md.bs)
	}
}

// growBatch predicts Grow (tokens nil) or GrowTokens.
func (md *pmodel) growBatch(ids []int64, counts []int32, tokens [][]int32) {
	need := 0
	for i, id := range ids {
		s := md.seqs[id]
		need += (s.length+int(counts[i])+md.bs-1)/md.bs - (s.length+md.bs-1)/md.bs
	}
	held := md.held()
	avail := md.free() + len(md.cached) - len(held)
	var err error
	if tokens == nil {
		err = md.m.Grow(ids, counts)
	} else {
		err = md.m.GrowTokens(ids, counts, slices.Concat(tokens...))
	}
	md.drain()
	if need > avail {
		wantCode(md.t, "grow past the pool", err, kverr.OutOfBlocks)
		return
	}
	if err != nil {
		md.t.Fatalf("grow: %v", err)
	}
	md.evicted("grow", need-md.free(), held)
	for i, id := range ids {
		s := md.seqs[id]
		oldFull := s.length / md.bs
		s.length += int(counts[i])
		if tokens == nil {
			if counts[i] > 0 {
				s.cacheable = false
			}
			continue
		}
		if s.cacheable {
			s.tokens = append(s.tokens, tokens[i]...)
		}
		md.insert("grow tokens", id, s, oldFull, s.length/md.bs)
	}
}

func (md *pmodel) fork(parent int64, children []int64) {
	p := md.seqs[parent]
	partial := p.length%md.bs != 0
	held := md.held()
	avail := md.free() + len(md.cached) - len(held)
	copies := make([]CopyPair, len(children))
	_, err := md.m.Fork(parent, children, copies)
	md.drain()
	if partial && len(children) > avail {
		wantCode(md.t, "fork past the pool", err, kverr.OutOfBlocks)
		return
	}
	if err != nil {
		md.t.Fatalf("fork: %v", err)
	}
	if partial {
		md.evicted("fork", len(children)-md.free(), held)
	}
	full := p.length / md.bs
	for _, c := range children {
		md.seqs[c] = &pseq{tokens: slices.Clone(p.tokens), keys: p.keys, cacheable: p.cacheable, length: p.length,
			blocks: slices.Clone(p.blocks[:full])} // learned again below
		for _, b := range p.blocks[:full] {
			for _, n := range md.cached {
				if n.block == b {
					n.holders++
				}
			}
		}
	}
}

func (md *pmodel) remove(ids []int64) {
	must(md.t, md.m.Remove(ids))
	md.drain()
	for _, id := range ids {
		for _, b := range md.seqs[id].blocks {
			for _, n := range md.cached {
				if n.block == b {
					n.holders--
				}
			}
		}
		delete(md.seqs, id)
	}
}

// learnTables reads every live table and checks the model against it.
func (md *pmodel) verify(where string) {
	t := md.t
	if len(md.events) > 0 {
		t.Fatalf("%s: %d events the model did not expect, the first %v", where, len(md.events), md.events[0].Kind)
	}
	if err := md.m.CheckInvariants(); err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	for id, s := range md.seqs {
		s.blocks = blocksOf(t, md.m, id, 1<<12)
	}
	for _, l := range md.learn {
		md.cached[l.h].block = md.seqs[l.seq].blocks[l.pos]
	}
	md.learn = md.learn[:0]
	holders := map[int32]int{}
	for id, s := range md.seqs {
		chain := md.chain(s.tokens, s.keys)
		for j, b := range s.blocks {
			holders[b]++
			if h, ok := md.m.cache.BlockHash(b); ok {
				if j >= len(chain) || chain[j] != h {
					t.Fatalf("%s: sequence %d holds cached block %d (%s) at position %d, which its tokens do not hash to", where, id, b, h, j)
				}
			}
		}
	}
	zeroRef := 0
	for h, n := range md.cached {
		if b, ok := md.m.cache.Lookup(h); !ok || b != n.block {
			t.Fatalf("%s: model caches %s in block %d, the manager in %d (%v)", where, h, n.block, b, ok)
		}
		if holders[n.block] != n.holders {
			t.Fatalf("%s: cached block %d has %d holders in the tables, %d in the model", where, n.block, holders[n.block], n.holders)
		}
		if !md.replay.Contains(h) {
			t.Fatalf("%s: the event replay lacks cached block %s", where, h)
		}
		if n.holders == 0 {
			zeroRef++
		}
	}
	st := md.m.Stats()
	ps := md.m.PrefixStats()
	if ps.CachedBlocks != len(md.cached) || md.replay.Len() != len(md.cached) || st.CachedBlocks != zeroRef || st.FreeBlocks != md.free() {
		t.Fatalf("%s: cache %d, replay %d, model %d; pool cached %d, model %d; free %d, model %d",
			where, ps.CachedBlocks, md.replay.Len(), len(md.cached), st.CachedBlocks, zeroRef, st.FreeBlocks, md.free())
	}
	if held := md.held(); ps.EvictableBlocks != len(md.cached)-len(held) {
		t.Fatalf("%s: %d evictable, the model says %d", where, ps.EvictableBlocks, len(md.cached)-len(held))
	}
}

func TestPrefixCacheAgainstModel(t *testing.T) {
	for _, c := range []struct{ bs, numBlocks, vocab int }{{1, 48, 3}, {2, 40, 3}, {4, 64, 4}, {16, 24, 50}} {
		for seed := range uint64(4) {
			t.Run(fmt.Sprintf("bs%d/seed%d", c.bs, seed), func(t *testing.T) {
				runPrefixModel(t, c.bs, c.numBlocks, c.vocab, seed, 600)
			})
		}
	}
}

func runPrefixModel(t *testing.T, bs, numBlocks, vocab int, seed uint64, steps int) {
	r := rand.New(rand.NewPCG(seed, uint64(bs)))
	md := &pmodel{t: t, m: newCached(t, numBlocks, bs, true), bs: bs, numBlocks: numBlocks,
		seqs: map[int64]*pseq{}, cached: map[prefix.Hash]*pnode{}, pins: map[uint64][]prefix.Hash{}, replay: prefix.NewEventIndex()}
	toks := func(n int) []int32 {
		t := make([]int32, n)
		for i := range t {
			t[i] = r.Int32N(int32(vocab))
		}
		return t
	}
	// Shared system prompts make prefixes recur.
	var systems [][]int32
	for range 4 {
		systems = append(systems, toks(r.IntN(3*bs)+bs))
	}
	salts := []*prefix.Keys{nil, {Salt: []byte("tenant")}, {Adapter: 3}}
	prompt := func() ([]int32, *prefix.Keys) {
		p := append(slices.Clone(systems[r.IntN(len(systems))]), toks(r.IntN(2*bs)+1)...)
		return p, salts[r.IntN(len(salts))]
	}
	live := func() []int64 {
		ids := make([]int64, 0, len(md.seqs))
		for id := range md.seqs {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		r.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
		return ids
	}
	nextID := int64(1)
	for step := range steps {
		where := fmt.Sprintf("step %d", step)
		switch op := r.IntN(20); {
		case op < 6: // admit
			k := r.IntN(3) + 1
			var ids []int64
			var ps [][]int32
			var ks []*prefix.Keys
			for range k {
				p, key := prompt()
				ids, ps, ks = append(ids, nextID), append(ps, p), append(ks, key)
				nextID++
			}
			md.admit(ids, ps, ks)
			// The step's forward pass: the model keeps every removed
			// sequence's blocks cached, so each admission or grow is
			// followed by MarkComputed before any removal (computed.go).
			md.m.MarkComputed()
		case op < 11 && len(md.seqs) > 0: // decode or extend, with tokens
			ids := live()[:r.IntN(min(len(md.seqs), 4))+1]
			counts := make([]int32, len(ids))
			tokens := make([][]int32, len(ids))
			for i := range ids {
				counts[i] = int32(r.IntN(bs + 2))
				tokens[i] = toks(int(counts[i]))
			}
			md.growBatch(ids, counts, tokens)
			md.m.MarkComputed() // the step's forward pass, as after admit
		case op < 12 && len(md.seqs) > 0: // grow without tokens
			ids := live()[:1]
			md.growBatch(ids, []int32{int32(r.IntN(bs) + 1)}, nil)
			md.m.MarkComputed() // the step's forward pass, as after admit
		case op < 13 && len(md.seqs) > 0:
			children := []int64{nextID, nextID + 1}[:r.IntN(2)+1]
			nextID += 2
			md.fork(live()[0], children)
		case op < 17 && len(md.seqs) > 0:
			md.remove(live()[:r.IntN(min(len(md.seqs), 3))+1])
		case op == 17: // pin or unpin a system prompt
			if len(md.pins) > 0 && r.IntN(2) == 0 {
				for id, hs := range md.pins {
					must(t, md.m.Unpin(id))
					for _, h := range hs {
						md.cached[h].pins--
					}
					delete(md.pins, id)
					break
				}
				break
			}
			p := systems[r.IntN(len(systems))]
			chain := md.chain(p, nil)
			k := 0
			for k < len(chain) && md.cached[chain[k]] != nil {
				k++
			}
			id, n, err := md.m.Pin(p, nil)
			if k == 0 {
				wantCode(t, where+": pin of an uncached prefix", err, kverr.NotFound)
				break
			}
			if err != nil || n != k {
				t.Fatalf("%s: pinned %d blocks (%v), the model says %d", where, n, err, k)
			}
			for _, h := range chain[:k] {
				md.cached[h].pins++
			}
			md.pins[id] = chain[:k]
		case op == 18: // match
			p, key := prompt()
			pr := one(p, key)
			out := make([]MatchInfo, 1)
			must(t, md.m.Match(pr, r.IntN(2) == 0, out))
			if want := md.matchLen(md.chain(p, key), len(p)) * bs; int(out[0].Tokens) != want {
				t.Fatalf("%s: matched %d tokens, the model says %d", where, out[0].Tokens, want)
			}
		case op == 19 && r.IntN(4) == 0: // clear
			busy := false
			for _, n := range md.cached {
				busy = busy || n.holders > 0
			}
			_, err := md.m.ClearPrefixCache()
			md.drain()
			if busy {
				wantCode(t, where+": clear while sequences hold cached blocks", err, kverr.InvalidArgument)
				break
			}
			must(t, err)
			if ev := md.next(where); ev.Kind != prefix.AllCleared {
				t.Fatalf("%s: clear recorded %v", where, ev.Kind)
			}
			clear(md.cached)
			clear(md.pins)
		}
		md.verify(where)
	}
	ps := md.m.PrefixStats()
	if ps.HitTokens == 0 || ps.Evictions == 0 || ps.Inserts == 0 {
		t.Fatalf("the run never hit, evicted or inserted: %+v", ps)
	}
}
