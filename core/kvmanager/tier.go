package kvmanager

import (
	"encoding/binary"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// The host tier in the manager (issue 23; core/kvtier's package comment
// has the ordering rules this follows).
//
// With Config.HostTier set, cached GPU blocks that the manager evicts
// ahead of need are demoted to the host pool instead of dropped: the
// manager Reserves a host slot under the block's hash, queues a copy
// (GPU block -> host slot) and keeps the GPU block out of the free queue
// until the copy has completed; then it Commits the slot and frees the
// block. Match per tier (MatchTiers) reports, beyond the GPU prefix
// cache's match, how many further blocks the host tier holds, and
// admission (Admit) uses them: a prompt's blocks that follow its GPU
// match and that the host tier holds are pinned there, get GPU blocks
// and count as matched (not computed); their reloads (host slot -> GPU
// block) go into the next copy batch.
//
// # Reloaded blocks
//
// A reloaded block is inserted into the GPU prefix cache at admission,
// as the blocks the step computes are (prefix.go: a block is cached when
// the call that fills it returns, before its K/V exists): its K/V
// arrives before the step's attention, since the engine orders the
// batch's reloads before it (core/kvtier, rule 3), so a later prompt, in
// the same step too, may share it. Until the reload completes, the copy
// holds one reference (and, once cached, one lock) on the GPU block, so
// that a sequence removed first leaves the block neither free nor
// evictable while the copy may still write it; and the host slot stays
// pinned, so the bytes under the copy cannot change. A failed reload
// (CompleteCopies with failed, or a refused batch) unpins and releases
// the same way, but the blocks stay cached without valid K/V: the
// engine must treat it as fatal for the prefix cache (remove the
// sequences, ClearPrefixCache).
//
// # When blocks are demoted
//
// An allocation that finds the free queue short (Add, Admit, Grow, Fork)
// needs the evicted blocks now, and a block whose copy is still in flight
// cannot serve it. So those evictions drop the blocks at once, without
// demotion, as without a tier (counted in TierStats.EvictedUndemoted).
// Demotion happens ahead of need instead, in FlushCopies, which the
// engine calls once per step: it evicts the least recently used cached
// blocks (the prefix cache's own order) until the free blocks plus those
// being demoted reach HostTier.DemoteAhead, queues their copies and hands
// the step's copies to the TierCopier as one batch. Their blocks return
// to the free queue when the engine reports the batch complete
// (CompleteCopies), normally before the next step's allocations, which
// then find free blocks and evict nothing. A block being demoted is
// neither free nor evictable: until its copy completes, allocations see
// that many fewer available blocks, and one that cannot be served fails
// with OutOfBlocks, changing nothing, as when the pool is exhausted.
// DemoteAhead bounds how many blocks that can be; 0 demotes nothing.
//
// FlushCopies never demotes a block allocated since the previous
// FlushCopies: a block is cached when the call that fills it returns, but
// its K/V exists only once the step's forward pass (which follows the
// step's flush) has written it, so a block whose sequence was removed
// before then holds nothing worth copying. Such a block is evicted (to
// the free queue) without demotion. The engine's step is one FlushCopies
// then the forward pass; a block allocated before a flush is written by
// the time of the next.
//
// # Demoting the blocks allocations evict (DemoteEvicted)
//
// The copy engine's stream order makes the blocks an allocation evicts
// demotable too, and HostTier.DemoteEvicted opts in: such a block goes to
// its new owner at once, and its demotion (a host slot reserved under its
// hash, a DemoteOp holding no reference on the GPU block) waits for the
// next FlushCopies, which hands it out ahead of the batch's other copies.
// Its K/V is intact until the step writes the new owner's: the forward
// pass (kv_write, attention), the Fork copy-on-write copies, a reload
// into the block. So the mode rests on one ordering rule, the engine's:
//
//   - FlushCopies follows the step's last allocation (Add, Admit, Grow,
//     Fork), and the batch's demotions are enqueued on the step's stream
//     before anything that writes K/V in that step (not on a side stream,
//     nor overlapped with the step): the demotions of a batch before its
//     reloads (tiercopy.Copier.Run launches them first), the batch before
//     the step's block copies and forward pass.
//
// An allocation after the step's FlushCopies would leave its evicted
// blocks' demotions for the next step's batch, after the forward pass had
// overwritten them: an engine that allocates then must not enable the
// mode (or calls FlushCopies again before the forward pass). A block
// allocated since the last FlushCopies holds no K/V yet (the step writes
// it), even when cached, so evicting it again before the next flush drops
// it (EvictedUndemoted; FlushCopies' own demotions skip such blocks in
// both modes, above); so does a host pool with every slot pinned. A
// block the host tier holds already is SkippedPresent. Completion commits
// the host slot as any demotion's (Abort on failure) and frees nothing on
// the GPU. FlushCopies still demotes ahead (DemoteAhead), in the same
// batch after the allocations' demotions.
//
// # Keys
//
// A host slot holds a block under a 64-bit key: the first eight bytes of
// the block's 128-bit chained hash (HostKey). The shared tier, which many
// instances fill over a long time, keys and checks blocks by the whole
// 128-bit hash (shared.go).
//
// # KV events
//
// With KV events on (Config.EnableKVEvents), the host tier's blocks have
// their own events, of medium CPU (prefix.MediumCPU; "CPU" on the wire,
// as vLLM's OffloadingConnector sends), in the one stream with the GPU
// prefix cache's (medium GPU), under the same bound and resync rules
// (package prefix, Index.DrainEvents):
//
//   - a demotion announces its block when CompleteCopies commits it
//     (BlockStored, CPU), never while its copy is in flight or when it
//     fails; its GPU BlockRemoved came when FlushCopies evicted it;
//   - a host slot that Reserve takes from a resident block (the host
//     LRU's eviction) announces that block's removal (BlockRemoved, CPU),
//     in FlushCopies, one event for the flush's evictions;
//   - a block fetched from the shared tier (shared.go) is announced when
//     its host slot commits (BlockStored, CPU, described from the prompt
//     that wanted it), and a slot its reservation takes from a resident
//     block announces that block's removal (BlockRemoved, CPU), in the
//     fetch, before the call's own work;
//   - a reload does not change the host tier (the block stays resident
//     there); its GPU BlockStored comes from the admission, as for any
//     block the prefix cache caches;
//   - a snapshot (RequestEventSnapshot, a full queue) lists the host
//     tier's resident blocks after the GPU's, and so does
//     ClearPrefixCache after its AllCleared, which a consumer applies to
//     every medium while the host tier keeps its blocks.
//
// A CPU BlockStored carries what the block's GPU BlockStored did: its
// chained hash (the same one: a consumer ties the tiers together by it),
// its parent's hash (the previous block of its chain, wherever that is
// held), its tokens, adapter and multimodal entries. vLLM's own CPU
// events leave the parent, tokens and adapter out (None, [], None);
// consumers written for them read these unchanged. To announce them, the
// manager keeps each host slot's block description (about 40 bytes and
// the block's tokens per slot) while events are on.
//
// # Model reloads
//
// ClearPrefixCache does not touch the host tier (its blocks would be the
// old model's K/V, and demotions in flight still commit): a model or
// adapter reload needs a new manager and host pool.
//
// # Ordering and threads
//
// FlushCopies calls TierCopier.Copy with the manager's lock held: Copy
// must only enqueue the batch (a copy kernel or cudaMemcpyBatchAsync on
// the engine's stream, then an event) and return; it must not call the
// Manager. The engine reports completion with CompleteCopies(ticket),
// from any goroutine, once the batch's copies have finished (its event
// has completed), or with failed set when they did not. Until then the
// batch's GPU blocks stay allocated to the copy and its host slots stay
// reserved (invisible to host matches), so the bytes under a copy never
// change and a half-written slot is never matched.

// HostTier configures a manager's host tier.
type HostTier struct {
	// Pool holds the demoted blocks. The manager is its only writer
	// (Reserve, Commit, Abort); one pool per manager.
	Pool *host.Pool
	// Copier performs the copies between GPU blocks and host slots. Nil:
	// the engine drives the copies itself through FlushCopiesTo (as the C
	// ABI does), and FlushCopies fails.
	Copier TierCopier
	// DemoteAhead is the number of blocks FlushCopies keeps free or being
	// demoted, by demoting least recently used cached blocks; in [0,
	// NumBlocks]. 0 disables demotion ahead of need.
	DemoteAhead int
	// DemoteEvicted demotes the cached blocks that allocations evict
	// (Add, Admit, Grow, Fork finding the free queue short), in the next
	// FlushCopies' batch, while their GPU blocks go to their new owners
	// at once. Only for an engine that calls FlushCopies after a step's
	// last allocation and enqueues the batch's demotions on the step's
	// stream before anything that writes K/V in the step (see "Demoting
	// the blocks allocations evict" above); otherwise the host tier would
	// hold the new owners' K/V under the old blocks' hashes.
	DemoteEvicted bool
	// WriteThrough stores computed blocks to the host tier while they stay
	// in the GPU prefix cache (writethrough.go): each FlushCopies copies
	// up to this many of the blocks computed since (oldest first), so a
	// GPU eviction later costs nothing and no GPU hit is traded for a host
	// one. In [0, NumBlocks]; 0 stores nothing this way.
	WriteThrough int
	// Shared, when not nil, adds the shared tier (a Valkey or Redis
	// server) below the host tier (shared.go). The manager must then be
	// closed (Close).
	Shared *SharedTier
}

// DemoteOp is one block's demotion: copy GPU block Block (all layers, K
// and V) into host slot Slot (Pool.Bytes(Slot)).
type DemoteOp struct {
	Block int32
	Slot  host.Slot
	Hash  prefix.Hash // the block's chained hash (its host key is HostKey(Hash))
}

// ReloadOp is one block's reload: copy host slot Slot into GPU block
// Block (all layers, K and V), before the step's attention reads it.
type ReloadOp struct {
	Slot  host.Slot
	Block int32
}

// CopyBatch is one step's copies, handed to TierCopier.Copy. Its slices
// are the manager's and valid only during the call.
type CopyBatch struct {
	// Ticket names the batch in CompleteCopies; never 0.
	Ticket uint64
	// Demote lists the GPU-to-host copies, in eviction order: those of
	// the blocks allocations evicted since the last flush first
	// (HostTier.DemoteEvicted), then FlushCopies' own. The engine must
	// copy them before the batch's reloads (which may write the same GPU
	// blocks, allocated anew) and, with DemoteEvicted, before anything
	// else that writes K/V in the step.
	Demote []DemoteOp
	// Reload lists the host-to-GPU copies of the step's host hits, in
	// admission order and each prompt's block order. The engine must
	// order them before the step's attention (a copy on the step's
	// stream, or an event the stream waits on).
	Reload []ReloadOp
}

// TierCopier performs a manager's tier copies (see the comment above
// HostTier for when and under which lock it is called).
type TierCopier interface {
	// Copy starts the batch's copies and returns. An error means nothing
	// of the batch was started: the manager drops the blocks without
	// demotion (aborting their host slots) and FlushCopies returns it.
	Copy(b CopyBatch) error
}

// TierStats are the host tier's counters in the manager, and the host
// pool's own.
type TierStats struct {
	DemotionsQueued    int64 // demotion copies handed to the copier
	DemotionsCompleted int64 // committed to the host tier
	DemotionsFailed    int64 // copies reported failed, or a Copy that failed
	SkippedFull        int64 // demotions skipped: every host slot pinned
	SkippedPresent     int64 // demotions skipped: the host tier holds the block already
	EvictedUndemoted   int64 // blocks an allocation evicted and dropped, not demoted (with DemoteEvicted: those it could not demote, present ones aside)
	Reloads            int64 // host-to-GPU block copies queued by admissions
	ReloadsCompleted   int64 // of which reported complete
	ReloadsFailed      int64 // of which reported failed
	HostHitTokens      int64 // tokens admissions matched in the host tier
	InFlight           int   // blocks whose demotion copy has not completed (queued by allocations included)
	MatchQueries       int64 // prompts asked of MatchTiers
	MatchGPUTokens     int64 // tokens MatchTiers found in the GPU prefix cache
	MatchHostTokens    int64 // tokens MatchTiers found in the host tier beyond them
	WriteThroughStored int64 // computed blocks copied to the host tier while staying on the GPU (completed)
	WriteThroughLost   int64 // computed blocks the GPU evicted before their write-through store
	WriteThroughQueue  int   // computed blocks waiting for their write-through store
	Host               host.Stats
	Shared             SharedStats // the shared tier's; zero without one
}

// TierMatch is what MatchTiers found for one prompt: its first GPU
// tokens are in the GPU prefix cache, the next Host tokens in the host
// tier (whole blocks; GPU+Host never covers the prompt's last token).
type TierMatch struct {
	GPU  int32
	Host int32
}

// HostKey is the host tier's key of a block: the first eight bytes of its
// chained hash, big-endian.
func HostKey(h prefix.Hash) uint64 { return binary.BigEndian.Uint64(h[:8]) }

// tier is a manager's host tier state.
type tier struct {
	cfg      HostTier
	inflight map[uint64]inflightBatch // by ticket
	nextTkt  uint64
	nBlocks  int // demotions in inflight that hold their GPU block
	nUnheld  int // demotions in inflight that do not (DemoteEvicted)

	// DemoteEvicted: the demotions of the blocks allocations evicted since
	// the last flush, their host slots reserved, holding no GPU block.
	// In both modes, each block's allocation epoch (stamp[b] == epoch:
	// allocated since the last flush, its K/V not written yet).
	evictOps []DemoteOp
	epoch    uint32
	stamp    []uint32

	// Reloads queued by admissions since the last FlushCopies. Each
	// reload op, queued or in flight, holds one reference on its GPU
	// block (and one lock, when the block is cached), so that the block
	// is not evicted, demoted or reused while the copy may write it, even
	// if its sequence is removed first.
	reloads []ReloadOp

	// KV events (Config.EnableKVEvents): each host slot's block, by slot,
	// grown as slots are first used; toks holds slot s's tokens at
	// [s*bs, (s+1)*bs).
	events    bool
	bs        int
	meta      []hostMeta
	toks      []int32
	nResident int           // slots whose block was announced (meta resident)
	gone      []prefix.Hash // scratch: a flush's host evictions

	// Scratch.
	pending []DemoteOp
	evInfo  []prefix.EvictedBlock
	evToks  []int32
	hashes  []prefix.Hash
	keys    []uint64
	slots   []host.Slot
	hasher  prefix.Hasher

	// The shared tier; nil when there is none.
	shared *sharedTier
	// The host keys of the blocks the current Admit or MatchTiers
	// fetched from the shared tier (set under the lock for the call).
	fetched map[uint64]struct{}

	// Write-through (writethrough.go).
	wt writeThrough

	st TierStats
}

// inflightBatch is a batch handed out and not completed: its first
// unheld demotions (the allocations', DemoteEvicted) hold no GPU block,
// the others one reference each.
type inflightBatch struct {
	CopyBatch
	unheld  int
	through int // the last through demotions are write-through stores (writethrough.go)
}

// hostMeta is what the events say of a host slot's block.
type hostMeta struct {
	hash     prefix.Hash
	parent   prefix.Hash
	adapter  uint64
	mm       []prefix.BlockMM
	resident bool // committed and announced; false while reserved
}

// hostEvicted notes, with KV events on, that a reservation took slot s
// (gone: the resident block it evicted, if any): the evicted block's
// hash joins t.gone, whose BlockRemoved the caller records, and the slot
// is no longer announced. Under the manager's lock, as every change of
// the host pool's slots is.
func (t *tier) hostEvicted(s host.Slot, gone host.Eviction, op string) {
	if !gone.Evicted {
		return
	}
	if int(s) >= len(t.meta) || !t.meta[s].resident || HostKey(t.meta[s].hash) != gone.Hash {
		panic(kverr.Errorf(kverr.Internal, "kvmanager: %s: the host pool evicted block %016x from slot %d, which holds no announced block", op, gone.Hash, s))
	}
	t.gone = append(t.gone, t.meta[s].hash)
	t.meta[s].resident = false
	t.nResident--
}

// setMeta records the block that slot s now holds (reserved).
func (t *tier) setMeta(s host.Slot, b *prefix.EvictedBlock, toks []int32) {
	if n := int(s) + 1; n > len(t.meta) {
		t.meta = append(t.meta, make([]hostMeta, n-len(t.meta))...)
		t.toks = append(t.toks, make([]int32, n*t.bs-len(t.toks))...)
	}
	// b.MM is the caller's (EvictBlocks hands it over).
	t.meta[s] = hostMeta{hash: b.Hash, parent: b.Parent, adapter: b.Adapter, mm: b.MM}
	copy(t.toks[int(s)*t.bs:(int(s)+1)*t.bs], toks)
}

// block returns slot s's block as its BlockStored describes it; its
// slices are the tier's.
func (t *tier) block(s host.Slot) prefix.TierBlock {
	h := &t.meta[s]
	return prefix.TierBlock{
		Medium:  prefix.MediumCPU,
		Hash:    h.hash,
		Parent:  h.parent,
		Adapter: h.adapter,
		Tokens:  t.toks[int(s)*t.bs : (int(s)+1)*t.bs : (int(s)+1)*t.bs],
		MM:      h.mm,
	}
}

// TierLen implements prefix.TierSource: the resident host blocks.
func (t *tier) TierLen() int { return t.nResident }

// AppendTierBlocks implements prefix.TierSource: the resident host
// blocks, in slot order.
func (t *tier) AppendTierBlocks(dst []prefix.TierBlock) []prefix.TierBlock {
	for s := range t.meta {
		if t.meta[s].resident {
			dst = append(dst, t.block(host.Slot(s)))
		}
	}
	return dst
}

func newTier(cfg Config) (*tier, error) {
	h := cfg.HostTier
	if h.Pool == nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: a pool is needed")
	}
	if !cfg.EnablePrefixCache {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: needs the prefix cache (enable_prefix_cache)")
	}
	if h.DemoteAhead < 0 || h.DemoteAhead > cfg.NumBlocks {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: demote_ahead must be in [0, %d]: got %d", cfg.NumBlocks, h.DemoteAhead)
	}
	if h.WriteThrough < 0 || h.WriteThrough > cfg.NumBlocks {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: write_through must be in [0, %d]: got %d", cfg.NumBlocks, h.WriteThrough)
	}
	t := &tier{cfg: *h, inflight: make(map[uint64]inflightBatch), bs: cfg.BlockSize}
	t.epoch = 1
	t.stamp = make([]uint32, cfg.NumBlocks)
	if h.WriteThrough > 0 {
		t.wt.queued = make([]bool, cfg.NumBlocks)
	}
	if h.Shared != nil {
		var err error
		if t.shared, err = newShared(h.Shared, h.Pool, cfg.BlockSize); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// FlushCopies demotes least recently used cached blocks until the free
// blocks plus those being demoted reach HostTier.DemoteAhead (fewer when
// fewer are evictable), and hands their copies, with the reloads queued
// by admissions since the last flush, to the copier as one batch. The
// engine calls it once per step, after the step's admissions and before
// its forward pass. It returns the batch's ticket, for CompleteCopies,
// and its number of copies; ticket 0 and n 0 when there was nothing to copy (the
// copier is not called). A block whose host slot cannot be reserved
// (every slot pinned, or the block is there already) is freed at once
// and counted. Errors: InvalidArgument (no host tier), and the copier's
// error, after which the batch's blocks are free and not demoted.
func (m *Manager) FlushCopies() (ticket uint64, n int, err error) {
	m.mu.Lock()
	defer m.unlock()
	t := m.tier
	if t == nil {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "flush copies: no host tier configured")
	}
	if t.cfg.Copier == nil {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "flush copies: the host tier has no copier (the engine drives the copies: FlushCopiesTo)")
	}
	return m.flushLocked(t.cfg.Copier.Copy)
}

