package kvmanager

import (
	"math"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/blocks"
)

// The prefix cache over layer groups.
//
// The index (package prefix) keeps group 0's blocks: a cached node is a
// group-0 block. Each node has, in every other attention group, the block
// holding the same tokens, its companion, which the sequence that filled
// the node filled at the same index: a full-attention group's companion
// lives and dies with its node; a sliding-window group's may be gone
// earlier, since a window group can give its blocks back.
//
// A prompt hits up to its longest cached prefix of h blocks for which
// every window group still has the companions its next query reads: those
// of the blocks holding tokens [h*bs - W + 1, h*bs) (hitBlocks). The
// admitted sequence takes group 0's h blocks and those companions; its
// window tables start with the entries before them dropped, as if it had
// slid past them itself.
//
// A companion whose sequences all dropped it or ended is Cached in the
// pool (retained, reference 0): free for an allocation that evicts it.
// Window companions are evicted on their own, by class and then least
// recently released first:
//   - behind: a block its sequence's window slid past with no hit point
//     (the end of an earlier match) within its window after it. Only a
//     prompt that diverges right there could use it: the interior of a
//     conversation. These go first, before any node;
//   - kept: a block released when its sequence ended, or one that the
//     window of a hit point reads. A conversation's next turn or a shared
//     system prompt's next user hits there. These go after every node
//     the index can evict (which takes its companions with it).
//
// Evicting the window blocks at the hit points that matter last is what
// keeps a window model's hits under pressure: a pool that evicts blocks
// by age alone drops a finished conversation's last window blocks (its
// most recent) together with its first ones, and its next turn cannot hit
// even though group 0 still holds every block.
//
// Recurrent states. A recurrent group's companion of a node is a
// checkpoint: the state after the node's last token, kept in a block of
// its own. The state exists on the GPU only at the end of a step, so a
// checkpoint is taken where a sequence's step ends at the end of a cached
// block whose number is a multiple of the group's CheckpointEvery: at
// MarkComputed (the step's forward pass is launched) the manager allocates
// the checkpoint blocks, if the pool has them to spare, and queues the
// copies of the sequence's states into them. A prompt hits only up to a checkpoint,
// and its sequence's new state block gets a copy from the checkpoint,
// queued behind the checkpoint's own copy: the engine performs the queue
// (TakeCopies) in order on the step's stream before the forward pass, so
// a hit never starts from a state that is not there. A queued copy holds
// a reference on both its blocks until TakeCopies hands it out (pin), so
// no eviction, removal or clear frees or reuses them before the engine
// performs it. Checkpoints are taken only once the engine has called
// TakeCopies, which tells the manager that it performs them. A node's
// state is its checkpoints of every recurrent group: only all of them
// together resume a hit, so a node is given checkpoints only when every
// group's interval divides its number and the pool spares a block for
// each. A sequence whose block is a private copy of a cached
// twin (it computed a prefix that was cached but had no state) gives the
// twin the state, so a prefix whose states were evicted gets them back
// from the next prompt that computes it.
//
// Eviction with recurrent groups. A prompt resumes from the last state at
// or before its match, so what a node is worth depends on the states at it
// and below it:
//   - a checkpoint of a node without a whole state (partial) is worth
//     nothing: it goes first;
//   - a node without a whole state is marked spent in the index
//     (prefix.Index.SetSpent); once no cached block is below it, it is
//     worth nothing either: no match ending in it or past it can resume
//     there. Spent leaves go next, with their companions, before any other
//     node; evicting one may leave its parent a spent leaf, which goes in
//     turn;
//   - a state at an inner node -- one cached block below it, a whole
//     state somewhere below that, and no match ended there -- serves only
//     a prompt that diverges between it and the next state down its chain:
//     the chain's deepest state (no state below it, whether or not
//     stateless blocks are, such as those a live sequence fills past its
//     last checkpoint) resumes every prompt that follows the chain, and a
//     branch (two or more blocks below) or a hit point is where prompts
//     did diverge (a shared system prompt's end, a conversation's turn).
//     Inner states go next, the least recently released first, each
//     node's checkpoints together, their nodes left spent;
//   - then nodes in the index's order, each with its companions; then the
//     states at chain ends (leaves, or a last state above stateless blocks)
//     whose nodes cannot go (locked, or with blocks below), each state
//     whole; and last the shared states, at branches and hit points. A
//     chain's end whose node cannot go is mostly a live sequence's latest
//     state, which serves that sequence alone, should it be preempted; a
//     shared state serves every prompt through it, such as a system
//     prompt's end, which many live sequences hold: taken by age with the
//     chain ends, it went first (it is listed at the hit's copy, and every
//     live sequence's step lists a newer state), and each prompt after it
//     missed the whole system prompt under pressure.
// (groupCache.below counts, for each node, its children with a whole state
// at or below them, kept up as states are taken and evicted and nodes go,
// so that a state's class needs no walk down the tree.)
// Keeping the states at chain ends, branches and hit points instead of one
// per block is what keeps a recurrent model's hits under pressure: with a
// checkpoint every block and three recurrent groups the states take three
// blocks for every block of K/V, and a pool that evicts them only with
// their nodes, by age, loses whole conversations (and a shared system
// prompt's end) to states no prompt will resume from. bench/RESULTS.md
// ("Recurrent hybrids under pressure") has the hit rates.

