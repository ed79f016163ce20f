// Package cuda reaches the CUDA driver API by dlopen of libcuda.so.1 at run
// time (through purego), so the library links against nothing from CUDA and
// loads on machines with no GPU or driver. Every entry point is bound on first
// use; on a machine without a driver Load returns an error wrapping
// ErrNoDevice and callers report KVP_ERR_NO_DEVICE.
//
// Files of this package declare the driver functions they need as package
// variables and register them with symbol() from an init function; Load binds
// every registered symbol once.
package cuda

import (
	"errors"
	"fmt"
	"sync"

	"github.com/ebitengine/purego"
)

// Result is a CUresult.
type Result int32

// Success is CUDA_SUCCESS.
const Success Result = 0

// ErrNoDevice is wrapped by every error that means "no usable CUDA driver or
// device on this machine".
var ErrNoDevice = errors.New("no CUDA device")

// Error is a failed driver call.
type Error struct {
	Call string // driver function that failed
	Code Result
	Name string // CUDA_ERROR_... when the driver can name it
	Desc string // the driver's description
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s failed: %s (%d): %s", e.Call, e.Name, int(e.Code), e.Desc)
}

// Library names tried in order; libcuda.so.1 is the one the driver installs.
var libraryNames = []string{"libcuda.so.1", "libcuda.so"}

type binding struct {
	fptr     any
	raw      *uintptr // set instead of fptr: the bare address, for purego.SyscallN
	name     string
	optional bool
}

var (
	bindings []binding

	loadOnce sync.Once
	loadErr  error
	handle   uintptr
)

// symbol registers a driver function to bind at Load. fptr is a pointer to a
// func variable whose signature matches the C prototype.
func symbol(fptr any, name string) { bindings = append(bindings, binding{fptr: fptr, name: name}) }

// optionalSymbol registers a function that older drivers may lack; Load leaves
// the variable nil when the symbol is missing.
func optionalSymbol(fptr any, name string) {
	bindings = append(bindings, binding{fptr: fptr, name: name, optional: true})
}

var (
	cuInit             func(flags uint32) Result
	cuGetErrorName     func(r Result, s **byte) Result
	cuGetErrorString   func(r Result, s **byte) Result
	cuDriverGetVersion func(v *int32) Result
)

func init() {
	symbol(&cuInit, "cuInit")
	symbol(&cuGetErrorName, "cuGetErrorName")
	symbol(&cuGetErrorString, "cuGetErrorString")
	symbol(&cuDriverGetVersion, "cuDriverGetVersion")
}

// rawSymbol registers a driver function whose address Load stores in *p, for
// calls on the launch path: purego.SyscallN on a bare address costs about a
// tenth of a RegisterLibFunc call (which goes through reflection and
// allocates) and, given heap-resident arguments, allocates nothing.
func rawSymbol(p *uintptr, name string) { bindings = append(bindings, binding{raw: p, name: name}) }

// Load opens the driver and calls cuInit(0) once per process. It is safe to
// call from any goroutine; every call after the first returns the first
// result.
func Load() error {
	loadOnce.Do(func() { loadErr = load() })
	return loadErr
}

func load() error {
	var err error
	for _, name := range libraryNames {
		handle, err = purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err == nil {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("%w: cannot load the CUDA driver (libcuda.so.1): %v", ErrNoDevice, err)
	}
	for _, b := range bindings {
		addr, err := purego.Dlsym(handle, b.name)
		if err != nil {
			if b.optional {
				continue
			}
			return fmt.Errorf("%w: the CUDA driver lacks %s; it is too old", ErrNoDevice, b.name)
		}
		if b.raw != nil {
			*b.raw = addr
			continue
		}
		purego.RegisterLibFunc(b.fptr, handle, b.name)
	}
	if r := cuInit(0); r != Success {
		return fmt.Errorf("%w: %v", ErrNoDevice, check("cuInit", r))
	}
	return nil
}

// check turns a CUresult into nil or an *Error carrying the driver's name and
// description of the code.
func check(call string, r Result) error {
	if r == Success {
		return nil
	}
	e := &Error{Call: call, Code: r, Name: "CUDA_ERROR_UNKNOWN", Desc: "unknown error"}
	var p *byte
	if cuGetErrorName != nil && cuGetErrorName(r, &p) == Success && p != nil {
		e.Name = goString(p)
	}
	if cuGetErrorString != nil && cuGetErrorString(r, &p) == Success && p != nil {
		e.Desc = goString(p)
	}
	return e
}

// DriverVersion returns the CUDA version the driver supports, as 1000*major +
// 10*minor (13000 for CUDA 13.0).
func DriverVersion() (int, error) {
	if err := Load(); err != nil {
		return 0, err
	}
	var v int32
	if err := check("cuDriverGetVersion", cuDriverGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}
