// Package kernels holds the library's CUDA kernels: kvplug_kernels.cu compiled
// by nvcc into one fatbin (machine code for sm_80, sm_86, sm_89 and sm_90, PTX
// for compute_90), embedded here and loaded into a context on first launch.
// `make kernels` builds kvplug.fatbin; the Go build embeds whatever is there.
package kernels

import _ "embed"

//go:embed kvplug.fatbin
var fatbin []byte

// Fatbin returns the embedded fatbin; empty when the library was built
// without the kernels. Callers must not modify it.
func Fatbin() []byte { return fatbin }