// FlushCopiesTo is FlushCopies for an engine that performs the copies
// itself (HostTier.Copier nil, as through the C ABI): instead of handing
// the batch to a copier it writes the batch's demotions into demote and
// its reloads into reload, and returns their numbers with the ticket
// (ticket 0 when there was nothing to copy). The engine then copies each
// demotion's GPU block into its host slot and each reload's host slot
// into its GPU block, ordering the reloads before the step's attention,
// and reports the batch with CompleteCopies (rules as for
// TierCopier.Copy and CompleteCopies).
//
// demote must hold the demotions the flush may queue: those allocations
// queued since the last flush (DemoteEvicted; never more than NumBlocks)
// and DemoteAhead minus the free blocks minus the blocks being demoted
// (never more than DemoteAhead); and reload the reloads queued since the last flush
// (never more than NumBlocks); when either is shorter the call fails with
// BufferTooSmall, changing nothing, and needDemote and needReload tell
// the sizes needed. Errors: InvalidArgument (no host tier), BufferTooSmall.
func (m *Manager) FlushCopiesTo(demote []DemoteOp, reload []ReloadOp) (ticket uint64, nDemote, nReload, needDemote, needReload int, err error) {
	m.mu.Lock()
	defer m.unlock()
	t := m.tier
	if t == nil {
		return 0, 0, 0, 0, 0, kverr.Errorf(kverr.InvalidArgument, "flush copies: no host tier configured")
	}
	needDemote = len(t.evictOps) + max(t.cfg.DemoteAhead-m.pool.NumFree()-t.nBlocks, 0) + min(len(t.wt.queue), t.cfg.WriteThrough)
	needReload = len(t.reloads)
	if len(demote) < needDemote || len(reload) < needReload {
		return 0, 0, 0, needDemote, needReload, kverr.Errorf(kverr.BufferTooSmall,
			"flush copies: the batch may hold %d demotions and holds %d reloads; the arrays hold %d and %d",
			needDemote, needReload, len(demote), len(reload))
	}
	ticket, _, err = m.flushLocked(func(b CopyBatch) error {
		nDemote = copy(demote, b.Demote)
		nReload = copy(reload, b.Reload)
		return nil
	})
	return ticket, nDemote, nReload, needDemote, needReload, err
}

