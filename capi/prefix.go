package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvmanager"
	"github.com/kvplug/kvplug/core/prefix"
)

// The C structs that the core reads or writes in place must have the
// core's layout; a mismatch fails the build (a negative array length).
var (
	_ [unsafe.Sizeof(C.kvp_mm_item{}) - unsafe.Sizeof(prefix.MMItem{})]struct{}
	_ [unsafe.Sizeof(prefix.MMItem{}) - unsafe.Sizeof(C.kvp_mm_item{})]struct{}
	_ [unsafe.Sizeof(C.kvp_block_mm{}) - unsafe.Sizeof(prefix.BlockMM{})]struct{}
	_ [unsafe.Sizeof(prefix.BlockMM{}) - unsafe.Sizeof(C.kvp_block_mm{})]struct{}
	_ [unsafe.Sizeof(C.kvp_prefix_match{}) - unsafe.Sizeof(kvmanager.MatchInfo{})]struct{}
	_ [unsafe.Sizeof(kvmanager.MatchInfo{}) - unsafe.Sizeof(C.kvp_prefix_match{})]struct{}
	_ [unsafe.Sizeof(C.kvp_block_match{}) - unsafe.Sizeof(kvmanager.BlockMatch{})]struct{}
	_ [unsafe.Sizeof(kvmanager.BlockMatch{}) - unsafe.Sizeof(C.kvp_block_match{})]struct{}
)

// maxMMItems bounds kvp_prefix_keys.num_mm (and num_items of
// kvp_manager_add_mm_items), so that a wrong count is caught before a
// slice is made over the caller's array.
const maxMMItems = prefix.MaxMMItems

// keysOf views one kvp_prefix_keys as prefix.Keys, without copying: the
// result must not outlive the call (the core copies what it keeps).
func keysOf(op string, i int, k *C.kvp_prefix_keys) (prefix.Keys, error) {
	var out prefix.Keys
	if k.num_mm < 0 || k.num_mm > maxMMItems {
		return out, kverr.Errorf(kverr.InvalidArgument, "%s: keys[%d].num_mm must be in [0, 2^20]: got %d", op, i, int32(k.num_mm))
	}
	if k.salt_len < 0 || k.salt_len > prefix.MaxSaltLen {
		return out, kverr.Errorf(kverr.InvalidArgument, "%s: keys[%d].salt_len must be in [0, %d]: got %d", op, i, prefix.MaxSaltLen, int32(k.salt_len))
	}
	if k.num_mm > 0 && k.mm == nil {
		return out, kverr.Errorf(kverr.NullPointer, "%s: keys[%d].mm is NULL with num_mm %d", op, i, int32(k.num_mm))
	}
	if k.salt_len > 0 && k.salt == nil {
		return out, kverr.Errorf(kverr.NullPointer, "%s: keys[%d].salt is NULL with salt_len %d", op, i, int32(k.salt_len))
	}
	out.Adapter = uint64(k.adapter)
	out.MM = slice[prefix.MMItem](unsafe.Pointer(k.mm), k.num_mm)
	out.Salt = slice[byte](unsafe.Pointer(k.salt), k.salt_len)
	return out, nil
}

// promptsOf views a batch of n prompts in the ABI's flat form.
func promptsOf(op string, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t, keys *C.kvp_prefix_keys) (kvmanager.Prompts, error) {
	var p kvmanager.Prompts
	if err := checkCount(n, op+": n"); err != nil {
		return p, err
	}
	if offsets == nil {
		return p, kverr.Errorf(kverr.NullPointer, "%s: token_offsets must not be NULL", op)
	}
	p.Offsets = slice[int64](unsafe.Pointer(offsets), n+1)
	end := p.Offsets[n]
	if end < 0 || end > int64(n)*kvmanager.MaxPromptLen {
		return p, kverr.Errorf(kverr.InvalidArgument, "%s: token_offsets[n] must be in [0, n * 2^30]: got %d", op, end)
	}
	if end > 0 && tokens == nil {
		return p, kverr.Errorf(kverr.NullPointer, "%s: tokens is NULL with token_offsets[n] = %d", op, end)
	}
	if end > 0 {
		p.Tokens = unsafe.Slice((*int32)(unsafe.Pointer(tokens)), end)
	}
	if keys != nil {
		ks := slice[C.kvp_prefix_keys](unsafe.Pointer(keys), n)
		p.Keys = make([]prefix.Keys, n)
		for i := range ks {
			var err error
			if p.Keys[i], err = keysOf(op, i, &ks[i]); err != nil {
				return p, err
			}
		}
	}
	return p, nil
}

