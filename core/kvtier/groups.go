package kvtier

import (
	"encoding/binary"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/core/prefix"
)

// The host tier of a manager with layer groups (issue 33).
//
// A cached node of a grouped manager owns a GPU block per attention
// group: its group-0 block (the node itself) and its companions, the
// blocks holding the same tokens in the other groups (core/kvmanager,
// groupcache.go). The tier keeps them at the granularity the GPU pool has
// them: one host slot per (node, group), keyed GroupKey(hash, group). A
// slot holds one block id across every layer slot of the engine's cache,
// which with the layer-slot layout (core/kvmanager, groups.go) is exactly
// one group's layers of that block, so it is as large as a slot without
// groups, and a window group's companion can be absent from the host tier
// without costing a slot: the window groups keep only the blocks a hit
// point reads, and the host LRU ages every (node, group) on its own.
//
// Demotion. When FlushCopies evicts a node, the manager detaches its
// companions from its group cache (Groups.Detach); the tier demotes the
// node under GroupKey(h, 0) == HostKey(h) and each companion no sequence
// holds under GroupKey(h, g), in the same batch, each op naming its group
// (reserveNode). A host hit needs a node's block in group 0 and in every
// full-attention group, so the tier keeps those all or none: it demotes
// the ones it lacks only when it can demote every one of them (none is a
// block allocated since the last flush, and host slots are not all
// pinned); otherwise it drops them all, and the node's window companions
// with them. A group-0 slot alone would waste a slot, serve no hit, and
// its CPU BlockStored would tell a router of a hit the tier refuses. A
// node the host tier holds already (reloaded, or computed again after a
// host hit that its missing window blocks cut) still has the companions
// the tier lacks demoted: dropping them would leave every later hit cut
// where it was. A window companion is demoted on its own terms: one the
// tier cannot take costs only the hits whose window reads it. A batch thus
// holds up to one op per group for each node evicted, more than the blocks
// the flush wanted free: FlushCopiesTo asks room for them all
// (demoteAhead), since an op left out of the engine's arrays would leave
// its slot for a later hit unwritten.
//
// The host pool ages every slot on its own. A node's group-0 slot is older
// than its full companions' when they were demoted in one batch or pinned
// by one hit (group 0 first in both), so the LRU takes group 0 first, with
// its CPU BlockRemoved, and the companions left behind serve nothing until
// they age out. A node demoted again while such a companion is still
// there gets a group-0 slot younger than it: should the LRU take the
// companion first, the group-0 slot could serve no hit, so it is dropped
// with it (orphaned; with KV events on, where the slots' blocks are
// known), its BlockRemoved sent. The companion may go while the group-0
// slot cannot: reserved for a demotion in flight (reserveNode pins a
// node's resident companions only while the node's own reservations
// evict, so a later node's reservation, in the same flush or a later one,
// may take them), or pinned. The node is then marked (t.orphans), and the
// slot goes when that ends: its completed demotion is aborted instead of
// committed, neither counted failed nor announced; a resident slot is
// dropped at its last unpin, with its BlockRemoved. Unless the node is
// whole again by then (every full companion resident or in flight: the
// node computed again and demoted, its companions only), and is kept. A
// full companion's demotion that fails orphans its node the same way: the
// node's group-0 slot is left without it.
//
// Hits obey the GPU's rule (PinHostGroups): after a GPU match of gpu
// blocks that is group 0's whole cached prefix, the host tier extends it
// to the most blocks H for which every full-attention group has every
// block in [gpu, H) in the host tier, and every window group of W tokens
// has the blocks covering tokens [H*bs-W+1, H*bs) that the next query
// reads: those below gpu on the GPU (companions of the matched nodes),
// those from gpu on in the host tier. Only those window blocks are
// reloaded; the admitted sequence's window tables start with the entries
// before them dropped, as after a GPU hit. A hit is never reported without
// its window blocks.
//
// Recurrent groups, the shared tier, write-through and DemoteEvicted are
// not supported with groups in this version (the manager refuses such a
// config with Unsupported): a recurrent state exists only at checkpoints,
// which a first version would have to demote and reload apart from the
// nodes' K/V.

