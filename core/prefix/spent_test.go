package prefix

import (
	"slices"
	"testing"
)

// A node marked spent goes before every node that is not, whatever their
// priority and last access; EvictSpent takes spent nodes only, and with
// them a parent that its own evictions turn into a spent leaf; Children
// and Parent describe the tree.
func TestSpentNodesGoFirst(t *testing.T) {
	x := newIndex(t, 2, 16, false)
	old := cache(t, x, []int32{1, 2, 3, 4}, nil, 0, 1)             // blocks 0, 1: the oldest chain
	young := cache(t, x, []int32{5, 6, 7, 8, 9, 10}, nil, 2, 3, 4) // blocks 2, 3, 4
	unlock(t, x, old...)
	unlock(t, x, young...)
	if _, err := x.SetPriority([]int32{5, 6, 7, 8, 9, 10}, nil, 5); err != nil {
		t.Fatal(err)
	}
	if got := [4]int{x.Children(0), x.Children(1), x.Children(3), x.Children(9)}; got != [4]int{1, 0, 1, -1} {
		t.Fatalf("children of blocks 0, 1, 3 and the uncached 9: %v", got)
	}
	if got := [3]int32{x.Parent(2), x.Parent(4), x.Parent(9)}; got != [3]int32{-1, 3, -1} {
		t.Fatalf("parents of blocks 2, 4 and 9: %v", got)
	}
	if got := x.EvictSpent(nil, 4); len(got) != 0 {
		t.Fatalf("EvictSpent with no spent node evicted %v", got)
	}
	// Blocks 3 and 4 spent: the younger, higher-priority chain's tail goes
	// before the old chain; block 2 (not spent) stops EvictSpent.
	x.SetSpent(4, true)
	x.SetSpent(3, true)
	x.SetSpent(9, true) // not cached: ignored
	if !x.Spent(3) || x.Spent(2) || x.Spent(9) {
		t.Fatalf("spent: 3 %v, 2 %v, 9 %v", x.Spent(3), x.Spent(2), x.Spent(9))
	}
	check(t, x)
	if got := x.EvictSpent(nil, 8); !slices.Equal(got, []int32{4, 3}) {
		t.Fatalf("EvictSpent took %v, want [4 3]", got)
	}
	check(t, x)
	// Marking the leaf 1 spent moves it ahead of the lower-priority 2.
	x.SetSpent(1, true)
	if got := evict(t, x, 1); !slices.Equal(got, []int32{1}) {
		t.Fatalf("Evict took %v, want the spent block 1", got)
	}
	x.SetSpent(0, true)
	x.SetSpent(0, false)
	if got := evict(t, x, 1); !slices.Equal(got, []int32{0}) {
		t.Fatalf("Evict took %v, want block 0 (priority 0 before 5)", got)
	}
}
