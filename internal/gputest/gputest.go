// Package gputest decides, for the Go tests that need a CUDA device,
// whether to run, skip or fail. A test skips only on a machine that has no
// NVIDIA device at all; a machine with one whose driver or device cannot be
// used fails the test, since a skip there would hide the breakage behind a
// green run. With KVPLUG_REQUIRE_GPU=1 in the environment (as on the GPU
// machine) every skip is a failure instead, so a run that was meant to
// exercise the kernels cannot pass without them.
package gputest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvplug/kvplug/core/cuda"
)

// RequireEnv names the environment variable that turns every GPU skip into
// a failure when it is set to 1.
const RequireEnv = "KVPLUG_REQUIRE_GPU"

// ErrAbsent is wrapped by Probe's error when the machine has no NVIDIA
// device: the one case in which a GPU test may skip.
var ErrAbsent = errors.New("no NVIDIA device on this machine")

// Required reports whether KVPLUG_REQUIRE_GPU=1 is set.
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// DeviceNodes lists the device files through which a GPU is reached:
// /dev/nvidiaN per NVIDIA GPU, /dev/dxg under WSL. /dev/nvidiactl and
// /dev/nvidia-uvm are left out; they exist wherever the kernel module is
// loaded, GPU or not.
func DeviceNodes() []string {
	nodes, _ := filepath.Glob("/dev/nvidia[0-9]*")
	if _, err := os.Stat("/dev/dxg"); err == nil {
		nodes = append(nodes, "/dev/dxg")
	}
	return nodes
}

// Probe loads the CUDA driver and counts the devices. It returns nil when a
// device can be used, an error wrapping ErrAbsent when the machine has no
// NVIDIA device node and the driver is missing, fails to start or reports
// no device, and any other error when something is broken: a device node
// the driver cannot reach, or a driver call that fails after it loaded.
func Probe() error {
	return classify(DeviceNodes(), cuda.Load, cuda.DeviceCount)
}

// classify is Probe's decision, given the device nodes and the driver's
// entry points.
func classify(nodes []string, load func() error, count func() (int, error)) error {
	if err := load(); err != nil {
		if len(nodes) == 0 {
			return fmt.Errorf("%w (no /dev/nvidiaN; %v)", ErrAbsent, err)
		}
		return fmt.Errorf("%v exist but the CUDA driver cannot be used: %w", nodes, err)
	}
	n, err := count()
	switch {
	case err != nil:
		return fmt.Errorf("the CUDA driver loaded but cannot count its devices: %w", err)
	case n > 0:
		return nil
	case len(nodes) == 0:
		return fmt.Errorf("%w (the CUDA driver reports none)", ErrAbsent)
	}
	return fmt.Errorf("the CUDA driver reports no device, yet %v exist", nodes)
}

// Need returns when a CUDA device can be used. It skips t when the machine
// has none (unless KVPLUG_REQUIRE_GPU=1) and fails it on any other error.
func Need(t testing.TB) {
	t.Helper()
	err := Probe()
	if err == nil {
		return
	}
	if errors.Is(err, ErrAbsent) {
		Skip(t, err.Error())
	}
	t.Fatal(err)
}

// Skip skips t for a reason that only a GPU test has (no device, a device
// of another architecture), or fails it under KVPLUG_REQUIRE_GPU=1.
func Skip(t testing.TB, reason string) {
	t.Helper()
	if Required() {
		t.Fatalf("%s=1, but this GPU test would skip: %s", RequireEnv, reason)
	}
	t.Skip(reason)
}
