package cascade

import (
	"bytes"
	"math"
	"slices"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// Routes of a plan (kvp_attn_plan.route).
const (
	RoutePrefill = 1 // KVP_ATTN_ROUTE_PREFILL: nothing shared enough to pay in a batch with prefill rows; the prefill kernel
	RouteDecode  = 2 // KVP_ATTN_ROUTE_DECODE: nothing shared enough to pay; plain paged decode
	RouteCascade = 3 // KVP_ATTN_ROUTE_CASCADE: the cascade kernels over the plan
)

// DefaultSlots is the number of attention blocks assumed resident at once
// when the caller does not know the device (an H100: 132 SMs, 2 per SM).
const DefaultSlots = 264

// Input is a batch as the engine holds it on the host.
type Input struct {
	NumQHeads, NumKVHeads, HeadDim int
	DTypeBytes                     int // 2 (f16, bf16) or 4 (f32)
	BlockSize                      int
	// Tables is the block table, row b at Tables[b*TableStride:], of which
	// columns < MaxBlocksPerSeq are read.
	Tables          []int32
	TableStride     int
	MaxBlocksPerSeq int
	// SeqLens[b] is sequence b's length this step, its new tokens included.
	SeqLens []int32
	// QIndptr (batch + 1 offsets from 0, non-decreasing) gives sequence b the
	// query rows [QIndptr[b], QIndptr[b+1]) at positions [SeqLens[b] - q_len,
	// SeqLens[b]), as the prefill API has them; nil: one query token per
	// sequence (decode), row b.
	QIndptr []int32
	// Slots is how many attention blocks the device runs at once (SMs times
	// blocks per SM); 0 = DefaultSlots.
	Slots int
	// Headroom is how many tokens each tail may grow by before Update asks
	// for a new plan; 0 = 64 (at most one more KV tile per tail).
	Headroom int
	// NoDecodeRoute keeps the cascade route even when sharing does not pay
	// (one captured graph for every batch).
	NoDecodeRoute bool
	// PlainPrefillFaster sends a batch with prefill rows to the prefill
	// route whatever it shares (unless NoDecodeRoute): on a device whose
	// plain prefill kernel (Hopper's wgmma one) outruns the cascade kernel's
	// shared items, reading a shared prompt once per batch does not pay.
	PlainPrefillFaster bool
	// SharedWgmma: the shared items run on Hopper's wgmma mainloop (128-token
	// tiles at about a decode tile's time per token), not the sm_80 tile, and
	// so do the tails of more than a decode tail's rows, cut into its 128-row
	// tiles (the plan still runs on the sm_80 kernel, two 64-row tiles each).
	SharedWgmma bool
}

// Summary is what a plan holds besides its arrays.
type Summary struct {
	Route       int
	Batch       int
	Rows        int // query rows (total_q; Batch in decode)
	MaxQLen     int
	Items       int
	Parts       int
	Nodes       int
	Chunk       int   // tokens per KV chunk
	MaxKV       int   // longest planned length, tail capacities included
	SavedTokens int64 // KV tokens per kv head that shared reads save (one read per sharing sequence)
	TotalTokens int64 // KV tokens per kv head that plain decode reads
	Gen         int32 // the plan's generation in its workspace
	// PrefillMainloop: on the prefill route, the mainloop its work list was
	// cut for (SetPrefillMainloop); -1 when none was recorded.
	PrefillMainloop int
}

// node is a shared run: tokens [begin, end) of every member's sequence,
// read through rep's table row; members are order[mBegin:mBegin+mCount],
// whose query tokens are tokens [tBegin, tBegin+tCount) of the plan's qrows.
type node struct {
	rep, begin, end, mBegin, mCount, chunks, partBase, tBegin, tCount int32
}

// Planner holds scratch memory reused across plans; not safe for concurrent
// use. The zero value is ready.
type Planner struct {
	full   []int32 // per sequence: shareable (whole, in-table, before its first query token) blocks
	pos    []int32 // per sequence: its first query token's index in qrows
	keys   []uint64
	nodes  []node
	nseg   []int32
	in     *Input
	order  []int32 // sequences, members of every node contiguous
	tail   []int32 // per sequence: tail begin (tokens)
	tcs    []int32 // per sequence: tail chunks
	qlen   []int32 // per sequence: query tokens
	qstart []int32 // per sequence: first query row; [B] = rows
	bs     int32
	qGroup int32 // q heads per kv head
	tileQ  int32 // packed rows per shared item
	// tailTile is the packed rows per item of a tail longer than
	// decodeTailRows: TailTileQ on the sm_80 tile, SM90TileQ when the tails
	// run on the wgmma mainloop (SharedWgmma).
	tailTile int32
	// hopperItems is how many items at the list's start the wgmma launch
	// runs: the shared items, and with SharedWgmma the long tails.
	hopperItems int32
	// prefill: the batch has prefill rows (a query longer than one token, or
	// sequences without one).
	prefill   bool
	nodeChunk int64 // tokens per KV chunk of the shared runs (chunking)
	vbyte     int64 // bytes of one token's K and V per kv head
	pcost     int64 // bytes of one query token's partial state per kv head (write + read)

	keepAll bool // tests: emit every shared run, paying or not
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// checkInput validates the batch against the layout and fills p.qlen and
// p.qstart; it returns the query rows.
func (p *Planner) checkInput(in *Input, l *Layout) (int, error) {
	b := len(in.SeqLens)
	if b > l.MaxBatch {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: batch %d exceeds the workspaces' max_batch %d", b, l.MaxBatch)
	}
	if in.BlockSize < 1 || in.BlockSize > 1<<20 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: block_size must be in [1, 2^20]: got %d", in.BlockSize)
	}
	if in.MaxBlocksPerSeq < 1 || in.MaxBlocksPerSeq > 1<<30 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: max_blocks_per_seq must be in [1, 2^30]: got %d", in.MaxBlocksPerSeq)
	}
	if in.TableStride < in.MaxBlocksPerSeq {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: block_table_stride (%d) must be >= max_blocks_per_seq (%d)", in.TableStride, in.MaxBlocksPerSeq)
	}
	if b > 0 && int64(len(in.Tables)) < int64(b-1)*int64(in.TableStride)+int64(in.MaxBlocksPerSeq) {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: the block table holds %d entries; %d rows of stride %d need %d", len(in.Tables), b, in.TableStride, int64(b-1)*int64(in.TableStride)+int64(in.MaxBlocksPerSeq))
	}
	if in.Headroom < 0 || in.Headroom > 1<<24 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: headroom must be in [0, 2^24]: got %d", in.Headroom)
	}
	capTok := int64(in.MaxBlocksPerSeq) * int64(in.BlockSize)
	for s, n := range in.SeqLens {
		if n < 0 || int64(n) > capTok {
			return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: seq_lens[%d] = %d is outside [0, max_blocks_per_seq * block_size = %d]", s, n, capTok)
		}
	}
	p.qlen = grow(p.qlen, b)
	p.qstart = grow(p.qstart, b+1)
	if in.QIndptr == nil {
		for s := 0; s < b; s++ {
			p.qlen[s], p.qstart[s] = 1, int32(s)
		}
		p.qstart[b] = int32(b)
		return b, nil
	}
	qi := in.QIndptr
	if len(qi) != b+1 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: qo_indptr must hold batch + 1 = %d offsets: got %d", b+1, len(qi))
	}
	if qi[0] != 0 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: qo_indptr[0] must be 0: got %d", qi[0])
	}
	for s := 0; s < b; s++ {
		n := int64(qi[s+1]) - int64(qi[s])
		if n < 0 {
			return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: qo_indptr must not decrease: qo_indptr[%d] = %d > qo_indptr[%d] = %d", s, qi[s], s+1, qi[s+1])
		}
		if n > int64(in.SeqLens[s]) {
			return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: sequence %d has %d query tokens but length %d (the length counts them: it must be >= q_len)", s, n, in.SeqLens[s])
		}
		p.qlen[s], p.qstart[s] = int32(n), qi[s]
	}
	p.qstart[b] = qi[b]
	if int(qi[b]) > l.MaxTokens {
		return 0, kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: %d query tokens exceed the workspaces' max_tokens %d", qi[b], l.MaxTokens)
	}
	// The kernels count a node's or a tail's packed rows (query tokens
	// times q heads per kv head) in int32.
	if g := int64(in.NumQHeads / max(in.NumKVHeads, 1)); int64(qi[b])*g > math.MaxInt32 {
		return 0, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: %d query tokens x %d q heads per kv head = %d packed rows; at most 2^31-1", qi[b], g, int64(qi[b])*g)
	}
	return int(qi[b]), nil
}

