package cascade_test

import (
	"fmt"
	. "github.com/kvplug/kvplug/core/cascade"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/testseed"
)

// span is one partial state's token range of one query token.
type span struct{ seq, tok, begin, end int32 }

// qlens is each sequence's query tokens (1 in decode).
func (b *batch) qlens() []int32 {
	q := make([]int32, len(b.lens))
	for s := range q {
		q[s] = 1
		if b.qo != nil {
			q[s] = b.qo[s+1] - b.qo[s]
		}
	}
	return q
}

// checkPlan verifies a cascade plan against the batch by brute force: the
// query-row maps are consistent; every shared item's tokens belong to
// members that hold the rep's blocks over its range, whole and before their
// first query token; a tail item's tokens are its sequence's; each query
// token's merge segments name partial states that cover [0, its sequence's
// length) exactly once (tails up to their planned capacity); capacities are
// respected.
// planPoisoned plans in into a fresh host workspace of layout l whose
// words all start poisoned (-7), so that a check reading a word the plan
// should have written sees garbage rather than a lucky zero; what names
// the case in a failure.
func planPoisoned(t *testing.T, p *Planner, in *Input, l *Layout, what string) ([]int32, Summary) {
	t.Helper()
	ws := make([]int32, l.HostInts)
	for i := range ws {
		ws[i] = -7
	}
	s, err := p.Plan(in, l, ws)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return ws, s
}

