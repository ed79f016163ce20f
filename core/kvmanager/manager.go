// Package kvmanager is the scheduler-facing KV cache manager: it keeps the
// block table of every live sequence over a paged block pool and answers the
// scheduler's per-step calls (add, grow, fork, remove, describe) in batches.
//
// A Manager is safe for concurrent use: one mutex serialises its calls.
//
// Terms used below:
//   - a sequence's length is its number of tokens; it holds
//     ceil(length / blockSize) blocks, its block table;
//   - slot s of the pool is row s % blockSize of block s / blockSize;
//   - a sequence's new tokens are the tokens of its most recent Add or Grow
//     call (a Grow by 0 makes them none, a forked child has none): the
//     tokens whose K/V the engine writes this step, whose slots Describe
//     reports.
//
// A hybrid model's manager has layer groups (Config.Groups): the block
// table above is group 0's, full attention; sliding-window and recurrent
// groups have tables of their own over the same pool (groups.go), which
// the prefix cache holds too (groupcache.go). An engine with a recurrent
// group in the prefix cache performs the copies of TakeCopies every step.
//
// Every call that fails changes nothing. An internal step documented as
// unable to fail is asserted, never discarded: its failure is a bug and
// panics with an Internal error, which the C ABI answers with
// KVP_ERR_INTERNAL; test builds (-race) check every invariant after every
// call that may change a manager (assert.go).
package kvmanager

