// Package kimage is the library's kernel image: the embedded fatbin
// (package kernels) as one cuda.Image, so that every package that
// launches kernels shares one module per context.
package kimage

import (
	"os"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/kernels"
)

// OverrideEnv names an environment variable that, when set, gives the path of
// a fatbin, cubin or PTX file to load in place of the embedded image. Kernel
// work uses it to time a variant built with nvcc against the same library
// without relinking it. Where the driver reports parameter sizes (CUDA 12.4
// and newer) each launch still checks the kernel's against the library's, so
// an image of another kernel ABI is refused there (an internal error). The
// variable is read at each context's first launch; a load that fails is kept
// for the context, so every later call that needs the kernels there fails
// with the same error.
const OverrideEnv = "KVPLUG_KERNEL_IMAGE"

// Image is the kernel image; register kernels on it at package level.
var Image = cuda.NewImage("kvplug", imageData)

func imageData() ([]byte, error) {
	path := os.Getenv(OverrideEnv)
	if path == "" {
		return kernels.Fatbin(), nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, kverr.Wrap(kverr.InvalidArgument, err, "%s: reading the kernel image", OverrideEnv)
	}
	if len(b) == 0 {
		return nil, kverr.Errorf(kverr.InvalidArgument, "%s=%s: the file is empty", OverrideEnv, path)
	}
	// The driver reads PTX as a NUL-terminated string; fatbins and cubins
	// carry their sizes and ignore the extra byte.
	return append(b, 0), nil
}
