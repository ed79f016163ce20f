//go:build linux

package vmem

import (
	"bytes"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvplug/kvplug/core/kverr"
)

// Host is a Driver over host memory with the CUDA driver's semantics:
// reservations are PROT_NONE anonymous mappings (touching an unmapped page
// faults, as on the GPU), pages live in one memfd (the page file), Map
// places pages with MAP_FIXED|MAP_SHARED and no access, SetAccess grants
// read/write, and Unmap puts PROT_NONE back. Page contents survive unmapping
// and remapping elsewhere, as physical pages do.
//
// Mappings are kept few, since the kernel caps a process's mappings
// (vm.max_map_count) and the Go runtime cannot survive hitting that cap:
//
//   - Every reservation owns a home range of the page file as large as
//     itself. A page gets its file offset when first mapped: the home of the
//     address it is mapped at, so pages mapped side by side are side by side
//     in the file and the kernel merges them into one mapping. A page mapped
//     where another live page already has its home goes to a spill offset
//     past every home range.
//   - MapRange maps a run of pages with one mmap per file-contiguous part.
//   - Every call counts the mappings it would leave (mapModel) and is refused
//     with OutOfMemory, changing nothing, when that would take all host
//     drivers of the process past half the headroom vm.max_map_count left
//     when the first one was created.
type Host struct {
	gran int

	mu     sync.Mutex
	fd     int
	end    int64 // page-file bytes handed out: home ranges and spill pages
	nextID Page
	pages  map[Page]*hostPage
	used   map[int64]Page  // file offset -> the live page stored there
	spill  map[int][]int64 // page size -> released spill offsets
	res    []*mapModel     // reservations by base
	homes  map[uintptr]int64
	closed bool
}

type hostPage struct {
	size    int
	off     int64 // file offset; -1 until first mapped
	spilled bool  // off is a spill offset, not a home
}

// hostMaps is the mapping budget shared by every host driver of the process.
var hostMaps struct {
	sync.Mutex
	init        bool
	used, limit int
	max         int // vm.max_map_count
}

// hostMapDelta adds delta to the process's host-driver mappings; a positive
// delta that would pass the limit is refused unless force.
func hostMapDelta(delta int, force bool) error {
	hostMaps.Lock()
	defer hostMaps.Unlock()
	if !hostMaps.init {
		hostMaps.max, hostMaps.limit = mapLimit()
		hostMaps.init = true
	}
	if delta > 0 && !force && hostMaps.used+delta > hostMaps.limit {
		return kverr.Errorf(kverr.OutOfMemory, "host vmem driver: %d more memory mappings would pass this process's budget for them (%d in use of %d, half of what vm.max_map_count %d left free); the pages are not contiguous enough: use a larger page_size or fewer slots, or raise vm.max_map_count", delta, hostMaps.used, hostMaps.limit, hostMaps.max)
	}
	hostMaps.used += delta
	return nil
}

// mapLimit reads vm.max_map_count and the mappings in use, and returns the
// maximum and the host drivers' share: half of what is free, the other half
// left to the Go runtime, the host and its libraries.
func mapLimit() (max, limit int) {
	max = 65530 // the kernel's default
	if b, err := os.ReadFile("/proc/sys/vm/max_map_count"); err == nil {
		if v, err := strconv.Atoi(string(bytes.TrimSpace(b))); err == nil && v > 0 {
			max = v
		}
	}
	inUse := max / 4 // unknown: assume a busy process
	if b, err := os.ReadFile("/proc/self/maps"); err == nil {
		inUse = bytes.Count(b, []byte{'\n'})
	}
	return max, (max - inUse) / 2
}

// NewHost returns a host driver whose granularity is granularity bytes (0:
// the OS page size); it must be a multiple of the OS page size.
func NewHost(granularity int) (*Host, error) {
	osPage := os.Getpagesize()
	if granularity == 0 {
		granularity = osPage
	}
	if granularity < osPage || granularity%osPage != 0 || granularity > 1<<30 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "host vmem driver: granularity must be a multiple of the OS page size %d, at most 1 GiB: got %d", osPage, granularity)
	}
	fd, err := unix.MemfdCreate("kvplug-vmem", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, kverr.Wrap(kverr.Unsupported, err, "host vmem driver: memfd_create")
	}
	return &Host{gran: granularity, fd: fd, nextID: 1, pages: map[Page]*hostPage{},
		used: map[int64]Page{}, spill: map[int][]int64{}, homes: map[uintptr]int64{}}, nil
}

func (h *Host) Granularity() int { return h.gran }

func (h *Host) checkRange(what string, addr uintptr, size int) error {
	if size <= 0 || size%h.gran != 0 || addr%uintptr(h.gran) != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: %s: address %#x size %d not aligned to %d", what, addr, size, h.gran)
	}
	return nil
}