// flushLocked is FlushCopies under the manager's lock, handing the batch
// to copyFn.
func (m *Manager) flushLocked(copyFn func(CopyBatch) error) (ticket uint64, n int, err error) {
	t := m.tier
	// The allocations' demotions first (DemoteEvicted): they hold no GPU
	// block, and their blocks' K/V lasts only until the step writes them.
	t.pending = append(t.pending[:0], t.evictOps...)
	unheld := len(t.evictOps)
	t.evictOps = t.evictOps[:0]
	if want := t.cfg.DemoteAhead - m.pool.NumFree() - t.nBlocks; want > 0 {
		t.evInfo, t.evToks = m.cache.EvictBlocks(t.evInfo[:0], t.evToks[:0], want, t.events)
		t.pending = m.reserveDemotions(t.pending, true, "flush copies")
	}
	moved := len(t.pending)
	t.pending = m.writeThroughOps(t.pending, "flush copies")
	through := len(t.pending) - moved
	t.epoch++ // the blocks allocated so far are the step's to write
	if len(t.pending) == 0 && len(t.reloads) == 0 {
		return 0, 0, nil
	}
	t.nextTkt++
	ticket = t.nextTkt
	if cerr := copyFn(CopyBatch{Ticket: ticket, Demote: t.pending, Reload: t.reloads}); cerr != nil {
		for i, op := range t.pending {
			if i >= moved {
				m.endStore(op, false)
				continue
			}
			m.endDemotion(op, false, i >= unheld)
		}
		for _, op := range t.reloads {
			m.endReload(op, false)
		}
		nd, nr := len(t.pending), len(t.reloads)
		t.reloads = t.reloads[:0]
		return 0, 0, kverr.Wrap(kverr.CodeOf(cerr), cerr,
			"flush copies: the copier refused %d demotions, whose blocks were freed, and %d reloads, whose blocks hold no valid K/V", nd, nr)
	}
	b := CopyBatch{Ticket: ticket, Demote: append([]DemoteOp(nil), t.pending...), Reload: append([]ReloadOp(nil), t.reloads...)}
	t.reloads = t.reloads[:0]
	t.inflight[ticket] = inflightBatch{b, unheld, through}
	t.nBlocks += len(b.Demote) - unheld - through
	t.nUnheld += unheld
	t.st.DemotionsQueued += int64(len(b.Demote) - through)
	return ticket, len(b.Demote) + len(b.Reload), nil
}

