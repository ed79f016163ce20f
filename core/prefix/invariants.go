package prefix

import (
	"fmt"
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
)

// CheckInvariants verifies the index's internal consistency and returns an
// Internal error naming the first broken invariant. It walks everything
// (O(cached blocks x block size)): for tests and debugging.
func (x *Index) CheckInvariants() error { return x.check(true) }

// CheckStructure is CheckInvariants less the recomputation of every
// block's hash from its tokens and keys, O(cached blocks): a block's
// tokens, keys and hash never change after Insert, so a check that runs
// after every call (the KV manager's in -race builds) need not redo it.
func (x *Index) CheckStructure() error { return x.check(false) }

func (x *Index) check(hashes bool) error {
	bad := func(format string, args ...any) error {
		return kverr.Errorf(kverr.Internal, "prefix invariant: "+format, args...)
	}
	if len(x.tokens) != len(x.nodes)*x.bs {
		return bad("token arena holds %d tokens for %d nodes of %d", len(x.tokens), len(x.nodes), x.bs)
	}
	root := &x.nodes[rootNode]
	if root.parent != nilNode || root.depth != 0 || root.block != nilNode || root.heapPos != -1 || !root.hash.IsZero() {
		return bad("root node is not a root: %+v", *root)
	}
	// Free slots.
	isFree := make([]bool, len(x.nodes))
	for _, i := range x.freeNodes {
		if i <= rootNode || int(i) >= len(x.nodes) || isFree[i] {
			return bad("free list holds node %d twice or out of range", i)
		}
		if x.nodes[i].block != nilNode {
			return bad("free node %d holds block %d", i, x.nodes[i].block)
		}
		isFree[i] = true
	}
	live, locked, pinned, inHeap, held, pending := 0, 0, 0, 0, 0, 0
	heldKids := make([]int32, len(x.nodes))
	for i := len(x.nodes) - 1; i > rootNode; i-- {
		// Count each node's held children.
		n := &x.nodes[i]
		if n.block >= 0 && n.holds > 0 && n.parent != rootNode {
			heldKids[n.parent]++
		}
	}
	pinCover := make([]int32, len(x.nodes))
	for _, deepest := range x.pins {
		if deepest <= rootNode || int(deepest) >= len(x.nodes) || x.nodes[deepest].block < 0 {
			return bad("a pin names node %d, not a cached block", deepest)
		}
		for i := deepest; i != rootNode; i = x.nodes[i].parent {
			pinCover[i]++
		}
	}
	var h Hasher
	for i := 0; i < len(x.nodes); i++ {
		n := &x.nodes[i]
		if i != rootNode && n.block < 0 {
			if !isFree[i] {
				return bad("node %d is neither cached nor free", i)
			}
			continue
		}
		// Children list.
		count, prev := int32(0), int32(nilNode)
		for c := n.child; c != nilNode; c = x.nodes[c].next {
			if int(c) >= len(x.nodes) || x.nodes[c].block < 0 || x.nodes[c].parent != int32(i) || x.nodes[c].prev != prev {
				return bad("child list of node %d is broken at node %d", i, c)
			}
			if count++; int(count) > len(x.nodes) {
				return bad("child list of node %d loops", i)
			}
			prev = c
		}
		if count != n.children {
			return bad("node %d counts %d children, its list has %d", i, n.children, count)
		}
		if i == rootNode {
			continue
		}
		live++
		p := &x.nodes[n.parent]
		if n.parent < 0 || int(n.parent) >= len(x.nodes) || (n.parent != rootNode && p.block < 0) {
			return bad("node %d (block %d) has parent %d, not a cached block", i, n.block, n.parent)
		}
		if n.depth != p.depth+1 {
			return bad("block %d has depth %d under a parent of depth %d", n.block, n.depth, p.depth)
		}
		if int(n.block) >= len(x.byBlock) || x.byBlock[n.block] != int32(i) {
			return bad("block %d of node %d is not indexed to it", n.block, i)
		}
		if j, ok := x.byHash.get(n.hash); !ok || j != int32(i) {
			return bad("block %d's hash %s is not indexed to it", n.block, n.hash)
		}
		// The stored hash is the hash of the stored content.
		var salt []byte
		if n.depth == 1 {
			salt = []byte(n.salt)
		} else if n.salt != "" {
			return bad("block %d at depth %d keeps a salt", n.block, n.depth)
		}
		if slices.ContainsFunc(n.mm, func(e BlockMM) bool { return int(e.Offset) >= x.bs }) {
			return bad("block %d has a multimodal entry past its end: %v", n.block, n.mm)
		}
		if hashes {
			h.buf = AppendBlockInput(h.buf[:0], p.hash, x.tokensOf(int32(i)), n.adapter, n.mm, salt)
			if got := Sum(h.buf); got != n.hash {
				return bad("block %d is cached under %s but its content hashes to %s", n.block, n.hash, got)
			}
		}
		if n.lock < 0 || n.pin < 0 {
			return bad("block %d has lock %d, pin %d", n.block, n.lock, n.pin)
		}
		if n.epoch == x.epoch {
			pending++
			if n.pin > 0 {
				return bad("pending block %d is pinned", n.block)
			}
		}
		if n.pin != pinCover[i] {
			return bad("block %d has pin count %d, its pins cover it %d times", n.block, n.pin, pinCover[i])
		}
		wantHolds := heldKids[i]
		if n.lock > 0 {
			locked++
			wantHolds++
		}
		if n.pin > 0 {
			wantHolds++
		}
		if n.holds != wantHolds {
			return bad("block %d has hold count %d, want %d (lock %d, pin %d, %d held children)", n.block, n.holds, wantHolds, n.lock, n.pin, heldKids[i])
		}
		if n.holds > 0 {
			held++
		}
		if n.pin > 0 {
			pinned++
		}
		if n.last > x.clock {
			return bad("block %d was last accessed at %d, after the clock's %d", n.block, n.last, x.clock)
		}
		evictable := n.lock == 0 && n.pin == 0 && n.children == 0
		if evictable != (n.heapPos >= 0) {
			return bad("block %d: evictable %v but heap position %d", n.block, evictable, n.heapPos)
		}
		if n.heapPos >= 0 {
			inHeap++
			if int(n.heapPos) >= len(x.heap) || x.heap[n.heapPos] != int32(i) {
				return bad("block %d's heap position %d does not hold it", n.block, n.heapPos)
			}
		}
	}
	if live != x.byHash.len() {
		return bad("%d cached nodes, %d hashes indexed", live, x.byHash.len())
	}
	indexed := 0
	for _, j := range x.byBlock {
		if j != nilNode {
			indexed++
		}
	}
	if indexed != live {
		return bad("%d cached nodes, %d block ids indexed", live, indexed)
	}
	if inHeap != len(x.heap) {
		return bad("%d nodes in the heap, heap holds %d", inHeap, len(x.heap))
	}
	for k := 1; k < len(x.heap); k++ {
		if x.evictsBefore(x.heap[k], x.heap[(k-1)/2]) {
			return bad("heap order broken at position %d", k)
		}
	}
	if held != x.nHeld {
		return bad("counted %d held blocks, the index says %d", held, x.nHeld)
	}
	if pending != x.nPending {
		return bad("counted %d pending blocks, the index says %d", pending, x.nPending)
	}
	if locked != x.nLocked || pinned != x.nPinned {
		return bad("counted %d locked and %d pinned blocks, the index says %d and %d", locked, pinned, x.nLocked, x.nPinned)
	}
	e := &x.events
	if e.head > len(e.q) || e.tokHead > len(e.toks) || e.mmHead > len(e.mms) || e.hashHead > len(e.hashes) {
		return bad("event queue heads past their ends")
	}
	if e.resync && len(e.q) != 0 {
		return bad("event queue awaiting a resync holds %d events", len(e.q))
	}
	if len(e.q)-e.head > e.limit {
		return bad("event queue holds %d events, limit %d", len(e.q)-e.head, e.limit)
	}
	return nil
}

func (n node) String() string {
	return fmt.Sprintf("node{block %d depth %d lock %d pin %d children %d}", n.block, n.depth, n.lock, n.pin, n.children)
}
