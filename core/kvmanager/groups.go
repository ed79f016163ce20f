package kvmanager

import (
	"fmt"
	"slices"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/internal/blocks"
)

// Layer groups: one pool for a hybrid model's kinds of layers.
//
// A hybrid model mixes layers that keep every token's K/V (full attention)
// with layers that keep only the last W tokens' (sliding window) and layers
// that keep one fixed-size state per sequence (linear attention, Mamba).
// The engine groups its layers so that every group has the same number of
// layers (padding a group with unused layers where needed) and lays its
// memory out in layer slots: slot j's tensor holds num_blocks blocks, and
// block b of slot j belongs to layer j of whichever group holds b. One
// block id thus means the same bytes in every slot, which is what lets
// every group draw from one pool with one block size, and what keeps a
// CopyPair (all slots of block Src into block Dst) right for every group.
//
// Group 0 must be full attention: its block table is the sequence's token
// timeline, as in a manager without groups (Describe reports it). Every
// other group g has its own table (DescribeGroups):
//   - full attention: ceil(length / blockSize) blocks, like group 0's;
//   - sliding window of W tokens: the same number of entries, but the
//     blocks that no query can read any more are dropped (their entries
//     become -1, NoBlock) and return to the pool. A query at position p
//     reads tokens [p-W+1, p]; the next queries of a sequence of length L
//     are at positions >= L (the tokens its next Grow adds), so a Grow
//     drops, before it allocates, the blocks that end before L-W+1, L the
//     length before the Grow. The tokens a call adds stay in the table for
//     the step that computes them, so a prompt admitted whole holds all of
//     its blocks until its first Grow;
//   - recurrent: one block per sequence, the sequence's state (at most
//     BlockBytes bytes per layer slot). Fork gives each child its own
//     block and a CopyPair from the parent's.
//
// The prefix cache holds every kind of group (groupcache.go): a recurrent
// group's states at checkpoints. The host tier holds full-attention and
// sliding-window groups, one host slot per cached node and group
// (grouptier.go, core/kvtier/groups.go); a manager with a recurrent group,
// or with the shared tier, write-through or DemoteEvicted, refuses it
// (Unsupported) in this version. Shared-prefix (cascade) planning reads
// group 0's tables.

// GroupKind is the kind of a layer group's layers.
type GroupKind uint8

// The kinds of layer group (kvp_layer_group_kind).
const (
	FullAttention GroupKind = iota // every token's K/V
	SlidingWindow                  // the last Window tokens' K/V
	Recurrent                      // one state per sequence
)

// NoBlock is the block table entry of a block a sliding-window group
// dropped, and the padding of every table row.
const NoBlock = -1

// Group declares one layer group.
type Group struct {
	Kind GroupKind
	// Window is a SlidingWindow group's window in tokens: a query reads
	// its last Window tokens, itself included (FlashInfer's window_left
	// is Window-1; kvp_paged_prefill_args.window_size is Window). In
	// [1, MaxModelLen) when MaxModelLen is set, else [1, 2^30]. 0 for the
	// other kinds.
	Window int
	// StateBytes is a Recurrent group's state size in bytes per layer
	// slot, in [1, Config.BlockBytes]. 0 for the other kinds.
	StateBytes int64
	// CheckpointEvery is a Recurrent group's checkpoint interval in
	// blocks, in [1, 2^20], required with the prefix cache: the state of
	// a sequence whose step ends at the end of a cached block that is a
	// multiple of it is kept (groupcache.go, "Recurrent states"); with
	// several recurrent groups, of every group's (a partial state resumes
	// nothing). 0 for the other kinds, and without the prefix cache.
	CheckpointEvery int
}

// groupTable is a sequence's table in one group other than group 0.
type groupTable struct {
	// blocks: an attention group's ceil(length / blockSize) entries, the
	// first gone of them NoBlock (dropped by its window); a recurrent
	// group's one state block.
	blocks []int32
	gone   int
}

// groupSet is a manager's groups past group 0, and what its calls need of
// them precomputed.
type groupSet struct {
	extra []Group // groups 1.. in order
	// attn counts the groups that hold a block per blockSize tokens
	// (group 0 included); states counts the recurrent groups.
	attn, states int
	windowed     bool // a SlidingWindow group is among them
	// host is groups 1.. as the host tier sees them (tierGroups.HostGroups),
	// built once: the groups never change.
	host []kvtier.HostGroup
}

