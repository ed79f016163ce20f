package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/limits"
)

const managerName = "kvp_manager"

func managerOf(h *C.kvp_manager) (*kvmanager.Manager, error) {
	return lookup[*kvmanager.Manager](unsafe.Pointer(h), managerName)
}

// onManager is an export on a kvp_manager handle (onHandle).
func onManager(h *C.kvp_manager, f func(*kvmanager.Manager) error) C.kvp_status {
	return onHandle(unsafe.Pointer(h), managerName, f)
}

//export kvpgo_manager_create
func kvpgo_manager_create(cfg *C.kvp_manager_config, out **C.kvp_manager) C.kvp_status {
	return createHandle("kvp_manager_create", cfg, unsafe.Pointer(out), managerConfigStruct, func(c *C.kvp_manager_config) (any, error) {
		// The shared tier's fields are checked before the host tier's memory
		// is allocated.
		shared, err := sharedTierOf(c)
		if err != nil {
			return nil, err
		}
		ht, err := hostTierOf(c)
		if err != nil {
			return nil, err
		}
		if ht != nil {
			ht.Shared = shared
		}
		groups, err := layerGroupsOf(c)
		if err != nil {
			return nil, err
		}
		m, err := kvmanager.New(kvmanager.Config{
			NumBlocks:         int(c.num_blocks),
			BlockSize:         int(c.block_size),
			EnablePrefixCache: c.enable_prefix_cache != 0,
			EnableKVEvents:    c.enable_kv_events != 0,
			MaxPendingEvents:  int(c.max_pending_events),
			HostTier:          ht,
			Groups:            groups,
			BlockBytes:        int64(c.block_bytes),
			MaxModelLen:       int(c.max_model_len),
		})
		if err != nil {
			return nil, err
		}
		return m, nil
	})
}

//export kvpgo_manager_destroy
func kvpgo_manager_destroy(h *C.kvp_manager) {
	// Only a live kvp_manager is dropped: another object's handle (a
	// kvp_vcache, say) stays registered and alive. Close writes the shared
	// tier's queued stores (bounded) and releases the host tier's memory.
	destroy(unsafe.Pointer(h), func(m *kvmanager.Manager) { _ = m.Close() })
}

//export kvpgo_manager_add
func kvpgo_manager_add(h *C.kvp_manager, id C.int64_t, promptLen C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		return m.Add(int64(id), int(promptLen))
	})
}

//export kvpgo_manager_grow
func kvpgo_manager_grow(h *C.kvp_manager, ids *C.int64_t, counts *C.int32_t, n C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := batchOf("kvp_manager_grow", n, ids == nil || counts == nil, "seq_ids and num_tokens"); err != nil {
			return err
		}
		return m.Grow(slice[int64](unsafe.Pointer(ids), n), slice[int32](unsafe.Pointer(counts), n))
	})
}

//export kvpgo_manager_fork
func kvpgo_manager_fork(h *C.kvp_manager, parent C.int64_t, children *C.int64_t, n C.int32_t,
	copies *C.kvp_block_copy, maxCopies C.int32_t, numCopies *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := batchOf("kvp_manager_fork", n, children == nil || numCopies == nil, "children and num_copies"); err != nil {
			return err
		}
		if maxCopies < 0 {
			return kverr.Errorf(kverr.InvalidArgument, "kvp_manager_fork: max_copies must be >= 0: got %d", int32(maxCopies))
		}
		if maxCopies > 0 && copies == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_fork: copies is NULL with max_copies %d", int32(maxCopies))
		}
		// kvp_block_copy and kvmanager.CopyPair are both two int32s.
		pairs := slice[kvmanager.CopyPair](unsafe.Pointer(copies), maxCopies)
		k, err := m.Fork(int64(parent), slice[int64](unsafe.Pointer(children), n), pairs)
		if err != nil {
			return err
		}
		*numCopies = C.int32_t(k)
		return nil
	})
}

//export kvpgo_manager_remove
func kvpgo_manager_remove(h *C.kvp_manager, ids *C.int64_t, n C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := batchOf("kvp_manager_remove", n, ids == nil, "seq_ids"); err != nil {
			return err
		}
		return m.Remove(slice[int64](unsafe.Pointer(ids), n))
	})
}

//export kvpgo_manager_mark_computed
func kvpgo_manager_mark_computed(h *C.kvp_manager) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		m.MarkComputed()
		return nil
	})
}