// GroupKey is the host key of group g's block of the node whose chained
// hash is h: HostKey(h) for group 0 (a manager without groups keys its
// blocks so), and for g > 0 the hash's second eight bytes mixed with g, so
// that a companion's key collides with another key no more often than
// two blocks' keys do.
func GroupKey(h prefix.Hash, g int) uint64 {
	if g == 0 {
		return HostKey(h)
	}
	return binary.BigEndian.Uint64(h[8:16]) ^ uint64(g)*0x9e3779b97f4a7c15
}

// opKey is the host key of a copy op's block.
func opKey(op DemoteOp) uint64 { return GroupKey(op.Hash, op.Group) }

// HostGroup describes a layer group past group 0 to the tier: Window 0
// for full attention, else the sliding window in tokens.
type HostGroup struct{ Window int }

// Companion is a block of an evicted node in group Group (>= 1), which
// Groups.Detach took out of the manager's group cache: Cached in the GPU
// pool (marked, no reference). Node indexes the evicted blocks.
type Companion struct {
	Node  int
	Block int32
	Group int
}

// Groups is the manager's side of a grouped tier, called under its lock.
type Groups interface {
	// HostGroups returns groups 1.. as the tier sees them (the same
	// slice every call: the tier only reads it).
	HostGroups() []HostGroup
	// Detach takes the companions of the nodes the tier just evicted out
	// of the group cache (announcing their removal with KV events on),
	// appends to dst those no sequence holds, still Cached for the tier to
	// demote or free, and returns dst.
	Detach(evicted []prefix.EvictedBlock, dst []Companion) []Companion
	// Released is told of a companion whose last reference a completed
	// reload dropped (Cached now), for the group cache's eviction lists.
	Released(c int32)
}

// groupReload is a pinned host slot of a grouped hit: block j of the
// prompt in group g.
type groupReload struct {
	slot host.Slot
	j, g int
}

