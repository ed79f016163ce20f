//go:build linux

package vmem

import (
	"os"
	"testing"
)

func TestHostDriverMapsRealMemory(t *testing.T) {
	pg := os.Getpagesize()
	h, err := NewHost(2 * pg)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	size := 4 * h.Granularity()
	base, err := h.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	if base%uintptr(h.Granularity()) != 0 {
		t.Fatalf("reservation %#x not aligned to %d", base, h.Granularity())
	}
	p, err := h.CreatePage(h.Granularity())
	if err != nil {
		t.Fatal(err)
	}
	g := h.Granularity()
	if err := h.Map(base+uintptr(g), g, p); err != nil {
		t.Fatal(err)
	}
	if err := h.SetAccess(base+uintptr(g), g); err != nil {
		t.Fatal(err)
	}
	b := Bytes(base+uintptr(g), g)
	for i := range b {
		b[i] = byte(i * 7)
	}
	// The page keeps its contents when unmapped and mapped elsewhere.
	if err := h.Unmap(base+uintptr(g), g); err != nil {
		t.Fatal(err)
	}
	if err := h.Map(base+uintptr(3*g), g, p); err != nil {
		t.Fatal(err)
	}
	if err := h.SetAccess(base+uintptr(3*g), g); err != nil {
		t.Fatal(err)
	}
	b = Bytes(base+uintptr(3*g), g)
	for i := range b {
		if b[i] != byte(i*7) {
			t.Fatalf("byte %d after remap: got %d, want %d", i, b[i], byte(i*7))
		}
	}
	if err := h.Unmap(base+uintptr(3*g), g); err != nil {
		t.Fatal(err)
	}
	if err := h.ReleasePage(p); err != nil {
		t.Fatal(err)
	}
	if err := h.ReleasePage(p); err == nil {
		t.Fatal("second release of a page succeeded")
	}
	// A released page's offset is reused, zeroed.
	q, err := h.CreatePage(g)
	if err != nil {
		t.Fatal(err)
	}
	if q != p {
		t.Fatalf("released offset %#x not reused: got %#x", p, q)
	}
	if err := h.Map(base, g, q); err != nil {
		t.Fatal(err)
	}
	if err := h.SetAccess(base, g); err != nil {
		t.Fatal(err)
	}
	for i, v := range Bytes(base, g) {
		if v != 0 {
			t.Fatalf("recycled page byte %d is %d, want 0", i, v)
		}
	}
	if err := h.Unmap(base, g); err != nil {
		t.Fatal(err)
	}
	if err := h.ReleasePage(q); err != nil {
		t.Fatal(err)
	}
	if err := h.FreeReservation(base, size); err != nil {
		t.Fatal(err)
	}
	if n := h.LivePages(); n != 0 {
		t.Fatalf("live pages after release: %d", n)
	}
}

func TestHostDriverRejectsMisalignedRanges(t *testing.T) {
	h, err := NewHost(0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	g := h.Granularity()
	if _, err := NewHost(g + 1); err == nil {
		t.Fatal("granularity not a multiple of the OS page accepted")
	}
	if _, err := h.Reserve(g + 1); err == nil {
		t.Fatal("misaligned reserve accepted")
	}
	if _, err := h.CreatePage(0); err == nil {
		t.Fatal("zero-size page accepted")
	}
	if err := h.Map(uintptr(g), g, Page(12345)); err == nil {
		t.Fatal("map of a page that does not exist accepted")
	}
	if err := h.Unmap(1, g); err == nil {
		t.Fatal("misaligned unmap accepted")
	}
}
