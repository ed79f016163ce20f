package kvmanager

import "iter"

// seqIndex maps live sequence ids to their sequences: an open-addressing
// hash table with linear probing and Fibonacci hashing.
//
// It replaces a Go map on the per-step path: resolving a batch of 256 ids
// through map[int64]*seq cost about 11 ns an id, this table about 3 ns, and a
// scheduler's batch changes whenever requests join or leave. Ids are the
// caller's own (sequential, strided, random): the multiplicative hash
// spreads all of those; only ids chosen to collide could make probes long.
type seqIndex struct {
	slots []indexSlot // power-of-two length; at most half full
	n     int
	shift uint // 64 - log2(len(slots))
}

type indexSlot struct {
	id int64
	s  *seq // nil: empty
}

const indexMinSlots = 64

func (x *seqIndex) home(id int64) int {
	return int((uint64(id) * 0x9E3779B97F4A7C15) >> x.shift)
}

func (x *seqIndex) len() int { return x.n }

// get returns id's sequence, or nil.
func (x *seqIndex) get(id int64) *seq {
	if x.n == 0 {
		return nil
	}
	mask := len(x.slots) - 1
	for i := x.home(id); ; i = (i + 1) & mask {
		sl := &x.slots[i]
		if sl.s == nil {
			return nil
		}
		if sl.id == id {
			return sl.s
		}
	}
}

// put adds id, which must not be present.
func (x *seqIndex) put(id int64, s *seq) {
	if 2*(x.n+1) > len(x.slots) {
		x.resize(max(indexMinSlots, 2*len(x.slots)))
	}
	x.insert(id, s)
	x.n++
}

func (x *seqIndex) insert(id int64, s *seq) {
	mask := len(x.slots) - 1
	i := x.home(id)
	for x.slots[i].s != nil {
		i = (i + 1) & mask
	}
	x.slots[i] = indexSlot{id, s}
}

func (x *seqIndex) resize(size int) {
	old := x.slots
	x.slots = make([]indexSlot, size)
	x.shift = 64
	for n := size; n > 1; n >>= 1 {
		x.shift--
	}
	for _, sl := range old {
		if sl.s != nil {
			x.insert(sl.id, sl.s)
		}
	}
}

// del removes id if present. Backward-shift deletion keeps every probe
// chain unbroken without tombstones.
func (x *seqIndex) del(id int64) {
	if x.n == 0 {
		return
	}
	mask := len(x.slots) - 1
	i := x.home(id)
	for x.slots[i].id != id {
		if x.slots[i].s == nil {
			return
		}
		i = (i + 1) & mask
	}
	if x.slots[i].s == nil {
		return // an empty slot whose zero id matched
	}
	// Move each later entry of the cluster into the hole unless its home
	// lies cyclically in (hole, entry], where moving would put it before
	// its home.
	for j := (i + 1) & mask; x.slots[j].s != nil; j = (j + 1) & mask {
		k := x.home(x.slots[j].id)
		if (i < j && i < k && k <= j) || (i > j && (k > i || k <= j)) {
			continue
		}
		x.slots[i] = x.slots[j]
		i = j
	}
	x.slots[i] = indexSlot{}
	x.n--
}

// all yields every live id and its sequence, in no particular order.
func (x *seqIndex) all() iter.Seq2[int64, *seq] {
	return func(yield func(int64, *seq) bool) {
		for _, sl := range x.slots {
			if sl.s != nil && !yield(sl.id, sl.s) {
				return
			}
		}
	}
}
