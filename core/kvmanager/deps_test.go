package kvmanager

import (
	"os/exec"
	"strings"
	"testing"
)

// The block manager is host-only: a program that manages blocks (a
// scheduler, a trace replay, a Go engine's CPU side) must not link the CUDA
// driver layer, the kernel launchers or the fatbin. Any import that reaches
// one of them (an oracle or a launcher beside the cascade planner, say)
// fails here.
func TestDepsHaveNoCUDA(t *testing.T) {
	// go test puts its own GOROOT/bin first on the PATH of the test.
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	var bad []string
	for _, pkg := range strings.Fields(string(out)) {
		if cudaPackage(pkg) {
			bad = append(bad, pkg)
		}
	}
	if len(bad) > 0 {
		t.Fatalf("core/kvmanager depends on CUDA packages %v; go list -deps:\n%s", bad, out)
	}
}

// cudaPackage reports whether pkg is one of the library's device-side
// packages or the dlopen layer they load libcuda with.
func cudaPackage(pkg string) bool {
	for _, p := range []string{
		"github.com/kvplug/kvplug/core/cuda",
		"github.com/kvplug/kvplug/core/attn",
		"github.com/kvplug/kvplug/kernels",
		"github.com/ebitengine/purego",
	} {
		if pkg == p || strings.HasPrefix(pkg, p+"/") {
			return true
		}
	}
	return false
}

func TestCUDAPackageMatches(t *testing.T) {
	for pkg, want := range map[string]bool{
		"github.com/kvplug/kvplug/core/cuda":            true,
		"github.com/kvplug/kvplug/core/attn":            true,
		"github.com/kvplug/kvplug/core/attn/attnref":    true,
		"github.com/kvplug/kvplug/kernels":              true,
		"github.com/ebitengine/purego/internal/fakecgo": true,
		"github.com/kvplug/kvplug/core/cascade":         false,
		"github.com/kvplug/kvplug/core/cudaless":        false,
	} {
		if got := cudaPackage(pkg); got != want {
			t.Errorf("cudaPackage(%s) = %v, want %v", pkg, got, want)
		}
	}
}
