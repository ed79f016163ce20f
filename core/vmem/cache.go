package vmem

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
)

// maxPages bounds the pages one cache holds (budget_bytes is capped to it):
// 256 GiB of 4 KiB host pages, 128 TiB of 2 MiB CUDA pages.
const maxPages = 1 << 26

// DefaultLookahead is how many tokens beyond a slot's context the background
// mapper keeps mapped when Config.LookaheadTokens is 0: decode adds one token
// a step, speculative decoding a few, so a small margin suffices.
const DefaultLookahead = 16

// Config describes a cache. The zero values of the optional fields are the
// defaults.
type Config struct {
	Layers     int // model layers on this device, in [1, 4096]
	KVHeads    int // KV heads on this device, in [1, 4096]
	HeadDim    int // in [1, 4096]
	DTypeBytes int // bytes per element: 1, 2, 4 or 8; 0 means 2 (fp16, bf16)
	MaxBatch   int // request slots, in [1, 65536]
	MaxContext int // tokens per slot, in [1, 2^30]

	// PageSize is the physical page size in bytes, a multiple of the
	// driver's granularity (2 MiB for CUDA); 0 means the granularity.
	PageSize int
	// BudgetBytes bounds the physical memory the cache holds (mapped pages
	// plus idle pages kept for reuse). It must cover at least one page in
	// each of the 2*Layers tensors.
	BudgetBytes int64
	// LookaheadTokens: the background mapper maps each active slot up to its
	// last context length plus this many tokens. 0 means DefaultLookahead.
	LookaheadTokens int
	// NoBackground turns background mapping off: Step maps everything it
	// needs itself, on the critical path.
	NoBackground bool
	// ReclaimBelowBytes: when the budget left for new mappings (unheld
	// budget plus idle pages) falls under this, pages of freed slots are
	// unmapped and returned to the idle pool. 0 means BudgetBytes/8;
	// negative reclaims only on demand (when a Step needs the pages).
	ReclaimBelowBytes int64
}

// Layout is the shape of every K and V tensor. Each is one contiguous
// virtual range of BufferBytes bytes, indexed
//
//	[slot][token][head][dim]  at  base + slot*SlotStride + token*TokenStride + head*HeadStride + dim*DTypeBytes
//
// SlotStride is MaxContext*TokenStride rounded up to a page multiple, so
// that every slot's region starts on a page and slots map independently:
// the batch stride is therefore generally not MaxContext*TokenStride, and a
// kernel must be given the real strides (in elements: SlotStride/DTypeBytes,
// KVHeads*HeadDim, HeadDim, 1).
type Layout struct {
	Layers, KVHeads, HeadDim, DTypeBytes, MaxBatch, MaxContext int

	PageSize    int64 // bytes of one physical page
	TokenStride int64 // bytes between consecutive tokens of a slot
	HeadStride  int64 // bytes between heads of a token
	SlotStride  int64 // bytes between slots: the padded per-slot region
	BufferBytes int64 // MaxBatch*SlotStride: virtual size of one K or V tensor
}

// ElementStrides returns the strides of [slot, token, head, dim] in elements.
func (l Layout) ElementStrides() [4]int64 {
	e := int64(l.DTypeBytes)
	return [4]int64{l.SlotStride / e, l.TokenStride / e, l.HeadStride / e, 1}
}

// Stats is a snapshot of the cache's state and counters.
type Stats struct {
	PageSize      int64
	BudgetBytes   int64 // the budget, rounded down to whole page groups
	MappedBytes   int64 // mapped into slots (active and freed)
	HeldBytes     int64 // physical memory held: mapped, idle, or in flight
	ActiveSlots   int
	ReusableSlots int // freed slots that still hold mapped pages

	Steps        int64
	MapCalls     int64 // pages mapped
	UnmapCalls   int64 // pages unmapped
	CreateCalls  int64 // pages created
	ReleaseCalls int64 // pages released to the driver
	OutOfMemory  int64 // Steps refused for lack of budget

	StepMapNs        int64 // time Steps spent mapping pages (critical path)
	StepWaitNs       int64 // time Steps waited for background jobs on their slots
	BackgroundMapNs  int64 // time the background spent mapping and unmapping
	BackgroundErrors int64 // background jobs that failed (Step retries them)
}