// reserveNode is reserveDemotions for evicted node i (t.evInfo[i]; toks:
// its tokens, with KV events) and its companions, the first of comps
// (t.comps from the node's on, those with Node i): it appends the node's
// demotions to ops by the package comment's rule, frees the blocks it does
// not demote, and returns ops and how many of comps were the node's. A
// node dropped for want of host slots counts each of its blocks in
// SkippedFull.
func (t *Tier) reserveNode(ops []DemoteOp, i int, comps []Companion, toks []int32, hold bool, op string) ([]DemoteOp, int) {
	ev := &t.evInfo[i]
	n := 0
	for n < len(comps) && comps[n].Node == i {
		n++
	}
	comps = comps[:n]
	gs := t.groups.HostGroups()
	// need: the groups a hit needs (group 0 and the full ones) whose
	// blocks the host tier lacks, with their blocks; held: the host slots
	// of the others, pinned while the node's reservations evict, which
	// must not make room for the node's other blocks.
	var need, held [1 + limits.LayerGroups]int32
	var needG [1 + limits.LayerGroups]int
	var lacks [1 + limits.LayerGroups]bool
	nNeed, nHeld := 0, 0
	ok := true
	for g := 0; g <= len(gs); g++ {
		if g > 0 && gs[g-1].Window > 0 {
			continue
		}
		s, st := t.cfg.Pool.State(GroupKey(ev.Hash, g))
		if st == host.Resident {
			assertOK(t.cfg.Pool.Pin(s), op+": pinning a node's host slot")
			held[nHeld] = int32(s)
			nHeld++
		}
		if st != host.Absent {
			continue // resident, or its copy in flight
		}
		b := int32(-1)
		if g == 0 {
			b = ev.Block
		}
		for _, c := range comps {
			if c.Group == g {
				b = c.Block
			}
		}
		if b < 0 || t.stamp[b] == t.epoch {
			// Not on the GPU (a full companion goes with its node, so
			// never), or allocated since the last flush: its K/V is not
			// written yet (reserveOne).
			ok = false
			if !hold {
				t.st.EvictedUndemoted += int64(1 + len(comps))
			}
			break
		}
		need[nNeed], needG[nNeed], lacks[g] = b, g, true
		nNeed++
	}
	var slots [1 + limits.LayerGroups]host.Slot
	k := 0 // slots reserved
	for ; ok && k < nNeed; k++ {
		s, gone, err := t.cfg.Pool.ReserveEvict(GroupKey(ev.Hash, needG[k]))
		if err != nil { // every slot pinned (the keys were absent)
			ok = false
			t.st.SkippedFull += int64(1 + len(comps))
			if !hold {
				t.st.EvictedUndemoted += int64(1 + len(comps))
			}
			break
		}
		if t.events {
			t.hostEvicted(s, gone, op) // gone, whatever becomes of the node
		}
		slots[k] = s
	}
	switch {
	case !ok:
		for _, s := range slots[:k] {
			assertOK(t.cfg.Pool.Abort(s), op+": giving a node's host slot back")
		}
		t.freeBlock(ev.Block, op)
		for _, c := range comps {
			t.freeBlock(c.Block, op)
		}
	default:
		for j := range nNeed {
			var bt []int32 // a companion's slot is not announced
			if needG[j] == 0 {
				bt = toks
			}
			ops = t.demoteInto(ops, ev, need[j], needG[j], slots[j], bt, hold, op)
		}
		if !lacks[0] {
			t.st.SkippedPresent++
			t.freeBlock(ev.Block, op)
		}
		for _, c := range comps {
			switch {
			case gs[c.Group-1].Window > 0:
				ops = t.reserveOne(ops, ev, c.Block, c.Group, nil, hold, op)
			case !lacks[c.Group]:
				t.st.SkippedPresent++
				t.freeBlock(c.Block, op)
			}
		}
	}
	for _, s := range held[:nHeld] {
		assertOK(t.cfg.Pool.Unpin(host.Slot(s)), op+": unpinning a node's host slot")
		t.unpinned(host.Slot(s), op)
	}
	return ops, n
}

// orphaned notes that the host tier lost node h's block of group g (a
// companion; with KV events on: evicted by the host pool, under
// hostEvicted, or its demotion failed): when g is a full-attention group,
// no host hit can use the node any more, so its group-0 slot goes too and
// its BlockRemoved joins t.gone, instead of announcing a hit the tier
// refuses until it ages out. A group-0 slot reserved or pinned cannot go
// now: the node is marked, and the slot goes once its copy completes
// (abandoned) or its last pin goes (unpinned). (Its other full companions
// age out on their own: announced by none.)
func (t *Tier) orphaned(h prefix.Hash, g int, op string) {
	if gs := t.groups.HostGroups(); g > len(gs) || gs[g-1].Window > 0 {
		return
	}
	s := t.cfg.Pool.Drop(HostKey(h))
	if s == host.NoSlot {
		if s, st := t.cfg.Pool.State(HostKey(h)); st != host.Absent && int(s) < len(t.meta) && t.meta[s].group == 0 && t.meta[s].hash == h {
			if t.orphans == nil {
				t.orphans = make(map[prefix.Hash]struct{})
			}
			t.orphans[h] = struct{}{}
		}
		return
	}
	t.dropGroupZero(s, h, op)
}

// dropGroupZero notes that the host pool dropped slot s, node h's
// announced group-0 block: its BlockRemoved joins t.gone.
func (t *Tier) dropGroupZero(s host.Slot, h prefix.Hash, op string) {
	if int(s) >= len(t.meta) || !t.meta[s].resident || t.meta[s].group != 0 || t.meta[s].hash != h {
		panic(kverr.Errorf(kverr.Internal, "kvtier: %s: dropped host slot %d holds no announced group-0 block of %s", op, s, h))
	}
	t.meta[s].resident = false
	t.gone = append(t.gone, h)
	t.nResident--
}

