// Package prefix is the prefix cache's index: a prefix tree whose nodes are
// full KV blocks (ChunkAttention's chunks), each identified by a chained
// 128-bit hash of its parent's hash, its tokens and the prompt's extra keys
// (vLLM's automatic prefix caching; HASH.md has the exact layout).
//
// The index keeps identities, not KV: block ids are the caller's pool's,
// and the caller allocates, frees and copies blocks. The tree answers four
// questions for an engine's scheduler:
//
//   - Match: which cached blocks hold a prompt's longest prefix;
//   - Insert: a block just filled; is an identical one cached already;
//   - Lock/Unlock: which blocks running sequences hold, so they stay;
//   - Evict: which unheld blocks to give back under memory pressure.
//
// # Structure
//
// Each node is one full block. Its children are found through one hash map
// keyed by chained hash (a child's hash already names its parent, so the
// map is the union of every node's children map), and each node threads
// its children on an intrusive sibling list for the walks that need them
// all (the partial match, the event snapshot). A map per node would cost
// an allocation per block and a second map probe per step down the tree.
// A hash hit is then verified against the node's stored parent, tokens and
// keys, so a hash collision can cost a miss but never a wrong match.
//
// # Eviction order
//
// A node is evictable when no sequence locks it, no pin covers it and it
// has no children: only leaves go, and a parent becomes a leaf when its
// last child goes. Evictable nodes sit in a binary heap ordered by
//
//	(spent first, priority ascending, last access ascending, depth descending, block id ascending)
//
// so a node the owner marked spent goes first (SetSpent: no match can use
// it), then the lowest priority, then the least recently used, ties to the
// deepest node (the end of the longest prefix), then the lowest block id
// so the order is fully determined. Last access is a logical clock that
// ticks once per Match, Insert and Unlock call; every block a call touches
// gets that call's tick (Match: the blocks it returns; Insert: the block;
// Unlock: every block named). Each eviction costs O(log n).
//
// # Concurrency
//
// An Index is not safe for concurrent use: its owner (the KV manager)
// serialises every call. Every call that fails changes nothing.
package prefix

import (
	"math"
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// Limits of Config.
const (
	MaxBlockSize = 1 << 16
	MaxBlocks    = 1 << 26
	// DefaultMaxPendingEvents is the event queue's bound when the config
	// gives none.
	DefaultMaxPendingEvents = 1 << 16
)

// Config sizes an Index.
type Config struct {
	BlockSize int // tokens per block, in [1, MaxBlockSize]
	NumBlocks int // block ids are in [0, NumBlocks); NumBlocks in [1, MaxBlocks]

	// EnableEvents records KV events for DrainEvents. Off by default: an
	// engine without a router should not pay for them.
	EnableEvents bool
	// MaxPendingEvents bounds the undrained events (0: the default). It is
	// raised to NumBlocks+TierBlocks+1 so a resync snapshot always fits
	// (see DrainEvents).
	MaxPendingEvents int
	// TierBlocks bounds the blocks a TierSource lists (SetTierSource): a
	// manager's host tier slots; 0 without one.
	TierBlocks int
}

const (
	nilNode  = -1
	rootNode = 0
)

// node is one cached block, or a free slot when block < 0. Nodes live in
// one slice and refer to each other by index, so the tree holds no Go
// pointers for the collector to trace (except mm, set only for blocks with
// multimodal entries).
type node struct {
	hash     Hash
	parent   int32
	child    int32 // first child
	prev     int32 // siblings
	next     int32 // siblings; the free list's link for free slots
	children int32
	block    int32
	depth    int32 // blocks from the root: a first block has depth 1
	lock     int32
	pin      int32
	prio     int32
	heapPos  int32  // position in the eviction heap; -1 when not there
	holds    int32  // (lock > 0) + (pin > 0) + held children; held when > 0
	epoch    uint32 // the step that inserted it: pending while it is Index.epoch (computed.go)
	spent    bool   // SetSpent: evicted before every node that is not
	last     uint64
	adapter  uint64
	mm       []BlockMM
	salt     string // first blocks only
}

// PinID names one Pin call's pins, for Unpin.
type PinID uint64

// Index is the prefix cache's tree. See the package comment.
type Index struct {
	bs            int
	nodes         []node  // nodes[0] is the root
	tokens        []int32 // node i's tokens are tokens[i*bs : (i+1)*bs]
	freeNodes     []int32 // free node slots, the next one to take last
	byHash        nodeTable
	byBlock       []int32 // block id -> node, or nilNode
	heap          []int32
	clock         uint64
	nLocked       int
	nPinned       int
	nHeld         int             // nodes held by a lock or pin, their own or a descendant's
	epoch         uint32          // the current step: nodes inserted in it are pending (computed.go)
	nPending      int             // cached nodes inserted in the current step
	pins          map[PinID]int32 // -> the deepest pinned node
	nextPin       PinID
	hasher        Hasher
	recent        int32     // the node a walk or Insert ended on: the likely parent of the next Insert
	runHashes     []Hash    // scratch: InsertRun's hashes
	sink          int32     // what prefetch read, kept so that its loads are not dropped
	path          []int32   // scratch: nodes of the last walk
	zeroed        []int32   // scratch: nodes Unlock took to lock 0
	mm            []BlockMM // scratch
	removedHashes []Hash    // scratch for Evict's event
	counters      Stats
	events        eventQueue
}

// New returns an empty index.
func New(cfg Config) (*Index, error) {
	if cfg.BlockSize < 1 || cfg.BlockSize > MaxBlockSize {
		return nil, kverr.Errorf(kverr.InvalidArgument, "block_size must be in [1, %d]: got %d", MaxBlockSize, cfg.BlockSize)
	}
	if cfg.NumBlocks < 1 || cfg.NumBlocks > MaxBlocks {
		return nil, kverr.Errorf(kverr.InvalidArgument, "num_blocks must be in [1, %d]: got %d", MaxBlocks, cfg.NumBlocks)
	}
	if cfg.TierBlocks < 0 || cfg.TierBlocks > limits.TierSlots {
		return nil, kverr.Errorf(kverr.InvalidArgument, "tier blocks must be in [0, 2^30]: got %d", cfg.TierBlocks)
	}
	if cfg.MaxPendingEvents < 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "max_pending_events must be >= 0: got %d", cfg.MaxPendingEvents)
	}
	x := &Index{
		bs:      cfg.BlockSize,
		byHash:  newNodeTable(),
		byBlock: make([]int32, cfg.NumBlocks),
		pins:    make(map[PinID]int32),
		nextPin: 1,
	}
	for i := range x.byBlock {
		x.byBlock[i] = nilNode
	}
	x.resetRoot()
	x.epoch = 1
	x.events.on = cfg.EnableEvents
	x.events.limit = cfg.MaxPendingEvents
	if x.events.limit == 0 {
		x.events.limit = DefaultMaxPendingEvents
	}
	x.events.limit = max(x.events.limit, cfg.NumBlocks+cfg.TierBlocks+1)
	return x, nil
}

