// Package vmem is a virtual-contiguous KV cache (vAttention): each layer's K
// and V is one contiguous virtual tensor [max_batch, max_context, kv_heads,
// head_dim], reserved once, whose physical pages are mapped on demand as
// sequences grow. Attention kernels index it like an ordinary dense tensor,
// so unmodified kernels (FlashAttention's plain ones, torch SDPA) run on it.
//
// The cache works over a small Driver interface with two implementations:
// CUDA virtual memory management (NewCUDA) and host memory (NewHost:
// PROT_NONE reservations with memfd-backed pages), which runs the same logic
// on machines without a GPU.
package vmem

import (
	"errors"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// Page is a driver's handle to one physical page (a CUmemGenericAllocationHandle,
// or an offset into the host driver's memfd).
type Page uint64

// Driver reserves virtual ranges and maps physical pages into them. Sizes and
// addresses are multiples of Granularity(). Implementations are safe for
// concurrent use; the cache never maps two pages at one address at once.
type Driver interface {
	// Granularity is the smallest page size and alignment the driver supports.
	Granularity() int
	// Reserve reserves size bytes of address space with nothing mapped.
	Reserve(size int) (base uintptr, err error)
	// FreeReservation returns a range from Reserve; nothing may be mapped in it.
	FreeReservation(base uintptr, size int) error
	// CreatePage allocates a physical page of size bytes.
	CreatePage(size int) (Page, error)
	// ReleasePage frees a page that is no longer mapped.
	ReleasePage(p Page) error
	// Map maps page p (of size bytes) at addr, without access rights yet.
	Map(addr uintptr, size int, p Page) error
	// SetAccess makes [addr, addr+size) readable and writable; the range may
	// span several mapped pages.
	SetAccess(addr uintptr, size int) error
	// Unmap unmaps [addr, addr+size), which covers whole pages; the range
	// stays reserved.
	Unmap(addr uintptr, size int) error
	// Close releases the driver's own resources (not reservations or pages).
	Close() error
}

// RangeMapper is implemented by drivers that map a run of pages in one call
// (the host driver: one kernel mapping per run instead of one per page).
// MapRange maps pages[i] at addr + i*pageSize, without access rights, all
// or nothing. The cache uses it when the driver has it, else Map per page.
type RangeMapper interface {
	MapRange(addr uintptr, pageSize int, pages []Page) error
}

// driverError gives an error from a driver a status code (its own, when it
// carries one) and the operation that failed.
func driverError(code kverr.Code, err error, format string, args ...any) error {
	var ke *kverr.Error
	if errors.As(err, &ke) {
		code = ke.Code
	}
	return kverr.Wrap(code, err, format, args...)
}

// pointerAt turns an address the cache owns (host driver memory) into a
// pointer without the uintptr-to-pointer conversion vet warns about: the
// memory is outside the Go heap, so the GC never moves or frees it.
func pointerAt(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

// Bytes views n bytes at a host-driver address as a slice. For host-backed
// caches only (tests, tools): a CUDA address is not host memory.
func Bytes(addr uintptr, n int) []byte {
	return unsafe.Slice((*byte)(pointerAt(addr)), n)
}
