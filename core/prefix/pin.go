package prefix

import (
	"math"

	"github.com/kvplug/kvplug/core/kverr"
)

// Pin pins the cached full blocks of a prompt's prefix (every cached full
// block, the last one included, unlike Match) so they are never evicted,
// until Unpin with the returned id. It stops at the prefix's first pending
// block (computed.go): a pin promises K/V that stays, and a pending block's
// may never be computed. Pins count: a block stays pinned while
// any pin covers it. Blocks of the prefix cached later are not covered; pin
// again to cover them. It returns the number of blocks pinned; a prefix
// with no cached block is NotFound. Pinning is not an access.
//
// Pins are named by id rather than by prompt so that Unpin releases exactly
// what its Pin took, whatever was cached or pinned in between.
func (x *Index) Pin(tokens []int32, keys *Keys) (PinID, int, error) {
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("pin"); err != nil {
		return 0, 0, err
	}
	x.walk(tokens, keys, len(tokens)/x.bs)
	x.path = x.computedPrefix(x.path)
	if len(x.path) == 0 {
		return 0, 0, kverr.Errorf(kverr.NotFound, "pin: no computed block of this %d-token prefix is cached", len(tokens))
	}
	for _, i := range x.path {
		if x.nodes[i].pin == math.MaxInt32 {
			return 0, 0, kverr.Errorf(kverr.InvalidArgument, "pin: block %d holds 2^31-1 pins", x.nodes[i].block)
		}
	}
	for _, i := range x.path {
		n := &x.nodes[i]
		n.pin++
		if n.pin == 1 {
			x.nPinned++
			x.hold(i, +1)
			x.settle(i)
		}
	}
	id := x.nextPin
	x.nextPin++
	x.pins[id] = x.path[len(x.path)-1]
	return id, len(x.path), nil
}

// Unpin releases the pins of one Pin call. Its blocks stay cached and
// become evictable once nothing else holds them. An unknown id (never
// issued, unpinned already, or dropped by Clear) is NotFound.
func (x *Index) Unpin(id PinID) error {
	deepest, ok := x.pins[id]
	if !ok {
		return kverr.Errorf(kverr.NotFound, "unpin: pin %d is not held", id)
	}
	delete(x.pins, id)
	for i := deepest; i != rootNode; i = x.nodes[i].parent {
		n := &x.nodes[i]
		n.pin--
		if n.pin == 0 {
			x.nPinned--
			x.hold(i, -1)
			x.settle(i)
		}
	}
	return nil
}

// SetPriority sets the eviction priority of the cached full blocks of a
// prompt's prefix (every cached full block, as Pin) and returns how many it
// set. Lower priorities are evicted first; blocks start at 0, and a block
// inserted later under a prioritised prefix starts at 0 too. A prefix with
// no cached block is NotFound.
func (x *Index) SetPriority(tokens []int32, keys *Keys, priority int32) (int, error) {
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("set priority"); err != nil {
		return 0, err
	}
	x.walk(tokens, keys, len(tokens)/x.bs)
	if len(x.path) == 0 {
		return 0, kverr.Errorf(kverr.NotFound, "set priority: no block of this %d-token prefix is cached", len(tokens))
	}
	for _, i := range x.path {
		x.nodes[i].prio = priority
		if x.nodes[i].heapPos >= 0 {
			x.heapFix(i)
		}
	}
	return len(x.path), nil
}