// reserveDemotions reserves host slots for the blocks the prefix cache
// just evicted (t.evInfo; t.evToks too with KV events on, for them) and
// appends their demotions to ops. hold (FlushCopies' demotions): each op
// holds its GPU block until the copy completes; otherwise (the blocks an
// allocation evicts, DemoteEvicted) the blocks are freed at once, the ops
// holding none. A block that cannot be demoted is freed and counted.
func (m *Manager) reserveDemotions(ops []DemoteOp, hold bool, op string) []DemoteOp {
	t := m.tier
	t.gone = t.gone[:0]
	for i := range t.evInfo {
		ev := &t.evInfo[i]
		b, h := ev.Block, ev.Hash
		m.one[0] = b
		if t.stamp[b] == t.epoch {
			// Allocated since the last flush: its K/V is not written yet
			// (cached at admission, its sequence removed before the step's
			// forward pass). Dropped, never demoted: the host tier would
			// serve whatever the block held. An allocation's eviction
			// (DemoteEvicted) counts it; FlushCopies' does not (nothing
			// was lost: the block held nothing).
			if !hold {
				t.st.EvictedUndemoted++
			}
			assertOK(m.pool.Evict(m.one[:]), op+": an evicted block is not Cached in the pool")
			ev.MM = nil
			continue
		}
		slot, gone, rerr := t.cfg.Pool.ReserveEvict(HostKey(h))
		if rerr != nil {
			if kverr.Is(rerr, kverr.OutOfBlocks) {
				t.st.SkippedFull++
				if !hold {
					t.st.EvictedUndemoted++
				}
			} else {
				t.st.SkippedPresent++
			}
			assertOK(m.pool.Evict(m.one[:]), op+": an evicted block is not Cached in the pool")
			ev.MM = nil
			continue
		}
		if hold {
			// The copy holds the block: Cached -> InUse with its one
			// reference, no longer retained by the cache (which dropped it).
			assertOK(m.pool.Incref(m.one[:]), op+": referencing an evicted block")
			assertOK(m.pool.UnmarkCached(b), op+": unmarking an evicted block")
		} else {
			// Free for the allocation: the copy reads it before the step
			// writes it (stream order).
			assertOK(m.pool.Evict(m.one[:]), op+": an evicted block is not Cached in the pool")
		}
		ops = append(ops, DemoteOp{Block: b, Slot: slot, Hash: h})
		if t.events {
			t.hostEvicted(slot, gone, op)
			t.setMeta(slot, ev, t.evToks[i*m.bs:(i+1)*m.bs])
		}
		ev.MM = nil // the slot's now, or dropped
	}
	if len(t.gone) > 0 {
		assertOK(m.cache.RecordTierRemoved(prefix.MediumCPU, t.gone), op+": recording host evictions")
	}
	return ops
}

