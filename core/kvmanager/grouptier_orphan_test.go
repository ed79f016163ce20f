package kvmanager

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kvtier"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
)

// orphanTier is a grouped tier with groups [full, full] and KV events on,
// driven step by step, its copy batches completed when the test says.
type orphanTier struct {
	*tierMem
	mr *groupMirror
	id int64
}

func newOrphanTier(t *testing.T, slots int) *orphanTier {
	const nb = 16
	groups := []Group{{Kind: FullAttention}, {Kind: FullAttention}}
	c := newGroupTier(t, nb, orphanBS, slots, nb, true, groups...)
	return &orphanTier{tierMem: c, mr: newGroupMirror(c.gm.m, groups, rand.New(rand.NewPCG(21, 22)))}
}

const orphanBS = 4

// compute admits each prompt, runs the step (its flush completed) and
// marks it computed; the sequences are then removed in order, their nodes
// cached, the least recently used the first's.
func (c *orphanTier) compute(t *testing.T, prompts ...[]int32) {
	t.Helper()
	ids := make([]int64, len(prompts))
	for i, p := range prompts {
		c.id++
		ids[i] = c.id
		c.gm.admit(t, c.id, p)
	}
	c.flush(t)
	c.gm.m.MarkComputed()
	for _, id := range ids {
		must(t, c.gm.m.Remove([]int64{id}))
		delete(c.gm.toks, id)
	}
}

// turn computes the prompts and demotes their nodes, completing the copies.
func (c *orphanTier) turn(t *testing.T, prompts ...[]int32) {
	t.Helper()
	c.compute(t, prompts...)
	c.flush(t)
}

// flushLate demotes the cached nodes and returns the batch's ticket, the
// copies done but not reported complete.
func (c *orphanTier) flushLate(t *testing.T) uint64 {
	t.Helper()
	tk, _, err := c.gm.m.FlushCopies()
	must(t, err)
	if tk == 0 {
		t.Fatal("the flush demoted nothing")
	}
	return tk
}

func (c *orphanTier) complete(t *testing.T, tk uint64, failed bool) {
	t.Helper()
	must(t, c.gm.m.CompleteCopies(tk, failed))
}

func (c *orphanTier) state(h prefix.Hash, g int) host.SlotState {
	_, st := c.pool.State(kvtier.GroupKey(h, g))
	return st
}

// check asserts what the tier says of node h: its group-0 slot is
// resident only with its full companion's (whole), the tier announces it
// (AppendTierBlocks, the CPU events) only then, and MatchTiers finds it
// in the host tier only then; and that whole is what the caller expects.
func (c *orphanTier) check(t *testing.T, what string, prompt []int32, h prefix.Hash, whole bool) {
	t.Helper()
	m := c.gm.m
	c.mr.drain(t)
	mustCheck(t, m)
	st0, st1 := c.state(h, 0), c.state(h, 1)
	listed := slices.ContainsFunc(m.tier.AppendTierBlocks(nil), func(b prefix.TierBlock) bool { return b.Hash == h })
	announced := slices.Contains(c.mr.x.HashesIn(prefix.MediumCPU, nil), h)
	out := make([]TierMatch, 1)
	must(t, m.MatchTiers(one(append(slices.Clone(prompt), 1), nil), out))
	name := func(st host.SlotState) string { return [...]string{"absent", "pending", "resident"}[st] }
	t.Logf("%s: group 0 %s, group 1 %s, listed %v, announced %v, match %+v", what, name(st0), name(st1), listed, announced, out[0])
	if st0 == host.Resident && st1 != host.Resident {
		t.Fatalf("%s: the node's group-0 host slot is resident, its full companion's %s: no host hit can use it", what, name(st1))
	}
	if got := st0 == host.Resident && st1 == host.Resident; got != whole {
		t.Fatalf("%s: the node is whole in the host tier: %v, want %v", what, got, whole)
	}
	if listed != whole || announced != whole {
		t.Fatalf("%s: listed by AppendTierBlocks %v, announced by the CPU events %v; the node is whole: %v", what, listed, announced, whole)
	}
	if hit := out[0].GPU == 0 && int(out[0].Host) == orphanBS; hit != whole {
		t.Fatalf("%s: MatchTiers %+v; a host hit of the node is wanted: %v", what, out[0], whole)
	}
}