func (x *Index) resetRoot() {
	x.nodes = append(x.nodes[:0], node{parent: nilNode, child: nilNode, prev: nilNode, next: nilNode, block: nilNode, heapPos: -1})
	if cap(x.tokens) < x.bs {
		x.tokens = make([]int32, x.bs)
	}
	x.tokens = x.tokens[:x.bs]
	x.freeNodes = x.freeNodes[:0]
}

// BlockSize returns the tokens per block.
func (x *Index) BlockSize() int { return x.bs }

// Len returns the number of cached blocks.
func (x *Index) Len() int { return x.byHash.len() }

// Evictable returns the number of blocks Evict could remove now, counting
// parents that become leaves as their children go: the cached blocks that
// no lock or pin holds, directly or through a descendant. An allocator
// checks it before evicting, so that a request it cannot satisfy fails
// with nothing evicted. O(1).
func (x *Index) Evictable() int { return x.byHash.len() - x.nHeld }

// hold changes node i's hold count by d (+1 or -1) and carries a change of
// its held state up the tree: a held node holds its parent. O(1) when a
// whole path is locked or unlocked together (the next node up is held
// already, or still), O(depth) at worst.
func (x *Index) hold(i int32, d int32) {
	for i != rootNode {
		n := &x.nodes[i]
		was := n.holds > 0
		n.holds += d
		if (n.holds > 0) == was {
			return
		}
		x.nHeld += int(d)
		i = n.parent
	}
}

// Lookup returns the block cached under hash.
func (x *Index) Lookup(h Hash) (block int32, ok bool) {
	i, ok := x.byHash.get(h)
	if !ok {
		return -1, false
	}
	return x.nodes[i].block, true
}

// BlockHash returns the hash of a cached block.
func (x *Index) BlockHash(block int32) (Hash, bool) {
	if block < 0 || int(block) >= len(x.byBlock) || x.byBlock[block] == nilNode {
		return Hash{}, false
	}
	return x.nodes[x.byBlock[block]].hash, true
}

// CachedHashes appends the hashes of every cached block to dst, in no
// particular order.
func (x *Index) CachedHashes(dst []Hash) []Hash {
	x.byHash.each(func(h Hash, _ int32) { dst = append(dst, h) })
	return dst
}