func checkPlan(t *testing.T, b *batch, in *Input, l *Layout, ws []int32, s Summary) {
	t.Helper()
	B := len(b.lens)
	if s.Route != RouteCascade {
		t.Fatalf("route %d, want cascade", s.Route)
	}
	if s.Parts > l.PartCap || s.Items > l.ItemCap {
		t.Fatalf("parts %d / items %d exceed capacities %d / %d", s.Parts, s.Items, l.PartCap, l.ItemCap)
	}
	ql := b.qlens()
	qs := ws[l.QStart : l.QStart+B+1]
	rows := int32(0)
	for sq := 0; sq < B; sq++ {
		if qs[sq] != rows {
			t.Fatalf("qstart[%d] = %d, want %d", sq, qs[sq], rows)
		}
		rows += ql[sq]
	}
	if qs[B] != rows || s.Rows != int(rows) {
		t.Fatalf("rows %d / qstart[B] %d, want %d", s.Rows, qs[B], rows)
	}
	qrows := ws[l.QRows : l.QRows+int(rows)]
	rowSeq := ws[l.RowSeq : l.RowSeq+int(rows)]
	at := make([]int32, B) // each sequence's first token in qrows
	for i := range at {
		at[i] = -1
	}
	seen := make([]bool, rows)
	for k, r := range qrows {
		if r < 0 || r >= rows || seen[r] {
			t.Fatalf("qrows is not a permutation of the rows: %v", qrows)
		}
		seen[r] = true
		sq := rowSeq[r]
		if sq < 0 || int(sq) >= B || r < qs[sq] || r >= qs[sq+1] {
			t.Fatalf("rowseq[%d] = %d, outside its rows", r, sq)
		}
		if r == qs[sq] {
			at[sq] = int32(k)
		}
		if k > 0 && qrows[k-1]+1 != r && r != qs[sq] {
			t.Fatalf("qrows: sequence %d's tokens are not contiguous and in order", sq)
		}
	}
	owner := make([]span, s.Parts) // partial state -> (sequence, token, range)
	for i := range owner {
		owner[i].seq = -1
	}
	tb, te := ws[l.TailBegin:l.TailBegin+B], ws[l.TailEnd:l.TailEnd+B]
	for i := 0; i < s.Items; i++ {
		it := ws[l.Items+i*ItemInts : l.Items+(i+1)*ItemInts]
		rep, kb, ke := it[IRep], it[IKVBegin], it[IKVEnd]
		mb, mc := it[IMBegin], it[IMCount]
		// On the wgmma mainloop the shared runs have chunks of their own.
		long := ke-kb > int32(s.Chunk) && (it[IDynamic] != 0 || !in.SharedWgmma)
		if mc < 1 || mb < 0 || mb+mc > rows || kb < 0 || ke <= kb || long {
			t.Fatalf("item %d malformed: %v (chunk %d)", i, it, s.Chunk)
		}
		// The wgmma launch's prefix: the shared items, then (cut for it)
		// the tails of more than a decode tail's rows; the rest are tails
		// for the cascade kernel.
		wgmmaItem := it[IDynamic] == 0 || in.SharedWgmma && mc*int32(l.Group) > DecodeTailRows
		if (int32(i) < ws[HHopperItems]) != wgmmaItem {
			t.Fatalf("item %d (%v) on the wrong side of the wgmma launch's %d items", i, it, ws[HHopperItems])
		}
		tq := int32(l.TileQ)
		if it[IDynamic] != 0 {
			tq = ws[HTailTileQ]
			if want := map[bool]int32{false: TailTileQ, true: SM90TileQ}[in.SharedWgmma]; tq != want {
				t.Fatalf("tail tile %d in the header; want %d (SharedWgmma %v)", tq, want, in.SharedWgmma)
			}
		}
		if it[ITile] < 0 || it[ITile]*tq >= mc*int32(l.Group) {
			t.Fatalf("item %d: tile %d outside %d rows", i, it[ITile], mc*int32(l.Group))
		}
		if it[IDynamic] != 0 {
			if mc != ql[rep] || mb != at[rep] || kb < tb[rep] || ke > te[rep]+int32(s.Chunk) {
				t.Fatalf("tail item %d malformed: %v (tail [%d, %d), q_len %d at %d)", i, it, tb[rep], te[rep], ql[rep], at[rep])
			}
		} else if kb%int32(b.bs) != 0 || ke%int32(b.bs) != 0 && ke != kb+int32(s.Chunk) {
			t.Fatalf("shared item %d: range [%d, %d) not block aligned", i, kb, ke)
		}
		for k := mb; k < mb+mc; k++ {
			sq := rowSeq[qrows[k]]
			if it[IDynamic] == 0 {
				if first := b.lens[sq] - ql[sq]; ke > first+1 {
					t.Fatalf("shared item %d: member %d's first query token is at %d, the range ends at %d", i, sq, first, ke)
				}
				for c := kb / int32(b.bs); c < (ke+int32(b.bs)-1)/int32(b.bs); c++ {
					if b.table[int(sq)*b.stride+int(c)] != b.table[int(rep)*b.stride+int(c)] {
						t.Fatalf("shared item %d: member %d's block at column %d differs from rep %d's", i, sq, c, rep)
					}
				}
			}
			pi := it[IPartBase] + k - mb
			if pi < 0 || int(pi) >= s.Parts {
				t.Fatalf("item %d: partial %d outside %d", i, pi, s.Parts)
			}
			o := &owner[pi]
			want := span{sq, qrows[k] - qs[sq], kb, ke}
			if o.seq >= 0 && *o != want {
				t.Fatalf("partial %d written by two items with different spans", pi)
			}
			*o = want
		}
	}
	segStart := ws[l.SegStart : l.SegStart+B+1]
	used := make([]bool, s.Parts)
	for sq := int32(0); sq < int32(B); sq++ {
		for tok := int32(0); tok < ql[sq]; tok++ {
			next := int32(0)
			for k := segStart[sq]; k < segStart[sq+1]; k++ {
				sg := ws[l.Segs+int(k)*SegInts : l.Segs+int(k+1)*SegInts]
				for c := int32(0); c < sg[1]; c++ {
					pi := sg[0] + tok + c*sg[2]
					if pi < 0 || int(pi) >= s.Parts || used[pi] {
						t.Fatalf("seq %d token %d: partial %d out of range or merged twice", sq, tok, pi)
					}
					used[pi] = true
					o := owner[pi]
					if o.seq != sq || o.tok != tok || o.begin != next {
						t.Fatalf("seq %d token %d: partial %d covers seq %d token %d [%d, %d); expected a span from %d", sq, tok, pi, o.seq, o.tok, o.begin, o.end, next)
					}
					next = o.end
				}
			}
			if next < b.lens[sq] || next < te[sq] {
				t.Fatalf("seq %d token %d (len %d, tail capacity %d): states cover [0, %d)", sq, tok, b.lens[sq], te[sq], next)
			}
		}
		if b.lens[sq] < tb[sq] || b.lens[sq] > te[sq] {
			t.Fatalf("seq %d: len %d outside its tail [%d, %d]", sq, b.lens[sq], tb[sq], te[sq])
		}
	}
	for pi, u := range used {
		if !u {
			t.Fatalf("partial %d is never merged", pi)
		}
	}
}

