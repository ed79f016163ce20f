package vmem

import (
	"math/rand/v2"
	"testing"
)

// bruteMappings counts the mappings of a reservation given the file offset
// of each page (-1: unmapped), merging neighbours as the kernel does.
func bruteMappings(offs []int64, page int64) int {
	n := 0
	for i := range offs {
		switch {
		case i == 0:
			n++
		case offs[i] < 0 && offs[i-1] < 0:
		case offs[i] >= 0 && offs[i-1] >= 0 && offs[i] == offs[i-1]+page:
		default:
			n++
		}
	}
	return n
}

func TestMapModelAgainstBruteForce(t *testing.T) {
	const pages, page = 64, 4096
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 200; trial++ {
		m := &mapModel{base: 1 << 30, size: pages * page}
		offs := make([]int64, pages)
		for i := range offs {
			offs[i] = -1
		}
		count := m.count()
		for op := 0; op < 100; op++ {
			from := rng.IntN(pages)
			k := 1 + rng.IntN(min(8, pages-from))
			free := true
			for i := from; i < from+k; i++ {
				free = free && offs[i] < 0
			}
			if free && rng.IntN(3) > 0 {
				// Pages from a few file regions, often consecutive.
				var runs []extent
				off := int64(rng.IntN(4)) * 1 << 20
				for i := from; i < from+k; i++ {
					if rng.IntN(4) == 0 {
						off = int64(rng.IntN(1<<10)) * page
					}
					e := extent{addr: m.base + uintptr(i*page), size: page, off: off}
					if n := len(runs); n > 0 && runs[n-1].joins(e) {
						runs[n-1].size += page
					} else {
						runs = append(runs, e)
					}
					offs[i] = off
					off += page
				}
				plan, ok := m.planMap(runs)
				if !ok {
					t.Fatalf("trial %d op %d: map of a free range refused", trial, op)
				}
				m.apply(plan)
				count += plan.delta
			} else if !free || rng.IntN(2) == 0 {
				plan := m.planUnmap(m.base+uintptr(from*page), k*page)
				m.apply(plan)
				count += plan.delta
				for i := from; i < from+k; i++ {
					offs[i] = -1
				}
			}
			want := bruteMappings(offs, page)
			if got := m.count(); got != want || count != want {
				t.Fatalf("trial %d op %d: model counts %d (deltas sum to %d), brute force %d", trial, op, got, count, want)
			}
		}
	}
}

func TestMapModelRefusesOverlap(t *testing.T) {
	m := &mapModel{base: 0, size: 16 * 4096}
	plan, ok := m.planMap([]extent{{addr: 4096, size: 2 * 4096, off: 0}})
	if !ok {
		t.Fatal("first map refused")
	}
	m.apply(plan)
	if _, ok := m.planMap([]extent{{addr: 2 * 4096, size: 4096, off: 1 << 20}}); ok {
		t.Fatal("a map over a mapped page was planned")
	}
	if m.count() != 3 {
		t.Fatalf("gap, extent, gap: counted %d", m.count())
	}
}