func (x *Index) tokensOf(i int32) []int32 {
	return x.tokens[int(i)*x.bs : (int(i)+1)*x.bs : (int(i)+1)*x.bs]
}

func (x *Index) newNode() int32 {
	if k := len(x.freeNodes); k > 0 {
		i := x.freeNodes[k-1]
		x.freeNodes = x.freeNodes[:k-1]
		return i
	}
	// The caller sets every field, so a slot within capacity (zeroed by
	// Clear, or never used) needs no zeroing here.
	if len(x.nodes) < cap(x.nodes) {
		x.nodes = x.nodes[:len(x.nodes)+1]
	} else {
		x.nodes = append(x.nodes, node{})
	}
	n := len(x.tokens)
	x.tokens = slices.Grow(x.tokens, x.bs)[:n+x.bs]
	return int32(len(x.nodes) - 1)
}

// same reports whether node i is the block with these parent, tokens and
// keys: the check behind every hash hit.
func (x *Index) same(i, parent int32, tokens []int32, adapter uint64, mm []BlockMM, salt []byte) bool {
	n := &x.nodes[i]
	// Lengths first: most blocks have no salt, and comparing two empty
	// strings still calls the runtime.
	return n.parent == parent && n.adapter == adapter && len(n.salt) == len(salt) &&
		(len(salt) == 0 || n.salt == string(salt)) &&
		slices.Equal(n.mm, mm) && equalTokens(x.tokensOf(i), tokens)
}

// walk follows the cached chain of a prompt's first maxBlocks full blocks
// and leaves its nodes in x.path. It returns the last node (the root when
// none matched) and its hash. keys is valid.
//
// A node with at most scanChildren children is searched by comparing its
// children with the block (keys, then tokens), which needs no hash: a
// matched block's hash is its node's. That finds exactly what the table
// lookup would: a child with the block's content has the block's hash
// (every node's hash is its content's), no other node holds that hash,
// and a table hit counts only if it is such a child. Nodes with more
// children (the root, a system prompt's branching point) are searched
// through the table, so a long child list is never scanned.
func (x *Index) walk(tokens []int32, keys *Keys, maxBlocks int) (int32, Hash) {
	x.path = x.path[:0]
	cur := int32(rootNode)
	var h Hash
	bs := x.bs
	short := len(keys.MM) == 0 && shortBlock(bs) // no block has entries
	for i := range maxBlocks {
		blk := tokens[i*bs : (i+1)*bs]
		x.mm = x.mm[:0]
		if len(keys.MM) > 0 {
			x.mm = appendBlockMM(x.mm, keys.MM, i*bs, bs)
		}
		var salt []byte
		if i == 0 {
			salt = keys.Salt
		}
		j := int32(nilNode)
		if n := &x.nodes[cur]; n.children <= scanChildren {
			for c := n.child; c != nilNode; c = x.nodes[c].next {
				if x.same(c, cur, blk, keys.Adapter, x.mm, salt) {
					j = c
					break
				}
			}
			if j == nilNode {
				break
			}
		} else {
			var next Hash
			if short && len(salt) == 0 {
				next = hashShort(&h, blk, keys.Adapter)
			} else {
				x.hasher.buf = AppendBlockInput(x.hasher.buf[:0], h, blk, keys.Adapter, x.mm, salt)
				next = Sum(x.hasher.buf)
			}
			var ok bool
			if j, ok = x.byHash.get(next); !ok || !x.same(j, cur, blk, keys.Adapter, x.mm, salt) {
				break
			}
		}
		x.path = append(x.path, j)
		cur, h = j, x.nodes[j].hash
	}
	x.recent = cur
	return cur, h
}

// scanChildren is the most children walk compares one by one.
const scanChildren = 4

// MatchResult is what Match found.
type MatchResult struct {
	// Blocks is Match's dst with the matched blocks' ids appended, first
	// block first: the prompt's first Tokens tokens are cached in them.
	Blocks []int32
	// Tokens is the number of matched tokens: BlockSize times the number of
	// blocks appended. Always less than the prompt's length.
	Tokens int
	// Last is the hash of the last matched block, the parent for Insert of
	// the prompt's next block; the zero (root) hash when none matched.
	Last Hash
	// PartialBlock is a cached child of the last matched block (or a cached
	// first block, when none matched) whose first PartialTokens tokens hold
	// the same KV as the prompt's next PartialTokens tokens: the caller may
	// copy those rows instead of computing them. -1 when Match was not
	// asked for it or no child shares a token. The index does not keep it
	// for the caller: Lock it until the copy is done.
	PartialBlock  int32
	PartialTokens int
}

