// Package kimage is the library's kernel image: the embedded fatbin
// (package kernels) as one cuda.Image, so that every package that
// launches kernels shares one module per context.
package kimage

import (
	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/kernels"
)

// Image is the fatbin's image; register kernels on it at package level.
var Image = cuda.NewImage("kvplug", kernels.Fatbin)