//export kvpgo_manager_describe
func kvpgo_manager_describe(h *C.kvp_manager, ids *C.int64_t, n C.int32_t,
	table *C.int32_t, maxBlocks C.int32_t, seqLens *C.int32_t,
	slots *C.int32_t, slotCap C.int32_t, numSlots *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := batchOf("kvp_manager_describe", n, ids == nil || numSlots == nil, "seq_ids and num_slots"); err != nil {
			return err
		}
		if table != nil && (maxBlocks < 1 || int64(maxBlocks)*int64(n) > 1<<31-1) {
			return kverr.Errorf(kverr.InvalidArgument, "kvp_manager_describe: max_blocks must be in [1, 2^31/n] with a block_table: got %d", int32(maxBlocks))
		}
		if slotCap < 0 {
			return kverr.Errorf(kverr.InvalidArgument, "kvp_manager_describe: slot_capacity must be >= 0: got %d", int32(slotCap))
		}
		var tbl []int32
		if table != nil {
			tbl = unsafe.Slice((*int32)(unsafe.Pointer(table)), int(n)*int(maxBlocks))
		}
		var slotBuf []int32
		if slots != nil {
			// A zero-length, non-nil view tells the core that slots are wanted.
			slotBuf = unsafe.Slice((*int32)(unsafe.Pointer(slots)), int(slotCap))
		}
		k, err := m.Describe(slice[int64](unsafe.Pointer(ids), n), int(maxBlocks), tbl,
			slice[int32](unsafe.Pointer(seqLens), n), slotBuf)
		if err != nil {
			return err
		}
		*numSlots = C.int32_t(k)
		return nil
	})
}

// layerGroupsOf translates the config's layer groups (kvmanager checks
// them).
func layerGroupsOf(c *C.kvp_manager_config) ([]kvmanager.Group, error) {
	n := c.num_layer_groups
	if n < 0 || n > limits.LayerGroups || (n == 0) != (c.layer_groups == nil) {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config: num_layer_groups must be in [1, %d] with layer_groups and 0 without: got %d (layer_groups %p)",
			limits.LayerGroups, int32(n), c.layer_groups)
	}
	src := slice[C.kvp_layer_group](unsafe.Pointer(c.layer_groups), n)
	groups := make([]kvmanager.Group, len(src))
	for i, g := range src {
		if g.kind < 0 || g.kind > 255 {
			return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config: layer group %d: unknown kind %d", i, int32(g.kind))
		}
		if g.reserved != 0 {
			return nil, kverr.Errorf(kverr.InvalidArgument, "kvp_manager_config: layer group %d: reserved must be 0: got %d", i, int32(g.reserved))
		}
		groups[i] = kvmanager.Group{Kind: kvmanager.GroupKind(g.kind), Window: int(g.window), StateBytes: int64(g.state_bytes),
			CheckpointEvery: int(g.checkpoint_every)}
	}
	return groups, nil
}

//export kvpgo_manager_describe_groups
func kvpgo_manager_describe_groups(h *C.kvp_manager, ids *C.int64_t, n C.int32_t, numGroups C.int32_t,
	tables **C.int32_t, maxBlocks C.int32_t, seqLens *C.int32_t,
	slots **C.int32_t, slotCap C.int32_t, numSlots *C.int32_t) C.kvp_status {
	const op = "kvp_manager_describe_groups"
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := batchOf(op, n, ids == nil || numSlots == nil, "seq_ids and num_slots"); err != nil {
			return err
		}
		if int(numGroups) != m.NumGroups() {
			return kverr.Errorf(kverr.InvalidArgument, "%s: num_groups is %d, the manager has %d layer groups", op, int32(numGroups), m.NumGroups())
		}
		if tables != nil && (maxBlocks < 1 || int64(maxBlocks)*int64(n) > 1<<31-1) {
			return kverr.Errorf(kverr.InvalidArgument, "%s: max_blocks must be in [1, 2^31/n] with block_tables: got %d", op, int32(maxBlocks))
		}
		if slotCap < 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: slot_capacity must be >= 0: got %d", op, int32(slotCap))
		}
		var tbls, sls [][]int32
		if tables != nil {
			tbls = make([][]int32, numGroups)
			for g, p := range slice[*C.int32_t](unsafe.Pointer(tables), numGroups) {
				tbls[g] = slice[int32](unsafe.Pointer(p), n*maxBlocks)
			}
		}
		if slots != nil {
			sls = make([][]int32, numGroups)
			for g, p := range slice[*C.int32_t](unsafe.Pointer(slots), numGroups) {
				if p != nil {
					// A zero-length, non-nil view tells the core that slots are wanted.
					sls[g] = unsafe.Slice((*int32)(unsafe.Pointer(p)), int(slotCap))
				}
			}
		}
		k, err := m.DescribeGroups(slice[int64](unsafe.Pointer(ids), n), int(maxBlocks), tbls,
			slice[int32](unsafe.Pointer(seqLens), n), sls)
		if err != nil {
			return err
		}
		*numSlots = C.int32_t(k)
		return nil
	})
}