// Match finds the longest cached prefix of a prompt in full blocks and
// appends its blocks to dst; with dst of enough capacity it allocates
// nothing. keys may be nil.
//
// A match never covers the prompt's last token, since the model must compute
// at least one position to produce logits: if every full block of the
// prompt is cached and the prompt ends at a block boundary, the last block
// is left out.
//
// With partial, Match also looks for the cached child that shares the
// longest token prefix with the next, unmatched, chunk of the prompt (its
// next BlockSize tokens, or fewer at the end, still never the last token).
// A child counts only with the prompt's adapter (and salt, for a first
// block); its shared tokens end where the two differ in a token or where a
// multimodal entry present in one but not the other begins. Ties go to the
// most recently used child, then to the lowest block id.
//
// Match touches the blocks it returns (not the partial one): they become the
// most recently used. It takes no locks: Lock the blocks before anything
// can evict them.
func (x *Index) Match(dst []int32, tokens []int32, keys *Keys, partial bool) (MatchResult, error) {
	res := MatchResult{Blocks: dst, PartialBlock: -1}
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("match"); err != nil {
		return res, err
	}
	cur, last := x.walk(tokens, keys, x.matchLimit(len(tokens)))
	return x.matchPath(res, tokens, keys, partial, cur, last), nil
}

// MatchPeeked is Match of the first h full blocks Peek just found for the
// same prompt (nothing may change the index in between; the caller chose
// h from the peeked blocks), without walking the prompt again. Peek
// validated the keys.
func (x *Index) MatchPeeked(dst []int32, tokens []int32, keys *Keys, partial bool, h int) MatchResult {
	if keys == nil {
		keys = &noKeys
	}
	cur, last := x.peeked(h)
	return x.matchPath(MatchResult{Blocks: dst, PartialBlock: -1}, tokens, keys, partial, cur, last)
}

// matchPath makes the last walk (x.path, ending at node cur whose hash is
// last) a match's result.
func (x *Index) matchPath(res MatchResult, tokens []int32, keys *Keys, partial bool, cur int32, last Hash) MatchResult {
	x.clock++
	x.take(&res, len(tokens), last)
	if partial {
		res.PartialBlock, res.PartialTokens = x.partial(cur, tokens, keys, res.Tokens)
		x.counters.PartialTokens += int64(res.PartialTokens)
	}
	return res
}

// peeked cuts the last walk (Peek's) to its first h blocks: the node it
// then ends at and that node's hash (the root's zero hash for none).
func (x *Index) peeked(h int) (int32, Hash) {
	x.path = x.path[:h]
	cur, last := int32(rootNode), Hash{}
	if h > 0 {
		cur = x.path[h-1]
		last = x.nodes[cur].hash
	}
	x.recent = cur
	return cur, last
}

// matchLimit is the number of a prompt's full blocks a match may cover:
// those that do not hold its last token.
func (x *Index) matchLimit(promptLen int) int {
	if promptLen == 0 {
		return 0
	}
	return (promptLen - 1) / x.bs
}

// take makes the blocks of the last walk (x.path) a match's result: it
// touches them, appends their ids and counts the query.
func (x *Index) take(res *MatchResult, promptLen int, last Hash) {
	for _, i := range x.path {
		x.nodes[i].last = x.clock
		if x.nodes[i].heapPos >= 0 {
			x.heapFix(i)
		}
		res.Blocks = append(res.Blocks, x.nodes[i].block)
	}
	res.Tokens = len(x.path) * x.bs
	res.Last = last
	x.counters.Queries++
	x.counters.QueryTokens += int64(promptLen)
	x.counters.HitTokens += int64(res.Tokens)
}

// Acquire is Match for an allocator that goes on to hold the matched
// blocks: it also takes one lock on each, provided the rest of the prompt
// fits. need is the number of blocks the whole prompt takes and free the
// number the caller's pool has free; the rest fits when
//
//	need - matched <= free + Evictable()
//
// counted after the lock (a matched block that was evictable is no longer).
// When it does not fit, Acquire returns ok == false and changes nothing:
// no lock, no access, no counter. It never looks for a partial block.
func (x *Index) Acquire(dst []int32, tokens []int32, keys *Keys, need, free int) (res MatchResult, ok bool, err error) {
	res = MatchResult{Blocks: dst, PartialBlock: -1}
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("acquire"); err != nil {
		return res, false, err
	}
	_, last := x.walk(tokens, keys, x.matchLimit(len(tokens)))
	return x.acquirePath(res, len(tokens), last, need, free)
}

