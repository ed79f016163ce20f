// Package hoststore is the standalone host store (include/kvplug.h,
// "standalone host store"): a host.Pool of its own, driven by key through
// the pool's batched calls (core/kvtier/host/keyed.go), for engines that
// keep their own GPU block manager, with the slots' memory and the copies
// between it and the caller's buffers.
//
// It is a package of its own, not part of package host, because package
// host is bookkeeping only and memory-agnostic (it never copies block
// data); a Store owns its memory, copies into and out of it from pointers
// into the caller's memory, and keeps that memory alive while a copy runs.
//
// Lifetime: Write and Read hold the store's lock shared from their slots'
// check to the end of their copies, Reset and Close hold it exclusively. A
// reset so waits for the copies that checked a slot before it, and a close
// on another thread never releases the memory under one; a copy that starts
// after the close fails with InvalidHandle.
package hoststore

import (
	"sync"
	"unsafe"

	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/limits"
	"github.com/kvplug/kvplug/internal/kverr"
)

// Memory is the slots' memory of a store with SlotBytes > 0: Alloc is
// called once, by New, and Release once, by Close (or by New when it
// fails). The C ABI allocates it with calloc, since the caller keeps the
// region's address (kvp_host_store_memory) and C may not keep a Go
// pointer; allocating it there keeps this package free of cgo, and its
// tests on Go memory.
type Memory interface {
	Alloc(size int) ([]byte, error)
	Release()
}

// Config sizes a store.
type Config struct {
	Slots int // in [1, limits.TierSlots]
	// SlotBytes is one slot's size, >= 0 with Slots*SlotBytes <=
	// limits.TierBytes; 0 makes a store that is bookkeeping only: it has
	// no memory and refuses Write and Read (the engine owns the memory
	// and indexes it by slot).
	SlotBytes int
	Memory    Memory // the slots' memory when SlotBytes > 0; nil: Go memory
}

// Store is a standalone host store. See the package comment.
type Store struct {
	pool      *host.Pool
	memory    Memory // nil: Go memory, or none
	slotBytes int
	slots     int
	copying   sync.RWMutex
	mem       []byte // under copying; nil without memory or once closed
	destroyed bool   // under copying: a call that got the store before its Close finds it gone
}

// New makes a store, all slots free. host.New refuses a size out of
// range (InvalidArgument).
func New(cfg Config) (*Store, error) {
	pc := host.Config{Slots: cfg.Slots, BlockBytes: cfg.SlotBytes}
	mem := cfg.Memory
	if cfg.SlotBytes == 0 {
		// Bookkeeping only: the pool needs a size; one Go byte per slot.
		pc.BlockBytes, mem = 1, nil
	} else if mem != nil {
		pc.Alloc = poolMemory{mem}
	}
	p, err := host.New(pc)
	if err != nil {
		if mem != nil {
			mem.Release()
		}
		return nil, err
	}
	s := &Store{pool: p, memory: mem, slotBytes: cfg.SlotBytes, slots: cfg.Slots}
	if cfg.SlotBytes > 0 {
		s.mem = p.Memory()[:cfg.Slots*cfg.SlotBytes]
	}
	return s, nil
}

// poolMemory hands a Memory to the pool as its Allocator: the pool's Free
// does nothing, the store releases the memory itself once the pool is
// closed (Close).
type poolMemory struct{ m Memory }

func (a poolMemory) Alloc(size int) ([]byte, error) { return a.m.Alloc(size) }

func (poolMemory) Free([]byte) error { return nil }

// Close drops every block and releases the memory, once any Write or Read
// running on another thread has finished; later Writes, Reads and Resets
// fail with InvalidHandle, and the keyed calls find the pool closed. The
// caller guarantees that no device copy still uses the memory.
func (s *Store) Close() {
	s.copying.Lock()
	defer s.copying.Unlock()
	if s.destroyed {
		return
	}
	s.destroyed = true
	s.pool.Reset()
	_ = s.pool.Close() // nothing is pinned after the reset: it cannot refuse
	if s.memory != nil {
		s.memory.Release()
	}
	s.mem = nil
}

