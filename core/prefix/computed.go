package prefix

import (
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
)

// Pending and computed blocks.
//
// A block enters the index when the call that fills its tokens returns,
// before the engine's forward pass has computed its K/V. Until the caller
// commits the step it was inserted in (Commit), the block is pending: it
// matches like any other (so a later prompt of the same step can share
// it, since the step's forward pass writes it before its attention reads
// it), but nothing may treat its K/V as existing on its own:
//
//   - Pin stops at a prefix's first pending block;
//   - DropPending removes a pending block, with every block cached below
//     it, when the sequence that was to compute it goes without its forward
//     pass; the caller returns the blocks to its pool.
//
// Pending blocks are those whose node was inserted in the current epoch,
// so Commit is one increment, whatever the number of blocks. A block the
// caller fills by other means than the forward pass (a copy from a lower
// tier, ordered before every reader) is marked computed at once with
// CommitBlocks.
//
// A pending node's descendants are pending too, or marked computed by
// CommitBlocks: a node is inserted below a parent that is cached at that
// moment, so a child of a pending node was inserted in the same epoch.
// No pin covers any of them (Pin stops at the first pending node, and a
// pin made before the step cannot reach a node inserted in it).

// Commit marks every pending block computed: the caller's forward pass has
// written (or enqueued, ahead of every later reader) the K/V of every block
// inserted so far. O(1).
func (x *Index) Commit() {
	x.epoch++
	x.nPending = 0
	if x.epoch == 0 {
		// Wrapped: forget every node's epoch, so that none inserted 2^32
		// steps ago reads as pending.
		for i := range x.nodes {
			x.nodes[i].epoch = 0
		}
		x.epoch = 1
	}
}

// CommitBlocks marks the given cached blocks computed now; ids that are not
// cached, or not pending, are skipped.
func (x *Index) CommitBlocks(ids []int32) {
	for _, id := range ids {
		if i := x.nodeOf(id); i != nilNode && x.nodes[i].epoch == x.epoch {
			x.nodes[i].epoch = 0
			x.nPending--
		}
	}
}

// IsPending reports whether block id is cached and pending.
func (x *Index) IsPending(id int32) bool {
	i := x.nodeOf(id)
	return i != nilNode && x.nodes[i].epoch == x.epoch
}

// Pending returns the number of cached pending blocks.
func (x *Index) Pending() int { return x.nPending }

// nodeOf returns block id's node, or nilNode when it is not cached.
func (x *Index) nodeOf(id int32) int32 {
	if id < 0 || int(id) >= len(x.byBlock) {
		return nilNode
	}
	return x.byBlock[id]
}

// computedPrefix cuts a walk's path at its first pending node.
func (x *Index) computedPrefix(path []int32) []int32 {
	for k, i := range path {
		if x.nodes[i].epoch == x.epoch {
			return path[:k]
		}
	}
	return path
}

// DroppedBlock is a block DropPending removed from the index. Locks is the
// number of locks it held (its holders other than the dropped sequence:
// the caller keeps their references, now on a private block); a block with
// none is the caller's to free.
type DroppedBlock struct {
	Block int32
	Locks int32
}

// DropPending removes from the index each pending block of ids, with every
// block cached below it, appends them to dst (deepest first) and returns it. Ids that are not cached or not pending are
// skipped. The dropped blocks' locks go with them (DroppedBlock.Locks
// says how many each had); one BlockRemoved event lists them. For a
// sequence removed before the forward pass that was to compute its
// blocks: the caller first unlocks the sequence's own blocks, checks that
// no other holder depends on the pending ones (their locks are 0), then
// drops them.
//
// Fails with Internal, changing nothing, when a block to drop is pinned,
// which the rules of Pin exclude.
func (x *Index) DropPending(ids []int32, dst []DroppedBlock) ([]DroppedBlock, error) {
	// Collect the subtrees first (preorder), so that a broken rule is
	// found before anything changes. taken counts a node once when an id
	// repeats or lies below another's.
	x.path = x.path[:0]
	taken := make(map[int32]struct{})
	for _, id := range ids {
		i := x.nodeOf(id)
		if i == nilNode || x.nodes[i].epoch != x.epoch {
			continue
		}
		if _, ok := taken[i]; ok {
			continue
		}
		start := len(x.path)
		x.path = append(x.path, i)
		taken[i] = struct{}{}
		for k := start; k < len(x.path); k++ {
			for c := x.nodes[x.path[k]].child; c != nilNode; c = x.nodes[c].next {
				if _, ok := taken[c]; !ok {
					taken[c] = struct{}{}
					x.path = append(x.path, c)
				}
			}
		}
	}
	for _, i := range x.path {
		if x.nodes[i].pin > 0 {
			return dst, kverr.Errorf(kverr.Internal, "prefix: pending block %d (or one cached below it) is pinned", x.nodes[i].block)
		}
	}
	// Deepest first: every node goes after its descendants, as a leaf.
	slices.SortStableFunc(x.path, func(a, b int32) int { return int(x.nodes[b].depth) - int(x.nodes[a].depth) })
	x.removedHashes = x.removedHashes[:0]
	for _, i := range x.path {
		n := &x.nodes[i]
		dst = append(dst, DroppedBlock{Block: n.block, Locks: n.lock})
		if n.lock > 0 {
			n.lock = 0
			x.nLocked--
			x.hold(i, -1)
		}
		if n.heapPos >= 0 {
			x.heapRemove(i)
		}
		if x.events.on {
			x.removedHashes = append(x.removedHashes, n.hash)
		}
		x.unlink(i)
	}
	x.counters.DroppedPending += int64(len(x.path))
	if len(x.removedHashes) > 0 {
		x.events.removed(MediumGPU, x.removedHashes)
	}
	return dst, nil
}
