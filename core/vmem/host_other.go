//go:build !linux

package vmem

import "github.com/kvplug/kvplug/core/kverr"

// Host is the host-memory driver; it needs Linux (memfd_create, MAP_FIXED).
type Host struct{}

var errHostUnsupported = kverr.Errorf(kverr.Unsupported, "the host vmem driver needs Linux")

// NewHost fails on this platform.
func NewHost(granularity int) (*Host, error) { return nil, errHostUnsupported }

func (h *Host) Granularity() int                             { return 0 }
func (h *Host) Reserve(size int) (uintptr, error)            { return 0, errHostUnsupported }
func (h *Host) FreeReservation(base uintptr, size int) error { return errHostUnsupported }
func (h *Host) CreatePage(size int) (Page, error)            { return 0, errHostUnsupported }
func (h *Host) ReleasePage(p Page) error                     { return errHostUnsupported }
func (h *Host) Map(addr uintptr, size int, p Page) error     { return errHostUnsupported }
func (h *Host) MapRange(addr uintptr, pageSize int, pages []Page) error {
	return errHostUnsupported
}
func (h *Host) SetAccess(addr uintptr, size int) error { return errHostUnsupported }
func (h *Host) Unmap(addr uintptr, size int) error     { return errHostUnsupported }
func (h *Host) Close() error                           { return nil }
func (h *Host) LivePages() int                         { return 0 }
func (h *Host) Mappings() int                          { return 0 }