// Reset drops every block, pending and pinned ones included, once any
// Write or Read running on another thread has finished, and returns how
// many slots it freed (host.Pool.Reset). The caller guarantees that no
// device copy still uses the slots.
func (s *Store) Reset() (int, error) {
	s.copying.Lock()
	defer s.copying.Unlock()
	if s.destroyed {
		return 0, kverr.Errorf(kverr.InvalidHandle, "the store was destroyed during the call")
	}
	return s.pool.Reset(), nil
}

// Memory returns the slots' memory, slot s at s*SlotBytes; nil without
// memory or once closed.
func (s *Store) Memory() []byte {
	s.copying.RLock()
	defer s.copying.RUnlock()
	return s.mem
}

// SlotBytes returns one slot's size (0 without memory).
func (s *Store) SlotBytes() int { return s.slotBytes }

// Slots returns the number of slots.
func (s *Store) Slots() int { return s.slots }

// The calls by key are the pool's (host.Pool, keyed.go): they change the
// bookkeeping only, never the memory, so they do not wait for copies.

// State is host.Pool.State.
func (s *Store) State(key uint64) (host.Slot, host.SlotState) { return s.pool.State(key) }

// Lookup is host.Pool.Lookup.
func (s *Store) Lookup(keys []uint64) int { return s.pool.Lookup(keys) }

// ReserveKeys is host.Pool.ReserveKeys.
func (s *Store) ReserveKeys(keys []uint64, slots []host.Slot, evicted []uint64) (int, error) {
	return s.pool.ReserveKeys(keys, slots, evicted)
}

// CompleteKeys is host.Pool.CompleteKeys.
func (s *Store) CompleteKeys(keys []uint64, failed bool) int {
	return s.pool.CompleteKeys(keys, failed)
}

// PinKeys is host.Pool.PinKeys.
func (s *Store) PinKeys(keys []uint64, slots []host.Slot) (int, error) {
	return s.pool.PinKeys(keys, slots)
}

// UnpinKeys is host.Pool.UnpinKeys.
func (s *Store) UnpinKeys(keys []uint64) int { return s.pool.UnpinKeys(keys) }

// TouchKeys is host.Pool.TouchKeys.
func (s *Store) TouchKeys(keys []uint64) { s.pool.TouchKeys(keys) }

// Stats is host.Pool.Stats.
func (s *Store) Stats() host.Stats { return s.pool.Stats() }

// MaxSegments bounds Segments.Per, the segments of one key (the C ABI's
// segs, for both standalone stores): with every length at most
// limits.TierBytes, a key's total cannot overflow.
const MaxSegments = 4096

// Segments is a scatter list in the caller's memory, Per segments a key:
// key i's bytes are the concatenation of Ptrs[i*Per+j], Lens[i*Per+j]
// bytes each, for j from 0 to Per-1. The pointers are the caller's (C
// memory at the ABI); they must stay valid for the call.
type Segments struct {
	Per  int
	Ptrs []unsafe.Pointer
	Lens []int64
}

// Check checks the segments key by key, in order: every length in [0,
// limits.TierBytes], a pointer for every length above 0 and, when total
// >= 0, lengths that add up to total. Errors name the segments by their
// index in Ptrs and Lens (the C ABI's ptrs and lens).
func (g Segments) Check(total int64) error {
	if g.Per < 1 || g.Per > MaxSegments || len(g.Ptrs) != len(g.Lens) || len(g.Lens)%g.Per != 0 {
		return kverr.Errorf(kverr.InvalidArgument, "%d pointers and %d lengths in segments of %d a key", len(g.Ptrs), len(g.Lens), g.Per)
	}
	for i := 0; i < len(g.Lens)/g.Per; i++ {
		sum := int64(0)
		for j := i * g.Per; j < (i+1)*g.Per; j++ {
			l := g.Lens[j]
			if l < 0 || l > limits.TierBytes {
				return kverr.Errorf(kverr.InvalidArgument, "lens[%d] is %d", j, l)
			}
			if l > 0 && g.Ptrs[j] == nil {
				return kverr.Errorf(kverr.NullPointer, "ptrs[%d] is NULL with a length of %d", j, l)
			}
			sum += l
		}
		if total >= 0 && sum != total {
			return kverr.Errorf(kverr.InvalidArgument, "key %d's segments total %d bytes, not the slot's %d", i, sum, total)
		}
	}
	return nil
}