// KV events. With events on, every group's cached blocks are announced
// (prefix.Event.Group): a companion's BlockStored when it is registered
// (with its node, or a checkpoint when it is taken), carrying its node's
// hash and fields, and its BlockRemoved when it goes, with its node or on
// its own (a window companion or a checkpoint evicted). A consumer that
// mirrors every group's set from the events computes exactly the hit
// hitBlocks gives a prompt: group 0's longest cached prefix, cut where a
// window group lacks a block its next query reads or a recurrent group
// lacks a checkpoint. Snapshots list the companions after the nodes
// (prefix.GroupSource); ClearPrefixCache's AllCleared covers them.

// The classes of a Cached companion: a window block behind its sequence or
// kept; a checkpoint of a partial state, of a state at an inner node, of a
// kept state at a chain's end, or of a shared state (a hit point or a
// branch).
const (
	compNone = iota // not listed
	compBehind
	compKept
	compPartial
	compInner
	compShared // a recurrent state at a hit point or a branch: evicted last
	numClasses
)

// groupCache is the companions of the index's nodes.
type groupCache struct {
	// comp[g][b] is cached block b's companion in group g+1, or NoBlock.
	comp [][]int32
	// owner[c] is the node companion c belongs to (NoBlock: c is none),
	// ownerGroup[c] its group, less one.
	owner      []int32
	ownerGroup []uint8
	// Evictable companions, one least-recently-released list per class,
	// threaded through prev/next (NoBlock ends a list).
	class      []uint8
	prev, next []int32
	head, tail [numClasses]int32
	listed     int
	// hitPoint[b]: a match ended at node b; the window blocks its next
	// query reads are kept.
	hitPoint []bool
	// fullExtra counts the full-attention groups past group 0: every
	// evictable node frees that many companions with it.
	fullExtra int
	// up[b] is cached block b's parent block (NoBlock: a first block),
	// kept with recurrent groups, whose states' classes change with their
	// nodes' children (restate) when a child goes. below[b] counts b's
	// children with a whole state at or below them (0 for a block not
	// cached): b's state is inner only with a state below it (stateClass).
	up    []int32
	below []int32
	// Checkpoints to take at the next MarkComputed; takes: the engine has
	// called TakeCopies.
	cands []checkpoint
	takes bool
	// owned counts the registered companions (owner != NoBlock); events:
	// KV events are on, and gone[g] gathers the hashes of group g+1's
	// companions a call removes, for one BlockRemoved per group.
	owned  int
	events bool
	gone   [][]prefix.Hash
}

// checkpoint is a sequence whose step ended, at length tokens, at the end
// of a block where every recurrent group keeps a checkpoint; hash is the
// block's (its own, or its cached twin's).
type checkpoint struct {
	id     int64
	s      *seq // the sequence itself: an id removed and admitted again in the step is another sequence
	length int
	hash   prefix.Hash
}

// maxQueuedCopies bounds the copies waiting for TakeCopies: an engine that
// never takes them gets no new checkpoints (and so no recurrent hits).
const maxQueuedCopies = 1 << 16

func newGroupCache(numBlocks int, gs *groupSet) *groupCache {
	gc := &groupCache{
		comp:       make([][]int32, len(gs.extra)),
		owner:      make([]int32, numBlocks),
		ownerGroup: make([]uint8, numBlocks),
		class:      make([]uint8, numBlocks),
		prev:       make([]int32, numBlocks),
		next:       make([]int32, numBlocks),
		hitPoint:   make([]bool, numBlocks),
	}
	gc.gone = make([][]prefix.Hash, len(gs.extra))
	for g, grp := range gs.extra {
		gc.comp[g] = make([]int32, numBlocks)
		fillNoBlock(gc.comp[g])
		if grp.Kind == FullAttention {
			gc.fullExtra++
		}
	}
	fillNoBlock(gc.owner)
	if gs.states > 0 {
		gc.up = make([]int32, numBlocks)
		fillNoBlock(gc.up)
		gc.below = make([]int32, numBlocks)
	}
	for c := range gc.head {
		gc.head[c], gc.tail[c] = NoBlock, NoBlock
	}
	return gc
}

func (gc *groupCache) push(c int32, class uint8) {
	gc.class[c] = class
	gc.next[c] = NoBlock
	gc.prev[c] = gc.tail[class]
	if t := gc.tail[class]; t != NoBlock {
		gc.next[t] = c
	} else {
		gc.head[class] = c
	}
	gc.tail[class] = c
	gc.listed++
}

