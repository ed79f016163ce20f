package attn

// WordMainloop is the plan-state word of a prefill plan (kvp_attn_plan.reserved,
// KVP_PLAN_STATE_MAINLOOP): the mainloop it was planned for.
const WordMainloop = 0

// PlanState packs p's state beyond kvp_attn_plan's named fields into its
// plan-state words.
func (p *PrefillPlan) PlanState() [6]uint64 {
	var w [6]uint64
	w[WordMainloop] = uint64(p.Mainloop)
	return w
}

// SetPlanState unpacks plan-state words that PlanState packed. A value no
// plan holds is clamped, not wrapped, so that the run's check refuses it.
func (p *PrefillPlan) SetPlanState(w *[6]uint64) {
	p.Mainloop = int(min(w[WordMainloop], 1<<16))
}
