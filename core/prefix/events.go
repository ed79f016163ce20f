package prefix

import (
	"fmt"
	"math"
	"strings"

	"github.com/kvplug/kvplug/core/kverr"
)

// EventKind says what an Event reports.
type EventKind uint8

// The event kinds of vLLM's KV events.
const (
	BlockStored  EventKind = 1 // a block entered the cache
	BlockRemoved EventKind = 2 // blocks left the cache
	AllCleared   EventKind = 3 // forget every block: the cache is empty, or a snapshot follows
)

func (k EventKind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllCleared:
		return "AllCleared"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// Medium is where the blocks of an event are held: vLLM's "medium" of
// BlockStored and BlockRemoved. The prefix cache's own blocks are on the
// GPU; a manager's host tier records its blocks' events as CPU (as vLLM's
// OffloadingConnector does); Shared names a tier that instances share (a
// Valkey/Redis store), reserved for it. The zero value is GPU.
type Medium uint8

// The media of KV events.
const (
	MediumGPU    Medium = 0 // "GPU": the GPU block pool (vLLM's name)
	MediumCPU    Medium = 1 // "CPU": host memory (vLLM's name for offloaded blocks)
	MediumShared Medium = 2 // "SHARED": a tier shared by instances
	// NumMedia is the number of media; every Medium is below it.
	NumMedia = 3
)

var mediumNames = [NumMedia]string{"GPU", "CPU", "SHARED"}

// String returns the medium's name on the wire: "GPU", "CPU" or "SHARED".
func (m Medium) String() string {
	if int(m) < NumMedia {
		return mediumNames[m]
	}
	return fmt.Sprintf("Medium(%d)", uint8(m))
}

// ParseMedium returns the medium named s, in any case ("GPU", "cpu",
// "Shared", ...); ok is false for any other name.
func ParseMedium(s string) (m Medium, ok bool) {
	for i, n := range mediumNames {
		if strings.EqualFold(s, n) {
			return Medium(i), true
		}
	}
	return 0, false
}

// Event is a change of the set of cached blocks, for a router that keeps
// its own view of which engine caches which prefix. Its fields are those
// of vLLM's KV events; the salt is not among them (it may be a secret), so
// a router learns a first block's salted hash, not the salt.
type Event struct {
	Kind EventKind
	// Medium says where the blocks of a BlockStored or BlockRemoved are:
	// GPU for the prefix cache's own events, CPU for a host tier's
	// (RecordTierStored, RecordTierRemoved). AllCleared has no medium: it
	// clears every one.
	Medium Medium

	// BlockStored: the block's hash, its parent's (zero for a first
	// block), its tokens (BlockSize of them), and its extra keys: the
	// adapter and the multimodal entries as its hash saw them. A block
	// of a tier below the GPU carries the same fields, its parent being
	// the previous block of its chain, wherever that block is held.
	Hash      Hash
	Parent    Hash
	Tokens    []int32
	BlockSize int
	Adapter   uint64
	MM        []BlockMM

	// BlockRemoved: the removed blocks' hashes, children before parents.
	Hashes []Hash

	// Group is the layer group of a BlockStored's or BlockRemoved's
	// blocks (vLLM's group_idx): 0 for the prefix cache's own blocks and
	// a tier's; g > 0 for the blocks a manager with layer groups keeps in
	// group g with a cached block (RecordGroupStored), under that block's
	// hash, whose BlockStored carries that block's fields. A group's
	// blocks form a set, not a tree: a window group may keep a block and
	// not its parent's.
	Group int
}

// pendingEvent is an undrained event; its slices live in the queue's
// arenas, at offsets that DrainEvents turns into caller-owned copies.
type pendingEvent struct {
	kind    EventKind
	medium  Medium
	group   int32
	hash    Hash
	parent  Hash
	adapter uint64
	nTok    int // BlockStored: tokens in toks
	nMM     int // BlockStored: entries in mms
	nHash   int // BlockRemoved: hashes in hashes
}

// eventQueue holds the undrained events in order. Arenas are consumed from
// their heads in event order, so each event's slices start where the
// previous event's end.
type eventQueue struct {
	on       bool
	tier     TierSource  // blocks below the GPU, listed by snapshots; nil: none
	groups   GroupSource // layer groups' blocks, listed by snapshots; nil: none
	limit    int
	q        []pendingEvent
	head     int
	toks     []int32
	tokHead  int
	mms      []BlockMM
	mmHead   int
	hashes   []Hash
	hashHead int
	resync   bool // events were lost: the next drain starts with a snapshot
	dropped  int64
}

func (e *eventQueue) pending(cached int) int {
	if e.resync {
		n := 1 + cached
		if e.tier != nil {
			n += e.tier.TierLen()
		}
		if e.groups != nil {
			n += e.groups.GroupLen()
		}
		return n
	}
	return len(e.q) - e.head
}

func (e *eventQueue) reset() {
	e.q, e.head = e.q[:0], 0
	e.toks, e.tokHead = e.toks[:0], 0
	e.mms, e.mmHead = e.mms[:0], 0
	e.hashes, e.hashHead = e.hashes[:0], 0
}

// admit reports whether one more event may be recorded. A full queue is
// discarded whole and replaced, at the next drain, by a snapshot: dropping
// only some events would leave a consumer's view silently wrong.
func (e *eventQueue) admit() bool {
	if !e.on {
		return false
	}
	if e.resync {
		e.dropped++
		return false
	}
	if n := len(e.q) - e.head; n >= e.limit {
		e.dropped += int64(n) + 1
		e.reset()
		e.resync = true
		return false
	}
	return true
}

func (e *eventQueue) stored(x *Index, i int32) {
	if e.admit() {
		e.pushStored(x, i)
	}
}

// pushStored records a BlockStored of the prefix cache's block i.
func (e *eventQueue) pushStored(x *Index, i int32) {
	n := &x.nodes[i]
	e.pushBlockStored(MediumGPU, n.hash, x.nodes[n.parent].hash, n.adapter, x.tokensOf(i), n.mm)
}

// pushGroupStored records a BlockStored of layer group g for the block
// it keeps with the prefix cache's block i: i's fields, in group g.
func (e *eventQueue) pushGroupStored(x *Index, i int32, g int) {
	e.pushStored(x, i)
	e.q[len(e.q)-1].group = int32(g)
}

func (e *eventQueue) removed(m Medium, hashes []Hash) {
	e.removedIn(m, 0, hashes)
}

// removedIn records a BlockRemoved of medium m in layer group g.
func (e *eventQueue) removedIn(m Medium, g int, hashes []Hash) {
	if e.admit() {
		e.q = append(e.q, pendingEvent{kind: BlockRemoved, medium: m, group: int32(g), nHash: len(hashes)})
		e.hashes = append(e.hashes, hashes...)
	}
}

// pushTier records a BlockStored of a tier's block.
func (e *eventQueue) pushTier(b *TierBlock) {
	e.pushBlockStored(b.Medium, b.Hash, b.Parent, b.Adapter, b.Tokens, b.MM)
}

// pushBlockStored records a BlockStored of medium m, whether the block is
// the prefix cache's own (pushStored) or a tier's (pushTier). Its tokens
// and extra keys are copied into the arenas, since their owner may reuse
// them before the event is drained; the event's BlockSize is len(tokens).
func (e *eventQueue) pushBlockStored(m Medium, hash, parent Hash, adapter uint64, tokens []int32, mm []BlockMM) {
	e.q = append(e.q, pendingEvent{
		kind:    BlockStored,
		medium:  m,
		hash:    hash,
		parent:  parent,
		adapter: adapter,
		nTok:    len(tokens),
		nMM:     len(mm),
	})
	e.toks = append(e.toks, tokens...)
	e.mms = append(e.mms, mm...)
}

// pushTierBlocks records a BlockStored for every block the tier source
// holds (after an AllCleared: a consumer forgets every medium's blocks).
func (e *eventQueue) pushTierBlocks() {
	if e.tier == nil {
		return
	}
	blocks := e.tier.AppendTierBlocks(nil)
	for k := range blocks {
		e.pushTier(&blocks[k])
	}
}

// cleared records AllCleared. The events before it no longer matter to a
// consumer, which ends up empty either way, so they are discarded (not
// counted as dropped), and a pending resync is no longer needed. The
// blocks of the tiers below the GPU, which Clear does not touch, follow
// it as BlockStored events, since a consumer forgets them too.
func (e *eventQueue) cleared(x *Index) {
	if !e.on {
		return
	}
	e.reset()
	e.resync = false
	e.q = append(e.q, pendingEvent{kind: AllCleared})
	e.pushTierBlocks()
}

// snapshot replaces a lost stretch of events: AllCleared, then one
// BlockStored per cached block, parents before children, then, group by
// group, one per block a layer group keeps (SetGroupSource) in the same
// order, then one per block of the tier source (SetTierSource), in its
// order.
func (x *Index) snapshot() {
	e := &x.events
	e.resync = false
	e.reset()
	e.q = append(e.q, pendingEvent{kind: AllCleared})
	level := make([]int32, 0, x.byHash.len())
	for c := x.nodes[rootNode].child; c != nilNode; c = x.nodes[c].next {
		level = append(level, c)
	}
	for k := 0; k < len(level); k++ {
		i := level[k]
		e.pushStored(x, i)
		for c := x.nodes[i].child; c != nilNode; c = x.nodes[c].next {
			level = append(level, c)
		}
	}
	if src := e.groups; src != nil {
		for g := 1; g < src.NumGroups(); g++ {
			for _, i := range level {
				if src.GroupHolds(g, x.nodes[i].block) {
					e.pushGroupStored(x, i, g)
				}
			}
		}
	}
	e.pushTierBlocks()
}

// TierBlock is a block a tier below the GPU holds (a manager's host
// tier), with the fields of its BlockStored event: those of the prefix
// cache's block it was (Tokens holds BlockSize tokens).
type TierBlock struct {
	Medium  Medium
	Hash    Hash
	Parent  Hash
	Adapter uint64
	Tokens  []int32
	MM      []BlockMM
}

// TierSource lists the blocks of the tiers below the GPU, for the
// snapshots that rebuild a consumer's view (DrainEvents after a full
// queue, RequestSnapshot) and for Clear, whose AllCleared a consumer
// applies to every medium. Its owner (the manager) calls the index under
// the same lock as it changes the tier.
type TierSource interface {
	// TierLen returns the number of blocks AppendTierBlocks lists.
	TierLen() int
	// AppendTierBlocks appends every block the tiers hold to dst and
	// returns it; the index copies what it keeps.
	AppendTierBlocks(dst []TierBlock) []TierBlock
}

// SetTierSource makes snapshots and Clear list src's blocks after the
// prefix cache's; nil removes it. A no-op when events are off.
// Config.TierBlocks should bound src's blocks, so that a snapshot fits
// the event queue's bound.
func (x *Index) SetTierSource(src TierSource) {
	if x.events.on {
		x.events.tier = src
	}
}

// GroupSource lists the blocks that a manager's layer groups past group 0
// keep with the prefix cache's blocks (a window group's block holding a
// cached block's tokens, a recurrent group's state after them), for the
// snapshots that rebuild a consumer's view. Its owner calls the index
// under the same lock as it changes the groups.
type GroupSource interface {
	// NumGroups returns the number of layer groups, group 0 included.
	NumGroups() int
	// GroupLen returns the number of blocks GroupHolds reports, over
	// every group.
	GroupLen() int
	// GroupHolds reports whether group g (> 0) keeps a block with the
	// cached block block.
	GroupHolds(g int, block int32) bool
}

// SetGroupSource makes snapshots list src's blocks after the prefix
// cache's; nil removes it. A no-op when events are off.
func (x *Index) SetGroupSource(src GroupSource) {
	if x.events.on {
		x.events.groups = src
	}
}

// RecordGroupStored records a BlockStored event of layer group g (> 0)
// for the block that group now keeps with cached block block: the
// fields of block's own BlockStored (hash, parent, tokens, keys), with
// Group g. Errors: InvalidArgument (g < 1, block not cached), recording
// nothing. A no-op when events are off.
func (x *Index) RecordGroupStored(g int, block int32) error {
	i := x.nodeOf(block)
	if g < 1 || g > math.MaxInt32 || i == nilNode {
		return kverr.Errorf(kverr.InvalidArgument, "group event: group %d of block %d (cached %v): a group past 0 of a cached block expected", g, block, i != nilNode)
	}
	if x.events.admit() {
		x.events.pushGroupStored(x, i, g)
	}
	return nil
}

// RecordGroupRemoved records a BlockRemoved event of layer group g (> 0)
// for the blocks that group no longer keeps, named by the hashes of the
// cached blocks they were kept with (those may have left the cache
// already). Errors: InvalidArgument (g < 1), recording nothing. A no-op
// when events are off or hashes is empty.
func (x *Index) RecordGroupRemoved(g int, hashes []Hash) error {
	if g < 1 || g > math.MaxInt32 {
		return kverr.Errorf(kverr.InvalidArgument, "group event: group %d: a group past 0 expected", g)
	}
	if len(hashes) > 0 {
		x.events.removedIn(MediumGPU, g, hashes)
	}
	return nil
}

// RecordTierStored records a BlockStored event of b.Medium for a block a
// tier below the GPU now holds (a demotion committed to the host tier),
// under the event queue's bound as the index's own events (DrainEvents).
// Errors: InvalidArgument (b.Medium GPU or unknown, b.Tokens not
// BlockSize long), recording nothing. A no-op when events are off.
func (x *Index) RecordTierStored(b *TierBlock) error {
	if b.Medium == MediumGPU || int(b.Medium) >= NumMedia {
		return kverr.Errorf(kverr.InvalidArgument, "tier event: medium %v is not a tier below the GPU", b.Medium)
	}
	if len(b.Tokens) != x.bs {
		return kverr.Errorf(kverr.InvalidArgument, "tier event: a block of %d tokens, the block size is %d", len(b.Tokens), x.bs)
	}
	if x.events.admit() {
		x.events.pushTier(b)
	}
	return nil
}

// RecordTierRemoved records a BlockRemoved event of medium m for blocks a
// tier below the GPU no longer holds (host slots evicted or overwritten),
// under the event queue's bound. Errors: InvalidArgument (m GPU or
// unknown), recording nothing. A no-op when events are off or hashes is
// empty.
func (x *Index) RecordTierRemoved(m Medium, hashes []Hash) error {
	if m == MediumGPU || int(m) >= NumMedia {
		return kverr.Errorf(kverr.InvalidArgument, "tier event: medium %v is not a tier below the GPU", m)
	}
	if len(hashes) > 0 {
		x.events.removed(m, hashes)
	}
	return nil
}

// DrainEvents removes up to max of the oldest pending events (all of them
// when max <= 0) and returns them in order, in memory the caller owns; nil
// when events are off or none is pending.
//
// The queue holds at most Config.MaxPendingEvents events (raised to
// NumBlocks+TierBlocks+1). When an event would exceed that, every pending event is
// discarded, counted in Stats.EventsDropped with every event after it, and
// recording stops; the next DrainEvents then starts with AllCleared
// followed by a BlockStored for every block cached at that moment (parents
// first) and one for every block of the tier source, after which
// recording resumes. A consumer that applies the
// stream in order thus always ends with the index's set of cached blocks;
// AllCleared means "forget everything", whether the cache was cleared or a
// snapshot follows.
func (x *Index) DrainEvents(max int) []Event {
	e := &x.events
	if !e.on {
		return nil
	}
	if e.resync {
		x.snapshot()
	}
	n := len(e.q) - e.head
	if max > 0 && max < n {
		n = max
	}
	if n == 0 {
		return nil
	}
	batch := e.q[e.head : e.head+n]
	nTok, nMM, nHash := 0, 0, 0
	for _, p := range batch {
		nTok += p.nTok
		nMM += p.nMM
		nHash += p.nHash
	}
	out := make([]Event, n)
	toks := make([]int32, nTok)
	copy(toks, e.toks[e.tokHead:])
	var mms []BlockMM
	if nMM > 0 {
		mms = make([]BlockMM, nMM)
		copy(mms, e.mms[e.mmHead:])
	}
	var hashes []Hash
	if nHash > 0 {
		hashes = make([]Hash, nHash)
		copy(hashes, e.hashes[e.hashHead:])
	}
	for k, p := range batch {
		ev := &out[k]
		ev.Kind, ev.Medium, ev.Group = p.kind, p.medium, int(p.group)
		switch p.kind {
		case BlockStored:
			ev.Hash, ev.Parent, ev.Adapter, ev.BlockSize = p.hash, p.parent, p.adapter, p.nTok
			ev.Tokens, toks = toks[:p.nTok:p.nTok], toks[p.nTok:]
			if p.nMM > 0 {
				ev.MM, mms = mms[:p.nMM:p.nMM], mms[p.nMM:]
			}
		case BlockRemoved:
			ev.Hashes, hashes = hashes[:p.nHash:p.nHash], hashes[p.nHash:]
		}
	}
	e.head += n
	e.tokHead += nTok
	e.mmHead += nMM
	e.hashHead += nHash
	switch {
	case e.head == len(e.q):
		e.reset()
	case e.head > len(e.q)/2:
		// Compact so a consumer that drains in small batches does not
		// keep the arenas growing.
		e.q = e.q[:copy(e.q, e.q[e.head:])]
		e.toks = e.toks[:copy(e.toks, e.toks[e.tokHead:])]
		e.mms = e.mms[:copy(e.mms, e.mms[e.mmHead:])]
		e.hashes = e.hashes[:copy(e.hashes, e.hashes[e.hashHead:])]
		e.head, e.tokHead, e.mmHead, e.hashHead = 0, 0, 0, 0
	}
	return out
}

// EventsEnabled reports whether the index records KV events
// (Config.EnableEvents).
func (x *Index) EventsEnabled() bool { return x.events.on }

// EventIndex is the view of a cache that a consumer builds from its events
// alone: the set of cached block hashes and their parents on the GPU, the
// set of blocks each layer group past 0 keeps there (Event.Group), and the
// set of blocks of each tier below it. It checks the stream as it goes
// (a GPU block is stored once, under a present parent, and removed only as
// a leaf; a group's or a tier's block is stored once and removed only
// while stored), so it doubles as the events' test oracle.
type EventIndex struct {
	parent   map[Hash]Hash
	children map[Hash]int
	tiers    [NumMedia]map[Hash]struct{} // [MediumGPU] unused
	groups   map[int]map[Hash]struct{}   // layer groups past 0
}

// NewEventIndex returns an empty EventIndex.
func NewEventIndex() *EventIndex {
	r := &EventIndex{parent: make(map[Hash]Hash), children: make(map[Hash]int), groups: make(map[int]map[Hash]struct{})}
	for m := 1; m < NumMedia; m++ {
		r.tiers[m] = make(map[Hash]struct{})
	}
	return r
}

// LenGroup returns the number of blocks the events say layer group g
// keeps on the GPU (Len for group 0).
func (r *EventIndex) LenGroup(g int) int {
	if g == 0 {
		return r.Len()
	}
	return len(r.groups[g])
}

// ContainsGroup reports whether the events say layer group g keeps block
// h on the GPU (Contains for group 0).
func (r *EventIndex) ContainsGroup(g int, h Hash) bool {
	if g == 0 {
		return r.Contains(h)
	}
	_, ok := r.groups[g][h]
	return ok
}

// applySet applies a BlockStored or BlockRemoved to set, a set of blocks
// without parents (a tier's or a layer group's); what names it.
func applySet(set map[Hash]struct{}, ev Event, what string) error {
	switch ev.Kind {
	case BlockStored:
		if _, ok := set[ev.Hash]; ok {
			return kverr.Errorf(kverr.InvalidArgument, "replay: %s block %s stored twice", what, ev.Hash)
		}
		set[ev.Hash] = struct{}{}
	case BlockRemoved:
		seen := make(map[Hash]bool, len(ev.Hashes))
		for _, h := range ev.Hashes {
			if _, ok := set[h]; !ok || seen[h] {
				return kverr.Errorf(kverr.InvalidArgument, "replay: removed %s block %s is not stored", what, h)
			}
			seen[h] = true
		}
		for _, h := range ev.Hashes {
			delete(set, h)
		}
	}
	return nil
}

// Len returns the number of blocks the events say are cached on the GPU.
func (r *EventIndex) Len() int { return len(r.parent) }

// Contains reports whether the events say block h is cached on the GPU.
func (r *EventIndex) Contains(h Hash) bool {
	_, ok := r.parent[h]
	return ok
}

// Hashes appends the hashes of the blocks the events say are cached on
// the GPU to dst, in no particular order.
func (r *EventIndex) Hashes(dst []Hash) []Hash {
	for h := range r.parent {
		dst = append(dst, h)
	}
	return dst
}

// LenIn is Len for medium m.
func (r *EventIndex) LenIn(m Medium) int {
	if m == MediumGPU {
		return r.Len()
	}
	return len(r.tiers[m])
}

// ContainsIn is Contains for medium m.
func (r *EventIndex) ContainsIn(m Medium, h Hash) bool {
	if m == MediumGPU {
		return r.Contains(h)
	}
	_, ok := r.tiers[m][h]
	return ok
}

// HashesIn is Hashes for medium m.
func (r *EventIndex) HashesIn(m Medium, dst []Hash) []Hash {
	if m == MediumGPU {
		return r.Hashes(dst)
	}
	for h := range r.tiers[m] {
		dst = append(dst, h)
	}
	return dst
}

// applyTier applies a tier's BlockStored or BlockRemoved.
func (r *EventIndex) applyTier(ev Event) error {
	return applySet(r.tiers[ev.Medium], ev, ev.Medium.String())
}

// applyGroup applies a BlockStored or BlockRemoved of a layer group past 0.
func (r *EventIndex) applyGroup(ev Event) error {
	if ev.Group < 0 || ev.Medium != MediumGPU {
		return kverr.Errorf(kverr.InvalidArgument, "replay: an event of layer group %d on medium %v (groups past 0 are on the GPU)", ev.Group, ev.Medium)
	}
	set := r.groups[ev.Group]
	if set == nil {
		set = make(map[Hash]struct{})
		r.groups[ev.Group] = set
	}
	return applySet(set, ev, fmt.Sprintf("group %d", ev.Group))
}

// Apply applies one event. An event inconsistent with the stream so far
// (a block stored twice or under an unknown parent, an unknown block
// removed, a block removed before its children; for a tier below the
// GPU or a layer group past 0, a block stored twice or an unknown one
// removed) is an error and changes nothing.
func (r *EventIndex) Apply(ev Event) error {
	if ev.Kind == BlockStored || ev.Kind == BlockRemoved {
		if int(ev.Medium) >= NumMedia {
			return kverr.Errorf(kverr.InvalidArgument, "replay: unknown medium %d", ev.Medium)
		}
		if ev.Group != 0 {
			return r.applyGroup(ev)
		}
		if ev.Medium != MediumGPU {
			return r.applyTier(ev)
		}
	}
	switch ev.Kind {
	case BlockStored:
		if _, ok := r.parent[ev.Hash]; ok {
			return kverr.Errorf(kverr.InvalidArgument, "replay: block %s stored twice", ev.Hash)
		}
		if !ev.Parent.IsZero() {
			if _, ok := r.parent[ev.Parent]; !ok {
				return kverr.Errorf(kverr.InvalidArgument, "replay: block %s stored under unknown parent %s", ev.Hash, ev.Parent)
			}
		}
		r.parent[ev.Hash] = ev.Parent
		r.children[ev.Parent]++
	case BlockRemoved:
		gone := make(map[Hash]int, len(ev.Hashes)) // removed children per parent, then -1 for removed blocks
		for _, h := range ev.Hashes {
			p, ok := r.parent[h]
			if !ok || gone[h] < 0 {
				return kverr.Errorf(kverr.InvalidArgument, "replay: removed block %s is not stored", h)
			}
			if r.children[h] > gone[h] {
				return kverr.Errorf(kverr.InvalidArgument, "replay: block %s removed while %d children remain", h, r.children[h]-gone[h])
			}
			gone[h] = -1
			if gone[p] >= 0 {
				gone[p]++
			}
		}
		for _, h := range ev.Hashes {
			p := r.parent[h]
			delete(r.parent, h)
			delete(r.children, h)
			if r.children[p]--; r.children[p] == 0 {
				delete(r.children, p)
			}
		}
	case AllCleared:
		clear(r.parent)
		clear(r.children)
		for m := 1; m < NumMedia; m++ {
			clear(r.tiers[m])
		}
		clear(r.groups)
	default:
		return kverr.Errorf(kverr.InvalidArgument, "replay: unknown event kind %d", ev.Kind)
	}
	return nil
}
