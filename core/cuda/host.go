package cuda

// Page-locked host memory mapped into the device's address space, for
// kernels that read or write host memory directly (the tier copy).

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// cuMemHostRegister flags (cuda.h).
const (
	hostRegisterPortable  = 0x01 // CU_MEMHOSTREGISTER_PORTABLE: every context
	hostRegisterDeviceMap = 0x02 // CU_MEMHOSTREGISTER_DEVICEMAP: mapped
)

// cuMemHostRegister's answers for memory that is page-locked already:
// CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (registered) and
// CUDA_ERROR_INVALID_VALUE (allocated pinned, by cudaHostAlloc).
const (
	errHostAlreadyRegistered Result = 712
	errInvalidValue          Result = 1
)

var (
	cuMemHostRegister         func(p unsafe.Pointer, size uintptr, flags uint32) Result
	cuMemHostUnregister       func(p unsafe.Pointer) Result
	cuMemHostGetDevicePointer func(d *DevicePtr, p unsafe.Pointer, flags uint32) Result
)

func init() {
	symbol(&cuMemHostRegister, "cuMemHostRegister_v2")
	symbol(&cuMemHostUnregister, "cuMemHostUnregister")
	symbol(&cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2")
}

// HostRegistration is host memory page-locked and mapped for the device.
type HostRegistration struct {
	Host   unsafe.Pointer
	Device DevicePtr // the address kernels use (equal to Host under UVA)
	// Owned is false when the memory was registered already (by the
	// engine, say): Unregister then leaves it registered.
	Owned bool
}

// RegisterHost page-locks [p, p+size) and maps it into the device's address
// space, in the calling thread's context (device 0's primary context when
// none is current). Memory that is page-locked and mapped already (the
// engine's cudaHostAlloc or cudaHostRegister; the whole region, which the
// driver cannot check) is used as it is and not registered twice.
func RegisterHost(p unsafe.Pointer, size int) (HostRegistration, error) {
	r := HostRegistration{Host: p}
	if p == nil || size <= 0 {
		return r, kverr.Errorf(kverr.InvalidArgument, "registering host memory: need a non-NULL region of > 0 bytes (got %p, %d bytes)", p, size)
	}
	err := withContext(func() error {
		res := cuMemHostRegister(p, uintptr(size), hostRegisterPortable|hostRegisterDeviceMap)
		if res == Success {
			r.Owned = true
		} else if res != errHostAlreadyRegistered && res != errInvalidValue {
			return cudaErr("registering host memory (page-locking it)", "cuMemHostRegister", res)
		}
		// Registered here, or by the engine (ALREADY_REGISTERED), or
		// allocated pinned by it (cudaHostAlloc memory answers
		// INVALID_VALUE): mapped if it has a device address.
		if dres := cuMemHostGetDevicePointer(&r.Device, p, 0); dres != Success {
			if r.Owned {
				cuMemHostUnregister(p)
				r.Owned = false
			}
			if res != Success && res != errHostAlreadyRegistered {
				return cudaErr("registering host memory (page-locking it)", "cuMemHostRegister", res)
			}
			return cudaErr("mapping host memory for the device", "cuMemHostGetDevicePointer", dres)
		}
		return nil
	})
	return r, err
}

// Unregister undoes RegisterHost (nothing for memory registered by others).
// No copy may be using the memory.
func (r *HostRegistration) Unregister() error {
	if !r.Owned {
		return nil
	}
	r.Owned = false
	return withContext(func() error {
		return cudaErr("unregistering host memory", "cuMemHostUnregister", cuMemHostUnregister(r.Host))
	})
}
