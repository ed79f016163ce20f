package kvmanager

import (
	"math"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

// The prefix cache in the manager.
//
// A sequence admitted with its tokens (Admit) starts on the blocks of its
// longest cached prefix and inserts each of its other blocks into the cache
// as soon as the block is full, whether by Admit or by GrowTokens. Its
// blocks are then shared by every later prompt with the same prefix, and
// they stay cached after the sequence is removed, until an allocation
// needs them: Add, Admit, Grow and Fork evict cached blocks nobody
// references (package prefix decides which) when the free queue runs
// short, and fail with nothing evicted when free and evictable blocks
// together are not enough.
//
// Two invariants tie the pool and the cache (CheckInvariants verifies them):
// a block is marked Cached in the pool exactly when the cache holds it, and
// a cached block's lock count in the cache equals its reference count in
// the pool (every reference is a sequence's, and each takes a lock). So a
// cached block becomes evictable exactly when no live sequence holds it.
//
// A block is cached as soon as the call that fills it returns, before the
// engine computes its KV. A sequence admitted later, even within the same
// step, may thus start on it: correct for an engine that writes every new
// token's K and V of a layer before that layer's attention reads the cache,
// as paged engines do, for the whole step at once. An engine that runs a
// step's sequences in separate forward passes must run them in admission
// order.

// seqPrefix is what a sequence needs to insert its blocks as they fill:
// while its tokens are known (from Admit and GrowTokens) it has one; a
// Grow without tokens drops it, and the sequence's later blocks stay
// private.
type seqPrefix struct {
	keys *prefix.Keys // the prompt's extra keys, the sequence's own copy; nil: none
	last prefix.Hash  // chain hash of the last full block; zero when none
	tail []int32      // tokens of the partially filled last block
}

// clone returns a forked child's copy; nil for nil.
func (p *seqPrefix) clone() *seqPrefix {
	if p == nil {
		return nil
	}
	return &seqPrefix{keys: p.keys, last: p.last, tail: append(make([]int32, 0, cap(p.tail)), p.tail...)}
}

// Prompts is a batch of prompts in the flat form of the C ABI: prompt i's
// tokens are Tokens[Offsets[i]:Offsets[i+1]] and its extra keys Keys[i]
// (Keys nil: none for every prompt). len(Offsets) is the batch size plus
// one. The tokens may be a prefix of a longer prompt (a chunk of a
// chunked prefill) whose keys Keys[i] are: multimodal items may extend
// past the tokens given (prefix.Keys).
type Prompts struct {
	Tokens  []int32
	Offsets []int64
	Keys    []prefix.Keys
}

// Len returns the number of prompts.
func (p *Prompts) Len() int { return max(len(p.Offsets)-1, 0) }

// Prompt returns prompt i's tokens and keys (nil: none).
func (p *Prompts) Prompt(i int) ([]int32, *prefix.Keys) {
	t := p.Tokens[p.Offsets[i]:p.Offsets[i+1]]
	if p.Keys == nil {
		return t, nil
	}
	return t, &p.Keys[i]
}

// validate checks the batch's shape, every prompt's length (in [minLen,
// MaxPromptLen]) and keys.
func (p *Prompts) validate(op string, minLen int) error {
	n := p.Len()
	if err := checkBatch(op, n); err != nil {
		return err
	}
	if p.Keys != nil && len(p.Keys) != n {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d keys for %d prompts", op, len(p.Keys), n)
	}
	if p.Offsets[0] < 0 || p.Offsets[n] > int64(len(p.Tokens)) {
		return kverr.Errorf(kverr.InvalidArgument, "%s: token offsets span [%d, %d), the tokens array holds %d", op, p.Offsets[0], p.Offsets[n], len(p.Tokens))
	}
	for i := range n {
		l := p.Offsets[i+1] - p.Offsets[i]
		if l < int64(minLen) || l > MaxPromptLen {
			return kverr.Errorf(kverr.InvalidArgument, "%s: prompt %d has %d tokens (offsets %d to %d); need %d to 2^30", op, i, l, p.Offsets[i], p.Offsets[i+1], minLen)
		}
		if p.Keys != nil {
			if err := p.Keys[i].Validate(op); err != nil {
				return err
			}
		}
	}
	return nil
}

// MatchInfo is what Match found for one prompt. Its layout (three int32) is
// the C ABI's kvp_prefix_match.
type MatchInfo struct {
	// Tokens is the length of the longest cached prefix in full blocks:
	// the tokens Admit would not compute. Never the whole prompt.
	Tokens int32
	// PartialBlock is a cached block whose first PartialTokens rows hold
	// the KV of the prompt's next PartialTokens tokens (package prefix's
	// partial match); -1 and 0 when none or not asked for, and always
	// with layer groups (a block holds group 0's rows only).
	PartialBlock  int32
	PartialTokens int32
}

// BlockMatch is what MatchBlocks found for one prompt. Its layout (two
// int32) is the C ABI's kvp_block_match.
type BlockMatch struct {
	// Tokens is Match's: the hit Admit would take.
	Tokens int32
	// BlockTokens is the length of group 0's longest cached prefix in full
	// blocks (never the whole prompt), at least Tokens. With layer groups
	// a hit stops short of it where a recurrent group has no checkpoint
	// (or a window group lacks a block the next query reads). A
	// recurrent group's state is kept only where a step ends, so an
	// engine that ends a prompt's step at BlockTokens (rounded down to a
	// checkpoint boundary) leaves a state where the cached prefix ends,
	// and the next prompt sharing it resumes there: BlockTokens is where
	// this prompt leaves the cached prefix, the point other prompts with
	// that prefix reach too (a shared system prompt's end).
	BlockTokens int32
}

// Admit adds sequences by their prompts, in batch order: sequence ids[i]
// gets prompt i, starts on the cached blocks of its longest cached prefix
// in full blocks (never its last token), and has the rest of the prompt as
// its new tokens; matched[i] (if matched is not nil) is set to the number
// of matched tokens. With a host tier (tier.go) the match goes on in the
// host tier: those blocks are reloaded, and their tokens count as matched
// too; with a shared tier, the blocks it holds past the host match are
// first fetched into the host tier (shared.go: before the call takes the
// manager's lock, and bounded by two operation timeouts). Its other blocks are allocated (evicting cached ones
// if the free queue runs short) and each full one is inserted into the
// cache, so later prompts, in this batch too, share it. Without the prefix
// cache nothing matches and the tokens are not kept.
//
// The keys belong to the sequence, not to this call: under chunked
// prefill (admit the prompt's first chunk, GrowTokens the rest) they are
// the whole prompt's, multimodal items past the chunk included, and the
// sequence keeps them, so every block it fills later is hashed with the
// items that overlap it, wherever the chunks end. Items not known at
// admission can follow with AddMMItems.
//
// Admission stops at the first prompt that does not fit (free plus
// evictable blocks, after its match, are fewer than the rest of it needs):
// Admit returns how many were admitted, that prefix of the batch, and
// changes nothing for the others. It is not an error: a scheduler retries
// them when sequences finish.
//
// A prompt that needs more blocks than the whole pool has can never be
// admitted: that is an error (InvalidArgument, naming it), checked before
// anything changes, not a short count.
//
// Errors, checked before anything changes: InvalidArgument (batch size,
// len(ids) != prompts.Len(), a prompt's length in [1, MaxPromptLen] or
// past the whole pool, offsets, keys, matched shorter than the batch),
// DuplicateSequence (an id live or repeated).
func (m *Manager) Admit(ids []int64, prompts Prompts, matched []int32) (int, error) {
	if err := prompts.validate("admit", 1); err != nil {
		return 0, err
	}
	n := prompts.Len()
	if len(ids) != n {
		return 0, kverr.Errorf(kverr.InvalidArgument, "admit: %d ids for %d prompts", len(ids), n)
	}
	if matched != nil && len(matched) < n {
		return 0, kverr.Errorf(kverr.InvalidArgument, "admit: matched_tokens holds %d entries for %d prompts", len(matched), n)
	}
	for i := range n {
		if err := m.neverFits("admit", ids[i], int(prompts.Offsets[i+1]-prompts.Offsets[i])); err != nil {
			return 0, err
		}
	}
	fetched, err := m.fetchShared(&prompts, ids)
	if err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.unlock()
	if err := m.checkNewIDs("admit", "sequence", ids); err != nil {
		return 0, err
	}
	for i, id := range ids {
		tokens, keys := prompts.Prompt(i)
		k, ok, err := m.admitOne(id, tokens, keys, fetched)
		if err != nil || !ok {
			if err == nil && logx.L().Core().Enabled(zap.DebugLevel) {
				logx.L().Debug("admit: pool full", zap.Int("admitted", i), zap.Int("batch", n))
			}
			return i, err
		}
		if matched != nil {
			matched[i] = int32(k)
		}
	}
	return n, nil
}

// admitOne admits one validated prompt and returns its matched tokens; ok
// is false, with nothing changed, when it does not fit.
func (m *Manager) admitOne(id int64, tokens []int32, keys *prefix.Keys, fetched kvtier.Fetched) (matched int, ok bool, err error) {
	need := m.blocksFor(len(tokens))
	var res prefix.MatchResult
	whole := false // with groups: the GPU hit is group 0's whole cached prefix
	switch {
	case m.gc != nil:
		res, whole, ok, err = m.acquireGroups(tokens, keys, need)
		if err != nil || !ok {
			return 0, false, err
		}
	case m.cache != nil:
		res, ok, err = m.cache.Acquire(m.locks[:0], tokens, keys, need, m.pool.NumFree())
		m.locks = res.Blocks[:0]
		if err != nil || !ok {
			return 0, false, err
		}
	case m.groups.perSeq(need) > int64(m.pool.NumFree()):
		return 0, false, nil // no cache: what every group needs must be free
	}
	k := len(res.Blocks)
	hostHit := 0 // blocks after the k matched on the GPU, pinned in the host tier
	switch {
	case m.tier != nil && m.gc != nil && whole:
		hostHit = m.tier.PinHostGroups(tokens, keys, k, m.gpuHas(res.Blocks))
	case m.tier != nil && m.gc == nil:
		hostHit = m.tier.PinHost(tokens, keys, k, fetched)
	}
	s := &seq{blocks: newTable(need, res.Blocks), length: res.Tokens, own: int32(k)}
	// The matched blocks are cached, so their references equal their
	// locks, which Acquire bounded below 2^31-1.
	assertOK(m.pool.Incref(s.blocks[:k]), "admit: referencing the matched blocks")
	// The groups' matched blocks are taken before anything is evicted.
	s.grp = m.newExtra(need)
	m.takeCompanions(s, k, k+hostHit)
	m.makeFree(int(m.groups.perSeq(need-k)) - m.droppedAhead(s, k))
	hint := int32(-1)
	if k > 0 {
		hint = s.blocks[k-1]
	}
	m.allocate(s.blocks[k:], hint, "admit: allocating blocks made free")
	m.allocExtra(s, k, s.blocks[need-1])
	m.queueStateCopies(s, k)
	if hostHit > 0 {
		if m.gc != nil {
			m.tier.QueueGroupReloads(func(j, g int) int32 { return s.groupBlock(j, g) })
		} else {
			m.tier.QueueReloads(s.blocks[k : k+hostHit])
		}
	}
	if m.cache != nil {
		s.pc = &seqPrefix{keys: keys.Clone(), last: res.Last, tail: make([]int32, 0, m.bs)}
		// The reloaded blocks are inserted like the blocks the step
		// computes: their K/V arrives before the step's attention.
		m.extendPrefix(s, tokens[res.Tokens:])
	}
	if hostHit > 0 {
		m.tier.LockReloads(s.blocks[k : k+hostHit])
		// Their K/V comes from the reload copy, which the engine orders
		// before every reader: computed, whatever becomes of s.
		m.cache.CommitBlocks(s.blocks[k : k+hostHit])
		m.hostHitPoint(s, k+hostHit)
	}
	matched = res.Tokens + hostHit*m.bs
	s.length = len(tokens)
	s.fresh = int32(len(tokens) - matched)
	m.seqs.put(id, s)
	m.noteCheckpoint(id, s)
	m.numTokens += int64(s.length)
	m.waste += m.wasteOf(s)
	return matched, true, nil
}

// GrowTokens is Grow with the new tokens themselves: tokens holds each
// sequence's counts[i] new tokens, in batch order (len(tokens) ==
// sum(counts)). With the prefix cache, a sequence admitted by its tokens
// inserts each block these tokens fill into the cache; a sequence whose
// tokens are not known (Add, or a Grow without tokens since) just grows.
// Errors: those of Grow, and InvalidArgument when len(tokens) is not the
// counts' sum.
func (m *Manager) GrowTokens(ids []int64, counts []int32, tokens []int32) error {
	if tokens == nil {
		tokens = []int32{} // grow tells the two calls apart by a nil tokens
	}
	return m.grow("grow tokens", ids, counts, tokens)
}

// extendPrefix hashes and inserts the blocks that s's new tokens toks fill,
// and keeps the rest in s's tail. s.length is the length before toks, and
// s's table already holds the blocks they go to.
func (m *Manager) extendPrefix(s *seq, toks []int32) {
	pc := s.pc
	if pc == nil || len(toks) == 0 {
		return
	}
	if len(toks) == 1 && len(pc.tail) < m.bs-1 {
		// A decode step's token that does not fill its block: keep it,
		// without the general path's copy call.
		pc.tail = append(pc.tail, toks[0])
		return
	}
	bi := s.length / m.bs // the block toks[0] goes to
	if len(pc.tail) > 0 {
		k := min(m.bs-len(pc.tail), len(toks))
		pc.tail = append(pc.tail, toks[:k]...)
		toks = toks[k:]
		if len(pc.tail) < m.bs {
			return
		}
		if !m.insertBlocks(s, bi, pc.tail) {
			return
		}
		pc.tail = pc.tail[:0]
		bi++
	}
	if full := len(toks) / m.bs; full > 0 {
		if !m.insertBlocks(s, bi, toks[:full*m.bs]) {
			return
		}
		toks = toks[full*m.bs:]
	}
	pc.tail = append(pc.tail, toks...)
}

// insertBlocks inserts s's full blocks from bi on, whose tokens are toks
// (a whole number of blocks), with InsertRun. If the cache holds an
// identical block already, s keeps its own as a private copy (the engine
// is writing its KV there this step) and the chain goes on from the
// cached twin's hash. It returns false, with s's later blocks left
// private, when the cache refuses a block: the twin's parent chain was
// evicted meanwhile (a private block is not locked, so its cached twin
// may go), or a hash collided.
func (m *Manager) insertBlocks(s *seq, bi int, toks []int32) bool {
	for len(toks) > 0 {
		n := len(toks) / m.bs
		if cap(m.inserted) < n {
			m.inserted = make([]prefix.InsertResult, n)
		}
		res := m.inserted[:n]
		done, err := m.cache.InsertRun(s.pc.last, toks, s.pc.keys, s.blocks[bi:bi+n], res)
		for k, r := range res[:done] {
			if r.Dup {
				// InsertRun locked the twin for s, which does not
				// reference it; InsertRun stops after a twin, so this
				// happens before the next block's insert, as with Insert.
				m.one[0] = r.Block
				assertOK(m.cache.Unlock(m.one[:]), "unlocking the block InsertRun just locked")
			} else {
				assertOK(m.pool.MarkCached(s.blocks[bi+k]), "a sequence's block is free")
				m.registerCompanions(s, bi+k)
				m.noteFilled(s.blocks[bi+k])
			}
		}
		if done > 0 {
			s.pc.last = res[done-1].Hash
		}
		if err != nil {
			logx.L().Debug("prefix cache: block not inserted; the sequence's later blocks stay private", zap.Error(err))
			s.pc = nil
			return false
		}
		bi += done
		toks = toks[done*m.bs:]
	}
	return true
}

// AddMMItems appends multimodal items to live sequence id's keys: items
// of tokens still to come that its admission did not name (a later turn
// with an image, a chunk whose items were not known yet). Every block the
// sequence fills from then on is hashed with the items that overlap it.
// The items must be valid as in prefix.Keys, in increasing offset order
// after the sequence's last item, and must not overlap a block the
// sequence has filled already: an offset below the start of its partial
// last block (or below its length, when that is a block boundary) is
// refused, since those blocks are cached without the item. Sequences
// forked from id before the call keep the keys they had. Without the
// prefix cache, or for a sequence whose tokens are not known (added, or
// grown without tokens), the items are checked and then dropped: such a
// sequence's blocks are not cached. An empty mm is a no-op.
// Errors, with nothing changed: InvalidArgument, UnknownSequence.
func (m *Manager) AddMMItems(id int64, mm []prefix.MMItem) error {
	const op = "add multimodal items"
	m.mu.Lock()
	defer m.unlock()
	s := m.seqs.get(id)
	if s == nil {
		return kverr.Errorf(kverr.UnknownSequence, "%s: sequence %d is not live", op, id)
	}
	var keys *prefix.Keys
	if s.pc != nil {
		keys = s.pc.keys
	}
	if err := prefix.ValidateMoreMM(op, keys, mm); err != nil {
		return err
	}
	if len(mm) == 0 {
		return nil
	}
	if filled := s.length / m.bs * m.bs; int64(mm[0].Offset) < int64(filled) {
		return kverr.Errorf(kverr.InvalidArgument, "%s: item 0 starts at %d, inside the %d tokens of sequence %d's full blocks, which are hashed without it; items must start at %d or later",
			op, mm[0].Offset, filled, id, filled)
	}
	if keys != nil && len(keys.MM)+len(mm) > prefix.MaxMMItems {
		return kverr.Errorf(kverr.InvalidArgument, "%s: sequence %d would have %d multimodal items, at most %d allowed", op, id, len(keys.MM)+len(mm), prefix.MaxMMItems)
	}
	if s.pc != nil {
		// A new Keys, never an in-place append: forked children share the
		// old one.
		s.pc.keys = keys.WithMoreMM(mm)
	}
	return nil
}

// errNoCache is the error of the calls that need the prefix cache.
func errNoCache(op string) error {
	return kverr.Errorf(kverr.InvalidArgument, "%s: the prefix cache is off (enable_prefix_cache in the manager's config)", op)
}

// Match finds each prompt's longest cached prefix in full blocks (never
// the whole prompt) without admitting anything, and writes what it found
// to out[i]; with partial, also the partial block (MatchInfo). The matched
// blocks count as used now for eviction, and the queries are counted in
// PrefixStats. Without the prefix cache nothing matches.
// Errors: InvalidArgument (batch, a prompt's length in [0, MaxPromptLen],
// keys, out shorter than the batch).
func (m *Manager) Match(prompts Prompts, partial bool, out []MatchInfo) error {
	if err := prompts.validate("match", 0); err != nil {
		return err
	}
	n := prompts.Len()
	if len(out) < n {
		return kverr.Errorf(kverr.InvalidArgument, "match: out holds %d entries for %d prompts", len(out), n)
	}
	m.mu.Lock()
	defer m.unlock()
	for i := range n {
		out[i] = MatchInfo{PartialBlock: -1}
		if m.cache == nil {
			continue
		}
		_, _, res := m.matchPrompt(&prompts, i, partial, "match: the index refused a validated prompt")
		out[i] = MatchInfo{Tokens: int32(res.Tokens), PartialBlock: res.PartialBlock, PartialTokens: int32(res.PartialTokens)}
	}
	return nil
}

// MatchBlocks is Match without the partial block, with each prompt's
// block match beside its hit (BlockMatch): out[i].BlockTokens is group
// 0's longest cached prefix, which the hit (out[i].Tokens) reaches unless
// another layer group cannot start there. Without layer groups the two are
// equal. It counts its queries, and touches the hit's blocks, as Match
// does; it looks at the GPU prefix cache only (a host tier's blocks count
// in MatchTiers). Errors: those of Match.
func (m *Manager) MatchBlocks(prompts Prompts, out []BlockMatch) error {
	if err := prompts.validate("match blocks", 0); err != nil {
		return err
	}
	n := prompts.Len()
	if len(out) < n {
		return kverr.Errorf(kverr.InvalidArgument, "match blocks: out holds %d entries for %d prompts", len(out), n)
	}
	m.mu.Lock()
	defer m.unlock()
	for i := range n {
		out[i] = BlockMatch{}
		if m.cache == nil {
			continue
		}
		_, _, res := m.matchPrompt(&prompts, i, false, "match blocks: the index refused a validated prompt")
		out[i] = BlockMatch{Tokens: int32(res.Tokens), BlockTokens: int32(res.Tokens)}
		if m.gc != nil {
			out[i].BlockTokens = int32(m.lastPeek * m.bs)
		}
	}
	return nil
}

// MatchRoom writes, for each prompt, the blocks an admission of it could
// allocate now beyond its GPU prefix-cache hit: the free blocks and the
// evictable cached ones, less the hit's blocks that the admission's lock
// would take out of the evictable ones (those nothing holds: no sequence,
// copy or pin). A hit that running sequences share (a system prompt) costs
// nothing, so this is exact where a count of all the hit's blocks would
// undercount. Admit takes a prompt whose blocks past its hit are at most
// that many. A query: nothing is touched, locked or counted. Errors:
// InvalidArgument (prompts, out too short), Unsupported (layer groups,
// whose window groups take blocks of the same pool beside group 0's).
func (m *Manager) MatchRoom(prompts Prompts, out []int32) error {
	if err := prompts.validate("match room", 0); err != nil {
		return err
	}
	n := prompts.Len()
	if len(out) < n {
		return kverr.Errorf(kverr.InvalidArgument, "match room: out holds %d entries for %d prompts", len(out), n)
	}
	m.mu.Lock()
	defer m.unlock()
	if m.gc != nil {
		return kverr.Errorf(kverr.Unsupported, "match room: a manager with layer groups (its window groups take blocks beside group 0's)")
	}
	avail := m.available()
	for i := range n {
		room := avail
		if m.cache != nil {
			tokens, keys := prompts.Prompt(i)
			peek, err := m.cache.Peek(m.locks[:0], tokens, keys)
			assertOK(err, "match room: the index refused a validated prompt")
			room -= int64(m.cache.Unheld(peek))
			m.locks = peek[:0]
		}
		out[i] = int32(min(room, math.MaxInt32))
	}
	return nil
}

// matchPrompt matches prompt i of prompts in the GPU prefix cache, under
// the lock, reusing m.locks for the matched blocks (held by no one: a
// match locks nothing); what names the caller if the index refuses the
// validated prompt all the same.
func (m *Manager) matchPrompt(prompts *Prompts, i int, partial bool, what string) ([]int32, *prefix.Keys, prefix.MatchResult) {
	tokens, keys := prompts.Prompt(i)
	var res prefix.MatchResult
	if m.gc != nil {
		// With layer groups a prompt hits only where every window group
		// holds what its next query reads.
		peek, err := m.cache.Peek(m.locks[:0], tokens, keys)
		assertOK(err, what)
		m.lastPeek = len(peek)
		// No partial block: a cached block holds group 0's rows, not the
		// other groups' K/V or a recurrent state for its tokens.
		res = m.cache.MatchPeeked(m.locks[:0], tokens, keys, false, m.hitBlocks(peek))
	} else {
		var err error
		res, err = m.cache.Match(m.locks[:0], tokens, keys, partial)
		assertOK(err, what)
	}
	m.locks = res.Blocks[:0]
	return tokens, keys, res
}

// Pin keeps the cached full blocks of a prefix (all of them, unlike a
// match) from eviction until Unpin with the returned id, and returns how
// many blocks it pinned. Blocks of the prefix cached later are not
// covered. Errors: InvalidArgument (prefix cache off, keys, a prompt
// longer than MaxPromptLen), NotFound (no block of the prefix is cached),
// Unsupported (layer groups: a pin keeps group 0's blocks, but the other
// groups' window blocks and states would still be evicted, and the
// pinned prefix would stop hitting).
func (m *Manager) Pin(tokens []int32, keys *prefix.Keys) (uint64, int, error) {
	if len(tokens) > MaxPromptLen {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "pin: %d tokens, at most 2^30", len(tokens))
	}
	m.mu.Lock()
	defer m.unlock()
	if m.cache == nil {
		return 0, 0, errNoCache("pin")
	}
	if m.gc != nil {
		return 0, 0, kverr.Errorf(kverr.Unsupported, "pin: a manager with layer groups does not pin prefixes in this version (the other groups' blocks and states of a pinned prefix could still be evicted, and it would stop hitting)")
	}
	id, n, err := m.cache.Pin(tokens, keys)
	return uint64(id), n, err
}

