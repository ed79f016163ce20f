package cuda

// Modules and launches. An Image is a fatbin (the library embeds one) whose
// kernels are loaded into each CUDA context on the first launch there; the
// load result, errors included, is kept per context, and each kernel's
// CUfunction is looked up once per context. Kernels take a single parameter:
// one plain-C struct passed by value, so a launch passes kernelParams =
// {&struct}.
//
// The launch path allocates nothing: the parameter struct is copied into a
// pooled heap frame (SyscallN needs heap addresses: a goroutine's stack may
// move during the call's prologue), the context and function lookups read
// immutable snapshots, and the driver is called through purego.SyscallN on
// the bare symbol address. Measured against a cgo trampoline doing the same
// call, SyscallN adds about 60 ns to a launch whose driver side costs
// microseconds, so the package stays free of cgo.

import (
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/kvplug/kvplug/core/kverr"
)

// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
const funcAttrMaxDynamicShared = 8

var (
	cuModuleLoadData    func(mod *uintptr, image unsafe.Pointer) Result
	cuModuleGetFunction func(fn *uintptr, mod uintptr, name *byte) Result
	cuFuncSetAttribute  func(fn uintptr, attr int32, value int32) Result
	// CUDA 12.4+: offset and size of a kernel parameter; used to check that a
	// Go parameter struct has the kernel's size.
	cuFuncGetParamInfo func(fn uintptr, index uintptr, offset, size *uintptr) Result

	procLaunchKernel uintptr
)

func init() {
	symbol(&cuModuleLoadData, "cuModuleLoadData")
	symbol(&cuModuleGetFunction, "cuModuleGetFunction")
	symbol(&cuFuncSetAttribute, "cuFuncSetAttribute")
	optionalSymbol(&cuFuncGetParamInfo, "cuFuncGetParamInfo")
	rawSymbol(&procLaunchKernel, "cuLaunchKernel")
}

// Image is a fatbin loaded lazily into each context that launches from it.
type Image struct {
	name string
	data func() ([]byte, error)

	mu      sync.Mutex // serialises registration and module loads
	kernels []*Kernel
	mods    atomic.Pointer[[]*Module] // copy-on-write, read on every launch
}

// NewImage declares an image; data returns the fatbin (empty when the
// library was built without its kernels), or why it cannot be had. It is
// called at each context's first load.
func NewImage(name string, data func() ([]byte, error)) *Image {
	im := &Image{name: name, data: data}
	im.mods.Store(&[]*Module{})
	return im
}

// Kernel names a kernel (an extern "C" __global__ function) of an image.
type Kernel struct {
	img  *Image
	name string
	idx  int
}

// Kernel registers a kernel name. Register every kernel before the first
// launch (package-level variables do); a kernel registered later is refused
// in contexts loaded before it.
func (im *Image) Kernel(name string) *Kernel {
	im.mu.Lock()
	defer im.mu.Unlock()
	k := &Kernel{img: im, name: name, idx: len(im.kernels)}
	im.kernels = append(im.kernels, k)
	return k
}

// Name is the kernel's symbol.
func (k *Kernel) Name() string { return k.name }

// Module is an image loaded into one context.
type Module struct {
	ctx    Context
	dev    Device
	handle uintptr
	err    error // the load's failure, kept so every launch reports it
	fns    []function
}

type function struct {
	once      sync.Once
	ptr       uintptr
	paramSize uintptr // 0 when the driver cannot tell
	err       error
	mu        sync.Mutex
	shared    atomic.Uint32 // dynamic shared-memory limit raised so far
}

// Device is the device of the module's context.
func (m *Module) Device() Device { return m.dev }

// Context is the context the module is loaded in.
func (m *Module) Context() Context { return m.ctx }

// Module returns the image loaded into the calling thread's context (binding
// device 0's primary context when none is current), loading it on first use.
// The caller must hold its goroutine on the OS thread (runtime.LockOSThread)
// until it has launched with the result.
func (im *Image) Module() (*Module, error) {
	ctx, err := Bind()
	if err != nil {
		return nil, err
	}
	for _, m := range *im.mods.Load() {
		if m.ctx == ctx {
			return m, m.err
		}
	}
	return im.load(ctx)
}

func (im *Image) load(ctx Context) (*Module, error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	old := *im.mods.Load()
	for _, m := range old {
		if m.ctx == ctx {
			return m, m.err
		}
	}
	m := &Module{ctx: ctx, fns: make([]function, len(im.kernels))}
	m.err = im.loadInto(m)
	mods := append(append(make([]*Module, 0, len(old)+1), old...), m)
	im.mods.Store(&mods)
	return m, m.err
}

func (im *Image) loadInto(m *Module) error {
	what := "loading the " + im.name + " kernels"
	ord, err := contextDevice()
	if err != nil {
		return err
	}
	if m.dev, err = DeviceInfo(ord); err != nil {
		return err
	}
	data, err := im.data()
	if err != nil {
		return err
	}
	if len(data) == 0 {
		return kverr.Errorf(kverr.Unsupported, "%s: this library was built without its CUDA kernels (empty fatbin)", what)
	}
	if err := cudaErr(what+" on "+m.dev.String(), "cuModuleLoadData", cuModuleLoadData(&m.handle, unsafe.Pointer(&data[0]))); err != nil {
		if kverr.Is(err, kverr.CUDA) && m.dev.Major < 8 {
			return kverr.Wrap(kverr.Unsupported, err, "%s: compute capability %d.%d is below the 8.0 the kernels are built for", what, m.dev.Major, m.dev.Minor)
		}
		return err
	}
	return nil
}

