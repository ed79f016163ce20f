package prefix

import (
	"encoding/binary"
	"math/bits"
	"unsafe"
)

// A block's hash input (HASH.md) is short for the usual block sizes: 101
// bytes at 16 tokens. XXH3-128 reads an input of 17 to 128 bytes as a few
// 64-bit words at fixed distances from its two ends, so the hash of a
// block with no multimodal entry and no salt can be computed from the
// parent hash, the adapter and the caller's tokens in place, without
// writing the input out first: no copy of the tokens, and no load that
// straddles bytes just stored (the parent hash sits at byte 1, so every
// word of the written-out header mixes two stores, which the processor
// cannot forward to the load; the chain of a prompt's blocks waits on
// that once per block). hashShort is that computation; it returns what
// Sum(AppendBlockInput(...)) returns, which the tests check for every
// block size it takes.

// XXH3's default secret, its first 128 bytes as little-endian words (the
// words the 17-128 byte path reads), and the primes it multiplies by.
const (
	xxhPrime64_1 = 11400714785074694791
	xxhPrime64_2 = 14029467366897019727
	xxhPrime64_4 = 9650029242287828579

	xxhKey000 uint64 = 0xbe4ba423396cfeb8
	xxhKey008 uint64 = 0x1cad21f72c81017c
	xxhKey016 uint64 = 0xdb979083e96dd4de
	xxhKey024 uint64 = 0x1f67b3b7a4a44072
	xxhKey032 uint64 = 0x78e5c0cc4ee679cb
	xxhKey040 uint64 = 0x2172ffcc7dd05a82
	xxhKey048 uint64 = 0x8e2443f7744608b8
	xxhKey056 uint64 = 0x4c263a81e69035e0
	xxhKey064 uint64 = 0xcb00c391bb52283c
	xxhKey072 uint64 = 0xa32e531b8b65d088
	xxhKey080 uint64 = 0x4ef90da297486471
	xxhKey088 uint64 = 0xd8acdea946ef1938
	xxhKey096 uint64 = 0x3f349ce33f76faa8
	xxhKey104 uint64 = 0x1d4f0bc7c7bbdcf9
	xxhKey112 uint64 = 0x3159b4cd4be0518a
	xxhKey120 uint64 = 0x647378d9c97e9fc8
)

// shortBlock reports whether hashShort takes blocks of bs tokens: the
// input (37 + 4*bs bytes with no entries and no salt) is at most 128
// bytes, and every word XXH3 reads lies in the 21-byte header, wholly in
// the tokens, or in the 16-byte trailer. That holds for 4-6 and 8-22
// tokens (7 tokens would read a word across the header's end). Token
// bytes are read in place, so the host must be little-endian.
func shortBlock(bs int) bool {
	return hostLittleEndian && (bs >= 4 && bs <= 6 || bs >= 8 && bs <= 22)
}

func mulFold64(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}

func xxh3Avalanche(x uint64) uint64 {
	x ^= x >> 37
	x *= 0x165667919e3779f9
	return x ^ x>>32
}

// hashShort returns the hash of the block with these parent, tokens and
// adapter, no multimodal entry and no salt; shortBlock(len(tokens)) holds.
//
// The input of l = 37 + n bytes (n = 4*len(tokens)) is, by byte offset:
// [0] the version, [1, 17) the parent, [17, 21) the token count, [21,
// 21+n) the tokens, then the adapter (8 bytes) and two zero counts (8
// bytes). XXH3 (17-128 bytes) reads the words at 0, 8, 16, ... from the
// front and l-8, l-16, ... from the back, as many as l needs; from the
// back, l-8 is the zero counts, l-16 the adapter and l-24-8k the token
// bytes n-8-8k; from the front, 0 and 8 are the version and parent, 16
// the parent's last byte, the count and the first three token bytes, and
// 24+8k the token bytes 3+8k.
func hashShort(parent *Hash, tokens []int32, adapter uint64) Hash {
	tb := tokenBytes(tokens)
	n := len(tb)
	l := uint64(37 + n)
	// Every offset below is in [0, n-8] for the block sizes shortBlock
	// takes (the tests cover each), so the words are read without bounds
	// checks, as 8-byte arrays (one load where the processor allows an
	// unaligned one).
	base := unsafe.Pointer(unsafe.SliceData(tb))
	word := func(o int) uint64 { return binary.LittleEndian.Uint64((*[8]byte)(unsafe.Add(base, o))[:]) }
	ph := binary.LittleEndian.Uint64(parent[0:8])
	pl := binary.LittleEndian.Uint64(parent[8:16])
	w0 := HashVersion | ph<<8
	w8 := ph>>56 | pl<<8
	w16 := pl>>56 | uint64(len(tokens))<<8 | uint64(binary.LittleEndian.Uint32(tb[0:4]))<<40

	// The rounds in XXH3's order: the innermost words last.
	lo := l * xxhPrime64_1
	var hi uint64
	if l > 64 {
		if l > 96 {
			in8, in7 := word(n-48), word(n-40)
			i6, i7 := word(27), word(35)
			hi += mulFold64(in8^xxhKey112, in7^xxhKey120)
			hi ^= i6 + i7
			lo += mulFold64(i6^xxhKey096, i7^xxhKey104)
			lo ^= in8 + in7
		}
		in6, in5 := word(n-32), word(n-24)
		i4, i5 := word(11), word(19)
		hi += mulFold64(in6^xxhKey080, in5^xxhKey088)
		hi ^= i4 + i5
		lo += mulFold64(i4^xxhKey064, i5^xxhKey072)
		lo ^= in6 + in5
	}
	in4, in3 := word(n-16), word(n-8)
	i3 := word(3)
	hi += mulFold64(in4^xxhKey048, in3^xxhKey056)
	hi ^= w16 + i3
	lo += mulFold64(w16^xxhKey032, i3^xxhKey040)
	lo ^= in4 + in3
	// in2 is the adapter, in1 the two zero counts.
	hi += mulFold64(adapter^xxhKey016, xxhKey024)
	hi ^= w0 + w8
	lo += mulFold64(w0^xxhKey000, w8^xxhKey008)
	lo ^= adapter

	hi, lo = lo*xxhPrime64_1+hi*xxhPrime64_4+l*xxhPrime64_2, hi+lo
	var h Hash
	binary.BigEndian.PutUint64(h[0:8], -xxh3Avalanche(hi))
	binary.BigEndian.PutUint64(h[8:16], xxh3Avalanche(lo))
	return h
}