// Cost model of the route decision for decode batches, fitted to H200
// measurements of bench/cascade_bench.py (fp16, 32 q / 8 kv heads, head_dim
// 128, block size 16, L2 flushed; the cascade kernels and plain decode
// timed in the same run), in microseconds per KV token of all kv heads at
// that shape, scaled to others by the bytes of a token's K and V:
//   - plain decode reads each sequence's tokens from HBM once (decHBM per
//     unique token), while the re-reads of blocks that other sequences of
//     the batch also hold mostly hit L2 (decL2 per re-read token);
//   - the cascade pays, per token of a shared run, one item per 128-row
//     tile of its members' packed rows (casShared per token and row tile:
//     the tile is bound by its matrix products), and casSpan per 64-token
//     tile of one shared chunk (the blocks that run a shared run's chunks
//     are few, and each runs its chunk's tiles one after another); per tail
//     token casTail (the decode kernel's 16-row tile: plain decode's cost,
//     as measured within a few percent); per sequence casSeq (its partial states written and merged,
//     scaled by q heads x head_dim); and casFixed for the two launches.
//
// Fitted on the four shared-prefix cases of issue 21 (B=32 P=2048 S=512,
// B=64 P=4096 S=512, B=96 P=1024 S=512, B=128 P=8192 S=256), the two-level
// tree, the fork case (residuals within 9 us) and tails alone (B=32 of 576
// and 2560 tokens, B=128 of 256 and 2048). Every sharing case measured
// faster on the cascade (61.5 vs 64.1 us at B=32 P=2048 up to 168 vs 695
// at B=128 P=8192), no sharing slower (151 vs 142 and 279 vs 267), and the
// model routes each the same way. Small batches route to plain decode: the
// fixed cost dominates what little they would save.
const (
	costRefTokenBytes = 8 * 2 * 128 * 2 // the fit's bytes of one token's K and V over all kv heads
	decHBM            = 1.05e-3
	decL2             = 0.66e-3
	casShared         = 2.19e-3
	casSpan           = 4.41
	casTail           = decHBM
	casSeq            = 0.039
	casFixed          = 15.9
)

