package main

import (
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
)

func goodKVLayers() hookKVLayers {
	return hookKVLayers{numLayers: 2, numBlocks: 4, k: []uint64{0x10000, 0x20000}, v: []uint64{0x30000, 0x40000},
		blockBytes: 64, kBlockStride: 64, vBlockStride: 64}
}

// Every bad argument of kvp_tier_copier_create is refused with its status
// and creates no handle; these checks come before any CUDA call, so they
// hold on machines without a GPU.
func TestTierCopierCreateRefusals(t *testing.T) {
	lockThread(t)
	before := liveHandles(t)
	for name, tc := range map[string]struct {
		edit      func(l *hookKVLayers)
		host      bool
		slotBytes int64
		slots     int32
		want      kverr.Code
	}{
		"null host":         {func(l *hookKVLayers) {}, false, 256, 4, kverr.NullPointer},
		"null k":            {func(l *hookKVLayers) { l.nullK = true }, true, 256, 4, kverr.NullPointer},
		"struct size":       {func(l *hookKVLayers) { l.structSize = 8 }, true, 256, 4, kverr.StructSize},
		"no layers":         {func(l *hookKVLayers) { l.numLayers = 0 }, true, 256, 4, kverr.InvalidArgument},
		"too many layers":   {func(l *hookKVLayers) { l.numLayers = 1025 }, true, 256, 4, kverr.InvalidArgument},
		"block bytes":       {func(l *hookKVLayers) { l.blockBytes = 24 }, true, 256, 4, kverr.InvalidArgument},
		"stride":            {func(l *hookKVLayers) { l.vBlockStride = 32 }, true, 256, 4, kverr.InvalidArgument},
		"unaligned address": {func(l *hookKVLayers) { l.k[1] = 0x20008 }, true, 256, 4, kverr.InvalidArgument},
		"zero address":      {func(l *hookKVLayers) { l.v[0] = 0 }, true, 256, 4, kverr.InvalidArgument},
		"slot too small":    {func(l *hookKVLayers) {}, true, 240, 4, kverr.InvalidArgument},
		"no slots":          {func(l *hookKVLayers) {}, true, 256, 0, kverr.InvalidArgument},
		"no blocks":         {func(l *hookKVLayers) { l.numBlocks = 0 }, true, 256, 4, kverr.InvalidArgument},
		"unknown flag":      {func(l *hookKVLayers) { l.flags = 2 }, true, 256, 4, kverr.InvalidArgument},
		"reserved":          {func(l *hookKVLayers) { l.reserved = 1 }, true, 256, 4, kverr.InvalidArgument},
	} {
		l := goodKVLayers()
		tc.edit(&l)
		h, st := hookTierCopierCreate(l, tc.host, tc.slotBytes, tc.slots)
		if abiStatus(st) != abiStatus(tc.want) || h != nil {
			t.Errorf("%s: status %d (%s), handle %p; want %d and no handle", name, st, lastError(), h, tc.want)
		}
	}
	if got := liveHandles(t); got != before {
		t.Fatalf("live handles %d -> %d: a refused create left a handle", before, got)
	}
	// A good layout: a copier where a GPU is, a clear refusal where none is.
	h, st := hookTierCopierCreate(goodKVLayers(), true, 256, 4)
	if cuda.Available() {
		expect(t, "create", st, kverr.OK)
		expect(t, "run out of range", hookTierCopierRun(h, [][2]int32{{4, 0}}, 1, nil, 0), kverr.InvalidArgument)
		expect(t, "run null", hookTierCopierRun(h, nil, 1, nil, 0), kverr.NullPointer)
		expect(t, "run count", hookTierCopierRun(h, nil, -1, nil, 0), kverr.InvalidArgument)
		expect(t, "run nothing", hookTierCopierRun(h, nil, 0, nil, 0), kverr.OK)
		hookTierCopierDestroy(h)
	} else if h != nil || (st != abiStatus(kverr.NoDevice) && st != abiStatus(kverr.Unsupported)) {
		t.Fatalf("create without a GPU: status %d (%s), handle %p", st, lastError(), h)
	}
	// Stores by the copy engines: where a GPU is, a copier whose demotions
	// the legacy default stream (the hook's NULL stream) refuses with
	// nothing enqueued, and whose reloads it takes; where none is, the
	// good layout's refusal. A 56-byte (0.3) struct has no flags: the kernel.
	ce := goodKVLayers()
	ce.flags = hookTierCopyStoreCopyEngine
	h2, st := hookTierCopierCreate(ce, true, 256, 4)
	if cuda.Available() && cuda.BatchCopySupported() == nil {
		expect(t, "create (copy engine)", st, kverr.OK)
		expect(t, "copy-engine stores on the legacy stream", hookTierCopierRun(h2, [][2]int32{{1, 1}}, 1, nil, 0), kverr.InvalidArgument)
		expect(t, "copy-engine copier's reloads", hookTierCopierRun(h2, nil, 0, [][2]int32{{1, 1}}, 1), kverr.OK)
		hookTierCopierDestroy(h2)
	} else if h2 != nil || (st != abiStatus(kverr.NoDevice) && st != abiStatus(kverr.Unsupported)) {
		t.Fatalf("create (copy engine) without a usable GPU: status %d (%s), handle %p", st, lastError(), h2)
	}
	old := goodKVLayers()
	old.structSize, old.flags = 56, 7 // past the caller's struct: never read
	h3, st := hookTierCopierCreate(old, true, 256, 4)
	if cuda.Available() {
		expect(t, "create (56-byte struct)", st, kverr.OK)
		hookTierCopierDestroy(h3)
	} else if h3 != nil || (st != abiStatus(kverr.NoDevice) && st != abiStatus(kverr.Unsupported)) {
		t.Fatalf("create (56-byte struct) without a GPU: status %d (%s), handle %p", st, lastError(), h3)
	}
	expect(t, "run on NULL", hookTierCopierRun(nil, nil, 0, nil, 0), kverr.InvalidHandle)
	expect(t, "run on a destroyed copier", hookTierCopierRun(h, nil, 0, nil, 0), kverr.InvalidHandle)
	hookTierCopierDestroy(nil)
	hookTierCopierDestroy(unsafe.Pointer(h))
}
