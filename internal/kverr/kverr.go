// Package kverr carries the library's status codes through every package,
// internal/ and core/ alike: they return *Error values built here, and the C
// ABI turns the code into a kvp_status and the message into
// kvp_last_error(). It sits at the bottom (it imports nothing of the
// library) so that any package may use it; core/kverr re-exports it for Go
// programs, which cannot import internal/. The numeric values are the ABI's:
// they must match enum kvp_status in include/kvplug.h and never change once
// released.
package kverr

import (
	"errors"
	"fmt"
)

// Code is a kvp_status value.
type Code int32

const (
	OK                Code = 0
	InvalidArgument   Code = 1  // a value out of range: zero, negative or huge count, bad enum
	NullPointer       Code = 2  // a required pointer or buffer is NULL
	StructSize        Code = 3  // a config struct's struct_size is not one this library knows
	InvalidHandle     Code = 4  // NULL, destroyed or wrong-type handle
	UnknownSequence   Code = 5  // no live sequence has that id (removed, or never added)
	DuplicateSequence Code = 6  // the id is already live, or repeated within one batch
	OutOfBlocks       Code = 7  // not enough free (or evictable) blocks; nothing changed
	BufferTooSmall    Code = 8  // a caller buffer cannot hold the result; nothing written
	NoDevice          Code = 9  // no CUDA driver or device
	CUDA              Code = 10 // a CUDA driver call failed
	Unsupported       Code = 11 // a valid request this build or device does not support
	OutOfMemory       Code = 12 // a memory budget (host or device) is exhausted; nothing changed
	NotFound          Code = 13 // a key (prefix, slot, pin) that is not present
	Internal          Code = 14 // a bug in the library: a recovered panic or broken invariant
	InUse             Code = 15 // the call would take state another live object still uses; nothing changed
)

var names = map[Code]string{
	OK:                "KVP_OK",
	InvalidArgument:   "KVP_ERR_INVALID_ARGUMENT",
	NullPointer:       "KVP_ERR_NULL_POINTER",
	StructSize:        "KVP_ERR_STRUCT_SIZE",
	InvalidHandle:     "KVP_ERR_INVALID_HANDLE",
	UnknownSequence:   "KVP_ERR_UNKNOWN_SEQUENCE",
	DuplicateSequence: "KVP_ERR_DUPLICATE_SEQUENCE",
	OutOfBlocks:       "KVP_ERR_OUT_OF_BLOCKS",
	BufferTooSmall:    "KVP_ERR_BUFFER_TOO_SMALL",
	NoDevice:          "KVP_ERR_NO_DEVICE",
	CUDA:              "KVP_ERR_CUDA",
	Unsupported:       "KVP_ERR_UNSUPPORTED",
	OutOfMemory:       "KVP_ERR_OUT_OF_MEMORY",
	NotFound:          "KVP_ERR_NOT_FOUND",
	Internal:          "KVP_ERR_INTERNAL",
	InUse:             "KVP_ERR_IN_USE",
}

// String returns the C enumerator's name.
func (c Code) String() string {
	if n, ok := names[c]; ok {
		return n
	}
	return fmt.Sprintf("kvp_status(%d)", int32(c))
}

// Error is an error with a status code.
type Error struct {
	Code Code
	Msg  string
	Err  error // optional cause
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

func (e *Error) Unwrap() error { return e.Err }

// Errorf builds an *Error with a formatted message.
func Errorf(code Code, format string, args ...any) error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, args...)}
}

// Wrap attaches a code and a message to a cause.
func Wrap(code Code, err error, format string, args ...any) error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, args...), Err: err}
}

// CodeOf returns the code an error carries: OK for nil, the code of the
// outermost *Error in its chain, Internal for any other error.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Internal
}

// Is reports whether err carries code.
func Is(err error, code Code) bool { return CodeOf(err) == code }