func (gc *groupCache) unlist(c int32) {
	cl := gc.class[c]
	if cl == compNone {
		return
	}
	p, n := gc.prev[c], gc.next[c]
	if p != NoBlock {
		gc.next[p] = n
	} else {
		gc.head[cl] = n
	}
	if n != NoBlock {
		gc.prev[n] = p
	} else {
		gc.tail[cl] = p
	}
	gc.class[c] = compNone
	gc.listed--
}

// NumGroups, GroupLen and GroupHolds list the companions for the index's
// snapshots (prefix.GroupSource), under the manager's lock.
func (gc *groupCache) NumGroups() int                     { return len(gc.comp) + 1 }
func (gc *groupCache) GroupLen() int                      { return gc.owned }
func (gc *groupCache) GroupHolds(g int, block int32) bool { return gc.comp[g-1][block] != NoBlock }

// register records c as node b's companion in group g+1 and announces it.
func (m *Manager) register(c, b int32, g int) {
	gc := m.gc
	gc.comp[g][b] = c
	gc.owner[c] = b
	gc.ownerGroup[c] = uint8(g)
	gc.owned++
	if gc.events {
		assertOK(m.cache.RecordGroupStored(g+1, b), "announcing a cached block's companion")
	}
}

// forget unregisters companion c; with events on, h is its node's hash,
// whose BlockRemoved in c's group flushGone records.
func (m *Manager) forget(c int32, h prefix.Hash) {
	gc := m.gc
	gc.unlist(c)
	g := gc.ownerGroup[c]
	gc.comp[g][gc.owner[c]] = NoBlock
	gc.owner[c] = NoBlock
	gc.owned--
	if gc.events {
		gc.gone[g] = append(gc.gone[g], h)
	}
}

// flushGone records the removals forget gathered, one BlockRemoved per
// group.
func (m *Manager) flushGone() {
	gc := m.gc
	if !gc.events {
		return
	}
	for g, hs := range gc.gone {
		if len(hs) > 0 {
			assertOK(m.cache.RecordGroupRemoved(g+1, hs), "announcing removed companions")
			gc.gone[g] = hs[:0]
		}
	}
}

// registerCompanions records the attention-group companions of s's block
// at index j, just inserted as a node, and marks them cached in the pool
// (a recurrent group's come at checkpoints: takeCheckpoints).
func (m *Manager) registerCompanions(s *seq, j int) {
	gc := m.gc
	if gc == nil {
		return
	}
	b := s.blocks[j]
	if gc.up != nil {
		// No state yet (takeCheckpoints gives it one), and its parent has
		// one more block below it.
		m.cache.SetSpent(b, true)
		gc.up[b] = m.cache.Parent(b)
		m.restate(gc.up[b])
	}
	for g, grp := range m.groups.extra {
		if grp.Kind == Recurrent {
			continue
		}
		c := s.extra()[g].blocks[j]
		if c == NoBlock {
			// A block is inserted as it fills, at the sequence's last
			// index, which no window has dropped; but a host hit's
			// reloaded blocks are inserted at admission, and their window
			// companions before what the hit point reads were not
			// reloaded (grouptier.go): such a node has none, as one whose
			// window companion was evicted.
			if j >= s.extra()[g].gone {
				panic("kvmanager: a filled block's companion was dropped")
			}
			continue
		}
		assertOK(m.pool.MarkCached(c), "a sequence's companion block is free")
		m.register(c, b, g)
	}
}

// nodesGone drops the companions of nodes that left the index: a Cached
// one returns to the free queue, one a sequence holds becomes its private
// block. hashes are the nodes' (the index's LastRemoved), whose
// companions' removal it announces; nil announces nothing (after an
// AllCleared, which covers them). It returns how many were freed.
func (m *Manager) nodesGone(nodes []int32, hashes []prefix.Hash) int {
	gc := m.gc
	if gc == nil {
		return 0
	}
	freed := 0
	for k, b := range nodes {
		var h prefix.Hash
		if hashes != nil {
			h = hashes[k]
		}
		stated := gc.up != nil && m.stated(b)
		m.dropCompanions(b, h, func(int, int32) bool { freed++; return false })
		if gc.up != nil {
			// Its parent has one block less below it, and maybe no state
			// below it any more.
			p := gc.up[b]
			gc.up[b] = NoBlock
			gc.below[b] = 0
			if stated {
				m.belowChanged(p, false)
			}
			m.restate(p)
		}
	}
	if hashes != nil {
		m.flushGone()
	} else {
		for g := range gc.gone {
			gc.gone[g] = gc.gone[g][:0]
		}
	}
	return freed
}

