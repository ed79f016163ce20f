package kvtier

import (
	"encoding/binary"
	"sync"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/blocks"
)

// The host tier in the manager (issue 23; core/kvtier's package comment
// has the ordering rules this follows).
//
// With kvmanager.Config.HostTier set, cached GPU blocks that the manager evicts
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
// as the blocks the step computes are (core/kvmanager, prefix.go: a block is cached when
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
// demotion, as without a tier (counted in Stats.EvictedUndemoted).
// Demotion happens ahead of need instead, in FlushCopies, which the
// engine calls once per step: it evicts the least recently used cached
// blocks (the prefix cache's own order) until the free blocks plus those
// being demoted reach Config.DemoteAhead, queues their copies and hands
// the step's copies to the Copier as one batch. Their blocks return
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
// demotable too, and Config.DemoteEvicted opts in: such a block goes to
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
// FlushCopies calls Copier.Copy with the manager's lock held: Copy
// must only enqueue the batch (a copy kernel or cudaMemcpyBatchAsync on
// the engine's stream, then an event) and return; it must not call the
// Manager. The engine reports completion with CompleteCopies(ticket),
// from any goroutine, once the batch's copies have finished (its event
// has completed), or with failed set when they did not. Until then the
// batch's GPU blocks stay allocated to the copy and its host slots stay
// reserved (invisible to host matches), so the bytes under a copy never
// change and a half-written slot is never matched.

// Config configures a manager's host tier (kvmanager.Config.HostTier).
type Config struct {
	// Pool holds the demoted blocks. The tier is its only writer
	// (Reserve, Commit, Abort); one pool per tier. The caller keeps it
	// (and closes it after the tier).
	Pool *host.Pool
	// With Pool nil, the tier makes its own pool of Slots slots of
	// BlockBytes bytes each, in memory from Memory (nil: Go memory), and
	// owns both: Close closes the pool and releases the memory.
	Slots, BlockBytes int
	Memory            Memory
	// Copier performs the copies between GPU blocks and host slots. Nil:
	// the engine drives the copies itself through FlushCopiesTo (as the C
	// ABI does), and FlushCopies fails.
	Copier Copier
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
	// WriteThroughSlack holds the write-through stores back while the GPU
	// pool's free queue holds more than this many blocks; the caller's
	// obligation and why no queued block is lost meanwhile are in
	// writethrough.go, "Waiting while the pool has room". In [0,
	// NumBlocks]; nonzero only with WriteThrough > 0 and at least
	// DemoteAhead. 0 stores every flush.
	WriteThroughSlack int
	// Shared, when not nil, adds the shared tier (a Valkey or Redis
	// server) below the host tier (shared.go). The manager must then be
	// closed (Close).
	Shared *SharedConfig
}

// Memory is the memory of a pool the tier makes (Config.Slots): Alloc is
// called once, at New, and Release once, when the tier closes (or New
// fails after Alloc), whatever the pool's state then: the caller of Close
// guarantees that no copy uses the memory any more.
type Memory interface {
	Alloc(size int) ([]byte, error)
	Release()
}

// NumSlots is the host slots of the tier this config makes.
func (c *Config) NumSlots() int {
	if c.Pool != nil {
		return c.Pool.Stats().Slots
	}
	return c.Slots
}

// DemoteOp is one block's demotion: copy GPU block Block (all layers, K
// and V) into host slot Slot (Pool.Bytes(Slot)).
type DemoteOp struct {
	Block int32
	Slot  host.Slot
	Hash  prefix.Hash // the block's chained hash, its node's in a group past 0 (host key GroupKey(Hash, Group))
	// Group is the layer group whose block Block is (groups.go): the copy
	// moves that group's layers of it. 0 without groups.
	Group int
}

// ReloadOp is one block's reload: copy host slot Slot into GPU block
// Block (all layers, K and V), before the step's attention reads it.
type ReloadOp struct {
	Slot  host.Slot
	Block int32
	Group int // as DemoteOp.Group
}