// evictForAlloc is makeFree's eviction with DemoteEvicted: it evicts n
// cached blocks to the free queue and queues the demotions of those it
// can demote for the next flush.
func (m *Manager) evictForAlloc(n int) {
	t := m.tier
	t.evInfo, t.evToks = m.cache.EvictBlocks(t.evInfo[:0], t.evToks[:0], n, t.events)
	t.evictOps = m.reserveDemotions(t.evictOps, false, "allocate")
}

// allocate allocates blocks the caller made free (hint as pool.Allocate)
// and records them as just allocated: their K/V is the current step's to
// write, so no demotion reads them before the next flush. One call does
// both so that no allocation misses the stamp. what names the caller's
// step for the panic when the blocks were not free.
func (m *Manager) allocate(blocks []int32, hint int32, what string) {
	assertOK(m.pool.Allocate(blocks, hint), what)
	if t := m.tier; t != nil {
		for _, b := range blocks {
			t.stamp[b] = t.epoch
		}
	}
}

// endReload ends one reload: its host slot is unpinned and the op's
// reference (and lock) on the GPU block dropped.
func (m *Manager) endReload(op ReloadOp, ok bool) {
	t := m.tier
	assertOK(t.cfg.Pool.Unpin(op.Slot), "complete copies: unpinning a reload's host slot")
	if ok {
		t.st.ReloadsCompleted++
	} else {
		t.st.ReloadsFailed++
	}
	m.one[0] = op.Block
	if m.pool.IsCached(op.Block) {
		// Not an access: the sequence that matched the block touched it.
		assertOK(m.cache.Release(m.one[:]), "complete copies: a reloaded cached block is not locked")
	}
	var err error
	m.cached, err = m.pool.Decref(m.one[:], m.cached[:0])
	assertOK(err, "complete copies: a reloaded block is not referenced")
}

