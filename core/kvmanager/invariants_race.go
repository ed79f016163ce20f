//go:build race

package kvmanager

// checkEveryCall: a build with the race detector is a test build (make
// test and CI run go test -race), so it verifies every invariant after
// every call that may change a manager (see unlock). A block's reference
// count lives in the pool and, for a cached block, again as the prefix
// index's lock count; this is what keeps the two equal in every test
// instead of only where a test calls CheckInvariants.
const checkEveryCall = true