// With groups [full, full] and KV events on, a node whose group-0 host
// slot the LRU took while its full companion stayed is demoted again in a
// flush that also demotes a later node: the node's group 0 alone is
// reserved, the companion pinned only while the node's own reservations
// evict, so the later node's reservation may evict it. The group-0 slot,
// reserved for a copy in flight, cannot be dropped then; its completion
// must abort it instead of committing and announcing (CPU BlockStored) a
// block no host hit can use.
func TestGroupTierAbortsAnInFlightGroupZeroSlotWhoseCompanionWent(t *testing.T) {
	for _, late := range []bool{false, true} {
		t.Run(map[bool]string{false: "same flush", true: "later flush"}[late], func(t *testing.T) {
			c := newOrphanTier(t, 3)
			r := rand.New(rand.NewPCG(3, 4))
			N, P, Q := seqTokens(r, orphanBS+1), seqTokens(r, orphanBS+1), seqTokens(r, orphanBS+1)
			hN := wholeChain(t, N, orphanBS, nil)[0]
			c.turn(t, N) // host: N0 N1
			c.turn(t, P) // host: N1 P0 P1 (N0 was the LRU)
			if c.state(hN, 0) != host.Absent || c.state(hN, 1) != host.Resident {
				t.Fatalf("N: group 0 %v, group 1 %v; want absent and resident", c.state(hN, 0), c.state(hN, 1))
			}
			if !late {
				// N and Q demoted by one flush, N first: Q's reservations
				// evict N1 while N0's copy is in flight.
				c.compute(t, N, Q)
				tk := c.flushLate(t)
				if c.state(hN, 0) != host.Pending || c.state(hN, 1) != host.Absent {
					t.Fatalf("N in flight: group 0 %v, group 1 %v; want pending and absent", c.state(hN, 0), c.state(hN, 1))
				}
				c.complete(t, tk, false)
			} else {
				// N's demotion still in flight when Q's flush evicts N1.
				c.compute(t, N)
				tk := c.flushLate(t)
				c.turn(t, Q)
				if c.state(hN, 0) != host.Pending || c.state(hN, 1) != host.Absent {
					t.Fatalf("N in flight: group 0 %v, group 1 %v; want pending and absent", c.state(hN, 0), c.state(hN, 1))
				}
				c.complete(t, tk, false)
			}
			c.check(t, "N completed without its companion", N, hN, false)
			if ts := c.gm.m.TierStats(); ts.DemotionsFailed != 0 || ts.InFlight != 0 {
				t.Fatalf("tier stats %+v: the aborted slot is no failed demotion", ts)
			}
		})
	}
}

// The other order: the node's full companion comes back to the host tier
// (the node computed again and demoted, only its companion lacking) before
// the group-0 slot's copy completes, whichever of the two batches
// completes first: the node is whole again and kept. Should the
// companion's demotion fail instead, the group-0 slot goes, in flight or
// committed.
func TestGroupTierKeepsAGroupZeroSlotWhoseCompanionCameBack(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		companionFirst, fail bool
	}{
		{"group 0 first", false, false},
		{"companion first", true, false},
		{"group 0 first, companion failed", false, true},
		{"companion failed first", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newOrphanTier(t, 5)
			r := rand.New(rand.NewPCG(5, 6))
			N, P, R, Q := seqTokens(r, orphanBS+1), seqTokens(r, orphanBS+1), seqTokens(r, orphanBS+1), seqTokens(r, orphanBS+1)
			hN := wholeChain(t, N, orphanBS, nil)[0]
			c.turn(t, N) // host: N0 N1
			c.turn(t, P) // host: N0 N1 P0 P1
			c.turn(t, R) // host: N1 P0 P1 R0 R1 (N0 was the LRU)
			if c.state(hN, 0) != host.Absent || c.state(hN, 1) != host.Resident {
				t.Fatalf("N: group 0 %v, group 1 %v; want absent and resident", c.state(hN, 0), c.state(hN, 1))
			}
			c.compute(t, N, Q)
			b1 := c.flushLate(t) // N0 Q0 Q1; Q's reservations evict N1
			if c.state(hN, 0) != host.Pending || c.state(hN, 1) != host.Absent {
				t.Fatalf("N in flight: group 0 %v, group 1 %v; want pending and absent", c.state(hN, 0), c.state(hN, 1))
			}
			c.compute(t, N)
			b2 := c.flushLate(t) // N1 alone: N0 is in flight
			if c.state(hN, 1) != host.Pending {
				t.Fatalf("N's companion demoted again: %v", c.state(hN, 1))
			}
			if tc.companionFirst {
				c.complete(t, b2, tc.fail)
				c.complete(t, b1, false)
			} else {
				c.complete(t, b1, false)
				mustCheck(t, c.gm.m)
				if st := c.state(hN, 0); st != host.Resident {
					t.Fatalf("N's group 0 %v once committed, its companion in flight: want resident", st)
				}
				c.complete(t, b2, tc.fail)
			}
			c.check(t, tc.name, N, hN, !tc.fail)
			if ts := c.gm.m.TierStats(); ts.DemotionsFailed != map[bool]int64{false: 0, true: 1}[tc.fail] || ts.InFlight != 0 {
				t.Fatalf("tier stats %+v", ts)
			}
		})
	}
}
