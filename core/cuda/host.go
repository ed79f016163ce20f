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

// errHostAlreadyRegistered is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
const errHostAlreadyRegistered Result = 712

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
		if cuMemHostGetDevicePointer(&r.Device, p, 0) == Success {
			return nil // pinned and mapped by its owner
		}
		res := cuMemHostRegister(p, uintptr(size), hostRegisterPortable|hostRegisterDeviceMap)
		switch res {
		case Success:
			r.Owned = true
		case errHostAlreadyRegistered:
		default:
			return cudaErr("registering host memory (page-locking it)", "cuMemHostRegister", res)
		}
		if err := cudaErr("mapping host memory for the device", "cuMemHostGetDevicePointer",
			cuMemHostGetDevicePointer(&r.Device, p, 0)); err != nil {
			if r.Owned {
				cuMemHostUnregister(p)
				r.Owned = false
			}
			return err
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
