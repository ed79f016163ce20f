package cascade

import (
	"bytes"
	"slices"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// Routes of a plan (kvp_attn_plan.route).
const (
	RouteDecode  = 2 // KVP_ATTN_ROUTE_DECODE: nothing shared enough to pay; plain paged decode
	RouteCascade = 3 // KVP_ATTN_ROUTE_CASCADE: the cascade kernels over the plan
)

// DefaultSlots is the number of attention blocks assumed resident at once
// when the caller does not know the device (an H100: 132 SMs, 2 per SM).
const DefaultSlots = 264

// Input is a decode batch as the engine holds it on the host.
type Input struct {
	NumQHeads, NumKVHeads, HeadDim int
	DTypeBytes                     int // 2 (f16, bf16) or 4 (f32)
	BlockSize                      int
	// Tables is the block table, row b at Tables[b*TableStride:], of which
	// columns < MaxBlocksPerSeq are read.
	Tables          []int32
	TableStride     int
	MaxBlocksPerSeq int
	// SeqLens[b] is sequence b's length this step, its new token included.
	SeqLens []int32
	// Slots is how many attention blocks the device runs at once (SMs times
	// blocks per SM); 0 = DefaultSlots.
	Slots int
	// Headroom is how many tokens each tail may grow by before Update asks
	// for a new plan; 0 = 64 (at most one more KV tile per tail).
	Headroom int
	// NoDecodeRoute keeps the cascade route even when sharing does not pay
	// (one captured graph for every batch).
	NoDecodeRoute bool
}

// Summary is what a plan holds besides its arrays.
type Summary struct {
	Route       int
	Batch       int
	Items       int
	Parts       int
	Nodes       int
	Chunk       int   // tokens per KV chunk
	MaxKV       int   // longest planned length, tail capacities included
	SavedTokens int64 // KV tokens per kv head that shared reads save
	TotalTokens int64 // KV tokens per kv head that plain decode reads
	Gen         int32 // the plan's generation in its workspace
}

// node is a shared run: tokens [begin, end) of every member's sequence,
// read through rep's table row; members are order[mBegin:mBegin+mCount].
type node struct {
	rep, begin, end, mBegin, mCount, chunks, partBase int32
}

// Planner holds scratch memory reused across plans; not safe for concurrent
// use. The zero value is ready.
type Planner struct {
	full  []int32 // per sequence: shareable (whole, in-table) blocks
	pos   []int32 // per sequence: its index in the order
	keys  []uint64
	nodes []node
	nseg  []int32
	in    *Input
	order []int32
	tail  []int32 // per sequence: tail begin (tokens)
	tcs   []int32 // per sequence: tail chunks
	bs    int32
	vbyte int64 // bytes of one token's K and V per kv head
	pcost int64 // bytes of one member's partial state per kv head (write + read)

	keepAll bool // tests: emit every shared run, paying or not
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	return s[:n]
}

// checkInput validates the batch against the layout.
func checkInput(in *Input, l *Layout) error {
	b := len(in.SeqLens)
	if b > l.MaxBatch {
		return kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: batch %d exceeds the workspaces' max_batch %d", b, l.MaxBatch)
	}
	if in.BlockSize < 1 || in.BlockSize > 1<<20 {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_plan: block_size must be in [1, 2^20]: got %d", in.BlockSize)
	}
	if in.MaxBlocksPerSeq < 1 || in.MaxBlocksPerSeq > 1<<30 {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_plan: max_blocks_per_seq must be in [1, 2^30]: got %d", in.MaxBlocksPerSeq)
	}
	if in.TableStride < in.MaxBlocksPerSeq {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_plan: block_table_stride (%d) must be >= max_blocks_per_seq (%d)", in.TableStride, in.MaxBlocksPerSeq)
	}
	if b > 0 && int64(len(in.Tables)) < int64(b-1)*int64(in.TableStride)+int64(in.MaxBlocksPerSeq) {
		return kverr.Errorf(kverr.BufferTooSmall, "cascade_plan: the block table holds %d entries; %d rows of stride %d need %d", len(in.Tables), b, in.TableStride, int64(b-1)*int64(in.TableStride)+int64(in.MaxBlocksPerSeq))
	}
	if in.Headroom < 0 || in.Headroom > 1<<24 {
		return kverr.Errorf(kverr.InvalidArgument, "cascade_plan: headroom must be in [0, 2^24]: got %d", in.Headroom)
	}
	capTok := int64(in.MaxBlocksPerSeq) * int64(in.BlockSize)
	for s, n := range in.SeqLens {
		if n < 0 || int64(n) > capTok {
			return kverr.Errorf(kverr.InvalidArgument, "cascade_plan: seq_lens[%d] = %d is outside [0, max_blocks_per_seq * block_size = %d]", s, n, capTok)
		}
	}
	return nil
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
	if err := checkInput(in, l); err != nil {
		return sum, err
	}
	B := len(in.SeqLens)
	if ws[hMagic] == planMagic {
		sum.Gen = ws[hGen] + 1
	}
	p.in, p.bs = in, int32(in.BlockSize)
	p.vbyte = 2 * int64(in.HeadDim) * int64(max(in.DTypeBytes, 1))
	p.pcost = 2 * int64(l.Group) * int64(in.HeadDim+1) * 4
	p.full = grow(p.full, B)
	p.pos = grow(p.pos, B)
	p.keys = grow(p.keys, B)
	p.nseg = grow(p.nseg, B)
	p.nodes = p.nodes[:0]
	order := ws[l.Order : l.Order+B]
	tail := ws[l.TailBegin : l.TailBegin+B]
	p.order, p.tail = order, tail
	p.tcs = grow(p.tcs, B)
	var total int64
	for s := 0; s < B; s++ {
		order[s] = int32(s)
		n := in.SeqLens[s]
		total += int64(n)
		p.full[s] = min(n/p.bs, int32(in.MaxBlocksPerSeq))
		p.nseg[s] = 0
	}
	if B > 0 {
		p.group(0, B, 0, 0, 0)
	}
	var saved int64
	for i := range p.nodes {
		nd := &p.nodes[i]
		saved += int64(nd.mCount-1) * int64(nd.end-nd.begin)
	}
	sum.Batch, sum.Nodes, sum.SavedTokens, sum.TotalTokens = B, len(p.nodes), saved, total
	// Sharing pays when it saves a tenth of the bytes plain decode reads;
	// below that the extra partial states and the merge cost about what the
	// shared reads save.
	if !in.NoDecodeRoute && (len(p.nodes) == 0 || saved*10 < total) {
		sum.Route = RouteDecode
		for s := 0; s < B; s++ {
			sum.MaxKV = max(sum.MaxKV, int(in.SeqLens[s]))
		}
		p.writeHeader(ws, l, &sum)
		return sum, nil
	}
	sum.Route = RouteCascade
	p.chunking(l, &sum)
	p.emit(ws, l, &sum)
	p.writeHeader(ws, l, &sum)
	return sum, nil
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
	if s.Route == RouteDecode {
		h[hItems], h[hParts] = 0, 0
	}
}

// worth reports whether a run of t tokens shared by m sequences saves more
// than twice what its partial states cost (written by the chunk pass, read
// by the merge).
func (p *Planner) worth(m int, t int32) bool {
	if p.keepAll {
		return true
	}
	return int64(m-1)*int64(t)*p.vbyte > 2*int64(m)*p.pcost
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
			if depth < MaxParts-1 && p.worth(len(b), (end-pend)*p.bs) {
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

// chunking picks the tokens per KV chunk: items of about equal work, about
// two per resident block, whole 64-token tiles, at least 256 tokens; then
// doubles it until every sequence's partial states fit MaxParts.
func (p *Planner) chunking(l *Layout, sum *Summary) {
	in := p.in
	slots := int64(in.Slots)
	if slots <= 0 {
		slots = DefaultSlots
	}
	var work int64 // KV tokens read per kv head, weighted by row tiles
	for i := range p.nodes {
		nd := &p.nodes[i]
		tiles := (int64(nd.mCount)*int64(l.Group) + int64(l.TileQ) - 1) / int64(l.TileQ)
		work += tiles * int64(nd.end-nd.begin)
	}
	for s, n := range in.SeqLens {
		work += int64(n - p.tail[s])
	}
	ch := work * int64(in.NumKVHeads) / (2 * slots)
	ch = max(256, (ch+chunkAlign-1)/chunkAlign*chunkAlign)
	for ; ; ch *= 2 {
		for s := range p.nseg {
			p.nseg[s] = 0
		}
		for i := range p.nodes {
			nd := &p.nodes[i]
			nd.chunks = int32((int64(nd.end-nd.begin) + ch - 1) / ch)
			for _, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
				p.nseg[s] += nd.chunks
			}
		}
		ok := true
		for s := range in.SeqLens {
			if tc, _ := p.tailChunks(s, ch); p.nseg[s]+tc > MaxParts {
				ok = false
				break
			}
		}
		if ok || ch >= maxTokens/2 {
			break
		}
	}
	sum.Chunk = int(ch)
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
	return int32(n), int32(min(tb+n*ch, int64(in.MaxBlocksPerSeq)*int64(in.BlockSize)))
}

// emit writes items, merge segments and tail capacities.
func (p *Planner) emit(ws []int32, l *Layout, sum *Summary) {
	in := p.in
	B := len(in.SeqLens)
	ch := int32(sum.Chunk)
	for j, s := range p.order {
		p.pos[s] = int32(j)
	}
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
	for i := range p.nodes {
		nd := &p.nodes[i]
		nd.partBase = parts
		tiles := (nd.mCount*g + tq - 1) / tq
		for c := int32(0); c < nd.chunks; c++ {
			kb := nd.begin + c*ch
			ke := min(nd.end, kb+ch)
			for t := int32(0); t < tiles; t++ {
				put(nd.rep, kb, ke, 0, nd.mBegin, nd.mCount, t, parts+c*nd.mCount)
			}
		}
		parts += nd.chunks * nd.mCount
	}
	tailEnd := ws[l.TailEnd : l.TailEnd+B]
	tailTiles := (g + tq - 1) / tq
	maxKV := 0
	for s := 0; s < B; s++ {
		tc, te := p.tailChunks(s, int64(ch))
		p.tcs[s] = tc
		tb := p.tail[s]
		tailEnd[s] = te
		maxKV = max(maxKV, int(tailEnd[s]))
		for c := int32(0); c < tc; c++ {
			for t := int32(0); t < tailTiles; t++ {
				put(int32(s), tb+c*ch, tb+(c+1)*ch, 1, p.pos[s], 1, t, parts+c)
			}
		}
		p.nseg[s] = parts // the tail's first partial state
		parts += tc
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
		for j, s := range p.order[nd.mBegin : nd.mBegin+nd.mCount] {
			k := int(cnt[s]) * SegInts
			sg := segs[k : k+SegInts : k+SegInts]
			sg[0], sg[1], sg[2], sg[3] = nd.partBase+int32(j), nd.chunks, nd.mCount, 0
			cnt[s]++
		}
	}
	for s := 0; s < B; s++ {
		k := int(cnt[s]) * SegInts
		segs[k], segs[k+1], segs[k+2], segs[k+3] = p.nseg[s], p.tcs[s], 1, 0
	}
	sum.Items, sum.Parts, sum.MaxKV = ni, int(parts), maxKV
}