// decodeCost and cascadeCost are the model's microseconds for the batch
// and for the plan's nodes (which must be grouped and chunked already).
func (p *Planner) decodeCost(l *Layout, total, saved int64) float64 {
	scale := float64(int64(p.in.NumKVHeads)*p.vbyte) / costRefTokenBytes
	return scale * (decHBM*float64(total-saved) + decL2*float64(saved))
}

func (p *Planner) cascadeCost(l *Layout, total, saved int64) float64 {
	in := p.in
	scale := float64(int64(in.NumKVHeads)*p.vbyte) / costRefTokenBytes
	var tiled, shared, span int64
	for i := range p.nodes {
		nd := &p.nodes[i]
		tiles := (int64(nd.tCount)*int64(l.Group) + int64(l.TileQ) - 1) / int64(l.TileQ)
		tiled += tiles * int64(nd.end-nd.begin)
		shared += int64(nd.mCount) * int64(nd.end-nd.begin)
		span = max(span, (min(int64(nd.end-nd.begin), p.nodeChunk)+chunkAlign-1)/chunkAlign)
	}
	heads := float64(in.NumQHeads*in.HeadDim) / (32 * 128)
	return scale*(casShared*float64(tiled)+casTail*float64(total-shared)) + casSpan*scale*float64(span) +
		casSeq*heads*float64(len(in.SeqLens)) + casFixed
}

// pays decides between the cascade and the plain route. Decode batches use
// the cost model above. Batches with prefill rows are bound by their MMAs,
// which sharing does not reduce (every query row still meets every token):
// there the shared read pays when the K/V reads it saves (the prefill kernel
// reads a sequence's tokens once per tile of its rows: 64 on the sm_80
// kernel, 128 on Hopper's, the long tails' tile) exceed what the partial
// states add.
func (p *Planner) pays(l *Layout, rows int, total, saved int64) bool {
	if len(p.nodes) == 0 {
		return false
	}
	if !p.prefill {
		return p.cascadeCost(l, total, saved) < p.decodeCost(l, total, saved)
	}
	g := int64(l.Group)
	var savedBytes, partBytes int64
	for i := range p.nodes {
		nd := &p.nodes[i]
		var plain int64
		for _, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
			plain += p.rowTiles(int(s))
		}
		once := (int64(nd.tCount)*g + int64(l.TileQ) - 1) / int64(l.TileQ)
		savedBytes += (plain - once) * int64(nd.end-nd.begin) * p.vbyte
		partBytes += int64(nd.tCount) * p.pcost
	}
	for s := range p.in.SeqLens {
		partBytes += int64(p.qlen[s]) * p.pcost
	}
	return savedBytes > 2*partBytes
}

