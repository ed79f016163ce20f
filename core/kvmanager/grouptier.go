package kvmanager

import (
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/prefix"
)

// The host tier with layer groups: core/kvtier's groups.go has the rule
// (one host slot per cached node and attention group; hits only where
// every window group has the blocks its next query reads, as on the GPU).
// The manager's part: it hands the tier the companions of the nodes the
// tier evicts (tierGroups.Detach), tells it which companions the GPU
// holds below a hit, admits a host hit with its window tables dropped
// before what the hit point reads (takeCompanions, allocExtra) and its
// companions reloaded, and lists a window companion a reload released.

// checkGroupTier refuses, with Unsupported, the host tier configs a
// manager with groups does not hold in this version.
func checkGroupTier(cfg *Config) error {
	for g, grp := range cfg.Groups {
		if grp.Kind == Recurrent {
			return kverr.Errorf(kverr.Unsupported, "layer groups: the host tier does not hold recurrent groups' states in this version (group %d is recurrent): use the GPU prefix cache alone, or no recurrent groups", g)
		}
	}
	h := cfg.HostTier
	switch {
	case h.Shared != nil:
		return kverr.Errorf(kverr.Unsupported, "layer groups: the shared tier does not hold layer groups in this version")
	case h.WriteThrough > 0:
		return kverr.Errorf(kverr.Unsupported, "layer groups: the host tier's write-through does not hold layer groups in this version (write_through 0 demotes ahead of need)")
	case h.DemoteEvicted:
		return kverr.Errorf(kverr.Unsupported, "layer groups: the host tier's demote_evicted does not hold layer groups in this version")
	}
	return nil
}

// tierGroups is the manager's side of a grouped host tier
// (kvtier.Groups), called under the manager's lock.
type tierGroups struct{ m *Manager }

// HostGroups implements kvtier.Groups.
func (tg tierGroups) HostGroups() []kvtier.HostGroup {
	gs := &tg.m.groups
	if gs.host == nil {
		gs.host = make([]kvtier.HostGroup, len(gs.extra))
		for g, grp := range gs.extra {
			if grp.Kind == SlidingWindow {
				gs.host[g].Window = grp.Window
			}
		}
	}
	return gs.host
}

// Detach implements kvtier.Groups: the evicted nodes' companions leave the
// group cache as nodesGone has them leave it, but those no sequence holds
// stay Cached, for the tier to demote.
func (tg tierGroups) Detach(evicted []prefix.EvictedBlock, dst []kvtier.Companion) []kvtier.Companion {
	m := tg.m
	for i := range evicted {
		m.dropCompanions(evicted[i].Block, evicted[i].Hash, func(g int, c int32) bool {
			dst = append(dst, kvtier.Companion{Node: i, Block: c, Group: g + 1})
			return true
		})
	}
	m.flushGone()
	return dst
}

// Released implements kvtier.Groups: a window companion left with no
// reference is listed, as kept (its node's hit reloaded it).
func (tg tierGroups) Released(c int32) {
	gc := tg.m.gc
	if b := gc.owner[c]; b != NoBlock && gc.class[c] == compNone && tg.m.groups.extra[gc.ownerGroup[c]].Kind == SlidingWindow {
		gc.push(c, compKept)
	}
}

// gpuHas returns the tier's view of the companions of matched: whether
// group g (>= 1) holds one for matched block j.
func (m *Manager) gpuHas(matched []int32) func(j, g int) bool {
	return func(j, g int) bool { return m.gc.comp[g-1][matched[j]] != NoBlock }
}

// groupBlock is s's block j in group g.
func (s *seq) groupBlock(j, g int) int32 {
	if g == 0 {
		return s.blocks[j]
	}
	return s.extra()[g-1].blocks[j]
}

// droppedAhead counts the entries past the first k of s's window tables
// that its admission dropped (a host hit's, before what its hit point
// reads): blocks the admission does not allocate.
func (m *Manager) droppedAhead(s *seq, k int) int {
	n := 0
	for g := range s.extra() {
		n += max(0, s.extra()[g].gone-k)
	}
	return n
}

// hostHitPoint marks s's block hit-1, the end of a host hit, a hit point
// (the window blocks it reads go last) when it was cached.
func (m *Manager) hostHitPoint(s *seq, hit int) {
	b := s.blocks[hit-1]
	if _, ok := m.cache.BlockHash(b); ok && m.gc != nil {
		m.gc.hitPoint[b] = true
	}
}