// dropCompanions takes node b's companions out of the group cache (h: its
// hash, for their removal events). keep(g, c) decides for each one no
// sequence holds whether it stays Cached (the host tier demotes it) or is
// freed; one a sequence holds becomes that sequence's private block.
func (m *Manager) dropCompanions(b int32, h prefix.Hash, keep func(g int, c int32) bool) {
	gc := m.gc
	gc.hitPoint[b] = false
	for g := range gc.comp {
		c := gc.comp[g][b]
		if c == NoBlock {
			continue
		}
		m.forget(c, h)
		if m.pool.State(c) == blocks.Cached && keep(g, c) {
			continue
		}
		assertOK(m.pool.UnmarkCached(c), "dropping a node's companion")
	}
}

// evictCompanions frees listed companions of class, the least recently
// released first, until it has freed n or the class is empty, and returns
// how many it freed. A checkpoint goes with its node's other listed
// checkpoints: without one of them the state resumes nothing, and the node
// is left spent.
func (m *Manager) evictCompanions(class uint8, n int) int {
	gc := m.gc
	k := 0
	for k < n && gc.head[class] != NoBlock {
		c := gc.head[class]
		b := gc.owner[c]
		var h prefix.Hash
		if gc.events {
			// Its node is cached: a companion goes before its node.
			h, _ = m.cache.BlockHash(b)
		}
		if m.groups.extra[gc.ownerGroup[c]].Kind != Recurrent {
			m.forget(c, h)
			assertOK(m.pool.UnmarkCached(c), "a listed companion is not cached")
			k++
			continue
		}
		was := m.whole(b)
		for g, grp := range m.groups.extra {
			// A checkpoint a queued copy holds is not listed: it stays
			// until the copy is taken, then lists as partial (unpin).
			if d := gc.comp[g][b]; grp.Kind == Recurrent && d != NoBlock && gc.class[d] != compNone {
				m.forget(d, h)
				assertOK(m.pool.UnmarkCached(d), "a listed checkpoint is not cached")
				k++
			}
		}
		m.cache.SetSpent(b, true)
		if was && gc.below[b] == 0 {
			// The last state at or below b: b's parent lost one.
			m.belowChanged(gc.up[b], false)
		}
	}
	m.flushGone()
	return k
}

// checkpoints counts node b's checkpoints.
func (m *Manager) checkpoints(b int32) int {
	n := 0
	for g, grp := range m.groups.extra {
		if grp.Kind == Recurrent && m.gc.comp[g][b] != NoBlock {
			n++
		}
	}
	return n
}

// whole reports whether node b has a checkpoint in every recurrent group:
// a state a hit can resume from.
func (m *Manager) whole(b int32) bool { return m.checkpoints(b) == m.groups.states }

// stateClass is the class of a released checkpoint of node b, which has
// kids cached blocks below it (groupcache.go, "Eviction with recurrent
// groups"): inner only when a whole state lies below b's one child's
// block, which resumes every prompt that follows the chain there.
func (m *Manager) stateClass(b int32, kids int) uint8 {
	switch {
	case !m.whole(b):
		return compPartial
	case m.gc.hitPoint[b] || kids > 1:
		return compShared
	case kids == 1 && m.gc.below[b] > 0:
		return compInner
	}
	return compKept
}

// stated reports whether a whole state lies at cached block b or below
// it.
func (m *Manager) stated(b int32) bool { return m.gc.below[b] > 0 || m.whole(b) }

// belowChanged updates the counts of the blocks from p up after a child of
// p gained (a state at or below it where there was none) or lost (none
// left) the states at or below it; p NoBlock or not cached (an eviction
// took it too) changes nothing. The walk stops at the first block whose
// own stated() does not change, so a state taken below another costs one
// step. A block whose count starts or stops being 0 has its state's class
// changed (restate).
func (m *Manager) belowChanged(p int32, gained bool) {
	gc := m.gc
	if p == NoBlock || m.cache.Children(p) < 0 {
		return
	}
	for ; p != NoBlock; p = gc.up[p] {
		if gained {
			gc.below[p]++
			if gc.below[p] > 1 {
				return
			}
		} else {
			gc.below[p]--
			if gc.below[p] > 0 {
				return
			}
		}
		m.restate(p)
		if m.whole(p) {
			return // a state at p: its parent's count is unchanged
		}
	}
}

// restate moves node b's listed checkpoints to the class they have now,
// after a change to b's children; a block not cached is left alone (its
// companions go with it).
func (m *Manager) restate(b int32) {
	if b == NoBlock {
		return
	}
	kids := m.cache.Children(b)
	if kids < 0 {
		return
	}
	gc := m.gc
	cl := m.stateClass(b, kids)
	for g, grp := range m.groups.extra {
		if c := gc.comp[g][b]; grp.Kind == Recurrent && c != NoBlock && gc.class[c] != compNone && gc.class[c] != cl {
			gc.unlist(c)
			gc.push(c, cl)
		}
	}
}