// newGroupSet checks cfg's groups and returns them. Nothing is allocated
// before the checks pass, so a bad config creates nothing.
func newGroupSet(cfg *Config) (groupSet, error) {
	gs := groupSet{attn: 1}
	if err := checkSizes(cfg); err != nil || len(cfg.Groups) == 0 {
		return gs, err
	}
	if len(cfg.Groups) > limits.LayerGroups {
		return gs, kverr.Errorf(kverr.InvalidArgument, "layer groups: at most %d groups: got %d", limits.LayerGroups, len(cfg.Groups))
	}
	maxWindow := limits.PromptTokens
	if cfg.MaxModelLen > 0 {
		maxWindow = cfg.MaxModelLen - 1
	}
	for g, grp := range cfg.Groups {
		switch grp.Kind {
		case FullAttention:
			if grp.Window != 0 || grp.StateBytes != 0 || grp.CheckpointEvery != 0 {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: a full-attention group has no window or state size: got window %d, state bytes %d", g, grp.Window, grp.StateBytes)
			}
		case SlidingWindow:
			if grp.StateBytes != 0 || grp.CheckpointEvery != 0 {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: a sliding-window group has no state size or checkpoints: got %d, %d", g, grp.StateBytes, grp.CheckpointEvery)
			}
			if grp.Window < 1 || grp.Window > maxWindow {
				if cfg.MaxModelLen > 0 && grp.Window >= cfg.MaxModelLen {
					return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: window %d is not below the context limit max_model_len %d: such layers read every token, so declare them full attention", g, grp.Window, cfg.MaxModelLen)
				}
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: window must be in [1, %d] tokens: got %d", g, maxWindow, grp.Window)
			}
		case Recurrent:
			if grp.Window != 0 {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: a recurrent group has no window: got %d", g, grp.Window)
			}
			if cfg.BlockBytes == 0 {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: a recurrent group needs block_bytes, the bytes of one block in one layer slot, to check that its state fits a block", g)
			}
			if grp.StateBytes < 1 || grp.StateBytes > cfg.BlockBytes {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: the recurrent state of %d bytes does not fit a block of %d bytes (block_bytes, per layer slot)", g, grp.StateBytes, cfg.BlockBytes)
			}
			if cfg.EnablePrefixCache && (grp.CheckpointEvery < 1 || grp.CheckpointEvery > 1<<20) {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: a recurrent group in the prefix cache needs checkpoint_every in [1, 2^20] blocks (how often its state is kept): got %d", g, grp.CheckpointEvery)
			}
			if !cfg.EnablePrefixCache && grp.CheckpointEvery != 0 {
				return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: checkpoint_every %d needs the prefix cache", g, grp.CheckpointEvery)
			}
		default:
			return gs, kverr.Errorf(kverr.InvalidArgument, "layer group %d: unknown kind %d", g, grp.Kind)
		}
	}
	if cfg.Groups[0].Kind != FullAttention {
		return gs, kverr.Errorf(kverr.InvalidArgument, "layer group 0 must be full attention (its table is the sequence's token timeline): got kind %d; declare a model without full-attention layers as one full-attention group", cfg.Groups[0].Kind)
	}
	if len(cfg.Groups) > 1 && cfg.HostTier != nil {
		if err := checkGroupTier(cfg); err != nil {
			return gs, err
		}
	}
	gs.extra = slices.Clone(cfg.Groups[1:])
	for _, grp := range gs.extra {
		switch grp.Kind {
		case Recurrent:
			gs.states++
		case SlidingWindow:
			gs.windowed = true
			gs.attn++
		default:
			gs.attn++
		}
	}
	return gs, nil
}

// checkSizes checks the config's byte and context sizes.
func checkSizes(cfg *Config) error {
	if cfg.BlockBytes < 0 || cfg.BlockBytes > limits.TierBytes {
		return kverr.Errorf(kverr.InvalidArgument, "block_bytes must be in [0, 2^46]: got %d", cfg.BlockBytes)
	}
	if cfg.MaxModelLen < 0 || cfg.MaxModelLen > limits.PromptTokens {
		return kverr.Errorf(kverr.InvalidArgument, "max_model_len must be in [0, 2^30]: got %d", cfg.MaxModelLen)
	}
	return nil
}