// Plan writes the plan of in into ws (a host workspace of l.HostInts words)
// and returns its summary. Nothing is written on error.
func (p *Planner) Plan(in *Input, l *Layout, ws []int32) (Summary, error) {
	var sum Summary
	if len(ws) < l.HostInts || len(ws) < HeaderInts {
		return sum, kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: the host workspace holds %d bytes; %d needed", 4*len(ws), 4*l.HostInts)
	}
	if in.NumQHeads != l.NumQHeads || in.NumQHeads/max(in.NumKVHeads, 1) != l.Group || in.HeadDim != l.HeadDim {
		return sum, kverr.Errorf(kverr.InvalidArgument, "cascade_plan: heads (%d q, %d kv) or head_dim %d differ from the workspace layout's", in.NumQHeads, in.NumKVHeads, in.HeadDim)
	}
	rows, err := p.checkInput(in, l)
	if err != nil {
		return sum, err
	}
	B := len(in.SeqLens)
	if ws[hMagic] == planMagic {
		sum.Gen = ws[hGen] + 1
	}
	p.in, p.bs, p.qGroup, p.tileQ = in, int32(in.BlockSize), int32(l.Group), int32(l.TileQ)
	p.tailTile = TailTileQ
	if in.SharedWgmma {
		p.tailTile = SM90TileQ
	}
	p.prefill = false
	for _, q := range p.qlen[:B] {
		p.prefill = p.prefill || q != 1
	}
	p.vbyte = 2 * int64(in.HeadDim) * int64(max(in.DTypeBytes, 1))
	p.pcost = 2 * int64(l.Group) * int64(in.HeadDim+1) * 4
	p.full = grow(p.full, B)
	p.pos = grow(p.pos, B)
	p.keys = grow(p.keys, B)
	p.nseg = grow(p.nseg, B)
	p.order = grow(p.order, B)
	p.tail = grow(p.tail, B)
	p.tcs = grow(p.tcs, B)
	p.nodes = p.nodes[:0]
	var total int64
	for s := 0; s < B; s++ {
		p.order[s] = int32(s)
		n, q := in.SeqLens[s], p.qlen[s]
		total += int64(n)
		sum.MaxQLen = max(sum.MaxQLen, int(q))
		// A shared run must end at or before the first query token's
		// position + 1, so that every query token sees all of it (no mask);
		// a sequence without query tokens shares nothing.
		p.full[s] = 0
		if q > 0 {
			p.full[s] = min((n-q+1)/p.bs, int32(in.MaxBlocksPerSeq))
		}
		p.nseg[s] = 0
	}
	if B > 0 {
		p.group(0, B, 0, 0, 0)
	}
	p.tokens()
	var saved int64
	for i := range p.nodes {
		nd := &p.nodes[i]
		saved += int64(nd.mCount-1) * int64(nd.end-nd.begin)
	}
	sum.Batch, sum.Rows, sum.Nodes, sum.SavedTokens, sum.TotalTokens = B, rows, len(p.nodes), saved, total
	plain := func() (Summary, error) {
		sum.Route, sum.Chunk = RouteDecode, 0
		if p.prefill {
			sum.Route = RoutePrefill
		}
		sum.MaxKV = 0
		for s := 0; s < B; s++ {
			sum.MaxKV = max(sum.MaxKV, int(in.SeqLens[s]))
		}
		p.writeRows(ws, l, B)
		p.writeHeader(ws, l, &sum)
		return sum, nil
	}
	// A decode batch's cost depends on the chunks (the shared runs' span).
	need := int64(-1)
	if !p.prefill && len(p.nodes) > 0 {
		need = p.chunking(l, &sum)
	}
	if !in.NoDecodeRoute && !p.keepAll && ((p.prefill && in.PlainPrefillFaster) || !p.pays(l, rows, total, saved)) {
		return plain()
	}
	if need < 0 {
		need = p.chunking(l, &sum)
	}
	if need > int64(l.PartCap) {
		if in.NoDecodeRoute {
			return Summary{}, kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: the plan of %d query tokens needs %d partial states; the workspaces hold %d (size them with a larger max_tokens)", rows, need, l.PartCap)
		}
		sum.Chunk = 0
		return plain()
	}
	sum.Route = RouteCascade
	p.emit(ws, l, &sum)
	p.writeRows(ws, l, B)
	p.writeHeader(ws, l, &sum)
	return sum, nil
}