// outArrayOf checks an output array out of capacity entries (outNil: it
// is NULL, which only a capacity of 0 allows) and its required count
// pointer (countNil: NULL; count names it).
func outArrayOf(op string, outNil bool, capacity C.int32_t, countNil bool, count string) error {
	if countNil || (outNil && capacity > 0) {
		return kverr.Errorf(kverr.NullPointer, "%s: %s (and out, with a capacity) must not be NULL", op, count)
	}
	if capacity < 0 {
		return kverr.Errorf(kverr.InvalidArgument, "%s: capacity must be >= 0: got %d", op, int32(capacity))
	}
	return nil
}

//export kvpgo_manager_group_blocks
func kvpgo_manager_group_blocks(h *C.kvp_manager, out *C.int32_t, capacity C.int32_t, numGroups *C.int32_t) C.kvp_status {
	const op = "kvp_manager_group_blocks"
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := outArrayOf(op, out == nil, capacity, numGroups == nil, "num_groups"); err != nil {
			return err
		}
		gb := m.GroupBlocks()
		*numGroups = C.int32_t(len(gb))
		if int(capacity) < len(gb) {
			return kverr.Errorf(kverr.BufferTooSmall, "%s: the manager has %d layer groups, out holds %d", op, len(gb), int32(capacity))
		}
		dst := slice[int32](unsafe.Pointer(out), capacity)
		for g, v := range gb {
			dst[g] = int32(v)
		}
		return nil
	})
}

//export kvpgo_manager_take_copies
func kvpgo_manager_take_copies(h *C.kvp_manager, out *C.kvp_block_copy, capacity C.int32_t, numCopies, numLeft *C.int32_t) C.kvp_status {
	const op = "kvp_manager_take_copies"
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := outArrayOf(op, out == nil, capacity, numCopies == nil, "num_copies"); err != nil {
			return err
		}
		// kvp_block_copy is two int32, kvmanager.CopyPair's layout.
		n, left := m.TakeCopies(slice[kvmanager.CopyPair](unsafe.Pointer(out), capacity))
		*numCopies = C.int32_t(n)
		if numLeft != nil {
			*numLeft = C.int32_t(left)
		}
		return nil
	})
}

//export kvpgo_manager_stats_get
func kvpgo_manager_stats_get(h *C.kvp_manager, out *C.kvp_manager_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), managerName, "kvp_manager_stats_get", out, managerStatsStruct, func(m *kvmanager.Manager) (v C.kvp_manager_stats) {
		s := m.Stats()
		v.num_blocks = C.int32_t(s.NumBlocks)
		v.block_size = C.int32_t(s.BlockSize)
		v.free_blocks = C.int32_t(s.FreeBlocks)
		v.used_blocks = C.int32_t(s.UsedBlocks)
		v.peak_used_blocks = C.int32_t(s.PeakUsedBlocks)
		v.cached_blocks = C.int32_t(s.CachedBlocks)
		v.shared_blocks = C.int32_t(s.SharedBlocks)
		v.num_seqs = C.int32_t(s.NumSeqs)
		v.num_tokens = C.int64_t(s.NumTokens)
		v.allocated_slots = C.int64_t(s.AllocatedSlots)
		v.internal_waste = C.int64_t(s.InternalWaste)
		v.fragmentation = C.double(s.Fragmentation)
		return v
	})
}

//export kvpgo_manager_check
func kvpgo_manager_check(h *C.kvp_manager) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if err := m.CheckInvariants(); err != nil {
			return kverr.Wrap(kverr.Internal, err, "kvp_manager_check")
		}
		return nil
	})
}
