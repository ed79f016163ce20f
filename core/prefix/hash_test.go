package prefix

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/hash_vectors.json from hashVectorCases")

const vectorsPath = "testdata/hash_vectors.json"

var (
	numberList = regexp.MustCompile(`\[[-0-9,\s]+\]`)
	space      = regexp.MustCompile(`\s+`)
)

// The JSON shapes of testdata/hash_vectors.json (HASH.md describes them).
type vectorFile struct {
	Description   string       `json:"description"`
	Algorithm     string       `json:"algorithm"`
	LayoutVersion int          `json:"layout_version"`
	Vectors       []hashVector `json:"vectors"`
}

type vectorMM struct {
	Offset int32  `json:"offset"`
	Length int32  `json:"length"`
	Hash   string `json:"hash"`
}

type vectorBlock struct {
	Input string `json:"input"` // hex of the bytes hashed
	Hash  string `json:"hash"`
}

type hashVector struct {
	Name      string        `json:"name"`
	BlockSize int           `json:"block_size"`
	Tokens    []int32       `json:"tokens"`
	Adapter   uint64        `json:"adapter"`
	MM        []vectorMM    `json:"mm"`
	Salt      string        `json:"salt"` // hex
	Blocks    []vectorBlock `json:"blocks"`
}

func seq(from, n int32) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = from + int32(i)
	}
	return s
}

func hexOf(s string) string { return hex.EncodeToString([]byte(s)) }

func contentHash(name string) string { return Sum([]byte(name)).String() }

// hashVectorCases are the inputs of the shipped vectors; -update computes
// their blocks.
func hashVectorCases() []hashVector {
	imgA, imgB := contentHash("image-a"), contentHash("image-b")
	lcg := make([]int32, 40)
	v := uint32(12345)
	for i := range lcg {
		v = v*1664525 + 1013904223
		lcg[i] = int32(v >> 8 % 152064)
	}
	return []hashVector{
		{Name: "one block, no keys", BlockSize: 4, Tokens: []int32{1, 2, 3, 4}},
		{Name: "three blocks and a partial tail (no hash for the tail)", BlockSize: 4, Tokens: seq(0, 14)},
		{Name: "negative and extreme token ids", BlockSize: 4, Tokens: []int32{-1, math.MaxInt32, math.MinInt32, 0, 65536, 7, 8, 9}},
		{Name: "adapter 7", BlockSize: 4, Tokens: seq(0, 12), Adapter: 7},
		{Name: "adapter 2^64-1", BlockSize: 4, Tokens: seq(0, 8), Adapter: math.MaxUint64},
		{Name: "salt tenant-a (first block only)", BlockSize: 4, Tokens: seq(0, 12), Salt: hexOf("tenant-a")},
		{Name: "salt tenant-b", BlockSize: 4, Tokens: seq(0, 12), Salt: hexOf("tenant-b")},
		{Name: "multimodal item inside block 1", BlockSize: 4, Tokens: seq(100, 12),
			MM: []vectorMM{{Offset: 5, Length: 2, Hash: imgA}}},
		{Name: "multimodal item spanning blocks 0-2 (relative offsets 2, -2, -6)", BlockSize: 4, Tokens: seq(100, 16),
			MM: []vectorMM{{Offset: 2, Length: 7, Hash: imgA}}},
		{Name: "two multimodal items, both in block 0, the second also in block 1", BlockSize: 4, Tokens: seq(100, 8),
			MM: []vectorMM{{Offset: 0, Length: 1, Hash: imgA}, {Offset: 2, Length: 3, Hash: imgB}}},
		{Name: "all keys", BlockSize: 4, Tokens: seq(200, 12), Adapter: 3, Salt: hexOf("tenant-a"),
			MM: []vectorMM{{Offset: 3, Length: 2, Hash: imgB}}},
		{Name: "block size 1", BlockSize: 1, Tokens: []int32{5, 6, 7}},
		{Name: "block size 16, pseudo-random tokens", BlockSize: 16, Tokens: lcg},
	}
}

