package kvtier

import (
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// Write-through: the host tier copies blocks, it does not move them.
//
// Demotion (tier.go) takes a block out of the GPU prefix cache to put it
// in the host tier: ahead of need (DemoteAhead) it evicts blocks the GPU
// cache would still have served, so a request that would have hit on the
// GPU reloads from the host instead, or misses. With Config.WriteThrough
// the host tier gets a copy of each block once its K/V exists, and the
// block stays in the GPU cache:
//
//   - a block filled by Admit or GrowTokens is noted; MarkComputed (its
//     step's forward pass has run) queues it, oldest first. A block taken
//     out of the cache before that (an uncomputed block, core/kvmanager computed.go) is
//     never queued, and its K/V never reaches a tier.
//   - each FlushCopies hands out up to WriteThrough queued blocks as
//     copies GPU block -> host slot, in the batch's Demote list after the
//     demotions (CopyBatch: the engine copies them all alike). Until the
//     batch completes, the copy holds a reference and a lock on the GPU
//     block, so it is neither evicted nor reused while the copy reads it;
//     the lock is released without counting as an access (prefix.Index.
//     Release), so the GPU cache's eviction order is what it would be
//     without the tier. An engine that completes each batch before its
//     next step's allocations (as it must for reloads) therefore sees the
//     GPU cache behave as with no tier: no GPU hit is lost. One exception:
//     a prompt admitted on a host hit and removed before its forward pass
//     (a preemption) leaves its reloaded blocks cached, their K/V valid,
//     where without the tier its blocks were uncomputed and dropped; they
//     are recent, so a later allocation may evict an older block that
//     the plain cache would still hold (and that the host tier then
//     serves).
//   - completion commits the host slot (and queues the block for the
//     shared tier, when there is one), as a demotion's does, and announces
//     it (CPU BlockStored); the GPU block stays cached, and a later GPU
//     eviction of it costs nothing.
//   - a queued block that the GPU evicts before its turn is counted lost
//     (Stats.WriteThroughLost): WriteThrough bounds the copies a step,
//     and a backlog longer than the pool is cut from its oldest end.
//
// # Waiting while the pool has room
//
// On a workload whose working set fits in the GPU pool no cached block is
// ever evicted, and every store is wasted copy bandwidth. With
// Config.WriteThroughSlack, FlushCopies hands out no store while the GPU
// pool's free queue (blocks.Pool.NumFree: the blocks no cached block
// occupies) holds more than the slack blocks; the computed blocks stay
// queued, oldest first, and once the free blocks fall to the slack or
// below each flush stores up to WriteThrough of them, as without it.
// Why no queued block is lost while the stores wait: a cached block
// leaves the GPU cache only when an allocation (Add, Admit, Grow, Fork)
// finds the free queue short (demotion ahead of need, DemoteAhead, aside:
// it copies the blocks it evicts), so while the free queue holds more
// blocks than the steps before the next flushes allocate, every queued
// block is still cached when its turn comes. That is the caller's
// obligation: a slack of at least the allocations of the few steps the
// queue needs to drain (its length over WriteThrough); with less, the
// first evictions may take queued blocks before their store, counted in
// Stats.WriteThroughLost (and those blocks miss later, as with no tier).
// The GPU prefix cache's hits do not depend on the slack: stores never
// evict.
type writeThrough struct {
	filled []int32   // blocks inserted since the last MarkComputed (some may since have gone)
	queue  []wtEntry // computed blocks waiting for their store, oldest first
	queued []bool    // by block id: an entry of queue names it
}

// wtEntry is a queued block: its id and the hash it was computed under
// (the id may since hold another block).
type wtEntry struct {
	block int32
	hash  prefix.Hash
}

// NoteFilled records a block the prefix cache just inserted for a
// sequence, to be queued for its store once computed.
func (t *Tier) NoteFilled(b int32) {
	if t.cfg.WriteThrough == 0 {
		return
	}
	t.wt.filled = append(t.wt.filled, b)
	if len(t.wt.filled) > 2*t.gpu.NumBlocks() {
		// No MarkComputed for a long time: keep only the blocks still
		// uncomputed in the cache, so the list stays bounded by the pool.
		t.wt.filled = slices.DeleteFunc(t.wt.filled, func(b int32) bool { return !t.cache.IsPending(b) })
	}
}

// QueueComputed queues, at MarkComputed (before the prefix cache's
// Commit), the noted blocks that are still cached and uncomputed: the
// ones this mark makes computed.
func (t *Tier) QueueComputed() {
	if t.cfg.WriteThrough == 0 {
		return
	}
	for _, b := range t.wt.filled {
		if !t.cache.IsPending(b) {
			continue // dropped uncomputed, or noted twice
		}
		if t.wt.queued[b] {
			// An older entry names this id, whose block the GPU evicted
			// and reused: that entry stores this block in its turn.
			continue
		}
		h, _ := t.cache.BlockHash(b)
		t.wt.queued[b] = true
		t.wt.queue = append(t.wt.queue, wtEntry{b, h})
	}
	t.wt.filled = t.wt.filled[:0]
	if over := len(t.wt.queue) - t.gpu.NumBlocks(); over > 0 {
		for _, e := range t.wt.queue[:over] {
			t.wt.queued[e.block] = false
		}
		t.wt.queue = append(t.wt.queue[:0], t.wt.queue[over:]...)
		t.st.WriteThroughLost += int64(over)
	}
}

// writeThroughOps appends to ops the stores of up to WriteThrough queued
// blocks: each still cached and computed gets a host slot under its hash
// and a reference and a lock for its copy. op names the call for panics.
// While the GPU pool's free queue holds more than WriteThroughSlack
// blocks it stores nothing ("Waiting while the pool has room").
func (t *Tier) writeThroughOps(ops []DemoteOp, op string) []DemoteOp {
	if t.cfg.WriteThrough == 0 || len(t.wt.queue) == 0 {
		return ops
	}
	if s := t.cfg.WriteThroughSlack; s > 0 && t.gpu.NumFree() > s {
		return ops
	}
	t.gone = t.gone[:0]
	taken, k := 0, 0
	for ; k < len(t.wt.queue) && taken < t.cfg.WriteThrough; k++ {
		b := t.wt.queue[k].block
		t.wt.queued[b] = false
		if t.cache.IsPending(b) {
			t.st.WriteThroughLost++ // evicted first, and the id filled again: queued anew once computed
			continue
		}
		ev, toks, ok := t.cache.Describe(b, t.evToks[:0])
		t.evToks = toks
		if !ok {
			t.evictedQueued(t.wt.queue[k].hash) // the GPU evicted it first
			continue
		}
		if ev.Hash != t.wt.queue[k].hash {
			// Evicted first; the id's block now is another computed one,
			// which this entry stores instead (QueueComputed left it out).
			t.evictedQueued(t.wt.queue[k].hash)
		}
		slot, gone, err := t.cfg.Pool.ReserveEvict(HostKey(ev.Hash))
		if err != nil {
			if kverr.Is(err, kverr.OutOfBlocks) {
				t.st.SkippedFull++
			} else {
				t.st.SkippedPresent++
			}
			continue
		}
		t.one[0] = b
		// A cached block: its references equal its locks, bounded below
		// 2^31-1 by the sequences that hold it.
		assertOK(t.gpu.Incref(t.one[:]), op+": referencing a block to store")
		assertOK(t.cache.Lock(t.one[:]), op+": locking a block to store")
		ops = append(ops, DemoteOp{Block: b, Slot: slot, Hash: ev.Hash})
		if t.events {
			t.hostEvicted(slot, gone, op)
			ev.MM = slices.Clone(ev.MM) // the index's; the slot keeps its own
			t.setMeta(slot, &ev, toks, 0)
		}
		taken++
	}
	t.wt.queue = append(t.wt.queue[:0], t.wt.queue[k:]...)
	if len(t.gone) > 0 {
		assertOK(t.cache.RecordTierRemoved(prefix.MediumCPU, t.gone), op+": recording host evictions")
	}
	return ops
}

// evictedQueued counts a queued block the GPU evicted before its store:
// lost, unless the host tier holds it (or its demotion is in flight: an
// eviction that demoted it, DemoteEvicted or DemoteAhead).
func (t *Tier) evictedQueued(hash prefix.Hash) {
	if _, st := t.cfg.Pool.State(HostKey(hash)); st == host.Absent {
		t.st.WriteThroughLost++
	}
}

// endStore ends one write-through store: its host slot is committed (ok)
// or aborted as a demotion's (a failed store counts lost), and the copy's
// reference and lock on the GPU block, which stays cached, are released
// without an access.
func (t *Tier) endStore(op DemoteOp, ok bool) {
	if t.endHostCopy(op, ok) {
		t.st.WriteThroughStored++
	} else if !ok {
		t.st.WriteThroughLost++
	}
	t.one[0] = op.Block
	// The copy's lock kept the block in the cache: not evictable. But a
	// removal drops an uncomputed block with every block cached below it,
	// locks and all (a reloaded block, computed, below a block its step
	// was to compute): the block is then private, held by this copy's
	// reference alone, and its K/V, copied whole, is still its hash's.
	if t.gpu.IsCached(op.Block) {
		assertOK(t.cache.Release(t.one[:]), "complete copies: releasing a stored block")
	}
	var err error
	t.cached, err = t.gpu.Decref(t.one[:], t.cached[:0])
	assertOK(err, "complete copies: a stored block is not referenced")
}