// tokens places the query tokens in the order of the sequences: sequence
// s's first at p.pos[s], so that every node's members' tokens are one
// contiguous range.
func (p *Planner) tokens() {
	t := int32(0)
	for _, s := range p.order {
		p.pos[s] = t
		t += p.qlen[s]
	}
	for i := range p.nodes {
		nd := &p.nodes[i]
		last := p.order[nd.mBegin+nd.mCount-1]
		nd.tBegin = p.pos[p.order[nd.mBegin]]
		nd.tCount = p.pos[last] + p.qlen[last] - nd.tBegin
	}
}

// writeRows writes the query-row regions: qrows (rows in the plan's order),
// rowseq and qstart.
func (p *Planner) writeRows(ws []int32, l *Layout, B int) {
	for _, s := range p.order[:B] {
		q0, n := p.qstart[s], p.qlen[s]
		qr := ws[l.QRows+int(p.pos[s]) : l.QRows+int(p.pos[s]+n)]
		rs := ws[l.RowSeq+int(q0) : l.RowSeq+int(q0+n)]
		for i := range qr {
			qr[i] = q0 + int32(i)
			rs[i] = s
		}
	}
	copy(ws[l.QStart:l.QStart+B+1], p.qstart[:B+1])
	copy(ws[l.TailBegin:l.TailBegin+B], p.tail[:B])
}

func clamp32(v int64) int32 { return int32(min(v, 1<<31-1)) }

func (p *Planner) writeHeader(ws []int32, l *Layout, s *Summary) {
	h := ws[:HeaderInts]
	clear(h)
	h[hMagic] = planMagic
	h[hItems] = int32(s.Items)
	h[hBatch] = int32(s.Batch)
	h[hNodes] = int32(s.Nodes)
	h[hParts] = int32(s.Parts)
	h[hChunk] = int32(s.Chunk)
	h[hMaxBatch] = int32(l.MaxBatch)
	h[hGroup] = int32(l.Group)
	h[hTileQ] = int32(l.TileQ)
	h[hBlockSize] = p.bs
	h[hMaxKV] = int32(s.MaxKV)
	h[hSaved] = clamp32(s.SavedTokens)
	h[hTotal] = clamp32(s.TotalTokens)
	h[hRoute] = int32(s.Route)
	h[hGen] = s.Gen
	h[hRows] = int32(s.Rows)
	h[hMaxTokens] = int32(l.MaxTokens)
	h[hMaxQLen] = int32(s.MaxQLen)
	h[hTailTileQ] = p.tailTile
	h[hHopperItems] = p.hopperItems
	h[hPrefillMainloop] = 0 // the attention layer records it once it has planned the prefill route
	s.PrefillMainloop = -1
	if s.Route != RouteCascade {
		h[hItems], h[hParts], h[hHopperItems] = 0, 0, 0
	}
}

// worth reports whether a run of t tokens shared by the sequences b saves
// more than twice what its partial states cost (written by the chunk pass,
// read by the merge). In decode the run is read once instead of once per
// member; with prefill rows, once per tile of the members' packed rows
// instead of once per row tile of each member's (the prefill kernel's).
func (p *Planner) worth(b []int32, t int32) bool {
	if p.keepAll {
		return true
	}
	var tokens, reads int64
	g := int64(p.qGroup)
	for _, s := range b {
		tokens += int64(p.qlen[s])
		reads += p.rowTiles(int(s))
	}
	if p.prefill {
		reads -= (tokens*g + int64(p.tileQ) - 1) / int64(p.tileQ)
	} else {
		reads = int64(len(b) - 1)
	}
	return reads*int64(t)*p.vbyte > 2*tokens*p.pcost
}

