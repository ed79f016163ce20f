// Command capi is libkvplug's C ABI: the //export functions declared in
// include/kvplug.h, built with go build -buildmode=c-shared. It translates:
// it decodes the C structs (the struct-evolution rule, must-be-zero fields,
// NULL pointers, views of the caller's arrays), maps handles to core
// objects, calls the core, encodes the result and recovers panics. The
// logic and the bounds (core/limits) live in core/.
package main

//go:generate go run ../internal/forkguard/gen ../include/kvplug.h forkguard.c

/*
#cgo CFLAGS: -I${SRCDIR}/../include -DKVPLUG_NO_PROTOTYPES -std=gnu11 -fvisibility=default
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import (
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

func main() {}

// setError stores msg as the calling thread's kvp_last_error().
func setError(msg string) {
	if len(msg) == 0 {
		C.kvp__set_error(nil, 0)
		return
	}
	C.kvp__set_error((*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
}

// fail records err for kvp_last_error and returns its status (KVP_OK for nil).
func fail(err error) C.kvp_status {
	if err == nil {
		return C.KVP_OK
	}
	code := kverr.CodeOf(err)
	setError(err.Error())
	if code == kverr.Internal {
		logx.L().Error("internal error", zap.Error(err))
	}
	return C.kvp_status(code)
}

// failf is fail of a new error with a code and a formatted message.
func failf(code kverr.Code, format string, args ...any) C.kvp_status {
	return fail(kverr.Errorf(code, format, args...))
}

// guard must be the first deferred call of every export that returns a
// status: it turns a panic into KVP_ERR_INTERNAL with a message and a stack
// in the log, so a bug never takes the host process down.
func guard(st *C.kvp_status) {
	if r := recover(); r != nil {
		*st = panicStatus(r)
	}
}

// guardVoid is guard for exports that return nothing (destroy functions).
func guardVoid() {
	if r := recover(); r != nil {
		panicStatus(r)
	}
}

func panicStatus(r any) C.kvp_status {
	msg := fmt.Sprintf("internal error (please report): %v", r)
	logx.L().Error(msg, zap.ByteString("stack", debug.Stack()))
	setError(msg)
	return C.KVP_ERR_INTERNAL
}

// Handles. A handle given to C is the address of a small C allocation that
// is never freed or reused, so a stale or foreign handle can never alias a
// live object; lookups are by address and never dereference it.
var (
	handles     sync.Map // uintptr -> any
	handleCount atomic.Int64
)

//export kvpgo_live_handles
func kvpgo_live_handles(out *C.int64_t) (st C.kvp_status) {
	defer guard(&st)
	if logx.InCallback() {
		return fail(errFromLogCallback("kvp_live_handles"))
	}
	if out == nil {
		return failf(kverr.NullPointer, "kvp_live_handles: out must not be NULL")
	}
	*out = C.int64_t(handleCount.Load())
	return C.KVP_OK
}

// newHandle registers obj and returns its C handle.
func newHandle(obj any) unsafe.Pointer {
	p := C.malloc(1)
	if p == nil {
		panic("out of host memory for a handle")
	}
	handles.Store(uintptr(p), obj)
	handleCount.Add(1)
	return p
}

// errFromLogCallback refuses a call made by the host's log callback: the
// code that logged may hold the lock the call needs, so going on could
// deadlock (the header forbids such calls; this makes them fail).
func errFromLogCallback(op string) error {
	return kverr.Errorf(kverr.Unsupported, "%s called from inside the log callback; the callback must not call into kvplug", op)
}

// lookup returns the object of handle h if it is live and of type T. Every
// call on a handle starts here, so this is also where a call from inside
// the log callback is refused.
func lookup[T any](h unsafe.Pointer, what string) (T, error) {
	var zero T
	if logx.InCallback() {
		return zero, errFromLogCallback("a " + what + " function")
	}
	if h == nil {
		return zero, kverr.Errorf(kverr.InvalidHandle, "%s handle is NULL", what)
	}
	v, ok := handles.Load(uintptr(h))
	if !ok {
		return zero, kverr.Errorf(kverr.InvalidHandle, "%s handle %p is not live (destroyed, or never created)", what, h)
	}
	t, ok := v.(T)
	if !ok {
		return zero, kverr.Errorf(kverr.InvalidHandle, "handle %p is not a %s handle", h, what)
	}
	return t, nil
}

// onHandle is the shape of every export on a handle but a destroy: under
// the panic guard, h's live object of type T (lookup's rules) is given to f,
// whose error becomes the status and kvp_last_error.
func onHandle[T any](h unsafe.Pointer, what string, f func(T) error) (st C.kvp_status) {
	defer guard(&st)
	obj, err := lookup[T](h, what)
	if err != nil {
		return fail(err)
	}
	return fail(f(obj))
}

// dropHandle unregisters h and returns its object if h is a live handle of
// type T; any other pointer (NULL, destroyed, never a handle, or a handle
// of another type) is left alone and false returned, so a destroy function
// never acts on an object it does not own. Nor does a destroy called from
// the log callback.
func dropHandle[T any](h unsafe.Pointer) (T, bool) {
	var zero T
	if h == nil || logx.InCallback() {
		return zero, false
	}
	v, ok := handles.Load(uintptr(h))
	if !ok {
		return zero, false
	}
	t, ok := v.(T)
	// CompareAndDelete: of two racing destroys of one handle, one wins.
	if !ok || !handles.CompareAndDelete(uintptr(h), v) {
		return zero, false
	}
	handleCount.Add(-1)
	return t, true
}

// checkCount validates a batch length (KVP_MAX_BATCH bounds every batched
// call, so a wrong count is caught before a slice is made over the caller's
// array).
func checkCount(n C.int32_t, what string) error {
	return limits.Range(what, int(n), 1, limits.Batch)
}

// slice views a caller array of n elements without copying; nil for a NULL
// pointer. The view must not outlive the call.
func slice[T any](p unsafe.Pointer, n C.int32_t) []T {
	if p == nil || n <= 0 {
		return nil
	}
	return unsafe.Slice((*T)(p), int(n))
}

// maxHostView bounds the length of a view of the caller's memory: no
// array or workspace the library reads is larger, so a larger size a caller
// states is as good as this one, and unsafe.Slice refuses a length past
// the address space.
const maxHostView = 1 << 40

// view is slice for what slice cannot say: counts past int32 (at most
// maxHostView bytes' worth) and, for an array that would run past the end
// of the address space (p is then no array's address), an InvalidArgument
// naming it, where unsafe.Slice would panic. nil for NULL or n <= 0.
func view[T any](what, name string, p unsafe.Pointer, n int64) ([]T, error) {
	if p == nil || n <= 0 {
		return nil, nil
	}
	if uint64(n)*uint64(unsafe.Sizeof(*new(T))) > uint64(^uintptr(0)-uintptr(p)) {
		return nil, kverr.Errorf(kverr.InvalidArgument, "%s: %s (%p) is not the address of %d values", what, name, p, n)
	}
	return unsafe.Slice((*T)(p), n), nil
}

// hostView is the caller's memory [p, p+n) as bytes (nil when p is NULL),
// at most maxHostView long and never past the end of the address space:
// for a workspace whose stated size may exceed what the library reads.
func hostView(p unsafe.Pointer, n uint64) []byte {
	if p == nil {
		return nil
	}
	n = min(n, maxHostView, uint64(^uintptr(0)-uintptr(p)))
	return unsafe.Slice((*byte)(p), n)
}

// copyStruct copies min(callerSize, ours) bytes of a versioned struct, so
// callers built against an older, shorter struct keep working: an output
// struct gets the fields it has room for, an input struct read into a
// zeroed value leaves the fields it lacks at 0, their defaults.
func copyStruct(dst, src unsafe.Pointer, callerSize, ours uintptr) {
	n := min(callerSize, ours)
	copy(unsafe.Slice((*byte)(dst), n), unsafe.Slice((*byte)(src), n))
}

// statsOut is the shape of every stats export: under onHandle's rules
// (what names the handle's type), fill translates h's object's figures
// into the C struct, which is written to out by the struct rule (s: as
// much as the caller's struct holds); out NULL fails with NullPointer,
// op naming the call.
func statsOut[T, S any](h unsafe.Pointer, what, op string, out *S, s abiStruct, fill func(T) S) C.kvp_status {
	return onHandle(h, what, func(obj T) error {
		if out == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: out must not be NULL", op)
		}
		v := fill(obj)
		return s.out(unsafe.Pointer(out), unsafe.Pointer(&v))
	})
}

// configIn is the start of every create export: cfg and out (outNil: it
// is NULL) must not be NULL, and the caller's config is read into c by
// the struct rule (s; fields past its struct_size stay 0, their defaults).
func configIn[T any](op string, cfg *T, outNil bool, s abiStruct, c *T) error {
	if cfg == nil || outNil {
		return kverr.Errorf(kverr.NullPointer, "%s: cfg and out must not be NULL", op)
	}
	return s.in(unsafe.Pointer(cfg), unsafe.Pointer(c))
}

// createHandle is the shape of a create export: under the panic guard, the
// caller's config is read into c (configIn's rules) and given to make,
// whose object, unless it fails, is registered and its handle written to
// the caller's out (a kvp_X **: every handle type is one pointer; the C
// handle types are opaque, so no Go type argument can name them); out is
// left alone on failure.
func createHandle[T any](op string, cfg *T, out unsafe.Pointer, s abiStruct, make func(c *T) (any, error)) (st C.kvp_status) {
	defer guard(&st)
	var c T
	if err := configIn(op, cfg, out == nil, s, &c); err != nil {
		return fail(err)
	}
	obj, err := make(&c)
	if err != nil {
		return fail(err)
	}
	*(*unsafe.Pointer)(out) = newHandle(obj)
	return C.KVP_OK
}

// destroy is the shape of every destroy export: under the panic guard, h
// is dropped (dropHandle's rules: only a live handle of type T) and its
// object closed.
func destroy[T any](h unsafe.Pointer, close func(T)) {
	defer guardVoid()
	if obj, ok := dropHandle[T](h); ok {
		close(obj)
	}
}

// batchOf checks a batched call's arguments in the order every such call
// does: its required pointers first (anyNil: one is NULL; names lists
// them for the message), then its count n (checkCount).
func batchOf(op string, n C.int32_t, anyNil bool, names string) error {
	if anyNil {
		return kverr.Errorf(kverr.NullPointer, "%s: %s must not be NULL", op, names)
	}
	return checkCount(n, op+": n")
}

// storeKeysOf validates a store call's count n and its keys (and, when name is
// not "", the output array that call requires: outNil, it is NULL) and
// views the caller's n keys of type K.
func storeKeysOf[K any](op string, n C.int32_t, keys unsafe.Pointer, name string, outNil bool) ([]K, error) {
	if err := checkCount(n, op+": n"); err != nil {
		return nil, err
	}
	if keys == nil {
		return nil, kverr.Errorf(kverr.NullPointer, "%s: keys must not be NULL", op)
	}
	if name != "" && outNil {
		return nil, kverr.Errorf(kverr.NullPointer, "%s: %s must not be NULL", op, name)
	}
	return slice[K](keys, n), nil
}
