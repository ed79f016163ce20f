//go:build linux

package vmem

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

func TestHostDriverMapsRealMemory(t *testing.T) {
	pg := os.Getpagesize()
	h, err := NewHost(2 * pg)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	size := 4 * h.Granularity()
	base, err := h.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	if base%uintptr(h.Granularity()) != 0 {
		t.Fatalf("reservation %#x not aligned to %d", base, h.Granularity())
	}
	p := newPage(t, h, h.Granularity())
	g := h.Granularity()
	mapPage(t, h, base+uintptr(g), g, p)
	b := Bytes(base+uintptr(g), g)
	for i := range b {
		b[i] = byte(i * 7)
	}
	// The page keeps its contents when unmapped and mapped elsewhere.
	unmap(t, h, base+uintptr(g), g)
	mapPage(t, h, base+uintptr(3*g), g, p)
	b = Bytes(base+uintptr(3*g), g)
	for i := range b {
		if b[i] != byte(i*7) {
			t.Fatalf("byte %d after remap: got %d, want %d", i, b[i], byte(i*7))
		}
	}
	unmap(t, h, base+uintptr(3*g), g)
	if err := h.ReleasePage(p); err != nil {
		t.Fatal(err)
	}
	if err := h.ReleasePage(p); err == nil {
		t.Fatal("second release of a page succeeded")
	}
	// A new page mapped where the released one lived gets its memory back,
	// zeroed.
	q := newPage(t, h, g)
	mapPage(t, h, base+uintptr(g), g, q)
	for i, v := range Bytes(base+uintptr(g), g) {
		if v != 0 {
			t.Fatalf("recycled page byte %d is %d, want 0", i, v)
		}
	}
	unmap(t, h, base+uintptr(g), g)
	if err := h.ReleasePage(q); err != nil {
		t.Fatal(err)
	}
	if err := h.FreeReservation(base, size); err != nil {
		t.Fatal(err)
	}
	if n := h.LivePages(); n != 0 {
		t.Fatalf("live pages after release: %d", n)
	}
}

func TestHostDriverRejectsMisalignedRanges(t *testing.T) {
	h, err := NewHost(0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	g := h.Granularity()
	if _, err := NewHost(g + 1); err == nil {
		t.Fatal("granularity not a multiple of the OS page accepted")
	}
	if _, err := h.Reserve(g + 1); err == nil {
		t.Fatal("misaligned reserve accepted")
	}
	if _, err := h.CreatePage(0); err == nil {
		t.Fatal("zero-size page accepted")
	}
	if err := h.Map(uintptr(g), g, Page(12345)); err == nil {
		t.Fatal("map of a page that does not exist accepted")
	}
	if err := h.Unmap(1, g); err == nil {
		t.Fatal("misaligned unmap accepted")
	}
}

// kernelMappings counts the process's mappings that lie in [lo, hi), from
// /proc/self/maps.
func kernelMappings(t testing.TB, lo, hi uintptr) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		var start, end uint64
		if _, err := fmt.Sscanf(line, "%x-%x", &start, &end); err != nil {
			continue
		}
		if uintptr(start) >= lo && uintptr(end) <= hi {
			n++
		}
	}
	return n
}

// kernelCacheMappings counts the kernel's mappings in all of c's tensors.
func kernelCacheMappings(t testing.TB, c *Cache) int {
	n := 0
	for _, b := range c.bases {
		n += kernelMappings(t, b, b+uintptr(c.layout.BufferBytes))
	}
	return n
}

// A 40000-token slot of 4 KiB tokens is 40000 pages a tensor, and decode
// grows it one page at a time: the pages must end up in a few mappings,
// not one each (65530 is the kernel's default cap for a whole process).
func TestHostMapsLongContextsInFewMappings(t *testing.T) {
	for _, background := range []bool{false, true} {
		t.Run(fmt.Sprintf("background=%v", background), func(t *testing.T) {
			h := newHost(t)
			c := newCache(t, Config{Layers: 1, KVHeads: 8, HeadDim: 256, DTypeBytes: 2, MaxBatch: 2, MaxContext: 40000,
				BudgetBytes: 1 << 30, NoBackground: !background}, h)
			a, b := mustAlloc(t, c), mustAlloc(t, c)
			step(t, c, a, 40000) // the whole context at once
			for n := 1; n <= 5000; n++ {
				step(t, c, b, n) // one token, one page a tensor, per step
			}
			c.WaitBackground()
			writeTokens(c, a, 39990, 40000)
			checkTokens(t, c, a, 39990, 40000)
			writeTokens(c, b, 0, 5000)
			checkTokens(t, c, b, 0, 5000)
			model, kernel := h.Mappings(), kernelCacheMappings(t, c)
			// Per tensor: the pages of slots a and b (consecutive in the
			// page file too, so one mapping) and the gap after them.
			if model != 4 || kernel != model {
				t.Fatalf("%d mappings counted, %d in the kernel; want 4", model, kernel)
			}
		})
	}
}

