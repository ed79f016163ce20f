//go:build linux

package vmem

import (
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvplug/kvplug/core/kverr"
)

// Host is a Driver over host memory with the CUDA driver's semantics:
// reservations are PROT_NONE anonymous mappings (touching an unmapped page
// faults, as on the GPU), pages are ranges of one memfd, Map places a page
// with MAP_FIXED|MAP_SHARED and no access, SetAccess grants read/write, and
// Unmap puts PROT_NONE back. Page contents survive unmapping and remapping
// elsewhere, as physical pages do.
type Host struct {
	gran int

	mu     sync.Mutex
	fd     int
	size   int64           // memfd length
	pages  map[Page]int    // live page offset -> size
	free   map[int][]int64 // size -> released offsets, reused before growing
	closed bool
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
	return &Host{gran: granularity, fd: fd, pages: map[Page]int{}, free: map[int][]int64{}}, nil
}

func (h *Host) Granularity() int { return h.gran }

func (h *Host) checkRange(what string, addr uintptr, size int) error {
	if size <= 0 || size%h.gran != 0 || addr%uintptr(h.gran) != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: %s: address %#x size %d not aligned to %d", what, addr, size, h.gran)
	}
	return nil
}

func (h *Host) Reserve(size int) (uintptr, error) {
	if size <= 0 || size%h.gran != 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "host vmem driver: reserve: size %d is not a positive multiple of %d", size, h.gran)
	}
	// Over-reserve by one granule so the base can be aligned to it.
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size+h.gran), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: reserving %d bytes", size)
	}
	raw := uintptr(p)
	base := (raw + uintptr(h.gran) - 1) &^ (uintptr(h.gran) - 1)
	if head := base - raw; head > 0 {
		_ = unix.MunmapPtr(pointerAt(raw), head)
	}
	if tail := raw + uintptr(size+h.gran) - (base + uintptr(size)); tail > 0 {
		_ = unix.MunmapPtr(pointerAt(base+uintptr(size)), tail)
	}
	return base, nil
}

func (h *Host) FreeReservation(base uintptr, size int) error {
	if err := h.checkRange("free reservation", base, size); err != nil {
		return err
	}
	if err := unix.MunmapPtr(pointerAt(base), uintptr(size)); err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: munmap %#x+%d", base, size)
	}
	return nil
}

func (h *Host) CreatePage(size int) (Page, error) {
	if size <= 0 || size%h.gran != 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "host vmem driver: page size %d is not a positive multiple of %d", size, h.gran)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return 0, kverr.Errorf(kverr.InvalidHandle, "host vmem driver is closed")
	}
	if offs := h.free[size]; len(offs) > 0 {
		off := offs[len(offs)-1]
		h.free[size] = offs[:len(offs)-1]
		h.pages[Page(off)] = size
		return Page(off), nil
	}
	off := h.size
	if err := unix.Ftruncate(h.fd, off+int64(size)); err != nil {
		return 0, kverr.Wrap(kverr.OutOfMemory, err, "host vmem driver: growing the page file to %d bytes", off+int64(size))
	}
	h.size += int64(size)
	h.pages[Page(off)] = size
	return Page(off), nil
}

func (h *Host) ReleasePage(p Page) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	size, ok := h.pages[p]
	if !ok {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: release of page %#x, which is not live", uint64(p))
	}
	// Punching a hole gives the memory back; the offset is reused later.
	if err := unix.Fallocate(h.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(p), int64(size)); err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: releasing page %#x", uint64(p))
	}
	delete(h.pages, p)
	h.free[size] = append(h.free[size], int64(p))
	return nil
}

func (h *Host) Map(addr uintptr, size int, p Page) error {
	if err := h.checkRange("map", addr, size); err != nil {
		return err
	}
	h.mu.Lock()
	psize, ok := h.pages[p]
	h.mu.Unlock()
	if !ok || psize != size {
		return kverr.Errorf(kverr.InvalidArgument, "host vmem driver: map of page %#x with size %d: not a live page of that size", uint64(p), size)
	}
	_, err := unix.MmapPtr(h.fd, int64(p), pointerAt(addr), uintptr(size), unix.PROT_NONE, unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: mapping page %#x at %#x", uint64(p), addr)
	}
	return nil
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
	if err := h.checkRange("unmap", addr, size); err != nil {
		return err
	}
	_, err := unix.MmapPtr(-1, 0, pointerAt(addr), uintptr(size), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED)
	if err != nil {
		return kverr.Wrap(kverr.Internal, err, "host vmem driver: unmapping %#x+%d", addr, size)
	}
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