// bruteSaved is the KV tokens per kv head that reading every run of whole
// blocks shared by 2+ sequences once saves: at each column, the classes of
// sequences with equal table prefixes through that column (whole blocks
// only) save (size - 1) blocks each.
func bruteSaved(b *batch) int64 {
	var saved int64
	class := make([]int, len(b.lens)) // class of each sequence's prefix through the previous column
	for c := 0; c < b.maxBlocks; c++ {
		next := map[[2]int]int{} // (previous class, block id) -> class
		size := map[int]int{}
		for s, n := range b.lens {
			if int(n)/b.bs <= c {
				class[s] = -1 // no whole block here: shares nothing further
				continue
			}
			if class[s] < 0 {
				continue
			}
			k := [2]int{class[s], int(b.table[s*b.stride+c])}
			id, ok := next[k]
			if !ok {
				id = len(next)
				next[k] = id
			}
			class[s] = id
			size[id]++
		}
		for _, n := range size {
			saved += int64(n-1) * int64(b.bs)
		}
	}
	return saved
}

// bruteTail is sequence s's longest run of whole blocks shared with another
// sequence, in tokens.
func bruteTail(b *batch, s int) int32 {
	best := 0
	fs := int(b.lens[s]) / b.bs
	for o := range b.lens {
		if o == s {
			continue
		}
		n := min(fs, int(b.lens[o])/b.bs, b.maxBlocks)
		c := 0
		for c < n && b.table[s*b.stride+c] == b.table[o*b.stride+c] {
			c++
		}
		best = max(best, c)
	}
	return int32(best * b.bs)
}

// Random trees (depth 0-4, groups 1-40, block sizes 1/16/64, tails 0-300,
// lengths ending inside shared runs): every plan checks out by brute force,
// and when every shared run pays (long runs, keepAll) the plan's saving is
// the brute-force maximum and each tail starts where its sequence's longest
// sharing ends.
func TestPlanRandomTrees(t *testing.T) {
	r := testseed.Rand(t, 11)
	var p Planner
	for iter := 0; iter < 400; iter++ {
		spec := randomSpec(r, 40, 300)
		b := genTree(r, spec)
		qh, kvh, D := cycleHeads(iter)
		in := b.input(qh, kvh, D)
		in.NoDecodeRoute = true
		in.Slots = 1 + r.IntN(600)
		if r.IntN(3) == 0 {
			in.Headroom = r.IntN(1000)
		}
		l, err := NewLayout(len(b.lens)+r.IntN(3), qh, kvh, D)
		if err != nil {
			t.Fatal(err)
		}
		p.SetKeepAll(iter%2 == 0)
		ws, s := planPoisoned(t, &p, in, &l, fmt.Sprintf("iter %d %+v", iter, spec))
		checkPlan(t, b, in, &l, ws, s)
		deepest := int32(0) // emitted nodes on the longest path
		for sq := range b.lens {
			deepest = max(deepest, ws[l.SegStart+sq+1]-ws[l.SegStart+sq]-1)
		}
		if p.KeepAll() && deepest < MaxParts-1 {
			if want := bruteSaved(b); s.SavedTokens != want {
				t.Fatalf("iter %d %+v: saved %d tokens, brute force %d", iter, spec, s.SavedTokens, want)
			}
			tb := ws[l.TailBegin : l.TailBegin+len(b.lens)]
			for sq := range b.lens {
				if want := bruteTail(b, sq); tb[sq] != want {
					t.Fatalf("iter %d: seq %d tail starts at %d, brute force %d", iter, sq, tb[sq], want)
				}
			}
		}
		if !p.KeepAll() && s.SavedTokens > bruteSaved(b) {
			t.Fatalf("iter %d: saved %d above the brute-force maximum %d", iter, s.SavedTokens, bruteSaved(b))
		}
	}
}

