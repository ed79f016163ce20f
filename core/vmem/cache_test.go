//go:build linux

package vmem

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// A small model: 2 layers, 2 heads of 8 float32 = 64 bytes a token, so one
// OS page (4 KiB) holds 64 tokens, and a 300-token slot spans 5 pages.
func testConfig() Config {
	return Config{
		Layers: 2, KVHeads: 2, HeadDim: 8, DTypeBytes: 4,
		MaxBatch: 4, MaxContext: 300,
		BudgetBytes: 64 << 20, NoBackground: true,
	}
}

func tokensPerPage(c *Cache) int { return int(c.layout.PageSize / c.layout.TokenStride) }

// unitBytes is the physical memory of one page in every tensor.
func unitBytes(c *Cache) int64 { return int64(c.nbuf) * c.layout.PageSize }

// faultyDriver wraps a driver to fail or slow down chosen calls.
type faultyDriver struct {
	Driver
	mu        sync.Mutex
	maps      int
	failMapAt int           // fail the n-th Map (1-based); 0: never
	mapDelay  time.Duration // sleep in every Map
}

var errInjected = errors.New("injected driver failure")

func (f *faultyDriver) Map(addr uintptr, size int, p Page) error {
	f.mu.Lock()
	f.maps++
	n := f.maps
	f.mu.Unlock()
	if f.mapDelay > 0 {
		time.Sleep(f.mapDelay)
	}
	if n == f.failMapAt {
		return errInjected
	}
	return f.Driver.Map(addr, size, p)
}