// onePrompt views a single prompt and its optional keys.
func onePrompt(op string, tokens *C.int32_t, numTokens C.int32_t, keys *C.kvp_prefix_keys) ([]int32, *prefix.Keys, error) {
	if numTokens < 0 || numTokens > kvmanager.MaxPromptLen {
		return nil, nil, kverr.Errorf(kverr.InvalidArgument, "%s: num_tokens must be in [0, 2^30]: got %d", op, int32(numTokens))
	}
	if numTokens > 0 && tokens == nil {
		return nil, nil, kverr.Errorf(kverr.NullPointer, "%s: tokens is NULL with num_tokens %d", op, int32(numTokens))
	}
	t := slice[int32](unsafe.Pointer(tokens), numTokens)
	if keys == nil {
		return t, nil, nil
	}
	k, err := keysOf(op, 0, keys)
	return t, &k, err
}

//export kvpgo_manager_admit
func kvpgo_manager_admit(h *C.kvp_manager, ids *C.int64_t, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, matched *C.int32_t, numAdmitted *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if ids == nil || numAdmitted == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_admit: seq_ids and num_admitted must not be NULL")
		}
		p, err := promptsOf("kvp_manager_admit", n, tokens, offsets, keys)
		if err != nil {
			return err
		}
		k, err := m.Admit(slice[int64](unsafe.Pointer(ids), n), p, slice[int32](unsafe.Pointer(matched), n))
		if k > 0 || err == nil {
			*numAdmitted = C.int32_t(k)
		}
		return err
	})
}

//export kvpgo_manager_grow_tokens
func kvpgo_manager_grow_tokens(h *C.kvp_manager, ids *C.int64_t, counts *C.int32_t, n C.int32_t, tokens *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if ids == nil || counts == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_grow_tokens: seq_ids and num_tokens must not be NULL")
		}
		if err := checkCount(n, "kvp_manager_grow_tokens: n"); err != nil {
			return err
		}
		c := slice[int32](unsafe.Pointer(counts), n)
		var total int64
		for _, x := range c {
			total += int64(max(x, 0)) // the core rejects negative counts
		}
		if total > 0 && tokens == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_grow_tokens: tokens is NULL with %d new tokens", total)
		}
		t := []int32{}
		if total > 0 {
			t = unsafe.Slice((*int32)(unsafe.Pointer(tokens)), total)
		}
		return m.GrowTokens(slice[int64](unsafe.Pointer(ids), n), c, t)
	})
}

//export kvpgo_manager_add_mm_items
func kvpgo_manager_add_mm_items(h *C.kvp_manager, seqID C.int64_t, items *C.kvp_mm_item, numItems C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if numItems < 0 || numItems > maxMMItems {
			return kverr.Errorf(kverr.InvalidArgument, "kvp_manager_add_mm_items: num_items must be in [0, 2^20]: got %d", int32(numItems))
		}
		if numItems > 0 && items == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_add_mm_items: items is NULL with num_items %d", int32(numItems))
		}
		return m.AddMMItems(int64(seqID), slice[prefix.MMItem](unsafe.Pointer(items), numItems))
	})
}