// Unpin releases one Pin's pins. Errors: InvalidArgument (prefix cache
// off), NotFound (id unknown, unpinned already or dropped by
// ClearPrefixCache).
func (m *Manager) Unpin(id uint64) error {
	m.mu.Lock()
	defer m.unlock()
	if m.cache == nil {
		return errNoCache("unpin")
	}
	return m.cache.Unpin(prefix.PinID(id))
}

// SetPriority sets the eviction priority of the cached full blocks of a
// prefix (lower goes first; blocks start at 0) and returns how many it
// set. Errors: as Pin.
func (m *Manager) SetPriority(tokens []int32, keys *prefix.Keys, priority int32) (int, error) {
	if len(tokens) > MaxPromptLen {
		return 0, kverr.Errorf(kverr.InvalidArgument, "set priority: %d tokens, at most 2^30", len(tokens))
	}
	m.mu.Lock()
	defer m.unlock()
	if m.cache == nil {
		return 0, errNoCache("set priority")
	}
	return m.cache.SetPriority(tokens, keys, priority)
}

// PrefixStats returns the prefix cache's counters and sizes; zero when the
// cache is off.
func (m *Manager) PrefixStats() prefix.Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cache == nil {
		return prefix.Stats{}
	}
	st := m.cache.Stats()
	st.PendingEvents += len(m.carry)
	return st
}

