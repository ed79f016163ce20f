// Package cascadetest holds batches with shared prefixes for the tests of
// the shared-prefix planner's callers (core/attn, capi), so that they plan
// the same block tables.
package cascadetest

// SharedPrefixBatch is 6 sequences of block size 16 sharing a 512-token
// prompt (32 blocks), sequences 0-2 sharing 256 more, each with its own
// tail: the block table (batch rows of cols columns) and the lengths.
func SharedPrefixBatch() (table, lens []int32, batch, cols int) {
	const B, C = 6, 64
	table = make([]int32, B*C)
	lens = make([]int32, B)
	next := int32(100)
	for s := 0; s < B; s++ {
		for c := 0; c < C; c++ {
			switch {
			case c < 32:
				table[s*C+c] = int32(c)
			case c < 48 && s < 3:
				table[s*C+c] = int32(c + 1000)
			default:
				table[s*C+c] = next
				next++
			}
		}
		lens[s] = int32(768 + 17*s)
	}
	return table, lens, B, C
}
