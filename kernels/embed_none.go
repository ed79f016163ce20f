//go:build kvplug_nokernels

package kernels

// FatbinPath is where the build writes the fatbin, relative to this package.
const FatbinPath = "fatbin/kvplug.fatbin"

// Fatbin returns nil: this build leaves the kernels out (tag kvplug_nokernels).
func Fatbin() []byte { return nil }

// Built reports whether the kernels are in this build.
func Built() bool { return false }