// ResetPrefixStats zeroes the prefix cache's counters (not its sizes).
func (m *Manager) ResetPrefixStats() {
	m.mu.Lock()
	defer m.unlock()
	if m.cache != nil {
		m.cache.ResetStats()
	}
}

// ClearPrefixCache drops every cached block that no sequence holds back to
// the free queue and every pin, for a model or adapter reload, and records
// an AllCleared event. It refuses, changing nothing, while live sequences
// hold cached blocks (InvalidArgument): remove them first. A no-op when
// the cache is off. It returns the number of blocks freed.
func (m *Manager) ClearPrefixCache() (int, error) {
	m.mu.Lock()
	defer m.unlock()
	if m.cache == nil {
		return 0, nil
	}
	var err error
	m.evicted, err = m.cache.Clear(m.evicted[:0])
	if err != nil {
		return 0, err
	}
	// Clear refuses while any block is locked, so every cleared block has
	// no reference and is Cached in the pool.
	assertOK(m.pool.Evict(m.evicted), "cleared blocks are not Cached in the pool")
	// The AllCleared covers the layer groups' blocks too.
	return len(m.evicted) + m.nodesGone(m.evicted, nil), nil
}

// EventLimits bound what one DrainEvents returns, so that the events fit
// a caller's fixed buffers: events, tokens of BlockStored events,
// multimodal entries of BlockStored events, hashes of BlockRemoved events.
type EventLimits struct {
	Events, Tokens, MM, Hashes int
}

