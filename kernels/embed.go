//go:build !kvplug_nokernels

// Package kernels holds the library's CUDA kernels: kvplug_kernels.cu compiled
// by nvcc into one fatbin (machine code for sm_80, sm_86, sm_89 and sm_90, PTX
// for compute_90), embedded here and loaded into a context on first launch.
//
// `make kernels` (or kernels/build.sh) writes fatbin/kvplug.fatbin; the Go
// build embeds the fatbin/ folder whatever it holds, so a checkout without
// the fatbin (a fresh clone, or this module fetched by another Go program)
// still builds, and its kernel calls answer KVP_ERR_UNSUPPORTED. The build
// tag kvplug_nokernels leaves the kernels out even where a fatbin exists.
package kernels

import (
	"embed"
	"io/fs"
)

//go:embed fatbin
var files embed.FS

// FatbinPath is where the build writes the fatbin, relative to this package.
const FatbinPath = "fatbin/kvplug.fatbin"

var fatbin = func() []byte {
	b, err := fs.ReadFile(files, FatbinPath)
	if err != nil {
		return nil
	}
	return b
}()

// Fatbin returns the embedded fatbin; empty when the library was built
// without the kernels. Callers must not modify it.
func Fatbin() []byte { return fatbin }

// Built reports whether the kernels are in this build.
func Built() bool { return len(fatbin) > 0 }
