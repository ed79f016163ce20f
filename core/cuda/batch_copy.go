package cuda

// Batched copies through the copy engines: cuMemcpyBatchAsync (CUDA 12.8+)
// enqueues a list of pointer-to-pointer copies in one call, so that a batch
// of thousands of small copies (a tier store is blocks x layers x 2 chunks)
// costs one driver call and no SM time, where a kernel doing the same copies
// takes thread blocks from the kernels running beside it.
//
// The entry point changed its signature between toolkits, and cuda.h maps
// the name cuMemcpyBatchAsync to a versioned symbol:
//
//	CUDA 12.8  cuMemcpyBatchAsync     (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream)
//	CUDA 13.0  cuMemcpyBatchAsync_v2  (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream)
//
// A 13.x driver exports both symbols, each with its own signature; a 12.8
// driver only the first. Both are bound as optional symbols and picked by
// the driver's version (pickBatchABI), so that a driver older than 12.8
// loads the library and answers UNSUPPORTED here instead of failing Load.

import (
	"fmt"

	"github.com/kvplug/kvplug/core/kverr"
)

// CUmemcpyAttributes (cuda.h, CUDA 12.8+): srcAccessOrder, srcLocHint and
// dstLocHint (CUmemLocation: a type and an id, two ints), flags. 24 bytes,
// 4-byte aligned.
type memcpyAttributes struct {
	SrcAccessOrder uint32
	SrcLocType     int32
	SrcLocID       int32
	DstLocType     int32
	DstLocID       int32
	Flags          uint32
}

// Values of cuda.h's CUmemcpySrcAccessOrder and CUmemcpyFlags.
const (
	// CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream
	// order, after the work enqueued before the batch (the kernels that
	// wrote the K/V).
	memcpySrcAccessOrderStream = 1
	// CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: a hint to keep the copies
	// off the SMs (on the copy engines), so that they overlap the kernels
	// of other streams. Drivers before 13.1 honour it on Tegra only; there
	// the driver picks the engine by itself.
	memcpyFlagPreferOverlapWithCompute = 1
)

// Legacy default streams, which cuMemcpyBatchAsync refuses ("must not be
// legacy NULL stream"): 0 and CU_STREAM_LEGACY.
const (
	streamNull   Stream = 0
	streamLegacy Stream = 1
)

var (
	// cuMemcpyBatchAsync_v2: the CUDA 13.0 signature.
	cuMemcpyBatchAsync13 func(dsts, srcs *DevicePtr, sizes *uintptr, count uintptr, attrs *memcpyAttributes,
		attrsIdxs *uintptr, numAttrs uintptr, s Stream) Result
	// cuMemcpyBatchAsync: the CUDA 12.8 signature, with failIdx.
	cuMemcpyBatchAsync12 func(dsts, srcs *DevicePtr, sizes *uintptr, count uintptr, attrs *memcpyAttributes,
		attrsIdxs *uintptr, numAttrs uintptr, failIdx *uintptr, s Stream) Result
)

func init() {
	optionalSymbol(&cuMemcpyBatchAsync13, "cuMemcpyBatchAsync_v2")
	optionalSymbol(&cuMemcpyBatchAsync12, "cuMemcpyBatchAsync")
}

// batchABI is the cuMemcpyBatchAsync signature in use.
type batchABI int

const (
	batchNone  batchABI = iota
	batch12080          // cuMemcpyBatchAsync, with failIdx
	batch13000          // cuMemcpyBatchAsync_v2
)

// pickBatchABI chooses the batched copy's entry point for a driver of
// version driver (cuDriverGetVersion's 1000*major + 10*minor) that exports
// the CUDA 13.0 symbol (have13) and the 12.8 one (have12): the newest
// signature both the driver's version and its exports provide. A driver
// older than 12.8 has neither: UNSUPPORTED.
func pickBatchABI(driver int, have13, have12 bool) (batchABI, error) {
	switch {
	case driver >= 13000 && have13:
		return batch13000, nil
	case driver >= 12080 && have12:
		return batch12080, nil
	}
	return batchNone, kverr.Errorf(kverr.Unsupported,
		"batched copies through the copy engines need cuMemcpyBatchAsync (a CUDA 12.8 or newer driver); this driver supports CUDA %d.%d",
		driver/1000, driver%1000/10)
}

// batchEntry returns the batched copy's signature for this driver.
func batchEntry() (batchABI, error) {
	if err := ready("cuda batched copy"); err != nil {
		return batchNone, err
	}
	v, err := DriverVersion()
	if err != nil {
		return batchNone, kverr.Wrap(kverr.CUDA, err, "cuda batched copy")
	}
	return pickBatchABI(v, cuMemcpyBatchAsync13 != nil, cuMemcpyBatchAsync12 != nil)
}

