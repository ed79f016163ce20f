package attn

// What a host-memory implementation of the launches needs from their
// checks: a layout's validity and the elements each of its buffers spans.
// The float64 oracle (core/attn/attnref) checks its buffers with these, so
// that it refuses exactly the layouts the launches refuse.

// KVWriteExtents are the elements a KV write's buffers span.
type KVWriteExtents struct{ Key, Value, Cache int64 }

// Extents checks l as KVWrite does and returns its buffers' extents.
func (l *KVWriteLayout) Extents() (KVWriteExtents, error) {
	e, err := l.validate()
	return KVWriteExtents{Key: e.key, Value: e.value, Cache: e.cache}, err
}

// DecodeExtents are the elements a paged decode's buffers span (the block
// table's in int32 entries).
type DecodeExtents struct{ Q, Cache, Out, Table int64 }

// Extents checks l as PagedDecode does and returns its buffers' extents.
func (l *DecodeLayout) Extents() (DecodeExtents, error) {
	e, err := l.validate()
	return DecodeExtents{Q: e.q, Cache: e.cache, Out: e.out, Table: e.table}, err
}

// MergeExtents are the elements a merge's buffers span (the lse arrays' in
// float32).
type MergeExtents struct{ V, S, Out, OutLSE int64 }

// Extents checks l as MergeStates does, with an output lse when withLSE,
// and returns its buffers' extents.
func (l *MergeLayout) Extents(withLSE bool) (MergeExtents, error) {
	e, err := l.validate(withLSE)
	return MergeExtents{V: e.v, S: e.s, Out: e.out, OutLSE: e.outLSE}, err
}

// PrefillBatch is what PlanPrefill finds in a batch's host arrays.
type PrefillBatch struct {
	TotalQ, MaxQLen, MaxKVLen int
	Items                     int64 // the prefill kernel's work items (row tiles)
}

// CheckBatch checks the shape s and the batch's host arrays as PlanPrefill
// does (messages start with what) and returns what it finds.
func (s *PrefillShape) CheckBatch(what string, qoIndptr, kvLens []int32) (PrefillBatch, error) {
	if err := s.validate(what); err != nil {
		return PrefillBatch{}, err
	}
	st, err := checkBatch(what, s, qoIndptr, kvLens)
	return PrefillBatch{TotalQ: st.totalQ, MaxQLen: st.maxQLen, MaxKVLen: st.maxKVLen, Items: st.items}, err
}

// PrefillExtents are the elements a prefill run's buffers span.
type PrefillExtents struct{ Q, Cache, Out, Table int64 }

// Extents checks l against plan p as PagedPrefill does and returns its
// buffers' extents.
func (l *PrefillLayout) Extents(what string, p *PrefillPlan) (PrefillExtents, error) {
	e, err := l.validate(what, p)
	return PrefillExtents{Q: e.q, Cache: e.cache, Out: e.out, Table: e.table}, err
}

// DecodeTile is the decode kernel's KV tile (KVP_DECODE_TILE): a split's
// chunk of a sequence is a whole number of tiles.
const DecodeTile = decodeTile

// PrefillTileRows is the prefill kernel's packed query rows (tokens times
// group) per work item (kvp_prefill_tile_q).
func PrefillTileRows(d DType, headDim int) int { return prefillTileQ(d, headDim) }