// Sharing that does not pay goes to plain decode: no sharing at all, two
// sequences sharing one small block, a tiny shared part of long sequences.
func TestPlanDecodeRoute(t *testing.T) {
	r := testseed.Rand(t, 11)
	l, _ := NewLayout(64, 32, 8, 128)
	ws := make([]int32, l.HostInts)
	var p Planner
	none := genTree(r, treeSpec{seqs: 64, depth: 0, maxTail: 4000, bs: 16})
	if s, err := p.Plan(none.input(32, 8, 128), &l, ws); err != nil || s.Route != RouteDecode || s.SavedTokens != 0 {
		t.Fatalf("no sharing: %+v %v", s, err)
	}
	// Two sequences sharing one 16-token block: the partial states cost more
	// than the 16 tokens read once.
	b := &batch{bs: 16, maxBlocks: 2, stride: 2, table: []int32{5, 6, 5, 7}, lens: []int32{20, 30}}
	if s, err := p.Plan(b.input(32, 8, 128), &l, ws); err != nil || s.Route != RouteDecode || s.Nodes != 0 {
		t.Fatalf("one shared block: %+v %v", s, err)
	}
	// 64 sequences of 8000 own tokens sharing 64: saves under a tenth.
	small := &batch{bs: 16, maxBlocks: 504, stride: 504, table: make([]int32, 64*504), lens: make([]int32, 64)}
	for s := 0; s < 64; s++ {
		for c := 0; c < 504; c++ {
			small.table[s*504+c] = int32(1000 + s*504 + c)
		}
		for c := 0; c < 4; c++ {
			small.table[s*504+c] = int32(c)
		}
		small.lens[s] = 8000
	}
	if s, err := p.Plan(small.input(32, 8, 128), &l, ws); err != nil || s.Route != RouteDecode || s.Nodes != 1 {
		t.Fatalf("small shared part: %+v %v", s, err)
	}
	// The same with a 4096-token shared prompt pays.
	for s := 0; s < 64; s++ {
		for c := 0; c < 256; c++ {
			small.table[s*504+c] = int32(c)
		}
	}
	if s, err := p.Plan(small.input(32, 8, 128), &l, ws); err != nil || s.Route != RouteCascade || s.SavedTokens != 63*4096 {
		t.Fatalf("shared prompt: %+v %v", s, err)
	}
}

// Update absorbs growth within each tail's capacity, and asks for a new
// plan when a tail outgrows it or a length falls below the shared part.
func TestUpdate(t *testing.T) {
	r := testseed.Rand(t, 11)
	b := widen(genTree(r, treeSpec{seqs: 24, depth: 2, maxRun: 20, maxTail: 200, bs: 16}), 20)
	in := b.input(8, 2, 64)
	in.NoDecodeRoute = true
	l, _ := NewLayout(32, 8, 2, 64)
	ws := make([]int32, l.HostInts)
	var p Planner
	s, err := p.Plan(in, &l, ws)
	if err != nil {
		t.Fatal(err)
	}
	lens := append([]int32(nil), b.lens...)
	te := ws[l.TailEnd : l.TailEnd+24]
	tb := ws[l.TailBegin : l.TailBegin+24]
	steps := 0
	for {
		for i := range lens {
			lens[i]++
		}
		ok, err := Update(ws, &l, s.Route, 24, lens)
		if err != nil {
			t.Fatal(err)
		}
		fits := true
		for i := range lens {
			fits = fits && lens[i] <= te[i]
		}
		if ok != fits {
			t.Fatalf("step %d: update says %v, capacities say %v", steps, ok, fits)
		}
		if !ok {
			break
		}
		steps++
	}
	if steps < 63 { // default headroom: at least 64 tokens per tail
		t.Fatalf("only %d steps absorbed", steps)
	}
	lens = append(lens[:0], b.lens...)
	for i := range lens {
		if tb[i] > 0 {
			lens[i] = tb[i] - 1
			if ok, err := Update(ws, &l, s.Route, 24, lens); ok || err != nil {
				t.Fatalf("length below the shared part accepted: %v %v", ok, err)
			}
			break
		}
	}
	if _, err := Update(ws, &l, s.Route, 23, lens[:23]); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("batch mismatch: %v", err)
	}
	if ok, err := Update(ws, &l, RouteDecode, 24, b.lens); !ok || err != nil {
		t.Fatalf("decode route: %v %v", ok, err)
	}
}

