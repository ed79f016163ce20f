package main

// Go-typed entry points over the shared-prefix attention exports, for capi's
// tests (test files cannot use cgo).

/*
#include "kvplug.h"
*/
import "C"

import (
	"unsafe"

	"github.com/kvplug/kvplug/core/attn"
	"github.com/kvplug/kvplug/core/kvmanager"
)

// cascadeHookArgs mirrors kvp_cascade_plan_args.
type cascadeHookArgs struct {
	structSize                             uintptr
	dtype, headDim, qHeads, kvHeads, batch int32
	maxBatch, blockSize, maxBlocks         int32
	stride                                 int64
	table, lens                            []int32
	seqLensDev                             uint64
	host                                   []int32
	hostBytes, workspace, workspaceBytes   uint64
	flags, headroom                        int32
	qo                                     []int32 // qo_indptr_host; nil: NULL
	qoDev                                  uint64
	maxTokens, reserved                    int32
}

func (h *cascadeHookArgs) c() C.kvp_cascade_plan_args {
	a := C.kvp_cascade_plan_args{
		struct_size: C.size_t(h.structSize), dtype: C.int32_t(h.dtype), head_dim: C.int32_t(h.headDim),
		num_q_heads: C.int32_t(h.qHeads), num_kv_heads: C.int32_t(h.kvHeads), batch: C.int32_t(h.batch),
		max_batch: C.int32_t(h.maxBatch), block_size: C.int32_t(h.blockSize), max_blocks_per_seq: C.int32_t(h.maxBlocks),
		block_table_stride: C.int64_t(h.stride), seq_lens: C.uint64_t(h.seqLensDev),
		host_workspace_bytes: C.uint64_t(h.hostBytes), workspace: C.uint64_t(h.workspace),
		workspace_bytes: C.uint64_t(h.workspaceBytes), flags: C.int32_t(h.flags), headroom: C.int32_t(h.headroom),
		qo_indptr: C.uint64_t(h.qoDev), max_tokens: C.int32_t(h.maxTokens), reserved: C.int32_t(h.reserved),
	}
	if h.qo != nil {
		a.qo_indptr_host = (*C.int32_t)(unsafe.Pointer(&h.qo[0]))
	}
	if len(h.table) > 0 {
		a.block_table_host = (*C.int32_t)(unsafe.Pointer(&h.table[0]))
	}
	if len(h.lens) > 0 {
		a.seq_lens_host = (*C.int32_t)(unsafe.Pointer(&h.lens[0]))
	}
	if len(h.host) > 0 {
		a.host_workspace = unsafe.Pointer(&h.host[0])
	}
	return a
}

func sizeofCascadePlanArgs() uintptr { return unsafe.Sizeof(C.kvp_cascade_plan_args{}) }

// firstCascadePlanArgsSize is kvp_cascade_plan_args's first released size.
func firstCascadePlanArgsSize() uintptr { return cascadePlanArgsStruct.first }

// planStateWords pairs each of the header's plan-state word indices of a
// prefill plan with core/attn's (a cascade plan's words are packed here,
// by the header's indices).
var planStateWords = map[string][2]int{
	"KVP_PLAN_STATE_MAINLOOP":     {C.KVP_PLAN_STATE_MAINLOOP, attn.WordMainloop},
	"KVP_PLAN_STATE_DECODE_ROWS":  {C.KVP_PLAN_STATE_DECODE_ROWS, attn.WordDecodeRows},
	"KVP_PLAN_STATE_DECODE_INDEX": {C.KVP_PLAN_STATE_DECODE_INDEX, attn.WordDecodeIndex},
	"KVP_PLAN_STATE_WORK_LIST":    {C.KVP_PLAN_STATE_WORK_LIST, attn.WordWorkList},
}

// cascadeHookPlan is a kvp_attn_plan kept in Go memory for the tests.
type cascadeHookPlan struct{ p C.kvp_attn_plan }

func hookCascadePlan(h *cascadeHookArgs, null bool) (*cascadeHookPlan, abiStatus) {
	var p cascadeHookPlan
	p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	if null {
		return &p, abiStatus(kvpgo_cascade_plan(nil, &p.p, 0))
	}
	a := h.c()
	return &p, abiStatus(kvpgo_cascade_plan(&a, &p.p, 0))
}

