package vmem

import (
	"errors"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

// CUDA is a Driver over the CUDA virtual memory management API on one
// device, through its primary context: cuMemAddressReserve for reservations,
// cuMemCreate (pinned device memory) for pages, cuMemMap + cuMemSetAccess to
// map, cuMemUnmap and cuMemRelease to give pages back.
type CUDA struct {
	vmm  *cuda.VMM
	gran int
}

// NewCUDA opens device ordinal. Errors: NoDevice (no driver, no such device),
// Unsupported (no virtual memory management), CUDA.
func NewCUDA(ordinal int) (*CUDA, error) {
	v, err := cuda.OpenVMM(ordinal)
	if err != nil {
		return nil, cudaError(err, "opening CUDA device %d for virtual memory", ordinal)
	}
	g, err := v.Granularity()
	if err != nil {
		_ = v.Close()
		return nil, cudaError(err, "allocation granularity of device %d", ordinal)
	}
	return &CUDA{vmm: v, gran: g}, nil
}

// cudaErrorOutOfMemory is CUDA_ERROR_OUT_OF_MEMORY.
const cudaErrorOutOfMemory = 2

func cudaError(err error, format string, args ...any) error {
	switch {
	case errors.Is(err, cuda.ErrNoDevice):
		return kverr.Wrap(kverr.NoDevice, err, format, args...)
	case errors.Is(err, cuda.ErrVMMUnsupported):
		return kverr.Wrap(kverr.Unsupported, err, format, args...)
	}
	// The device's memory and address space are limits a caller can meet
	// in normal use: OutOfMemory tells it to preempt or shrink, as for the
	// cache's own budget (the Step or create that hit it changed nothing).
	var ce *cuda.Error
	if errors.As(err, &ce) && ce.Code == cudaErrorOutOfMemory {
		return kverr.Wrap(kverr.OutOfMemory, err, format, args...)
	}
	return kverr.Wrap(kverr.CUDA, err, format, args...)
}

// VMM is the underlying device (for tests and tools that copy to and from
// mapped memory).
func (d *CUDA) VMM() *cuda.VMM { return d.vmm }

func (d *CUDA) Granularity() int { return d.gran }

func (d *CUDA) Reserve(size int) (uintptr, error) {
	p, err := d.vmm.Reserve(uintptr(size), uintptr(d.gran))
	if err != nil {
		return 0, cudaError(err, "reserving %d bytes of device address space", size)
	}
	return uintptr(p), nil
}

func (d *CUDA) FreeReservation(base uintptr, size int) error {
	if err := d.vmm.FreeAddress(uint64(base), uintptr(size)); err != nil {
		return cudaError(err, "freeing reservation %#x+%d", base, size)
	}
	return nil
}

func (d *CUDA) CreatePage(size int) (Page, error) {
	h, err := d.vmm.Create(uintptr(size))
	if err != nil {
		return 0, cudaError(err, "creating a %d-byte device page", size)
	}
	return Page(h), nil
}

func (d *CUDA) ReleasePage(p Page) error {
	if err := d.vmm.Release(cuda.MemHandle(p)); err != nil {
		return cudaError(err, "releasing device page")
	}
	return nil
}

func (d *CUDA) Map(addr uintptr, size int, p Page) error {
	if err := d.vmm.Map(uint64(addr), uintptr(size), cuda.MemHandle(p)); err != nil {
		return cudaError(err, "mapping a device page at %#x", addr)
	}
	return nil
}

func (d *CUDA) SetAccess(addr uintptr, size int) error {
	if err := d.vmm.SetAccess(uint64(addr), uintptr(size)); err != nil {
		return cudaError(err, "granting access to %#x+%d", addr, size)
	}
	return nil
}

func (d *CUDA) Unmap(addr uintptr, size int) error {
	if err := d.vmm.Unmap(uint64(addr), uintptr(size)); err != nil {
		return cudaError(err, "unmapping %#x+%d", addr, size)
	}
	return nil
}

// Close releases the device's primary context reference.
func (d *CUDA) Close() error {
	if err := d.vmm.Close(); err != nil {
		return cudaError(err, "releasing the primary context")
	}
	return nil
}