// endHostCopy ends the host side of a copy GPU block -> host slot (a
// demotion's or a write-through store's): the slot is committed, and
// queued for the shared tier when there is one (ok), or aborted (counted
// failed); with KV events the slot is announced or forgotten. It returns
// ok.
func (t *tier) endHostCopy(op DemoteOp, ok bool) bool {
	if ok {
		if t.shared != nil {
			t.shared.queueStore(op)
		} else {
			assertOK(t.cfg.Pool.Commit(op.Slot), "complete copies: committing a reserved host slot")
		}
		if t.events {
			t.meta[op.Slot].resident = true
			t.nResident++
		}
		return true
	}
	assertOK(t.cfg.Pool.Abort(op.Slot), "complete copies: aborting a reserved host slot")
	t.st.DemotionsFailed++
	if t.events {
		t.meta[op.Slot] = hostMeta{}
	}
	return false
}

// endDemotion ends one demotion: its host slot is committed (ok) or
// aborted, and its GPU block freed when the op holds it (held).
func (m *Manager) endDemotion(op DemoteOp, ok, held bool) {
	if m.tier.endHostCopy(op, ok) {
		m.tier.st.DemotionsCompleted++
	}
	if !held {
		return
	}
	m.one[0] = op.Block
	var err error
	m.cached, err = m.pool.Decref(m.one[:], m.cached[:0])
	assertOK(err, "complete copies: a demoted block is not referenced")
}

