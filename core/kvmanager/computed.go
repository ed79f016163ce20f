package kvmanager

import (
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

// Computed K/V: the contract between the prefix cache and the engine.
//
// A block the prefix cache holds is shared with later prompts, demoted to
// the host tier and stored in the shared tier: each of them reads its K/V
// as if it existed. A block enters the cache when the call that fills it
// (Admit, GrowTokens) returns, before the engine's forward pass computes
// its K/V, so that a prompt admitted later in the same step can share it.
// Between that call and the forward pass, the engine may drop the
// sequence (preempted to make room, aborted by its client, a step
// abandoned). The manager therefore keeps, from the fill to the engine's
// word, the blocks a step filled apart as uncomputed:
//
//   - MarkComputed is the engine's word: the forward pass of every new
//     token described so far has run (or is enqueued on the stream that
//     every later reader of the cache follows). The engine calls it once
//     per step, after launching the step's forward pass and before it
//     removes the step's finished sequences. It costs O(1).
//   - Remove drops from the cache the blocks its sequences filled since
//     the last MarkComputed, and with them every block cached below them
//     (prefix.Index.DropPending); they return to the free queue, so no
//     later prompt matches them and no tier demotes or stores them.
//   - A live sequence that shares such a block (admitted after the filler
//     in the same step and matched it, or forked from it) would be left
//     with K/V nobody computes, so Remove refuses with InUse, naming it.
//     Removing both in one batch, or removing the filler after
//     MarkComputed, succeeds. A scheduler that preempts the most recently
//     admitted sequence first never meets the refusal.
//   - Blocks reloaded from the host tier are computed at admission: the
//     reload copy, which the engine orders before every reader, writes
//     them whatever becomes of their sequence.
//   - Pin covers computed blocks only; demotion and the shared tier see
//     only computed blocks, since an uncomputed block is held by its
//     filler until it is computed or dropped.
//
// An engine that never calls MarkComputed keeps correct results and loses
// every cached block when its sequence ends; the first such loss is
// logged at warning level.

// MarkComputed records that the K/V of every new token described so far
// has been computed: the blocks filled so far become computed, so that
// removing their sequences keeps them cached. Without the prefix cache it
// does nothing. O(1).
func (m *Manager) MarkComputed() {
	m.mu.Lock()
	defer m.unlock()
	m.committed = true
	if m.cache != nil {
		m.queueComputed() // the host tier's write-through: before the blocks stop reading as uncomputed
		m.cache.Commit()
		m.takeCheckpoints()
	}
}

// uncomputedOf returns the cached uncomputed blocks the sequences of a
// remove batch filled, in m.uncomp's key order, or InUse when a live
// sequence outside the batch shares one. Nothing changes. Most removals
// find nothing uncomputed in the cache and return at once.
func (m *Manager) uncomputedOf(ids []int64, batch []*seq) ([]int32, error) {
	if m.cache == nil || m.cache.Pending() == 0 {
		return nil, nil
	}
	var own []int32
	for _, s := range batch {
		for _, b := range s.blocks[s.own:] {
			if m.cache.IsPending(b) {
				own = append(own, b)
			}
		}
	}
	if len(own) == 0 {
		return nil, nil
	}
	// Each uncomputed block's references must all come from the batch
	// (a cached block's references are sequences': reloads and demotions
	// hold computed or uncached blocks).
	if m.uncomp == nil {
		m.uncomp = make(map[int32]int32)
	}
	clear(m.uncomp)
	for _, b := range own {
		m.uncomp[b] = 0
	}
	for _, s := range batch {
		for _, b := range s.blocks {
			if n, ok := m.uncomp[b]; ok {
				m.uncomp[b] = n + 1
			}
		}
	}
	for _, b := range own {
		if held := m.uncomp[b]; m.pool.Ref(b) > held {
			return nil, m.inUse(ids, batch, b)
		}
	}
	return own, nil
}

// inUse builds the InUse error for block b, which a sequence outside the
// remove batch shares.
func (m *Manager) inUse(ids []int64, batch []*seq, b int32) error {
	filler, other := int64(-1), int64(-1)
	for i, s := range batch {
		if slices.Contains(s.blocks[s.own:], b) {
			filler = ids[i]
		}
	}
	for id, s := range m.seqs.all() {
		if !slices.Contains(batch, s) && slices.Contains(s.blocks, b) {
			other = id
			break
		}
	}
	return kverr.Errorf(kverr.InUse,
		"remove: sequence %d filled block %d in this step, and sequence %d, which is not removed, shares it; "+
			"no forward pass has computed its K/V (mark_computed not called since), so it would be left without it: "+
			"remove %d in the same batch, or remove %d after the step's forward pass and mark_computed",
		filler, b, other, other, filler)
}

// dropUncomputed drops the removed sequences' uncomputed blocks, and the
// blocks cached below them, from the prefix cache: those no sequence holds
// any more return to the free queue, the others stay their holders'
// private blocks.
func (m *Manager) dropUncomputed(blocks []int32) {
	var err error
	m.dropped, err = m.cache.DropPending(blocks, m.dropped[:0])
	assertOK(err, "remove: dropping uncomputed blocks")
	for _, d := range m.dropped {
		assertOK(m.pool.UnmarkCached(d.Block), "remove: a dropped block is free")
	}
	if m.gc != nil { // the dropped nodes' companions go with them
		m.evicted = m.evicted[:0]
		for _, d := range m.dropped {
			m.evicted = append(m.evicted, d.Block)
		}
		m.nodesGone(m.evicted, m.cache.LastRemoved())
	}
	if !m.committed && !m.warned && len(m.dropped) > 0 {
		m.warned = true
		logx.L().Warn("prefix cache: a removed sequence's blocks were dropped as uncomputed, and mark_computed has never been called: "+
			"call it once per step after the forward pass, or the cache keeps nothing of finished sequences",
			zap.Int("blocks", len(m.dropped)))
	}
}