//export kvpgo_manager_match
func kvpgo_manager_match(h *C.kvp_manager, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, wantPartial C.int32_t, out *C.kvp_prefix_match) C.kvp_status {
	return onPrompts(h, "kvp_manager_match", n, tokens, offsets, keys, unsafe.Pointer(out),
		func(m *kvmanager.Manager, p kvmanager.Prompts, out []kvmanager.MatchInfo) error {
			return m.Match(p, wantPartial != 0, out)
		})
}

//export kvpgo_manager_match_blocks
func kvpgo_manager_match_blocks(h *C.kvp_manager, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, out *C.kvp_block_match) C.kvp_status {
	return onPrompts(h, "kvp_manager_match_blocks", n, tokens, offsets, keys, unsafe.Pointer(out), (*kvmanager.Manager).MatchBlocks)
}

//export kvpgo_manager_match_room
func kvpgo_manager_match_room(h *C.kvp_manager, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, room *C.int32_t) C.kvp_status {
	return onPrompts(h, "kvp_manager_match_room", n, tokens, offsets, keys, unsafe.Pointer(room), (*kvmanager.Manager).MatchRoom)
}

// onPrompts runs a per-prompt query on the manager: the n prompts of
// tokens, offsets and keys, and out viewed as n results of the layout of
// T (which the ABI tests check against the C struct); out NULL is
// NULL_POINTER.
func onPrompts[T any](h *C.kvp_manager, call string, n C.int32_t, tokens *C.int32_t, offsets *C.int64_t,
	keys *C.kvp_prefix_keys, out unsafe.Pointer, f func(*kvmanager.Manager, kvmanager.Prompts, []T) error) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if out == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: out must not be NULL", call)
		}
		p, err := promptsOf(call, n, tokens, offsets, keys)
		if err != nil {
			return err
		}
		return f(m, p, slice[T](out, n))
	})
}

//export kvpgo_manager_pin
func kvpgo_manager_pin(h *C.kvp_manager, tokens *C.int32_t, numTokens C.int32_t, keys *C.kvp_prefix_keys,
	pinID *C.uint64_t, numBlocks *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if pinID == nil {
			return kverr.Errorf(kverr.NullPointer, "kvp_manager_pin: pin_id must not be NULL")
		}
		t, k, err := onePrompt("kvp_manager_pin", tokens, numTokens, keys)
		if err != nil {
			return err
		}
		id, nb, err := m.Pin(t, k)
		if err != nil {
			return err
		}
		*pinID = C.uint64_t(id)
		if numBlocks != nil {
			*numBlocks = C.int32_t(nb)
		}
		return nil
	})
}

//export kvpgo_manager_unpin
func kvpgo_manager_unpin(h *C.kvp_manager, pinID C.uint64_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		return m.Unpin(uint64(pinID))
	})
}

//export kvpgo_manager_set_priority
func kvpgo_manager_set_priority(h *C.kvp_manager, tokens *C.int32_t, numTokens C.int32_t, keys *C.kvp_prefix_keys,
	priority C.int32_t, numBlocks *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		t, k, err := onePrompt("kvp_manager_set_priority", tokens, numTokens, keys)
		if err != nil {
			return err
		}
		nb, err := m.SetPriority(t, k, int32(priority))
		if err != nil {
			return err
		}
		if numBlocks != nil {
			*numBlocks = C.int32_t(nb)
		}
		return nil
	})
}

