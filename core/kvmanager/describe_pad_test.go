package kvmanager

import (
	"fmt"
	"testing"
)

// TestDescribePadsEveryWidth checks the block table's -1 padding for
// widths on both sides of the short-row loop (16 entries) and past the
// 1024-entry run the long rows are copied from, with the rows' blocks
// intact and the entries after the batch's rows untouched.
func TestDescribePadsEveryWidth(t *testing.T) {
	const bs = 4
	m := newMgr(t, 64, bs)
	must(t, m.Add(1, 3))      // 1 block
	must(t, m.Add(2, 5*bs+1)) // 6 blocks
	ids := []int64{1, 2}
	for _, width := range []int{6, 7, 16, 17, 22, 1024, 1025, 3000} {
		t.Run(fmt.Sprint(width), func(t *testing.T) {
			table := make([]int32, 3*width) // one spare row
			for i := range table {
				table[i] = 12345
			}
			if _, err := m.Describe(ids, width, table, nil, nil); err != nil {
				t.Fatal(err)
			}
			for r, s := range []*seq{m.seqs.get(1), m.seqs.get(2)} {
				row := table[r*width : (r+1)*width]
				for j, b := range row {
					want := int32(-1)
					if j < len(s.blocks) {
						want = s.blocks[j]
					}
					if b != want {
						t.Fatalf("row %d entry %d: %d, want %d", r, j, b, want)
					}
				}
			}
			for j, b := range table[2*width:] {
				if b != 12345 {
					t.Fatalf("entry %d after the batch's rows changed to %d", j, b)
				}
			}
		})
	}
}