// NoEventLimits drains every pending event.
var NoEventLimits = EventLimits{math.MaxInt, math.MaxInt, math.MaxInt, math.MaxInt}

// DrainEvents returns the oldest pending KV events of layer group 0, in
// order, as many whole events as fit lim; a BlockRemoved event with more
// hashes than fit is split (its first hashes now, the rest next time),
// which a consumer applying events in order cannot tell apart. The events
// are the caller's (package prefix, Index.DrainEvents, has their meaning
// and what happens when too many wait). A manager with layer groups also
// records its other groups' events (groupcache.go, "KV events"), which
// DrainEvents passes over and drops: its consumer knows one group, and
// another group's event read as group 0's would store a block twice or
// remove one still cached. DrainGroupEvents returns them. Errors:
// InvalidArgument (KV events off), and BufferTooSmall, draining nothing,
// when lim cannot hold even the oldest event (a BlockStored needs
// BlockSize tokens and its multimodal entries, a BlockRemoved one hash).
func (m *Manager) DrainEvents(lim EventLimits) ([]prefix.Event, error) {
	return m.drainEvents("drain events", lim, false)
}

// DrainGroupEvents is DrainEvents for every layer group's events, each
// with its group (prefix.Event.Group); for a manager without groups it is
// DrainEvents. A consumer uses one of the two: the events either takes
// are gone for the other.
func (m *Manager) DrainGroupEvents(lim EventLimits) ([]prefix.Event, error) {
	return m.drainEvents("drain group events", lim, true)
}

