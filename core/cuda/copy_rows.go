package cuda

// Strided copies through the copy engines: cuMemcpy2DAsync moves rows of
// equal width at a fixed pitch on each side in one driver call. A paged KV
// cache allocated as one tensor [layers][K, V][blocks][...] holds a block's
// chunks of every layer and tensor at one pitch (blocks x block stride), and
// a host tier slot holds them back to back: one call moves the whole block,
// where a list of pointer-to-pointer copies (MemcpyBatchAsync) needs one
// entry a chunk and costs the driver about half a microsecond each.

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// memcpy2D mirrors cuda.h's CUDA_MEMCPY2D (128 bytes on 64-bit hosts).
type memcpy2D struct {
	SrcXInBytes, SrcY uintptr
	SrcMemoryType     uint32
	_                 uint32
	SrcHost           uintptr
	SrcDevice         DevicePtr
	SrcArray          uintptr
	SrcPitch          uintptr
	DstXInBytes, DstY uintptr
	DstMemoryType     uint32
	_                 uint32
	DstHost           uintptr
	DstDevice         DevicePtr
	DstArray          uintptr
	DstPitch          uintptr
	WidthInBytes      uintptr
	Height            uintptr
}

// Values of cuda.h's CUmemorytype.
const (
	memoryTypeHost   = 1
	memoryTypeDevice = 2
)

// MaxCopyPitch is the largest pitch a strided copy takes: the driver refuses
// one above CU_DEVICE_ATTRIBUTE_MAX_PITCH, which is 2^31 - 1 bytes on every
// device since compute capability 2.0.
const MaxCopyPitch = 1<<31 - 1

var cuMemcpy2DAsync func(p *memcpy2D, s Stream) Result

func init() { symbol(&cuMemcpy2DAsync, "cuMemcpy2DAsync_v2") }

// RowCopy holds one strided copy's arguments between calls, so that no Go
// stack address reaches the driver. Not safe for concurrent use.
type RowCopy struct{ p memcpy2D }

// DeviceToHostAsync enqueues on stream the copy of rows rows of width bytes
// from device memory (row r at src + r*srcPitch) to page-locked host memory
// (row r at dst + r*dstPitch), in the calling thread's current context (the
// caller has locked its OS thread and made a context current). Both pitches
// are at least width and at most MaxCopyPitch; the host memory stays
// allocated and unchanged by the host until the copy has executed.
func (c *RowCopy) DeviceToHostAsync(dst unsafe.Pointer, dstPitch int64, src DevicePtr, srcPitch, width, rows int64, stream Stream) error {
	const what = "cuda strided copy to host"
	if width <= 0 || rows <= 0 || dst == nil || src == 0 ||
		srcPitch < width || dstPitch < width || srcPitch > MaxCopyPitch || dstPitch > MaxCopyPitch {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d rows of %d bytes at pitches %d (device) and %d (host) from %#x to %p",
			what, rows, width, srcPitch, dstPitch, uint64(src), dst)
	}
	if err := ready(what); err != nil {
		return err
	}
	c.p = memcpy2D{
		SrcMemoryType: memoryTypeDevice, SrcDevice: src, SrcPitch: uintptr(srcPitch),
		DstMemoryType: memoryTypeHost, DstHost: uintptr(dst), DstPitch: uintptr(dstPitch),
		WidthInBytes: uintptr(width), Height: uintptr(rows),
	}
	return cudaErr(what, "cuMemcpy2DAsync", cuMemcpy2DAsync(&c.p, stream))
}

var cuMemGetAddressRange func(base *DevicePtr, size *uintptr, p DevicePtr) Result

func init() { symbol(&cuMemGetAddressRange, "cuMemGetAddressRange_v2") }

// AllocationRange returns the start and the size in bytes of the device
// allocation that holds p, in the calling thread's current context. A
// strided copy's rows must lie in one allocation: the driver refuses
// (CUDA_ERROR_INVALID_VALUE) rows spread over several.
func AllocationRange(p DevicePtr) (DevicePtr, int64, error) {
	const what = "cuda allocation range"
	if err := ready(what); err != nil {
		return 0, 0, err
	}
	var base DevicePtr
	var size uintptr
	if err := cudaErr(what, "cuMemGetAddressRange", cuMemGetAddressRange(&base, &size, p)); err != nil {
		return 0, 0, err
	}
	return base, int64(size), nil
}
