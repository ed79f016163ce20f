package valkey

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// checkAll gets blocks 0..n-1 and fails on any payload other than the
// block's own; it returns the hits.
func checkAll(t *testing.T, tr *Tier, n, size int) int {
	t.Helper()
	hits := 0
	got := tr.Get(hs(seq(n)...))
	for i, p := range got {
		if p == nil {
			continue
		}
		if !bytes.Equal(p, payload(uint64(i), size)) {
			t.Fatalf("block %d: a wrong payload", i)
		}
		hits++
	}
	return hits
}

func seq(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i)
	}
	return out
}

func putAll(t *testing.T, tr *Tier, n, size int) int {
	t.Helper()
	ps := make([][]byte, n)
	for i := range ps {
		ps[i] = payload(uint64(i), size)
	}
	return tr.Put(hs(seq(n)...), ps)
}

func nodeKeys(t *testing.T, s *redistest.Server) int64 {
	return redistest.Cmd(t, s.Addr(), "DBSIZE").(int64)
}

// A 3-primary cluster with one replica: blocks spread over the primaries;
// a slot migrated while readers and writers run (ASK, then MOVED); the
// replicated primary killed (its keys misses, nothing wrong) and its
// replica promoted (hits resume); a node added and given a slot. No call
// ever returns another block's payload.
func TestCluster(t *testing.T) {
	bin := redistest.Find(t)
	cl := redistest.StartCluster(t, bin, 3, 1)
	const n, size = 240, 4096
	tr := newTier(t, Config{Addr: cl.Seed(), OpTimeout: 500 * time.Millisecond, Backoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	if got := putAll(t, tr, n, size); got != n {
		t.Fatalf("stored %d of %d: %v", got, n, tr.Stats())
	}
	if h := checkAll(t, tr, n, size); h != n {
		t.Fatalf("%d hits of %d: %v", h, n, tr.Stats())
	}
	st := tr.Stats()
	if !st.Cluster || st.Primaries != 3 || st.Redirects != 0 {
		t.Fatalf("stats %v", st)
	}
	for _, p := range cl.Primaries {
		if k := nodeKeys(t, p); k < n/6 {
			t.Fatalf("primary %s holds %d of %d blocks", p.Addr(), k, n)
		}
	}
	if ex := tr.Exists(hs(seq(n)...)); !ex[0] || !ex[n-1] || tr.Prefix(hs(seq(n)...)) != n {
		t.Fatal("Exists")
	}

	// A slot migrated while readers and writers run.
	slot := resp.Slot([]byte(tr.Key(hashOf(0))))
	src := cl.Owner(t, slot)
	dst := cl.Primaries[1]
	if dst == src {
		dst = cl.Primaries[2]
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	var calls atomic.Int64
	for range 2 {
		wg.Go(func() {
			for !stop.Load() {
				checkAll(t, tr, n, size)
				putAll(t, tr, 16, size)
				calls.Add(1)
			}
		})
	}
	cl.BeginMigration(t, slot, src, dst)
	time.Sleep(20 * time.Millisecond)
	if cl.MoveKeys(t, slot, src, dst, 1000) == 0 {
		t.Fatal("no key in the slot")
	}
	// Mid-migration: the moved keys answer ASK.
	if h := checkAll(t, tr, n, size); h != n {
		t.Fatalf("mid-migration: %d hits of %d: %v", h, n, tr.Stats())
	}
	if tr.Stats().Redirects == 0 {
		t.Fatal("no ASK followed")
	}
	cl.FinishMigration(t, slot, dst)
	cl.WaitOK(t)
	time.Sleep(20 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if h := checkAll(t, tr, n, size); h != n {
		t.Fatalf("after the migration: %d hits of %d: %v", h, n, tr.Stats())
	}
	if calls.Load() == 0 {
		t.Fatal("the readers ran no call")
	}

	// The replicated primary killed, then its replica promoted.
	victim, replica := cl.Primaries[0], cl.Replicas[0]
	deadline := time.Now().Add(10 * time.Second)
	for nodeKeys(t, replica) != nodeKeys(t, victim) {
		if time.Now().After(deadline) {
			t.Fatal("the replica did not catch up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	lost := nodeKeys(t, victim)
	victim.Stop()
	for range 3 {
		h := checkAll(t, tr, n, size)
		if h == n || int64(h) < n-lost {
			t.Fatalf("with a primary down: %d hits of %d (it held %d): %v", h, n, lost, tr.Stats())
		}
	}
	if st := tr.Stats(); st.Errors+st.Timeouts+st.Skipped == 0 || !st.Available {
		t.Fatalf("a node's loss not counted, or the whole tier skipped: %v", st)
	}
	cl.Promote(t, replica)
	waitHits(t, tr, n, size)
	putAll(t, tr, n, size)

	// A node added and given a slot with keys.
	added := cl.AddPrimary(t)
	slot = resp.Slot([]byte(tr.Key(hashOf(5))))
	cl.MigrateSlot(t, slot, cl.Owner(t, slot), added)
	cl.WaitOK(t)
	waitHits(t, tr, n, size)
	if nodeKeys(t, added) == 0 {
		t.Fatal("the added node holds nothing")
	}
	if st := tr.Stats(); st.Redirects == 0 || st.MapReads < 2 {
		t.Fatalf("stats %v", st)
	}
}

// waitHits waits until every block is a hit again (a refreshed map).
func waitHits(t *testing.T, tr *Tier, n, size int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		h := checkAll(t, tr, n, size)
		if h == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d hits of %d: %v", h, n, tr.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A standalone server is found standalone: no map, no redirect; one
// discovery each for the readers' and the stores' connections.
func TestClusterDiscoveryStandalone(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	tr := newTier(t, Config{Addr: srv.Addr()})
	if putAll(t, tr, 4, 64) != 4 || checkAll(t, tr, 4, 64) != 4 {
		t.Fatal(tr.Stats())
	}
	if st := tr.Stats(); st.Cluster || st.Primaries != 0 || st.Redirects != 0 || st.MapReads != 2 {
		t.Fatalf("stats %v", st)
	}
}

// Four clients (four tiers, as four instances), each with batches of 16
// blocks of 64 KiB (1 MiB) of its own, against one server or a cluster of
// 3 primaries, all on loopback.
func benchClients(b *testing.B, get, cluster bool) {
	const clients, n, bs = 4, 16, 64 << 10
	bin := redistest.Find(b)
	var addr string
	if cluster {
		addr = redistest.StartCluster(b, bin, 3, 0).Seed()
	} else {
		addr = redistest.Start(b, bin, 0).Addr()
	}
	type client struct {
		tr      *Tier
		keys    []Hash
		ps, dst [][]byte
	}
	cs := make([]client, clients)
	for c := range cs {
		cs[c].tr = newTier(b, Config{Addr: addr, BlockBytes: bs, OpTimeout: 10 * time.Second})
		for i := range n {
			cs[c].keys = append(cs[c].keys, hashOf(uint64(c*n+i+1)))
			cs[c].ps = append(cs[c].ps, payload(uint64(c*n+i), bs))
			cs[c].dst = append(cs[c].dst, make([]byte, bs))
		}
		if cs[c].tr.Put(cs[c].keys, cs[c].ps) != n {
			b.Fatal("put")
		}
	}
	if st := cs[0].tr.Stats(); st.Cluster != cluster {
		b.Fatalf("stats %v", st)
	}
	b.SetBytes(n * bs)
	var next atomic.Int64
	b.ResetTimer()
	var wg sync.WaitGroup
	for c := range cs {
		wg.Go(func() {
			cl := cs[c]
			for next.Add(1) <= int64(b.N) {
				if get {
					for _, ok := range cl.tr.GetInto(cl.keys, cl.dst) {
						if !ok {
							b.Error("miss")
							return
						}
					}
				} else if cl.tr.Put(cl.keys, cl.ps) != n {
					b.Error("put")
					return
				}
			}
		})
	}
	wg.Wait()
}

func BenchmarkGet4Clients16x64KiB(b *testing.B)         { benchClients(b, true, false) }
func BenchmarkPut4Clients16x64KiB(b *testing.B)         { benchClients(b, false, false) }
func BenchmarkGet4Clients16x64KiBCluster3(b *testing.B) { benchClients(b, true, true) }
func BenchmarkPut4Clients16x64KiBCluster3(b *testing.B) { benchClients(b, false, true) }