// wants reports whether a drain of every group (all) or of group 0 takes
// ev.
func wants(ev *prefix.Event, all bool) bool { return all || ev.Group == 0 }

// fillCarry moves the index's pending events into m.carry when it holds
// none the drain (all: of every group) takes, under the lock; an error
// when events are off. The carry is bounded as the index's queue is: it
// grows only while it holds nothing a drain takes, and the next drain
// takes or passes over all of it.
func (m *Manager) fillCarry(op string, all bool) error {
	if m.cache == nil || !m.cache.EventsEnabled() {
		return kverr.Errorf(kverr.InvalidArgument, "%s: KV events are off (enable_kv_events in the manager's config)", op)
	}
	for i := range m.carry {
		if wants(&m.carry[i], all) {
			return nil
		}
	}
	if evs := m.cache.DrainEvents(0); len(evs) > 0 {
		m.carry = append(m.carry, evs...)
	}
	return nil
}

func (m *Manager) drainEvents(op string, lim EventLimits, all bool) ([]prefix.Event, error) {
	m.mu.Lock()
	defer m.unlock()
	if err := m.fillCarry(op, all); err != nil {
		return nil, err
	}
	var out []prefix.Event
	tok, mm, hashes := 0, 0, 0
	i := 0 // m.carry[:i] is taken or passed over
	for ; i < len(m.carry) && len(out) < lim.Events; i++ {
		ev := &m.carry[i]
		if !wants(ev, all) {
			continue
		}
		switch ev.Kind {
		case prefix.BlockStored:
			if tok+len(ev.Tokens) > lim.Tokens || mm+len(ev.MM) > lim.MM {
				if len(out) == 0 {
					return nil, kverr.Errorf(kverr.BufferTooSmall, "%s: the buffers cannot hold the oldest event: a stored block needs room for %d tokens (the tokens buffer holds %d) and %d multimodal entries (the mm buffer holds %d)",
						op, len(ev.Tokens), lim.Tokens, len(ev.MM), lim.MM)
				}
				m.carry = m.carry[i:]
				return out, nil
			}
			tok += len(ev.Tokens)
			mm += len(ev.MM)
		case prefix.BlockRemoved:
			room := lim.Hashes - hashes
			if room <= 0 {
				if len(out) == 0 {
					return nil, kverr.Errorf(kverr.BufferTooSmall, "%s: the buffers cannot hold the oldest event: a removed-blocks event needs room for at least one hash (the hashes buffer holds %d)", op, lim.Hashes)
				}
				m.carry = m.carry[i:]
				return out, nil
			}
			if len(ev.Hashes) > room {
				head := *ev
				head.Hashes = ev.Hashes[:room:room]
				ev.Hashes = ev.Hashes[room:]
				m.carry = m.carry[i:]
				return append(out, head), nil
			}
			hashes += len(ev.Hashes)
		}
		out = append(out, *ev)
	}
	m.carry = m.carry[i:]
	if len(m.carry) == 0 {
		m.carry = nil
	}
	return out, nil
}