func (p *cascadeHookPlan) route() int32    { return int32(p.p.route) }
func (p *cascadeHookPlan) setKind(k int32) { p.p.kind = C.int32_t(k) }

// hookPlanStruct is core plan p as kvp_attn_plan holds it.
func hookPlanStruct(p *attn.CascadePlan) (*cascadeHookPlan, abiStatus) {
	h := &cascadeHookPlan{}
	h.p.struct_size = C.size_t(unsafe.Sizeof(h.p))
	return h, abiStatus(fail(writeCascadePlan(&h.p, p)))
}

// hookCascadeStateRoundTrip packs a cascade plan's state into plan-state
// words and unpacks them, as the plan, update and run exports do.
func hookCascadeStateRoundTrip(s *attn.CascadeState) ([6]uint64, attn.CascadeState) {
	w := cascadeStateWords(s)
	return w, cascadeStateOf(attn.KindCascade, &w)
}

// hookPrefillPlanRoundTrip writes prefill plan p into a kvp_attn_plan and
// reads it back, as kvp_prefill_plan and kvp_paged_prefill do; it returns
// the struct's plan-state words and the plan read back.
func hookPrefillPlanRoundTrip(p *attn.PrefillPlan) ([6]uint64, attn.PrefillPlan, error) {
	var c C.kvp_attn_plan
	c.struct_size = C.size_t(unsafe.Sizeof(c))
	if err := writeAttnPlan(&c, p, p.PlanState()); err != nil {
		return [6]uint64{}, attn.PrefillPlan{}, err
	}
	var words [6]uint64
	for i, w := range c.state {
		words[i] = uint64(w)
	}
	back, state, err := readAttnPlan("test", &c)
	back.SetPlanState(&state)
	return words, back, err
}

// plan is the core plan the struct holds, as the run and update exports read it.
func (p *cascadeHookPlan) plan() (attn.CascadePlan, error) {
	return readCascadePlan("test", &p.p)
}

func hookCascadeUpdate(p *cascadeHookPlan, lens []int32, batch int32) (int32, abiStatus) {
	var fits C.int32_t = -1
	var lp *C.int32_t
	if len(lens) > 0 {
		lp = (*C.int32_t)(unsafe.Pointer(&lens[0]))
	}
	st := kvpgo_cascade_update(&p.p, lp, C.int32_t(batch), &fits)
	return int32(fits), abiStatus(st)
}

func hookCascadePrefillWorkspaceSize(maxBatch, maxTokens, qh, kvh, d int32) (uint64, uint64, abiStatus) {
	var dev, host C.uint64_t
	st := kvpgo_cascade_prefill_workspace_size(C.int32_t(maxBatch), C.int32_t(maxTokens), C.int32_t(qh), C.int32_t(kvh), C.int32_t(d), &dev, &host)
	return uint64(dev), uint64(host), abiStatus(st)
}

func hookCascadeWorkspaceSize(maxBatch, qh, kvh, d int32) (uint64, uint64, abiStatus) {
	var dev, host C.uint64_t
	st := kvpgo_cascade_workspace_size(C.int32_t(maxBatch), C.int32_t(qh), C.int32_t(kvh), C.int32_t(d), &dev, &host)
	return uint64(dev), uint64(host), abiStatus(st)
}

// hookPagedCascade runs a plan over contiguous tensors at fake addresses.
func hookPagedCascade(p *cascadeHookPlan, blockSize, maxBlocks, reserved int32) abiStatus {
	D, qh, kvh := int64(p.p.head_dim), int64(p.p.num_q_heads), int64(p.p.num_kv_heads)
	a := C.kvp_paged_prefill_args{struct_size: C.size_t(unsafe.Sizeof(C.kvp_paged_prefill_args{})),
		num_blocks: 1 << 20, block_size: C.int32_t(blockSize), max_blocks_per_seq: C.int32_t(maxBlocks), reserved: C.int32_t(reserved),
		q: 0x10000, q_token_stride: C.int64_t(qh * D), q_head_stride: C.int64_t(D),
		k_cache: 0x20000, v_cache: 0x30000,
		cache_block_stride: C.int64_t(int64(blockSize) * kvh * D), cache_token_stride: C.int64_t(kvh * D), cache_head_stride: C.int64_t(D),
		block_table: 0x40000, block_table_stride: C.int64_t(maxBlocks),
		out: 0x50000, out_token_stride: C.int64_t(qh * D), out_head_stride: C.int64_t(D)}
	return abiStatus(kvpgo_paged_cascade(&p.p, &a, 0))
}

