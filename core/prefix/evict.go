package prefix

import (
	"github.com/kvplug/kvplug/core/kverr"
)

// Evict removes up to n blocks from the tree, in the order of the package
// comment (priority, last access, deepest first, lowest id), appends their
// ids to dst and returns it: the caller returns them to its pool. Only
// leaves that no lock or pin holds go; a parent whose last child goes
// becomes a candidate at once, in the same call. Fewer than n come back
// when nothing else is evictable. One BlockRemoved event lists the call's
// blocks.
func (x *Index) Evict(dst []int32, n int) []int32 {
	return x.evict(dst, n, nil, false)
}

// EvictSpent is Evict limited to nodes marked spent (SetSpent), including
// those its own evictions turn into evictable leaves.
func (x *Index) EvictSpent(dst []int32, n int) []int32 {
	return x.evict(dst, n, nil, true)
}

// SetSpent marks cached block id as spent, or not: a spent node is of no
// use to any match its owner serves (a recurrent model's block with no
// state kept after it), so the eviction order takes it before every other
// evictable node, whatever its priority or last access. A block that is
// not cached is ignored. O(log n).
func (x *Index) SetSpent(id int32, spent bool) {
	i := x.nodeOf(id)
	if i == nilNode || x.nodes[i].spent == spent {
		return
	}
	x.nodes[i].spent = spent
	if x.nodes[i].heapPos >= 0 {
		x.heapFix(i)
	}
}

// Spent reports whether cached block id is marked spent.
func (x *Index) Spent(id int32) bool {
	i := x.nodeOf(id)
	return i != nilNode && x.nodes[i].spent
}

// Children returns how many cached blocks follow cached block id (its
// children in the tree); -1 when id is not cached.
func (x *Index) Children(id int32) int {
	i := x.nodeOf(id)
	if i == nilNode {
		return -1
	}
	return int(x.nodes[i].children)
}

// Parent returns the cached block that cached block id follows: -1 for a
// first block, or when id is not cached.
func (x *Index) Parent(id int32) int32 {
	i := x.nodeOf(id)
	if i == nilNode {
		return -1
	}
	return x.nodes[x.nodes[i].parent].block
}

// EvictedBlock is a block EvictBlocks removed, with the fields of the
// BlockStored event that announced it (its tokens go to a separate slice).
type EvictedBlock struct {
	Block   int32
	Hash    Hash
	Parent  Hash
	Adapter uint64
	MM      []BlockMM // the caller's: the index keeps no reference to it
}

// EvictBlocks is Evict that describes each evicted block: it appends one
// EvictedBlock per block to info and returns it, in eviction order: for a
// caller that keeps evicted blocks elsewhere (the host tier). With tokens,
// it also appends each block's BlockSize tokens to toks, which only a
// caller announcing the blocks there needs (the host tier's events); toks
// comes back as passed otherwise, sparing the copy.
func (x *Index) EvictBlocks(info []EvictedBlock, toks []int32, n int, tokens bool) ([]EvictedBlock, []int32) {
	d := evictDesc{info: info, toks: toks, tokens: tokens}
	x.evict(nil, n, &d, false)
	return d.info, d.toks
}

// evictDesc collects EvictBlocks' descriptions.
type evictDesc struct {
	info   []EvictedBlock
	toks   []int32
	tokens bool
}

// evict evicts up to n blocks, appending their ids to dst, or, when desc
// is not nil, their descriptions to desc instead; with spentOnly, only
// blocks marked spent.
func (x *Index) evict(dst []int32, n int, desc *evictDesc, spentOnly bool) []int32 {
	count := 0
	x.removedHashes = x.removedHashes[:0]
	for count < n && len(x.heap) > 0 {
		i := x.heap[0]
		if spentOnly && !x.nodes[i].spent {
			break // spent nodes sort first: none is left
		}
		x.heapRemove(i)
		nd := &x.nodes[i]
		if desc != nil {
			desc.info = append(desc.info, EvictedBlock{Block: nd.block, Hash: nd.hash, Parent: x.nodes[nd.parent].hash, Adapter: nd.adapter, MM: nd.mm})
			if desc.tokens {
				desc.toks = append(desc.toks, x.tokensOf(i)...)
			}
		} else {
			dst = append(dst, nd.block)
		}
		if x.events.on {
			x.removedHashes = append(x.removedHashes, nd.hash)
		}
		x.unlink(i)
		count++
	}
	x.counters.Evictions += int64(count)
	if len(x.removedHashes) > 0 {
		x.events.removed(MediumGPU, x.removedHashes)
	}
	return dst
}

// LastRemoved returns the hashes of the blocks the last Evict, EvictBlocks
// or DropPending removed, in the order it gave them, for a caller that
// announces blocks it kept with them (a manager's layer groups); nil when
// events are off. Valid until the next call that removes blocks.
func (x *Index) LastRemoved() []Hash {
	if !x.events.on {
		return nil
	}
	return x.removedHashes
}

