package kvmanager

import "testing"

// matchTokens returns the GPU prefix cache's match of a prompt.
func matchTokens(t testing.TB, m *Manager, toks []int32) int32 {
	t.Helper()
	out := make([]MatchInfo, 1)
	must(t, m.Match(one(toks, nil), false, out))
	return out[0].Tokens
}

// A reload's completion releases its hold on the GPU blocks without an
// access, as a write-through store's does: the eviction order is the
// one the sequences' own uses made. Here the reloaded chain was last used
// when its sequence was removed, before another block was, so the next
// eviction takes the reloaded chain's leaf, however late the reload
// completes.
func TestReloadCompletionIsNotAnAccess(t *testing.T) {
	const bs = 4
	m, _, r, conv := newDemotedConv(t, 11)
	if got := admit(t, m, 2, conv, nil); got != 4*bs {
		t.Fatalf("admit matched %d tokens, want the 4 host blocks", got)
	}
	m.MarkComputed()
	tk, n, err := m.FlushCopies()
	must(t, err)
	if tk == 0 || n != 4 {
		t.Fatalf("flush: ticket %d, %d copies; want the 4 reloads", tk, n)
	}
	// The sequence goes while its reloads are in flight (its removal is
	// the chain's last use), then another block is used.
	must(t, m.Remove([]int64{2}))
	other := seqTokens(r, bs+1)
	admit(t, m, 3, other, nil)
	m.MarkComputed()
	must(t, m.Remove([]int64{3}))
	must(t, m.CompleteCopies(tk, false))
	mustCheck(t, m)
	if st := m.Stats(); st.CachedBlocks != 5 || st.FreeBlocks != 3 {
		t.Fatalf("before the eviction: %+v", st)
	}
	// One block short: the least recently used leaf goes.
	must(t, m.Add(4, 4*bs))
	if got := matchTokens(t, m, conv); got != 3*bs {
		t.Fatalf("the reloaded chain matches %d tokens after one eviction, want %d (its leaf evicted)", got, 3*bs)
	}
	if got := matchTokens(t, m, other); got != bs {
		t.Fatalf("the block used after the chain matches %d tokens, want %d (kept)", got, bs)
	}
	mustCheck(t, m)
}

// A queued write-through entry whose block id the GPU evicted and filled
// again before its store stores the id's new block, once: MarkComputed
// does not queue the id a second time, so the queue holds one entry per
// block and no store finds its slot taken by another store of the batch.
func TestWriteThroughQueuesAReusedIDOnce(t *testing.T) {
	const bs = 4
	m, _ := newWriteThroughMgr(t, 8, bs, 16, 8)
	// Block a: one full block, computed and queued, no flush yet.
	admit(t, m, 1, iota32(0, bs+1), nil)
	a := blocksOf(t, m, 1, 2)[0]
	m.MarkComputed()
	if st := m.TierStats(); st.WriteThroughQueue != 1 {
		t.Fatalf("queue %d after the first step, want 1", st.WriteThroughQueue)
	}
	// Every other block goes to a private sequence; a is cached, unheld.
	must(t, m.Add(9, 6*bs))
	must(t, m.Remove([]int64{1}))
	// Two full blocks need a's id: the GPU evicts a and fills it again.
	admit(t, m, 2, iota32(1000, 2*bs), nil)
	tbl := blocksOf(t, m, 2, 2)
	if tbl[0] != a && tbl[1] != a {
		t.Fatalf("the second prompt's blocks %v do not reuse block %d", tbl, a)
	}
	m.MarkComputed()
	if st := m.TierStats(); st.WriteThroughQueue != 2 {
		t.Fatalf("queue %d after the second step, want 2 (block %d's entry stores its new block)", st.WriteThroughQueue, a)
	}
	tk, n, err := m.FlushCopies()
	must(t, err)
	if tk == 0 || n != 2 {
		t.Fatalf("flush: ticket %d, %d copies; want 2 stores", tk, n)
	}
	must(t, m.CompleteCopies(tk, false))
	st := m.TierStats()
	if st.WriteThroughStored != 2 || st.WriteThroughLost != 1 || st.SkippedPresent != 0 || st.WriteThroughQueue != 0 {
		t.Fatalf("stats %+v: want 2 stored, 1 lost (a's first block), none skipped", st)
	}
	mustCheck(t, m)
}

// Blocks dropped uncomputed (their sequence removed before the step's
// MarkComputed) never enter the write-through queue: nothing is queued,
// stored or counted lost for them.
func TestWriteThroughSkipsBlocksDroppedUncomputed(t *testing.T) {
	const bs = 4
	m, _ := newWriteThroughMgr(t, 8, bs, 16, 4)
	admit(t, m, 1, iota32(0, 2*bs+1), nil) // two full blocks
	admit(t, m, 2, iota32(100, bs+1), nil) // one, kept
	must(t, m.Remove([]int64{1}))          // before the forward pass: dropped
	m.MarkComputed()
	if st := m.TierStats(); st.WriteThroughQueue != 1 {
		t.Fatalf("queue %d, want the one computed block", st.WriteThroughQueue)
	}
	tk, n, err := m.FlushCopies()
	must(t, err)
	if tk == 0 || n != 1 {
		t.Fatalf("flush: ticket %d, %d copies; want one store", tk, n)
	}
	must(t, m.CompleteCopies(tk, false))
	if st := m.TierStats(); st.WriteThroughStored != 1 || st.WriteThroughLost != 0 || st.WriteThroughQueue != 0 {
		t.Fatalf("stats %+v: want one store and nothing lost", st)
	}
	mustCheck(t, m)
}