// whole reports whether the host tier holds, or is demoting, node h's
// block in every full-attention group past 0.
func (t *Tier) whole(h prefix.Hash) bool {
	for g, hg := range t.groups.HostGroups() {
		if _, st := t.cfg.Pool.State(GroupKey(h, g+1)); hg.Window == 0 && st == host.Absent {
			return false
		}
	}
	return true
}

// abandoned reports whether demotion op, whose copy has completed, must
// be aborted instead of committed: its node's group-0 slot, orphaned
// while in flight and not whole again. It clears op's node's mark.
func (t *Tier) abandoned(op DemoteOp) bool {
	if op.Group != 0 || len(t.orphans) == 0 {
		return false
	}
	if _, ok := t.orphans[op.Hash]; !ok {
		return false
	}
	delete(t.orphans, op.Hash)
	return !t.whole(op.Hash)
}

// unpinned settles slot s, a resident slot the caller just unpinned (a
// reload's, or a node's that reserveNode held): a group-0 slot whose node
// was orphaned while it was pinned is dropped now, its BlockRemoved
// joining t.gone (which the caller records), unless the node is whole
// again, or another pin still holds the slot (whose unpin settles it).
func (t *Tier) unpinned(s host.Slot, op string) {
	if len(t.orphans) == 0 || int(s) >= len(t.meta) || !t.meta[s].resident || t.meta[s].group != 0 {
		return
	}
	h := t.meta[s].hash
	if _, ok := t.orphans[h]; !ok {
		return
	}
	if t.whole(h) {
		delete(t.orphans, h)
		return
	}
	if d := t.cfg.Pool.Drop(HostKey(h)); d != host.NoSlot {
		delete(t.orphans, h)
		t.dropGroupZero(d, h, op)
	}
}

// freeBlock frees evicted block b, Cached in the GPU pool, undemoted.
func (t *Tier) freeBlock(b int32, op string) {
	t.one[0] = b
	assertOK(t.gpu.Evict(t.one[:]), op+": an evicted block is not Cached in the pool")
}

// keepFrom is the first block a window of w tokens reads for a query at
// position pos.
func (t *Tier) keepFrom(pos, w int) int { return max(0, pos-w+1) / t.bs }

// resident reports whether the host tier holds key k, committed, without
// touching its LRU.
func (t *Tier) resident(k uint64) bool {
	_, st := t.cfg.Pool.State(k)
	return st == host.Resident
}

// hostGroupHit is the host part of a grouped hit for a prompt whose first
// gpu blocks the GPU matched (group 0's whole cached prefix), over t.hashes
// (the prompt's chained hashes up to limit): the most blocks H > gpu the
// hit can reach (the package comment's rule), or gpu when none. gpuHas
// reports whether the GPU holds group g's companion of matched block j <
// gpu.
func (t *Tier) hostGroupHit(gpu, limit int, gpuHas func(j, g int) bool) int {
	gs := t.groups.HostGroups()
	h := gpu
	for h < limit {
		ok := t.resident(GroupKey(t.hashes[h], 0))
		for g := 1; ok && g <= len(gs); g++ {
			ok = gs[g-1].Window > 0 || t.resident(GroupKey(t.hashes[h], g))
		}
		if !ok {
			break
		}
		h++
	}
	has := func(j, g int) bool {
		if j < gpu {
			return gpuHas(j, g)
		}
		return t.resident(GroupKey(t.hashes[j], g))
	}
	// As the GPU's windowHit: the last missing window block a hit point
	// reads caps it, until every window group holds what it reads.
	for changed := true; changed && h > gpu; {
		changed = false
		for g := 1; g <= len(gs) && h > gpu; g++ {
			w := gs[g-1].Window
			if w == 0 {
				continue
			}
			for h > gpu {
				miss := -1
				for j := h - 1; j >= t.keepFrom(h*t.bs, w); j-- {
					if !has(j, g) {
						miss = j
						break
					}
				}
				if miss < 0 {
					break
				}
				h, changed = miss, true
			}
		}
	}
	return max(h, gpu)
}

