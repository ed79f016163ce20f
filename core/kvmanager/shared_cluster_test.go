package kvmanager

import (
	"bytes"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// admitChecked admits conv as sequence id, runs the copies and checks
// that every matched block holds its K/V (a block fetched from the shared
// tier included), then computes the rest, removes the sequence and runs
// its demotions.
func admitChecked(t testing.TB, m *Manager, g *fakeGPU, id int64, conv []int32) int {
	t.Helper()
	bs := m.BlockSize()
	got := admit(t, m, id, conv, nil)
	flushCompleted(t, m)
	tbl := blocksOf(t, m, id, len(conv)/bs+1)
	chain := wholeChain(t, conv, bs, nil)
	g.mu.Lock()
	for j := range got / bs {
		if !bytes.Equal(g.mem[tbl[j]], kvOf(chain[j])) {
			g.mu.Unlock()
			t.Fatalf("block %d of a prompt holds another block's K/V", j)
		}
	}
	g.mu.Unlock()
	g.compute(t, m, id, conv)
	m.MarkComputed()
	must(t, m.Remove([]int64{id}))
	flushCompleted(t, m)
	return got
}

// workerTB is a test's TB for a goroutine of its own: testing allows
// FailNow only on the test's goroutine, so a fatal failure here is
// reported with Errorf and ends the worker's goroutine alone (its
// deferred calls run); the test sees it through t.Failed.
type workerTB struct{ *testing.T }

func (w workerTB) FailNow()          { w.T.Fail(); runtime.Goexit() }
func (w workerTB) Fatal(args ...any) { w.T.Helper(); w.T.Error(args...); runtime.Goexit() }
func (w workerTB) Fatalf(format string, a ...any) {
	w.T.Helper()
	w.T.Errorf(format, a...)
	runtime.Goexit()
}

// Two managers share a 3-primary cluster (one primary replicated) while a
// slot is migrated, the replicated primary is killed and its replica
// promoted, and a node is added: every block either manager reloads holds
// its own K/V, and a fresh manager finds what is stored afterwards.
func TestSharedTierCluster(t *testing.T) {
	cl := redistest.StartCluster(t, redistest.Find(t), 3, 1)
	const bs = 4
	r := rand.New(rand.NewPCG(3, 35))
	convs := make([][]int32, 24)
	for i := range convs {
		convs[i] = seqTokens(r, 4*bs+1)
	}
	fast := func(c *SharedTier) {
		c.OpTimeout = 2 * time.Second
		c.Backoff, c.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	var rounds, matched, fetched atomic.Int64
	for w := range 2 {
		m, g := newSharedMgr(t, cl.Seed(), 8, bs, 8, 8, fast)
		wg.Go(func() {
			defer func() {
				m.Close()
				fetched.Add(m.TierStats().Shared.Fetched)
			}()
			wt := workerTB{t}
			for i := 0; !stop.Load() && !t.Failed(); i++ {
				matched.Add(int64(admitChecked(wt, m, g, int64(i+1), convs[(i*5+w*7)%len(convs)])))
				rounds.Add(1)
			}
		})
	}
	pause := func() { time.Sleep(150 * time.Millisecond) }
	pause()
	// A slot with keys migrated, ASK then MOVED.
	key := redistest.Cmd(t, cl.Primaries[1].Addr(), "RANDOMKEY").([]byte)
	slot := resp.Slot(key)
	cl.BeginMigration(t, slot, cl.Primaries[1], cl.Primaries[2])
	pause()
	cl.MoveKeys(t, slot, cl.Primaries[1], cl.Primaries[2], 1000)
	pause()
	cl.FinishMigration(t, slot, cl.Primaries[2])
	pause()
	// The replicated primary lost, then its replica promoted.
	cl.Primaries[0].Stop()
	pause()
	cl.Promote(t, cl.Replicas[0])
	pause()
	cl.AddPrimary(t)
	cl.MigrateSlot(t, slot, cl.Primaries[2], cl.Primaries[3])
	pause()
	stop.Store(true)
	wg.Wait()
	if rounds.Load() < 10 || matched.Load() == 0 || fetched.Load() == 0 {
		t.Fatalf("%d rounds, %d tokens matched, %d blocks fetched", rounds.Load(), matched.Load(), fetched.Load())
	}
	// Hits after the events: what one manager stores, a fresh one finds.
	conv := seqTokens(r, 4*bs+1)
	storeConv(t, cl.Seed(), bs, conv)
	t.Logf("%d rounds, %d tokens matched, %d blocks fetched from the cluster", rounds.Load(), matched.Load(), fetched.Load())
	b, gb := newSharedMgr(t, cl.Seed(), 8, bs, 16, 4, fast)
	if got := admitChecked(t, b, gb, 1, conv); got != 4*bs {
		t.Fatalf("a fresh manager matched %d tokens, want %d: %+v", got, 4*bs, b.TierStats().Shared)
	}
}