// BatchCopySupported returns nil when the driver can run MemcpyBatchAsync,
// UNSUPPORTED when it is older than CUDA 12.8 and NO_DEVICE without a
// driver.
func BatchCopySupported() error {
	_, err := batchEntry()
	return err
}

// CopyBatch is a list of copies for MemcpyBatchAsync: copy i moves Size[i]
// bytes from Src[i] to Dst[i] (unified addresses: device memory, or host
// memory the driver knows, such as page-locked registered memory). Its
// arrays are reused from batch to batch: Reset keeps their capacity.
type CopyBatch struct {
	Dst, Src []DevicePtr
	Size     []uintptr

	// Heap-resident arguments of the driver call (one attribute for every
	// copy), so that no Go stack address reaches the driver.
	attrs    memcpyAttributes
	attrsIdx uintptr
	failIdx  uintptr
}

// Add appends the copy of n bytes from src to dst.
func (b *CopyBatch) Add(dst, src DevicePtr, n int64) {
	b.Dst = append(b.Dst, dst)
	b.Src = append(b.Src, src)
	b.Size = append(b.Size, uintptr(n))
}

// Len is the number of copies.
func (b *CopyBatch) Len() int { return len(b.Size) }

// Reset empties the batch, keeping its arrays.
func (b *CopyBatch) Reset() { b.Dst, b.Src, b.Size = b.Dst[:0], b.Src[:0], b.Size[:0] }

// CheckBatchStream returns INVALID_ARGUMENT for a stream MemcpyBatchAsync
// refuses: the legacy default stream, which cuMemcpyBatchAsync does not
// take. A caller checks before enqueueing any of a call's work.
func CheckBatchStream(s Stream) error {
	if s == streamNull || s == streamLegacy {
		return kverr.Errorf(kverr.InvalidArgument,
			"cuda batched copy: the legacy default stream (%#x) cannot take a batched copy (cuMemcpyBatchAsync); use a created stream or the per-thread default stream", uintptr(s))
	}
	return nil
}

// MemcpyBatchAsync enqueues b's copies on stream as one batch, in the
// calling thread's current context (the caller has locked its OS thread
// and made a context current). The sources are read in stream order; the
// copies of one batch run in no given order among themselves, so no copy
// may read what another of the batch writes. The driver reads b's arrays
// during the call only. The legacy default stream is refused
// (INVALID_ARGUMENT), a driver older than CUDA 12.8 too (UNSUPPORTED).
func MemcpyBatchAsync(b *CopyBatch, stream Stream) error {
	const what = "cuda batched copy"
	n := b.Len()
	if n == 0 {
		return nil
	}
	if len(b.Dst) != n || len(b.Src) != n {
		return kverr.Errorf(kverr.Internal, "%s: %d destinations, %d sources, %d sizes", what, len(b.Dst), len(b.Src), n)
	}
	if err := CheckBatchStream(stream); err != nil {
		return err
	}
	abi, err := batchEntry()
	if err != nil {
		return err
	}
	b.attrs = memcpyAttributes{SrcAccessOrder: memcpySrcAccessOrderStream, Flags: memcpyFlagPreferOverlapWithCompute}
	b.attrsIdx = 0 // attrs[0] applies from copy 0 on: to every copy
	var r Result
	switch abi {
	case batch13000:
		r = cuMemcpyBatchAsync13(&b.Dst[0], &b.Src[0], &b.Size[0], uintptr(n), &b.attrs, &b.attrsIdx, 1, stream)
		return cudaErr(fmt.Sprintf("%s of %d copies", what, n), "cuMemcpyBatchAsync_v2", r)
	default:
		b.failIdx = ^uintptr(0) // SIZE_MAX: the failure concerns no single copy
		r = cuMemcpyBatchAsync12(&b.Dst[0], &b.Src[0], &b.Size[0], uintptr(n), &b.attrs, &b.attrsIdx, 1, &b.failIdx, stream)
		if r != Success && b.failIdx < uintptr(n) {
			i := b.failIdx
			return cudaErr(fmt.Sprintf("%s of %d copies (copy %d: %d bytes from %#x to %#x)", what, n, i, b.Size[i],
				uint64(b.Src[i]), uint64(b.Dst[i])), "cuMemcpyBatchAsync", r)
		}
		return cudaErr(fmt.Sprintf("%s of %d copies", what, n), "cuMemcpyBatchAsync", r)
	}
}
