package main

import (
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/internal/redistest"
)

// A shared tier and a shared store whose address is a cluster's node say
// so in their C stats: a cluster, its primaries, the slot maps read.
func TestSharedClusterStatsABI(t *testing.T) {
	lockThread(t)
	cl := redistest.StartCluster(t, redistest.Find(t), 3, 0)
	addr, ns := cl.Seed(), "abi-cluster"
	h, st := hookManagerCreateTier(hookTierConfig{numBlocks: 16, blockSize: 4, slots: 8, blockBytes: 16,
		sharedAddr: &addr, sharedNS: &ns, sharedTimeoutMs: 2000})
	expect(t, "create", st, kverr.OK)
	defer hookManagerDestroy(h)
	conv := tokenRun(13, 7)
	_, _, st = hookAdmit(h, []int64{1}, [][]int32{conv}, nil) // a lookup: the map is read
	expect(t, "admit", st, kverr.OK)
	s, st := hookSharedStats(h, sizeofTierStats())
	expect(t, "tier stats", st, kverr.OK)
	if s["cluster"] != 1 || s["primaries"] != 3 || s["map_reads"] < 1 {
		t.Fatalf("the tier's cluster stats: %v", s)
	}
	ss, st := hookSharedStoreCreate(addr, ns, 2000)
	expect(t, "store create", st, kverr.OK)
	defer hookSharedStoreDestroy(ss)
	if _, _, _, st := hookSharedStorePutGet(ss, []uint64{1, 2, 3}, [][]byte{{1}, {2}, {3}}); st != 0 {
		t.Fatalf("put and get: %s", statusName(st))
	}
	c, st := hookSharedStoreClusterStats(ss)
	expect(t, "store stats", st, kverr.OK)
	if c[0] != 1 || c[1] != 3 || c[2] < 1 {
		t.Fatalf("the store's cluster stats [cluster primaries map_reads redirects]: %v", c)
	}
}