// noteCheckpoint records, for the next MarkComputed, sequence id's state
// as a checkpoint, when its step ends at the end of its last block, whose
// number every recurrent group's interval divides, and its blocks are
// being cached. (A block where only some groups keep a checkpoint would
// hold a partial state, which resumes nothing.)
func (m *Manager) noteCheckpoint(id int64, s *seq) {
	gc := m.gc
	if gc == nil || m.groups.states == 0 || s.pc == nil || s.length == 0 || s.length%m.bs != 0 {
		return
	}
	n := s.length / m.bs
	for _, grp := range m.groups.extra {
		if grp.Kind == Recurrent && n%grp.CheckpointEvery != 0 {
			return
		}
	}
	gc.cands = append(gc.cands, checkpoint{id: id, s: s, length: s.length, hash: s.pc.last})
}

// takeCheckpoints, at MarkComputed, gives the cached block of each
// recorded checkpoint whose sequence is as it was, if the block has no
// checkpoint yet and the pool can spare a block per recurrent group, its
// state: a checkpoint block per group, with the copy of the sequence's
// state there queued. The block is the sequence's, or the cached twin of
// the sequence's private copy (insertBlocks), which then gets the state it
// lacked.
func (m *Manager) takeCheckpoints() {
	gc := m.gc
	if gc == nil {
		return
	}
	if !gc.takes {
		gc.cands = gc.cands[:0]
		return
	}
	need := m.groups.states
	for _, cp := range gc.cands {
		s := m.seqs.get(cp.id)
		if s == nil || s != cp.s || s.length != cp.length || s.pc == nil || s.pc.last != cp.hash ||
			len(m.queued)+need > maxQueuedCopies {
			continue // gone, another sequence under the id, or moved on: its state is not the block's
		}
		b, ok := m.cache.Lookup(cp.hash)
		if !ok || m.checkpoints(b) > 0 {
			continue // evicted, or given a state already
		}
		twin := [1]int32{b}
		locked := b != s.blocks[cp.length/m.bs-1]
		if locked {
			// No sequence holds a twin: the evictions below must not take it.
			assertOK(m.cache.Lock(twin[:]), "checkpoint: locking a cached twin")
		}
		if m.available() >= int64(need) {
			m.makeFree(need)
			for g, grp := range m.groups.extra {
				if grp.Kind != Recurrent {
					continue
				}
				src := s.extra()[g].blocks[0]
				m.one[0] = NoBlock
				m.allocate(m.one[:], src, "checkpoint: allocating a block made free")
				c := m.one[0]
				assertOK(m.pool.MarkCached(c), "checkpoint: marking its block")
				m.register(c, b, g)
				// The allocation's reference is the copy's pin of c (unpin lists it).
				m.pin(src)
				m.queued = append(m.queued, CopyPair{Src: src, Dst: c})
			}
			m.cache.SetSpent(b, false)
			if gc.below[b] == 0 {
				// b's first state at or below it: its parent gained one.
				m.belowChanged(gc.up[b], true)
			}
		}
		if locked {
			assertOK(m.cache.Release(twin[:]), "checkpoint: releasing a cached twin")
		}
	}
	gc.cands = gc.cands[:0]
}

// A queued copy holds its two blocks until TakeCopies hands it to the
// engine: a reference each, and a listed companion leaves its list, so
// that no eviction and no release between the queueing and the copy (an
// admission short of blocks, the sequence's removal) frees or reuses
// them. The engine performs the copies before the next forward pass, ahead
// of any later scheduling call. Released at TakeCopies (unpin), a
// checkpoint with no other reference is listed as kept again.

// pin takes block b's copy reference.
func (m *Manager) pin(b int32) {
	m.gc.unlist(b)
	one := [1]int32{b}
	assertOK(m.pool.Incref(one[:]), "queued copy: referencing its block")
}

// unpin drops block b's copy reference; a companion left with none (a
// checkpoint: copies move recurrent states only) is listed by its state's
// class.
func (m *Manager) unpin(b int32) {
	one := [1]int32{b}
	var err error
	m.cached, err = m.pool.Decref(one[:], m.cached[:0])
	assertOK(err, "queued copy: releasing its block")
	for _, c := range m.cached {
		if b := m.gc.owner[c]; b != NoBlock && m.gc.class[c] == compNone {
			m.gc.push(c, m.stateClass(b, m.cache.Children(b)))
		}
	}
}

// queueStateCopies queues the copies of a hit's checkpoints into the
// admitted sequence s's state blocks (h matched blocks). takeCompanions
// pinned the checkpoints before anything was evicted for the admission;
// their pins become the copies'.
func (m *Manager) queueStateCopies(s *seq, h int) {
	gc := m.gc
	if gc == nil || h == 0 {
		return
	}
	for g, grp := range m.groups.extra {
		if grp.Kind == Recurrent {
			dst := s.extra()[g].blocks[0]
			m.pin(dst)
			m.queued = append(m.queued, CopyPair{Src: gc.comp[g][s.blocks[h-1]], Dst: dst})
		}
	}
}

