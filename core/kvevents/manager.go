package kvevents

import (
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

// managerSource publishes a manager's events.
type managerSource struct{ m *kvmanager.Manager }

// ManagerSource returns the Source of m's KV events; m must record them
// (enable_kv_events). It takes every layer group's events
// (DrainGroupEvents), and a Publisher started on it sends each with its
// group (GroupedSource). While a Publisher uses it, it is m's one consumer
// of events: DrainEvents or DrainGroupEvents elsewhere would take part of
// the stream.
func ManagerSource(m *kvmanager.Manager) (Source, error) {
	if _, _, err := m.NextEventSize(); err != nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "event publisher: the manager records no KV events: create it with enable_prefix_cache and enable_kv_events")
	}
	return managerSource{m}, nil
}

func (s managerSource) Drain() ([]prefix.Event, error) {
	return s.m.DrainGroupEvents(kvmanager.NoEventLimits)
}

// GroupSpecs describes the manager's layer groups on the wire; nil for a
// manager without groups, whose events carry no group.
func (s managerSource) GroupSpecs() []GroupSpec {
	groups := s.m.Groups()
	if len(groups) < 2 {
		return nil
	}
	specs := make([]GroupSpec, len(groups))
	for g, grp := range groups {
		switch grp.Kind {
		case kvmanager.FullAttention:
			specs[g] = GroupSpec{Kind: SpecFullAttention}
		case kvmanager.SlidingWindow:
			specs[g] = GroupSpec{Kind: SpecSlidingWindow, SlidingWindow: grp.Window}
		case kvmanager.Recurrent:
			specs[g] = GroupSpec{Kind: SpecMamba}
		}
	}
	return specs
}

func (s managerSource) Snapshot() error { return s.m.RequestEventSnapshot() }