type slotState struct {
	pages   []Page // pages[u*nbuf+b]: page unit u of tensor b
	units   int    // page units [0, units) are mapped in every tensor
	tokens  int32  // tokens the mapped units hold, capped at MaxContext
	lastCtx int32  // context length at the last Step
	stamp   uint32 // catches a slot given twice to one Step
	active  bool
	busy    bool // a background job maps or unmaps this slot's pages
}

// Cache is a virtual-contiguous KV cache. All methods are safe for
// concurrent use.
//
// Physical memory is counted in page units: one page in each of the
// 2*Layers tensors at the same offset of a slot. A slot's mapped units are
// always a prefix [0, units) of its region, so "is this context mapped" is
// one comparison per slot.
type Cache struct {
	drv          Driver
	layout       Layout
	nbuf         int // 2*Layers tensors: K of layer l is 2l, V is 2l+1
	pageSize     int
	tokenBytes   int64
	lookahead    int32
	budgetUnits  int
	reclaimBelow int // units
	bases        []uintptr
	background   bool

	mu         sync.Mutex
	cond       sync.Cond
	slots      []slotState
	pool       []Page // idle pages, whole units (len is a multiple of nbuf)
	held       int    // units created and not released
	mapped     int    // units mapped into slots
	reclaiming int    // units a background job is unmapping (held, not pooled yet)
	active     int
	epoch      uint32
	closed     bool
	cursor     int    // where the background's next scan starts
	passStart  uint64 // background passes started
	passEnd    uint64 // last background pass finished

	wake chan struct{}
	stop chan struct{}
	done chan struct{}

	nSteps, nMap, nUnmap, nCreate, nRelease, nOOM atomic.Int64
	stepMapNs, stepWaitNs, bgNs, bgErrors         atomic.Int64
}

// New reserves the 2*Layers virtual tensors and starts the background mapper
// (unless cfg.NoBackground). Nothing is mapped until Step. The driver stays
// the caller's: Close does not close it.
func New(cfg Config, drv Driver) (*Cache, error) {
	if drv == nil {
		return nil, kverr.Errorf(kverr.NullPointer, "vmem: driver is nil")
	}
	if err := checkConfig(&cfg, drv.Granularity()); err != nil {
		return nil, err
	}
	tokenBytes := int64(cfg.KVHeads) * int64(cfg.HeadDim) * int64(cfg.DTypeBytes)
	page := int64(cfg.PageSize)
	slotBytes := (int64(cfg.MaxContext)*tokenBytes + page - 1) / page * page
	bufBytes := slotBytes * int64(cfg.MaxBatch)
	if slotBytes > 1<<47 || bufBytes > 1<<47 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "vmem: each K/V tensor would need %d bytes of address space (max_batch %d x %d per slot); the limit is 2^47", bufBytes, cfg.MaxBatch, slotBytes)
	}
	nbuf := 2 * cfg.Layers
	unitBytes := int64(nbuf) * page
	budgetUnits := cfg.BudgetBytes / unitBytes
	if budgetUnits < 1 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "vmem: budget of %d bytes is less than one page in each of the %d K/V tensors (%d bytes)", cfg.BudgetBytes, nbuf, unitBytes)
	}
	// The cache keeps a handle for every page it holds: capping the pages
	// bounds that bookkeeping (8 bytes a page, 512 MiB at most), which the
	// Go runtime could not survive failing to allocate.
	budgetUnits = min(budgetUnits, maxPages/int64(nbuf))
	reclaimBelow := cfg.ReclaimBelowBytes
	switch {
	case reclaimBelow == 0:
		reclaimBelow = cfg.BudgetBytes / 8
	case reclaimBelow < 0:
		reclaimBelow = 0 // only when a Step needs the pages
	}
	lookahead := cfg.LookaheadTokens
	if lookahead == 0 {
		lookahead = DefaultLookahead
	}
	c := &Cache{
		drv: drv,
		layout: Layout{
			Layers: cfg.Layers, KVHeads: cfg.KVHeads, HeadDim: cfg.HeadDim, DTypeBytes: cfg.DTypeBytes,
			MaxBatch: cfg.MaxBatch, MaxContext: cfg.MaxContext,
			PageSize: page, TokenStride: tokenBytes, HeadStride: int64(cfg.HeadDim) * int64(cfg.DTypeBytes),
			SlotStride: slotBytes, BufferBytes: bufBytes,
		},
		nbuf:         nbuf,
		pageSize:     cfg.PageSize,
		tokenBytes:   tokenBytes,
		lookahead:    int32(min(lookahead, cfg.MaxContext)),
		budgetUnits:  int(budgetUnits),
		reclaimBelow: int(min((reclaimBelow+unitBytes-1)/unitBytes, budgetUnits)),
		background:   !cfg.NoBackground,
		slots:        make([]slotState, cfg.MaxBatch),
	}
	c.cond.L = &c.mu
	for b := 0; b < nbuf; b++ {
		base, err := drv.Reserve(int(bufBytes))
		if err != nil {
			for _, p := range c.bases {
				_ = drv.FreeReservation(p, int(bufBytes))
			}
			return nil, driverError(kverr.Internal, err, "vmem: reserving K/V tensor %d of %d (%d bytes)", b, nbuf, bufBytes)
		}
		c.bases = append(c.bases, base)
	}
	if c.background {
		c.wake = make(chan struct{}, 1)
		c.stop = make(chan struct{})
		c.done = make(chan struct{})
		go c.backgroundLoop()
	}
	return c, nil
}