// vectorKeys decodes a vector's keys.
func vectorKeys(t *testing.T, v hashVector) *Keys {
	t.Helper()
	k := &Keys{Adapter: v.Adapter}
	var err error
	if k.Salt, err = hex.DecodeString(v.Salt); err != nil {
		t.Fatalf("%s: salt: %v", v.Name, err)
	}
	for _, m := range v.MM {
		h, err := ParseHash(m.Hash)
		if err != nil {
			t.Fatalf("%s: %v", v.Name, err)
		}
		k.MM = append(k.MM, MMItem{Offset: m.Offset, Length: m.Length, Hash: h})
	}
	return k
}

// computeBlocks hashes a vector's prompt block by block, spelling out the
// chain as another language would: block i's parent is block i-1's hash,
// its entries are the items it overlaps, and the salt is block 0's only.
func computeBlocks(t *testing.T, v hashVector) []vectorBlock {
	t.Helper()
	keys := vectorKeys(t, v)
	var out []vectorBlock
	var parent Hash
	bs := v.BlockSize
	for i := 0; (i+1)*bs <= len(v.Tokens); i++ {
		var mm []BlockMM
		for _, it := range keys.MM {
			if int(it.Offset) < (i+1)*bs && int(it.Offset+it.Length) > i*bs {
				mm = append(mm, BlockMM{Offset: it.Offset - int32(i*bs), Hash: it.Hash})
			}
		}
		var salt []byte
		if i == 0 {
			salt = keys.Salt
		}
		in := AppendBlockInput(nil, parent, v.Tokens[i*bs:(i+1)*bs], keys.Adapter, mm, salt)
		parent = Sum(in)
		out = append(out, vectorBlock{Input: hex.EncodeToString(in), Hash: parent.String()})
	}
	return out
}