// ReadPlan reads back what Plan wrote: the layout of the plan's capacities
// and its summary; a workspace short of the layout is reported, not read.
func TestReadPlan(t *testing.T) {
	r := testseed.Rand(t, 11)
	b := widen(genTree(r, treeSpec{seqs: 24, depth: 2, maxRun: 20, maxTail: 200, bs: 16}), 20)
	in := b.input(8, 2, 64)
	l, _ := NewPrefillLayout(32, 48, 8, 2, 64)
	ws := make([]int32, l.HostInts)
	var p Planner
	s, err := p.Plan(in, &l, ws)
	if err != nil {
		t.Fatal(err)
	}
	got, gs, fits, err := ReadPlan(ws, 32, 8, 2, 64)
	if err != nil || !fits || got != l || gs != s {
		t.Fatalf("read back %+v %+v %v %v; planned %+v %+v", got, gs, fits, err, l, s)
	}
	// The prefill route's mainloop, recorded after the plan, reads back; a
	// new plan clears it.
	for _, m := range []int{0, 1} {
		SetPrefillMainloop(ws, m)
		if _, gs, _, err := ReadPlan(ws, 32, 8, 2, 64); err != nil || gs.PrefillMainloop != m {
			t.Fatalf("mainloop %d read back as %d (%v)", m, gs.PrefillMainloop, err)
		}
	}
	if s, err := p.Plan(in, &l, ws); err != nil || s.PrefillMainloop != -1 {
		t.Fatalf("a new plan keeps a mainloop: %+v, %v", s, err)
	}
	if _, gs, _, _ := ReadPlan(ws, 32, 8, 2, 64); gs.PrefillMainloop != -1 {
		t.Fatalf("a new plan's header keeps mainloop %d", gs.PrefillMainloop)
	}
	for _, n := range []int{0, 1, l.HostInts - 1} {
		if _, _, fits, err := ReadPlan(ws[:n], 32, 8, 2, 64); fits || err != nil {
			t.Fatalf("%d words: fits %v, %v", n, fits, err)
		}
	}
	if _, _, _, err := ReadPlan(ws, 0, 8, 2, 64); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("max_batch 0: %v", err)
	}
	if _, _, fits, err := ReadPlan(make([]int32, l.HostInts), 32, 8, 2, 64); !fits || kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("empty workspace: fits %v, %v", fits, err)
	}
}