// Check validates the configuration as far as it can without a driver
// (New also checks the page size against the driver's granularity).
func (cfg Config) Check() error {
	type rng struct {
		name   string
		v      int
		lo, hi int
	}
	for _, r := range []rng{
		{"num_layers", cfg.Layers, 1, 4096},
		{"num_kv_heads", cfg.KVHeads, 1, 4096},
		{"head_dim", cfg.HeadDim, 1, 4096},
		{"max_batch", cfg.MaxBatch, 1, 1 << 16},
		{"max_context", cfg.MaxContext, 1, 1 << 30},
		{"lookahead_tokens", cfg.LookaheadTokens, 0, 1 << 30},
	} {
		if r.v < r.lo || r.v > r.hi {
			return kverr.Errorf(kverr.InvalidArgument, "vmem: %s must be in [%d, %d]: got %d", r.name, r.lo, r.hi, r.v)
		}
	}
	switch cfg.DTypeBytes {
	case 0, 1, 2, 4, 8:
	default:
		return kverr.Errorf(kverr.InvalidArgument, "vmem: dtype_bytes must be 1, 2, 4 or 8 (0: 2): got %d", cfg.DTypeBytes)
	}
	if cfg.PageSize < 0 || cfg.PageSize > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "vmem: page_size must be in [0, 1 GiB] (0: the driver's granularity): got %d", cfg.PageSize)
	}
	if cfg.BudgetBytes <= 0 {
		return kverr.Errorf(kverr.InvalidArgument, "vmem: budget_bytes must be > 0: got %d", cfg.BudgetBytes)
	}
	return nil
}

// DefaultDTypeBytes is the element size of a Config whose DTypeBytes is 0.
const DefaultDTypeBytes = 2

func checkConfig(cfg *Config, gran int) error {
	if err := cfg.Check(); err != nil {
		return err
	}
	if cfg.DTypeBytes == 0 {
		cfg.DTypeBytes = DefaultDTypeBytes
	}
	if gran <= 0 {
		return kverr.Errorf(kverr.Internal, "vmem: driver granularity is %d", gran)
	}
	if cfg.PageSize == 0 {
		cfg.PageSize = gran
	}
	if cfg.PageSize < gran || cfg.PageSize%gran != 0 || cfg.PageSize > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "vmem: page_size must be a multiple of the driver's granularity %d, at most 1 GiB: got %d", gran, cfg.PageSize)
	}
	return nil
}