// CompleteCopies reports that batch ticket's copies have finished (failed
// false) or failed: each demoted block's host slot is committed (aborted
// on failure), and queued for the shared tier when there is one (never
// waiting on it), and its GPU block returns to the free queue; each reload's
// host slot is unpinned and the copy's hold on its GPU block dropped. Errors:
// InvalidArgument (no host tier), NotFound (ticket unknown or completed
// already), with nothing changed.
func (m *Manager) CompleteCopies(ticket uint64, failed bool) error {
	m.mu.Lock()
	defer m.unlock()
	t := m.tier
	if t == nil {
		return kverr.Errorf(kverr.InvalidArgument, "complete copies: no host tier configured")
	}
	b, ok := t.inflight[ticket]
	if !ok {
		return kverr.Errorf(kverr.NotFound, "complete copies: no batch %d in flight", ticket)
	}
	delete(t.inflight, ticket)
	t.nBlocks -= len(b.Demote) - b.unheld - b.through
	t.nUnheld -= b.unheld
	moved := len(b.Demote) - b.through
	for i, op := range b.Demote {
		if i >= moved {
			m.endStore(op, !failed)
			continue
		}
		m.endDemotion(op, !failed, i >= b.unheld)
	}
	if t.events && !failed {
		// Announced parents first (the batch is in eviction order,
		// children first), so that a chain goes as one BlockStored.
		for k := len(b.Demote) - 1; k >= 0; k-- {
			blk := t.block(b.Demote[k].Slot)
			assertOK(m.cache.RecordTierStored(&blk), "complete copies: recording a committed demotion")
		}
	}
	for _, op := range b.Reload {
		m.endReload(op, !failed)
	}
	return nil
}

