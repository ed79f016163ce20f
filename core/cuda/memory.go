package cuda

// Device memory, streams, events and graphs. Engines own their memory and
// streams; the library uses these for its tests, benchmarks and tools. Each
// call runs on a locked OS thread with a current context (device 0's primary
// context when the thread has none).

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

var (
	cuMemAlloc           func(p *DevicePtr, size uintptr) Result
	cuMemFree            func(p DevicePtr) Result
	cuMemcpyHtoD         func(dst DevicePtr, src unsafe.Pointer, n uintptr) Result
	cuMemcpyDtoH         func(dst unsafe.Pointer, src DevicePtr, n uintptr) Result
	cuMemsetD16          func(dst DevicePtr, v uint16, n uintptr) Result
	cuMemsetD32          func(dst DevicePtr, v uint32, n uintptr) Result
	cuStreamCreate       func(s *Stream, flags uint32) Result
	cuStreamDestroy      func(s Stream) Result
	cuStreamSynchronize  func(s Stream) Result
	cuStreamBeginCapture func(s Stream, mode int32) Result
	cuStreamEndCapture   func(s Stream, g *uintptr) Result
	cuGraphInstantiate   func(exec *uintptr, g uintptr, flags uint64) Result
	cuGraphLaunch        func(exec uintptr, s Stream) Result
	cuGraphExecDestroy   func(exec uintptr) Result
	cuGraphDestroy       func(g uintptr) Result
	cuEventCreate        func(e *uintptr, flags uint32) Result
	cuEventRecord        func(e uintptr, s Stream) Result
	cuEventSynchronize   func(e uintptr) Result
	cuEventElapsedTime   func(ms *float32, start, end uintptr) Result
	cuEventDestroy       func(e uintptr) Result
)

func init() {
	// cuda.h maps these names to their _v2 symbols.
	symbol(&cuMemAlloc, "cuMemAlloc_v2")
	symbol(&cuMemFree, "cuMemFree_v2")
	symbol(&cuMemcpyHtoD, "cuMemcpyHtoD_v2")
	symbol(&cuMemcpyDtoH, "cuMemcpyDtoH_v2")
	symbol(&cuMemsetD16, "cuMemsetD16_v2")
	symbol(&cuMemsetD32, "cuMemsetD32_v2")
	symbol(&cuStreamDestroy, "cuStreamDestroy_v2")
	symbol(&cuStreamBeginCapture, "cuStreamBeginCapture_v2")
	symbol(&cuEventDestroy, "cuEventDestroy_v2")
	symbol(&cuStreamCreate, "cuStreamCreate")
	symbol(&cuStreamSynchronize, "cuStreamSynchronize")
	symbol(&cuStreamEndCapture, "cuStreamEndCapture")
	symbol(&cuGraphInstantiate, "cuGraphInstantiateWithFlags")
	symbol(&cuGraphLaunch, "cuGraphLaunch")
	symbol(&cuGraphExecDestroy, "cuGraphExecDestroy")
	symbol(&cuGraphDestroy, "cuGraphDestroy")
	symbol(&cuEventCreate, "cuEventCreate")
	symbol(&cuEventRecord, "cuEventRecord")
	symbol(&cuEventSynchronize, "cuEventSynchronize")
	symbol(&cuEventElapsedTime, "cuEventElapsedTime")
}

// MemAlloc allocates size bytes of device memory (size > 0).
func MemAlloc(size int) (DevicePtr, error) {
	if size <= 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cuda alloc: size must be positive: got %d", size)
	}
	var p DevicePtr
	err := withContext(func() error {
		if r := cuMemAlloc(&p, uintptr(size)); r != Success {
			err := cudaErr("cuda alloc", "cuMemAlloc", r)
			if r == 2 { // CUDA_ERROR_OUT_OF_MEMORY
				err = kverr.Wrap(kverr.OutOfMemory, err, "cuda alloc of %d bytes", size)
			}
			return err
		}
		return nil
	})
	return p, err
}

// MemFree frees memory from MemAlloc; 0 is a no-op.
func MemFree(p DevicePtr) error {
	if p == 0 {
		return nil
	}
	return withContext(func() error { return cudaErr("cuda free", "cuMemFree", cuMemFree(p)) })
}

// CopyToDevice copies src to dst (synchronous).
func CopyToDevice(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return withContext(func() error {
		return cudaErr("cuda copy to device", "cuMemcpyHtoD", cuMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uintptr(len(src))))
	})
}

