package prefix

// RequestSnapshot replaces the undrained events with AllCleared and a
// BlockStored for every block cached now (parents first), as after a full
// queue, for a consumer that lost its view of the cache (a router that
// restarted, or missed more than its publisher kept for replay). Events
// after the call follow the snapshot. A no-op when events are off. The
// replaced events are not counted as dropped: the snapshot says all they
// said.
func (x *Index) RequestSnapshot() {
	if x.events.on {
		x.snapshot()
	}
}