// perSeq returns the blocks a sequence of n tokens holds over every group
// before any window drop: its attention groups' tables and its states.
func (gs *groupSet) perSeq(blocksForN int) int64 {
	return int64(blocksForN)*int64(gs.attn) + int64(gs.states)
}

// NumGroups returns the manager's layer groups (1 without groups).
func (m *Manager) NumGroups() int { return 1 + len(m.groups.extra) }

// Groups returns the manager's layer groups, group 0 included (one
// FullAttention group without groups).
func (m *Manager) Groups() []Group {
	return append([]Group{{Kind: FullAttention}}, m.groups.extra...)
}

// newExtra returns the tables of a new sequence of n blocks per attention
// group, with no block in them yet (allocExtra).
func (m *Manager) newExtra(n int) *seqGroups {
	if len(m.groups.extra) == 0 {
		return nil
	}
	ts := make([]groupTable, len(m.groups.extra))
	for g, grp := range m.groups.extra {
		if grp.Kind == Recurrent {
			ts[g].blocks = []int32{NoBlock}
		} else {
			ts[g].blocks = newTable(n, nil)
		}
	}
	return &seqGroups{t: ts}
}

// allocExtra allocates s's attention-group blocks from index from on (a
// window group's from its first entry not dropped, if later: a host hit
// drops more than a GPU hit), and its recurrent states; the caller made
// them free.
func (m *Manager) allocExtra(s *seq, from int, hint int32) {
	for g, grp := range m.groups.extra {
		t := s.extra()[g].blocks
		if grp.Kind != Recurrent {
			t = t[max(from, s.extra()[g].gone):]
		}
		if len(t) == 0 {
			continue
		}
		m.allocate(t, hint, "layer groups: allocating blocks made free")
		hint = t[len(t)-1]
	}
}

// growExtra extends s's attention-group tables by add blocks each; the
// caller made them free.
func (m *Manager) growExtra(s *seq, add int) {
	for g := range s.extra() {
		if m.groups.extra[g].Kind == Recurrent {
			continue
		}
		t := &s.extra()[g]
		old := len(t.blocks)
		t.blocks = slices.Grow(t.blocks, add)[:old+add]
		m.allocate(t.blocks[old:], t.blocks[old-1], "layer groups: growing blocks made free")
	}
}

// keepFrom returns the first block of a window group of window w that a
// sequence of length tokens must keep: the block of token length-w+1,
// the first its next query (at position length) reads.
func (m *Manager) keepFrom(length, w int) int { return max(0, length-w+1) / m.bs }

// windowDrops returns whether the batch's window groups hold blocks that
// their next queries can no longer read, and how many of those would go
// back to the pool: a block shared with a forked sibling returns only once
// every holder drops it. applyDrops drops them.
func (m *Manager) windowDrops(batch []*seq) (any bool, freed int) {
	dst := m.drops[:0]
	for _, s := range batch {
		for g, grp := range m.groups.extra {
			if grp.Kind != SlidingWindow {
				continue
			}
			t := &s.extra()[g]
			if k := m.keepFrom(s.length, grp.Window); k > t.gone {
				dst = append(dst, t.blocks[t.gone:k]...)
			}
		}
	}
	m.drops = dst
	// Each distinct block goes back when this batch drops all of its
	// references.
	sorted := dst
	slices.Sort(sorted)
	for i := 0; i < len(sorted); {
		j := i + 1
		for j < len(sorted) && sorted[j] == sorted[i] {
			j++
		}
		if int(m.pool.Ref(sorted[i])) == j-i {
			freed++
		}
		i = j
	}
	return len(dst) > 0, freed
}

// applyDrops drops from the batch's window groups what windowDrops found.
func (m *Manager) applyDrops(batch []*seq) {
	for _, s := range batch {
		for g, grp := range m.groups.extra {
			if grp.Kind != SlidingWindow {
				continue
			}
			t := &s.extra()[g]
			k := m.keepFrom(s.length, grp.Window)
			if k <= t.gone {
				continue
			}
			var err error
			m.cached, err = m.pool.Decref(t.blocks[t.gone:k], m.cached[:0])
			assertOK(err, "layer groups: a window group's blocks are not referenced")
			m.listReleased(s, g, t.gone, k, false)
			fillNoBlock(t.blocks[t.gone:k])
			t.gone = k
		}
	}
}