// CopyFromDevice fills dst from src (synchronous).
func CopyFromDevice(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	return withContext(func() error {
		return cudaErr("cuda copy from device", "cuMemcpyDtoH", cuMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uintptr(len(dst))))
	})
}

// Memset16 sets n 16-bit words at dst to v.
func Memset16(dst DevicePtr, v uint16, n int) error {
	return withContext(func() error { return cudaErr("cuda memset", "cuMemsetD16", cuMemsetD16(dst, v, uintptr(n))) })
}

// Memset32 sets n 32-bit words at dst to v.
func Memset32(dst DevicePtr, v uint32, n int) error {
	return withContext(func() error { return cudaErr("cuda memset", "cuMemsetD32", cuMemsetD32(dst, v, uintptr(n))) })
}

// StreamCreate creates a stream that does not synchronise with the legacy
// default stream (CU_STREAM_NON_BLOCKING), as engines' streams are.
func StreamCreate() (Stream, error) {
	var s Stream
	err := withContext(func() error { return cudaErr("cuda stream", "cuStreamCreate", cuStreamCreate(&s, 1)) })
	return s, err
}

// StreamDestroy destroys a stream from StreamCreate.
func StreamDestroy(s Stream) error {
	return withContext(func() error { return cudaErr("cuda stream", "cuStreamDestroy", cuStreamDestroy(s)) })
}

// StreamSynchronize waits for the stream's work; it reports errors of
// kernels that failed on it.
func StreamSynchronize(s Stream) error {
	return withContext(func() error {
		return cudaErr("cuda stream synchronize", "cuStreamSynchronize", cuStreamSynchronize(s))
	})
}

// Graph is an instantiated CUDA graph.
type Graph struct {
	graph, exec uintptr
}

// Capture records what f enqueues on stream s (a stream from StreamCreate)
// into a graph and instantiates it. f runs on the capturing OS thread; the
// capture is thread-local, so other threads' CUDA calls are unaffected.
func Capture(s Stream, f func() error) (*Graph, error) {
	g := &Graph{}
	err := withContext(func() error {
		const threadLocal = 1 // CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
		if err := cudaErr("cuda graph capture", "cuStreamBeginCapture", cuStreamBeginCapture(s, threadLocal)); err != nil {
			return err
		}
		ferr := f()
		endErr := cudaErr("cuda graph capture", "cuStreamEndCapture", cuStreamEndCapture(s, &g.graph))
		if ferr != nil || endErr != nil {
			if g.graph != 0 {
				cuGraphDestroy(g.graph)
			}
			if ferr != nil {
				return ferr
			}
			return endErr
		}
		if err := cudaErr("cuda graph instantiate", "cuGraphInstantiate", cuGraphInstantiate(&g.exec, g.graph, 0)); err != nil {
			cuGraphDestroy(g.graph)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// Launch replays the graph on stream s.
func (g *Graph) Launch(s Stream) error {
	return withContext(func() error { return cudaErr("cuda graph launch", "cuGraphLaunch", cuGraphLaunch(g.exec, s)) })
}

// Destroy frees the graph.
func (g *Graph) Destroy() error {
	return withContext(func() error {
		return errJoin(cudaErr("cuda graph", "cuGraphExecDestroy", cuGraphExecDestroy(g.exec)),
			cudaErr("cuda graph", "cuGraphDestroy", cuGraphDestroy(g.graph)))
	})
}

func errJoin(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// Event is a CUevent, for timing.
type Event uintptr

// EventCreate creates a timing event.
func EventCreate() (Event, error) {
	var e uintptr
	err := withContext(func() error { return cudaErr("cuda event", "cuEventCreate", cuEventCreate(&e, 0)) })
	return Event(e), err
}

// Record records e on stream s.
func (e Event) Record(s Stream) error {
	return withContext(func() error { return cudaErr("cuda event", "cuEventRecord", cuEventRecord(uintptr(e), s)) })
}

// Elapsed waits for end and returns the milliseconds between e and end.
func (e Event) Elapsed(end Event) (float32, error) {
	var ms float32
	err := withContext(func() error {
		if err := cudaErr("cuda event", "cuEventSynchronize", cuEventSynchronize(uintptr(end))); err != nil {
			return err
		}
		return cudaErr("cuda event", "cuEventElapsedTime", cuEventElapsedTime(&ms, uintptr(e), uintptr(end)))
	})
	return ms, err
}

// Destroy frees the event.
func (e Event) Destroy() error {
	return withContext(func() error { return cudaErr("cuda event", "cuEventDestroy", cuEventDestroy(uintptr(e))) })
}