// group partitions the members order[lo:hi], which share columns [?, col),
// by their block at column col. pend is the first column not covered by an
// emitted node on their path; depth is the number of emitted nodes on it.
func (p *Planner) group(lo, hi int, col, pend int32, depth int32) {
	in := p.in
	ms := p.order[lo:hi]
	if len(ms) == 1 {
		p.setTail(ms[0], pend)
		return
	}
	// Members with no whole block at col end here; move them to the front.
	k := 0
	for i, s := range ms {
		if p.full[s] <= col {
			p.setTail(s, pend)
			ms[i], ms[k] = ms[k], ms[i]
			k++
		}
	}
	rest := ms[k:]
	base := lo + k
	if len(rest) == 0 {
		return
	}
	at := func(s int32) int32 { return in.Tables[int64(s)*int64(in.TableStride)+int64(col)] }
	first := at(rest[0])
	same := true
	for _, s := range rest[1:] {
		if at(s) != first {
			same = false
			break
		}
	}
	if !same {
		keys := p.keys[:len(rest)]
		for i, s := range rest {
			keys[i] = uint64(uint32(at(s)))<<32 | uint64(uint32(s))
		}
		slices.Sort(keys)
		for i := range rest {
			rest[i] = int32(uint32(keys[i]))
		}
	}
	for i := 0; i < len(rest); {
		j := i + 1
		id := at(rest[i])
		for j < len(rest) && at(rest[j]) == id {
			j++
		}
		b := rest[i:j]
		if len(b) == 1 {
			p.setTail(b[0], pend)
		} else {
			end := col + p.commonRun(b, col)
			if depth < MaxParts-1 && p.worth(b, (end-pend)*p.bs) {
				p.nodes = append(p.nodes, node{rep: b[0], begin: pend * p.bs, end: end * p.bs,
					mBegin: int32(base + i), mCount: int32(len(b))})
				p.group(base+i, base+j, end, end, depth+1)
			} else {
				p.group(base+i, base+j, end, pend, depth)
			}
		}
		i = j
	}
}

func (p *Planner) setTail(s, pend int32) {
	p.tail[s] = pend * p.bs
}

// commonRun is the number of columns from col on (at least 1: the members
// share col) that every member of b has whole and equal.
func (p *Planner) commonRun(b []int32, col int32) int32 {
	in := p.in
	limit := int32(1 << 30)
	for _, s := range b {
		limit = min(limit, p.full[s]-col)
	}
	row := func(s int32) []int32 {
		o := int64(s)*int64(in.TableStride) + int64(col)
		return in.Tables[o : o+int64(limit)]
	}
	r0 := row(b[0])
	for _, s := range b[1:] {
		limit = min(limit, mismatch(r0[:limit], row(s)[:limit]))
		if limit <= 1 {
			return 1
		}
	}
	return limit
}

func asBytes(s []int32) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), 4*len(s))
}

// mismatch is the first index where a and b (equal lengths) differ, or
// len(a). Rows of a shared run are usually equal to the end, so the whole
// range is compared first with the runtime's vectorised memequal; a
// mismatch is then narrowed by 64- and 8-entry chunks.
func mismatch(a, b []int32) int32 {
	if bytes.Equal(asBytes(a), asBytes(b)) {
		return int32(len(a))
	}
	i := 0
	for _, c := range [...]int{64, 8} {
		for ; i+c <= len(a); i += c {
			if !bytes.Equal(asBytes(a[i:i+c]), asBytes(b[i:i+c])) {
				break
			}
		}
	}
	for ; i < len(a); i++ {
		if a[i] != b[i] {
			return int32(i)
		}
	}
	return int32(len(a))
}

// tileWeight is the time of one 64-token K/V tile of an item with `rows`
// packed rows, in units of a decode tail's 16-row tile: the tile's matrix
// products grow with its rows (rows / 32), while a decode tile is bound by
// its reads. H200, one block per SM: a 128-row shared tile takes about 5 us,
// a decode tail's about 1.3.
func tileWeight(rows int64) int64 { return max(1, rows/32) }