// TakeCopies moves the oldest queued block copies into dst and returns how
// many it moved and how many are left. The engine performs them in queue
// order, every layer slot of Src into Dst as for Fork's copies, on the
// stream of the next forward pass and before it: a prefix hit's recurrent
// states (its checkpoint into the admitted sequence's state block, queued
// by Admit) and checkpoints (a sequence's state into a checkpoint block,
// queued by MarkComputed). Call it every step between the scheduler's
// calls and the forward pass (until left is 0); checkpoints are taken only
// once it has been called. A queued copy holds its two blocks until this
// call hands it out (no eviction, removal or clear frees them), so the
// engine takes the copies after the step's last scheduling call and
// performs them before the next. A manager without recurrent groups in the
// prefix cache queues nothing.
func (m *Manager) TakeCopies(dst []CopyPair) (n, left int) {
	m.mu.Lock()
	defer m.unlock()
	if m.gc != nil {
		m.gc.takes = true
	}
	n = copy(dst, m.queued)
	for _, p := range dst[:n] {
		m.unpin(p.Src)
		m.unpin(p.Dst)
	}
	m.queued = append(m.queued[:0], m.queued[n:]...)
	return n, len(m.queued)
}

// listReleased lists the window companions among s's group g entries
// [from, to) that a release just left with no reference: as kept when s
// ended, else by whether a hit point reads them. A full group's
// companions are not listed: they go with their nodes.
func (m *Manager) listReleased(s *seq, g, from, to int, ended bool) {
	gc := m.gc
	if gc == nil || m.groups.extra[g].Kind != SlidingWindow {
		return
	}
	for j := from; j < to; j++ {
		c := s.extra()[g].blocks[j]
		if gc.owner[c] == NoBlock || m.pool.State(c) != blocks.Cached {
			continue
		}
		class := uint8(compKept)
		if !ended && !m.nearHitPoint(s, g, j) {
			class = compBehind
		}
		gc.push(c, class)
	}
}

// nearHitPoint reports whether a node of s's at which a match ended reads
// s's window companion at index j in group g: a hit point after i blocks
// reads the blocks from keepFrom(i*bs) to i-1.
func (m *Manager) nearHitPoint(s *seq, g, j int) bool {
	w := m.groups.extra[g].Window
	for i := j + 1; i <= len(s.blocks) && m.keepFrom(i*m.bs, w) <= j; i++ {
		if m.gc.hitPoint[s.blocks[i-1]] {
			return true
		}
	}
	return false
}

// hitBlocks returns how many of the matched blocks (group 0's longest
// cached prefix) a prompt can start on: the most, h, for which every
// window group holds the companions of the blocks its query at position
// h*bs reads.
func (m *Manager) hitBlocks(matched []int32) int {
	if m.gc == nil {
		return len(matched)
	}
	h := len(matched)
	for {
		was := h
		h = m.windowHit(matched, h)
		h = m.stateHit(matched, h)
		if h == was {
			return h
		}
	}
}

// stateHit is the most, at most h, of the matched blocks that every
// recurrent group has a checkpoint after.
func (m *Manager) stateHit(matched []int32, h int) int {
	gc := m.gc
	for g, grp := range m.groups.extra {
		if grp.Kind != Recurrent {
			continue
		}
		for h > 0 && gc.comp[g][matched[h-1]] == NoBlock {
			h--
		}
	}
	return h
}

// windowHit is the most, at most h, of the matched blocks from which every
// window group holds what the next query reads.
func (m *Manager) windowHit(matched []int32, h int) int {
	gc := m.gc
	for g, grp := range m.groups.extra {
		if grp.Kind != SlidingWindow {
			continue
		}
		// The last missing companion at or below h-1 caps h: every hit
		// point past it needs it, unless its window starts after it.
		for h > 0 {
			miss := -1
			for j := h - 1; j >= m.keepFrom(h*m.bs, grp.Window); j-- {
				if gc.comp[g][matched[j]] == NoBlock {
					miss = j
					break
				}
			}
			if miss < 0 {
				break
			}
			h = miss
		}
	}
	return h
}

// listedTaken is what taking h matched blocks takes from the evictable
// companions: the listed ones it revives.
func (m *Manager) listedTaken(matched []int32, h int) int {
	gc := m.gc
	if gc == nil {
		return 0
	}
	n := 0
	for g, grp := range m.groups.extra {
		if grp.Kind != SlidingWindow {
			continue
		}
		for j := m.keepFrom(h*m.bs, grp.Window); j < h; j++ {
			if gc.class[gc.comp[g][matched[j]]] != compNone {
				n++
			}
		}
	}
	if h > 0 {
		for g, grp := range m.groups.extra {
			// The hit's checkpoints are pinned for their copies.
			if grp.Kind == Recurrent && gc.class[gc.comp[g][matched[h-1]]] != compNone {
				n++
			}
		}
	}
	return n
}

