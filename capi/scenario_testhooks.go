package main

// Raw entry points over every export, for the data-driven scenario tests
// and the ABI fuzz target (test files cannot use cgo): pointers pass
// through as given, NULL included, so the tests reach every argument check
// a C host can. Struct layouts come from the header's own types by
// reflection, so no offset is written down twice.

/*
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import (
	"reflect"
	"unsafe"
)

type ptr = unsafe.Pointer

// cField is a field of a header struct: its offset and size in bytes.
type cField struct{ off, size uintptr }

// cLayout is a header struct's size and fields, by the header's names.
type cLayout struct {
	size   uintptr
	fields map[string]cField
}

// buildCLayouts returns the layouts of the header structs the tests use.
// A function, not a package variable: the library itself never runs it.
func buildCLayouts() map[string]cLayout {
	out := map[string]cLayout{}
	for name, v := range map[string]any{
		"kvp_manager_config":         C.kvp_manager_config{},
		"kvp_manager_stats":          C.kvp_manager_stats{},
		"kvp_prefix_stats":           C.kvp_prefix_stats{},
		"kvp_prefix_keys":            C.kvp_prefix_keys{},
		"kvp_prefix_match":           C.kvp_prefix_match{},
		"kvp_mm_item":                C.kvp_mm_item{},
		"kvp_block_mm":               C.kvp_block_mm{},
		"kvp_block_copy":             C.kvp_block_copy{},
		"kvp_kv_event":               C.kvp_kv_event{},
		"kvp_kv_group_event":         C.kvp_kv_group_event{},
		"kvp_vcache_config":          C.kvp_vcache_config{},
		"kvp_vcache_stats":           C.kvp_vcache_stats{},
		"kvp_paged_kv":               C.kvp_paged_kv{},
		"kvp_kv_write_args":          C.kvp_kv_write_args{},
		"kvp_paged_decode_args":      C.kvp_paged_decode_args{},
		"kvp_merge_states_args":      C.kvp_merge_states_args{},
		"kvp_prefill_plan_args":      C.kvp_prefill_plan_args{},
		"kvp_attn_plan":              C.kvp_attn_plan{},
		"kvp_paged_prefill_args":     C.kvp_paged_prefill_args{},
		"kvp_cascade_plan_args":      C.kvp_cascade_plan_args{},
		"kvp_event_publisher_config": C.kvp_event_publisher_config{},
		"kvp_event_publisher_stats":  C.kvp_event_publisher_stats{},
		"kvp_tier_copy":              C.kvp_tier_copy{},
		"kvp_tier_match":             C.kvp_tier_match{},
		"kvp_block_match":            C.kvp_block_match{},
		"kvp_tier_stats":             C.kvp_tier_stats{},
		"kvp_host_store_config":      C.kvp_host_store_config{},
		"kvp_host_store_stats":       C.kvp_host_store_stats{},
		"kvp_shared_store_config":    C.kvp_shared_store_config{},
		"kvp_shared_store_stats":     C.kvp_shared_store_stats{},
	} {
		t := reflect.TypeOf(v)
		l := cLayout{size: t.Size(), fields: map[string]cField{}}
		for i := range t.NumField() {
			f := t.Field(i)
			if f.Name != "_" {
				l.fields[f.Name] = cField{f.Offset, f.Type.Size()}
			}
		}
		out[name] = l
	}
	return out
}

// firstManagerConfigSize is kvp_manager_config's first released size.
func firstManagerConfigSize() uintptr { return managerConfigStruct.first }

func st(s C.kvp_status) int { return int(s) }

func rawManagerCreate(cfg, out ptr) int {
	return st(kvpgo_manager_create((*C.kvp_manager_config)(cfg), (**C.kvp_manager)(out)))
}
func rawManagerDestroy(m ptr) { kvpgo_manager_destroy((*C.kvp_manager)(m)) }
func rawManagerAdd(m ptr, id int64, n int32) int {
	return st(kvpgo_manager_add((*C.kvp_manager)(m), C.int64_t(id), C.int32_t(n)))
}
func rawManagerGrow(m, ids, counts ptr, n int32) int {
	return st(kvpgo_manager_grow((*C.kvp_manager)(m), (*C.int64_t)(ids), (*C.int32_t)(counts), C.int32_t(n)))
}
func rawManagerGrowTokens(m, ids, counts ptr, n int32, tokens ptr) int {
	return st(kvpgo_manager_grow_tokens((*C.kvp_manager)(m), (*C.int64_t)(ids), (*C.int32_t)(counts), C.int32_t(n), (*C.int32_t)(tokens)))
}
func rawManagerFork(m ptr, parent int64, children ptr, n int32, copies ptr, maxCopies int32, numCopies ptr) int {
	return st(kvpgo_manager_fork((*C.kvp_manager)(m), C.int64_t(parent), (*C.int64_t)(children), C.int32_t(n),
		(*C.kvp_block_copy)(copies), C.int32_t(maxCopies), (*C.int32_t)(numCopies)))
}
func rawManagerMarkComputed(m ptr) int {
	return st(kvpgo_manager_mark_computed((*C.kvp_manager)(m)))
}
func rawManagerRemove(m, ids ptr, n int32) int {
	return st(kvpgo_manager_remove((*C.kvp_manager)(m), (*C.int64_t)(ids), C.int32_t(n)))
}
func rawManagerDescribe(m, ids ptr, n int32, table ptr, maxBlocks int32, lens, slots ptr, slotCap int32, numSlots ptr) int {
	return st(kvpgo_manager_describe((*C.kvp_manager)(m), (*C.int64_t)(ids), C.int32_t(n), (*C.int32_t)(table), C.int32_t(maxBlocks),
		(*C.int32_t)(lens), (*C.int32_t)(slots), C.int32_t(slotCap), (*C.int32_t)(numSlots)))
}
func rawManagerStats(m, out ptr) int {
	return st(kvpgo_manager_stats_get((*C.kvp_manager)(m), (*C.kvp_manager_stats)(out)))
}
func rawManagerCheck(m ptr) int { return st(kvpgo_manager_check((*C.kvp_manager)(m))) }
func rawManagerAdmit(m, ids ptr, n int32, tokens, offsets, keys, matched, numAdmitted ptr) int {
	return st(kvpgo_manager_admit((*C.kvp_manager)(m), (*C.int64_t)(ids), C.int32_t(n), (*C.int32_t)(tokens), (*C.int64_t)(offsets),
		(*C.kvp_prefix_keys)(keys), (*C.int32_t)(matched), (*C.int32_t)(numAdmitted)))
}
func rawManagerMatch(m ptr, n int32, tokens, offsets, keys ptr, partial int32, out ptr) int {
	return st(kvpgo_manager_match((*C.kvp_manager)(m), C.int32_t(n), (*C.int32_t)(tokens), (*C.int64_t)(offsets),
		(*C.kvp_prefix_keys)(keys), C.int32_t(partial), (*C.kvp_prefix_match)(out)))
}
func rawManagerMatchBlocks(m ptr, n int32, tokens, offsets, keys, out ptr) int {
	return st(kvpgo_manager_match_blocks((*C.kvp_manager)(m), C.int32_t(n), (*C.int32_t)(tokens), (*C.int64_t)(offsets),
		(*C.kvp_prefix_keys)(keys), (*C.kvp_block_match)(out)))
}
func rawManagerMatchRoom(m ptr, n int32, tokens, offsets, keys, room ptr) int {
	return st(kvpgo_manager_match_room((*C.kvp_manager)(m), C.int32_t(n), (*C.int32_t)(tokens), (*C.int64_t)(offsets),
		(*C.kvp_prefix_keys)(keys), (*C.int32_t)(room)))
}
func rawManagerPin(m, tokens ptr, n int32, keys, pinID, numBlocks ptr) int {
	return st(kvpgo_manager_pin((*C.kvp_manager)(m), (*C.int32_t)(tokens), C.int32_t(n), (*C.kvp_prefix_keys)(keys),
		(*C.uint64_t)(pinID), (*C.int32_t)(numBlocks)))
}
func rawManagerUnpin(m ptr, id uint64) int {
	return st(kvpgo_manager_unpin((*C.kvp_manager)(m), C.uint64_t(id)))
}
func rawManagerSetPriority(m, tokens ptr, n int32, keys ptr, prio int32, numBlocks ptr) int {
	return st(kvpgo_manager_set_priority((*C.kvp_manager)(m), (*C.int32_t)(tokens), C.int32_t(n), (*C.kvp_prefix_keys)(keys),
		C.int32_t(prio), (*C.int32_t)(numBlocks)))
}
func rawManagerPrefixStats(m, out ptr) int {
	return st(kvpgo_manager_prefix_stats((*C.kvp_manager)(m), (*C.kvp_prefix_stats)(out)))
}
func rawManagerPrefixStatsReset(m ptr) int {
	return st(kvpgo_manager_prefix_stats_reset((*C.kvp_manager)(m)))
}
func rawManagerClearPrefixCache(m, numFreed ptr) int {
	return st(kvpgo_manager_clear_prefix_cache((*C.kvp_manager)(m), (*C.int32_t)(numFreed)))
}
func rawManagerDrainEvents(m, events ptr, maxEvents int32, tokens ptr, maxTokens int32, mm ptr, maxMM int32,
	hashes ptr, maxHashes int32, numEvents ptr) int {
	return st(kvpgo_manager_drain_events((*C.kvp_manager)(m), (*C.kvp_kv_event)(events), C.int32_t(maxEvents),
		(*C.int32_t)(tokens), C.int32_t(maxTokens), (*C.kvp_block_mm)(mm), C.int32_t(maxMM),
		(*C.uint8_t)(hashes), C.int32_t(maxHashes), (*C.int32_t)(numEvents)))
}
func rawManagerNextEventSize(m, tokens, mm, hashes ptr) int {
	return st(kvpgo_manager_next_event_size((*C.kvp_manager)(m), (*C.int32_t)(tokens), (*C.int32_t)(mm), (*C.int32_t)(hashes)))
}
func rawManagerAddMMItems(m ptr, seqID int64, items ptr, n int32) int {
	return st(kvpgo_manager_add_mm_items((*C.kvp_manager)(m), C.int64_t(seqID), (*C.kvp_mm_item)(items), C.int32_t(n)))
}
func rawManagerFlushCopies(m, demote ptr, maxDemote int32, numDemote, reload ptr, maxReload int32, numReload, ticket ptr) int {
	return st(kvpgo_manager_flush_copies((*C.kvp_manager)(m), (*C.kvp_tier_copy)(demote), C.int32_t(maxDemote), (*C.int32_t)(numDemote),
		(*C.kvp_tier_copy)(reload), C.int32_t(maxReload), (*C.int32_t)(numReload), (*C.uint64_t)(ticket)))
}
func rawManagerCompleteCopies(m ptr, ticket uint64, failed int32) int {
	return st(kvpgo_manager_complete_copies((*C.kvp_manager)(m), C.uint64_t(ticket), C.int32_t(failed)))
}
func rawManagerMatchTiers(m ptr, n int32, tokens, offsets, keys, out ptr) int {
	return st(kvpgo_manager_match_tiers((*C.kvp_manager)(m), C.int32_t(n), (*C.int32_t)(tokens), (*C.int64_t)(offsets),
		(*C.kvp_prefix_keys)(keys), (*C.kvp_tier_match)(out)))
}
func rawManagerTierStats(m, out ptr) int {
	return st(kvpgo_manager_tier_stats((*C.kvp_manager)(m), (*C.kvp_tier_stats)(out)))
}
func rawManagerHostTierMemory(m, base, slotBytes, numSlots ptr) int {
	return st(kvpgo_manager_host_tier_memory((*C.kvp_manager)(m), (*unsafe.Pointer)(base), (*C.int64_t)(slotBytes), (*C.int32_t)(numSlots)))
}

func rawVcacheCreate(cfg, out ptr) int {
	return st(kvpgo_vcache_create((*C.kvp_vcache_config)(cfg), (**C.kvp_vcache)(out)))
}
func rawVcacheDestroy(c ptr) { kvpgo_vcache_destroy((*C.kvp_vcache)(c)) }
func rawVcacheLayerPtrs(c ptr, layer int32, k, v ptr) int {
	return st(kvpgo_vcache_layer_ptrs((*C.kvp_vcache)(c), C.int32_t(layer), (*C.uint64_t)(k), (*C.uint64_t)(v)))
}
func rawVcacheStrides(c, strides ptr) int {
	return st(kvpgo_vcache_strides((*C.kvp_vcache)(c), (*C.int64_t)(strides)))
}
func rawVcacheAllocSlot(c, slot ptr) int {
	return st(kvpgo_vcache_alloc_slot((*C.kvp_vcache)(c), (*C.int32_t)(slot)))
}
func rawVcacheFreeSlot(c ptr, slot int32) int {
	return st(kvpgo_vcache_free_slot((*C.kvp_vcache)(c), C.int32_t(slot)))
}
func rawVcacheStep(c, slots, ctxLens ptr, n int32) int {
	return st(kvpgo_vcache_step((*C.kvp_vcache)(c), (*C.int32_t)(slots), (*C.int32_t)(ctxLens), C.int32_t(n)))
}
func rawVcacheTrim(c ptr) int { return st(kvpgo_vcache_trim((*C.kvp_vcache)(c))) }
func rawVcacheStats(c, out ptr) int {
	return st(kvpgo_vcache_stats_get((*C.kvp_vcache)(c), (*C.kvp_vcache_stats)(out)))
}

func rawAttnWorkspaceSize(maxBatch, qHeads, headDim, maxSplits int32, out ptr) int {
	return st(kvpgo_attn_workspace_size(C.int32_t(maxBatch), C.int32_t(qHeads), C.int32_t(headDim), C.int32_t(maxSplits), (*C.uint64_t)(out)))
}
func rawPrefillWorkspaceSize(maxBatch, maxTokens, qHeads, kvHeads, headDim int32, out ptr) int {
	return st(kvpgo_prefill_workspace_size(C.int32_t(maxBatch), C.int32_t(maxTokens), C.int32_t(qHeads), C.int32_t(kvHeads),
		C.int32_t(headDim), (*C.uint64_t)(out)))
}
func rawAttnNumSplits(dtype, headDim, batch, qHeads, kvHeads, maxSeqLen int32, out ptr) int {
	return st(kvpgo_attn_num_splits(C.int32_t(dtype), C.int32_t(headDim), C.int32_t(batch), C.int32_t(qHeads),
		C.int32_t(kvHeads), C.int32_t(maxSeqLen), (*C.int32_t)(out)))
}
func rawKVWrite(args ptr) int { return st(kvpgo_kv_write((*C.kvp_kv_write_args)(args), 0)) }
func rawPagedDecode(args ptr) int {
	return st(kvpgo_paged_decode((*C.kvp_paged_decode_args)(args), 0))
}
func rawMergeStates(args ptr) int {
	return st(kvpgo_merge_states((*C.kvp_merge_states_args)(args), 0))
}
func rawPrefillPlan(args, plan ptr) int {
	return st(kvpgo_prefill_plan((*C.kvp_prefill_plan_args)(args), (*C.kvp_attn_plan)(plan), 0))
}
func rawPagedPrefill(plan, args ptr) int {
	return st(kvpgo_paged_prefill((*C.kvp_attn_plan)(plan), (*C.kvp_paged_prefill_args)(args), 0))
}

func rawVersion() uint32              { return uint32(kvpgo_version()) }
func rawVersionString() string        { return C.GoString(kvpgo_version_string()) }
func rawSetLogLevel(level int32) int  { return st(kvpgo_set_log_level(C.int(level))) }
func rawLiveHandles(out ptr) int      { return st(kvpgo_live_handles((*C.int64_t)(out))) }
func rawCudaAvailable(out ptr) int    { return st(kvpgo_cuda_available((*C.int32_t)(out))) }
func rawAttnPrepare() int             { return st(kvpgo_attn_prepare()) }
func rawStatusString(s int32) string  { return C.GoString(C.kvp_status_string(C.kvp_status(s))) }
func rawSetLoggerOff(level int32) int { return st(kvpgo_set_logger(nil, nil, C.int(level))) }

// hookGuarded runs f under an export's guard and returns the status the
// export would return.
func hookGuarded(f func()) int {
	var s C.kvp_status
	func() {
		defer guard(&s)
		f()
	}()
	return int(s)
}

func rawCascadeWorkspaceSize(maxBatch, qHeads, kvHeads, headDim int32, dev, host ptr) int {
	return st(kvpgo_cascade_workspace_size(C.int32_t(maxBatch), C.int32_t(qHeads), C.int32_t(kvHeads), C.int32_t(headDim),
		(*C.uint64_t)(dev), (*C.uint64_t)(host)))
}
func rawCascadePlan(args, plan ptr) int {
	return st(kvpgo_cascade_plan((*C.kvp_cascade_plan_args)(args), (*C.kvp_attn_plan)(plan), 0))
}
func rawCascadeUpdate(plan, lens ptr, batch int32, fits ptr) int {
	return st(kvpgo_cascade_update((*C.kvp_attn_plan)(plan), (*C.int32_t)(lens), C.int32_t(batch), (*C.int32_t)(fits)))
}
func rawPagedCascade(plan, args ptr) int {
	return st(kvpgo_paged_cascade((*C.kvp_attn_plan)(plan), (*C.kvp_paged_prefill_args)(args), 0))
}
func rawPublisherCreate(m, cfg, out ptr) int {
	return st(kvpgo_event_publisher_create((*C.kvp_manager)(m), (*C.kvp_event_publisher_config)(cfg), (**C.kvp_event_publisher)(out)))
}
func rawPublisherDestroy(p ptr) { kvpgo_event_publisher_destroy((*C.kvp_event_publisher)(p)) }
func rawPublisherFlush(p ptr) int {
	return st(kvpgo_event_publisher_flush((*C.kvp_event_publisher)(p)))
}
func rawPublisherResync(p ptr) int {
	return st(kvpgo_event_publisher_resync((*C.kvp_event_publisher)(p)))
}
func rawPublisherStats(p, out ptr) int {
	return st(kvpgo_event_publisher_stats_get((*C.kvp_event_publisher)(p), (*C.kvp_event_publisher_stats)(out)))
}
