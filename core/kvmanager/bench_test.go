package kvmanager

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvplug/kvplug/core/kvtier/host"
)

// readmit removes the batch's sequences and has admit add them again (a
// fresh batch), off the benchmark's timer.
func readmit(b *testing.B, m *Manager, ids []int64, admit func()) {
	b.StopTimer()
	if err := m.Remove(ids); err != nil {
		b.Fatal(err)
	}
	admit()
	b.StartTimer()
}

// BenchmarkStep is one decode step of the scheduler's loop for a batch of
// 256 sequences of about 1000 tokens: Grow each by one token, then Describe
// the batch's block table (max_blocks sized to fit), lengths and slots. The
// batch-changes case gives Grow a different batch every step, so it misses
// the manager's batch memo and looks each id up in the map.
func BenchmarkStep(b *testing.B) {
	for _, c := range []struct {
		bs      int
		reorder bool
	}{{16, false}, {1, false}, {16, true}} {
		bs := c.bs
		name := fmt.Sprintf("seqs256/bs%d", bs)
		if c.reorder {
			name += "/batch-changes"
		}
		b.Run(name, func(b *testing.B) {
			const (
				numSeqs = 256
				prompt  = 1000
				// Sequences are re-admitted after this many steps, so the
				// pool and the table width stay bounded for any b.N.
				reset = 128
			)
			maxLen := prompt + reset
			maxBlocks := (maxLen + bs - 1) / bs
			m := newMgr(b, numSeqs*(maxBlocks+1), bs)
			ids := make([]int64, numSeqs)
			ones := make([]int32, numSeqs)
			for i := range ids {
				ids[i] = int64(i)*7919 + 3 // arbitrary ids, not an index
				ones[i] = 1
			}
			admit := func() {
				for _, id := range ids {
					if err := m.Add(id, prompt); err != nil {
						b.Fatal(err)
					}
				}
			}
			admit()
			table := make([]int32, numSeqs*maxBlocks)
			lens := make([]int32, numSeqs)
			slots := make([]int32, numSeqs)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i%reset == reset-1 {
					readmit(b, m, ids, admit)
				}
				if c.reorder {
					// A new batch every step: Grow looks every id up.
					ids[i%numSeqs], ids[(i+1)%numSeqs] = ids[(i+1)%numSeqs], ids[i%numSeqs]
				}
				if err := m.Grow(ids, ones); err != nil {
					b.Fatal(err)
				}
				if n, err := m.Describe(ids, maxBlocks, table, lens, slots); err != nil || n != numSeqs {
					b.Fatal(n, err)
				}
			}
		})
	}
}

// BenchmarkGrow and BenchmarkDescribe split the step into its two calls.
func BenchmarkGrow(b *testing.B) {
	m, ids, ones, _ := benchBatch(b)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%1024 == 1023 {
			b.StopTimer()
			_ = m.Remove(ids)
			for _, id := range ids {
				_ = m.Add(id, 1000)
			}
			b.StartTimer()
		}
		if err := m.Grow(ids, ones); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkDescribe(b *testing.B) {
	m, ids, ones, _ := benchBatch(b)
	const maxBlocks = 63 // 1001 tokens in blocks of 16: sized to fit
	if err := m.Grow(ids, ones); err != nil {
		b.Fatal(err)
	}
	table := make([]int32, len(ids)*maxBlocks)
	lens := make([]int32, len(ids))
	slots := make([]int32, len(ids))
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := m.Describe(ids, maxBlocks, table, lens, slots); err != nil {
			b.Fatal(err)
		}
	}
}

func benchBatch(b *testing.B) (*Manager, []int64, []int32, int) {
	const bs, maxBlocks = 16, 128
	m := newMgr(b, 256*maxBlocks, bs)
	ids := make([]int64, 256)
	ones := make([]int32, 256)
	for i := range ids {
		ids[i] = int64(i)*7919 + 3
		ones[i] = 1
		if err := m.Add(ids[i], 1000); err != nil {
			b.Fatal(err)
		}
	}
	return m, ids, ones, maxBlocks
}

// BenchmarkAdmit admits one 4096-token prompt (block size 16 or 64) whose
// first 2048 tokens are a cached system prompt: hash the prompt's blocks,
// match, lock and reference the cached half, allocate the other half and
// cache its full blocks. Every prompt's user part is new (its first token is the
// iteration number, which changes every later block's chained hash).
// Sequences are removed in rounds of 128 with the timer stopped.
//   - fresh-pool: the round's blocks are evicted with the timer stopped, so
//     admit finds free blocks;
//   - full-pool: the pool is full of cached blocks, so every admit also
//     evicts the 128 blocks it needs;
//   - no-cache/add: Add(4096) on a manager without the cache, the baseline
//     of the same allocation.
func BenchmarkAdmit(b *testing.B) {
	const promptLen, cached, round = 4096, 2048, 128
	r := rand.New(rand.NewPCG(1, 1))
	prompt := make([]int32, promptLen)
	for i := range prompt {
		prompt[i] = r.Int32N(100000)
	}
	one := func(p []int32) Prompts { return Prompts{Tokens: p, Offsets: []int64{0, int64(len(p))}} }
	for _, bs := range []int{16, 64} {
		for _, mode := range []string{"fresh-pool", "full-pool", "no-cache/add"} {
			benchAdmit(b, bs, mode, prompt, cached, round, one)
		}
	}
}