// Bad inputs are status codes with messages, and write nothing.
func TestPlanErrors(t *testing.T) {
	r := testseed.Rand(t, 11)
	b := genTree(r, treeSpec{seqs: 8, depth: 1, maxRun: 4, maxTail: 40, bs: 16})
	l, _ := NewLayout(8, 8, 2, 64)
	small, _ := NewLayout(4, 8, 2, 64)
	var p Planner
	ws := make([]int32, l.HostInts)
	cases := []struct {
		name string
		mod  func(in *Input)
		l    *Layout
		ws   []int32
		code kverr.Code
	}{
		{"batch over capacity", func(in *Input) {}, &small, make([]int32, small.HostInts), kverr.BufferTooSmall},
		{"host workspace small", func(in *Input) {}, &l, ws[:l.HostInts-1], kverr.BufferTooSmall},
		{"block size 0", func(in *Input) { in.BlockSize = 0 }, &l, ws, kverr.InvalidArgument},
		{"stride", func(in *Input) { in.TableStride = in.MaxBlocksPerSeq - 1 }, &l, ws, kverr.InvalidArgument},
		{"table short", func(in *Input) { in.Tables = in.Tables[:7*in.TableStride+in.MaxBlocksPerSeq-1] }, &l, ws, kverr.BufferTooSmall},
		{"length over table", func(in *Input) { in.SeqLens = append([]int32{int32(in.MaxBlocksPerSeq*16 + 1)}, in.SeqLens[1:]...) }, &l, ws, kverr.InvalidArgument},
		{"negative length", func(in *Input) { in.SeqLens = append([]int32{-1}, in.SeqLens[1:]...) }, &l, ws, kverr.InvalidArgument},
		{"heads differ", func(in *Input) { in.NumQHeads = 16 }, &l, ws, kverr.InvalidArgument},
		{"headroom", func(in *Input) { in.Headroom = -1 }, &l, ws, kverr.InvalidArgument},
	}
	for _, c := range cases {
		in := b.input(8, 2, 64)
		c.mod(in)
		for i := range c.ws {
			c.ws[i] = 12345
		}
		_, err := p.Plan(in, c.l, c.ws)
		if kverr.CodeOf(err) != c.code || err.Error() == "" {
			t.Fatalf("%s: got %v, want code %v", c.name, err, c.code)
		}
		for i, v := range c.ws {
			if v != 12345 {
				t.Fatalf("%s: word %d written on error", c.name, i)
			}
		}
	}
	if _, err := NewLayout(0, 8, 2, 64); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatal("max_batch 0 accepted")
	}
	if _, err := NewLayout(8, 8, 3, 64); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatal("heads not a multiple accepted")
	}
	if _, err := NewLayout(8, 8, 2, 96); kverr.CodeOf(err) != kverr.Unsupported {
		t.Fatal("head_dim 96 accepted")
	}
	if _, err := Header(make([]int32, l.HostInts), &l); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatal("empty workspace read as a plan")
	}
}

// decodeTree is B decode sequences (block size 16): all share p tokens,
// groups of `group` share q more, each owns s.
func decodeTree(B, p, group, q, s int) *batch {
	cols := (p + q + s + 15) / 16
	b := &batch{bs: 16, maxBlocks: cols, stride: cols, table: make([]int32, B*cols), lens: make([]int32, B)}
	next := int32(0)
	id := map[[2]int]int32{}
	for i := 0; i < B; i++ {
		for c := 0; c < cols; c++ {
			key := [2]int{-1, c} // owned
			switch {
			case c < p/16:
				key = [2]int{B, c}
			case c < (p+q)/16 && group > 0:
				key = [2]int{B + 1 + i/group, c}
			default:
				key = [2]int{i, c}
			}
			v, ok := id[key]
			if !ok {
				v = next
				id[key] = v
				next++
			}
			b.table[i*cols+c] = v
		}
		b.lens[i] = int32(p + q + s)
	}
	b.numBlocks = int(next)
	return b
}

// The route cost model on the benchmark's decode cases (32 q / 8 kv heads,
// head_dim 128, fp16; H200): every sharing case, where the cascade measured
// faster than plain decode, routes to the cascade; no sharing to decode.
func TestPlanCostModel(t *testing.T) {
	cases := []struct {
		name string
		b    *batch
		want int
	}{
		{"B=32 P=2048 S=512", decodeTree(32, 2048, 0, 0, 512), RouteCascade},
		{"B=64 P=4096 S=512", decodeTree(64, 4096, 0, 0, 512), RouteCascade},
		{"B=96 P=1024 S=512", decodeTree(96, 1024, 0, 0, 512), RouteCascade},
		{"B=128 P=8192 S=256", decodeTree(128, 8192, 0, 0, 256), RouteCascade},
		{"two-level", decodeTree(128, 4096, 16, 1024, 256), RouteCascade},
		{"fork 64x4096 S=128", decodeTree(64, 4096, 0, 0, 128), RouteCascade},
		{"no sharing B=32 L=4096", decodeTree(32, 0, 0, 0, 4096), RouteDecode},
		{"no sharing B=128 L=2048", decodeTree(128, 0, 0, 0, 2048), RouteDecode},
	}
	var p Planner
	for _, c := range cases {
		l, err := NewLayout(len(c.b.lens), 32, 8, 128)
		if err != nil {
			t.Fatal(err)
		}
		ws := make([]int32, l.HostInts)
		s, err := p.Plan(c.b.input(32, 8, 128), &l, ws)
		if err != nil {
			t.Fatal(err)
		}
		dec, cas := p.DecodeCost(&l, s.TotalTokens, s.SavedTokens), p.CascadeCost(&l, s.TotalTokens, s.SavedTokens)
		t.Logf("%s: nodes %d, model: decode %.1f us, cascade %.1f us", c.name, s.Nodes, dec, cas)
		if s.Route != c.want {
			t.Errorf("%s: route %d, want %d (model: decode %.1f us, cascade %.1f us)", c.name, s.Route, c.want, dec, cas)
		}
	}
}