// CopyBatch is one step's copies, handed to Copier.Copy. Its slices
// are the manager's and valid only during the call.
type CopyBatch struct {
	// Ticket names the batch in CompleteCopies; never 0.
	Ticket uint64
	// Demote lists the GPU-to-host copies, in eviction order: those of
	// the blocks allocations evicted since the last flush first
	// (Config.DemoteEvicted), then FlushCopies' own. The engine must
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

// Copier performs a manager's tier copies (see the comment above
// Config for when and under which lock it is called).
type Copier interface {
	// Copy starts the batch's copies and returns. An error means nothing
	// of the batch was started: the manager drops the blocks without
	// demotion (aborting their host slots) and FlushCopies returns it.
	Copy(b CopyBatch) error
}

// Stats are the host tier's counters in the manager, and the host
// pool's own.
type Stats struct {
	DemotionsQueued    int64 // demotion copies handed to the copier
	DemotionsCompleted int64 // committed to the host tier (with groups, a node's group-0 slot aborted as its full companion went is neither this nor failed)
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
	WriteThroughLost   int64 // computed blocks the GPU evicted before their write-through store (and the host tier does not hold), or whose store failed
	WriteThroughQueue  int   // computed blocks waiting for their write-through store
	Host               host.Stats
	Shared             SharedStats // the shared tier's; zero without one
}

// HostKey is the host tier's key of a block: the first eight bytes of its
// chained hash, big-endian.
func HostKey(h prefix.Hash) uint64 { return binary.BigEndian.Uint64(h[:8]) }

// Tier is a manager's host tier: the host pool (and its memory, when
// the tier made it), the shared tier's client and the policy that moves
// blocks between them and the GPU pool (demotion, write-through,
// reloads). Its methods are called under the manager's lock (the
// package comment's obligations), but for Fetch and Close, which take
// that lock themselves around their round trips to the shared tier.
type Tier struct {
	cfg      Config
	gpu      *blocks.Pool
	cache    *prefix.Index
	lock     sync.Locker
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
	// orphans: the nodes (layer groups, groups.go) whose group-0 slot,
	// reserved for a demotion in flight or pinned, lost a full companion
	// (orphaned): dropped once no longer in flight or pinned, unless whole
	// again. At most one per such slot.
	orphans map[prefix.Hash]struct{}

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

	// owned: the tier made cfg.Pool (Config.Slots) and releases it, with
	// cfg.Memory, at Close; released once it has.
	owned, released bool

	// Scratch for the GPU pool's calls.
	one    [1]int32
	cached []int32
	locks  []int32

	// Write-through (writethrough.go).
	wt writeThrough

	// Layer groups (groups.go): the manager's side, nil without groups;
	// an admission's pinned slots; a flush's evicted companions;
	// nCompanions counts the companions' slots committed (with events).
	groups      Groups
	greloads    []groupReload
	comps       []Companion
	nCompanions int

	st Stats
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
	resident bool // committed (and announced in group 0); false while reserved
	// group: the slot holds a companion (groups.go), which CPU events do
	// not announce: they carry no group, and its node's group-0 block
	// stands for the node.
	group int
}

// hostEvicted notes, with KV events on, that a reservation took slot s
// (gone: the resident block it evicted, if any): the evicted block's
// hash joins t.gone, whose BlockRemoved the caller records, and the slot
// is no longer announced. Under the manager's lock, as every change of
// the host pool's slots is.
func (t *Tier) hostEvicted(s host.Slot, gone host.Eviction, op string) {
	if !gone.Evicted {
		return
	}
	if int(s) >= len(t.meta) || !t.meta[s].resident || GroupKey(t.meta[s].hash, t.meta[s].group) != gone.Hash {
		panic(kverr.Errorf(kverr.Internal, "kvtier: %s: the host pool evicted block %016x from slot %d, which holds no announced block", op, gone.Hash, s))
	}
	t.meta[s].resident = false
	if g := t.meta[s].group; g > 0 {
		t.nCompanions--
		t.orphaned(t.meta[s].hash, g, op)
		return
	}
	t.gone = append(t.gone, t.meta[s].hash)
	t.nResident--
}

// setMeta records the block that slot s now holds (reserved), in group g.
func (t *Tier) setMeta(s host.Slot, b *prefix.EvictedBlock, toks []int32, g int) {
	if n := int(s) + 1; n > len(t.meta) {
		t.meta = append(t.meta, make([]hostMeta, n-len(t.meta))...)
		t.toks = append(t.toks, make([]int32, n*t.bs-len(t.toks))...)
	}
	// b.MM is the caller's (EvictBlocks hands it over).
	t.meta[s] = hostMeta{hash: b.Hash, parent: b.Parent, adapter: b.Adapter, mm: b.MM, group: g}
	copy(t.toks[int(s)*t.bs:(int(s)+1)*t.bs], toks)
}

// block returns slot s's block as its BlockStored describes it; its
// slices are the tier's.
func (t *Tier) block(s host.Slot) prefix.TierBlock {
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
func (t *Tier) TierLen() int { return t.nResident }

// AppendTierBlocks implements prefix.TierSource: the resident host
// blocks, in slot order.
func (t *Tier) AppendTierBlocks(dst []prefix.TierBlock) []prefix.TierBlock {
	for s := range t.meta {
		if t.meta[s].resident && t.meta[s].group == 0 {
			dst = append(dst, t.block(host.Slot(s)))
		}
	}
	return dst
}

// GPU is what a tier works on: the manager's GPU block pool and prefix
// cache, and the manager's lock (Lock, and an Unlock that runs the
// manager's end-of-call checks), which Fetch and Close take themselves.
type GPU struct {
	Pool  *blocks.Pool
	Cache *prefix.Index // nil: the prefix cache is off (refused: the tier needs it)
	Lock  sync.Locker
	// Events: the prefix cache records KV events, and the host tier's
	// blocks are announced in them ("KV events" above).
	Events bool
	// Groups: the manager has layer groups (groups.go); nil without.
	Groups Groups
}

// New returns the host tier of cfg over g; with a shared tier its store
// goroutine runs until Close. A tier that makes its pool (Config.Slots)
// checks everything else first, so that a refused config allocates
// nothing.
func New(cfg Config, g GPU) (*Tier, error) {
	h := &cfg
	if h.Pool == nil && h.Slots == 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: a pool is needed")
	}
	if g.Cache == nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: needs the prefix cache (enable_prefix_cache)")
	}
	nb := g.Pool.NumBlocks()
	if h.DemoteAhead < 0 || h.DemoteAhead > nb {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: demote_ahead must be in [0, %d]: got %d", nb, h.DemoteAhead)
	}
	if h.WriteThrough < 0 || h.WriteThrough > nb {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: write_through must be in [0, %d]: got %d", nb, h.WriteThrough)
	}
	if h.WriteThroughSlack < 0 || h.WriteThroughSlack > nb {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: write_through_slack must be in [0, %d]: got %d", nb, h.WriteThroughSlack)
	}
	if h.WriteThroughSlack > 0 && h.WriteThrough == 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host tier: write_through_slack (%d) needs write-through (write_through > 0)", h.WriteThroughSlack)
	}
	// Demotion ahead keeps more blocks free than the slack lets the free
	// queue fall to: the stores would wait while a step allocates fewer
	// than demote_ahead - slack blocks, and race the demotions (which move
	// the same blocks to the host) when it allocates more, most of them
	// lost.
	if h.WriteThroughSlack > 0 && h.DemoteAhead > h.WriteThroughSlack {
		return nil, kverr.Errorf(kverr.InvalidArgument,
			"host tier: demote_ahead (%d) above write_through_slack (%d) would hold the write-through stores back (demotion keeps more blocks free than the slack); use demote_ahead <= write_through_slack, or 0",
			h.DemoteAhead, h.WriteThroughSlack)
	}
	if h.Shared != nil {
		if err := h.Shared.Check(); err != nil {
			return nil, err
		}
	}
	t := &Tier{cfg: cfg, gpu: g.Pool, cache: g.Cache, lock: g.Lock, inflight: make(map[uint64]inflightBatch), bs: g.Pool.BlockSize(), groups: g.Groups}
	if h.Pool == nil {
		p, err := newPool(h.Slots, h.BlockBytes, h.Memory)
		if err != nil {
			return nil, err
		}
		t.cfg.Pool, t.owned = p, true
	}
	t.epoch = 1
	t.stamp = make([]uint32, nb)
	if h.WriteThrough > 0 {
		t.wt.queued = make([]bool, nb)
	}
	if h.Shared != nil {
		var err error
		if t.shared, err = newShared(h.Shared, t.cfg.Pool, t.bs); err != nil {
			t.release()
			return nil, err
		}
	}
	if g.Events {
		// The host tier's blocks are announced as CPU events and listed
		// by snapshots ("KV events" above).
		t.events = true
		t.cache.SetTierSource(t)
	}
	if t.shared != nil {
		go t.shared.run() // until Close
	}
	return t, nil
}

