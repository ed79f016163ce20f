// Package kverr is the library's status codes for Go programs that use the
// core packages: an error a core call returns carries one (CodeOf), and the
// C ABI returns the same values as kvp_status. The definitions live in
// internal/kverr, at the bottom of the library where internal/ packages can
// use them too; this package names them for importers outside the module,
// which cannot import internal/. Everything here is an alias, so the two
// packages' values are interchangeable.
package kverr

import "github.com/kvplug/kvplug/internal/kverr"

// Code is a kvp_status value.
type Code = kverr.Code

// Error is an error with a status code.
type Error = kverr.Error

// The status codes (enum kvp_status of include/kvplug.h).
const (
	OK                = kverr.OK
	InvalidArgument   = kverr.InvalidArgument
	NullPointer       = kverr.NullPointer
	StructSize        = kverr.StructSize
	InvalidHandle     = kverr.InvalidHandle
	UnknownSequence   = kverr.UnknownSequence
	DuplicateSequence = kverr.DuplicateSequence
	OutOfBlocks       = kverr.OutOfBlocks
	BufferTooSmall    = kverr.BufferTooSmall
	NoDevice          = kverr.NoDevice
	CUDA              = kverr.CUDA
	Unsupported       = kverr.Unsupported
	OutOfMemory       = kverr.OutOfMemory
	NotFound          = kverr.NotFound
	Internal          = kverr.Internal
	InUse             = kverr.InUse
)

// Errorf builds an *Error with a formatted message.
func Errorf(code Code, format string, args ...any) error { return kverr.Errorf(code, format, args...) }

// Wrap attaches a code and a message to a cause.
func Wrap(code Code, err error, format string, args ...any) error {
	return kverr.Wrap(code, err, format, args...)
}

// CodeOf returns the code an error carries: OK for nil, the code of the
// outermost *Error in its chain, Internal for any other error.
func CodeOf(err error) Code { return kverr.CodeOf(err) }

// Is reports whether err carries code.
func Is(err error, code Code) bool { return kverr.Is(err, code) }