import (
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/blocks"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

// Limits of the batched calls' arguments.
const (
	MaxBatch      = limits.Batch        // sequences in one Grow, Remove, Describe or Fork
	MaxGrowTokens = 1 << 24             // tokens added to one sequence by one Grow
	MaxPromptLen  = limits.PromptTokens // tokens of one Add
	// maxSlots bounds numBlocks * blockSize: slots are int32 in the C ABI.
	maxSlots = 1<<31 - 1
)

// DefaultBlockSize is the block size of a Config that leaves it 0.
const DefaultBlockSize = 16

// Config sizes a Manager's pool.
type Config struct {
	NumBlocks int // blocks in the pool, in [1, 2^26]
	BlockSize int // tokens per block, in [1, 2^16]; 1 is token-granular mode; 0 means DefaultBlockSize

	// EnablePrefixCache keeps the full blocks of sequences admitted with
	// their tokens (Admit, GrowTokens) in a prefix cache, shared by later
	// prompts with the same prefix and kept after their sequences finish,
	// until the pool needs them (prefix.go).
	EnablePrefixCache bool
	// EnableKVEvents records the prefix cache's KV events for DrainEvents
	// and, with layer groups, every group's for DrainGroupEvents
	// (groupcache.go, "KV events"); needs EnablePrefixCache.
	EnableKVEvents bool
	// MaxPendingEvents bounds the undrained KV events (0: the default of
	// package prefix); it is raised to NumBlocks plus the host tier's
	// slots plus 1, so that a snapshot fits.
	MaxPendingEvents int

	// HostTier, when not nil, adds the host tier below the GPU pool
	// (tier.go; needs EnablePrefixCache).
	HostTier *HostTier

	// Groups declares a hybrid model's layer groups over the one pool
	// (groups.go); nil or one FullAttention group: every layer keeps
	// every token's K/V.
	Groups []Group
	// BlockBytes is the bytes of one block in one layer slot, as the
	// engine lays it out (groups.go), in [0, 2^46]; needed with a
	// Recurrent group, whose state must fit.
	BlockBytes int64
	// MaxModelLen is the model's context limit in tokens, in [0, 2^30]
	// (0: not given); a SlidingWindow group's window must be below it.
	MaxModelLen int
}

// CopyPair is a KV block copy the engine must perform before the next kernel
// reads Dst: every row of block Src (all layers, K and V) into block Dst.
// Its layout (two int32) is the C ABI's kvp_block_copy.
type CopyPair struct{ Src, Dst int32 }

// Stats are a Manager's pool and fragmentation figures.
type Stats struct {
	NumBlocks      int     // pool size
	BlockSize      int     // tokens per block
	FreeBlocks     int     // in the free queue
	UsedBlocks     int     // referenced by at least one sequence
	PeakUsedBlocks int     // highest UsedBlocks since New
	CachedBlocks   int     // unreferenced blocks kept by the prefix cache
	SharedBlocks   int     // referenced by more than one sequence
	NumSeqs        int     // live sequences
	NumTokens      int64   // sum of the live sequences' lengths
	AllocatedSlots int64   // UsedBlocks * BlockSize (a shared block counts once)
	InternalWaste  int64   // empty slots in partially filled last blocks, once per block
	Fragmentation  float64 // InternalWaste / AllocatedSlots; 0 when nothing is allocated
}

// seq is one live sequence.
//
// Its fields fill one 64-byte cache line: a step walks hundreds of them.
type seq struct {
	blocks []int32 // block table: ceil(length / bs) block ids in order
	length int     // tokens
	fresh  int32   // new tokens: those of the latest Add or Grow (at most 2^30)
	// own is the index in blocks of the first block allocated for this
	// sequence: those before it were matched or forked from another. Only
	// a sequence's own blocks can be blocks it filled (computed.go).
	own   int32
	stamp uint64 // last batch that visited it (repeat detection)
	pc    *seqPrefix
	// grp holds the sequence's tables in layer groups 1.. (groups.go); nil
	// without groups.
	grp *seqGroups
}

// seqGroups is a sequence's tables in layer groups 1..
type seqGroups struct{ t []groupTable }

// extra returns s's tables in layer groups 1.. (nil without groups).
func (s *seq) extra() []groupTable {
	if s.grp == nil {
		return nil
	}
	return s.grp.t
}

// Manager manages the block tables of live sequences over one block pool.
type Manager struct {
	mu   sync.Mutex
	pool *blocks.Pool
	bs   int
	seqs seqIndex

	// Running totals, so Stats is O(1).
	numTokens int64
	waste     int64

	// The last batch resolved by Grow, Describe or Remove: its ids and
	// their sequences (memo.seqs is also the scratch every resolution
	// writes into). A scheduler calls Grow and Describe with the same batch
	// every step and the batch changes only when requests join or leave, so
	// comparing ids with the memo (a linear scan) replaces most index
	// lookups (about 1 us of a 256-sequence step). Valid while
	// len(memo.ids) > 0; Remove
	// clears it, so it never refers to a removed sequence (Add and Fork
	// leave the sequences it names live).
	memo struct {
		ids  []int64
		seqs []*seq
	}

	// The prefix cache's index; nil when the cache is off.
	cache *prefix.Index
	// The host tier; nil when there is none.
	tier *kvtier.Tier
	// KV events drained from the index that the caller's buffers could not
	// hold yet (DrainEvents).
	carry []prefix.Event

	// Scratch reused by every call (under mu), so the per-step calls do not
	// allocate.
	stamp   uint64
	ids     []int64
	cached  []int32
	evicted []int32
	locks   []int32
	// lastPeek: group 0's cached prefix, in blocks, of the last prompt
	// matchPrompt matched with layer groups (MatchTiers' host part, MatchBlocks).
	lastPeek int
	inserted []prefix.InsertResult
	one      [1]int32
	dropped  []prefix.DroppedBlock
	uncomp   map[int32]int32

	// committed is set by the first MarkComputed: a drop of uncomputed
	// blocks before it is logged as a likely missing call (computed.go).
	committed bool
	warned    bool

	// The layer groups past group 0 (groups.go), and their blocks in the
	// prefix cache (groupcache.go; nil without the cache or groups). Last,
	// so that the fields every step reads keep their places.
	groups groupSet
	gc     *groupCache
	queued []CopyPair // copies for the engine's next TakeCopies (groupcache.go)
	drops  []int32    // scratch: the blocks a Grow's windows drop
}

// New returns a Manager with an empty pool. NumBlocks must be in
// [1, 2^26], BlockSize in [1, 2^16], and NumBlocks*BlockSize below 2^31 so
// that every slot fits in an int32.
func New(cfg Config) (*Manager, error) {
	if cfg.BlockSize == 0 {
		cfg.BlockSize = DefaultBlockSize
	}
	p, err := blocks.New(cfg.NumBlocks, cfg.BlockSize)
	if err != nil {
		return nil, err
	}
	if int64(cfg.NumBlocks)*int64(cfg.BlockSize) > maxSlots {
		return nil, kverr.Errorf(kverr.InvalidArgument,
			"num_blocks * block_size must be below 2^31 so slots fit in int32: got %d * %d", cfg.NumBlocks, cfg.BlockSize)
	}
	if cfg.EnableKVEvents && !cfg.EnablePrefixCache {
		return nil, kverr.Errorf(kverr.InvalidArgument, "KV events need the prefix cache: set enable_prefix_cache too")
	}
	gs, err := newGroupSet(&cfg)
	if err != nil {
		return nil, err
	}
	m := &Manager{pool: p, bs: cfg.BlockSize, groups: gs}
	if cfg.EnablePrefixCache {
		tierBlocks := 0
		if cfg.HostTier != nil {
			tierBlocks = cfg.HostTier.NumSlots()
		}
		m.cache, err = prefix.New(prefix.Config{
			BlockSize:        cfg.BlockSize,
			NumBlocks:        cfg.NumBlocks,
			EnableEvents:     cfg.EnableKVEvents,
			MaxPendingEvents: cfg.MaxPendingEvents,
			TierBlocks:       tierBlocks,
		})
		if err != nil {
			return nil, err
		}
		if len(gs.extra) > 0 {
			m.gc = newGroupCache(cfg.NumBlocks, &m.groups)
			if cfg.EnableKVEvents {
				// Every group's cached blocks are announced (groupcache.go,
				// "KV events") and listed by snapshots.
				m.gc.events = true
				m.cache.SetGroupSource(m.gc)
			}
		}
	}
	if cfg.HostTier != nil {
		// The host tier's blocks are announced as CPU events and listed
		// by snapshots with KV events on (core/kvtier, "KV events"); with
		// a shared tier, its store goroutine runs until Close.
		gpu := kvtier.GPU{Pool: p, Cache: m.cache, Lock: tierLock{m}, Events: cfg.EnableKVEvents}
		if m.gc != nil {
			gpu.Groups = tierGroups{m} // grouptier.go
		}
		if m.tier, err = kvtier.New(*cfg.HostTier, gpu); err != nil {
			return nil, err
		}
	}
	logx.L().Debug("kv manager created", zap.Int("num_blocks", cfg.NumBlocks), zap.Int("block_size", cfg.BlockSize),
		zap.Bool("prefix_cache", cfg.EnablePrefixCache), zap.Bool("kv_events", cfg.EnableKVEvents))
	return m, nil
}

// BlockSize returns the tokens per block.
func (m *Manager) BlockSize() int { return m.bs }

func (m *Manager) blocksFor(tokens int) int { return (tokens + m.bs - 1) / m.bs }

// wasteOf is the number of empty slots in s's last block. A partially filled
// last block is never shared (Fork copies it), so summing this over
// sequences counts each such block once.
// Every attention group's last block has the same empty slots.
func (m *Manager) wasteOf(s *seq) int64 {
	return int64(len(s.blocks)*m.bs-s.length) * int64(m.groups.attn)
}

// resolve returns the live sequences of ids, in order. A repeated id fails
// with DuplicateSequence unless allowRepeat; an id that is not live fails
// with UnknownSequence. The result is only valid until the next call that
// resolves or removes: callers must not keep it.
func (m *Manager) resolve(op string, ids []int64, allowRepeat bool) ([]*seq, error) {
	if len(m.memo.ids) > 0 && slices.Equal(ids, m.memo.ids) {
		return m.memo.seqs, nil // a memoised batch has no repeats
	}
	m.clearMemo()
	if cap(m.memo.seqs) < len(ids) {
		m.memo.seqs = make([]*seq, len(ids))
	}
	batch := m.memo.seqs[:len(ids)]
	m.stamp++
	repeated := false
	for i, id := range ids {
		s := m.seqs.get(id)
		if s == nil {
			clear(batch[:i])
			return nil, kverr.Errorf(kverr.UnknownSequence, "%s: sequence %d is not live", op, id)
		}
		if s.stamp == m.stamp {
			if !allowRepeat {
				clear(batch[:i])
				return nil, kverr.Errorf(kverr.DuplicateSequence, "%s: sequence %d appears twice in the batch", op, id)
			}
			repeated = true
		}
		s.stamp = m.stamp
		batch[i] = s
	}
	m.memo.seqs = batch
	if !repeated {
		m.memo.ids = append(m.memo.ids[:0], ids...)
	}
	return batch, nil
}

// clearMemo forgets the memoised batch and drops its sequence pointers.
func (m *Manager) clearMemo() {
	m.memo.ids = m.memo.ids[:0]
	clear(m.memo.seqs)
}

func checkBatch(op string, n int) error {
	if n < 1 || n > MaxBatch {
		return kverr.Errorf(kverr.InvalidArgument, "%s: batch size must be in [1, %d]: got %d", op, MaxBatch, n)
	}
	return nil
}

// neverFits returns the InvalidArgument error of a prompt of n tokens that
// needs more blocks than the whole pool has: no eviction or finished
// sequence can make room for it, so "not now" (OutOfBlocks, or Admit's
// short count) would have a scheduler retry it forever.
func (m *Manager) neverFits(op string, id int64, n int) error {
	if need := m.groups.perSeq(m.blocksFor(n)); need > int64(m.pool.NumBlocks()) {
		return kverr.Errorf(kverr.InvalidArgument, "%s: sequence %d's prompt of %d tokens needs %d blocks of %d tokens; the whole pool holds %d, so it can never be admitted",
			op, id, n, need, m.bs, m.pool.NumBlocks())
	}
	return nil
}

// Add admits sequence id with a prompt of promptLen tokens, in
// [1, MaxPromptLen], and allocates its ceil(promptLen / blockSize) blocks:
// from the head of the pool's free queue, contiguously while the following
// ids are free (one run in an unfragmented pool). The prompt's tokens are the
// sequence's new tokens.
// Errors: InvalidArgument (promptLen, or more blocks than the whole pool
// has), DuplicateSequence (id is live), OutOfBlocks.
func (m *Manager) Add(id int64, promptLen int) error {
	if promptLen < 1 || promptLen > MaxPromptLen {
		return kverr.Errorf(kverr.InvalidArgument, "add: prompt length must be in [1, 2^30]: got %d", promptLen)
	}
	if err := m.neverFits("add", id, promptLen); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.unlock()
	if m.seqs.get(id) != nil {
		return kverr.Errorf(kverr.DuplicateSequence, "add: sequence %d is already live", id)
	}
	nb := m.blocksFor(promptLen)
	need := m.groups.perSeq(nb)
	if avail := m.available(); need > avail {
		return kverr.Errorf(kverr.OutOfBlocks, "add: sequence %d needs %d blocks for %d tokens, %s", id, need, promptLen, m.availableText())
	}
	m.makeFree(int(need))
	s := &seq{length: promptLen, fresh: int32(promptLen), blocks: newTable(nb, nil)}
	m.allocate(s.blocks, -1, "add: allocating blocks made free")
	s.grp = m.newExtra(nb)
	m.allocExtra(s, 0, s.blocks[nb-1])
	m.seqs.put(id, s)
	m.numTokens += int64(promptLen)
	m.waste += m.wasteOf(s)
	return nil
}

// newTable returns a block table of n blocks with headroom for decoding,
// so that the first n/4 blocks of growth do not reallocate it, holding
// first before the rest.
func newTable(n int, first []int32) []int32 {
	t := make([]int32, n, n+max(4, n/4))
	copy(t, first)
	return t
}

// available returns how many blocks an allocation can have now: the free
// ones and, with the prefix cache, the cached ones it can evict.
func (m *Manager) available() int64 {
	a := int64(m.pool.NumFree())
	if m.gc != nil {
		// An evictable node frees its full groups' companions with it;
		// listed window companions go on their own (groupcache.go).
		return a + int64(m.cache.Evictable())*int64(1+m.gc.fullExtra) + int64(m.gc.listed)
	}
	if m.cache != nil {
		a += int64(m.cache.Evictable())
	}
	return a
}

// availableText says what available counts, for OutOfBlocks messages.
func (m *Manager) availableText() string {
	if m.cache == nil {
		return fmt.Sprintf("%d are free", m.pool.NumFree())
	}
	if m.gc != nil {
		return fmt.Sprintf("%d are free, %d cached blocks evictable (with their groups' blocks) and %d window blocks", m.pool.NumFree(), m.cache.Evictable(), m.gc.listed)
	}
	return fmt.Sprintf("%d are free and %d cached blocks evictable", m.pool.NumFree(), m.cache.Evictable())
}

// makeFree evicts cached blocks until need blocks are free. The caller has
// checked need <= available(), so that a call that cannot be satisfied
// fails before anything is evicted.
func (m *Manager) makeFree(need int) {
	short := need - m.pool.NumFree()
	if short <= 0 || m.cache == nil {
		return
	}
	if m.gc != nil {
		m.makeFreeGroups(short)
		return
	}
	if m.tier != nil && m.tier.EvictForAlloc(short) {
		return // demotes what it evicted (HostTier.DemoteEvicted)
	}
	m.evicted = m.cache.Evict(m.evicted[:0], short)
	if m.tier != nil {
		m.tier.Evicted(len(m.evicted))
	}
	// An evictable block has no lock, hence no reference (CheckInvariants:
	// locks equal references), and is marked, so it is Cached in the pool.
	assertOK(m.pool.Evict(m.evicted), "evicted blocks are not Cached in the pool")
}

// Grow adds counts[i] tokens, in [0, MaxGrowTokens], to each sequence ids[i]
// and allocates the blocks they need, each sequence's new blocks continuing
// its last block's run when those ids are free. The batch has
// len(ids) == len(counts) in [1, MaxBatch] and no id twice. All or none: if
// the batch needs more blocks in total than are free, Grow returns
// OutOfBlocks (saying how many were needed and free) and no sequence grows.
// On success the counts become the sequences' new tokens (a count of 0 makes
// them none).
// Errors, checked in this order: InvalidArgument (batch size, a count),
// UnknownSequence, DuplicateSequence (an id twice), OutOfBlocks.
func (m *Manager) Grow(ids []int64, counts []int32) error {
	return m.grow("grow", ids, counts, nil)
}

// grow is Grow, and GrowTokens when tokens is not nil (the sequences' new
// tokens in batch order, sum(counts) of them).
func (m *Manager) grow(op string, ids []int64, counts []int32, tokens []int32) error {
	if err := checkBatch(op, len(ids)); err != nil {
		return err
	}
	if len(counts) != len(ids) {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d counts for %d sequences", op, len(counts), len(ids))
	}
	var total int64
	for i, c := range counts {
		if c < 0 || c > MaxGrowTokens {
			return kverr.Errorf(kverr.InvalidArgument, "%s: token count for sequence %d must be in [0, 2^24]: got %d", op, ids[i], c)
		}
		total += int64(c)
	}
	if tokens != nil && int64(len(tokens)) != total {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d tokens given, the counts add up to %d", op, len(tokens), total)
	}
	m.mu.Lock()
	defer m.unlock()
	batch, err := m.resolve(op, ids, false)
	if err != nil {
		return err
	}
	var need int64
	for i, s := range batch {
		need += int64(m.newBlocks(s, int(counts[i])))
	}
	need *= int64(m.groups.attn)
	// Window groups drop what their next queries cannot read before the
	// batch allocates: the blocks they free count as available.
	var drops bool
	var freed int
	if m.groups.windowed {
		drops, freed = m.windowDrops(batch)
	}
	if avail := m.available() + int64(freed); need > avail {
		return kverr.Errorf(kverr.OutOfBlocks, "grow: the batch needs %d new blocks, %s", need, m.availableText())
	}
	if drops {
		m.applyDrops(batch)
	}
	m.makeFree(int(need))
	var added, slots int64 // tokens added, slots allocated (one group's)
	for i, s := range batch {
		c := int(counts[i])
		if add := m.newBlocks(s, c); add > 0 {
			old := len(s.blocks)
			s.blocks = slices.Grow(s.blocks, add)[:old+add]
			// The batch's total was made free above.
			m.allocate(s.blocks[old:], s.blocks[old-1], "grow: allocating blocks made free")
			if s.grp != nil {
				m.growExtra(s, add)
			}
			slots += int64(add * m.bs)
		}
		if tokens != nil {
			m.extendPrefix(s, tokens[:c])
			tokens = tokens[c:]
		} else if c > 0 {
			s.pc = nil // tokens unknown: the blocks from here on are private
		}
		s.length += c
		s.fresh = int32(c)
		added += int64(c)
	}
	if m.gc != nil && m.groups.states > 0 { // only recurrent groups take checkpoints
		for i, s := range batch {
			m.noteCheckpoint(ids[i], s)
		}
	}
	m.numTokens += added
	// Every attention group's last block has the same empty slots.
	m.waste += (slots - added) * int64(m.groups.attn)
	return nil
}

// newBlocks returns how many blocks s needs to hold c more tokens. It
// divides only when the tokens overflow the last block, so a decode step
// (one token) mostly does not.
func (m *Manager) newBlocks(s *seq, c int) int {
	room := len(s.blocks)*m.bs - s.length
	if c <= room {
		return 0
	}
	return (c - room + m.bs - 1) / m.bs
}

// Fork creates the sequences children, copies of the live sequence parent
// (parallel sampling, beam search). Each child references all of the parent's
// full blocks. If the parent's last block is partially filled, each child
// gets a newly allocated block in its place (copy-on-write done eagerly, as
// every child writes its next token there), and CopyPair{Src: parent's last
// block, Dst: the child's} is written to copies[i] for child i; Fork returns
// the number of pairs written (0 or len(children)). Children have the
// parent's length and no new tokens.
// All or none. Errors: InvalidArgument (len(children) not in [1, MaxBatch]),
// UnknownSequence (parent), DuplicateSequence (a child is live or repeated),
// BufferTooSmall (len(copies) < len(children) while copies are needed),
// OutOfBlocks.
func (m *Manager) Fork(parent int64, children []int64, copies []CopyPair) (n int, err error) {
	if err := checkBatch("fork", len(children)); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.unlock()
	p := m.seqs.get(parent)
	if p == nil {
		return 0, kverr.Errorf(kverr.UnknownSequence, "fork: parent sequence %d is not live", parent)
	}
	if err := m.checkNewIDs("fork", "child sequence", children); err != nil {
		return 0, err
	}
	partial := p.length%m.bs != 0
	full := len(p.blocks)
	if partial {
		full--
	}
	// Each child needs a new block, and a copy, for each partial last
	// block (one per attention group) and each recurrent state.
	perChild := m.forkCopies(partial)
	if perChild > 0 {
		if need := len(children) * perChild; len(copies) < need {
			return 0, kverr.Errorf(kverr.BufferTooSmall,
				"fork: %d block copies are needed; copies holds %d (per child: the parent's partial last block in each attention group, and each recurrent state)", need, len(copies))
		}
		if need := int64(len(children) * perChild); need > m.available() {
			return 0, kverr.Errorf(kverr.OutOfBlocks, "fork: %d children need %d new blocks, %s", len(children), need, m.availableText())
		}
	}
	// Each child adds one reference to each full block; refuse up front a
	// count past int32 (unreachable in practice: 2^31 live sequences), so
	// the Incref below cannot fail half way.
	for _, b := range p.blocks[:full] {
		if int64(m.pool.Ref(b))+int64(len(children)) > math.MaxInt32 {
			return 0, kverr.Errorf(kverr.InvalidArgument, "fork: block %d would pass 2^31-1 references", b)
		}
	}
	if perChild > 0 {
		m.makeFree(len(children) * perChild)
	}
	// The parent's cached blocks get one lock per child, as they get one
	// reference (locks equal references for cached blocks, and a cached
	// block's lock count is bounded like its reference count above).
	m.locks = m.cachedOf(p.blocks[:full], m.locks[:0])
	for _, id := range children {
		c := &seq{blocks: make([]int32, len(p.blocks)), length: p.length, pc: p.pc.clone(), own: int32(full)}
		copy(c.blocks, p.blocks[:full])
		// Live blocks, their counts bounded above; the locks' likewise.
		assertOK(m.pool.Incref(c.blocks[:full]), "fork: referencing the parent's blocks")
		if len(m.locks) > 0 {
			assertOK(m.cache.Lock(m.locks), "fork: locking the parent's cached blocks")
		}
		if partial {
			last := p.blocks[full]
			hint := int32(-1)
			if full > 0 {
				hint = p.blocks[full-1]
			}
			// The free count was checked and made free above.
			m.allocate(c.blocks[full:], hint, "fork: allocating the copy-on-write blocks")
			copies[n] = CopyPair{Src: last, Dst: c.blocks[full]}
			n++
		}
		n += m.forkExtra(p, c, partial, copies[n:])
		m.seqs.put(id, c)
		m.numTokens += int64(c.length)
		m.waste += m.wasteOf(c)
	}
	return n, nil
}

// checkNewIDs fails with DuplicateSequence if an id of a batch of new
// sequences (what names them in the message) is live or repeated.
func (m *Manager) checkNewIDs(op, what string, ids []int64) error {
	for _, id := range ids {
		if m.seqs.get(id) != nil {
			return kverr.Errorf(kverr.DuplicateSequence, "%s: %s %d is already live", op, what, id)
		}
	}
	if len(ids) > 1 {
		sorted := append(m.ids[:0], ids...)
		m.ids = sorted
		slices.Sort(sorted)
		for i := 1; i < len(sorted); i++ {
			if sorted[i] == sorted[i-1] {
				return kverr.Errorf(kverr.DuplicateSequence, "%s: %s %d appears twice", op, what, sorted[i])
			}
		}
	}
	return nil
}

// Remove retires the sequences ids and releases their block references;
// blocks no other sequence references return to the pool. The batch has
// len(ids) in [1, MaxBatch]. All or none: an unknown id (a double remove
// included) or an id twice in the batch fails the call and removes nothing.
//
// The blocks a removed sequence filled since the last MarkComputed leave
// the prefix cache (computed.go): no forward pass computed their K/V. If
// a live sequence outside the batch shares one of them (it matched them
// or was forked from the sequence since), Remove fails with InUse,
// naming it: remove the two in one batch, or after MarkComputed.
// Errors: InvalidArgument, UnknownSequence, DuplicateSequence, InUse.
func (m *Manager) Remove(ids []int64) error {
	if err := checkBatch("remove", len(ids)); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.unlock()
	batch, err := m.resolve("remove", ids, false)
	if err != nil {
		return err
	}
	defer m.clearMemo()
	uncomputed, err := m.uncomputedOf(ids, batch)
	if err != nil {
		return err
	}
	for i, s := range batch {
		m.release(s)
		m.numTokens -= int64(s.length)
		m.waste -= m.wasteOf(s)
		m.seqs.del(ids[i])
	}
	if len(uncomputed) > 0 {
		m.dropUncomputed(uncomputed)
	}
	return nil
}

// release drops a retired sequence's block references, and its locks on
// the cached ones: cached blocks that lose their last reference stay
// Cached in the pool, evictable by the prefix cache, instead of returning
// to the free queue.
func (m *Manager) release(s *seq) {
	if m.cache != nil {
		m.locks = m.cachedOf(s.blocks, m.locks[:0])
		if len(m.locks) > 0 {
			// Locks equal references for cached blocks.
			assertOK(m.cache.Unlock(m.locks), "a sequence's cached blocks are not locked")
		}
	}
	// A live sequence holds a reference on each of its blocks
	// (CheckInvariants verifies it).
	var err error
	m.cached, err = m.pool.Decref(s.blocks, m.cached[:0])
	assertOK(err, "a sequence's blocks are not referenced")
	m.releaseExtra(s)
}

// cachedOf appends to dst the blocks of ids that the prefix cache holds.
func (m *Manager) cachedOf(ids []int32, dst []int32) []int32 {
	if m.cache == nil {
		return dst
	}
	for _, b := range ids {
		if m.pool.IsCached(b) {
			dst = append(dst, b)
		}
	}
	return dst
}

// Describe writes the state of the batch ids (len in [1, MaxBatch]; an id may
// repeat) into caller buffers, in batch order:
//   - table, if not nil: [len(ids)][maxBlocks] int32 row-major (len(table)
//     >= len(ids)*maxBlocks, maxBlocks >= 1); row i is ids[i]'s block ids in
//     order, padded with -1;
//   - seqLens, if not nil (len >= len(ids)): each sequence's length;
//   - slots, if not nil: the slot of each new token of each sequence,
//     sequences in batch order, tokens in position order. A non-nil slice of
//     length 0 asks for slots with no room for any.
//
// It returns the number of slots (computed even when slots is nil, so a
// caller can size the buffer). Describe is read-only: calling it twice gives
// the same answer.
// Errors, with nothing written: InvalidArgument (batch size, maxBlocks < 1
// with a table), UnknownSequence, BufferTooSmall (a sequence has more than
// maxBlocks blocks, table or seqLens shorter than the batch needs, or more
// new tokens in all than len(slots)).
func (m *Manager) Describe(ids []int64, maxBlocks int, table, seqLens, slots []int32) (numSlots int, err error) {
	n := len(ids)
	if err := checkBatch("describe", n); err != nil {
		return 0, err
	}
	if err := checkDescribe("describe", "block table", n, maxBlocks, table, seqLens); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	batch, total, err := m.describeBatch("describe", ids, maxBlocks, table != nil)
	if err != nil {
		return 0, err
	}
	if slots != nil && total > len(slots) {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "describe: the batch has %d new tokens, slot_mapping holds %d", total, len(slots))
	}
	// One pass over the batch, so each sequence is loaded once.
	bs := int32(m.bs)
	k := 0
	for i, s := range batch {
		if table != nil {
			row := table[i*maxBlocks : (i+1)*maxBlocks]
			fillNoBlock(row[copy(row, s.blocks):])
		}
		if seqLens != nil {
			seqLens[i] = int32(s.length)
		}
		if slots != nil {
			if s.fresh == 1 { // a decode step: the last token
				last := len(s.blocks) - 1
				slots[k] = s.blocks[last]*bs + int32(s.length-1-last*m.bs)
				k++
			} else {
				k += m.writeSlots(s.blocks, s.length, int(s.fresh), slots[k:])
			}
		}
	}
	return total, nil
}

