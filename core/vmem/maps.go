package vmem

import "sort"

// The host driver's model of the kernel's memory mappings (VMAs) inside one
// reservation. The kernel allows a process vm.max_map_count of them (65530
// by default) and the Go runtime dies with a fatal error, not an error
// value, when it cannot map its own heap past that limit. So the host driver
// counts the mappings each call would leave before making it, and refuses a
// call that would take it past its share.
//
// A reservation is a run of extents (pages of the page file mapped at
// consecutive addresses and consecutive file offsets: the kernel merges such
// neighbours into one mapping) with PROT_NONE gaps between them; each extent
// and each non-empty gap is one mapping.

type extent struct {
	addr uintptr
	size int
	off  int64 // file offset of addr
}

func (e extent) end() uintptr { return e.addr + uintptr(e.size) }

// joins reports whether the kernel merges b into a when b follows a.
func (a extent) joins(b extent) bool {
	return a.end() == b.addr && a.off+int64(a.size) == b.off
}

type mapModel struct {
	base uintptr
	size int
	ext  []extent // sorted by addr, disjoint, no two joining
}

// count is the number of mappings the reservation occupies now.
func (m *mapModel) count() int { return mappings(m.base, m.ext, m.base+uintptr(m.size)) }

// mappings counts the extents of ext and the gaps they leave in [lo, hi).
func mappings(lo uintptr, ext []extent, hi uintptr) int {
	n, at := len(ext), lo
	for _, e := range ext {
		if e.addr > at {
			n++
		}
		at = e.end()
	}
	if hi > at {
		n++
	}
	return n
}

// edit is a planned change: ext[from:to] becomes repl, changing the number
// of mappings by delta. Plans are computed without changing the model, so a
// call can be refused before anything happens.
type edit struct {
	from, to int
	repl     []extent
	delta    int
}

// window returns the bounds of the space around ext[p:q]: the end of the
// extent before it (or the base) and the start of the one after it (or the
// reservation's end).
func (m *mapModel) window(p, q int) (lo, hi uintptr) {
	lo, hi = m.base, m.base+uintptr(m.size)
	if p > 0 {
		lo = m.ext[p-1].end()
	}
	if q < len(m.ext) {
		hi = m.ext[q].addr
	}
	return lo, hi
}

// planMap plans mapping runs (address-contiguous, in order, each a maximal
// file-contiguous run) over an unmapped range. ok is false when the range
// overlaps a mapped extent.
func (m *mapModel) planMap(runs []extent) (e edit, ok bool) {
	first, last := runs[0], runs[len(runs)-1]
	i := sort.Search(len(m.ext), func(k int) bool { return m.ext[k].addr >= first.addr })
	if (i > 0 && m.ext[i-1].end() > first.addr) || (i < len(m.ext) && m.ext[i].addr < last.end()) {
		return edit{}, false
	}
	// The window holds the neighbours the runs may join.
	p, q := max(i-1, 0), min(i+1, len(m.ext))
	lo, hi := m.window(p, q)
	old := m.ext[p:q]
	repl := make([]extent, 0, len(old)+len(runs))
	repl = append(repl, m.ext[p:i]...)
	for _, r := range runs {
		if n := len(repl); n > 0 && repl[n-1].joins(r) {
			repl[n-1].size += r.size
			continue
		}
		repl = append(repl, r)
	}
	for _, r := range m.ext[i:q] {
		if n := len(repl); repl[n-1].joins(r) {
			repl[n-1].size += r.size
			continue
		}
		repl = append(repl, r)
	}
	return edit{from: p, to: q, repl: repl, delta: mappings(lo, repl, hi) - mappings(lo, old, hi)}, true
}

// planUnmap plans unmapping [addr, addr+size), which may cover parts of
// extents.
func (m *mapModel) planUnmap(addr uintptr, size int) edit {
	end := addr + uintptr(size)
	j := sort.Search(len(m.ext), func(k int) bool { return m.ext[k].end() > addr })
	k := sort.Search(len(m.ext), func(k int) bool { return m.ext[k].addr >= end })
	p, q := max(j-1, 0), min(k+1, len(m.ext))
	lo, hi := m.window(p, q)
	old := m.ext[p:q]
	repl := make([]extent, 0, len(old)+1)
	for _, e := range old {
		if e.end() <= addr || e.addr >= end {
			repl = append(repl, e)
			continue
		}
		if e.addr < addr { // the part before the hole
			repl = append(repl, extent{addr: e.addr, size: int(addr - e.addr), off: e.off})
		}
		if e.end() > end { // the part after it
			repl = append(repl, extent{addr: end, size: int(e.end() - end), off: e.off + int64(end-e.addr)})
		}
	}
	return edit{from: p, to: q, repl: repl, delta: mappings(lo, repl, hi) - mappings(lo, old, hi)}
}

func (m *mapModel) apply(e edit) {
	tail := append([]extent(nil), m.ext[e.to:]...)
	m.ext = append(append(m.ext[:e.from], e.repl...), tail...)
}
