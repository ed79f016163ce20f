package kvmanager

import "github.com/kvplug/kvplug/core/kverr"

// How the manager treats its own bugs.
//
// Some calls into the pool and the prefix index cannot fail because the
// manager checked their preconditions first (blocks are free, counts are
// bounded, a cached block's locks equal its references). Such a call's
// error is never discarded: assertOK asserts it, and a failure panics with an
// Internal error naming the broken assumption. That is a bug in kvmanager,
// not a bad argument, so it is not returned as an ordinary error that a
// caller might retry: the C ABI's guard recovers the panic and answers
// KVP_ERR_INTERNAL with the message (and a stack in the log), and a Go
// caller sees the panic. The manager's lock is released on the way out
// (every call unlocks in a defer).
//
// In builds with the race detector (every `go test -race`) each call that
// may change the manager also ends with CheckInvariants (less the rehash of
// cached blocks, which never change after insertion), whose violations
// panic the same way (checkEveryCall; invariants_race.go).

// assertOK panics with an Internal error if err, from a call documented as
// unable to fail, is not nil. what names the assumption that failed.
func assertOK(err error, what string) {
	if err != nil {
		panic(kverr.Wrap(kverr.Internal, err, "kvmanager: %s", what))
	}
}

// unlock releases m.mu at the end of a call that may have changed m. With
// checkEveryCall it first runs CheckInvariants under the lock and panics,
// after unlocking, on a violation, so the manager stays usable for the
// recovered caller's diagnosis.
func (m *Manager) unlock() {
	if !checkEveryCall {
		m.mu.Unlock()
		return
	}
	if r := recover(); r != nil {
		// An assertion failed mid-call: report it, not the half-done state
		// it leaves, which the check would find broken too.
		m.mu.Unlock()
		panic(r)
	}
	err := m.checkInvariants(false)
	m.mu.Unlock()
	if err != nil {
		panic(kverr.Wrap(kverr.Internal, err, "kvmanager: invariant broken by the last call"))
	}
}