// takeCompanions fills s's group tables' first h entries from the matched
// blocks' companions, referencing them, and marks the hit point. hit >= h
// is the whole hit, the host tier's blocks past h included (grouptier.go):
// a window group's entries before what a query at hit reads are dropped.
func (m *Manager) takeCompanions(s *seq, h, hit int) {
	gc := m.gc
	if gc == nil {
		return
	}
	if h > 0 {
		gc.hitPoint[s.blocks[h-1]] = true
	}
	for g, grp := range m.groups.extra {
		if grp.Kind == Recurrent {
			// Its state comes by copy (queueStateCopies); the checkpoint
			// it copies is pinned now, before the admission evicts.
			if h > 0 {
				m.pin(gc.comp[g][s.blocks[h-1]])
			}
			continue
		}
		t := &s.extra()[g]
		from := 0
		if grp.Kind == SlidingWindow {
			from = m.keepFrom(hit*m.bs, grp.Window)
			fillNoBlock(t.blocks[:from])
			t.gone = from
		}
		for j := from; j < h; j++ {
			c := gc.comp[g][s.blocks[j]]
			gc.unlist(c)
			t.blocks[j] = c
		}
		if from < h {
			assertOK(m.pool.Incref(t.blocks[from:h]), "admit: referencing the matched companions")
		}
	}
}

// checkGroupCache verifies the companions against the pool and the index.
// pins holds each block's references from queued copies.
func (m *Manager) checkGroupCache(pins []int32, bad func(string, ...any) error) error {
	gc := m.gc
	if gc == nil {
		return nil
	}
	listed := 0
	for c := range gc.owner {
		b := gc.owner[c]
		if b == NoBlock {
			if gc.class[c] != compNone {
				return bad("block %d is listed as a companion and is none", c)
			}
			continue
		}
		g := gc.ownerGroup[c]
		if gc.comp[g][b] != int32(c) {
			return bad("companion %d names node %d, whose group %d companion is %d", c, b, g+1, gc.comp[g][b])
		}
		if _, ok := m.cache.BlockHash(b); !ok {
			return bad("companion %d belongs to block %d, which is not cached", c, b)
		}
		if !m.pool.IsCached(int32(c)) {
			return bad("companion %d is not marked cached in the pool", c)
		}
		st := m.pool.State(int32(c))
		if gc.class[c] != compNone {
			listed++
			if st != blocks.Cached || m.groups.extra[g].Kind == FullAttention {
				return bad("listed companion %d is %s in group %d", c, st, g+1)
			}
			want := gc.class[c]
			if m.groups.extra[g].Kind == Recurrent {
				want = m.stateClass(b, m.cache.Children(b))
			} else if want != compBehind && want != compKept {
				want = compKept
			}
			if gc.class[c] != want {
				return bad("companion %d of node %d in group %d is listed in class %d, its class is %d", c, b, g+1, gc.class[c], want)
			}
		} else if st == blocks.Cached && m.groups.extra[g].Kind != FullAttention {
			return bad("companion %d of group %d is cached with no reference and not listed", c, g+1)
		}
		if m.groups.extra[g].Kind == Recurrent && st != blocks.Cached && m.pool.Ref(int32(c)) != pins[c] {
			return bad("checkpoint %d of group %d is %s with %d references, %d of them queued copies'", c, g+1, st,
				m.pool.Ref(int32(c)), pins[c])
		}
		if m.groups.extra[g].Kind == FullAttention && (st == blocks.Cached) != (m.cache.LockCount(b) == 0) {
			return bad("full group companion %d is %s while its node %d has %d locks", c, st, b, m.cache.LockCount(b))
		}
	}
	if listed != gc.listed {
		return bad("%d companions listed, the count says %d", listed, gc.listed)
	}
	owned := 0
	for _, b := range gc.owner {
		if b != NoBlock {
			owned++
		}
	}
	if owned != gc.owned {
		return bad("%d companions registered, the count says %d", owned, gc.owned)
	}
	for g := range gc.comp {
		for b, c := range gc.comp[g] {
			if c != NoBlock && gc.owner[c] != int32(b) {
				return bad("block %d's group %d companion %d names node %d", b, g+1, c, gc.owner[c])
			}
		}
	}
	for b, up := range gc.up {
		_, cached := m.cache.BlockHash(int32(b))
		switch {
		case !cached && up != NoBlock:
			return bad("block %d is not cached and names parent %d", b, up)
		case cached && up != m.cache.Parent(int32(b)):
			return bad("cached block %d names parent %d, the index %d", b, up, m.cache.Parent(int32(b)))
		case cached && m.cache.Spent(int32(b)) == m.whole(int32(b)):
			return bad("cached block %d is marked spent %v with %d of %d checkpoints", b, m.cache.Spent(int32(b)), m.checkpoints(int32(b)), m.groups.states)
		}
	}
	return m.checkBelow(bad)
}