func newHost(t testing.TB) *Host {
	t.Helper()
	h, err := NewHost(os.Getpagesize())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func newCache(t testing.TB, cfg Config, drv Driver) *Cache {
	t.Helper()
	c, err := New(cfg, drv)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return c
}

func mustAlloc(t testing.TB, c *Cache) int {
	t.Helper()
	s, err := c.Alloc()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func step(t testing.TB, c *Cache, pairs ...int) {
	t.Helper()
	slots, ctx := make([]int32, 0, len(pairs)/2), make([]int32, 0, len(pairs)/2)
	for i := 0; i < len(pairs); i += 2 {
		slots = append(slots, int32(pairs[i]))
		ctx = append(ctx, int32(pairs[i+1]))
	}
	if err := c.Step(slots, ctx); err != nil {
		t.Fatalf("step %v: %v", pairs, err)
	}
}

// word is the first 4 bytes of token tok of slot in tensor buf.
func word(c *Cache, buf, slot, tok int) *uint32 {
	a := c.bases[buf] + uintptr(int64(slot)*c.layout.SlotStride+int64(tok)*c.layout.TokenStride)
	return (*uint32)(pointerAt(a))
}

func pattern(buf, slot, tok int) uint32 { return uint32(buf)<<24 | uint32(slot)<<16 | uint32(tok) }

func writeTokens(c *Cache, slot, from, to int) {
	for b := 0; b < c.nbuf; b++ {
		for tok := from; tok < to; tok++ {
			*word(c, b, slot, tok) = pattern(b, slot, tok)
			// The token's last element too: a whole row must be mapped.
			last := (*uint32)(unsafe.Add(unsafe.Pointer(word(c, b, slot, tok)), c.layout.TokenStride-4))
			*last = ^pattern(b, slot, tok)
		}
	}
}

func checkTokens(t testing.TB, c *Cache, slot, from, to int) {
	t.Helper()
	for b := 0; b < c.nbuf; b++ {
		for tok := from; tok < to; tok++ {
			if got, want := *word(c, b, slot, tok), pattern(b, slot, tok); got != want {
				t.Fatalf("tensor %d slot %d token %d: got %#x, want %#x", b, slot, tok, got, want)
			}
			last := (*uint32)(unsafe.Add(unsafe.Pointer(word(c, b, slot, tok)), c.layout.TokenStride-4))
			if *last != ^pattern(b, slot, tok) {
				t.Fatalf("tensor %d slot %d token %d: last element %#x", b, slot, tok, *last)
			}
		}
	}
}

func TestLayoutPadsSlotsToPages(t *testing.T) {
	c := newCache(t, testConfig(), newHost(t))
	l := c.Layout()
	pg := int64(os.Getpagesize())
	if l.TokenStride != 64 || l.HeadStride != 32 || l.PageSize != pg {
		t.Fatalf("layout %+v", l)
	}
	want := (300*64 + pg - 1) / pg * pg
	if l.SlotStride != want || l.BufferBytes != 4*want {
		t.Fatalf("slot stride %d (want %d), buffer %d", l.SlotStride, want, l.BufferBytes)
	}
	if s := l.ElementStrides(); s != [4]int64{want / 4, 16, 8, 1} {
		t.Fatalf("element strides %v", s)
	}
	k0, v0, err := c.LayerPtrs(0)
	if err != nil {
		t.Fatal(err)
	}
	k1, v1, _ := c.LayerPtrs(1)
	if len(map[uintptr]bool{k0: true, v0: true, k1: true, v1: true}) != 4 {
		t.Fatal("layer pointers are not distinct")
	}
}

func TestWriteReadThroughMappedRanges(t *testing.T) {
	for _, bg := range []bool{false, true} {
		t.Run(fmt.Sprintf("background=%v", bg), func(t *testing.T) {
			cfg := testConfig()
			cfg.NoBackground = !bg
			c := newCache(t, cfg, newHost(t))
			a, b, d := mustAlloc(t, c), mustAlloc(t, c), mustAlloc(t, c)
			step(t, c, a, 100, b, 64, d, 1)
			// Step maps exactly one page; the background mapper, when on,
			// may already have mapped the next one for the lookahead
			// (64 + DefaultLookahead tokens).
			if got := c.MappedTokens(b); got != 64 && !(bg && got == 128) {
				t.Fatalf("64 tokens mapped %d (want one page, or two with the background lookahead)", got)
			}
			writeTokens(c, a, 0, 100)
			writeTokens(c, b, 0, 64)
			writeTokens(c, d, 0, 1)
			// Later mappings (more pages of the same and other slots) keep
			// what was written, and slots never alias.
			step(t, c, a, 300, b, 65, d, 200)
			writeTokens(c, a, 100, 300)
			writeTokens(c, b, 64, 65)
			writeTokens(c, d, 1, 200)
			c.WaitBackground()
			checkTokens(t, c, a, 0, 300)
			checkTokens(t, c, b, 0, 65)
			checkTokens(t, c, d, 0, 200)
			st := c.Stats()
			if st.ActiveSlots != 3 || st.Steps != 2 {
				t.Fatalf("stats %+v", st)
			}
			if st.MappedBytes < (5+2+4)*unitBytes(c) {
				t.Fatalf("mapped %d bytes, want at least %d", st.MappedBytes, (5+2+4)*unitBytes(c))
			}
			if st.MapCalls != st.MappedBytes/c.layout.PageSize {
				t.Fatalf("map calls %d for %d mapped bytes", st.MapCalls, st.MappedBytes)
			}
		})
	}
}

func TestStepOutOfBudgetChangesNothing(t *testing.T) {
	cfg := testConfig()
	c0 := newCache(t, cfg, newHost(t))
	cfg.BudgetBytes = 6 * unitBytes(c0) // six pages in every tensor
	c := newCache(t, cfg, newHost(t))
	tpp := tokensPerPage(c)
	a, b := mustAlloc(t, c), mustAlloc(t, c)
	step(t, c, a, tpp) // 1 unit
	before := c.Stats()

	// 4 + 3 units > 6: refused as a whole, nothing mapped.
	err := c.Step([]int32{int32(a), int32(b)}, []int32{int32(4 * tpp), int32(3 * tpp)})
	if !kverr.Is(err, kverr.OutOfMemory) {
		t.Fatalf("want OutOfMemory, got %v", err)
	}
	after := c.Stats()
	if after.MappedBytes != before.MappedBytes || after.MapCalls != before.MapCalls || after.HeldBytes != before.HeldBytes {
		t.Fatalf("a refused step changed the cache: %+v -> %+v", before, after)
	}
	if c.MappedTokens(a) != tpp || c.MappedTokens(b) != 0 {
		t.Fatalf("mapped tokens a=%d b=%d", c.MappedTokens(a), c.MappedTokens(b))
	}
	if after.OutOfMemory != 1 {
		t.Fatalf("OutOfMemory count %d", after.OutOfMemory)
	}
	// An invalid entry after a valid one maps nothing either.
	err = c.Step([]int32{int32(a), 3}, []int32{int32(2 * tpp), 1})
	if !kverr.Is(err, kverr.NotFound) {
		t.Fatalf("want NotFound, got %v", err)
	}
	if c.MappedTokens(a) != tpp || c.Stats().MapCalls != before.MapCalls {
		t.Fatal("a step with a bad slot mapped pages")
	}
	// What fits still works: 4 + 2 = 6.
	step(t, c, a, 4*tpp, b, 2*tpp)
	if got := c.Stats().MappedBytes; got != 6*unitBytes(c) {
		t.Fatalf("mapped %d bytes, want %d", got, 6*unitBytes(c))
	}
}

func TestFreedSlotKeepsPagesForTheNextAlloc(t *testing.T) {
	c := newCache(t, testConfig(), newHost(t))
	tpp := tokensPerPage(c)
	a, b, d := mustAlloc(t, c), mustAlloc(t, c), mustAlloc(t, c)
	step(t, c, a, tpp, b, 4*tpp, d, 2*tpp)
	writeTokens(c, b, 0, 4*tpp)
	for _, s := range []int{a, b, d} {
		if err := c.Free(s); err != nil {
			t.Fatal(err)
		}
	}
	st := c.Stats()
	if st.ReusableSlots != 3 || st.ActiveSlots != 0 || st.MappedBytes != 7*unitBytes(c) {
		t.Fatalf("after free: %+v", st)
	}
	// The slot with the most pages comes first, then the next.
	if s := mustAlloc(t, c); s != b {
		t.Fatalf("alloc gave slot %d, want %d (most pages)", s, b)
	}
	if s := mustAlloc(t, c); s != d {
		t.Fatalf("alloc gave slot %d, want %d", s, d)
	}
	calls := c.Stats().MapCalls
	step(t, c, b, 4*tpp, d, 2*tpp)
	if got := c.Stats().MapCalls; got != calls {
		t.Fatalf("reused slots mapped %d pages again", got-calls)
	}
	checkTokens(t, c, b, 0, 4*tpp) // the same physical pages
}

func TestReclaimBelowThreshold(t *testing.T) {
	for _, bg := range []bool{false, true} {
		t.Run(fmt.Sprintf("background=%v", bg), func(t *testing.T) {
			cfg := testConfig()
			cfg.NoBackground = !bg
			cfg.LookaheadTokens = 1
			c0 := newCache(t, cfg, newHost(t))
			unit := unitBytes(c0)
			cfg.BudgetBytes = 10 * unit
			cfg.ReclaimBelowBytes = 4 * unit
			c := newCache(t, cfg, newHost(t))
			tpp := tokensPerPage(c)
			a, b, d := mustAlloc(t, c), mustAlloc(t, c), mustAlloc(t, c)
			step(t, c, a, 4*tpp-1, b, 2*tpp-1, d, 2*tpp-1) // 8 units: 2 free
			c.WaitBackground()
			if got := c.Stats().MappedBytes; got != 8*unit {
				t.Fatalf("mapped %d, want %d", got/unit, 8)
			}
			// Freeing b: free budget 2 < 4, so b's 2 units go back to the pool
			// (b has the fewest pages); free is then 4 and a's pages stay.
			if err := c.Free(b); err != nil {
				t.Fatal(err)
			}
			if err := c.Free(a); err != nil {
				t.Fatal(err)
			}
			c.WaitBackground()
			st := c.Stats()
			if st.MappedBytes != 6*unit || st.ReusableSlots != 1 || c.MappedTokens(b) != 0 || c.MappedTokens(a) != 4*tpp {
				t.Fatalf("after reclaim: mapped %d units, cached %d, b %d a %d tokens", st.MappedBytes/unit, st.ReusableSlots, c.MappedTokens(b), c.MappedTokens(a))
			}
			if st.UnmapCalls != 2*int64(c.nbuf) || st.HeldBytes != 8*unit {
				t.Fatalf("unmap calls %d, held %d units", st.UnmapCalls, st.HeldBytes/unit)
			}
			// Reclaimed pages are reused without creating new ones.
			creates := st.CreateCalls
			step(t, c, d, 4*tpp-1)
			if got := c.Stats().CreateCalls; got != creates {
				t.Fatalf("created %d pages while idle pages were pooled", got-creates)
			}
			// Trim gives everything not in use back.
			if err := c.Trim(); err != nil {
				t.Fatal(err)
			}
			st = c.Stats()
			if st.HeldBytes != st.MappedBytes || st.MappedBytes != 4*unit || st.ReusableSlots != 0 {
				t.Fatalf("after trim: %+v", st)
			}
		})
	}
}

func TestStepReclaimsFreedSlotsOnDemand(t *testing.T) {
	cfg := testConfig()
	c0 := newCache(t, cfg, newHost(t))
	cfg.BudgetBytes = 5 * unitBytes(c0)
	cfg.ReclaimBelowBytes = -1 // only on demand
	c := newCache(t, cfg, newHost(t))
	tpp := tokensPerPage(c)
	a := mustAlloc(t, c)
	step(t, c, a, 4*tpp)
	if err := c.Free(a); err != nil {
		t.Fatal(err)
	}
	b := mustAlloc(t, c) // gets a back: it has the pages
	if b != a {
		t.Fatalf("alloc gave %d, want the cached slot %d", b, a)
	}
	d := mustAlloc(t, c)
	// d needs 3 units; 1 is free and a's 4 are in use: refused.
	if err := c.Step([]int32{int32(d)}, []int32{int32(3 * tpp)}); !kverr.Is(err, kverr.OutOfMemory) {
		t.Fatalf("want OutOfMemory, got %v", err)
	}
	if err := c.Free(b); err != nil {
		t.Fatal(err)
	}
	step(t, c, d, 3*tpp) // now a's cached pages are reclaimed for d
	if c.MappedTokens(a) != 0 || c.MappedTokens(d) != 3*tpp {
		t.Fatalf("a %d d %d tokens", c.MappedTokens(a), c.MappedTokens(d))
	}
	writeTokens(c, d, 0, 3*tpp)
	checkTokens(t, c, d, 0, 3*tpp)
}

func TestDriverFailureLeavesSlotUnchanged(t *testing.T) {
	h := newHost(t)
	f := &faultyDriver{Driver: h}
	c := newCache(t, testConfig(), f)
	tpp := tokensPerPage(c)
	a := mustAlloc(t, c)
	step(t, c, a, tpp)
	f.mu.Lock()
	f.failMapAt = f.maps + 5 // in the middle of the next growth
	f.mu.Unlock()
	err := c.Step([]int32{int32(a)}, []int32{int32(3 * tpp)})
	if !errors.Is(err, errInjected) {
		t.Fatalf("want the injected failure, got %v", err)
	}
	if c.MappedTokens(a) != tpp || c.Stats().MappedBytes != unitBytes(c) {
		t.Fatalf("failed step left %d tokens mapped", c.MappedTokens(a))
	}
	step(t, c, a, 3*tpp) // the retry maps over the rolled-back range
	writeTokens(c, a, 0, 3*tpp)
	checkTokens(t, c, a, 0, 3*tpp)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if n := h.LivePages(); n != 0 {
		t.Fatalf("%d pages live after close", n)
	}
}

func TestBadInputs(t *testing.T) {
	h := newHost(t)
	base := testConfig()
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		code kverr.Code
	}{
		{"layers 0", func(c *Config) { c.Layers = 0 }, kverr.InvalidArgument},
		{"kv heads negative", func(c *Config) { c.KVHeads = -1 }, kverr.InvalidArgument},
		{"dtype 3", func(c *Config) { c.DTypeBytes = 3 }, kverr.InvalidArgument},
		{"max batch 0", func(c *Config) { c.MaxBatch = 0 }, kverr.InvalidArgument},
		{"max context huge", func(c *Config) { c.MaxContext = 1 << 31 }, kverr.InvalidArgument},
		{"page not a multiple", func(c *Config) { c.PageSize = os.Getpagesize() + 512 }, kverr.InvalidArgument},
		{"budget under one unit", func(c *Config) { c.BudgetBytes = 100 }, kverr.InvalidArgument},
		{"budget zero", func(c *Config) { c.BudgetBytes = 0 }, kverr.InvalidArgument},
		{"lookahead negative", func(c *Config) { c.LookaheadTokens = -1 }, kverr.InvalidArgument},
		{"address space too large", func(c *Config) { c.MaxBatch = 1 << 16; c.MaxContext = 1 << 30 }, kverr.InvalidArgument},
	} {
		cfg := base
		tc.mod(&cfg)
		if _, err := New(cfg, h); !kverr.Is(err, tc.code) {
			t.Errorf("%s: want %v, got %v", tc.name, tc.code, err)
		}
	}
	if _, err := New(base, nil); !kverr.Is(err, kverr.NullPointer) {
		t.Errorf("nil driver: got %v", err)
	}

	c := newCache(t, base, h)
	a := mustAlloc(t, c)
	for _, tc := range []struct {
		name       string
		slots, ctx []int32
		code       kverr.Code
	}{
		{"length mismatch", []int32{int32(a)}, nil, kverr.InvalidArgument},
		{"slot negative", []int32{-1}, []int32{1}, kverr.InvalidArgument},
		{"slot out of range", []int32{4}, []int32{1}, kverr.InvalidArgument},
		{"slot not allocated", []int32{1}, []int32{1}, kverr.NotFound},
		{"slot twice", []int32{int32(a), int32(a)}, []int32{1, 2}, kverr.InvalidArgument},
		{"context over max", []int32{int32(a)}, []int32{301}, kverr.InvalidArgument},
		{"context negative", []int32{int32(a)}, []int32{-1}, kverr.InvalidArgument},
	} {
		if err := c.Step(tc.slots, tc.ctx); !kverr.Is(err, tc.code) {
			t.Errorf("step %s: want %v, got %v", tc.name, tc.code, err)
		}
	}
	if st := c.Stats(); st.MapCalls != 0 || st.Steps != 0 {
		t.Errorf("bad steps changed the cache: %+v", st)
	}
	if err := c.Step(nil, nil); err != nil {
		t.Errorf("empty step: %v", err)
	}
	if err := c.Free(7); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("free out of range: %v", err)
	}
	if err := c.Free(2); !kverr.Is(err, kverr.NotFound) {
		t.Errorf("free of a free slot: %v", err)
	}
	if _, _, err := c.LayerPtrs(2); !kverr.Is(err, kverr.InvalidArgument) {
		t.Errorf("layer out of range: %v", err)
	}
	for i := 1; i < base.MaxBatch; i++ {
		mustAlloc(t, c)
	}
	if _, err := c.Alloc(); !kverr.Is(err, kverr.OutOfMemory) {
		t.Errorf("alloc with all slots in use: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Step([]int32{int32(a)}, []int32{1}); !kverr.Is(err, kverr.InvalidHandle) {
		t.Errorf("step after close: %v", err)
	}
	if _, err := c.Alloc(); !kverr.Is(err, kverr.InvalidHandle) {
		t.Errorf("alloc after close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("second close: %v", err)
	}
}

// Steps race the background mapper (slowed down so its jobs overlap the
// Steps), while another goroutine churns other slots. After every Step the
// whole context of each slot must be mapped and writable.
func TestStepRacesBackgroundMapper(t *testing.T) {
	h := newHost(t)
	f := &faultyDriver{Driver: h, mapDelay: 20 * time.Microsecond}
	cfg := testConfig()
	cfg.NoBackground = false
	cfg.MaxBatch = 8
	cfg.MaxContext = 1000
	cfg.LookaheadTokens = 40
	c0 := newCache(t, cfg, h)
	cfg.BudgetBytes = 60 * unitBytes(c0)
	cfg.ReclaimBelowBytes = 8 * unitBytes(c0)
	c := newCache(t, cfg, f)

	var wg sync.WaitGroup
	var failed atomic.Bool
	run := func(seed uint64, nslots, steps int) {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(seed, 1))
		for round := 0; round < 3 && !failed.Load(); round++ {
			slots := make([]int32, nslots)
			ctx := make([]int32, nslots)
			for i := range slots {
				s, err := c.Alloc()
				if err != nil {
					t.Error(err)
					failed.Store(true)
					return
				}
				slots[i] = int32(s)
				ctx[i] = int32(rng.IntN(50))
			}
			for it := 0; it < steps && !failed.Load(); it++ {
				for i := range ctx {
					ctx[i] = min(ctx[i]+int32(1+rng.IntN(6)), int32(cfg.MaxContext))
				}
				if err := c.Step(slots, ctx); err != nil {
					if kverr.Is(err, kverr.OutOfMemory) {
						continue // the other goroutine holds the budget for now
					}
					t.Error(err)
					failed.Store(true)
					return
				}
				for i, s := range slots {
					if got := c.MappedTokens(int(s)); got < int(ctx[i]) {
						t.Errorf("slot %d: %d tokens mapped after a step to %d", s, got, ctx[i])
						failed.Store(true)
						return
					}
					writeTokens(c, int(s), int(ctx[i])-1, int(ctx[i]))
					checkTokens(t, c, int(s), int(ctx[i])-1, int(ctx[i]))
				}
				if it%16 == 0 {
					time.Sleep(200 * time.Microsecond) // "GPU work": let the mapper run
				}
			}
			for _, s := range slots {
				if err := c.Free(int(s)); err != nil {
					t.Error(err)
					failed.Store(true)
					return
				}
			}
		}
	}
	wg.Add(2)
	go run(1, 4, 120)
	go run(2, 3, 90)
	wg.Wait()
	c.WaitBackground()
	st := c.Stats()
	if st.BackgroundMapNs == 0 || st.BackgroundErrors != 0 {
		t.Fatalf("background did no work or failed: %+v", st)
	}
	if st.HeldBytes > st.BudgetBytes {
		t.Fatalf("held %d over the budget %d", st.HeldBytes, st.BudgetBytes)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if n := h.LivePages(); n != 0 {
		t.Fatalf("%d pages live after close", n)
	}
}

// With background mapping on, a decode loop's Steps find their pages mapped
// ahead: after the first Step, none maps on the critical path.
func TestBackgroundMapsAhead(t *testing.T) {
	cfg := testConfig()
	cfg.NoBackground = false
	cfg.LookaheadTokens = 8
	c := newCache(t, cfg, newHost(t))
	a, b := mustAlloc(t, c), mustAlloc(t, c)
	step(t, c, a, 10, b, 60)
	first := c.Stats().MapCalls
	for ctx := 11; ctx <= 250; ctx++ {
		c.WaitBackground() // the GPU step the mapper overlaps with
		before := c.Stats().StepMapNs
		step(t, c, a, ctx, b, ctx+50)
		if got := c.Stats().StepMapNs; got != before {
			t.Fatalf("step to %d mapped on the critical path", ctx)
		}
	}
	if c.Stats().MapCalls <= first {
		t.Fatal("the background mapped nothing")
	}
}

func BenchmarkStepSteady(b *testing.B) {
	for _, bg := range []bool{false, true} {
		b.Run(fmt.Sprintf("slots=64/background=%v", bg), func(b *testing.B) {
			cfg := Config{Layers: 4, KVHeads: 2, HeadDim: 8, DTypeBytes: 4, MaxBatch: 64, MaxContext: 1024,
				BudgetBytes: 1 << 30, NoBackground: !bg}
			c := newCache(b, cfg, newHost(b))
			slots := make([]int32, 64)
			ctx := make([]int32, 64)
			for i := range slots {
				slots[i] = int32(mustAlloc(b, c))
				ctx[i] = int32(100 + 5*i)
			}
			if err := c.Step(slots, ctx); err != nil {
				b.Fatal(err)
			}
			c.WaitBackground()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.Step(slots, ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A driver failure on a later slot of a batch undoes the earlier slots'
// growth: the Step changes nothing.
func TestDriverFailureUndoesTheWholeBatch(t *testing.T) {
	h := newHost(t)
	f := &faultyDriver{Driver: h}
	c := newCache(t, testConfig(), f)
	tpp := tokensPerPage(c)
	a, b := mustAlloc(t, c), mustAlloc(t, c)
	step(t, c, a, tpp)
	before := c.Stats()
	f.mu.Lock()
	f.failMapAt = f.maps + 2*c.nbuf + 1 // slot a's two new units map, then b's first page fails
	f.mu.Unlock()
	err := c.Step([]int32{int32(a), int32(b)}, []int32{int32(3 * tpp), int32(tpp)})
	if !errors.Is(err, errInjected) {
		t.Fatalf("want the injected failure, got %v", err)
	}
	after := c.Stats()
	if c.MappedTokens(a) != tpp || c.MappedTokens(b) != 0 || after.MappedBytes != before.MappedBytes || after.Steps != before.Steps {
		t.Fatalf("failed batch left slot a with %d tokens, b with %d, %d bytes mapped (was %d)",
			c.MappedTokens(a), c.MappedTokens(b), after.MappedBytes, before.MappedBytes)
	}
	step(t, c, a, 3*tpp, b, tpp)
	writeTokens(c, a, 0, 3*tpp)
	checkTokens(t, c, a, 0, 3*tpp)
}
