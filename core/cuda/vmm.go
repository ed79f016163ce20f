package cuda

// CUDA virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap,
// ...): reserve a virtual range once, then back parts of it with physical
// pages on demand. core/vmem builds its virtual-contiguous KV cache on this.

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"
)

// MemHandle is a CUmemGenericAllocationHandle: one physical allocation.
type MemHandle uint64

// Values of cuda.h's enums used here.
const (
	memAllocationTypePinned     = 1   // CU_MEM_ALLOCATION_TYPE_PINNED
	memLocationTypeDevice       = 1   // CU_MEM_LOCATION_TYPE_DEVICE
	memAccessFlagsProtReadWrite = 3   // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	memAllocGranularityMinimum  = 0   // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	attrVirtualMemorySupported  = 102 // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
)

// memLocation is CUmemLocation: {CUmemLocationType type; int id;}, 8 bytes.
type memLocation struct {
	Type int32
	ID   int32
}

// memAllocationProp is CUmemAllocationProp (CUDA 11.2 through 13): 32 bytes,
// location at offset 8, win32HandleMetaData at 16, allocFlags at 24. The
// layout is checked by TestVMMStructLayout here and against cuda.h on the
// device machine.
type memAllocationProp struct {
	Type                 int32 // CUmemAllocationType
	RequestedHandleTypes int32 // CUmemAllocationHandleType
	Location             memLocation
	Win32HandleMetaData  uintptr
	CompressionType      uint8 // allocFlags.compressionType
	GPUDirectRDMACapable uint8
	Usage                uint16
	Reserved             [4]uint8
}

// memAccessDesc is CUmemAccessDesc: {CUmemLocation location; CUmemAccess_flags
// flags;}, 12 bytes.
type memAccessDesc struct {
	Location memLocation
	Flags    int32
}

var (
	vmmDevicePrimaryCtxRelease     func(dev int32) Result
	vmmCtxGetCurrent               func(ctx *uintptr) Result
	vmmMemGetAllocationGranularity func(g *uintptr, prop *memAllocationProp, option int32) Result
	vmmMemAddressReserve           func(ptr *uint64, size, alignment uintptr, addr uint64, flags uint64) Result
	vmmMemAddressFree              func(ptr uint64, size uintptr) Result
	vmmMemCreate                   func(h *MemHandle, size uintptr, prop *memAllocationProp, flags uint64) Result
	vmmMemRelease                  func(h MemHandle) Result
	vmmMemMap                      func(ptr uint64, size, offset uintptr, h MemHandle, flags uint64) Result
	vmmMemUnmap                    func(ptr uint64, size uintptr) Result
	vmmMemSetAccess                func(ptr uint64, size uintptr, desc *memAccessDesc, count uintptr) Result
	vmmMemcpyHtoD                  func(dst uint64, src unsafe.Pointer, n uintptr) Result
	vmmMemcpyDtoH                  func(dst unsafe.Pointer, src uint64, n uintptr) Result
)

func init() {
	// cuda.h maps cuDevicePrimaryCtxRelease to its _v2 symbol.
	symbol(&vmmDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")
	symbol(&vmmCtxGetCurrent, "cuCtxGetCurrent")
	symbol(&vmmMemGetAllocationGranularity, "cuMemGetAllocationGranularity")
	symbol(&vmmMemAddressReserve, "cuMemAddressReserve")
	symbol(&vmmMemAddressFree, "cuMemAddressFree")
	symbol(&vmmMemCreate, "cuMemCreate")
	symbol(&vmmMemRelease, "cuMemRelease")
	symbol(&vmmMemMap, "cuMemMap")
	symbol(&vmmMemUnmap, "cuMemUnmap")
	symbol(&vmmMemSetAccess, "cuMemSetAccess")
	symbol(&vmmMemcpyHtoD, "cuMemcpyHtoD_v2")
	symbol(&vmmMemcpyDtoH, "cuMemcpyDtoH_v2")
}

// VMM performs virtual-memory operations for one device through its primary
// context (the context the CUDA runtime and PyTorch use, so pointers it maps
// are valid in theirs). Its methods may be called from any goroutine: each
// pins the goroutine to its OS thread for the call and makes the primary
// context current on that thread when no context is.
type VMM struct {
	ordinal int
	dev     int32
	ctx     uintptr
}

// OpenVMM loads the driver, checks that device ordinal exists and supports
// virtual memory management, and retains its primary context. Errors wrap
// ErrNoDevice when there is no driver or no such device.
func OpenVMM(ordinal int) (*VMM, error) {
	if err := Load(); err != nil {
		return nil, err
	}
	var n int32
	if err := check("cuDeviceGetCount", cuDeviceGetCount(&n)); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDevice, err)
	}
	if ordinal < 0 || ordinal >= int(n) {
		return nil, fmt.Errorf("%w: device ordinal %d is out of range: this machine has %d CUDA devices", ErrNoDevice, ordinal, n)
	}
	v := &VMM{ordinal: ordinal}
	if err := check("cuDeviceGet", cuDeviceGet(&v.dev, int32(ordinal))); err != nil {
		return nil, err
	}
	var supported int32
	if err := check("cuDeviceGetAttribute", cuDeviceGetAttribute(&supported, attrVirtualMemorySupported, v.dev)); err != nil {
		return nil, err
	}
	if supported == 0 {
		return nil, ErrVMMUnsupported
	}
	if err := check("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&v.ctx, v.dev)); err != nil {
		return nil, err
	}
	return v, nil
}

