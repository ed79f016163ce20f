package prefix

// Stats are an Index's counters (since New or ResetStats) and gauges.
type Stats struct {
	Queries       int64 // Match calls
	QueryTokens   int64 // prompt tokens given to Match
	HitTokens     int64 // of those, tokens matched in full cached blocks
	PartialTokens int64 // tokens of partial matches, for Match calls that asked
	Inserts       int64 // blocks Insert added
	Dedups        int64 // Insert calls that found the block cached already
	Evictions     int64 // blocks Evict removed
	EventsDropped int64 // events lost to a full queue (see DrainEvents)
	// DroppedPending counts pending blocks DropPending removed (with the
	// blocks cached below them): blocks whose K/V no forward pass computed.
	DroppedPending int64

	// Gauges: the state now; ResetStats leaves them.
	CachedBlocks    int // blocks in the tree
	LockedBlocks    int // blocks with at least one lock
	PinnedBlocks    int // blocks with at least one pin
	EvictableBlocks int // blocks Evict could remove (see Evictable)
	PendingEvents   int // events waiting for DrainEvents
	PendingBlocks   int // blocks inserted since the last Commit, not computed yet
}

// Stats returns the counters and gauges.
func (x *Index) Stats() Stats {
	s := x.counters
	s.EventsDropped = x.events.dropped
	s.CachedBlocks = x.byHash.len()
	s.LockedBlocks = x.nLocked
	s.PinnedBlocks = x.nPinned
	s.EvictableBlocks = x.Evictable()
	s.PendingEvents = x.events.pending(x.byHash.len())
	s.PendingBlocks = x.nPending
	return s
}

// ResetStats zeroes the counters.
func (x *Index) ResetStats() {
	x.counters = Stats{}
	x.events.dropped = 0
}
