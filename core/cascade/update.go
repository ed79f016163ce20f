package cascade

import (
	"github.com/kvplug/kvplug/core/kverr"
)

// Update checks that a cascade plan still covers a step whose sequences only
// grew: every sequence's length within [its tail's start, its tail's planned
// capacity]. It reads the host workspace only (O(batch)) and writes nothing:
// the kernels read the tails' ends from the device's sequence lengths. false
// means the batch needs a new plan (a tail outgrew its chunks, or a length
// fell below the shared part it was planned with). A decode-route plan
// always fits; a plan with prefill rows (more query rows than sequences, a
// query of more than one token, or the prefill route) never does: the next step's queries differ. The block tables' shared columns must not have changed: the
// host cannot see that here (the caller's obligation).
func Update(ws []int32, l *Layout, route, batch int, seqLens []int32) (bool, error) {
	if len(seqLens) != batch {
		return false, kverr.Errorf(kverr.InvalidArgument, "cascade_update: %d lengths given for the plan's batch of %d", len(seqLens), batch)
	}
	if route == RouteDecode {
		return true, nil
	}
	s, err := Header(ws, l)
	if err != nil {
		return false, err
	}
	if route == RoutePrefill || s.Rows != s.Batch || s.MaxQLen > 1 {
		// Prefill rows: rows == batch can still be varlen (a sequence of
		// 0 query tokens beside one of 2), whose rows map to sequences
		// by this step's qo_indptr.
		return false, nil
	}
	if s.Batch != batch {
		return false, kverr.Errorf(kverr.InvalidArgument, "cascade_update: the host workspace holds a plan of %d sequences; the plan given has %d (planned again since?)", s.Batch, batch)
	}
	tb := ws[l.TailBegin : l.TailBegin+batch]
	te := ws[l.TailEnd : l.TailEnd+batch]
	for i, n := range seqLens {
		if n < tb[i] || n > te[i] {
			return false, nil
		}
	}
	return true, nil
}