// checkBelow verifies groupCache.below against the nodes' states: every
// cached block's count of children with a whole state at or below them,
// 0 for the others. The parents (gc.up) are checked already.
func (m *Manager) checkBelow(bad func(string, ...any) error) error {
	gc := m.gc
	if gc.up == nil {
		return nil
	}
	stated := make([]bool, len(gc.up)) // a whole state at the block or below it
	for b := range gc.up {
		if _, cached := m.cache.BlockHash(int32(b)); !cached || !m.whole(int32(b)) {
			continue
		}
		for v := int32(b); v != NoBlock && !stated[v]; v = gc.up[v] {
			stated[v] = true
		}
	}
	want := make([]int32, len(gc.up))
	for b, up := range gc.up {
		if stated[b] && up != NoBlock {
			want[up]++
		}
	}
	for b := range gc.up {
		if gc.below[b] != want[b] {
			return bad("block %d counts %d children with a state at or below them, %d have one", b, gc.below[b], want[b])
		}
	}
	return nil
}

// acquireGroups is the prefix cache's Acquire for a manager of groups: it
// matches the prompt up to the hit every group can start from and locks
// those blocks, provided the blocks the prompt needs beyond them in every
// group fit; ok is false, with nothing changed, when they do not. whole:
// the hit is group 0's whole cached prefix (a host tier may extend it).
func (m *Manager) acquireGroups(tokens []int32, keys *prefix.Keys, need int) (res prefix.MatchResult, whole, ok bool, err error) {
	peek, err := m.cache.Peek(m.locks[:0], tokens, keys)
	m.locks = peek[:0]
	if err != nil {
		return res, false, false, err
	}
	h := m.hitBlocks(peek)
	whole = h == len(peek)
	// What is free after the lock: evictable nodes but those the match
	// holds, listed companions but those it takes.
	avail := m.available() - int64(m.cache.Unheld(peek[:h]))*int64(1+m.gc.fullExtra) - int64(m.listedTaken(peek, h))
	if m.groups.perSeq(need-h) > avail {
		return res, false, false, nil
	}
	res, ok, err = m.cache.AcquirePeeked(m.locks[:0], len(tokens), h, h, math.MaxInt32)
	m.locks = res.Blocks[:0]
	if err == nil && (!ok || len(res.Blocks) != h) {
		panic(kverr.Errorf(kverr.Internal, "kvmanager: acquire of the %d blocks peek found took %d (ok %v)", h, len(res.Blocks), ok))
	}
	return res, whole, ok, err
}

// makeFreeGroups is makeFree with layer groups: checkpoints of partial
// states and window companions behind their sequences first; then, with
// recurrent groups, spent nodes and the states at inner nodes; then the
// index's nodes with their companions (spent ones first: the index's
// order), then the kept companions (window blocks, states at chain ends),
// and last the states at hit points and branches. The caller checked
// short <= available().
func (m *Manager) makeFreeGroups(short int) {
	short -= m.evictCompanions(compPartial, short)
	short -= m.evictCompanions(compBehind, short)
	for short > 0 {
		if m.gc.up != nil {
			if n := m.evictNodes(short, true); n > 0 {
				short -= n
				continue
			}
			if m.gc.head[compInner] != NoBlock {
				short -= m.evictCompanions(compInner, short)
				continue
			}
		}
		if m.cache.Evictable() == 0 {
			break
		}
		short -= m.evictNodes(short, false)
	}
	if short > 0 {
		short -= m.evictCompanions(compKept, short)
	}
	if short > 0 {
		short -= m.evictCompanions(compShared, short)
	}
	if short > 0 {
		panic(kverr.Errorf(kverr.Internal, "kvmanager: %d blocks short after evicting every evictable block", short))
	}
}

// evictNodes evicts nodes from the index (only spent ones with spentOnly)
// with their companions, no more than a shortfall of short needs, and
// returns how many blocks that freed.
func (m *Manager) evictNodes(short int, spentOnly bool) int {
	// A node frees its full groups' companions with it.
	n := max(1, short/(1+m.gc.fullExtra))
	if spentOnly {
		m.evicted = m.cache.EvictSpent(m.evicted[:0], n)
	} else {
		m.evicted = m.cache.Evict(m.evicted[:0], n)
	}
	// An evictable block has no lock, hence no reference, and is marked,
	// so it is Cached in the pool.
	assertOK(m.pool.Evict(m.evicted), "evicted blocks are not Cached in the pool")
	freed := len(m.evicted) + m.nodesGone(m.evicted, m.cache.LastRemoved())
	if m.tier != nil {
		// Needed now: dropped, not demoted (the tier demotes ahead of
		// need, FlushCopies).
		m.tier.Evicted(len(m.evicted))
	}
	return freed
}
