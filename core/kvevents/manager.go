package kvevents

import (
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

// managerSource publishes a manager's events.
type managerSource struct{ m *kvmanager.Manager }

// ManagerSource returns the Source of m's KV events; m must record them
// (enable_kv_events). While a Publisher uses it, it is m's one consumer of
// events: DrainEvents elsewhere would take part of the stream.
func ManagerSource(m *kvmanager.Manager) (Source, error) {
	if _, _, err := m.NextEventSize(); err != nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "event publisher: the manager records no KV events: create it with enable_prefix_cache and enable_kv_events")
	}
	return managerSource{m}, nil
}

func (s managerSource) Drain() ([]prefix.Event, error) {
	return s.m.DrainEvents(kvmanager.NoEventLimits)
}

func (s managerSource) Snapshot() error { return s.m.RequestEventSnapshot() }