// poolMemory adapts a Memory to the host pool's Allocator: the pool's
// Free does nothing, the tier releases the memory itself (release), after
// the pool is closed.
type poolMemory struct{ m Memory }

func (a poolMemory) Alloc(size int) ([]byte, error) { return a.m.Alloc(size) }

func (poolMemory) Free([]byte) error { return nil }

// newPool makes a tier's own pool in mem (nil: Go memory), releasing
// mem when the pool cannot be made.
func newPool(slots, blockBytes int, mem Memory) (*host.Pool, error) {
	pc := host.Config{Slots: slots, BlockBytes: blockBytes}
	if mem != nil {
		pc.Alloc = poolMemory{mem}
	}
	p, err := host.New(pc)
	if err != nil && mem != nil {
		mem.Release()
	}
	return p, err
}

// release closes the pool the tier made and releases its memory; once.
func (t *Tier) release() {
	if !t.owned || t.released {
		return
	}
	t.released = true
	_ = t.cfg.Pool.Close() // refused while a slot is pinned: the memory goes all the same
	if t.cfg.Memory != nil {
		t.cfg.Memory.Release()
	}
}

// Pool returns the tier's host pool.
func (t *Tier) Pool() *host.Pool { return t.cfg.Pool }

// Config returns the tier's configuration (Pool set).
func (t *Tier) Config() Config { return t.cfg }

// FlushCopies demotes least recently used cached blocks until the free
// blocks plus those being demoted reach Config.DemoteAhead (fewer when
// fewer are evictable), and hands their copies, with the reloads queued
// by admissions since the last flush, to the copier as one batch. The
// engine calls it once per step, after the step's admissions and before
// its forward pass. It returns the batch's ticket, for CompleteCopies,
// and its number of copies; ticket 0 and n 0 when there was nothing to copy (the
// copier is not called). A block whose host slot cannot be reserved
// (every slot pinned, or the block is there already) is freed at once
// and counted. Errors: InvalidArgument (no host tier), and the copier's
// error, after which the batch's blocks are free and not demoted.
func (t *Tier) FlushCopies() (ticket uint64, n int, err error) {
	if t.cfg.Copier == nil {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "flush copies: the host tier has no copier (the engine drives the copies: FlushCopiesTo)")
	}
	return t.flush(t.cfg.Copier.Copy)
}