// unlink removes leaf i from the tree and frees its slot.
func (x *Index) unlink(i int32) {
	n := &x.nodes[i]
	p := n.parent
	if n.prev != nilNode {
		x.nodes[n.prev].next = n.next
	} else {
		x.nodes[p].child = n.next
	}
	if n.next != nilNode {
		x.nodes[n.next].prev = n.prev
	}
	x.nodes[p].children--
	if n.epoch == x.epoch {
		x.nPending--
	}
	x.byHash.del(n.hash)
	x.byBlock[n.block] = nilNode
	*n = node{parent: nilNode, child: nilNode, prev: nilNode, next: nilNode, block: nilNode, heapPos: -1}
	x.freeNodes = append(x.freeNodes, i)
	x.settle(p)
}

// Clear empties the index for a model or adapter reload, when no cached KV
// stays valid: it appends every cached block's id to dst (in no
// particular order) and returns it, drops every pin (their
// PinIDs become unknown to Unpin) and records one AllCleared event. It
// refuses, changing nothing, while any block is locked: running sequences
// still read those blocks, so the caller must retire them first. (Evict
// with a large n is the way to drop every unheld block and keep the rest.)
// Counters are kept; Evictions does not count cleared blocks.
func (x *Index) Clear(dst []int32) ([]int32, error) {
	if x.nLocked > 0 {
		return dst, kverr.Errorf(kverr.InvalidArgument, "clear: %d cached blocks are locked by running sequences; unlock them first", x.nLocked)
	}
	for i := 1; i < len(x.nodes); i++ {
		if b := x.nodes[i].block; b >= 0 {
			dst = append(dst, b)
			x.byBlock[b] = nilNode
		}
	}
	x.byHash.reset()
	clear(x.nodes[1:]) // drop the mm slices
	x.resetRoot()
	x.heap = x.heap[:0]
	clear(x.pins)
	x.nPinned = 0
	x.nHeld = 0
	x.nPending = 0
	x.events.cleared(x)
	return dst, nil
}

// settle puts node i in the eviction heap, takes it out, or restores its
// heap position, after a change to its locks, pins, children, priority or
// last access.
func (x *Index) settle(i int32) {
	if i == rootNode {
		return
	}
	n := &x.nodes[i]
	evictable := n.lock == 0 && n.pin == 0 && n.children == 0
	switch {
	case evictable && n.heapPos < 0:
		x.heapPush(i)
	case !evictable && n.heapPos >= 0:
		x.heapRemove(i)
	case evictable:
		x.heapFix(i)
	}
}

// evictsBefore is the eviction order: spent, then lower priority, then
// older last access, then deeper, then lower block id.
func (x *Index) evictsBefore(a, b int32) bool {
	na, nb := &x.nodes[a], &x.nodes[b]
	if na.spent != nb.spent {
		return na.spent
	}
	if na.prio != nb.prio {
		return na.prio < nb.prio
	}
	if na.last != nb.last {
		return na.last < nb.last
	}
	if na.depth != nb.depth {
		return na.depth > nb.depth
	}
	return na.block < nb.block
}

func (x *Index) heapPush(i int32) {
	x.nodes[i].heapPos = int32(len(x.heap))
	x.heap = append(x.heap, i)
	x.heapUp(len(x.heap) - 1)
}

func (x *Index) heapRemove(i int32) {
	pos := int(x.nodes[i].heapPos)
	last := len(x.heap) - 1
	if pos != last {
		x.heapSwap(pos, last)
	}
	x.heap = x.heap[:last]
	x.nodes[i].heapPos = -1
	if pos != last && !x.heapDown(pos) {
		x.heapUp(pos)
	}
}

func (x *Index) heapFix(i int32) {
	pos := int(x.nodes[i].heapPos)
	if !x.heapDown(pos) {
		x.heapUp(pos)
	}
}

func (x *Index) heapSwap(a, b int) {
	h := x.heap
	h[a], h[b] = h[b], h[a]
	x.nodes[h[a]].heapPos = int32(a)
	x.nodes[h[b]].heapPos = int32(b)
}

func (x *Index) heapUp(j int) {
	for j > 0 {
		p := (j - 1) / 2
		if !x.evictsBefore(x.heap[j], x.heap[p]) {
			break
		}
		x.heapSwap(j, p)
		j = p
	}
}

// heapDown sifts position j down and reports whether it moved.
func (x *Index) heapDown(j int) bool {
	start := j
	n := len(x.heap)
	for {
		c := 2*j + 1
		if c >= n {
			break
		}
		if r := c + 1; r < n && x.evictsBefore(x.heap[r], x.heap[c]) {
			c = r
		}
		if !x.evictsBefore(x.heap[c], x.heap[j]) {
			break
		}
		x.heapSwap(j, c)
		j = c
	}
	return j > start
}