func (m *Module) function(k *Kernel) (*function, error) {
	if k.idx >= len(m.fns) {
		return nil, kverr.Errorf(kverr.Internal, "kernel %s was registered after its image was loaded", k.name)
	}
	f := &m.fns[k.idx]
	f.once.Do(func() {
		name := append([]byte(k.name), 0)
		if f.err = cudaErr("looking up kernel "+k.name, "cuModuleGetFunction", cuModuleGetFunction(&f.ptr, m.handle, &name[0])); f.err != nil {
			return
		}
		if cuFuncGetParamInfo != nil {
			var off, size uintptr
			if cuFuncGetParamInfo(f.ptr, 0, &off, &size) == Success {
				f.paramSize = size
			}
		}
	})
	return f, f.err
}

// ParamSize returns the size of kernel k's single parameter as the driver
// reports it (CUDA 12.4 and newer; 0 when the driver cannot tell).
func (m *Module) ParamSize(k *Kernel) (int, error) {
	if m.err != nil {
		return 0, m.err
	}
	f, err := m.function(k)
	if err != nil {
		return 0, err
	}
	return int(f.paramSize), nil
}

// Dim3 is a grid or block shape.
type Dim3 struct{ X, Y, Z uint32 }

// LaunchConfig is a launch's shape and dynamic shared memory in bytes.
type LaunchConfig struct {
	Grid, Block Dim3
	Shared      uint32
}

// maxParamBytes bounds a parameter struct: the classic 4 KiB kernel
// parameter limit.
const maxParamBytes = 4096

// frame holds a launch's arguments in heap memory.
type frame struct {
	params [maxParamBytes / 8]uint64
	ptrs   [1]uintptr
	args   [11]uintptr // cuLaunchKernel's, as an existing slice: no allocation
}

var frames = sync.Pool{New: func() any { return new(frame) }}

// Launch enqueues kernel k of module m on stream with *params as its single
// argument. It does not synchronise, allocates nothing, and can be captured
// into a CUDA graph. m must be the module of the calling thread's current
// context (Image.Module, on the same locked thread).
func Launch[P any](m *Module, k *Kernel, cfg LaunchConfig, stream Stream, params *P) error {
	if m.err != nil {
		return m.err
	}
	f, err := m.function(k)
	if err != nil {
		return err
	}
	size := unsafe.Sizeof(*params)
	if size > maxParamBytes || (f.paramSize != 0 && f.paramSize != size) {
		return kverr.Errorf(kverr.Internal, "kernel %s takes a %d-byte parameter; the launcher passes %d bytes", k.name, f.paramSize, size)
	}
	if cfg.Shared > uint32(m.dev.SharedPerBlock) && cfg.Shared > f.shared.Load() {
		if err := m.raiseShared(k, f, cfg.Shared); err != nil {
			return err
		}
	}
	fr := frames.Get().(*frame)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&fr.params[0])), size), unsafe.Slice((*byte)(unsafe.Pointer(params)), size))
	fr.ptrs[0] = uintptr(unsafe.Pointer(&fr.params[0]))
	fr.args = [11]uintptr{f.ptr,
		uintptr(cfg.Grid.X), uintptr(cfg.Grid.Y), uintptr(cfg.Grid.Z),
		uintptr(cfg.Block.X), uintptr(cfg.Block.Y), uintptr(cfg.Block.Z),
		uintptr(cfg.Shared), uintptr(stream), uintptr(unsafe.Pointer(&fr.ptrs[0])), 0}
	r, _, _ := purego.SyscallN(procLaunchKernel, fr.args[:]...)
	runtime.KeepAlive(fr)
	frames.Put(fr)
	if Result(r) != Success {
		return cudaErr("launching "+k.name, "cuLaunchKernel", Result(r))
	}
	return nil
}

// raiseShared lets f use bytes of dynamic shared memory, which a kernel may
// only do above the default 48 KiB after opting in.
func (m *Module) raiseShared(k *Kernel, f *function, bytes uint32) error {
	if int(bytes) > m.dev.SharedPerBlockOptin {
		return kverr.Errorf(kverr.Unsupported, "kernel %s needs %d bytes of shared memory; %s allows %d", k.name, bytes, m.dev, m.dev.SharedPerBlockOptin)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if bytes <= f.shared.Load() {
		return nil
	}
	if err := cudaErr("raising the shared memory of "+k.name, "cuFuncSetAttribute", cuFuncSetAttribute(f.ptr, funcAttrMaxDynamicShared, int32(bytes))); err != nil {
		return err
	}
	f.shared.Store(bytes)
	return nil
}

// Prepare resolves kernel k in the module and, for shared > 0, lets it use
// that much dynamic shared memory, so that a later launch makes no driver
// call but the launch itself (as inside a CUDA graph capture).
func (m *Module) Prepare(k *Kernel, shared uint32) error {
	if m.err != nil {
		return m.err
	}
	f, err := m.function(k)
	if err != nil {
		return err
	}
	if shared > uint32(m.dev.SharedPerBlock) && shared > f.shared.Load() {
		return m.raiseShared(k, f, shared)
	}
	return nil
}
