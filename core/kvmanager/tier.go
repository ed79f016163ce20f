package kvmanager

import (
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// The host tier (and the shared tier below it) is core/kvtier's Tier:
// its pool, memory, shared-store client and policy. The manager owns one
// (Config.HostTier), calls it under its lock from its own calls (the
// allocations, admission, MarkComputed, the invariants) and forwards the
// tier's calls below to it; core/kvtier's package comment says how they
// fit together and the rules the engine follows.

// The tier's types, under the names the manager's API has always used.
type (
	HostTier    = kvtier.Config
	TierCopier  = kvtier.Copier
	TierStats   = kvtier.Stats
	DemoteOp    = kvtier.DemoteOp
	ReloadOp    = kvtier.ReloadOp
	CopyBatch   = kvtier.CopyBatch
	SharedTier  = kvtier.SharedConfig
	SharedStats = kvtier.SharedStats
)

// DefaultPutQueue is the store queue's size of a SharedTier that leaves
// PutQueue 0.
const DefaultPutQueue = kvtier.DefaultPutQueue

// HostKey is the host tier's key of a block: the first eight bytes of its
// chained hash, big-endian.
func HostKey(h prefix.Hash) uint64 { return kvtier.HostKey(h) }

// TierMatch is what MatchTiers found for one prompt: its first GPU
// tokens are in the GPU prefix cache, the next Host tokens in the host
// tier (whole blocks; GPU+Host never covers the prompt's last token).
type TierMatch struct {
	GPU  int32
	Host int32
}

// tierLock is the manager's lock as the tier takes it (kvtier.GPU.Lock):
// released with the end-of-call check, as every call that may change the
// manager is (assert.go).
type tierLock struct{ m *Manager }

func (l tierLock) Lock()   { l.m.mu.Lock() }
func (l tierLock) Unlock() { l.m.unlock() }

// noTier is the error of the tier's calls on a manager without one.
func noTier(op string) error {
	return kverr.Errorf(kverr.InvalidArgument, "%s: no host tier configured", op)
}

// FlushCopies demotes least recently used cached blocks until the free
// blocks plus those being demoted reach HostTier.DemoteAhead (fewer when
// fewer are evictable), and hands their copies, with the reloads queued
// by admissions since the last flush and the write-through stores, to the
// copier as one batch (kvtier.Tier.FlushCopies). The engine calls it once
// per step, after the step's admissions and before its forward pass. It
// returns the batch's ticket, for CompleteCopies, and its number of
// copies; ticket 0 and n 0 when there was nothing to copy. Errors:
// InvalidArgument (no host tier, or no copier), and the copier's error,
// after which the batch's blocks are free and not demoted.
func (m *Manager) FlushCopies() (ticket uint64, n int, err error) {
	m.mu.Lock()
	defer m.unlock()
	if m.tier == nil {
		return 0, 0, noTier("flush copies")
	}
	return m.tier.FlushCopies()
}

// FlushCopiesTo is FlushCopies for an engine that performs the copies
// itself (HostTier.Copier nil, as through the C ABI): the batch goes into
// demote and reload (kvtier.Tier.FlushCopiesTo has the sizes they need).
// Errors: InvalidArgument (no host tier), BufferTooSmall.
func (m *Manager) FlushCopiesTo(demote []DemoteOp, reload []ReloadOp) (ticket uint64, nDemote, nReload, needDemote, needReload int, err error) {
	m.mu.Lock()
	defer m.unlock()
	if m.tier == nil {
		return 0, 0, 0, 0, 0, noTier("flush copies")
	}
	return m.tier.FlushCopiesTo(demote, reload)
}

// FlushCopiesWithin is FlushCopiesTo with the room counted rather than
// given (kvtier.Tier.FlushCopiesWithin): the batch comes back in slices of
// its own. Errors: as FlushCopiesTo.
func (m *Manager) FlushCopiesWithin(maxDemote, maxReload int) (ticket uint64, demote []DemoteOp, reload []ReloadOp, needDemote, needReload int, err error) {
	m.mu.Lock()
	defer m.unlock()
	if m.tier == nil {
		return 0, nil, nil, 0, 0, noTier("flush copies")
	}
	return m.tier.FlushCopiesWithin(maxDemote, maxReload)
}

// CompleteCopies reports that batch ticket's copies have finished (failed
// false) or failed (kvtier.Tier.CompleteCopies). Errors: InvalidArgument
// (no host tier), NotFound (ticket unknown or completed already), with
// nothing changed.
func (m *Manager) CompleteCopies(ticket uint64, failed bool) error {
	m.mu.Lock()
	defer m.unlock()
	if m.tier == nil {
		return noTier("complete copies")
	}
	return m.tier.CompleteCopies(ticket, failed)
}

// MatchTiers is Match per tier: for each prompt, the tokens of its
// longest prefix in the GPU prefix cache (as Match, touching those
// blocks) and, beyond them, of the blocks the host tier holds under the
// prompt's next chained hashes (host.Pool.Lookup: touched in the host
// LRU, not pinned). Neither match covers the prompt's last token. Without
// a host tier Host is 0; without the prefix cache both are.
//
// With a shared tier, the blocks it holds past each prompt's GPU and host
// matches are first fetched into the host tier (kvtier.Tier.Fetch,
// bounded by two operation timeouts), and Host counts them: a
// scheduler's MatchTiers ahead of Admit prefetches them.
// Errors: InvalidArgument (batch, a prompt's length in [0, MaxPromptLen],
// keys, out shorter than the batch).
func (m *Manager) MatchTiers(prompts Prompts, out []TierMatch) error {
	if err := prompts.validate("match tiers", 0); err != nil {
		return err
	}
	n := prompts.Len()
	if len(out) < n {
		return kverr.Errorf(kverr.InvalidArgument, "match tiers: out holds %d entries for %d prompts", len(out), n)
	}
	var fetched kvtier.Fetched
	if m.tier != nil {
		fetched, _ = m.tier.Fetch(&prompts, nil) // no check: no error
	}
	m.mu.Lock()
	defer m.unlock()
	for i := range n {
		out[i] = TierMatch{}
		if m.cache == nil {
			continue
		}
		tokens, keys, res := m.matchPrompt(&prompts, i, false, "match tiers: the index refused a validated prompt")
		out[i].GPU = int32(res.Tokens)
		switch {
		case m.tier != nil && m.gc != nil:
			// As admission: the host tier extends only group 0's whole
			// cached prefix (grouptier.go).
			out[i].Host = int32(m.tier.MatchHostGroups(tokens, keys, res.Tokens, m.lastPeek == len(res.Blocks), m.gpuHas(res.Blocks)))
		case m.tier != nil:
			out[i].Host = int32(m.tier.MatchHost(tokens, keys, res.Tokens, fetched))
		}
	}
	return nil
}

// TierStats returns the host tier's counters; zero when there is none.
func (m *Manager) TierStats() TierStats {
	m.mu.Lock()
	defer m.unlock() // read-only, but not in unlock_test.go's list of such calls
	if m.tier == nil {
		return TierStats{}
	}
	return m.tier.Stats()
}

// Close ends the manager's background work: the shared tier's queued
// stores are written (each round trip bounded by SharedTier.OpTimeout; a
// server that is down skips them at once) and its connection is closed
// (kvtier.Tier.Close). The manager stays usable, without the shared tier:
// nothing is fetched or stored after Close; but a manager whose tier made
// its host pool (HostTier.Slots, as the C ABI's do) has that pool closed
// and its memory released, and must not be used again. A Go program that
// creates a manager with a shared tier must Close it, or its store
// goroutine lives on; the C ABI's kvp_manager_destroy does. Closing
// twice, or a manager without a host tier, does nothing.
func (m *Manager) Close() error {
	if m.tier == nil {
		return nil
	}
	return m.tier.Close()
}

// HostTierPool returns the host tier's pool (its memory: Memory, Stats);
// nil without a host tier.
func (m *Manager) HostTierPool() *host.Pool {
	if m.tier == nil {
		return nil
	}
	return m.tier.Pool()
}

// fetchShared is the shared tier's part of Admit (kvtier.Tier.Fetch),
// before it takes the lock: it fails as Admit would when an id of ids is
// live or repeated.
func (m *Manager) fetchShared(prompts *Prompts, ids []int64) (kvtier.Fetched, error) {
	if m.tier == nil {
		return nil, nil
	}
	return m.tier.Fetch(prompts, func() error { return m.checkNewIDs("admit", "sequence", ids) })
}

// The tier's parts of the manager's own calls, under its lock; each does
// nothing without a host tier.

// allocate allocates blocks the caller made free (hint as pool.Allocate)
// and records them with the tier as just allocated (kvtier.Tier.Allocated):
// one call does both so that no allocation misses the stamp. what names
// the caller's step for the panic when the blocks were not free.
func (m *Manager) allocate(blocks []int32, hint int32, what string) {
	assertOK(m.pool.Allocate(blocks, hint), what)
	if m.tier != nil {
		m.tier.Allocated(blocks)
	}
}

// noteFilled records a block the prefix cache just inserted, for the
// write-through store once computed.
func (m *Manager) noteFilled(b int32) {
	if m.tier != nil {
		m.tier.NoteFilled(b)
	}
}

// queueComputed queues, at MarkComputed, the write-through stores of the
// blocks this mark makes computed.
func (m *Manager) queueComputed() {
	if m.tier != nil {
		m.tier.QueueComputed()
	}
}

// checkTier is the host tier's part of the invariants (kvtier.Tier.Check).
func (m *Manager) checkTier(refs []int32, bad func(string, ...any) error) error {
	if m.tier == nil {
		return nil
	}
	return m.tier.Check(refs, bad)
}