// AcquirePeeked is Acquire of the first h blocks Peek just found for a
// prompt of promptLen tokens (nothing may change the index in between;
// the caller chose h from the peeked blocks), without walking the prompt
// again.
func (x *Index) AcquirePeeked(dst []int32, promptLen, h, need, free int) (res MatchResult, ok bool, err error) {
	_, last := x.peeked(h)
	return x.acquirePath(MatchResult{Blocks: dst, PartialBlock: -1}, promptLen, last, need, free)
}

// acquirePath locks the last walk's blocks (x.path; last the hash of its
// last one) when the rest of the prompt fits (Acquire).
func (x *Index) acquirePath(res MatchResult, promptLen int, last Hash, need, free int) (MatchResult, bool, error) {
	nowHeld := 0 // matched blocks the lock takes out of Evictable
	for _, i := range x.path {
		if x.nodes[i].holds == 0 {
			nowHeld++
		}
		if x.nodes[i].lock == math.MaxInt32 {
			return res, false, kverr.Errorf(kverr.InvalidArgument, "acquire: block %d holds 2^31-1 locks", x.nodes[i].block)
		}
	}
	if need-len(x.path) > free+x.Evictable()-nowHeld {
		return res, false, nil
	}
	x.clock++
	x.take(&res, promptLen, last)
	for _, i := range x.path {
		x.addLock(i)
	}
	return res, true, nil
}

// Peek appends to dst the blocks of the longest cached prefix of a prompt,
// as Acquire would match it, and returns it: no access, lock or counter
// changes. keys may be nil.
func (x *Index) Peek(dst []int32, tokens []int32, keys *Keys) ([]int32, error) {
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("peek"); err != nil {
		return dst, err
	}
	x.walk(tokens, keys, x.matchLimit(len(tokens)))
	for _, i := range x.path {
		dst = append(dst, x.nodes[i].block)
	}
	return dst, nil
}

// Unheld returns how many of blocks no lock or pin holds, directly or
// through a descendant: the ones a lock would take out of Evictable.
// Blocks not cached count 0.
func (x *Index) Unheld(blocks []int32) int {
	n := 0
	for _, b := range blocks {
		if i := x.nodeOf(b); i != nilNode && x.nodes[i].holds == 0 {
			n++
		}
	}
	return n
}

// LockCount returns a cached block's number of locks; -1 when the block is
// not cached.
func (x *Index) LockCount(block int32) int32 {
	if block < 0 || int(block) >= len(x.byBlock) || x.byBlock[block] == nilNode {
		return -1
	}
	return x.nodes[x.byBlock[block]].lock
}

// partial finds Match's partial block below node cur for the chunk of
// tokens starting at start.
func (x *Index) partial(cur int32, tokens []int32, keys *Keys, start int) (int32, int) {
	avail := min(x.bs, len(tokens)-1-start)
	if avail <= 0 {
		return -1, 0
	}
	chunk := tokens[start : start+avail]
	x.mm = appendBlockMM(x.mm[:0], keys.MM, start, x.bs)
	var salt []byte
	if cur == rootNode {
		salt = keys.Salt
	}
	best, bestK := int32(nilNode), 0
	for c := x.nodes[cur].child; c != nilNode; c = x.nodes[c].next {
		n := &x.nodes[c]
		if n.adapter != keys.Adapter || n.salt != string(salt) {
			continue
		}
		ct := x.tokensOf(c)
		k := 0
		for k < len(chunk) && ct[k] == chunk[k] {
			k++
		}
		k = min(k, mmCut(n.mm, x.mm), mmCut(x.mm, n.mm))
		if k == 0 {
			continue
		}
		if best == nilNode || k > bestK || (k == bestK && x.recentFirst(c, best)) {
			best, bestK = c, k
		}
	}
	if best == nilNode {
		return -1, 0
	}
	return x.nodes[best].block, bestK
}

func (x *Index) recentFirst(a, b int32) bool {
	na, nb := &x.nodes[a], &x.nodes[b]
	if na.last != nb.last {
		return na.last > nb.last
	}
	return na.block < nb.block
}

// mmCut returns the first block position at which an entry of a that b
// lacks begins to cover tokens: KV past it may differ even where tokens
// agree. math.MaxInt when b has every entry of a.
func mmCut(a, b []BlockMM) int {
	cut := math.MaxInt
	for _, e := range a {
		if !slices.Contains(b, e) {
			cut = min(cut, int(max(e.Offset, 0)))
		}
	}
	return cut
}

// InsertResult is what Insert did.
type InsertResult struct {
	// Hash is the block's chained hash: the parent for the prompt's next
	// block.
	Hash Hash
	// Block is the cached block: the inserted one, or with Dup the one
	// already cached under Hash.
	Block int32
	// Dup reports that an identical block was cached already. The caller
	// holds the same KV twice: it should free its own block (unless it is
	// Block itself) and use Block from now on.
	Dup bool
}

