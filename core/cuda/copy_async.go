package cuda

import (
	"unsafe"
)

var cuMemcpyHtoDAsync func(dst DevicePtr, src unsafe.Pointer, n uintptr, s Stream) Result

func init() { symbol(&cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2") }

// CopyToDeviceAsync enqueues a copy of n bytes from host memory src to dst
// on stream, in the calling thread's current context. From pinned memory it
// returns at once and the source must stay unchanged until the copy has
// executed; from pageable memory the driver stages the bytes before it
// returns. The caller has locked its OS thread and made a context current
// (as every launch does). Copies of pageable memory cannot be captured in a
// CUDA graph.
func CopyToDeviceAsync(dst DevicePtr, src unsafe.Pointer, n int, stream Stream) error {
	if n <= 0 {
		return nil
	}
	if err := ready("cuda copy to device"); err != nil {
		return err
	}
	return cudaErr("cuda copy to device", "cuMemcpyHtoDAsync", cuMemcpyHtoDAsync(dst, src, uintptr(n), stream))
}