func renderVectors(t *testing.T) []byte {
	t.Helper()
	f := vectorFile{
		Description: "Chained block hashes of kvplug's prefix cache (core/prefix/HASH.md). For each vector, " +
			"split tokens into blocks of block_size (a partial tail has no hash); blocks[i].input is the " +
			"hex of the bytes hashed for block i and blocks[i].hash their XXH3-128 digest.",
		Algorithm:     "XXH3-128, seed 0, canonical (big-endian) digest",
		LayoutVersion: HashVersion,
		Vectors:       hashVectorCases(),
	}
	for i := range f.Vectors {
		if f.Vectors[i].MM == nil {
			f.Vectors[i].MM = []vectorMM{}
		}
		f.Vectors[i].Blocks = computeBlocks(t, f.Vectors[i])
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	// One line per list of numbers, so a vector reads at a glance.
	b = numberList.ReplaceAllFunc(b, func(m []byte) []byte {
		return space.ReplaceAll(m, nil)
	})
	return append(b, '\n')
}

// TestHashVectors checks the shipped vectors two ways: the file recomputes
// from its own inputs (what Python and C++ do), and it is what the cases
// above generate (so a stale file fails; regenerate with -update).
func TestHashVectors(t *testing.T) {
	want := renderVectors(t)
	if *update {
		if err := os.MkdirAll(filepath.Dir(vectorsPath), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(vectorsPath, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(vectorsPath)
	if err != nil {
		t.Fatalf("%v (generate it with go test -run TestHashVectors -update)", err)
	}
	var f vectorFile
	if err := json.Unmarshal(got, &f); err != nil {
		t.Fatal(err)
	}
	if f.LayoutVersion != HashVersion {
		t.Fatalf("vectors are for layout %d, code is %d", f.LayoutVersion, HashVersion)
	}
	if len(f.Vectors) == 0 {
		t.Fatal("no vectors")
	}
	var h Hasher
	for _, v := range f.Vectors {
		blocks := computeBlocks(t, v)
		if len(blocks) != len(v.Blocks) || len(blocks) != len(v.Tokens)/v.BlockSize {
			t.Fatalf("%s: file has %d blocks, computed %d", v.Name, len(v.Blocks), len(blocks))
		}
		chain, err := h.Chain(nil, v.Tokens, v.BlockSize, vectorKeys(t, v))
		if err != nil {
			t.Fatalf("%s: %v", v.Name, err)
		}
		for i, b := range blocks {
			if b != v.Blocks[i] {
				t.Errorf("%s block %d: file has %+v, computed %+v", v.Name, i, v.Blocks[i], b)
			}
			if chain[i].String() != v.Blocks[i].Hash {
				t.Errorf("%s block %d: Chain gives %s, file %s", v.Name, i, chain[i], v.Blocks[i].Hash)
			}
		}
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the cases in hash_test.go: regenerate with go test -run TestHashVectors -update", vectorsPath)
	}
}

// TestSumIsCanonicalXXH3 pins the digest's algorithm and byte order to
// published XXH3-128 values (as xxhash.xxh3_128_hexdigest gives them).
func TestSumIsCanonicalXXH3(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", "99aa06d3014798d86001c324468d497f"},
		{"abc", "06b05ab6733a618578af5f94892f3950"},
	} {
		if got := Sum([]byte(c.in)).String(); got != c.want {
			t.Errorf("Sum(%q) = %s, want %s", c.in, got, c.want)
		}
	}
}

func TestBlockInputLayout(t *testing.T) {
	parent := Hash{0: 0xAA, 15: 0xBB}
	mmh := Hash{0: 1, 15: 2}
	in := AppendBlockInput(nil, parent, []int32{1, -2}, 0x0102030405060708, []BlockMM{{Offset: -3, Hash: mmh}}, []byte("s"))
	want := "01" + // version
		"aa0000000000000000000000000000bb" + // parent
		"02000000" + "01000000" + "feffffff" + // n, tokens
		"0807060504030201" + // adapter
		"01000000" + "fdffffff" + "01000000000000000000000000000002" + // m, offset, hash
		"01000000" + "73" // salt
	if got := hex.EncodeToString(in); got != want {
		t.Fatalf("layout:\n got %s\nwant %s", got, want)
	}
}

func TestChainErrors(t *testing.T) {
	var h Hasher
	for _, c := range []struct {
		name string
		bs   int
		n    int
		keys *Keys
	}{
		{"block size 0", 0, 8, nil},
		{"block size too big", MaxBlockSize + 1, 8, nil},
		{"salt too long", 4, 8, &Keys{Salt: make([]byte, MaxSaltLen+1)}},
		{"too many items", 4, 8, &Keys{MM: make([]MMItem, MaxMMItems+1)}},
		{"negative offset", 4, 8, &Keys{MM: []MMItem{{Offset: -1, Length: 2}}}},
		{"zero length", 4, 8, &Keys{MM: []MMItem{{Offset: 1, Length: 0}}}},
		{"unordered", 4, 8, &Keys{MM: []MMItem{{Offset: 3, Length: 1}, {Offset: 3, Length: 1}}}},
		{"overflow", 4, 8, &Keys{MM: []MMItem{{Offset: math.MaxInt32, Length: 2}}}},
	} {
		if _, err := h.Chain(nil, seq(0, int32(c.n)), c.bs, c.keys); err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
}

// chainOf is Chain for tests.
func chainOf(t *testing.T, tokens []int32, bs int, keys *Keys) []Hash {
	t.Helper()
	var h Hasher
	c, err := h.Chain(nil, tokens, bs, keys)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestSaltIsolation(t *testing.T) {
	toks := seq(0, 64)
	a := chainOf(t, toks, 16, &Keys{Salt: []byte("a")})
	b := chainOf(t, toks, 16, &Keys{Salt: []byte("b")})
	none := chainOf(t, toks, 16, nil)
	for i := range a {
		if a[i] == b[i] || a[i] == none[i] || b[i] == none[i] {
			t.Fatalf("block %d shared across salts", i)
		}
	}
	// The salt enters block 0 only: the later inputs carry no salt bytes.
	in := AppendBlockInput(nil, a[0], toks[16:32], 0, nil, nil)
	if Sum(in) != a[1] {
		t.Fatal("block 1 of a salted chain is not hash(block 0's hash, tokens) without the salt")
	}
}

func TestAdapterIsolation(t *testing.T) {
	toks := seq(0, 48)
	a := chainOf(t, toks, 16, &Keys{Adapter: 1})
	b := chainOf(t, toks, 16, &Keys{Adapter: 2})
	none := chainOf(t, toks, 16, nil)
	for i := range a {
		if a[i] == b[i] || a[i] == none[i] {
			t.Fatalf("block %d shared across adapters", i)
		}
	}
}

// A multimodal item changes the hash of exactly the blocks it overlaps, and
// (through the chain) every block after the first of them.
func TestMultimodalOverlap(t *testing.T) {
	toks := seq(0, 80) // five blocks of 16
	img := Sum([]byte("img"))
	plain := chainOf(t, toks, 16, nil)
	cases := []struct {
		off, n  int32
		touched []int // blocks whose own input gains an entry
	}{
		{0, 1, []int{0}},
		{15, 1, []int{0}},
		{15, 2, []int{0, 1}},
		{16, 16, []int{1}},
		{20, 30, []int{1, 2, 3}},
		{79, 1, []int{4}},
	}
	for _, c := range cases {
		keys := &Keys{MM: []MMItem{{Offset: c.off, Length: c.n, Hash: img}}}
		got := chainOf(t, toks, 16, keys)
		first := c.touched[0]
		for i := range got {
			if (got[i] != plain[i]) != (i >= first) {
				t.Errorf("item [%d,%d): block %d changed=%v", c.off, c.off+c.n, i, got[i] != plain[i])
			}
		}
		// Which blocks' own inputs carry the entry, and at what offset.
		for i := range 5 {
			mm := appendBlockMM(nil, keys.MM, i*16, 16)
			touched := slices.Contains(c.touched, i)
			want := int(c.off) - i*16
			switch {
			case !touched && len(mm) != 0:
				t.Errorf("item [%d,%d): block %d has entries %v", c.off, c.off+c.n, i, mm)
			case touched && (len(mm) != 1 || int(mm[0].Offset) != want):
				t.Errorf("item [%d,%d): block %d has entries %v, want offset %d", c.off, c.off+c.n, i, mm, want)
			}
		}
	}
	// A different content hash at the same place changes the same blocks.
	a := chainOf(t, toks, 16, &Keys{MM: []MMItem{{Offset: 20, Length: 4, Hash: img}}})
	b := chainOf(t, toks, 16, &Keys{MM: []MMItem{{Offset: 20, Length: 4, Hash: Sum([]byte("other"))}}})
	if a[0] != b[0] || a[1] == b[1] {
		t.Error("content hash: block 0 must agree and block 1 differ")
	}
}

// A prefix of a prompt hashed with the whole prompt's items, some past the
// prefix, has the whole prompt's first hashes: what lets a chunked prefill
// pass its items before their tokens.
func TestChainOfAPrefixWithTheWholePromptsItems(t *testing.T) {
	toks := seq(0, 80)
	keys := &Keys{Adapter: 3, Salt: []byte("s"), MM: []MMItem{
		{Offset: 10, Length: 30, Hash: Sum([]byte("a"))}, // blocks 0 to 2 of 16
		{Offset: 50, Length: 4, Hash: Sum([]byte("b"))},  // block 3
		{Offset: 90, Length: 4, Hash: Sum([]byte("c"))},  // past the whole prompt
	}}
	whole := chainOf(t, toks, 16, keys)
	for n := range len(toks) + 1 {
		got := chainOf(t, toks[:n], 16, keys)
		if !slices.Equal(got, whole[:n/16]) {
			t.Fatalf("prefix of %d tokens: hashes differ from the whole prompt's", n)
		}
	}
	// Without the item that reaches past a 32-token prefix, its second
	// block hashes differently: the item is part of its identity.
	if short := chainOf(t, toks[:32], 16, &Keys{Adapter: 3, Salt: []byte("s")}); short[1] == whole[1] {
		t.Fatal("a block overlapping an item hashed as without it")
	}
}

func TestParseHash(t *testing.T) {
	h := Sum([]byte("x"))
	if g, err := ParseHash(h.String()); err != nil || g != h {
		t.Fatalf("round trip: %v %v", g, err)
	}
	for _, s := range []string{"", "00", h.String() + "0", "zz" + h.String()[2:]} {
		if _, err := ParseHash(s); err == nil {
			t.Errorf("ParseHash(%q): no error", s)
		}
	}
}