// chunking picks the tokens per KV chunk of the tails (sum.Chunk) and of the
// shared runs (p.nodeChunk): items of about equal time, about two per
// resident block, whole 64-token tiles, tails of at least 256 tokens, a
// shared run's chunk shorter by its tiles' weight; then doubles both until
// every query token's partial states fit MaxParts and all of them the
// workspaces' PartCap. It returns the partial states the plan needs at that
// chunk (above PartCap: the plan does not fit).
func (p *Planner) chunking(l *Layout, sum *Summary) int64 {
	in := p.in
	slots := int64(in.Slots)
	if slots <= 0 {
		slots = DefaultSlots
	}
	g := int64(l.Group)
	// A shared tile's weight and a long tail's, and the shared chunks'
	// alignment (the wgmma mainloop's K/V tiles are 128 tokens).
	sw, tw, align := tileWeight(int64(l.TileQ)), tileWeight(TailTileQ), int64(chunkAlign)
	if in.SharedWgmma {
		sw, tw, align = 1, 1, 2*chunkAlign
	}
	// work: KV tokens read per kv head, weighted by row tiles and their
	// weight; tiled: the shared runs' and the long tails' part of it, in
	// row tiles alone (what the wgmma launch runs when SharedWgmma).
	var work, tiled int64
	for i := range p.nodes {
		nd := &p.nodes[i]
		t := (int64(nd.tCount)*g + int64(l.TileQ) - 1) / int64(l.TileQ) * int64(nd.end-nd.begin)
		work += t * sw
		tiled += t
	}
	for s, n := range in.SeqLens {
		if !p.longTail(s) {
			work += int64(n - p.tail[s])
			continue
		}
		t := p.rowTiles(s) * int64(n-p.tail[s])
		work += t * tw
		tiled += t
	}
	ch := work * int64(in.NumKVHeads) / (2 * slots)
	// A chunk past every tail's length is one chunk a tail: no longer one
	// changes the plan, and items' bounds stay in int32.
	ch = min(max(256, (ch+chunkAlign-1)/chunkAlign*chunkAlign), maxChunk)
	// On the wgmma mainloop the shared items and the long tails run in a
	// launch of their own, one block per SM (half the cascade kernel's
	// slots): the shared chunks are cut so that its work fills those blocks.
	nc := int64(0)
	if in.SharedWgmma {
		nc = tiled * int64(in.NumKVHeads) / max(slots/2, 1)
		nc = max(align, (nc+align-1)/align*align)
	}
	var parts int64
	for ; ; ch *= 2 {
		for s := range p.nseg {
			p.nseg[s] = 0
		}
		parts = 0
		p.nodeChunk = max(align, (ch/sw+align-1)/align*align)
		if nc > 0 {
			p.nodeChunk = nc
			nc *= 2
		}
		for i := range p.nodes {
			nd := &p.nodes[i]
			nd.chunks = int32((int64(nd.end-nd.begin) + p.nodeChunk - 1) / p.nodeChunk)
			parts += int64(nd.chunks) * int64(nd.tCount)
			for _, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
				p.nseg[s] += nd.chunks
			}
		}
		ok := true
		for s := range in.SeqLens {
			tc, _ := p.tailChunks(s, ch)
			parts += int64(tc) * int64(p.qlen[s])
			if p.nseg[s]+tc > MaxParts {
				ok = false
			}
		}
		if ok && parts <= int64(l.PartCap) || ch >= maxChunk {
			break
		}
	}
	sum.Chunk = int(ch)
	return parts
}

// longTail reports whether sequence s's tail has more packed rows than the
// decode kernel's 16-row tile holds (the kernels' decode_tail test).
func (p *Planner) longTail(s int) bool { return int64(p.qlen[s])*int64(p.qGroup) > decodeTailRows }

// rowTiles is sequence s's packed rows in tiles of p.tailTile rows: its
// tail's items per KV chunk, and how often the plain prefill kernel, whose
// row tile that is, reads each of its tokens.
func (p *Planner) rowTiles(s int) int64 {
	tt := int64(p.tailTile)
	return (int64(p.qlen[s])*int64(p.qGroup) + tt - 1) / tt
}

// tailChunks is the chunks of sequence s's tail, planned with headroom and
// capped by its block table's capacity, and the tail's capacity end.
func (p *Planner) tailChunks(s int, ch int64) (int32, int32) {
	in := p.in
	h := int64(in.Headroom)
	if h == 0 {
		h = chunkAlign
	}
	tb := int64(p.tail[s])
	end := min(int64(in.SeqLens[s])+h, int64(in.MaxBlocksPerSeq)*int64(in.BlockSize))
	end = max(end, int64(in.SeqLens[s]))
	n := max(1, (end-tb+ch-1)/ch)
	return int32(n), int32(min(tb+n*ch, int64(in.MaxBlocksPerSeq)*int64(in.BlockSize), math.MaxInt32))
}

