package cuda

// Devices and contexts. A CUDA context is current per OS thread. Engines
// (PyTorch, the CUDA runtime) keep their device's primary context current on
// the threads that call us, so every entry point here uses the calling
// thread's current context and only when there is none makes device 0's
// primary context current (retained once per process, never released).
// Callers pin the goroutine to its OS thread for the duration of a call
// sequence that depends on the current context (runtime.LockOSThread); a
// C thread calling an exported function is pinned already.

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/kvplug/kvplug/core/kverr"
)

// Context is a CUcontext.
type Context uintptr

// Stream is a CUstream as an integer; 0 is the legacy default stream.
type Stream uintptr

// DevicePtr is a CUdeviceptr.
type DevicePtr uint64

// Values of cuda.h's CUdevice_attribute used here.
const (
	attrMaxSharedPerBlock      = 8  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK
	attrMultiprocessorCount    = 16 // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
	attrComputeCapabilityMajor = 75 // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
	attrComputeCapabilityMinor = 76 // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
	attrMaxSharedPerBlockOptin = 97 // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
)

var (
	cuDeviceGetCount         func(n *int32) Result
	cuDeviceGet              func(dev *int32, ordinal int32) Result
	cuDeviceGetAttribute     func(v *int32, attr int32, dev int32) Result
	cuDevicePrimaryCtxRetain func(ctx *uintptr, dev int32) Result
	cuCtxSetCurrent          func(ctx uintptr) Result
	cuCtxGetDevice           func(dev *int32) Result
	cuCtxSynchronize         func() Result

	// On every launch: bare addresses called through purego.SyscallN.
	procCtxGetCurrent uintptr
)

