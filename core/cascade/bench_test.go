package cascade_test

import (
	. "github.com/kvplug/kvplug/core/cascade"
	"testing"
)

// benchBatch is 256 sequences of 4096 tokens (block size 16, 256 blocks
// each) with the given sharing: shared = blocks every sequence shares,
// groupShared = blocks shared within groups of groupSize after that.
func benchBatch(shared, groupShared, groupSize int) *batch {
	const B, cols, bs = 256, 256, 16
	b := &batch{bs: bs, maxBlocks: cols, stride: cols, table: make([]int32, B*cols), lens: make([]int32, B)}
	next := int32(shared)
	groupBase := map[int]int32{}
	for s := 0; s < B; s++ {
		row := b.table[s*cols : (s+1)*cols]
		for c := 0; c < shared; c++ {
			row[c] = int32(c)
		}
		g := s / max(groupSize, 1)
		if _, ok := groupBase[g]; !ok && groupShared > 0 {
			groupBase[g] = next
			next += int32(groupShared)
		}
		for c := 0; c < groupShared; c++ {
			row[shared+c] = groupBase[g] + int32(c)
		}
		for c := shared + groupShared; c < cols; c++ {
			row[c] = next
			next++
		}
		b.lens[s] = 4096
	}
	b.numBlocks = int(next)
	return b
}

// Planning a 256-sequence batch of 4096-token sequences from the host
// arrays (the target is at most 25 us).
func BenchmarkPlan256x4096(b *testing.B) {
	cases := []struct {
		name                 string
		shared, group, gsize int
	}{
		{"none", 0, 0, 0},
		{"prompt2048", 128, 0, 0},
		{"tree2048+1024x16", 128, 64, 16},
		{"forks4080", 255, 0, 0},
		{"all4096", 256, 0, 0},
	}
	for _, c := range cases {
		bt := benchBatch(c.shared, c.group, c.gsize)
		in := bt.input(32, 8, 128)
		l, _ := NewLayout(256, 32, 8, 128)
		ws := make([]int32, l.HostInts)
		var p Planner
		b.Run(c.name, func(b *testing.B) {
			var s Summary
			for b.Loop() {
				var err error
				if s, err = p.Plan(in, &l, ws); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(s.Items), "items")
			b.ReportMetric(float64(s.SavedTokens)/float64(max(s.TotalTokens, 1)), "saved/total")
		})
	}
	bt := benchBatch(128, 64, 16)
	in := bt.input(32, 8, 128)
	l, _ := NewLayout(256, 32, 8, 128)
	ws := make([]int32, l.HostInts)
	var p Planner
	s, _ := p.Plan(in, &l, ws)
	b.Run("update", func(b *testing.B) {
		for b.Loop() {
			if ok, err := Update(ws, &l, s.Route, 256, bt.lens); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
	})
}