// EventSize is the room one event needs in DrainEvents' limits: Tokens
// and MM for a BlockStored (its block's tokens and multimodal entries),
// Hashes 1 for a BlockRemoved (a longer one is split across drains), all
// 0 for AllCleared.
type EventSize struct {
	Tokens, MM, Hashes int
}

// NextEventSize returns the room the oldest pending event of group 0
// needs (the one DrainEvents returns next), so that a caller whose
// buffers were too small (DrainEvents' BufferTooSmall) can grow them to
// fit; ok is false when no event is pending. Errors: InvalidArgument (KV
// events off).
func (m *Manager) NextEventSize() (size EventSize, ok bool, err error) {
	return m.nextEventSize("next event size", false)
}

// NextGroupEventSize is NextEventSize for DrainGroupEvents: the room the
// oldest pending event of any group needs.
func (m *Manager) NextGroupEventSize() (size EventSize, ok bool, err error) {
	return m.nextEventSize("next group event size", true)
}

func (m *Manager) nextEventSize(op string, all bool) (size EventSize, ok bool, err error) {
	m.mu.Lock()
	defer m.unlock()
	if err := m.fillCarry(op, all); err != nil {
		return size, false, err
	}
	for i := range m.carry {
		ev := &m.carry[i]
		if !wants(ev, all) {
			continue
		}
		switch ev.Kind {
		case prefix.BlockStored:
			size.Tokens, size.MM = len(ev.Tokens), len(ev.MM)
		case prefix.BlockRemoved:
			size.Hashes = 1
		}
		return size, true, nil
	}
	return size, false, nil
}