// lockRes checks the range (checkRange), then locks h and returns the
// reservation holding it. It returns holding h.mu only when it returns no
// error.
func (h *Host) lockRes(what string, addr uintptr, size int) (*mapModel, error) {
	if err := h.checkRange(what, addr, size); err != nil {
		return nil, err
	}
	h.mu.Lock()
	r, err := h.resLocked(what, addr, size)
	if err != nil {
		h.mu.Unlock()
	}
	return r, err
}

// resLocked returns the reservation holding [addr, addr+size).
func (h *Host) resLocked(what string, addr uintptr, size int) (*mapModel, error) {
	i := sort.Search(len(h.res), func(k int) bool { return h.res[k].base+uintptr(h.res[k].size) > addr })
	if i < len(h.res) {
		if r := h.res[i]; r.base <= addr && addr+uintptr(size) <= r.base+uintptr(r.size) {
			return r, nil
		}
	}
	return nil, kverr.Errorf(kverr.InvalidArgument, "host vmem driver: %s: %#x+%d is not inside one reservation", what, addr, size)
}

// lockOpen checks that size, which what names, is a positive multiple of
// the granularity, then locks h and checks that it is open. It returns
// holding h.mu only when it returns nil.
func (h *Host) lockOpen(what string, size int) error {
	if size <= 0 || size%h.gran != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: %s %d is not a positive multiple of %d", what, size, h.gran)
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return kverr.Errorf(kverr.InvalidHandle, "host vmem driver is closed")
	}
	return nil
}

func (h *Host) Reserve(size int) (uintptr, error) {
	if err := h.lockOpen("reserve: size", size); err != nil {
		return 0, err
	}
	defer h.mu.Unlock()
	if err := hostMapDelta(1, false); err != nil {
		return 0, err
	}
	// The home range grows the page file, which stays sparse: only pages
	// written to take memory.
	home := h.end
	if err := unix.Ftruncate(h.fd, home+int64(size)); err != nil {
		_ = hostMapDelta(-1, false)
		return 0, kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: growing the page file to %d bytes", home+int64(size))
	}
	// Over-reserve by one granule so the base can be aligned to it.
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size+h.gran), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		_ = hostMapDelta(-1, false)
		return 0, kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: reserving %d bytes of address space", size)
	}
	h.end += int64(size)
	raw := uintptr(p)
	base := (raw + uintptr(h.gran) - 1) &^ (uintptr(h.gran) - 1)
	if head := base - raw; head > 0 {
		_ = unix.MunmapPtr(pointerAt(raw), head)
	}
	if tail := raw + uintptr(size+h.gran) - (base + uintptr(size)); tail > 0 {
		_ = unix.MunmapPtr(pointerAt(base+uintptr(size)), tail)
	}
	m := &mapModel{base: base, size: size}
	i := sort.Search(len(h.res), func(k int) bool { return h.res[k].base > base })
	h.res = append(h.res, nil)
	copy(h.res[i+1:], h.res[i:])
	h.res[i] = m
	h.homes[base] = home
	return base, nil
}

func (h *Host) FreeReservation(base uintptr, size int) error {
	if err := h.checkRange("free reservation", base, size); err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	i := sort.Search(len(h.res), func(k int) bool { return h.res[k].base >= base })
	if i == len(h.res) || h.res[i].base != base || h.res[i].size != size {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: free reservation: %#x+%d is not a reservation", base, size)
	}
	if err := unix.MunmapPtr(pointerAt(base), uintptr(size)); err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: munmap %#x+%d", base, size)
	}
	_ = hostMapDelta(-h.res[i].count(), false)
	h.res = append(h.res[:i], h.res[i+1:]...)
	delete(h.homes, base)
	return nil
}

func (h *Host) CreatePage(size int) (Page, error) {
	if err := h.lockOpen("page size", size); err != nil {
		return 0, err
	}
	defer h.mu.Unlock()
	// The page has no file offset until it is mapped: then it takes the
	// home of its address.
	id := h.nextID
	h.nextID++
	h.pages[id] = &hostPage{size: size, off: -1}
	return id, nil
}

func (h *Host) ReleasePage(p Page) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	pg, ok := h.pages[p]
	if !ok {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: release of page %#x, which is not live", uint64(p))
	}
	if pg.off >= 0 {
		// Punching a hole gives the memory back, and the offset's next page
		// starts zeroed.
		if err := unix.Fallocate(h.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, pg.off, int64(pg.size)); err != nil {
			return kverr.Wrap(kverr.Internal, err, "host vmem driver: releasing page %#x", uint64(p))
		}
		delete(h.used, pg.off)
		if pg.spilled {
			h.spill[pg.size] = append(h.spill[pg.size], pg.off)
		}
	}
	delete(h.pages, p)
	return nil
}

