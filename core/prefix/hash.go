package prefix

import (
	"encoding/binary"
	"encoding/hex"
	"slices"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/zeebo/xxh3"
)

// HashVersion is the first byte of every block's hash input (HASH.md). It
// changes whenever the layout does, so hashes of different layouts never
// meet in one index or one router.
const HashVersion = 1

// MaxSaltLen bounds a tenant salt: a salt names a tenant (a key, an id, a
// digest of both); it is not a place for payloads.
const MaxSaltLen = limits.SaltLen

// MaxMMItems bounds the multimodal items of one prompt or sequence, so a
// wrong count from a caller is caught before it is used.
const MaxMMItems = limits.MMItems

// Hash is a block's 128-bit identity: XXH3-128 with seed 0 of the block's
// hash input (HASH.md), in canonical byte order (high 64 bits first, each
// half big-endian): the bytes of Python's xxhash.xxh3_128_digest and of C's
// XXH128_canonicalFromHash. The zero Hash stands for the root: the parent of
// a prompt's first block.
type Hash [16]byte

// String returns the hash as 32 lower-case hex digits.
func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// IsZero reports whether h is the root's (zero) hash.
func (h Hash) IsZero() bool { return h == Hash{} }

// ParseHash parses 32 hex digits.
func ParseHash(s string) (Hash, error) {
	var h Hash
	if len(s) != 2*len(h) {
		return h, kverr.Errorf(kverr.InvalidArgument, "hash must be %d hex digits: got %d characters", 2*len(h), len(s))
	}
	if _, err := hex.Decode(h[:], []byte(s)); err != nil {
		return Hash{}, kverr.Errorf(kverr.InvalidArgument, "hash %q is not hex: %v", s, err)
	}
	return h, nil
}

// MMItem is a multimodal input (an image, an audio clip) of a prompt: its
// placeholder tokens occupy prompt positions [Offset, Offset+Length), and
// Hash is the caller's digest of its content (e.g. of the image's bytes and
// the processor settings). The item enters the hash of every block it
// overlaps (HASH.md).
type MMItem struct {
	Offset int32
	Length int32
	Hash   Hash
}

// Keys are the parts of a prompt's identity besides its tokens.
type Keys struct {
	// Adapter is the LoRA adapter the prompt runs with; 0 is none. It enters
	// every block's hash.
	Adapter uint64
	// MM are the prompt's multimodal items, in strictly increasing Offset
	// order. They describe the whole prompt, so a call given only a prefix
	// of its tokens (a chunk of a chunked prefill) takes the same items:
	// one may extend past the tokens given, or lie wholly beyond them. A
	// full block's hash depends only on the items that overlap it, so
	// every block of the prefix hashes as it does in the whole prompt.
	MM []MMItem
	// Salt isolates a tenant: it enters the first block's hash only, and
	// through the chain every later one, so prompts with different salts
	// share no block. Empty is no salt. At most MaxSaltLen bytes.
	Salt []byte
}

// BlockMM is a multimodal item as one block's hash sees it: Offset is the
// item's first position relative to the block's first position (negative
// when the item began in an earlier block).
type BlockMM struct {
	Offset int32
	Hash   Hash
}

var noKeys Keys

// Validate checks keys as every call that takes keys does; op names the
// call in the error.
func (k *Keys) Validate(op string) error { return k.validate(op) }

// Clone returns a copy of k that shares no memory with it (nil for nil),
// for a caller that keeps keys past the call that gave them.
func (k *Keys) Clone() *Keys {
	if k == nil {
		return nil
	}
	c := &Keys{Adapter: k.Adapter}
	if len(k.MM) > 0 {
		c.MM = slices.Clone(k.MM)
	}
	if len(k.Salt) > 0 {
		c.Salt = slices.Clone(k.Salt)
	}
	return c
}

// validate checks keys: a salt of at most MaxSaltLen bytes, and items of
// positive length at offsets >= 0, strictly increasing, each ending by
// 2^31-1. Items are not checked against a prompt's length: keys describe
// a whole prompt, of which a call may see only a prefix (Keys.MM).
func (k *Keys) validate(op string) error {
	if len(k.Salt) > MaxSaltLen {
		return kverr.Errorf(kverr.InvalidArgument, "%s: salt is %d bytes, at most %d allowed", op, len(k.Salt), MaxSaltLen)
	}
	if len(k.MM) > MaxMMItems {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d multimodal items, at most %d allowed", op, len(k.MM), MaxMMItems)
	}
	return validateMM(op, k.MM, -1)
}