// FlushCopiesTo is FlushCopies for an engine that performs the copies
// itself (Config.Copier nil, as through the C ABI): instead of handing
// the batch to a copier it writes the batch's demotions into demote and
// its reloads into reload, and returns their numbers with the ticket
// (ticket 0 when there was nothing to copy). The engine then copies each
// demotion's GPU block into its host slot and each reload's host slot
// into its GPU block, ordering the reloads before the step's attention,
// and reports the batch with CompleteCopies (rules as for
// Copier.Copy and CompleteCopies).
//
// demote must hold the demotions the flush may queue: those allocations
// queued since the last flush (DemoteEvicted; never more than NumBlocks)
// and DemoteAhead minus the free blocks minus the blocks being demoted
// (never more than DemoteAhead; with layer groups, the nodes evicted for
// them times one op per group, since each brings its companions:
// demoteAhead); and reload the reloads queued since the last flush
// (never more than NumBlocks); when either is shorter the call fails with
// BufferTooSmall, changing nothing, and needDemote and needReload tell
// the sizes needed. Errors: InvalidArgument (no host tier), BufferTooSmall.
func (t *Tier) FlushCopiesTo(demote []DemoteOp, reload []ReloadOp) (ticket uint64, nDemote, nReload, needDemote, needReload int, err error) {
	needDemote, needReload = t.flushNeeds()
	if len(demote) < needDemote || len(reload) < needReload {
		return 0, 0, 0, needDemote, needReload, kverr.Errorf(kverr.BufferTooSmall,
			"flush copies: the batch may hold %d demotions and holds %d reloads; the arrays hold %d and %d",
			needDemote, needReload, len(demote), len(reload))
	}
	ticket, _, err = t.flush(func(b CopyBatch) error {
		// needDemote and needReload bound the batch: an op left out would
		// never be copied, and its host slot (or GPU block, for a reload
		// the prefix cache already serves) would hold whatever it held.
		// Failing the batch cannot undo that either, so it is a bug.
		if len(b.Demote) > len(demote) || len(b.Reload) > len(reload) {
			panic(kverr.Errorf(kverr.Internal, "kvtier: flush copies: a batch of %d demotions and %d reloads exceeds the %d and %d it asked room for",
				len(b.Demote), len(b.Reload), len(demote), len(reload)))
		}
		nDemote = copy(demote, b.Demote)
		nReload = copy(reload, b.Reload)
		return nil
	})
	return ticket, nDemote, nReload, needDemote, needReload, err
}

// FlushCopiesWithin is FlushCopiesTo for a caller whose room is counted
// (maxDemote, maxReload: the C ABI's arrays) rather than given as
// slices: the batch's ops come back in slices of their own, as long as
// the batch may need, however large the room. Errors: FlushCopiesTo's.
func (t *Tier) FlushCopiesWithin(maxDemote, maxReload int) (ticket uint64, demote []DemoteOp, reload []ReloadOp, needDemote, needReload int, err error) {
	needDemote, needReload = t.flushNeeds()
	d, r := make([]DemoteOp, min(needDemote, maxDemote)), make([]ReloadOp, min(needReload, maxReload))
	ticket, nd, nr, needDemote, needReload, err := t.FlushCopiesTo(d, r)
	return ticket, d[:nd], r[:nr], needDemote, needReload, err
}

// flushNeeds bounds the next batch's demotions and reloads
// (FlushCopiesTo).
func (t *Tier) flushNeeds() (demote, reload int) {
	_, ahead := t.demoteAhead()
	return len(t.evictOps) + ahead + min(len(t.wt.queue), t.cfg.WriteThrough), len(t.reloads)
}

