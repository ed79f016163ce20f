package cascade

// HostPlanner plans a batch into host memory of its own, for the summary
// alone: how much sharing the batch has (SavedTokens of TotalTokens), the
// route, and the items and partial states a plan would have. It needs no
// workspace from the caller and no device, so an engine (or a trace replay)
// can measure a batch's sharing on a machine without a GPU. Its plan cannot
// be run: nothing of it leaves the planner.
//
// Slots are the Input's, so a caller that leaves them 0 gets the chunking of
// DefaultSlots; the route, SavedTokens and TotalTokens do not depend on the
// slots. Not safe for concurrent use; the zero value is ready.
type HostPlanner struct {
	p  Planner
	ws []int32
}

// Plan plans in for workspaces of capacity maxBatch sequences (0: the
// batch) and maxTokens query rows (0: maxBatch, decode) and returns its
// summary, with Gen 0. The errors are Plan's and NewPrefillLayout's.
func (h *HostPlanner) Plan(in *Input, maxBatch, maxTokens int) (Summary, error) {
	if maxBatch == 0 {
		maxBatch = max(len(in.SeqLens), 1)
	}
	if maxTokens == 0 {
		maxTokens = maxBatch
	}
	l, err := NewPrefillLayout(maxBatch, maxTokens, in.NumQHeads, in.NumKVHeads, in.HeadDim)
	if err != nil {
		return Summary{}, err
	}
	h.ws = grow(h.ws, l.HostInts)
	// A fresh header each time: the summary of a host plan is not a
	// generation of anything, and the stale-plan check never sees it.
	h.ws[hMagic] = 0
	return h.p.Plan(in, &l, h.ws)
}