//export kvpgo_manager_prefix_stats
func kvpgo_manager_prefix_stats(h *C.kvp_manager, out *C.kvp_prefix_stats) C.kvp_status {
	return statsOut(unsafe.Pointer(h), managerName, "kvp_manager_prefix_stats", out, prefixStatsStruct, func(m *kvmanager.Manager) (v C.kvp_prefix_stats) {
		s := m.PrefixStats()
		v = C.kvp_prefix_stats{
			queries:          C.int64_t(s.Queries),
			query_tokens:     C.int64_t(s.QueryTokens),
			hit_tokens:       C.int64_t(s.HitTokens),
			partial_tokens:   C.int64_t(s.PartialTokens),
			inserts:          C.int64_t(s.Inserts),
			dedups:           C.int64_t(s.Dedups),
			evictions:        C.int64_t(s.Evictions),
			events_dropped:   C.int64_t(s.EventsDropped),
			cached_blocks:    C.int32_t(s.CachedBlocks),
			locked_blocks:    C.int32_t(s.LockedBlocks),
			pinned_blocks:    C.int32_t(s.PinnedBlocks),
			evictable_blocks: C.int32_t(s.EvictableBlocks),
			pending_events:   C.int32_t(s.PendingEvents),

			uncomputed_blocks:  C.int32_t(s.PendingBlocks),
			dropped_uncomputed: C.int64_t(s.DroppedPending),
		}
		return v
	})
}

//export kvpgo_manager_prefix_stats_reset
func kvpgo_manager_prefix_stats_reset(h *C.kvp_manager) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		m.ResetPrefixStats()
		return nil
	})
}

//export kvpgo_manager_clear_prefix_cache
func kvpgo_manager_clear_prefix_cache(h *C.kvp_manager, numFreed *C.int32_t) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		n, err := m.ClearPrefixCache()
		if err != nil {
			return err
		}
		if numFreed != nil {
			*numFreed = C.int32_t(n)
		}
		return nil
	})
}

//export kvpgo_manager_drain_events
func kvpgo_manager_drain_events(h *C.kvp_manager, events *C.kvp_kv_event, maxEvents C.int32_t,
	tokens *C.int32_t, maxTokens C.int32_t, mm *C.kvp_block_mm, maxMM C.int32_t,
	hashes *C.uint8_t, maxHashes C.int32_t, numEvents *C.int32_t) C.kvp_status {
	return drainEvents("kvp_manager_drain_events", h, unsafe.Pointer(events), maxEvents, tokens, maxTokens, mm, maxMM, hashes, maxHashes, numEvents,
		(*kvmanager.Manager).DrainEvents,
		func(i int, e C.kvp_kv_event, _ *prefix.Event) {
			slice[C.kvp_kv_event](unsafe.Pointer(events), maxEvents)[i] = e
		})
}

//export kvpgo_manager_drain_group_events
func kvpgo_manager_drain_group_events(h *C.kvp_manager, events *C.kvp_kv_group_event, maxEvents C.int32_t,
	tokens *C.int32_t, maxTokens C.int32_t, mm *C.kvp_block_mm, maxMM C.int32_t,
	hashes *C.uint8_t, maxHashes C.int32_t, numEvents *C.int32_t) C.kvp_status {
	return drainEvents("kvp_manager_drain_group_events", h, unsafe.Pointer(events), maxEvents, tokens, maxTokens, mm, maxMM, hashes, maxHashes, numEvents,
		(*kvmanager.Manager).DrainGroupEvents,
		func(i int, e C.kvp_kv_event, ev *prefix.Event) {
			slice[C.kvp_kv_group_event](unsafe.Pointer(events), maxEvents)[i] = C.kvp_kv_group_event{event: e, group: C.int32_t(ev.Group)}
		})
}