// Layout returns the tensors' shape and strides.
func (c *Cache) Layout() Layout { return c.layout }

// LayerPtrs returns the base addresses of layer's K and V tensors.
func (c *Cache) LayerPtrs(layer int) (k, v uintptr, err error) {
	if layer < 0 || layer >= c.layout.Layers {
		return 0, 0, kverr.Errorf(kverr.InvalidArgument, "vmem: layer must be in [0, %d): got %d", c.layout.Layers, layer)
	}
	return c.bases[2*layer], c.bases[2*layer+1], nil
}

func (c *Cache) unitsFor(tokens int32) int {
	return int((int64(tokens)*c.tokenBytes + int64(c.pageSize) - 1) / int64(c.pageSize))
}

func (c *Cache) tokensFor(units int) int32 {
	t := int64(units) * int64(c.pageSize) / c.tokenBytes
	return int32(min(t, int64(c.layout.MaxContext)))
}

func (c *Cache) addr(buf, slot, unit int) uintptr {
	return c.bases[buf] + uintptr(int64(slot)*c.layout.SlotStride) + uintptr(unit*c.pageSize)
}

// freeUnitsLocked: units a new mapping can use without reclaiming a slot.
func (c *Cache) freeUnitsLocked() int { return c.budgetUnits - c.held + len(c.pool)/c.nbuf }

func errClosed(op string) error {
	return kverr.Errorf(kverr.InvalidHandle, "vmem: %s on a closed cache", op)
}

// Alloc returns a free slot. It prefers the freed slot holding the most
// mapped pages (deferred reclamation: a new request reuses a finished one's
// memory), then the lowest-numbered slot. Errors: OutOfMemory when every
// slot is active.
func (c *Cache) Alloc() (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, errClosed("alloc")
	}
	best := -1
	for s := range c.slots {
		st := &c.slots[s]
		if st.active {
			continue
		}
		if best < 0 {
			best = s
			continue
		}
		b := &c.slots[best]
		// A slot under a background job would make the first Step wait.
		if (b.busy && !st.busy) || (b.busy == st.busy && st.units > b.units) {
			best = s
		}
	}
	if best < 0 {
		return 0, kverr.Errorf(kverr.OutOfMemory, "vmem: alloc: all %d slots are in use", len(c.slots))
	}
	st := &c.slots[best]
	st.active = true
	st.lastCtx = 0
	c.active++
	return best, nil
}

// Free releases an active slot. Its pages stay mapped for the next Alloc
// until reclamation needs them. Errors: InvalidArgument (out of range),
// NotFound (not active).
func (c *Cache) Free(slot int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed("free")
	}
	if slot < 0 || slot >= len(c.slots) {
		return kverr.Errorf(kverr.InvalidArgument, "vmem: free: slot must be in [0, %d): got %d", len(c.slots), slot)
	}
	st := &c.slots[slot]
	if !st.active {
		return kverr.Errorf(kverr.NotFound, "vmem: free: slot %d is not allocated", slot)
	}
	st.active = false
	st.lastCtx = 0
	c.active--
	if c.freeUnitsLocked() < c.reclaimBelow {
		if c.background {
			c.signal()
		} else {
			c.reclaimToThresholdLocked()
		}
	}
	return nil
}

