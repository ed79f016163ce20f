package kimage

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/kernels"
)

func TestImageDataOverride(t *testing.T) {
	t.Setenv(OverrideEnv, "")
	if b, err := imageData(); err != nil || !bytes.Equal(b, kernels.Fatbin()) {
		t.Fatalf("unset: %d bytes, %v; want the embedded %d", len(b), err, len(kernels.Fatbin()))
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "variant.cubin")
	want := []byte("a variant image")
	if err := os.WriteFile(img, want, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(OverrideEnv, img)
	if b, err := imageData(); err != nil || !bytes.Equal(b, append(want, 0)) {
		t.Fatalf("override: %q, %v; want the file's bytes and a NUL", b, err)
	}
	t.Setenv(OverrideEnv, filepath.Join(dir, "missing.cubin"))
	if _, err := imageData(); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("missing file: %v", err)
	}
	empty := filepath.Join(dir, "empty.cubin")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(OverrideEnv, empty)
	if _, err := imageData(); !kverr.Is(err, kverr.InvalidArgument) {
		t.Fatalf("empty file: %v", err)
	}
}