// checkDescribe checks a describe call's buffers for a batch of n: a block
// table (nil: not wanted; what names it) of n rows of maxBlocks, and
// seqLens (nil: not wanted) of n.
func checkDescribe(op, what string, n, maxBlocks int, table, seqLens []int32) error {
	if table != nil {
		if maxBlocks < 1 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: max_blocks must be >= 1 with a block table: got %d", op, maxBlocks)
		}
		if int64(len(table)) < int64(n)*int64(maxBlocks) {
			return kverr.Errorf(kverr.BufferTooSmall, "%s: %s holds %d entries, %d x %d needed", op, what, len(table), n, maxBlocks)
		}
	}
	if seqLens != nil && len(seqLens) < n {
		return kverr.Errorf(kverr.BufferTooSmall, "%s: seq_lens holds %d entries for %d sequences", op, len(seqLens), n)
	}
	return nil
}

// describeBatch resolves a describe call's batch (under m.mu; an id may
// repeat) and returns it with its new tokens, refusing a sequence of more
// than maxBlocks blocks when a table is wanted.
func (m *Manager) describeBatch(op string, ids []int64, maxBlocks int, table bool) ([]*seq, int, error) {
	batch, err := m.resolve(op, ids, true)
	if err != nil {
		return nil, 0, err
	}
	total := 0
	for i, s := range batch {
		if table && len(s.blocks) > maxBlocks {
			return nil, 0, kverr.Errorf(kverr.BufferTooSmall, "%s: sequence %d has %d blocks, max_blocks is %d", op, ids[i], len(s.blocks), maxBlocks)
		}
		total += int(s.fresh)
	}
	return batch, total, nil
}

