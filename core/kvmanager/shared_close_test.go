package kvmanager

import "testing"

// Close while an admission's lookup (EXISTS) is in flight: the fetch reads
// nothing after Close (no GET, no new connection once Close has returned),
// reserves no host slot, and the admission computes the prompt.
func TestSharedFetchClosedDuringLookup(t *testing.T) {
	const bs = 4
	srv, _, conv := newStoredConv(t, 5, 41)
	g := newHoldGate(t, srv.Addr())
	m, _ := newConcMgr(t, 32, bs, 16, 0, g.addr())

	held, release := g.hold("EXISTS")
	a := concGoAdmit(m, 1, conv)
	concWaitChan(t, "the admission's EXISTS", held)
	closed := concGoClose(t, m)
	release()
	res := concWaitChan(t, "the admission", a)
	must(t, concWaitChan(t, "Close", closed))
	concWaitFor(t, "the server connection to close", func() bool { _, open := g.counts(); return open == 0 })
	ts := m.TierStats()
	if res.err != nil || res.n != 1 || res.matched != 0 || ts.Shared.Fetched != 0 || ts.Host.Reserved != 0 {
		t.Fatalf("admission %+v after Close during its lookup; %+v", res, ts)
	}
	if dials, open := g.counts(); dials != 1 || open != 0 {
		t.Fatalf("%d connections made, %d open: the fetch dialled again after Close", dials, open)
	}
	mustCheck(t, m)
}