// hookCascadePlanSized passes the args in a buffer larger than this
// library's struct, with struct_size = callerSize and the byte just past
// this library's size set to tail.
func hookCascadePlanSized(h *cascadeHookArgs, callerSize uintptr, tail byte) abiStatus {
	size := unsafe.Sizeof(C.kvp_cascade_plan_args{})
	buf := newStructBuf(size + 64)
	defer buf.free()
	a := h.c()
	a.struct_size = C.size_t(callerSize)
	*(*C.kvp_cascade_plan_args)(buf.p) = a
	buf.bytes()[size] = tail
	var p C.kvp_attn_plan
	p.struct_size = C.size_t(unsafe.Sizeof(p))
	return abiStatus(kvpgo_cascade_plan((*C.kvp_cascade_plan_args)(buf.p), &p, 0))
}

// hookManagerHandle registers a core manager as a kvp_manager handle, so a
// test can build sharing through the Go API (prefix cache, forks) and plan
// through the ABI.
func hookManagerHandle(m *kvmanager.Manager) unsafe.Pointer { return newHandle(m) }

// hookManagerCascadePlan calls kvp_manager_cascade_plan with h's fields
// (host arrays included, so a test can check they are refused); nullArgs
// and nullPlan pass NULL for them. The plan struct starts as prev.
func hookManagerCascadePlan(m unsafe.Pointer, ids []int64, n int32, h *cascadeHookArgs, prev *cascadeHookPlan, nullArgs, nullPlan bool) (*cascadeHookPlan, abiStatus) {
	p := &cascadeHookPlan{}
	if prev != nil {
		*p = *prev
	} else {
		p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	}
	a := h.c()
	ap, pp := &a, &p.p
	if nullArgs {
		ap = nil
	}
	if nullPlan {
		pp = nil
	}
	var idp *C.int64_t
	if len(ids) > 0 {
		idp = (*C.int64_t)(unsafe.Pointer(&ids[0]))
	}
	st := kvpgo_manager_cascade_plan((*C.kvp_manager)(m), idp, C.int32_t(n), ap, pp, 0)
	return p, abiStatus(st)
}

// hookPlanSentinel is a plan struct with values no call writes (route 77,
// batch 99), to see that a failed call leaves it alone.
func hookPlanSentinel() *cascadeHookPlan {
	p := &cascadeHookPlan{}
	p.p.struct_size = C.size_t(unsafe.Sizeof(p.p))
	p.p.route, p.p.batch = 77, 99
	return p
}

// cascadePlanFields are a kvp_attn_plan's fields that a test compares.
type cascadePlanFields struct {
	Kind, Route, Batch, TotalQ, MaxQ, MaxKV, Items, Grid int32
	Workspace, WorkspaceBytes, KVLens                    uint64
	Reserved                                             [6]uint64
}

func (p *cascadeHookPlan) fields() cascadePlanFields {
	c := &p.p
	f := cascadePlanFields{Kind: int32(c.kind), Route: int32(c.route), Batch: int32(c.batch), TotalQ: int32(c.total_q),
		MaxQ: int32(c.max_q_len), MaxKV: int32(c.max_kv_len), Items: int32(c.num_items), Grid: int32(c.grid),
		Workspace: uint64(c.workspace), WorkspaceBytes: uint64(c.workspace_bytes), KVLens: uint64(c.kv_lens)}
	for i := range f.Reserved {
		f.Reserved[i] = uint64(c.state[i])
	}
	return f
}
