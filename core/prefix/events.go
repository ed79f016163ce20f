package prefix

import (
	"fmt"

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

// Event is a change of the set of cached blocks, for a router that keeps
// its own view of which engine caches which prefix. Its fields are those
// of vLLM's KV events; the salt is not among them (it may be a secret), so
// a router learns a first block's salted hash, not the salt.
type Event struct {
	Kind EventKind

	// BlockStored: the block's hash, its parent's (zero for a first
	// block), its tokens (BlockSize of them), and its extra keys: the
	// adapter and the multimodal entries as its hash saw them.
	Hash      Hash
	Parent    Hash
	Tokens    []int32
	BlockSize int
	Adapter   uint64
	MM        []BlockMM

	// BlockRemoved: the removed blocks' hashes, children before parents.
	Hashes []Hash
}

// pendingEvent is an undrained event; its slices live in the queue's
// arenas, at offsets that DrainEvents turns into caller-owned copies.
type pendingEvent struct {
	kind    EventKind
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
		return 1 + cached
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

func (e *eventQueue) pushStored(x *Index, i int32) {
	n := &x.nodes[i]
	e.q = append(e.q, pendingEvent{
		kind:    BlockStored,
		hash:    n.hash,
		parent:  x.nodes[n.parent].hash,
		adapter: n.adapter,
		nTok:    x.bs,
		nMM:     len(n.mm),
	})
	e.toks = append(e.toks, x.tokensOf(i)...)
	e.mms = append(e.mms, n.mm...)
}

func (e *eventQueue) removed(x *Index, hashes []Hash) {
	if e.admit() {
		e.q = append(e.q, pendingEvent{kind: BlockRemoved, nHash: len(hashes)})
		e.hashes = append(e.hashes, hashes...)
	}
}

// cleared records AllCleared. The events before it no longer matter to a
// consumer, which ends up empty either way, so they are discarded (not
// counted as dropped), and a pending resync is no longer needed.
func (e *eventQueue) cleared(x *Index) {
	if !e.on {
		return
	}
	e.reset()
	e.resync = false
	e.q = append(e.q, pendingEvent{kind: AllCleared})
}

// snapshot replaces a lost stretch of events: AllCleared, then one
// BlockStored per cached block, parents before children.
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
}

// DrainEvents removes up to max of the oldest pending events (all of them
// when max <= 0) and returns them in order, in memory the caller owns; nil
// when events are off or none is pending.
//
// The queue holds at most Config.MaxPendingEvents events (raised to
// NumBlocks+1). When an event would exceed that, every pending event is
// discarded, counted in Stats.EventsDropped with every event after it, and
// recording stops; the next DrainEvents then starts with AllCleared
// followed by a BlockStored for every block cached at that moment (parents
// first), after which recording resumes. A consumer that applies the
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
		ev.Kind = p.kind
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
// alone: the set of cached block hashes and their parents. It checks the
// stream as it goes (a block is stored once, under a present parent, and
// removed only as a leaf), so it doubles as the events' test oracle.
type EventIndex struct {
	parent   map[Hash]Hash
	children map[Hash]int
}

// NewEventIndex returns an empty EventIndex.
func NewEventIndex() *EventIndex {
	return &EventIndex{parent: make(map[Hash]Hash), children: make(map[Hash]int)}
}

// Len returns the number of blocks the events say are cached.
func (r *EventIndex) Len() int { return len(r.parent) }

// Contains reports whether the events say block h is cached.
func (r *EventIndex) Contains(h Hash) bool {
	_, ok := r.parent[h]
	return ok
}

// Hashes appends the hashes of the blocks the events say are cached to dst,
// in no particular order.
func (r *EventIndex) Hashes(dst []Hash) []Hash {
	for h := range r.parent {
		dst = append(dst, h)
	}
	return dst
}

// Apply applies one event. An event inconsistent with the stream so far
// (a block stored twice or under an unknown parent, an unknown block
// removed, a block removed before its children) is an error and changes
// nothing.
func (r *EventIndex) Apply(ev Event) error {
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
	default:
		return kverr.Errorf(kverr.InvalidArgument, "replay: unknown event kind %d", ev.Kind)
	}
	return nil
}