// noBlocks is a run of -1 (no block) that fillNoBlock copies from.
var noBlocks = func() *[1024]int32 {
	var a [1024]int32
	for i := range a {
		a[i] = -1
	}
	return &a
}()

// fillNoBlock sets every entry of dst to -1 with memory copies, which move
// many entries an instruction: the padding of a decode step's block table
// is most of the table when max_blocks fits the longest sequence and the
// others are shorter (tens of thousands of entries a step for 256 rows of
// 300, which one store each made about half of the step's time).
func fillNoBlock(dst []int32) {
	if len(dst) < 16 {
		// A few entries: stores beat the copy call.
		for i := range dst {
			dst[i] = -1
		}
		return
	}
	for len(dst) > 0 {
		dst = dst[copy(dst, noBlocks[:]):]
	}
}

// writeSlots writes to dst the slots, in table, of the fresh new tokens of
// a sequence of length tokens, and returns how many. It walks block by
// block, so it divides once per sequence, not per token.
func (m *Manager) writeSlots(table []int32, length, fresh int, dst []int32) int {
	if fresh == 0 {
		return 0
	}
	bs := int32(m.bs)
	// Start from the last block, which holds inLast tokens: a decode step's
	// tokens are there, and then no division is needed.
	bi := len(table) - 1
	inLast := length - bi*m.bs
	off := int32(inLast - fresh)
	if fresh > inLast {
		pos := length - fresh
		bi, off = pos/m.bs, int32(pos%m.bs)
	}
	dst = dst[:fresh]
	base := table[bi] * bs
	for k := range dst {
		dst[k] = base + off
		if off++; off == bs {
			off = 0
			if bi++; bi < len(table) {
				base = table[bi] * bs
			}
		}
	}
	return len(dst)
}