// emit writes items, merge segments and tail capacities.
func (p *Planner) emit(ws []int32, l *Layout, sum *Summary) {
	in := p.in
	B := len(in.SeqLens)
	ch := int32(sum.Chunk)
	items := ws[l.Items : l.Items+l.ItemCap*ItemInts]
	ni := 0
	parts := int32(0)
	put := func(rep, kb, ke, dyn, mb, mc, tile, pb int32) {
		it := items[ni*ItemInts : ni*ItemInts+ItemInts]
		it[iRep], it[iKVBegin], it[iKVEnd], it[iDynamic] = rep, kb, ke, dyn
		it[iMBegin], it[iMCount], it[iTile], it[iPartBase] = mb, mc, tile, pb
		ni++
	}
	tq := int32(l.TileQ)
	g := int32(l.Group)
	nch := int32(p.nodeChunk)
	for i := range p.nodes {
		nd := &p.nodes[i]
		nd.partBase = parts
		tiles := int32((int64(nd.tCount)*int64(g) + int64(tq) - 1) / int64(tq)) // the rows fit int32 (checked at planning)
		for c := int32(0); c < nd.chunks; c++ {
			kb := nd.begin + c*nch
			ke := min(nd.end, kb+nch)
			for t := int32(0); t < tiles; t++ {
				put(nd.rep, kb, ke, 0, nd.tBegin, nd.tCount, t, parts+c*nd.tCount)
			}
		}
		parts += nd.chunks * nd.tCount
	}
	tailEnd := ws[l.TailEnd : l.TailEnd+B]
	maxKV := 0
	// The tails longer than a decode tail first: on the wgmma mainloop they
	// join the shared items in the Hopper launch's prefix of the list.
	hopper := ni
	for pass := 0; pass < 2; pass++ {
		for s := 0; s < B; s++ {
			if p.longTail(s) != (pass == 0) {
				continue
			}
			q := p.qlen[s]
			tc, te := p.tailChunks(s, int64(ch))
			p.tcs[s] = tc
			tb := p.tail[s]
			tailEnd[s] = te
			maxKV = max(maxKV, int(tailEnd[s]))
			tailTiles := int32(p.rowTiles(s))
			for c := int32(0); c < tc; c++ {
				// In int64 first: tb + (c+1)*ch may pass int32 where the
				// tail's capacity does not (no key lies past 2^31-1).
				kb := tb + c*ch
				ke := int32(min(int64(tb)+int64(c+1)*int64(ch), math.MaxInt32))
				for t := int32(0); t < tailTiles; t++ {
					put(int32(s), kb, ke, 1, p.pos[s], q, t, parts+c*q)
				}
			}
			p.nseg[s] = parts // the tail's first partial state
			parts += tc * q
		}
		if pass == 0 && p.in.SharedWgmma {
			hopper = ni
		}
	}
	// Merge segments: per sequence, one per emitted node on its path, then
	// its tail. Counts first, in the order's place of each sequence.
	segStart := ws[l.SegStart : l.SegStart+B+1]
	cnt := p.keys[:B] // reuse: per sequence segment count
	for s := 0; s < B; s++ {
		cnt[s] = 1
	}
	for i := range p.nodes {
		nd := &p.nodes[i]
		for _, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
			cnt[s]++
		}
	}
	segStart[0] = 0
	for s := 0; s < B; s++ {
		segStart[s+1] = segStart[s] + int32(cnt[s])
		cnt[s] = uint64(segStart[s]) // fill cursor
	}
	segs := ws[l.Segs : l.Segs+l.SegCap*SegInts]
	for i := range p.nodes { // DFS order: a path's nodes come root first
		nd := &p.nodes[i]
		for _, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
			k := int(cnt[s]) * SegInts
			sg := segs[k : k+SegInts : k+SegInts]
			sg[0], sg[1], sg[2], sg[3] = nd.partBase+p.pos[s]-nd.tBegin, nd.chunks, nd.tCount, 0
			cnt[s]++
		}
	}
	for s := 0; s < B; s++ {
		k := int(cnt[s]) * SegInts
		segs[k], segs[k+1], segs[k+2], segs[k+3] = p.nseg[s], p.tcs[s], p.qlen[s], 0
	}
	sum.Items, sum.Parts, sum.MaxKV = ni, int(parts), maxKV
	p.hopperItems = int32(hopper)
}