// ErrVMMUnsupported: the device lacks virtual memory management.
var ErrVMMUnsupported = errors.New("the device does not support CUDA virtual memory management")

// Close releases the primary context retained by OpenVMM. Mappings must be
// gone first.
func (v *VMM) Close() error {
	if v.ctx == 0 {
		return nil
	}
	v.ctx = 0
	return check("cuDevicePrimaryCtxRelease", vmmDevicePrimaryCtxRelease(v.dev))
}

// Ordinal is the device ordinal.
func (v *VMM) Ordinal() int { return v.ordinal }

// bind makes the primary context current on the calling OS thread if none
// is. The caller has locked the goroutine to its thread.
func (v *VMM) bind() error {
	var cur uintptr
	if err := check("cuCtxGetCurrent", vmmCtxGetCurrent(&cur)); err != nil {
		return err
	}
	if cur != 0 {
		return nil
	}
	return check("cuCtxSetCurrent", cuCtxSetCurrent(v.ctx))
}

// call runs f on a thread with a current context.
func (v *VMM) call(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := v.bind(); err != nil {
		return err
	}
	return f()
}

func (v *VMM) prop() memAllocationProp {
	return memAllocationProp{
		Type:     memAllocationTypePinned,
		Location: memLocation{Type: memLocationTypeDevice, ID: v.dev},
	}
}

// Granularity is the minimum allocation granularity of pinned device memory
// (2 MiB on current drivers): sizes and addresses of physical pages and
// reservations are multiples of it.
func (v *VMM) Granularity() (int, error) {
	var g uintptr
	err := v.call(func() error {
		p := v.prop()
		return check("cuMemGetAllocationGranularity", vmmMemGetAllocationGranularity(&g, &p, memAllocGranularityMinimum))
	})
	return int(g), err
}

// Reserve reserves size bytes of virtual address space aligned to align.
func (v *VMM) Reserve(size, align uintptr) (uint64, error) {
	var p uint64
	err := v.call(func() error {
		return check("cuMemAddressReserve", vmmMemAddressReserve(&p, size, align, 0, 0))
	})
	return p, err
}

// FreeAddress returns a reservation made by Reserve.
func (v *VMM) FreeAddress(ptr uint64, size uintptr) error {
	return v.call(func() error { return check("cuMemAddressFree", vmmMemAddressFree(ptr, size)) })
}

// Create allocates size bytes of physical memory on the device.
func (v *VMM) Create(size uintptr) (MemHandle, error) {
	var h MemHandle
	err := v.call(func() error {
		p := v.prop()
		return check("cuMemCreate", vmmMemCreate(&h, size, &p, 0))
	})
	return h, err
}

// Release frees a physical allocation once it is no longer mapped.
func (v *VMM) Release(h MemHandle) error {
	return v.call(func() error { return check("cuMemRelease", vmmMemRelease(h)) })
}

// Map maps the whole of physical allocation h (size bytes) at ptr.
func (v *VMM) Map(ptr uint64, size uintptr, h MemHandle) error {
	return v.call(func() error { return check("cuMemMap", vmmMemMap(ptr, size, 0, h, 0)) })
}

// Unmap unmaps [ptr, ptr+size), which must cover whole mappings.
func (v *VMM) Unmap(ptr uint64, size uintptr) error {
	return v.call(func() error { return check("cuMemUnmap", vmmMemUnmap(ptr, size)) })
}

// SetAccess grants the device read/write access to the mapped range
// [ptr, ptr+size), which may span several mappings.
func (v *VMM) SetAccess(ptr uint64, size uintptr) error {
	return v.call(func() error {
		d := memAccessDesc{Location: memLocation{Type: memLocationTypeDevice, ID: v.dev}, Flags: memAccessFlagsProtReadWrite}
		return check("cuMemSetAccess", vmmMemSetAccess(ptr, size, &d, 1))
	})
}

// CopyToDevice copies src to device address dst (synchronous; for tests and
// tools).
func (v *VMM) CopyToDevice(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return v.call(func() error {
		return check("cuMemcpyHtoD", vmmMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uintptr(len(src))))
	})
}

// CopyFromDevice copies len(dst) bytes from device address src (synchronous).
func (v *VMM) CopyFromDevice(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	return v.call(func() error {
		return check("cuMemcpyDtoH", vmmMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uintptr(len(dst))))
	})
}