// flush is FlushCopies handing the batch to copyFn.
func (t *Tier) flush(copyFn func(CopyBatch) error) (ticket uint64, n int, err error) {
	// The allocations' demotions first (DemoteEvicted): they hold no GPU
	// block, and their blocks' K/V lasts only until the step writes them.
	t.pending = append(t.pending[:0], t.evictOps...)
	unheld := len(t.evictOps)
	t.evictOps = t.evictOps[:0]
	if nodes, _ := t.demoteAhead(); nodes > 0 {
		t.evInfo, t.evToks = t.cache.EvictBlocks(t.evInfo[:0], t.evToks[:0], nodes, t.events)
		t.pending = t.reserveDemotions(t.pending, true, "flush copies")
	}
	moved := len(t.pending)
	t.pending = t.writeThroughOps(t.pending, "flush copies")
	through := len(t.pending) - moved
	t.epoch++ // the blocks allocated so far are the step's to write
	if len(t.pending) == 0 && len(t.reloads) == 0 {
		return 0, 0, nil
	}
	t.nextTkt++
	ticket = t.nextTkt
	if cerr := copyFn(CopyBatch{Ticket: ticket, Demote: t.pending, Reload: t.reloads}); cerr != nil {
		t.gone = t.gone[:0]
		for i, op := range t.pending {
			if i >= moved {
				t.endStore(op, false)
				continue
			}
			t.endDemotion(op, false, i >= unheld)
		}
		for _, op := range t.reloads {
			t.endReload(op, false)
		}
		t.recordGone("flush copies")
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
// holding none. A block that cannot be demoted is freed and counted. With
// layer groups each node's companions follow it (groups.go, reserveNode),
// as ops of their groups.
func (t *Tier) reserveDemotions(ops []DemoteOp, hold bool, op string) []DemoteOp {
	t.gone = t.gone[:0]
	t.comps = t.comps[:0]
	if t.groups != nil && len(t.evInfo) > 0 {
		t.comps = t.groups.Detach(t.evInfo, t.comps)
	}
	c := 0 // t.comps is in node order
	for i := range t.evInfo {
		ev := &t.evInfo[i]
		var toks []int32
		if t.events {
			toks = t.evToks[i*t.bs : (i+1)*t.bs]
		}
		if t.groups != nil {
			var n int
			ops, n = t.reserveNode(ops, i, t.comps[c:], toks, hold, op)
			c += n
		} else {
			ops = t.reserveOne(ops, ev, ev.Block, 0, toks, hold, op)
		}
		ev.MM = nil // the slot's now, or dropped
	}
	t.recordGone(op)
	return ops
}

// reserveOne is reserveDemotions for block b of evicted node ev in group
// g: it appends b's demotion to ops, or frees b.
func (t *Tier) reserveOne(ops []DemoteOp, ev *prefix.EvictedBlock, b int32, g int, toks []int32, hold bool, op string) []DemoteOp {
	h := ev.Hash
	t.one[0] = b
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
		assertOK(t.gpu.Evict(t.one[:]), op+": an evicted block is not Cached in the pool")
		return ops
	}
	slot, gone, rerr := t.cfg.Pool.ReserveEvict(GroupKey(h, g))
	if rerr != nil {
		if kverr.Is(rerr, kverr.OutOfBlocks) {
			t.st.SkippedFull++
			if !hold {
				t.st.EvictedUndemoted++
			}
		} else {
			t.st.SkippedPresent++
		}
		assertOK(t.gpu.Evict(t.one[:]), op+": an evicted block is not Cached in the pool")
		return ops
	}
	if t.events {
		t.hostEvicted(slot, gone, op)
	}
	return t.demoteInto(ops, ev, b, g, slot, toks, hold, op)
}

// demoteInto appends to ops the demotion of block b of evicted node ev in
// group g into host slot s, which it reserved, and returns ops.
func (t *Tier) demoteInto(ops []DemoteOp, ev *prefix.EvictedBlock, b int32, g int, s host.Slot, toks []int32, hold bool, op string) []DemoteOp {
	t.one[0] = b
	if hold {
		// The copy holds the block: Cached -> InUse with its one
		// reference, no longer retained by the cache (which dropped it).
		assertOK(t.gpu.Incref(t.one[:]), op+": referencing an evicted block")
		assertOK(t.gpu.UnmarkCached(b), op+": unmarking an evicted block")
	} else {
		// Free for the allocation: the copy reads it before the step
		// writes it (stream order).
		assertOK(t.gpu.Evict(t.one[:]), op+": an evicted block is not Cached in the pool")
	}
	if t.events {
		t.setMeta(s, ev, toks, g)
	}
	return append(ops, DemoteOp{Block: b, Slot: s, Hash: ev.Hash, Group: g})
}

// demoteAhead returns how many nodes the flush evicts to demote ahead
// (DemoteAhead minus the free blocks minus those being demoted), and the
// most demotions they queue. Without groups a node is one block. With
// groups a node frees its companions with it: at least its full groups'
// (window ones may be gone already), so ceil(want / that) nodes are
// evicted; but each may bring a companion in every group, so the batch
// may hold up to 1 + len(groups) ops a node, more than the blocks wanted
// (FlushCopiesTo's arrays must hold them all).
func (t *Tier) demoteAhead() (nodes, ops int) {
	want := t.cfg.DemoteAhead - t.gpu.NumFree() - t.nBlocks
	if want <= 0 {
		return 0, 0
	}
	if t.groups == nil {
		return want, want
	}
	gs := t.groups.HostGroups()
	per := 1
	for _, g := range gs {
		if g.Window == 0 {
			per++
		}
	}
	nodes = (want + per - 1) / per
	// Every op demotes a cached block no sequence holds: never more ops
	// than those (so arrays of NumBlocks always do, as the header says).
	return nodes, min(nodes*(1+len(gs)), t.gpu.Stats().Cached)
}

// EvictForAlloc is the manager's eviction for an allocation that finds
// the free queue n blocks short, with DemoteEvicted: it evicts n cached
// blocks to the free queue and queues the demotions of those it can
// demote for the next flush. Without DemoteEvicted it does nothing and
// returns false: the manager evicts (and calls Evicted).
func (t *Tier) EvictForAlloc(n int) bool {
	if !t.cfg.DemoteEvicted {
		return false
	}
	t.evInfo, t.evToks = t.cache.EvictBlocks(t.evInfo[:0], t.evToks[:0], n, t.events)
	t.evictOps = t.reserveDemotions(t.evictOps, false, "allocate")
	return true
}

// Evicted counts n blocks an allocation evicted and dropped (without
// DemoteEvicted): needed now, a block waiting for its demotion copy could
// not have served the allocation. With write-through they are not
// counted: the host tier has their copy, or counts it lost
// (writethrough.go).
func (t *Tier) Evicted(n int) {
	if t.cfg.WriteThrough == 0 {
		t.st.EvictedUndemoted += int64(n)
	}
}

// Allocated records blocks the manager just allocated: their K/V is the
// current step's to write, so no demotion reads them before the next
// flush. The manager calls it with every allocation, so that none misses
// the stamp.
func (t *Tier) Allocated(blocks []int32) {
	for _, b := range blocks {
		t.stamp[b] = t.epoch
	}
}

// endReload ends one reload: its host slot is unpinned (and dropped, when
// its node lost a full companion meanwhile: groups.go, unpinned) and the
// op's reference (and lock) on the GPU block dropped.
func (t *Tier) endReload(op ReloadOp, ok bool) {
	assertOK(t.cfg.Pool.Unpin(op.Slot), "complete copies: unpinning a reload's host slot")
	t.unpinned(op.Slot, "complete copies")
	if ok {
		t.st.ReloadsCompleted++
	} else {
		t.st.ReloadsFailed++
	}
	t.one[0] = op.Block
	if op.Group == 0 && t.gpu.IsCached(op.Block) {
		// Not an access: the sequence that matched the block touched it.
		// (A companion is marked cached too, but is no node: the reload
		// holds a reference on it and no lock.)
		assertOK(t.cache.Release(t.one[:]), "complete copies: a reloaded cached block is not locked")
	}
	var err error
	t.cached, err = t.gpu.Decref(t.one[:], t.cached[:0])
	assertOK(err, "complete copies: a reloaded block is not referenced")
	if op.Group > 0 && len(t.cached) > 0 {
		t.groups.Released(op.Block)
	}
}

// endHostCopy ends the host side of a copy GPU block -> host slot (a
// demotion's or a write-through store's): the slot is committed, and
// queued for the shared tier when there is one (ok), or aborted (counted
// failed); with KV events the slot is announced or forgotten. It returns
// whether the slot was committed. With layer groups (groups.go), a
// group-0 slot whose node lost a full companion while the copy was in
// flight is aborted instead, neither failed nor announced (the copy was
// fine, the node useless); a full companion whose copy failed orphans its
// node.
func (t *Tier) endHostCopy(op DemoteOp, ok bool) bool {
	if ok && t.abandoned(op) {
		assertOK(t.cfg.Pool.Abort(op.Slot), "complete copies: aborting a host slot whose node lost a full companion")
		t.meta[op.Slot] = hostMeta{}
		return false
	}
	if ok {
		if t.shared != nil {
			t.shared.queueStore(op)
		} else {
			assertOK(t.cfg.Pool.Commit(op.Slot), "complete copies: committing a reserved host slot")
		}
		if t.events {
			t.meta[op.Slot].resident = true
			if op.Group > 0 {
				t.nCompanions++
			} else {
				t.nResident++
			}
		}
		return true
	}
	assertOK(t.cfg.Pool.Abort(op.Slot), "complete copies: aborting a reserved host slot")
	if t.events {
		t.meta[op.Slot] = hostMeta{}
		if op.Group == 0 {
			delete(t.orphans, op.Hash) // the slot it marked is gone
		} else {
			t.orphaned(op.Hash, op.Group, "complete copies")
		}
	}
	return false
}

// endDemotion ends one demotion: its host slot is committed (ok) or
// aborted, and its GPU block freed when the op holds it (held).
func (t *Tier) endDemotion(op DemoteOp, ok, held bool) {
	if t.endHostCopy(op, ok) {
		t.st.DemotionsCompleted++
	} else if !ok {
		t.st.DemotionsFailed++
	}
	if !held {
		return
	}
	t.one[0] = op.Block
	var err error
	t.cached, err = t.gpu.Decref(t.one[:], t.cached[:0])
	assertOK(err, "complete copies: a demoted block is not referenced")
}

// CompleteCopies reports that batch ticket's copies have finished (failed
// false) or failed: each demoted block's host slot is committed (aborted
// on failure), and queued for the shared tier when there is one (never
// waiting on it), and its GPU block returns to the free queue; each reload's
// host slot is unpinned and the copy's hold on its GPU block dropped. Errors:
// InvalidArgument (no host tier), NotFound (ticket unknown or completed
// already), with nothing changed.
func (t *Tier) CompleteCopies(ticket uint64, failed bool) error {
	b, ok := t.inflight[ticket]
	if !ok {
		return kverr.Errorf(kverr.NotFound, "complete copies: no batch %d in flight", ticket)
	}
	delete(t.inflight, ticket)
	t.gone = t.gone[:0]
	t.nBlocks -= len(b.Demote) - b.unheld - b.through
	t.nUnheld -= b.unheld
	moved := len(b.Demote) - b.through
	for i, op := range b.Demote {
		if i >= moved {
			t.endStore(op, !failed)
			continue
		}
		t.endDemotion(op, !failed, i >= b.unheld)
	}
	if t.events && !failed {
		// Announced parents first, so that a chain goes as one
		// BlockStored: the demotions are in eviction order (children
		// first), the stores after them in the order their blocks were
		// computed (parents first).
		for k := moved - 1; k >= 0; k-- {
			t.announceStored(b.Demote[k])
		}
		for _, op := range b.Demote[moved:] {
			t.announceStored(op)
		}
	}
	for _, op := range b.Reload {
		t.endReload(op, !failed)
	}
	t.recordGone("complete copies")
	return nil
}

// announceStored records the CPU BlockStored of a committed host copy;
// a companion (its node's block stands for it) or an aborted copy has
// none.
func (t *Tier) announceStored(op DemoteOp) {
	if op.Group > 0 || !t.meta[op.Slot].resident {
		return
	}
	blk := t.block(op.Slot)
	assertOK(t.cache.RecordTierStored(&blk), "complete copies: recording a committed host copy")
}

// recordGone records the BlockRemoved of the host blocks in t.gone (the
// group-0 slots that completions dropped with their nodes' full
// companions: groups.go), if any.
func (t *Tier) recordGone(op string) {
	if len(t.gone) > 0 {
		assertOK(t.cache.RecordTierRemoved(prefix.MediumCPU, t.gone), op+": recording host evictions")
	}
}

// MatchHost is MatchTiers' host part for one prompt (tokens, keys) whose
// first gpuTokens the GPU prefix cache holds: the tokens of the blocks
// the host tier holds under the prompt's next chained hashes
// (host.Pool.Lookup: touched in the host LRU, not pinned), never the
// block of its last token. fetched is what the call's Fetch fetched
// from the shared tier (counted in SharedStats.MatchTokens).
func (t *Tier) MatchHost(tokens []int32, keys *prefix.Keys, gpuTokens int, fetched Fetched) int {
	t.st.MatchQueries++
	t.st.MatchGPUTokens += int64(gpuTokens)
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / t.bs // full blocks short of the last token
	}
	gpuBlocks := gpuTokens / t.bs
	if limit <= gpuBlocks {
		return 0
	}
	t.chain(tokens, keys, limit, "match tiers: hashing a validated prompt")
	t.hostKeysFrom(gpuBlocks)
	hit := t.cfg.Pool.Lookup(t.keys)
	t.st.MatchHostTokens += int64(hit * t.bs)
	if k := t.countShared(fetched, hit); k > 0 {
		t.shared.matchTokens.Add(int64(k * t.bs))
	}
	return hit * t.bs
}