// forkExtra gives child c its tables of parent p's groups: the parent's
// full (and not dropped) blocks referenced, a new block for a partial last
// block and for each state, each new block with its CopyPair written to
// copies. It returns the pairs written.
func (m *Manager) forkExtra(p, c *seq, partial bool, copies []CopyPair) int {
	if p.grp == nil {
		return 0
	}
	c.grp = &seqGroups{t: make([]groupTable, len(p.extra()))}
	n := 0
	for g, grp := range m.groups.extra {
		pt, ct := &p.extra()[g], &c.extra()[g]
		if grp.Kind == Recurrent {
			ct.blocks = []int32{0}
			m.allocate(ct.blocks, pt.blocks[0], "fork: allocating a child's state block")
			copies[n] = CopyPair{Src: pt.blocks[0], Dst: ct.blocks[0]}
			n++
			continue
		}
		full := len(pt.blocks)
		if partial {
			full--
		}
		ct.blocks = make([]int32, len(pt.blocks))
		copy(ct.blocks, pt.blocks[:full])
		ct.gone = pt.gone
		if shared := ct.blocks[min(ct.gone, full):full]; len(shared) > 0 {
			assertOK(m.pool.Incref(shared), "fork: referencing the parent's group blocks")
		}
		if partial {
			m.allocate(ct.blocks[full:], -1, "fork: allocating a group's copy-on-write block")
			copies[n] = CopyPair{Src: pt.blocks[full], Dst: ct.blocks[full]}
			n++
		}
	}
	return n
}

// forkCopies returns the CopyPairs a child of a parent needs: one per
// attention group when the parent's last block is partial, and one per
// recurrent group.
func (m *Manager) forkCopies(partial bool) int {
	n := m.groups.states
	if partial {
		n += m.groups.attn
	}
	return n
}

// releaseExtra drops a retired sequence's references in its groups.
func (m *Manager) releaseExtra(s *seq) {
	for g := range s.extra() {
		t := &s.extra()[g]
		var err error
		m.cached, err = m.pool.Decref(t.blocks[t.gone:], m.cached[:0])
		assertOK(err, "layer groups: a sequence's group blocks are not referenced")
		m.listReleased(s, g, t.gone, len(t.blocks), true)
	}
}

// DescribeGroups is Describe for every layer group at once: tables[g] and
// slots[g] are group g's block table and slot mapping buffers, with
// Describe's layouts and sizes (nil: not wanted; tables and slots
// themselves may be nil, or have NumGroups entries). Group 0's are what
// Describe writes. A sliding-window group's row has NoBlock where blocks
// were dropped; a recurrent group's row is its state block, padded with
// NoBlock, and it has no slots (slots[g] is not written). The slot count
// returned is the batch's new tokens, which every attention group's slot
// mapping holds. Errors as Describe's, and InvalidArgument when tables or
// slots has neither 0 nor NumGroups entries.
func (m *Manager) DescribeGroups(ids []int64, maxBlocks int, tables [][]int32, seqLens []int32, slots [][]int32) (numSlots int, err error) {
	ng := m.NumGroups()
	if len(tables) != 0 && len(tables) != ng || len(slots) != 0 && len(slots) != ng {
		return 0, kverr.Errorf(kverr.InvalidArgument, "describe groups: %d tables and %d slot mappings for %d groups (give none or one per group)", len(tables), len(slots), ng)
	}
	n := len(ids)
	if err := checkBatch("describe groups", n); err != nil {
		return 0, err
	}
	anyTable := false
	for g, tbl := range tables {
		if err := checkDescribe("describe groups", fmt.Sprintf("group %d's block table", g), n, maxBlocks, tbl, nil); err != nil {
			return 0, err
		}
		anyTable = anyTable || tbl != nil
	}
	if err := checkDescribe("describe groups", "", n, maxBlocks, nil, seqLens); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	batch, total, err := m.describeBatch("describe groups", ids, maxBlocks, anyTable)
	if err != nil {
		return 0, err
	}
	for g, sl := range slots {
		if sl != nil && total > len(sl) && m.hasSlots(g) {
			return 0, kverr.Errorf(kverr.BufferTooSmall, "describe groups: the batch has %d new tokens, group %d's slot mapping holds %d", total, g, len(sl))
		}
	}
	for g := 0; g < ng; g++ {
		var tbl, sl []int32
		if len(tables) > 0 {
			tbl = tables[g]
		}
		if len(slots) > 0 {
			sl = slots[g]
		}
		if tbl == nil && sl == nil {
			continue
		}
		k := 0
		for i, s := range batch {
			own := s.blocks
			if g > 0 {
				own = s.extra()[g-1].blocks
			}
			if tbl != nil {
				row := tbl[i*maxBlocks : (i+1)*maxBlocks]
				fillNoBlock(row[copy(row, own):])
			}
			if sl != nil && m.hasSlots(g) {
				k += m.writeSlots(own, s.length, int(s.fresh), sl[k:])
			}
		}
	}
	if seqLens != nil {
		for i, s := range batch {
			seqLens[i] = int32(s.length)
		}
	}
	return total, nil
}