// Step guarantees that, for every i, the pages holding tokens
// [0, ctxLens[i]) of slot slots[i] are mapped in every layer's K and V. It
// is called once per engine step before the step's kernels are launched.
// With background mapping on, it also asks the background mapper to map
// each slot ahead to ctxLens[i]+LookaheadTokens while the GPU works.
//
// All or nothing: when the budget cannot cover the batch, even after
// reclaiming freed slots' pages, it fails with OutOfMemory and changes
// nothing; the engine then preempts and retries. A driver call that fails
// (the device out of memory, the host driver's mapping budget, any CUDA
// error) fails the Step too, with the slots it grew shrunk back, so it
// changes nothing either (freed slots' pages it reclaimed stay reclaimed);
// only when that undoing fails as well do the slots grown before keep
// their pages. Errors: InvalidArgument (length mismatch, slot out of range
// or repeated, context outside [0, MaxContext]), NotFound (slot not
// allocated), OutOfMemory (budget, device memory, mapping budget), or the
// driver's error (CUDA).
func (c *Cache) Step(slots, ctxLens []int32) error {
	if len(slots) != len(ctxLens) {
		return kverr.Errorf(kverr.InvalidArgument, "vmem: step: %d slots but %d context lengths", len(slots), len(ctxLens))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var waitStart time.Time
	for {
		if c.closed {
			return errClosed("step")
		}
		need, wait, err := c.scanLocked(slots, ctxLens)
		if err != nil {
			return err
		}
		if !wait && need > 0 {
			avail := c.freeUnitsLocked() + c.reclaimableLocked()
			if need > avail {
				if need > avail+c.reclaiming {
					c.nOOM.Add(1)
					return kverr.Errorf(kverr.OutOfMemory, "vmem: step needs %d more pages in each of the %d K/V tensors (%d bytes); %d fit in the budget of %d bytes", need, c.nbuf, int64(need)*int64(c.nbuf)*int64(c.pageSize), avail, int64(c.budgetUnits)*int64(c.nbuf)*int64(c.pageSize))
				}
				wait = true // a background reclaim in flight will free enough
			}
		}
		if wait {
			if waitStart.IsZero() {
				waitStart = time.Now()
			}
			c.cond.Wait()
			continue
		}
		if !waitStart.IsZero() {
			c.stepWaitNs.Add(int64(time.Since(waitStart)))
		}
		if need > 0 {
			if err := c.growLocked(slots, ctxLens); err != nil {
				return err
			}
		}
		break
	}
	wake := false
	for i, s := range slots {
		st := &c.slots[s]
		st.lastCtx = ctxLens[i]
		if min(st.lastCtx+c.lookahead, int32(c.layout.MaxContext)) > st.tokens {
			wake = true
		}
	}
	if c.background && (wake || c.freeUnitsLocked() < c.reclaimBelow) {
		c.signal()
	}
	c.nSteps.Add(1)
	return nil
}

// scanLocked validates a Step and counts the page units it must map. wait
// is set when a slot that needs pages has a background job in flight.
func (c *Cache) scanLocked(slots, ctxLens []int32) (need int, wait bool, err error) {
	c.epoch++
	if c.epoch == 0 { // wrapped: old stamps could collide
		for s := range c.slots {
			c.slots[s].stamp = 0
		}
		c.epoch = 1
	}
	maxBatch, maxCtx := int32(len(c.slots)), int32(c.layout.MaxContext)
	for i, s := range slots {
		if s < 0 || s >= maxBatch {
			return 0, false, kverr.Errorf(kverr.InvalidArgument, "vmem: step: slot must be in [0, %d): got %d", maxBatch, s)
		}
		st := &c.slots[s]
		if !st.active {
			return 0, false, kverr.Errorf(kverr.NotFound, "vmem: step: slot %d is not allocated", s)
		}
		if st.stamp == c.epoch {
			return 0, false, kverr.Errorf(kverr.InvalidArgument, "vmem: step: slot %d appears twice", s)
		}
		st.stamp = c.epoch
		n := ctxLens[i]
		if n < 0 || n > maxCtx {
			return 0, false, kverr.Errorf(kverr.InvalidArgument, "vmem: step: context length of slot %d must be in [0, %d]: got %d", s, maxCtx, n)
		}
		if n > st.tokens {
			if st.busy {
				wait = true
				continue
			}
			need += c.unitsFor(n) - st.units
		}
	}
	return need, wait, nil
}

// reclaimableLocked: units held by freed slots that no job is touching.
func (c *Cache) reclaimableLocked() int {
	n := 0
	for s := range c.slots {
		if st := &c.slots[s]; !st.active && !st.busy {
			n += st.units
		}
	}
	return n
}

// growLocked maps, on the caller's thread, what a validated Step needs. All
// or nothing: when a driver call fails (a device out of memory, the host
// driver's mapping budget), the slots grown before it are shrunk back, so
// the Step changes nothing the caller sees.
func (c *Cache) growLocked(slots, ctxLens []int32) (err error) {
	start := time.Now()
	defer func() { c.stepMapNs.Add(int64(time.Since(start))) }()
	type grown struct{ slot, from int }
	var done []grown
	defer func() {
		if err != nil {
			for i := len(done) - 1; i >= 0; i-- {
				if !c.shrinkLocked(done[i].slot, done[i].from) {
					break // the slots before it keep their pages, as documented
				}
			}
		}
	}()
	for i, s := range slots {
		st := &c.slots[s]
		if ctxLens[i] <= st.tokens {
			continue
		}
		k := c.unitsFor(ctxLens[i]) - st.units
		for c.freeUnitsLocked() < k {
			r := c.reclaimCandidateLocked()
			if r < 0 {
				return kverr.Errorf(kverr.Internal, "vmem: step: budget accounting is off (%d units wanted, %d free)", k, c.freeUnitsLocked())
			}
			if err := c.reclaimSlotLocked(r); err != nil {
				return err
			}
		}
		handles, create := c.takeLocked(k)
		created, err := c.createUnits(create)
		handles = append(handles, created...)
		if err == nil {
			err = c.mapUnits(int(s), st.units, handles)
		}
		if err != nil {
			c.held -= create - len(created)/c.nbuf
			c.pool = append(c.pool, handles...)
			return err
		}
		done = append(done, grown{int(s), st.units})
		c.commitMapLocked(st, handles)
	}
	return nil
}

// shrinkLocked unmaps a slot's units from `from` up into the idle pool,
// undoing a growth. It reports whether every unit came back; on a driver
// failure the unit that failed is lost to the budget, as in a reclaim.
func (c *Cache) shrinkLocked(s, from int) bool {
	st := &c.slots[s]
	pages := st.pages[from*c.nbuf : st.units*c.nbuf]
	k := len(pages) / c.nbuf
	n, err := c.unmapUnits(s, from, pages)
	c.pool = append(c.pool, pages[(k-n)*c.nbuf:]...)
	gone := n
	if err != nil {
		gone++
	}
	c.mapped -= gone
	st.units -= gone
	st.pages = st.pages[:st.units*c.nbuf]
	st.tokens = c.tokensFor(st.units)
	return err == nil
}

// takeLocked takes k units for mapping: idle pages first (copied out of the
// pool), then budget for create units to be created by the caller.
func (c *Cache) takeLocked(k int) (handles []Page, create int) {
	fromPool := min(k, len(c.pool)/c.nbuf)
	n := fromPool * c.nbuf
	handles = make([]Page, n, k*c.nbuf)
	copy(handles, c.pool[len(c.pool)-n:])
	c.pool = c.pool[:len(c.pool)-n]
	create = k - fromPool
	c.held += create
	return handles, create
}

func (c *Cache) commitMapLocked(st *slotState, handles []Page) {
	k := len(handles) / c.nbuf
	st.pages = append(st.pages, handles...)
	st.units += k
	st.tokens = c.tokensFor(st.units)
	c.mapped += k
}

// createUnits creates n units of pages. On failure it returns the whole
// units it made (releasing a partial one) with the error.
func (c *Cache) createUnits(n int) ([]Page, error) {
	if n == 0 {
		return nil, nil
	}
	out := make([]Page, 0, n*c.nbuf)
	for i := 0; i < n*c.nbuf; i++ {
		p, err := c.drv.CreatePage(c.pageSize)
		if err != nil {
			whole := len(out) / c.nbuf * c.nbuf
			for _, q := range out[whole:] {
				if c.drv.ReleasePage(q) == nil {
					c.nRelease.Add(1)
				}
			}
			return out[:whole], driverError(kverr.Internal, err, "vmem: creating a %d-byte page", c.pageSize)
		}
		c.nCreate.Add(1)
		out = append(out, p)
	}
	return out, nil
}

// mapUnits maps len(handles)/nbuf units of slot starting at unit from in
// every tensor and grants access: one SetAccess per tensor covers the new
// range, and a driver that maps ranges maps each tensor's pages in one call.
// On failure it unmaps what it mapped, so nothing changes.
func (c *Cache) mapUnits(slot, from int, handles []Page) error {
	k := len(handles) / c.nbuf
	if k == 0 {
		return nil
	}
	type span struct {
		addr  uintptr
		pages int
	}
	var mapped []span
	fail := func(err error) error {
		for _, m := range mapped {
			if c.drv.Unmap(m.addr, m.pages*c.pageSize) == nil {
				c.nUnmap.Add(int64(m.pages))
			}
		}
		return err
	}
	rm, ranges := c.drv.(RangeMapper)
	var run []Page
	if ranges {
		run = make([]Page, k)
	}
	for b := 0; b < c.nbuf; b++ {
		if ranges {
			for i := range run {
				run[i] = handles[i*c.nbuf+b]
			}
			a := c.addr(b, slot, from)
			if err := rm.MapRange(a, c.pageSize, run); err != nil {
				return fail(driverError(kverr.Internal, err, "vmem: mapping pages %d..%d of slot %d in tensor %d", from, from+k-1, slot, b))
			}
			c.nMap.Add(int64(k))
			mapped = append(mapped, span{a, k})
		} else {
			for i := 0; i < k; i++ {
				a := c.addr(b, slot, from+i)
				if err := c.drv.Map(a, c.pageSize, handles[i*c.nbuf+b]); err != nil {
					return fail(driverError(kverr.Internal, err, "vmem: mapping page %d of slot %d in tensor %d", from+i, slot, b))
				}
				c.nMap.Add(1)
				mapped = append(mapped, span{a, 1})
			}
		}
		if err := c.drv.SetAccess(c.addr(b, slot, from), k*c.pageSize); err != nil {
			return fail(driverError(kverr.Internal, err, "vmem: granting access to pages %d..%d of slot %d in tensor %d", from, from+k-1, slot, b))
		}
	}
	return nil
}

// unmapUnits unmaps the units of pages (unit-major, starting at unit from)
// from the last down. It returns how many trailing units it unmapped; the
// pages of a unit it could not fully unmap are lost to the budget (a driver
// failure there leaves no safe way to reuse them).
func (c *Cache) unmapUnits(slot, from int, pages []Page) (int, error) {
	k := len(pages) / c.nbuf
	for i := k - 1; i >= 0; i-- {
		for b := 0; b < c.nbuf; b++ {
			if err := c.drv.Unmap(c.addr(b, slot, from+i), c.pageSize); err != nil {
				return k - 1 - i, driverError(kverr.Internal, err, "vmem: unmapping page %d of slot %d in tensor %d", from+i, slot, b)
			}
			c.nUnmap.Add(1)
		}
	}
	return k, nil
}

// reclaimCandidateLocked picks the freed slot with the fewest mapped units
// (keeping the larger ones for reuse by Alloc); -1 if none.
func (c *Cache) reclaimCandidateLocked() int {
	best := -1
	for s := range c.slots {
		st := &c.slots[s]
		if st.active || st.busy || st.units == 0 {
			continue
		}
		if best < 0 || st.units < c.slots[best].units {
			best = s
		}
	}
	return best
}

// reclaimSlotLocked unmaps all of a freed slot's pages into the idle pool,
// on the caller's thread.
func (c *Cache) reclaimSlotLocked(s int) error {
	st := &c.slots[s]
	pages := st.pages[:st.units*c.nbuf]
	n, err := c.unmapUnits(s, 0, pages)
	keep := st.units - n
	if err != nil {
		// The unit that failed stays held (it may still be mapped in some
		// tensors) but leaves the slot: it is lost to the budget.
		keep--
	}
	c.pool = append(c.pool, pages[(st.units-n)*c.nbuf:]...)
	c.mapped -= st.units - keep
	st.pages = st.pages[:keep*c.nbuf]
	st.units = keep
	st.tokens = c.tokensFor(keep)
	return err
}

// reclaimToThresholdLocked reclaims freed slots until the free budget is at
// least the threshold (used when there is no background mapper).
func (c *Cache) reclaimToThresholdLocked() {
	for c.freeUnitsLocked() < c.reclaimBelow {
		r := c.reclaimCandidateLocked()
		if r < 0 || c.reclaimSlotLocked(r) != nil {
			return
		}
	}
}

// Trim unmaps every freed slot's pages and releases all idle pages to the
// driver, giving the memory back. It waits for background jobs in flight.
func (c *Cache) Trim() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed("trim")
	}
	var first error
	for c.anyBusyLocked() {
		c.cond.Wait()
	}
	for {
		r := c.reclaimCandidateLocked()
		if r < 0 {
			break
		}
		if err := c.reclaimSlotLocked(r); err != nil && first == nil {
			first = err
		}
	}
	if err := c.releasePoolLocked(); err != nil && first == nil {
		first = err
	}
	return first
}