// placeLocked gives an unplaced page its file offset for address addr: the
// address's home, or a spill offset when another live page holds the home.
func (h *Host) placeLocked(pg *hostPage, r *mapModel, addr uintptr) error {
	home := h.homes[r.base] + int64(addr-r.base)
	if _, taken := h.used[home]; !taken {
		pg.off = home
		return nil
	}
	if offs := h.spill[pg.size]; len(offs) > 0 {
		pg.off, pg.spilled = offs[len(offs)-1], true
		h.spill[pg.size] = offs[:len(offs)-1]
		return nil
	}
	if err := unix.Ftruncate(h.fd, h.end+int64(pg.size)); err != nil {
		return kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: growing the page file to %d bytes", h.end+int64(pg.size))
	}
	pg.off, pg.spilled = h.end, true
	h.end += int64(pg.size)
	return nil
}

// unplaceLocked undoes placeLocked for a page whose mapping failed.
func (h *Host) unplaceLocked(pg *hostPage) {
	if pg.spilled {
		h.spill[pg.size] = append(h.spill[pg.size], pg.off)
	}
	pg.off, pg.spilled = -1, false
}

func (h *Host) Map(addr uintptr, size int, p Page) error {
	return h.MapRange(addr, size, []Page{p})
}

// MapRange maps pages side by side from addr, without access rights yet:
// one mmap, and one kernel mapping, per run of pages consecutive in the
// page file. All or nothing.
func (h *Host) MapRange(addr uintptr, pageSize int, pages []Page) error {
	if len(pages) == 0 {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: map: no pages")
	}
	if len(pages) > (1<<47)/pageSize {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: map: %d pages of %d bytes", len(pages), pageSize)
	}
	total := len(pages) * pageSize
	r, err := h.lockRes("map", addr, total)
	if err != nil {
		return err
	}
	defer h.mu.Unlock()
	var placed []*hostPage
	unplace := func() {
		for _, pg := range placed {
			h.unplaceLocked(pg)
		}
	}
	runs := make([]extent, 0, 1)
	for i, p := range pages {
		pg, ok := h.pages[p]
		if !ok || pg.size != pageSize {
			unplace()
			return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: map of page %#x with size %d: not a live page of that size", uint64(p), pageSize)
		}
		a := addr + uintptr(i*pageSize)
		if pg.off < 0 {
			if err := h.placeLocked(pg, r, a); err != nil {
				unplace()
				return err
			}
			h.used[pg.off] = p
			placed = append(placed, pg)
		}
		e := extent{addr: a, size: pageSize, off: pg.off}
		if n := len(runs); n > 0 && runs[n-1].joins(e) {
			runs[n-1].size += pageSize
		} else {
			runs = append(runs, e)
		}
	}
	fail := func(err error) error {
		for _, pg := range placed {
			delete(h.used, pg.off)
		}
		unplace()
		return err
	}
	plan, ok := r.planMap(runs)
	if !ok {
		return fail(kverr.Errorf(kverr.InvalidArgument, "host vmem driver: map: %#x+%d overlaps mapped pages", addr, total))
	}
	if err := hostMapDelta(plan.delta, false); err != nil {
		return fail(err)
	}
	for i, e := range runs {
		if _, err := unix.MmapPtr(h.fd, e.off, pointerAt(e.addr), uintptr(e.size), unix.PROT_NONE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
			// Put the reservation back over what this call mapped.
			if i > 0 {
				_ = h.anonLocked(addr, int(e.addr-addr))
			}
			_ = hostMapDelta(-plan.delta, false)
			return fail(kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: mapping %d bytes of the page file at %#x", e.size, e.addr))
		}
	}
	r.apply(plan)
	return nil
}

// anonLocked puts the reservation's PROT_NONE anonymous memory over a range.
func (h *Host) anonLocked(addr uintptr, size int) error {
	_, err := unix.MmapPtr(-1, 0, pointerAt(addr), uintptr(size), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	return err
}

func (h *Host) SetAccess(addr uintptr, size int) error {
	if err := h.checkRange("set access", addr, size); err != nil {
		return err
	}
	if err := unix.Mprotect(Bytes(addr, size), unix.PROT_READ|unix.PROT_WRITE); err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: mprotect %#x+%d", addr, size)
	}
	return nil
}

func (h *Host) Unmap(addr uintptr, size int) error {
	r, err := h.lockRes("unmap", addr, size)
	if err != nil {
		return err
	}
	defer h.mu.Unlock()
	plan := r.planUnmap(addr, size)
	// Unmapping is never refused for the budget: it is how memory comes
	// back, and it adds mappings only when it cuts a run in two.
	_ = hostMapDelta(plan.delta, true)
	if err := h.anonLocked(addr, size); err != nil {
		_ = hostMapDelta(-plan.delta, true)
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: unmapping %#x+%d", addr, size)
	}
	r.apply(plan)
	return nil
}

// Close closes the page file; mappings of it stay valid until unmapped.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	if err := unix.Close(h.fd); err != nil {
		return fmt.Errorf("host vmem driver: close: %w", err)
	}
	return nil
}

// LivePages is the number of pages created and not released (for tests).
func (h *Host) LivePages() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.pages)
}

// Mappings is the number of kernel memory mappings the driver's model
// counts in its reservations (for tests and tools).
func (h *Host) Mappings() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.res {
		n += r.count()
	}
	return n
}
