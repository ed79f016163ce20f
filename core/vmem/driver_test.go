package vmem

import "testing"

// Steps of the driver tests (Host and CUDA alike) that fail the test on an
// error.

// newPage creates a page of size bytes.
func newPage(t *testing.T, d Driver, size int) Page {
	t.Helper()
	p, err := d.CreatePage(size)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// mapPage maps p at [addr, addr+size) and makes the range accessible.
func mapPage(t *testing.T, d Driver, addr uintptr, size int, p Page) {
	t.Helper()
	if err := d.Map(addr, size, p); err != nil {
		t.Fatal(err)
	}
	if err := d.SetAccess(addr, size); err != nil {
		t.Fatal(err)
	}
}

// unmap unmaps [addr, addr+size).
func unmap(t *testing.T, d Driver, addr uintptr, size int) {
	t.Helper()
	if err := d.Unmap(addr, size); err != nil {
		t.Fatal(err)
	}
}
