package attn

import "github.com/kvplug/kvplug/core/cuda"

// The plan-state words of a prefill plan (kvp_attn_plan.reserved,
// KVP_PLAN_STATE_*).
const (
	WordMainloop    = 0 // KVP_PLAN_STATE_MAINLOOP: the mainloop it was planned for
	WordDecodeRows  = 1 // KVP_PLAN_STATE_DECODE_ROWS: decode sequences | decode splits << 32
	WordDecodeIndex = 2 // KVP_PLAN_STATE_DECODE_INDEX: the device qo_indptr the decode rows are found by
	WordWorkList    = 3 // KVP_PLAN_STATE_WORK_LIST: the fingerprint of the work list it wrote
)

// PlanState packs p's state beyond kvp_attn_plan's named fields into its
// plan-state words.
func (p *PrefillPlan) PlanState() [6]uint64 {
	var w [6]uint64
	w[WordMainloop] = uint64(p.Mainloop)
	w[WordDecodeRows] = uint64(uint32(p.DecodeSeqs)) | uint64(uint32(p.DecodeSplits))<<32
	w[WordDecodeIndex] = uint64(p.QOIndptr)
	w[WordWorkList] = p.WorkList
	return w
}

// SetPlanState unpacks plan-state words that PlanState packed. A value no
// plan holds is clamped, not wrapped, so that the run's check refuses it.
func (p *PrefillPlan) SetPlanState(w *[6]uint64) {
	p.Mainloop = int(min(w[WordMainloop], 1<<16))
	p.DecodeSeqs = int(min(w[WordDecodeRows]&0xffffffff, 1<<31-1))
	p.DecodeSplits = int(min(w[WordDecodeRows]>>32, 1<<31-1))
	p.QOIndptr = cuda.DevicePtr(w[WordDecodeIndex])
	p.WorkList = w[WordWorkList]
}