// Stats returns the host tier's counters.
func (t *Tier) Stats() Stats {
	st := t.st
	st.InFlight = t.nBlocks + t.nUnheld + len(t.evictOps)
	st.WriteThroughQueue = len(t.wt.queue)
	st.Host = t.cfg.Pool.Stats()
	if t.shared != nil {
		st.Shared = t.shared.stats()
	}
	return st
}

// Check verifies the host tier's part of the invariants: every block
// being demoted is InUse, not cached, with one reference, which refs (the
// sequences' references so far) is credited with; its host slot is
// reserved under the block's key.
func (t *Tier) Check(refs []int32, bad func(string, ...any) error) error {
	count := 0
	for _, op := range t.reloads {
		refs[op.Block]++
	}
	for _, op := range t.evictOps {
		if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != opKey(op) {
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
				// copy holds a reference and a lock on it; or a removal
				// dropped it with an uncomputed block above it (its lock
				// went with its node), and the copy's reference alone
				// holds it, private, until the copy completes.
				if h, ok := t.cache.BlockHash(b); t.gpu.IsCached(b) && (!ok || h != op.Hash) {
					return bad("block %d being stored (batch %d) is not cached under its hash %s", b, tk, op.Hash)
				}
				refs[b]++
				if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != opKey(op) {
					return bad("block %d being stored (batch %d): host slot %d does not hold its key", b, tk, op.Slot)
				}
				continue
			}
			if i < batch.unheld {
				// Holds no GPU block (DemoteEvicted), only its host slot.
				unheld++
				if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != opKey(op) {
					return bad("block %d's demotion (batch %d, unheld): host slot %d does not hold its key", b, tk, op.Slot)
				}
				continue
			}
			if t.gpu.IsCached(b) {
				return bad("block %d being demoted (batch %d) is marked cached", b, tk)
			}
			if _, ok := t.cache.BlockHash(b); ok {
				return bad("block %d being demoted (batch %d) is in the prefix cache", b, tk)
			}
			refs[b]++
			if k, ok := t.cfg.Pool.Hash(op.Slot); !ok || k != opKey(op) {
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
func (t *Tier) checkEvents(bad func(string, ...any) error) error {
	if !t.events {
		return nil
	}
	n, comps := 0, 0
	for s := range t.meta {
		if !t.meta[s].resident {
			continue
		}
		if t.meta[s].group > 0 {
			comps++
		} else {
			n++
		}
		if k, ok := t.cfg.Pool.Hash(host.Slot(s)); !ok || k != GroupKey(t.meta[s].hash, t.meta[s].group) {
			return bad("host slot %d is announced with block %s, the pool holds %016x (%v)", s, t.meta[s].hash, k, ok)
		}
		if _, marked := t.orphans[t.meta[s].hash]; t.groups != nil && t.meta[s].group == 0 && !marked && !t.whole(t.meta[s].hash) {
			return bad("host block %s is announced (slot %d) without a full companion in the host tier", t.meta[s].hash, s)
		}
	}
	for h := range t.orphans {
		if s, st := t.cfg.Pool.State(HostKey(h)); st == host.Absent || int(s) >= len(t.meta) || t.meta[s].group != 0 || t.meta[s].hash != h {
			return bad("node %s is marked orphaned, its group-0 host slot %d (%v) does not hold it", h, s, st)
		}
	}
	if res := t.cfg.Pool.Stats().Resident; n != t.nResident || comps != t.nCompanions || n+comps != res {
		return bad("%d host slots announced and %d companions', the counts say %d and %d, the pool holds %d resident", n, comps, t.nResident, t.nCompanions, res)
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

// PinHost matches a prompt's blocks beyond its first gpu matched ones in
// the host tier, pinning the matched slots (for QueueReloads), and
// returns how many. Never the block holding the prompt's last token.
// fetched is what the call's Fetch fetched from the shared tier (counted
// in SharedStats.HitTokens).
func (t *Tier) PinHost(tokens []int32, keys *prefix.Keys, gpu int, fetched Fetched) int {
	n := t.pinHost(tokens, keys, gpu)
	if k := t.countShared(fetched, n); k > 0 {
		t.shared.hitTokens.Add(int64(k * t.bs))
	}
	return n
}

// chain sets t.hashes to the chained hashes of the first limit full
// blocks of tokens, a validated prompt (what names the caller if the
// hasher fails all the same).
func (t *Tier) chain(tokens []int32, keys *prefix.Keys, limit int, what string) {
	var err error
	t.hashes, err = t.hasher.Chain(t.hashes[:0], tokens[:limit*t.bs], t.bs, keys)
	assertOK(err, what)
}

// hostKeysFrom sets t.keys to the host keys of t.hashes[from:].
func (t *Tier) hostKeysFrom(from int) {
	t.keys = t.keys[:0]
	for _, h := range t.hashes[from:] {
		t.keys = append(t.keys, HostKey(h))
	}
}

func (t *Tier) pinHost(tokens []int32, keys *prefix.Keys, gpu int) int {
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / t.bs
	}
	if limit <= gpu || t.cfg.Pool.Stats().Resident == 0 {
		return 0 // nothing to match: spare the hashing
	}
	t.chain(tokens, keys, limit, "admit: hashing a validated prompt")
	t.hostKeysFrom(gpu)
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

// QueueReloads records the reloads into blocks (fresh, as many as
// PinHost pinned) from the slots PinHost pinned, and takes the ops'
// references on them; LockReloads then takes their locks on those the
// prefix cache holds (once inserted).
func (t *Tier) QueueReloads(blocks []int32) {
	for j, b := range blocks {
		t.reloads = append(t.reloads, ReloadOp{Slot: t.slots[j], Block: b})
	}
	// Fresh blocks with one reference each.
	assertOK(t.gpu.Incref(blocks), "admit: referencing the reload's blocks")
	t.st.Reloads += int64(len(blocks))
	t.st.HostHitTokens += int64(len(blocks) * t.bs)
}

// LockReloads takes the reload ops' locks on those of blocks (the ones
// QueueReloads was given) that the prefix cache holds.
func (t *Tier) LockReloads(blocks []int32) {
	t.locks = t.locks[:0]
	for _, b := range blocks {
		if t.gpu.IsCached(b) {
			t.locks = append(t.locks, b)
		}
	}
	if len(t.locks) > 0 {
		assertOK(t.cache.Lock(t.locks), "admit: locking the reload's cached blocks")
	}
}