func benchAdmit(b *testing.B, bs int, mode string, prompt []int32, cached, round int, one func([]int32) Prompts) {
	promptLen := len(prompt)
	need := promptLen / bs
	{
		b.Run(fmt.Sprintf("bs%d/%s", bs, mode), func(b *testing.B) {
			numBlocks := (round + 2) * need
			m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: mode != "no-cache/add"})
			if err != nil {
				b.Fatal(err)
			}
			if m.cache != nil {
				if _, err := m.Admit([]int64{-1}, one(prompt[:cached+1]), nil); err != nil {
					b.Fatal(err)
				}
				// Its step's forward pass: the system prompt's blocks are
				// computed, so they stay cached after the removal and
				// Pin covers them (computed.go).
				m.MarkComputed()
				must(b, m.Remove([]int64{-1}))
				if _, _, err := m.Pin(prompt[:cached], nil); err != nil {
					b.Fatal(err)
				}
			}
			ids := make([]int64, 0, round)
			matched := []int32{0}
			hits := 0
			endRound := func() {
				b.StopTimer()
				// The round's forward passes: its blocks stay cached after
				// the removal, so full-pool fills the pool with cached
				// blocks (computed.go).
				m.MarkComputed()
				must(b, m.Remove(ids))
				ids = ids[:0]
				if mode == "fresh-pool" {
					m.mu.Lock()
					m.makeFree(numBlocks)
					m.mu.Unlock()
				}
				b.StartTimer()
			}
			i := 0
			for b.Loop() {
				id := int64(i)
				prompt[cached] = int32(i)
				i++
				if m.cache == nil {
					must(b, m.Add(id, promptLen))
				} else if n, err := m.Admit([]int64{id}, one(prompt), matched); err != nil || n != 1 {
					b.Fatalf("admit: %d, %v", n, err)
				}
				hits += int(matched[0])
				ids = append(ids, id)
				if len(ids) == round {
					endRound()
				}
			}
			if m.cache != nil {
				if hits != cached*i {
					b.Fatalf("matched %d tokens over %d admits, want %d each", hits, i, cached)
				}
				if mode == "full-pool" {
					b.ReportMetric(float64(m.PrefixStats().Evictions)/float64(i), "evictions/op")
				}
			}
		})
	}
}

// BenchmarkTierIdleStep is the host tier's cost in a decode step when it
// has nothing to copy: 256 sequences of about 1000 tokens (block size 16)
// grow by one token, the step's forward pass is marked computed, and, with
// a tier, the step's copies are flushed: its demote-ahead is met by the
// free blocks and nothing was evicted, so the flush finds no work. The
// difference between the sub-benchmarks is what an idle tier costs a step
// in the core; an engine adds its own calls around it.
func BenchmarkTierIdleStep(b *testing.B) {
	for _, tier := range []bool{false, true} {
		name := "no-tier"
		if tier {
			name = "tier-idle"
		}
		b.Run(name, func(b *testing.B) {
			const numSeqs, prompt, bs, reset = 256, 1000, 16, 128
			maxBlocks := (prompt + reset + bs - 1) / bs
			cfg := Config{NumBlocks: 2 * numSeqs * (maxBlocks + 1), BlockSize: bs, EnablePrefixCache: true}
			if tier {
				pool, err := host.New(host.Config{Slots: 1024, BlockBytes: 16})
				if err != nil {
					b.Fatal(err)
				}
				cfg.HostTier = &HostTier{Pool: pool, Copier: nopCopier{}, DemoteAhead: 64}
			}
			m, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			r := rand.New(rand.NewPCG(1, 2))
			ids := make([]int64, numSeqs)
			ones := make([]int32, numSeqs)
			toks := make([]int32, 0, numSeqs*prompt)
			offs := []int64{0}
			for i := range ids {
				ids[i] = int64(i)
				ones[i] = 1
				for range prompt {
					toks = append(toks, int32(r.IntN(32000)))
				}
				offs = append(offs, int64(len(toks)))
			}
			next := int64(numSeqs)
			admit := func() {
				if n, err := m.Admit(ids, Prompts{Tokens: toks, Offsets: offs}, nil); err != nil || n != numSeqs {
					b.Fatal(n, err)
				}
				m.MarkComputed()
			}
			admit()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i%reset == reset-1 {
					readmit(b, m, ids, func() {
						for j := range ids {
							ids[j] = next
							next++
						}
						admit()
					})
				}
				if err := m.Grow(ids, ones); err != nil {
					b.Fatal(err)
				}
				m.MarkComputed()
				if tier {
					if tk, _, err := m.FlushCopies(); err != nil || tk != 0 {
						b.Fatal("the idle tier found work", tk, err)
					}
				}
			}
		})
	}
}