// Insert caches a block that just filled: blockID holds the KV of the
// prompt block whose tokens are block (BlockSize of them), whose parent is
// the cached block with hash parent (the zero hash for a prompt's first
// block), under the prompt's keys (nil: none; multimodal offsets are
// prompt positions, as in Match). The block's place in the prompt follows
// from its parent: it starts at the parent's depth times BlockSize.
//
// Insert takes one lock on the cached block on the caller's behalf, as the
// running sequence that filled it holds it: Unlock it when the sequence
// lets go. If an identical block (same hash) is cached already, that block
// gets the lock and Insert reports it with Dup; nothing else changes.
//
// Errors: a block of the wrong length, a block id outside the pool or
// cached already under another hash, a parent that is not cached
// (NotFound), bad keys, and the astronomically unlikely hash collision with
// a different cached block (the caller just keeps its block private).
func (x *Index) Insert(parent Hash, block []int32, keys *Keys, blockID int32) (InsertResult, error) {
	if keys == nil {
		keys = &noKeys
	}
	if len(block) != x.bs {
		return InsertResult{}, kverr.Errorf(kverr.InvalidArgument, "insert: block holds %d tokens, block size is %d", len(block), x.bs)
	}
	if blockID < 0 || int(blockID) >= len(x.byBlock) {
		return InsertResult{}, kverr.Errorf(kverr.InvalidArgument, "insert: block %d is outside the pool of %d", blockID, len(x.byBlock))
	}
	if err := keys.validate("insert"); err != nil {
		return InsertResult{}, err
	}
	p, err := x.parentNode("insert", parent)
	if err != nil {
		return InsertResult{}, err
	}
	res, _, err := x.insertAt(p, parent, block, keys, blockID, nil)
	return res, err
}

// InsertRun is Insert for a run of consecutive full blocks of one prompt:
// block k's tokens are tokens[k*BlockSize : (k+1)*BlockSize] and its id
// ids[k]; block 0's parent is parent and each later block's the block
// before it. It does what Insert would do called for each block in turn
// with the hash the previous call returned, and writes each call's result
// to out[k]. It returns the number of blocks done: all of them, or fewer
// when it stopped early, either after a block that was cached already
// (its result has Dup, so that the caller can act on it, say unlock the
// twin, before the next insert, as between Insert calls), or at a block
// Insert would refuse, with that block's error (a refused block leaves
// the rest of the run without a cached parent). Checked before anything
// changes: len(tokens) == len(ids)*BlockSize, len(out) >= len(ids), keys,
// parent.
//
// It computes the run's hashes first and reads the table slots and tree
// nodes the inserts will use before it inserts any block, so the memory
// loads of the whole run overlap instead of each block waiting on its
// own.
func (x *Index) InsertRun(parent Hash, tokens []int32, keys *Keys, ids []int32, out []InsertResult) (int, error) {
	if keys == nil {
		keys = &noKeys
	}
	if len(tokens) != len(ids)*x.bs {
		return 0, kverr.Errorf(kverr.InvalidArgument, "insert run: %d tokens for %d blocks of %d", len(tokens), len(ids), x.bs)
	}
	if len(out) < len(ids) {
		return 0, kverr.Errorf(kverr.InvalidArgument, "insert run: out holds %d results for %d blocks", len(out), len(ids))
	}
	if err := keys.validate("insert run"); err != nil {
		return 0, err
	}
	p, err := x.parentNode("insert run", parent)
	if err != nil {
		return 0, err
	}
	bs := x.bs
	depth := int(x.nodes[p].depth)
	hs := slices.Grow(x.runHashes[:0], len(ids))[:len(ids)]
	short := len(keys.MM) == 0 && shortBlock(bs) // no block has entries
	h := parent
	for k := range hs {
		blk := tokens[k*bs : (k+1)*bs]
		if short && (depth+k > 0 || len(keys.Salt) == 0) {
			h = hashShort(&h, blk, keys.Adapter)
		} else {
			x.mm = appendBlockMM(x.mm[:0], keys.MM, (depth+k)*bs, bs)
			var salt []byte
			if depth+k == 0 {
				salt = keys.Salt
			}
			x.hasher.buf = AppendBlockInput(x.hasher.buf[:0], h, blk, keys.Adapter, x.mm, salt)
			h = Sum(x.hasher.buf)
		}
		hs[k] = h
	}
	x.runHashes = hs
	x.prefetch(hs)
	for k, id := range ids {
		res, i, err := x.insertAt(p, parent, tokens[k*bs:(k+1)*bs], keys, id, &hs[k])
		if err != nil {
			return k, err
		}
		out[k] = res
		if res.Dup {
			return k + 1, nil
		}
		p, parent = i, res.Hash
	}
	return len(ids), nil
}