// Batch is one Write or Read: slot Slots[i] and key i's segments.
type Batch struct {
	Slots []host.Slot
	Segments
}

// Write copies each key's segments into its slot, which must be pending
// (reserved and not completed). Read copies each slot, which must be
// resident (and pinned by the caller, so that no reserve evicts it), out
// to its key's segments. Everything is checked before anything is copied,
// in this order: the store is open (InvalidHandle) and has memory
// (Unsupported); batch, called then, converts the caller's arguments and
// may fail; the segments (Segments.Check, each key's totalling SlotBytes);
// the slots' range (InvalidArgument) and state (NotFound). Errors are
// prefixed with op, the call's name, as batch's own are: the order and the
// messages are the C ABI's (kvp_host_store_write and _read), which calls
// batch under the lock so that its checks come after the store's.
func (s *Store) Write(op string, batch func() (Batch, error)) error {
	return s.copyBatch(op, batch, true)
}

// Read is the converse of Write. See Write.
func (s *Store) Read(op string, batch func() (Batch, error)) error {
	return s.copyBatch(op, batch, false)
}

// copyChunk bounds one copy call: a copy in the runtime's memmove cannot be
// preempted, so a slot of gigabytes copied in one call would hold up a
// garbage collection's stop of the world for its whole length.
const copyChunk = 1 << 20

func (s *Store) copyBatch(op string, batch func() (Batch, error), in bool) error {
	s.copying.RLock()
	defer s.copying.RUnlock()
	if s.destroyed {
		return kverr.Errorf(kverr.InvalidHandle, "%s: the store was destroyed during the call", op)
	}
	if s.mem == nil {
		return kverr.Errorf(kverr.Unsupported, "%s: the store has no memory (slot_bytes 0)", op)
	}
	b, err := batch()
	if err != nil {
		return err
	}
	if err := b.Check(int64(s.slotBytes)); err != nil {
		return kverr.Wrap(kverr.CodeOf(err), err, "%s", op)
	}
	if len(b.Slots)*b.Per != len(b.Lens) {
		return kverr.Errorf(kverr.InvalidArgument, "%s: %d slots for the segments of %d keys", op, len(b.Slots), len(b.Lens)/b.Per)
	}
	want := host.Resident
	if in {
		want = host.Pending
	}
	for i, sl := range b.Slots {
		if sl < 0 || int(sl) >= s.slots {
			return kverr.Errorf(kverr.InvalidArgument, "%s: slots[%d] = %d is out of range [0, %d)", op, i, sl, s.slots)
		}
		k, ok := s.pool.Hash(sl)
		if _, state := s.pool.State(k); !ok || state != want {
			what := "resident"
			if in {
				what = "pending (reserved and not completed)"
			}
			return kverr.Errorf(kverr.NotFound, "%s: slot %d is not %s", op, sl, what)
		}
	}
	for i, sl := range b.Slots {
		off := int(sl) * s.slotBytes
		for j := i * b.Per; j < (i+1)*b.Per; j++ {
			l := int(b.Lens[j])
			if l == 0 {
				continue
			}
			slot, user := s.mem[off:off+l], unsafe.Slice((*byte)(b.Ptrs[j]), l)
			for c := 0; c < l; c += copyChunk {
				e := min(c+copyChunk, l)
				if in {
					copy(slot[c:e], user[c:e])
				} else {
					copy(user[c:e], slot[c:e])
				}
			}
			off += l
		}
	}
	return nil
}