// Stats returns the manager's figures at the time of the call. O(1).
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	ps := m.pool.Stats()
	st := Stats{
		NumBlocks:      ps.Total,
		BlockSize:      m.bs,
		FreeBlocks:     ps.Free,
		UsedBlocks:     ps.InUse,
		PeakUsedBlocks: ps.PeakInUse,
		CachedBlocks:   ps.Cached,
		SharedBlocks:   ps.Shared,
		NumSeqs:        m.seqs.len(),
		NumTokens:      m.numTokens,
		AllocatedSlots: int64(ps.InUse) * int64(m.bs),
		InternalWaste:  m.waste,
	}
	if st.AllocatedSlots > 0 {
		st.Fragmentation = float64(st.InternalWaste) / float64(st.AllocatedSlots)
	}
	return st
}

// CheckInvariants verifies the pool's invariants and that the block tables
// agree with it: every sequence holds ceil(length / blockSize) in-use blocks,
// no block twice; each block's reference count equals the number of
// sequences holding it; a partially filled last block is not shared; the
// token and waste totals match; with the prefix cache, the cache's own
// invariants and those of prefix.go. O(numBlocks + total blocks held). It returns
// the first violation found, with code Internal.
func (m *Manager) CheckInvariants() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.checkInvariants(true)
}