// Pages reused through the idle pool land where other pages have their home
// and take spill offsets; the model still counts what the kernel holds.
func TestHostModelMatchesKernelUnderReuse(t *testing.T) {
	h := newHost(t)
	cfg := testConfig()
	cfg.ReclaimBelowBytes = -1                        // only on demand
	cfg.BudgetBytes = 5 * 4 * int64(os.Getpagesize()) // five pages a tensor: steps reclaim freed slots
	c := newCache(t, cfg, h)
	tpp := tokensPerPage(c)
	// Slot a's pages move to slot b, then a new page goes where one of
	// them has its home: it takes a spill offset.
	a, b := mustAlloc(t, c), mustAlloc(t, c)
	step(t, c, a, 2*tpp)
	if err := c.Free(a); err != nil {
		t.Fatal(err)
	}
	step(t, c, b, 4*tpp)
	if a2 := mustAlloc(t, c); a2 != a {
		t.Fatalf("alloc gave slot %d, want the free slot %d", a2, a)
	}
	step(t, c, a, tpp)
	writeTokens(c, a, 0, tpp)
	writeTokens(c, b, 0, 4*tpp)
	checkTokens(t, c, a, 0, tpp)
	checkTokens(t, c, b, 0, 4*tpp)
	for _, s := range []int{a, b} {
		if err := c.Free(s); err != nil {
			t.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	live := map[int]int{}
	for op := 0; op < 300; op++ {
		switch r := rng.IntN(10); {
		case r < 2 && len(live) < cfg.MaxBatch:
			live[mustAlloc(t, c)] = 0
		case r < 3 && len(live) > 0:
			for s := range live {
				if err := c.Free(s); err != nil {
					t.Fatal(err)
				}
				delete(live, s)
				break
			}
		case r < 4:
			if err := c.Trim(); err != nil {
				t.Fatal(err)
			}
		default:
			for s, n := range live {
				n = min(n+rng.IntN(2*tpp), cfg.MaxContext)
				if err := c.Step([]int32{int32(s)}, []int32{int32(n)}); err != nil && !kverr.Is(err, kverr.OutOfMemory) {
					t.Fatal(err)
				} else if err == nil {
					live[s] = n
				}
				break
			}
		}
		if model, kernel := h.Mappings(), kernelCacheMappings(t, c); kernel != model {
			t.Fatalf("op %d: the kernel holds %d mappings, the model counts %d", op, kernel, model)
		}
	}
	h.mu.Lock()
	spilled := h.end > int64(c.nbuf)*c.layout.BufferBytes
	h.mu.Unlock()
	if !spilled {
		t.Fatal("no page took a spill offset: the test did not reuse pages across slots")
	}
}

// withMapBudget lets a test run with n more host mappings allowed than are
// in use now.
func withMapBudget(t *testing.T, n int) {
	t.Helper()
	_ = hostMapDelta(0, false) // reads the real limit first
	hostMaps.Lock()
	saved := hostMaps.limit
	hostMaps.limit = hostMaps.used + n
	hostMaps.Unlock()
	t.Cleanup(func() {
		hostMaps.Lock()
		hostMaps.limit = saved
		hostMaps.Unlock()
	})
}

func TestHostMappingBudgetRefusesStepBeforeChangingIt(t *testing.T) {
	h := newHost(t)
	c := newCache(t, testConfig(), h) // 4 tensors
	tpp := tokensPerPage(c)
	a, b := mustAlloc(t, c), mustAlloc(t, c)
	kernelBefore := kernelCacheMappings(t, c)
	// Slot a's first pages cut each tensor's gap in two: one more mapping
	// a tensor. Budget for three tensors: the fourth is refused.
	withMapBudget(t, 3)
	hostMaps.Lock()
	usedBefore := hostMaps.used
	hostMaps.Unlock()
	err := c.Step([]int32{int32(a)}, []int32{int32(2 * tpp)})
	if !kverr.Is(err, kverr.OutOfMemory) || !strings.Contains(err.Error(), "vm.max_map_count") {
		t.Fatalf("want OutOfMemory naming vm.max_map_count, got %v", err)
	}
	hostMaps.Lock()
	usedAfter := hostMaps.used
	hostMaps.Unlock()
	if c.MappedTokens(a) != 0 || c.Stats().MappedBytes != 0 || usedAfter != usedBefore || kernelCacheMappings(t, c) != kernelBefore {
		t.Fatalf("refused step changed things: %d tokens mapped, %d bytes, budget used %d -> %d",
			c.MappedTokens(a), c.Stats().MappedBytes, usedBefore, usedAfter)
	}
	// A batch whose first slot fits and second does not: the first is
	// shrunk back.
	withMapBudget(t, 4+1)
	err = c.Step([]int32{int32(a), int32(b)}, []int32{int32(tpp), int32(tpp)})
	if !kverr.Is(err, kverr.OutOfMemory) {
		t.Fatalf("want OutOfMemory for the second slot, got %v", err)
	}
	if c.MappedTokens(a) != 0 || c.MappedTokens(b) != 0 || c.Stats().MappedBytes != 0 || kernelCacheMappings(t, c) != kernelBefore {
		t.Fatalf("refused batch left slot a with %d tokens, b with %d", c.MappedTokens(a), c.MappedTokens(b))
	}
	// With room, the same step works and the memory is usable.
	withMapBudget(t, 100)
	step(t, c, a, tpp, b, tpp)
	writeTokens(c, a, 0, tpp)
	checkTokens(t, c, a, 0, tpp)
}
