package kvmanager

import "github.com/kvplug/kvplug/core/kverr"

// RequestEventSnapshot replaces the undrained KV events (those carried
// between drains too) with AllCleared and a BlockStored for every cached
// block, so that the next DrainEvents gives a consumer the whole cache:
// what an event publisher asks for when it starts, or when a subscriber
// missed more than it can replay. Errors: InvalidArgument (KV events off).
func (m *Manager) RequestEventSnapshot() error {
	m.mu.Lock()
	defer m.unlock()
	if m.cache == nil || !m.cache.EventsEnabled() {
		return kverr.Errorf(kverr.InvalidArgument, "event snapshot: KV events are off (enable_kv_events in the manager's config)")
	}
	m.carry = nil
	m.cache.RequestSnapshot()
	return nil
}