// hasSlots reports whether group g's sequences have slots: its blocks hold
// tokens (a recurrent group's hold states).
func (m *Manager) hasSlots(g int) bool { return g == 0 || m.groups.extra[g-1].Kind != Recurrent }

// GroupBlocks returns the blocks each layer group holds now (a block
// shared by forked sequences counts once). O(num_blocks + blocks held).
func (m *Manager) GroupBlocks() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]int, m.NumGroups())
	seen := make([]bool, m.pool.NumBlocks())
	count := func(g int, bs []int32) {
		for _, b := range bs {
			if b >= 0 && !seen[b] {
				seen[b] = true
				out[g]++
			}
		}
	}
	for _, s := range m.seqs.all() {
		count(0, s.blocks)
		for g := range s.extra() {
			count(g+1, s.extra()[g].blocks)
		}
	}
	return out
}

// checkGroups verifies s's group tables: their lengths, the dropped
// entries (exactly the first gone, never a block the next query reads),
// every other entry in use; refs counts their references.
func (m *Manager) checkGroups(id int64, s *seq, refs, pins []int32, bad func(string, ...any) error) error {
	if len(s.extra()) != len(m.groups.extra) {
		return bad("sequence %d has %d group tables for %d groups", id, len(s.extra()), len(m.groups.extra))
	}
	for g, grp := range m.groups.extra {
		t := &s.extra()[g]
		want := len(s.blocks)
		if grp.Kind == Recurrent {
			want = 1
		}
		if len(t.blocks) != want || t.gone < 0 || t.gone > len(t.blocks) {
			return bad("sequence %d's group %d table has %d entries (%d dropped), %d expected", id, g+1, len(t.blocks), t.gone, want)
		}
		if grp.Kind == SlidingWindow && t.gone > m.keepFrom(s.length-int(s.fresh), grp.Window) {
			return bad("sequence %d's group %d dropped %d blocks; its queries still read from block %d", id, g+1, t.gone, m.keepFrom(s.length-int(s.fresh), grp.Window))
		}
		for j, b := range t.blocks {
			if j < t.gone {
				if b != NoBlock {
					return bad("sequence %d's group %d entry %d is block %d, dropped", id, g+1, j, b)
				}
				continue
			}
			if m.pool.State(b) != blocks.InUse {
				return bad("sequence %d's group %d holds block %d in state %s", id, g+1, b, m.pool.State(b))
			}
			refs[b]++
		}
		if grp.Kind != Recurrent && s.length%m.bs != 0 {
			if last := t.blocks[len(t.blocks)-1]; m.pool.Ref(last) != 1 {
				return bad("sequence %d's group %d partial last block %d has ref %d", id, g+1, last, m.pool.Ref(last))
			}
		}
		if grp.Kind == Recurrent && m.pool.Ref(t.blocks[0]) != 1+pins[t.blocks[0]] {
			return bad("sequence %d's state block %d in group %d has ref %d (%d of them queued copies')", id, t.blocks[0], g+1,
				m.pool.Ref(t.blocks[0]), pins[t.blocks[0]])
		}
	}
	return nil
}
