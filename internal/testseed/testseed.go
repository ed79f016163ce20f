// Package testseed gives randomized tests a seed that a failure can be
// replayed with: fresh on every run, so that runs explore new inputs, and
// logged (go test prints a test's log when it fails, and under -v) with the
// environment setting that repeats it.
package testseed

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
)

// Env names the environment variable that fixes the seed, to replay a
// failure: KVPLUG_TEST_SEED=<the logged seed> go test -run <the test> ...
const Env = "KVPLUG_TEST_SEED"

// Seed returns the seed of t's random inputs: KVPLUG_TEST_SEED when it is
// set, a fresh random one otherwise. It logs the seed either way.
func Seed(t testing.TB) uint64 {
	t.Helper()
	if v := os.Getenv(Env); v != "" {
		s, err := strconv.ParseUint(v, 0, 64)
		if err != nil {
			t.Fatalf("%s=%q is not an unsigned 64-bit integer: %v", Env, v, err)
		}
		t.Logf("seed %d (from %s)", s, Env)
		return s
	}
	s := rand.Uint64()
	t.Logf("seed %d: replay with %s=%d", s, Env, s)
	return s
}

// Rand is a random source seeded with Seed(t); stream is the PCG's second
// word, which keeps one package's draws apart from another's under the same
// seed.
func Rand(t testing.TB, stream uint64) *rand.Rand {
	t.Helper()
	return rand.New(rand.NewPCG(Seed(t), stream))
}