// validateMM checks multimodal items as validate does, and that the first
// starts after prev (an offset; -1 when there is no earlier item).
func validateMM(op string, mm []MMItem, prev int64) error {
	for i, it := range mm {
		if it.Offset < 0 || it.Length < 1 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: multimodal item %d has offset %d and length %d: need offset >= 0 and length >= 1", op, i, it.Offset, it.Length)
		}
		end := int64(it.Offset) + int64(it.Length)
		if end > 1<<31-1 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: multimodal item %d ends at %d, past 2^31-1", op, i, end)
		}
		if int64(it.Offset) <= prev {
			return kverr.Errorf(kverr.InvalidArgument, "%s: multimodal item %d starts at %d, not after the previous item's offset %d: offsets must increase", op, i, it.Offset, prev)
		}
		prev = int64(it.Offset)
	}
	return nil
}

// ValidateMoreMM checks items that are to follow keys' own (a sequence's
// items given after its admission): valid as in Validate, and each starts
// after the last of keys.MM (keys may be nil).
func ValidateMoreMM(op string, keys *Keys, mm []MMItem) error {
	prev := int64(-1)
	if keys != nil && len(keys.MM) > 0 {
		prev = int64(keys.MM[len(keys.MM)-1].Offset)
	}
	return validateMM(op, mm, prev)
}

// WithMoreMM returns a copy of keys (nil: none) with mm appended to its
// items; keys itself is not changed, so holders of it (forked sequences)
// keep what they had. mm is checked by ValidateMoreMM.
func (k *Keys) WithMoreMM(mm []MMItem) *Keys {
	c := &Keys{}
	if k != nil {
		c.Adapter, c.Salt = k.Adapter, k.Salt
		c.MM = make([]MMItem, 0, len(k.MM)+len(mm))
		c.MM = append(c.MM, k.MM...)
	}
	c.MM = append(c.MM, mm...)
	return c
}

// AppendBlockMM appends to dst the entries of k's multimodal items in
// block index of blockSize tokens (those that overlap it, offsets relative
// to its first position), as the block's hash and its BlockStored see
// them, and returns dst; k may be nil (none). For a caller that describes
// a prompt's block it did not take from the index (the host tier's blocks
// fetched from the shared tier).
func (k *Keys) AppendBlockMM(dst []BlockMM, index, blockSize int) []BlockMM {
	if k == nil {
		return dst
	}
	return appendBlockMM(dst, k.MM, index*blockSize, blockSize)
}

// appendBlockMM appends to dst the items of mm that overlap the block of
// blockSize positions starting at prompt position start, with offsets made
// relative to start. mm is in increasing Offset order, so the result is too.
func appendBlockMM(dst []BlockMM, mm []MMItem, start, blockSize int) []BlockMM {
	end := int64(start) + int64(blockSize)
	for _, it := range mm {
		if int64(it.Offset) >= end {
			break
		}
		if int64(it.Offset)+int64(it.Length) > int64(start) {
			dst = append(dst, BlockMM{Offset: int32(int64(it.Offset) - int64(start)), Hash: it.Hash})
		}
	}
	return dst
}

// AppendBlockInput appends to dst the bytes that a block's hash is taken
// over (the layout of HASH.md, all integers little-endian):
//
//	u8      HashVersion
//	[16]u8  parent hash (zero for a first block)
//	u32     n, the number of tokens
//	n x i32 tokens
//	u64     adapter id
//	u32     m, the number of multimodal entries
//	m x     { i32 offset relative to the block; [16]u8 content hash }
//	u32     s, the salt's length (0 unless first block)
//	s x u8  salt
func AppendBlockInput(dst []byte, parent Hash, tokens []int32, adapter uint64, mm []BlockMM, salt []byte) []byte {
	dst = append(dst, HashVersion)
	dst = append(dst, parent[:]...)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(tokens)))
	dst = appendTokens(dst, tokens)
	dst = binary.LittleEndian.AppendUint64(dst, adapter)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(mm)))
	for _, e := range mm {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(e.Offset))
		dst = append(dst, e.Hash[:]...)
	}
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(salt)))
	return append(dst, salt...)
}

