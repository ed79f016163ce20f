// Package testtok makes the token sequences of tests: runs of consecutive
// ids, and draws from a vocabulary (a small one makes prompts collide and
// share blocks).
package testtok

import "math/rand/v2"

// Iota returns the n consecutive tokens from start.
func Iota(start, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(start + i)
	}
	return out
}

// Rand returns n tokens drawn by r from [0, vocab).
func Rand(r *rand.Rand, n, vocab int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(r.IntN(vocab))
	}
	return out
}