// Shared runs are cut shorter than tails: by their tiles' weight on the
// sm_80 tile (a 128-row tile costs about four decode tiles), and on the
// wgmma mainloop into 128-token multiples whose items alone fill one block
// per SM (half the cascade kernel's slots).
func TestPlanSharedChunks(t *testing.T) {
	for _, c := range []struct {
		name string
		b    *batch
	}{
		{"B=128 P=8192 S=256", decodeTree(128, 8192, 0, 0, 256)},
		{"B=32 P=2048 S=512", decodeTree(32, 2048, 0, 0, 512)},
		{"B=96 P=1024 S=512", decodeTree(96, 1024, 0, 0, 512)},
	} {
		for _, wgmma := range []bool{false, true} {
			l, err := NewLayout(len(c.b.lens), 32, 8, 128)
			if err != nil {
				t.Fatal(err)
			}
			ws := make([]int32, l.HostInts)
			in := c.b.input(32, 8, 128)
			in.SharedWgmma, in.NoDecodeRoute = wgmma, true
			var p Planner
			s, err := p.Plan(in, &l, ws)
			if err != nil || s.Route != RouteCascade || s.Nodes != 1 {
				t.Fatalf("%s: %+v %v", c.name, s, err)
			}
			ndT, ndChunks := p.FirstNode()
			rowTiles := (int64(ndT)*int64(l.Group) + int64(l.TileQ) - 1) / int64(l.TileQ)
			units := rowTiles * int64(ndChunks) * 8
			var shared int64
			for i := 0; i < s.Items; i++ {
				if ws[l.Items+i*ItemInts+IDynamic] == 0 {
					shared++
					if ke, kb := ws[l.Items+i*ItemInts+IKVEnd], ws[l.Items+i*ItemInts+IKVBegin]; int64(ke-kb) > p.NodeChunk() {
						t.Errorf("%s: a shared item of %d tokens; chunk %d", c.name, ke-kb, p.NodeChunk())
					}
				}
			}
			if shared != rowTiles*int64(ndChunks) {
				t.Errorf("%s: %d shared items, want %d row tiles x %d chunks", c.name, shared, rowTiles, ndChunks)
			}
			t.Logf("%s wgmma=%v: tail chunk %d, shared chunk %d, %d shared units", c.name, wgmma, s.Chunk, p.NodeChunk(), units)
			if wgmma {
				// One wave of at least half the SMs, unless the chunk is at its
				// minimum or halving it would exceed MaxParts.
				oneWave := units <= DefaultSlots/2 || p.NodeChunk() == 128
				busy := units >= DefaultSlots/4 || 2*ndChunks+p.TailChunks(0) > MaxParts
				if p.NodeChunk()%128 != 0 || !oneWave || !busy {
					t.Errorf("%s: shared chunk %d, %d units on %d blocks", c.name, p.NodeChunk(), units, DefaultSlots/2)
				}
			} else if p.NodeChunk() > int64(s.Chunk)/TileWeight(int64(l.TileQ))+ChunkAlign {
				t.Errorf("%s: shared chunk %d, tail chunk %d: not cut by the tile weight", c.name, p.NodeChunk(), s.Chunk)
			}
		}
	}
}