// PinHostGroups is PinHost for a manager with layer groups: it matches
// the prompt's blocks beyond its first gpu, group 0's whole cached prefix
// on the GPU, by the package comment's rule, pins the host slots of every
// group's blocks the hit reloads, and returns how many blocks beyond gpu
// it hit. gpuHas reports whether the GPU holds group g's companion of
// matched block j < gpu. QueueGroupReloads then queues the reloads.
func (t *Tier) PinHostGroups(tokens []int32, keys *prefix.Keys, gpu int, gpuHas func(j, g int) bool) int {
	t.greloads = t.greloads[:0]
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / t.bs
	}
	if limit <= gpu || t.cfg.Pool.Stats().Resident == 0 {
		return 0
	}
	t.chain(tokens, keys, limit, "admit: hashing a validated prompt")
	h := t.hostGroupHit(gpu, limit, gpuHas)
	if h == gpu {
		return 0
	}
	gs := t.groups.HostGroups()
	t.keys = t.keys[:0]
	for g := 0; g <= len(gs); g++ {
		from := gpu
		if g > 0 && gs[g-1].Window > 0 {
			from = max(gpu, t.keepFrom(h*t.bs, gs[g-1].Window))
		}
		for j := from; j < h; j++ {
			t.keys = append(t.keys, GroupKey(t.hashes[j], g))
			t.greloads = append(t.greloads, groupReload{j: j, g: g})
		}
	}
	if cap(t.slots) < len(t.keys) {
		t.slots = make([]host.Slot, len(t.keys))
	}
	t.slots = t.slots[:len(t.keys)]
	n, err := t.cfg.Pool.PinPrefix(t.keys, t.slots)
	if err != nil || n < len(t.keys) {
		// Under the manager's lock every key checked resident stays so
		// (the tier is the pool's only writer); a closed pool is a miss.
		for _, s := range t.slots[:n] {
			assertOK(t.cfg.Pool.Unpin(s), "admit: unpinning a host hit given up")
		}
		t.greloads = t.greloads[:0]
		return 0
	}
	for i := range t.greloads {
		t.greloads[i].slot = t.slots[i]
	}
	return h - gpu
}

// QueueGroupReloads records the reloads of the slots PinHostGroups pinned
// into the admitted sequence's blocks (block(j, g): its group g's block j,
// fresh) and takes the ops' references on them; LockReloads then takes
// the locks on the group-0 blocks the prefix cache holds.
func (t *Tier) QueueGroupReloads(block func(j, g int) int32) {
	for _, r := range t.greloads {
		b := block(r.j, r.g)
		t.reloads = append(t.reloads, ReloadOp{Slot: r.slot, Block: b, Group: r.g})
		t.one[0] = b
		assertOK(t.gpu.Incref(t.one[:]), "admit: referencing a reload's block")
		t.st.Reloads++ // every copy; the hit's tokens are group 0's
		if r.g == 0 {
			t.st.HostHitTokens += int64(t.bs)
		}
	}
	t.greloads = t.greloads[:0]
}

// MatchHostGroups is MatchHost for a manager with layer groups: the
// tokens of the blocks past the GPU's match of gpuTokens that a grouped
// hit would reload (PinHostGroups' rule), touching nothing; none unless
// whole (the GPU match is group 0's whole cached prefix).
func (t *Tier) MatchHostGroups(tokens []int32, keys *prefix.Keys, gpuTokens int, whole bool, gpuHas func(j, g int) bool) int {
	t.st.MatchQueries++
	t.st.MatchGPUTokens += int64(gpuTokens)
	gpu := gpuTokens / t.bs
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / t.bs
	}
	if !whole || limit <= gpu {
		return 0
	}
	t.chain(tokens, keys, limit, "match tiers: hashing a validated prompt")
	hit := t.hostGroupHit(gpu, limit, gpuHas) - gpu
	t.st.MatchHostTokens += int64(hit * t.bs)
	return hit * t.bs
}