// drainEvents is the body of the two drains (op names the one called):
// it checks the arguments, drains with drain and writes each event's
// kvp_kv_event, its variable parts in the caller's arrays, with put.
func drainEvents(op string, h *C.kvp_manager, events unsafe.Pointer, maxEvents C.int32_t,
	tokens *C.int32_t, maxTokens C.int32_t, mm *C.kvp_block_mm, maxMM C.int32_t,
	hashes *C.uint8_t, maxHashes C.int32_t, numEvents *C.int32_t,
	drain func(*kvmanager.Manager, kvmanager.EventLimits) ([]prefix.Event, error),
	put func(int, C.kvp_kv_event, *prefix.Event)) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		if events == nil || numEvents == nil {
			return kverr.Errorf(kverr.NullPointer, "%s: events and num_events must not be NULL", op)
		}
		if maxEvents < 1 || maxTokens < 0 || maxMM < 0 || maxHashes < 0 {
			return kverr.Errorf(kverr.InvalidArgument, "%s: max_events must be >= 1 and the other maxima >= 0: got %d, %d, %d, %d",
				op, int32(maxEvents), int32(maxTokens), int32(maxMM), int32(maxHashes))
		}
		if (maxTokens > 0 && tokens == nil) || (maxMM > 0 && mm == nil) || (maxHashes > 0 && hashes == nil) {
			return kverr.Errorf(kverr.NullPointer, "%s: tokens, mm and hashes must not be NULL with a maximum above 0", op)
		}
		evs, err := drain(m, kvmanager.EventLimits{Events: int(maxEvents), Tokens: int(maxTokens), MM: int(maxMM), Hashes: int(maxHashes)})
		if err != nil {
			return err
		}
		outTok := slice[int32](unsafe.Pointer(tokens), maxTokens)
		outMM := slice[prefix.BlockMM](unsafe.Pointer(mm), maxMM)
		outHash := slice[prefix.Hash](unsafe.Pointer(hashes), maxHashes)
		nTok, nMM, nHash := 0, 0, 0
		for i := range evs {
			ev := &evs[i]
			// AllCleared has no medium: its Medium is the zero value, so
			// its medium field stays 0 as the header has it.
			e := C.kvp_kv_event{kind: C.int32_t(ev.Kind), medium: C.int32_t(ev.Medium)}
			switch ev.Kind {
			case prefix.BlockStored:
				e.block_size = C.int32_t(ev.BlockSize)
				e.adapter = C.uint64_t(ev.Adapter)
				e.hash = *(*[16]C.uint8_t)(unsafe.Pointer(&ev.Hash))
				e.parent = *(*[16]C.uint8_t)(unsafe.Pointer(&ev.Parent))
				e.tokens_offset = C.int32_t(nTok)
				nTok += copy(outTok[nTok:], ev.Tokens)
				e.mm_offset = C.int32_t(nMM)
				e.num_mm = C.int32_t(len(ev.MM))
				nMM += copy(outMM[nMM:], ev.MM)
			case prefix.BlockRemoved:
				e.hashes_offset = C.int32_t(nHash)
				e.num_hashes = C.int32_t(len(ev.Hashes))
				nHash += copy(outHash[nHash:], ev.Hashes)
			}
			put(i, e, ev)
		}
		*numEvents = C.int32_t(len(evs))
		return nil
	})
}

//export kvpgo_manager_next_event_size
func kvpgo_manager_next_event_size(h *C.kvp_manager, tokens, mm, hashes *C.int32_t) C.kvp_status {
	return nextEventSize(h, tokens, mm, hashes, (*kvmanager.Manager).NextEventSize)
}

//export kvpgo_manager_next_group_event_size
func kvpgo_manager_next_group_event_size(h *C.kvp_manager, tokens, mm, hashes *C.int32_t) C.kvp_status {
	return nextEventSize(h, tokens, mm, hashes, (*kvmanager.Manager).NextGroupEventSize)
}

// nextEventSize is the body of the two next-size calls: next is the
// manager's answer for the drain the call pairs with.
func nextEventSize(h *C.kvp_manager, tokens, mm, hashes *C.int32_t, next func(*kvmanager.Manager) (kvmanager.EventSize, bool, error)) C.kvp_status {
	return onManager(h, func(m *kvmanager.Manager) error {
		size, _, err := next(m)
		if err != nil {
			return err
		}
		for _, o := range []struct {
			p *C.int32_t
			v int
		}{{tokens, size.Tokens}, {mm, size.MM}, {hashes, size.Hashes}} {
			if o.p != nil {
				*o.p = C.int32_t(o.v)
			}
		}
		return nil
	})
}