func (c *Cache) anyBusyLocked() bool {
	for s := range c.slots {
		if c.slots[s].busy {
			return true
		}
	}
	return false
}

func (c *Cache) releasePoolLocked() error {
	var first error
	for _, p := range c.pool {
		if err := c.drv.ReleasePage(p); err != nil {
			if first == nil {
				first = driverError(kverr.Internal, err, "vmem: releasing a page")
			}
			continue
		}
		c.nRelease.Add(1)
	}
	c.held -= len(c.pool) / c.nbuf
	c.pool = c.pool[:0]
	return first
}

// Close stops the background mapper, unmaps and releases every page and
// frees the reservations. The tensors' addresses are invalid afterwards.
// Close is idempotent; other calls after it fail with InvalidHandle.
func (c *Cache) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.cond.Broadcast()
	c.mu.Unlock()
	if c.background {
		close(c.stop)
		<-c.done
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.anyBusyLocked() {
		c.cond.Wait()
	}
	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = err
		}
	}
	for s := range c.slots {
		st := &c.slots[s]
		if st.units > 0 {
			pages := st.pages[:st.units*c.nbuf]
			n, err := c.unmapUnits(s, 0, pages)
			keep(err)
			c.pool = append(c.pool, pages[(st.units-n)*c.nbuf:]...)
		}
		st.pages, st.units, st.tokens, st.active = nil, 0, 0, false
	}
	c.mapped, c.active = 0, 0
	keep(c.releasePoolLocked())
	for _, b := range c.bases {
		if err := c.drv.FreeReservation(b, int(c.layout.BufferBytes)); err != nil {
			keep(driverError(kverr.Internal, err, "vmem: freeing a reservation"))
		}
	}
	c.bases = nil
	return first
}