// MatchTiers is Match per tier: for each prompt, the tokens of its
// longest prefix in the GPU prefix cache (as Match, touching those
// blocks) and, beyond them, of the blocks the host tier holds under the
// prompt's next chained hashes (host.Pool.Lookup: touched in the host
// LRU, not pinned). Neither match covers the prompt's last token. Without
// a host tier Host is 0; without the prefix cache both are.
//
// With a shared tier, the blocks it holds past each prompt's GPU and host
// matches are first fetched into the host tier (shared.go, bounded by
// two operation timeouts), and Host counts them: a scheduler's MatchTiers
// ahead of Admit prefetches them.
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
	fetched, _ := m.fetchShared(prompts, nil) // no ids: no error
	m.mu.Lock()
	defer m.unlock()
	for i := range n {
		out[i] = TierMatch{}
		if m.cache == nil {
			continue
		}
		tokens, keys := prompts.prompt(i)
		res, err := m.cache.Match(m.locks[:0], tokens, keys, false)
		m.locks = res.Blocks[:0]
		assertOK(err, "match tiers: the index refused a validated prompt")
		out[i].GPU = int32(res.Tokens)
		t := m.tier
		if t == nil {
			continue
		}
		t.st.MatchQueries++
		t.st.MatchGPUTokens += int64(res.Tokens)
		limit := 0
		if len(tokens) > 0 {
			limit = (len(tokens) - 1) / m.bs // full blocks short of the last token
		}
		gpuBlocks := res.Tokens / m.bs
		if limit <= gpuBlocks {
			continue
		}
		t.hashes, err = t.hasher.Chain(t.hashes[:0], tokens[:limit*m.bs], m.bs, keys)
		assertOK(err, "match tiers: hashing a validated prompt")
		t.keys = t.keys[:0]
		for _, h := range t.hashes[gpuBlocks:] {
			t.keys = append(t.keys, HostKey(h))
		}
		hit := t.cfg.Pool.Lookup(t.keys)
		out[i].Host = int32(hit * m.bs)
		t.st.MatchHostTokens += int64(hit * m.bs)
		if k := t.countShared(fetched, hit); k > 0 {
			t.shared.matchTokens.Add(int64(k * m.bs))
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
	st := m.tier.st
	st.InFlight = m.tier.nBlocks + m.tier.nUnheld + len(m.tier.evictOps)
	st.WriteThroughQueue = len(m.tier.wt.queue)
	st.Host = m.tier.cfg.Pool.Stats()
	if m.tier.shared != nil {
		st.Shared = m.tier.shared.stats()
	}
	return st
}

// checkTier verifies the host tier's part of the invariants: every block
// being demoted is InUse, not cached, with one reference, which refs (the
// sequences' references so far) is credited with; its host slot is
// reserved under the block's key.
func (m *Manager) checkTier(refs []int32, bad func(string, ...any) error) error {
	t := m.tier
	if t == nil {
		return nil
	}
	count := 0
	for _, op := range t.reloads {
		refs[op.Block]++
	}
	for _, op := range t.evictOps {
		if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != HostKey(op.Hash) {
			return bad("block %d's queued demotion: host slot %d does not hold its key", op.Block, op.Slot)
		}
	}
	unheld := 0
	for tk, batch := range t.inflight {
		for _, op := range batch.Reload {
			refs[op.Block]++
		}
		for i, op := range batch.Demote {
			b := op.Block
			if i >= len(batch.Demote)-batch.through {
				// A write-through store: the block stays cached, and the
				// copy holds a reference and a lock on it.
				if !m.pool.IsCached(b) {
					return bad("block %d being stored (batch %d) is not cached", b, tk)
				}
				if h, ok := m.cache.BlockHash(b); !ok || h != op.Hash {
					return bad("block %d being stored (batch %d) is not cached under its hash %s", b, tk, op.Hash)
				}
				refs[b]++
				if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != HostKey(op.Hash) {
					return bad("block %d being stored (batch %d): host slot %d does not hold its key", b, tk, op.Slot)
				}
				continue
			}
			if i < batch.unheld {
				// Holds no GPU block (DemoteEvicted), only its host slot.
				unheld++
				if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != HostKey(op.Hash) {
					return bad("block %d's demotion (batch %d, unheld): host slot %d does not hold its key", b, tk, op.Slot)
				}
				continue
			}
			if m.pool.IsCached(b) {
				return bad("block %d being demoted (batch %d) is marked cached", b, tk)
			}
			if _, ok := m.cache.BlockHash(b); ok {
				return bad("block %d being demoted (batch %d) is in the prefix cache", b, tk)
			}
			refs[b]++
			if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != HostKey(op.Hash) {
				return bad("block %d being demoted (batch %d): host slot %d does not hold its key", b, tk, op.Slot)
			}
			count++
		}
	}
	if count != t.nBlocks || unheld != t.nUnheld {
		return bad("%d blocks being demoted and %d unheld demotions, the counts say %d and %d", count, unheld, t.nBlocks, t.nUnheld)
	}
	return t.checkEvents(bad)
}

// checkEvents verifies the slots' descriptions that the KV events rest
// on: the announced slots are the pool's resident ones, each under its
// block's key, and every slot being demoted describes its block, not yet
// announced.
func (t *tier) checkEvents(bad func(string, ...any) error) error {
	if !t.events {
		return nil
	}
	n := 0
	for s := range t.meta {
		if !t.meta[s].resident {
			continue
		}
		n++
		if k, ok := t.cfg.Pool.Hash(host.Slot(s)); !ok || k != HostKey(t.meta[s].hash) {
			return bad("host slot %d is announced with block %s, the pool holds %016x (%v)", s, t.meta[s].hash, k, ok)
		}
	}
	if res := t.cfg.Pool.Stats().Resident; n != t.nResident || n != res {
		return bad("%d host slots announced, the count says %d, the pool holds %d resident", n, t.nResident, res)
	}
	for tk, batch := range t.inflight {
		for _, op := range batch.Demote {
			if int(op.Slot) >= len(t.meta) || t.meta[op.Slot].resident || t.meta[op.Slot].hash != op.Hash {
				return bad("host slot %d being demoted (batch %d) does not describe block %s", op.Slot, tk, op.Hash)
			}
		}
	}
	for _, op := range t.evictOps {
		if int(op.Slot) >= len(t.meta) || t.meta[op.Slot].resident || t.meta[op.Slot].hash != op.Hash {
			return bad("host slot %d of a queued demotion does not describe block %s", op.Slot, op.Hash)
		}
	}
	return nil
}

// pinHost matches a prompt's blocks beyond its first gpu matched ones in
// the host tier, pinning the matched slots (into t.slots), and returns
// how many. Never the block holding the prompt's last token.
func (m *Manager) pinHost(tokens []int32, keys *prefix.Keys, gpu int) int {
	t := m.tier
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / m.bs
	}
	if limit <= gpu || t.cfg.Pool.Stats().Resident == 0 {
		return 0 // nothing to match: spare the hashing
	}
	var err error
	t.hashes, err = t.hasher.Chain(t.hashes[:0], tokens[:limit*m.bs], m.bs, keys)
	assertOK(err, "admit: hashing a validated prompt")
	t.keys = t.keys[:0]
	for _, h := range t.hashes[gpu:] {
		t.keys = append(t.keys, HostKey(h))
	}
	if cap(t.slots) < len(t.keys) {
		t.slots = make([]host.Slot, len(t.keys))
	}
	t.slots = t.slots[:len(t.keys)]
	n, err := t.cfg.Pool.PinPrefix(t.keys, t.slots)
	if err != nil {
		return 0 // a closed pool: a miss
	}
	return n
}

// queueReloads records the reloads of s's blocks [k, k+n) from t.slots
// and takes the ops' references on them; lockReloads then takes their
// locks on those the prefix cache holds (once inserted).
func (m *Manager) queueReloads(s *seq, k, n int) {
	t := m.tier
	for j := range n {
		t.reloads = append(t.reloads, ReloadOp{Slot: t.slots[j], Block: s.blocks[k+j]})
	}
	// Fresh blocks with one reference each.
	assertOK(m.pool.Incref(s.blocks[k:k+n]), "admit: referencing the reload's blocks")
	t.st.Reloads += int64(n)
	t.st.HostHitTokens += int64(n * m.bs)
}

func (m *Manager) lockReloads(s *seq, k, n int) {
	m.locks = m.cachedOf(s.blocks[k:k+n], m.locks[:0])
	if len(m.locks) > 0 {
		assertOK(m.cache.Lock(m.locks), "admit: locking the reload's cached blocks")
	}
}
