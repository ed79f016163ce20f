package prefix

import (
	"encoding/binary"
	"math/bits"
	"math/rand/v2"
)

// nodeTable maps block hashes to tree nodes. It replaces a Go map on the
// hot path of every match and insert: a block hash is already uniform, so
// the table needs no key hashing of its own, and one probe sequence serves
// both the lookup and the insert that follows a miss. Open addressing with
// linear probing, at most half full, deletion by backward shift (no
// tombstones, so probe sequences stay short under churn).
//
// The slot of a hash mixes both of its halves with per-table random seeds
// before taking the top bits, so a client that crafts prompts whose block
// hashes share bits (XXH3 is not collision resistant) cannot pile them into
// one probe sequence without knowing the seeds.
type nodeTable struct {
	slots []tableSlot
	shift uint8 // 64 - log2(len(slots))
	n     int
	seed  uint64
	seed2 uint64
}

// tableSlot holds node+1, so the zero slot is empty.
type tableSlot struct {
	key  Hash
	node int32
}

const minTableSlots = 64

func newNodeTable() nodeTable {
	t := nodeTable{seed: rand.Uint64(), seed2: rand.Uint64()}
	t.alloc(minTableSlots)
	return t
}

func (t *nodeTable) alloc(size int) {
	t.slots = make([]tableSlot, size)
	t.shift = uint8(64 - bits.TrailingZeros(uint(size)))
}

func (t *nodeTable) home(h *Hash) int {
	lo := (binary.LittleEndian.Uint64(h[:8]) ^ t.seed) * 0x9E3779B97F4A7C15
	hi := (binary.LittleEndian.Uint64(h[8:]) ^ t.seed2) * 0xC2B2AE3D27D4EB4F
	return int((lo ^ hi) >> t.shift)
}

// len returns the number of hashes held.
func (t *nodeTable) len() int { return t.n }

// get returns the node of h.
func (t *nodeTable) get(h Hash) (int32, bool) {
	mask := len(t.slots) - 1
	for i := t.home(&h); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.node == 0 {
			return nilNode, false
		}
		if s.key == h {
			return s.node - 1, true
		}
	}
}

// lookup is get for a caller that inserts on a miss: it also returns the
// slot where putAt places h, so the insert needs no second probe. The table
// grows first if an insert would need it.
func (t *nodeTable) lookup(h Hash) (node int32, slot int, ok bool) {
	if 2*(t.n+1) > len(t.slots) {
		t.grow()
	}
	mask := len(t.slots) - 1
	for i := t.home(&h); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.node == 0 {
			return nilNode, i, false
		}
		if s.key == h {
			return s.node - 1, i, true
		}
	}
}

// putAt adds h -> node at the slot a missed lookup of h returned, with no
// change to the table in between.
func (t *nodeTable) putAt(slot int, h Hash, node int32) {
	t.slots[slot] = tableSlot{key: h, node: node + 1}
	t.n++
}

// put adds h -> node; h must not be held.
func (t *nodeTable) put(h Hash, node int32) {
	if 2*(t.n+1) > len(t.slots) {
		t.grow()
	}
	mask := len(t.slots) - 1
	i := t.home(&h)
	for t.slots[i].node != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = tableSlot{key: h, node: node + 1}
	t.n++
}

func (t *nodeTable) grow() {
	old := t.slots
	t.alloc(2 * len(old))
	mask := len(t.slots) - 1
	for _, s := range old {
		if s.node == 0 {
			continue
		}
		i := t.home(&s.key)
		for t.slots[i].node != 0 {
			i = (i + 1) & mask
		}
		t.slots[i] = s
	}
}

// del removes h if held, shifting back the entries after it whose probe
// sequence passed through its slot.
func (t *nodeTable) del(h Hash) {
	mask := len(t.slots) - 1
	i := t.home(&h)
	for {
		if t.slots[i].node == 0 {
			return
		}
		if t.slots[i].key == h {
			break
		}
		i = (i + 1) & mask
	}
	for j := (i + 1) & mask; t.slots[j].node != 0; j = (j + 1) & mask {
		k := t.home(&t.slots[j].key)
		// The entry at j stays if its home lies cyclically in (i, j].
		stays := (i < j && i < k && k <= j) || (i > j && (i < k || k <= j))
		if !stays {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = tableSlot{}
	t.n--
}

// reset empties the table, keeping its memory unless it is large.
func (t *nodeTable) reset() {
	if len(t.slots) > 1<<16 {
		t.alloc(minTableSlots)
	} else {
		clear(t.slots)
	}
	t.n = 0
}

// each calls f for every held hash and node, in no particular order.
func (t *nodeTable) each(f func(Hash, int32)) {
	for _, s := range t.slots {
		if s.node != 0 {
			f(s.key, s.node-1)
		}
	}
}