// parentNode returns the node of an insert's parent hash: the root for
// the zero hash.
func (x *Index) parentNode(op string, parent Hash) (int32, error) {
	if parent.IsZero() {
		return rootNode, nil
	}
	// A sequence inserts its blocks in order, each under the one inserted
	// or matched just before: check that node before the table.
	if r := x.recent; r > rootNode && int(r) < len(x.nodes) && x.nodes[r].block >= 0 && x.nodes[r].hash == parent {
		return r, nil
	}
	p, ok := x.byHash.get(parent)
	if !ok {
		return nilNode, kverr.Errorf(kverr.NotFound, "%s: parent block %s is not cached", op, parent)
	}
	return p, nil
}

// prefetch reads, for inserts of blocks with hashes hs, the table slot
// each hash starts probing at and the node slots (and their token rows)
// the inserts will take, so that their cache misses overlap. It changes
// nothing; a slot read here that the inserts do not use is harmless.
func (x *Index) prefetch(hs []Hash) {
	var acc int32
	t := &x.byHash
	for k := range hs {
		acc += t.slots[t.home(&hs[k])].node
	}
	for k := 1; k <= len(hs) && k <= len(x.freeNodes); k++ {
		i := x.freeNodes[len(x.freeNodes)-k]
		n := &x.nodes[i] // its first and last words: a node spans two cache lines
		acc += int32(n.hash[0]) + int32(len(n.salt)) + x.tokens[int(i)*x.bs]
	}
	x.sink = acc
}

// insertAt is Insert of a block whose parent node p (hash parent) is
// resolved and whose keys are valid; h is the block's hash when the
// caller has computed it. It also returns the cached block's node.
func (x *Index) insertAt(p int32, parent Hash, block []int32, keys *Keys, blockID int32, hp *Hash) (InsertResult, int32, error) {
	if blockID < 0 || int(blockID) >= len(x.byBlock) {
		return InsertResult{}, nilNode, kverr.Errorf(kverr.InvalidArgument, "insert: block %d is outside the pool of %d", blockID, len(x.byBlock))
	}
	depth := int(x.nodes[p].depth)
	x.mm = x.mm[:0]
	if len(keys.MM) > 0 {
		x.mm = appendBlockMM(x.mm, keys.MM, depth*x.bs, x.bs)
	}
	var salt []byte
	if depth == 0 {
		salt = keys.Salt
	}
	var h Hash
	if hp != nil {
		h = *hp
	} else {
		h = x.hasher.sum(parent, block, keys.Adapter, x.mm, salt)
	}

	i, slot, ok := x.byHash.lookup(h)
	if ok {
		if !x.same(i, p, block, keys.Adapter, x.mm, salt) {
			return InsertResult{}, nilNode, kverr.Errorf(kverr.InvalidArgument, "insert: hash %s of block %d collides with cached block %d of different content", h, blockID, x.nodes[i].block)
		}
		if b := x.byBlock[blockID]; b != nilNode && b != i {
			return InsertResult{}, nilNode, kverr.Errorf(kverr.InvalidArgument, "insert: block %d is cached already under hash %s", blockID, x.nodes[b].hash)
		}
		if x.nodes[i].lock == math.MaxInt32 {
			return InsertResult{}, nilNode, kverr.Errorf(kverr.InvalidArgument, "insert: block %d holds 2^31-1 locks", x.nodes[i].block)
		}
		x.clock++
		x.addLock(i)
		x.nodes[i].last = x.clock
		x.counters.Dedups++
		x.recent = i
		return InsertResult{Hash: h, Block: x.nodes[i].block, Dup: true}, i, nil
	}
	if b := x.byBlock[blockID]; b != nilNode {
		return InsertResult{}, nilNode, kverr.Errorf(kverr.InvalidArgument, "insert: block %d is cached already under hash %s", blockID, x.nodes[b].hash)
	}

	x.clock++
	i = x.newNode()
	pn := &x.nodes[p]
	x.nodes[i] = node{
		hash:    h,
		parent:  p,
		child:   nilNode,
		prev:    nilNode,
		next:    pn.child,
		block:   blockID,
		depth:   pn.depth + 1,
		lock:    1,
		heapPos: -1,
		epoch:   x.epoch,
		last:    x.clock,
		adapter: keys.Adapter,
	}
	if len(salt) > 0 {
		x.nodes[i].salt = string(salt)
	}
	if len(x.mm) > 0 {
		x.nodes[i].mm = slices.Clone(x.mm)
	}
	if pn.child != nilNode {
		x.nodes[pn.child].prev = i
	}
	pn.child = i
	pn.children++
	copy(x.tokensOf(i), block)
	x.byHash.putAt(slot, h, i)
	x.byBlock[blockID] = i
	x.nLocked++
	x.nPending++
	x.hold(i, +1)
	x.settle(p)
	x.counters.Inserts++
	x.recent = i
	if x.events.on {
		x.events.stored(x, i)
	}
	return InsertResult{Hash: h, Block: blockID}, i, nil
}

