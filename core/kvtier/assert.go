package kvtier

import "github.com/kvplug/kvplug/core/kverr"

// assertOK panics with an Internal error if err, from a call documented as
// unable to fail, is not nil: as the manager's own (core/kvmanager,
// assert.go), a failure is a bug of the tier, which the manager's callers
// see as KVP_ERR_INTERNAL. what names the assumption that failed.
func assertOK(err error, what string) {
	if err != nil {
		panic(kverr.Wrap(kverr.Internal, err, "kvtier: %s", what))
	}
}