// Sum returns XXH3-128 (seed 0) of input in canonical byte order.
func Sum(input []byte) Hash {
	return xxh3.Hash128(input).Bytes()
}

// Hasher computes block hashes with reusable scratch space, so hashing a
// prompt allocates nothing once the scratch has grown. The zero value is
// ready; a Hasher is not safe for concurrent use.
type Hasher struct {
	buf []byte
	mm  []BlockMM
}

// block returns the hash of block index of a prompt (its tokens are block,
// its first position index*len(block)) under parent. keys is valid.
func (h *Hasher) block(parent Hash, index int, block []int32, keys *Keys) Hash {
	h.mm = appendBlockMM(h.mm[:0], keys.MM, index*len(block), len(block))
	var salt []byte
	if index == 0 {
		salt = keys.Salt
	}
	if len(h.mm) == 0 && len(salt) == 0 && shortBlock(len(block)) {
		return hashShort(&parent, block, keys.Adapter)
	}
	h.buf = AppendBlockInput(h.buf[:0], parent, block, keys.Adapter, h.mm, salt)
	return Sum(h.buf)
}

// sum returns the hash of the block with these parent, tokens and keys
// (mm: its entries; salt: for a first block): hashShort where it applies,
// else XXH3 of the written-out input.
func (h *Hasher) sum(parent Hash, tokens []int32, adapter uint64, mm []BlockMM, salt []byte) Hash {
	if len(mm) == 0 && len(salt) == 0 && shortBlock(len(tokens)) {
		return hashShort(&parent, tokens, adapter)
	}
	h.buf = AppendBlockInput(h.buf[:0], parent, tokens, adapter, mm, salt)
	return Sum(h.buf)
}

// Next returns the hash of one block, tokens, chained to parent (zero for
// a prompt's first block) under adapter and, for a first block, salt: one
// step of Chain for a block with no multimodal items. For consumers that
// rebuild chains one block at a time from another engine's events
// (core/kvindex); Chain's blocks hash the same.
func (h *Hasher) Next(parent Hash, tokens []int32, adapter uint64, salt []byte) Hash {
	return h.sum(parent, tokens, adapter, nil, salt)
}

// Chain appends to dst the chained hashes of every full block of a prompt
// (len(tokens)/blockSize of them; a partial tail has no hash) and returns
// the extended slice. keys may be nil (no adapter, no multimodal items, no
// salt). tokens may be a prefix of the prompt that keys describe: its
// hashes are then the first ones of the whole prompt's.
func (h *Hasher) Chain(dst []Hash, tokens []int32, blockSize int, keys *Keys) ([]Hash, error) {
	if blockSize < 1 || blockSize > MaxBlockSize {
		return dst, kverr.Errorf(kverr.InvalidArgument, "chain: block_size must be in [1, %d]: got %d", MaxBlockSize, blockSize)
	}
	if keys == nil {
		keys = &noKeys
	}
	if err := keys.validate("chain"); err != nil {
		return dst, err
	}
	var parent Hash
	for i := range len(tokens) / blockSize {
		parent = h.block(parent, i, tokens[i*blockSize:(i+1)*blockSize], keys)
		dst = append(dst, parent)
	}
	return dst, nil
}

// hostLittleEndian reports whether int32s sit in memory as the layout
// writes them, so tokens can be copied (and compared) as bytes.
var hostLittleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// tokenBytes views tokens as their in-memory bytes.
func tokenBytes(tokens []int32) []byte {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens))
}

// appendTokens appends tokens as int32 little-endian: one copy on a
// little-endian host (every host Go builds this library for, in practice),
// a loop elsewhere. It is a third of a block's hashing cost as a loop.
func appendTokens(dst []byte, tokens []int32) []byte {
	if hostLittleEndian {
		return append(dst, tokenBytes(tokens)...)
	}
	for _, t := range tokens {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(t))
	}
	return dst
}

// equalTokens is slices.Equal for tokens, through the runtime's vectorised
// memory compare.
func equalTokens(a, b []int32) bool {
	return len(a) == len(b) && string(tokenBytes(a)) == string(tokenBytes(b))
}