func (x *Index) addLock(i int32) {
	n := &x.nodes[i]
	n.lock++
	if n.lock == 1 {
		x.nLocked++
		x.hold(i, +1)
		x.settle(i)
	}
}

// resolve maps block ids to their nodes in x.path, or fails naming the
// first id that is not a cached block.
func (x *Index) resolve(op string, ids []int32) error {
	x.path = x.path[:0]
	for _, id := range ids {
		if id < 0 || int(id) >= len(x.byBlock) {
			return kverr.Errorf(kverr.InvalidArgument, "%s: block %d is outside the pool of %d", op, id, len(x.byBlock))
		}
		i := x.byBlock[id]
		if i == nilNode {
			return kverr.Errorf(kverr.NotFound, "%s: block %d is not cached", op, id)
		}
		x.path = append(x.path, i)
	}
	return nil
}

// Lock takes one lock on each block of ids (a repeated id takes one per
// occurrence): locked blocks are never evicted. Every id must be a cached
// block (NotFound otherwise). Lock is not an access: Match, which finds
// the blocks, already touched them.
func (x *Index) Lock(ids []int32) error {
	if err := x.resolve("lock", ids); err != nil {
		return err
	}
	for k, i := range x.path {
		if x.nodes[i].lock == math.MaxInt32 {
			for _, j := range x.path[:k] {
				x.dropLock(j)
			}
			return kverr.Errorf(kverr.InvalidArgument, "lock: block %d holds 2^31-1 locks", ids[k])
		}
		x.addLock(i)
	}
	return nil
}

func (x *Index) dropLock(i int32) {
	n := &x.nodes[i]
	n.lock--
	if n.lock == 0 {
		x.nLocked--
		x.hold(i, -1)
		x.settle(i)
	}
}

// Unlock drops one lock from each block of ids (a repeated id drops one per
// occurrence) and touches them all. A block that loses its last lock stays
// cached, evictable once no pin or child holds it. All or none: an id that
// is not cached, or has fewer locks than it occurs, changes nothing.
func (x *Index) Unlock(ids []int32) error { return x.unlock("unlock", ids, true) }

// Release drops one lock from each block of ids, as Unlock does, but is not
// an access: the blocks keep their last-access time, so the eviction order
// is what it would have been without the lock. For holds that are not a
// sequence's use of a block (a copy reading it). All or none, as Unlock.
func (x *Index) Release(ids []int32) error { return x.unlock("release", ids, false) }

// unlock is Unlock, touching the blocks when touch is set.
func (x *Index) unlock(op string, ids []int32, touch bool) error {
	if err := x.resolve(op, ids); err != nil {
		return err
	}
	// Decrement tentatively, so repeats count exactly; undo on the first
	// block with no lock left.
	x.zeroed = x.zeroed[:0]
	for k, i := range x.path {
		if x.nodes[i].lock < 1 {
			for _, j := range x.path[:k] {
				x.nodes[j].lock++
			}
			return kverr.Errorf(kverr.InvalidArgument, "%s: block %d has no lock left", op, ids[k])
		}
		if x.nodes[i].lock--; x.nodes[i].lock == 0 {
			x.zeroed = append(x.zeroed, i)
		}
	}
	for _, i := range x.zeroed {
		x.nLocked--
		x.hold(i, -1)
	}
	if touch {
		x.clock++
	}
	for _, i := range x.path {
		if touch {
			x.nodes[i].last = x.clock
		}
		x.settle(i)
	}
	return nil
}

// Describe appends the tokens of cached block id to toks and returns them
// with the fields of its BlockStored event; ok is false when the block is
// not cached. The MM slice is the index's: copy it to keep it.
func (x *Index) Describe(id int32, toks []int32) (EvictedBlock, []int32, bool) {
	i := x.nodeOf(id)
	if i == nilNode {
		return EvictedBlock{}, toks, false
	}
	n := &x.nodes[i]
	return EvictedBlock{Block: id, Hash: n.hash, Parent: x.nodes[n.parent].hash, Adapter: n.adapter, MM: n.mm},
		append(toks, x.tokensOf(i)...), true
}