// MappedTokens reports how many tokens of slot's context are backed by
// mapped pages (0 for a slot out of range).
func (c *Cache) MappedTokens(slot int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if slot < 0 || slot >= len(c.slots) {
		return 0
	}
	return int(c.slots[slot].tokens)
}

// Stats returns a snapshot of the cache's state and counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	unit := int64(c.nbuf) * int64(c.pageSize)
	s := Stats{
		PageSize:    int64(c.pageSize),
		BudgetBytes: int64(c.budgetUnits) * unit,
		MappedBytes: int64(c.mapped) * unit,
		HeldBytes:   int64(c.held) * unit,
		ActiveSlots: c.active,
	}
	for i := range c.slots {
		if st := &c.slots[i]; !st.active && st.units > 0 {
			s.ReusableSlots++
		}
	}
	c.mu.Unlock()
	s.Steps = c.nSteps.Load()
	s.MapCalls = c.nMap.Load()
	s.UnmapCalls = c.nUnmap.Load()
	s.CreateCalls = c.nCreate.Load()
	s.ReleaseCalls = c.nRelease.Load()
	s.OutOfMemory = c.nOOM.Load()
	s.StepMapNs = c.stepMapNs.Load()
	s.StepWaitNs = c.stepWaitNs.Load()
	s.BackgroundMapNs = c.bgNs.Load()
	s.BackgroundErrors = c.bgErrors.Load()
	return s
}
