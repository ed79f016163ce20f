//go:build !race

package kvmanager

// checkEveryCall is off in release builds: CheckInvariants is O(pool size)
// and would dominate a scheduler step (see invariants_race.go).
const checkEveryCall = false