// checkInvariants is CheckInvariants under m.mu; without hashes, the
// prefix cache's blocks are not rehashed (prefix.Index.CheckStructure),
// which is the per-call check's saving.
func (m *Manager) checkInvariants(hashes bool) error {
	if err := m.pool.CheckInvariants(); err != nil {
		return err
	}
	bad := func(format string, args ...any) error {
		return kverr.Errorf(kverr.Internal, "kv manager: "+format, args...)
	}
	refs := make([]int32, m.pool.NumBlocks())
	pins := make([]int32, m.pool.NumBlocks()) // the references queued copies hold
	for _, p := range m.queued {
		pins[p.Src]++
		pins[p.Dst]++
	}
	var tokens, waste int64
	for id, s := range m.seqs.all() {
		if s.length < 1 || len(s.blocks) != m.blocksFor(s.length) {
			return bad("sequence %d has length %d and %d blocks (block size %d)", id, s.length, len(s.blocks), m.bs)
		}
		if s.fresh < 0 || int(s.fresh) > s.length {
			return bad("sequence %d has %d new tokens of %d", id, s.fresh, s.length)
		}
		if s.own < 0 || int(s.own) > len(s.blocks) {
			return bad("sequence %d's own blocks start at %d of %d", id, s.own, len(s.blocks))
		}
		for _, b := range s.blocks {
			if m.pool.State(b) != blocks.InUse {
				return bad("sequence %d holds block %d in state %s", id, b, m.pool.State(b))
			}
			refs[b]++
		}
		if s.length%m.bs != 0 {
			if last := s.blocks[len(s.blocks)-1]; m.pool.Ref(last) != 1 {
				return bad("sequence %d's partial last block %d has ref %d", id, last, m.pool.Ref(last))
			}
		}
		if pc := s.pc; pc != nil {
			if len(pc.tail) != s.length%m.bs {
				return bad("sequence %d of length %d keeps %d tail tokens (block size %d)", id, s.length, len(pc.tail), m.bs)
			}
			full := s.length / m.bs
			if full == 0 && !pc.last.IsZero() {
				return bad("sequence %d has no full block but chain hash %s", id, pc.last)
			}
			if full > 0 {
				if h, ok := m.cache.BlockHash(s.blocks[full-1]); ok && h != pc.last {
					return bad("sequence %d's last full block %d is cached as %s, the sequence's chain says %s", id, s.blocks[full-1], h, pc.last)
				}
			}
		}
		if err := m.checkGroups(id, s, refs, pins, bad); err != nil {
			return err
		}
		tokens += int64(s.length)
		waste += m.wasteOf(s)
	}
	if err := m.checkTier(refs, bad); err != nil {
		return err
	}
	for b, p := range pins {
		refs[b] += p
	}
	for b, r := range refs {
		if got := m.pool.Ref(int32(b)); got != r {
			return bad("block %d has ref %d, held by %d sequence references", b, got, r)
		}
	}
	if m.cache != nil {
		check := m.cache.CheckStructure
		if hashes {
			check = m.cache.CheckInvariants
		}
		if err := check(); err != nil {
			return err
		}
		if err := m.checkGroupCache(pins, bad); err != nil {
			return err
		}
		for b := range refs {
			id := int32(b)
			_, indexed := m.cache.BlockHash(id)
			companion := m.gc != nil && m.gc.owner[id] != NoBlock
			if indexed == companion && indexed || (indexed || companion) != m.pool.IsCached(id) {
				return bad("block %d: in the prefix cache %v, a cached companion %v, marked cached in the pool %v", b, indexed, companion, m.pool.IsCached(id))
			}
			if indexed && m.cache.LockCount(id) != m.pool.Ref(id) {
				return bad("cached block %d has %d locks and %d references", b, m.cache.LockCount(id), m.pool.Ref(id))
			}
			if m.cache.IsPending(id) && m.pool.Ref(id) == 0 {
				return bad("block %d is cached uncomputed with no sequence to compute it", b)
			}
		}
	}
	if tokens != m.numTokens || waste != m.waste {
		return bad("totals say %d tokens and %d waste, sequences say %d and %d", m.numTokens, m.waste, tokens, waste)
	}
	return nil
}