func init() {
	symbol(&cuDeviceGetCount, "cuDeviceGetCount")
	symbol(&cuDeviceGet, "cuDeviceGet")
	symbol(&cuDeviceGetAttribute, "cuDeviceGetAttribute")
	symbol(&cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
	symbol(&cuCtxSetCurrent, "cuCtxSetCurrent")
	symbol(&cuCtxGetDevice, "cuCtxGetDevice")
	symbol(&cuCtxSynchronize, "cuCtxSynchronize")
	rawSymbol(&procCtxGetCurrent, "cuCtxGetCurrent")
}

// Device describes one CUDA device.
type Device struct {
	Ordinal int
	SMs     int // multiprocessors
	Major   int // compute capability
	Minor   int
	// Shared memory a block may use: the default limit, and the opt-in limit
	// a kernel reaches after raising its dynamic shared-memory attribute.
	SharedPerBlock      int
	SharedPerBlockOptin int
}

// ready loads the driver and turns a failure into a NO_DEVICE error whose
// message starts with what.
func ready(what string) error {
	if err := Load(); err != nil {
		return kverr.Wrap(kverr.NoDevice, err, "%s", what)
	}
	return nil
}

// cudaErr turns a failed driver call into a CUDA-coded error; nil on success.
func cudaErr(what, call string, r Result) error {
	if r == Success {
		return nil
	}
	return kverr.Wrap(kverr.CUDA, check(call, r), "%s", what)
}

// Available reports whether the driver loads and at least one device exists.
func Available() bool {
	n, err := DeviceCount()
	return err == nil && n > 0
}

// DeviceCount returns the number of CUDA devices; a NO_DEVICE error when the
// driver is missing.
func DeviceCount() (int, error) {
	if err := ready("cuda"); err != nil {
		return 0, err
	}
	var n int32
	if err := cudaErr("cuda", "cuDeviceGetCount", cuDeviceGetCount(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

var (
	devicesMu sync.Mutex
	devices   = map[int]Device{}
)

// DeviceInfo returns the attributes of device ordinal (cached).
func DeviceInfo(ordinal int) (Device, error) {
	const what = "cuda device"
	if err := ready(what); err != nil {
		return Device{}, err
	}
	devicesMu.Lock()
	defer devicesMu.Unlock()
	if d, ok := devices[ordinal]; ok {
		return d, nil
	}
	var n int32
	if err := cudaErr(what, "cuDeviceGetCount", cuDeviceGetCount(&n)); err != nil {
		return Device{}, err
	}
	if ordinal < 0 || ordinal >= int(n) {
		return Device{}, kverr.Errorf(kverr.NoDevice, "cuda device %d does not exist: this machine has %d", ordinal, n)
	}
	var dev int32
	if err := cudaErr(what, "cuDeviceGet", cuDeviceGet(&dev, int32(ordinal))); err != nil {
		return Device{}, err
	}
	attr := func(a int32) (int, error) {
		var v int32
		err := cudaErr(what, "cuDeviceGetAttribute", cuDeviceGetAttribute(&v, a, dev))
		return int(v), err
	}
	d := Device{Ordinal: ordinal}
	var errs [5]error
	d.SMs, errs[0] = attr(attrMultiprocessorCount)
	d.Major, errs[1] = attr(attrComputeCapabilityMajor)
	d.Minor, errs[2] = attr(attrComputeCapabilityMinor)
	d.SharedPerBlock, errs[3] = attr(attrMaxSharedPerBlock)
	d.SharedPerBlockOptin, errs[4] = attr(attrMaxSharedPerBlockOptin)
	if err := errors.Join(errs[:]...); err != nil {
		return Device{}, err
	}
	devices[ordinal] = d
	return d, nil
}

var (
	primaryMu sync.Mutex
	primary   = map[int]Context{} // retained primary contexts, by ordinal
)

// PrimaryContext retains device ordinal's primary context (once per process)
// and returns it.
func PrimaryContext(ordinal int) (Context, error) {
	const what = "cuda primary context"
	if _, err := DeviceInfo(ordinal); err != nil {
		return 0, err
	}
	primaryMu.Lock()
	defer primaryMu.Unlock()
	if c, ok := primary[ordinal]; ok {
		return c, nil
	}
	var dev int32
	if err := cudaErr(what, "cuDeviceGet", cuDeviceGet(&dev, int32(ordinal))); err != nil {
		return 0, err
	}
	var c uintptr
	if err := cudaErr(what, "cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&c, dev)); err != nil {
		return 0, err
	}
	primary[ordinal] = Context(c)
	return Context(c), nil
}

// slot is heap memory for a one-argument SyscallN call: the out-parameter
// (a stack variable's address could move with the goroutine's stack) and the
// argument slice, passed as an existing slice so the call allocates nothing.
type slot struct {
	v    uintptr
	args [1]uintptr
}

var slots = sync.Pool{New: func() any { return new(slot) }}

// currentContext returns the calling OS thread's current context, 0 if none.
// It allocates nothing.
func currentContext() (Context, error) {
	s := slots.Get().(*slot)
	s.v = 0
	s.args[0] = uintptr(unsafe.Pointer(&s.v))
	r, _, _ := purego.SyscallN(procCtxGetCurrent, s.args[:]...)
	c := Context(s.v)
	slots.Put(s)
	if Result(r) != Success {
		return 0, cudaErr("cuda", "cuCtxGetCurrent", Result(r))
	}
	return c, nil
}

// Bind returns the context current on the calling OS thread, first making
// device 0's primary context current when there is none. The caller must have
// locked its goroutine to the OS thread (runtime.LockOSThread) for as long as
// it relies on the result.
func Bind() (Context, error) {
	if err := ready("cuda"); err != nil {
		return 0, err
	}
	c, err := currentContext()
	if err != nil || c != 0 {
		return c, err
	}
	c, err = PrimaryContext(0)
	if err != nil {
		return 0, err
	}
	if err := cudaErr("cuda", "cuCtxSetCurrent", cuCtxSetCurrent(uintptr(c))); err != nil {
		return 0, err
	}
	return c, nil
}

// contextDevice returns the ordinal of the current context's device.
func contextDevice() (int, error) {
	var d int32
	if err := cudaErr("cuda", "cuCtxGetDevice", cuCtxGetDevice(&d)); err != nil {
		return 0, err
	}
	return int(d), nil
}

// Synchronize waits for all work of the calling thread's context (binding
// device 0's primary context when none is current).
func Synchronize() error {
	return withContext(func() error {
		return cudaErr("cuda synchronize", "cuCtxSynchronize", cuCtxSynchronize())
	})
}

// withContext runs f pinned to one OS thread with a current context.
func withContext(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := Bind(); err != nil {
		return err
	}
	return f()
}

// String describes the device for logs and test output.
func (d Device) String() string {
	return fmt.Sprintf("cuda:%d (sm_%d%d, %d SMs)", d.Ordinal, d.Major, d.Minor, d.SMs)
}
