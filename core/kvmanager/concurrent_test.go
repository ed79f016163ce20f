package kvmanager

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime/debug"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/redistest"
)

// Concurrency with the prefix cache on: one manager, with KV events and a
// host tier (and, in the shared tier's tests, a real Valkey or Redis
// server behind it), called from many goroutines at once, each with
// sequence ids of its own, as an engine's threads would. Run them with
// -race: the detector checks the locking, and a race build checks every
// invariant after every call (assert.go). Each call's result is checked
// against the codes it may legitimately return when other goroutines
// share the manager; at the end the manager must pass CheckInvariants and
// agree with what the goroutines did.

// concurrentCodes are the codes each call may fail with when other
// goroutines use the manager (valid arguments, ids of the caller's own).
// Any other code, Internal above all, fails the test.
var concurrentCodes = map[string][]kverr.Code{
	"admit":              nil, // a full pool admits fewer prompts, without an error
	"grow tokens":        {kverr.OutOfBlocks},
	"describe":           nil,
	"match":              nil,
	"match tiers":        nil,
	"remove":             {kverr.InUse}, // another goroutine's sequence shares a block ours filled since MarkComputed
	"flush copies":       nil,
	"complete copies":    nil,
	"drain events":       nil, // limits that hold any one event
	"next event size":    nil,
	"event snapshot":     nil,
	"pin":                {kverr.NotFound},        // the prefix is not cached (evicted, cleared, dropped) or not computed yet
	"unpin":              {kverr.NotFound},        // ClearPrefixCache dropped the pin
	"set priority":       {kverr.NotFound},        // as pin
	"clear prefix cache": {kverr.InvalidArgument}, // live sequences or reloads in flight hold cached blocks
	"check invariants":   nil,
	"close":              nil,
}

// codeLog counts the calls' outcomes and fails the test on a code the
// call may not return.
type codeLog struct {
	t  testing.TB
	mu sync.Mutex
	n  map[string]map[kverr.Code]int
}

// ok records call's outcome and reports whether it succeeded.
func (l *codeLog) ok(call string, err error) bool {
	allowed, known := concurrentCodes[call]
	if !known {
		panic("codeLog: no codes listed for " + call)
	}
	code := kverr.CodeOf(err)
	l.mu.Lock()
	if l.n == nil {
		l.n = map[string]map[kverr.Code]int{}
	}
	if l.n[call] == nil {
		l.n[call] = map[kverr.Code]int{}
	}
	l.n[call][code]++
	l.mu.Unlock()
	switch {
	case err == nil:
		return true
	case !slices.Contains(allowed, code):
		l.t.Errorf("%s: unexpected %s under concurrency: %v", call, code, err)
	case err.Error() == "":
		l.t.Errorf("%s: %s without a message", call, code)
	}
	return false
}

func (l *codeLog) count(call string, code kverr.Code) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n[call][code]
}

func (l *codeLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	calls := make([]string, 0, len(l.n))
	for c := range l.n {
		calls = append(calls, c)
	}
	sort.Strings(calls)
	var b strings.Builder
	for _, c := range calls {
		fmt.Fprintf(&b, "%s:", c)
		for code, n := range l.n[c] {
			fmt.Fprintf(&b, " %s=%d", code, n)
		}
		b.WriteString("; ")
	}
	return b.String()
}

// concCopier is the engine's copier in these tests: a demotion writes the
// K/V of the block's hash (kvOf) into its host slot, and a reload checks
// that the host slot it reads holds the K/V of the block the slot is
// keyed by, whether a demotion or a shared-tier fetch filled it. It runs
// under the manager's lock (FlushCopies), as a copier's enqueue does.
type concCopier struct {
	pool *host.Pool
	mu   sync.Mutex
	kv   map[uint64]prefix.Hash // host key -> the block's hash, for every block that may be in the host tier
	bad  []string
	ops  atomic.Int64
}

func newConcCopier(pool *host.Pool) *concCopier {
	return &concCopier{pool: pool, kv: map[uint64]prefix.Hash{}}
}

// know records the blocks of a chain that may reach the host tier from
// elsewhere (the shared tier).
func (c *concCopier) know(chain []prefix.Hash) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range chain {
		c.kv[HostKey(h)] = h
	}
}

func (c *concCopier) Copy(b CopyBatch) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, op := range b.Demote {
		copy(c.pool.Bytes(op.Slot), kvOf(op.Hash))
		c.kv[HostKey(op.Hash)] = op.Hash
	}
	for _, op := range b.Reload {
		k, ok := c.pool.Hash(op.Slot)
		h, known := c.kv[k]
		if !ok || !known {
			c.bad = append(c.bad, fmt.Sprintf("reload of host slot %d (key %016x, held %v): no block of that key was ever demoted or stored", op.Slot, k, ok))
		} else if got := c.pool.Bytes(op.Slot); !bytes.Equal(got, kvOf(h)) {
			c.bad = append(c.bad, fmt.Sprintf("reload of host slot %d into block %d: holds %x, block %s's K/V is %x", op.Slot, op.Block, got, h, kvOf(h)))
		}
	}
	c.ops.Add(int64(len(b.Demote) + len(b.Reload)))
	return nil
}

func (c *concCopier) check(t testing.TB) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.bad {
		t.Error(s)
	}
}

// newConcMgr returns a manager with the prefix cache, KV events and a host
// tier of slots slots driven by a concCopier; with a shared tier at addr
// when addr is not empty (closed at the test's end).
func newConcMgr(t testing.TB, numBlocks, bs, slots, ahead int, addr string) (*Manager, *concCopier) {
	t.Helper()
	p, err := host.New(host.Config{Slots: slots, BlockBytes: tierBlockBytes})
	must(t, err)
	c := newConcCopier(p)
	ht := &HostTier{Pool: p, Copier: c, DemoteAhead: ahead}
	if addr != "" {
		// Long operation timeouts and a skip window of a millisecond:
		// these tests hold round trips on purpose, and a timeout would
		// make their outcome depend on the machine's speed.
		ht.Shared = &SharedTier{Addr: addr, Namespace: sharedNS, OpTimeout: 10 * time.Second, Backoff: time.Millisecond, MaxBackoff: time.Millisecond}
	}
	m, err := New(Config{NumBlocks: numBlocks, BlockSize: bs, EnablePrefixCache: true, EnableKVEvents: true, HostTier: ht})
	must(t, err)
	t.Cleanup(func() { m.Close() })
	return m, c
}

// concRun is one run of concurrent workers on a manager.
type concRun struct {
	t       *testing.T
	m       *Manager
	bs      int
	log     *codeLog
	prompts [][]int32     // prefixes the goroutines' prompts start with
	stop    chan struct{} // closed when the workers are done
	iters   atomic.Int64  // worker iterations done, all workers
	matched atomic.Int64  // tokens admissions matched
	maxLen  int           // a sequence is removed once this long

	lookupsAtClose atomic.Int64 // the shared tier's lookups when Close returned
}

// concSeq is a worker's live sequence: its id and tokens.
type concSeq struct {
	id   int64
	toks []int32
}

// prompt is one of the shared prefixes and a short tail of a small
// vocabulary, so that whole blocks repeat between goroutines too (the
// prefix cache's duplicate inserts).
func (c *concRun) prompt(r *rand.Rand) []int32 {
	p := slices.Clone(c.prompts[r.IntN(len(c.prompts))])
	for range 1 + r.IntN(2*c.bs) {
		p = append(p, r.Int32N(3))
	}
	return p
}

// concGuard ends a goroutine that panicked (an assertion of the manager's)
// with a test error instead of the process.
func concGuard(t testing.TB, who string) {
	if r := recover(); r != nil {
		t.Errorf("%s panicked: %v\n%s", who, r, debug.Stack())
	}
}

// checkRows checks a Describe of seqs: each row holds its sequence's
// ceil(length/bs) blocks, distinct and in the pool, then -1; each length
// is the sequence's.
func (c *concRun) checkRows(seqs []*concSeq, maxBlocks int, table, lens []int32) {
	nb := int32(c.m.pool.NumBlocks())
	for i, s := range seqs {
		if int(lens[i]) != len(s.toks) {
			c.t.Errorf("describe: sequence %d has length %d, %d tokens given", s.id, lens[i], len(s.toks))
			continue
		}
		row := table[i*maxBlocks : (i+1)*maxBlocks]
		n := (len(s.toks) + c.bs - 1) / c.bs
		seen := map[int32]bool{}
		for j, b := range row {
			switch {
			case j < n && (b < 0 || b >= nb || seen[b]):
				c.t.Errorf("describe: sequence %d's block %d is %d (row %v)", s.id, j, b, row)
			case j >= n && b != -1:
				c.t.Errorf("describe: sequence %d of %d blocks has %d at %d (row %v)", s.id, n, b, j, row)
			}
			seen[b] = true
		}
	}
}

// worker runs iters scheduler steps on sequences of its own and returns
// those still live: admit, match per tier, grow by tokens, describe,
// flush the tier copies (completing them a step later, some as failed),
// mark the step computed (not every step: a removal may then meet a
// block another goroutine's sequence shares), remove.
func (c *concRun) worker(w int, iters int, seed uint64) (live []*concSeq) {
	defer concGuard(c.t, fmt.Sprintf("worker %d", w))
	m, bs := c.m, c.bs
	r := rand.New(rand.NewPCG(seed, uint64(w)))
	next := int64(w+1) << 32
	maxBlocks := c.maxBlocks()
	var tickets []uint64
	for range iters {
		if len(live) < 3 {
			k := 1 + r.IntN(2)
			ids := make([]int64, k)
			ps := make([][]int32, k)
			for i := range k {
				next++
				ids[i], ps[i] = next, c.prompt(r)
			}
			matched := make([]int32, k)
			n, err := m.Admit(ids, promptsOf(ps...), matched)
			if c.log.ok("admit", err) {
				if n < 0 || n > k {
					c.t.Errorf("admit: %d of %d admitted", n, k)
					n = 0
				}
				for i := range n {
					if matched[i] < 0 || int(matched[i]) >= len(ps[i]) || int(matched[i])%bs != 0 {
						c.t.Errorf("admit: sequence %d of %d tokens matched %d", ids[i], len(ps[i]), matched[i])
					}
					c.matched.Add(int64(matched[i]))
					live = append(live, &concSeq{ids[i], ps[i]})
				}
				if n > 0 && r.IntN(8) == 0 {
					// Preempted before its forward pass: its blocks
					// leave the cache, unless a sequence admitted
					// since shares them (another goroutine's, or a
					// twin admitted here to make it likely) and no
					// goroutine called MarkComputed in between.
					last := live[len(live)-1]
					live = live[:len(live)-1]
					if r.IntN(2) == 0 {
						next++
						if k, err := m.Admit([]int64{next}, one(last.toks, nil), nil); c.log.ok("admit", err) && k == 1 {
							live = append(live, &concSeq{next, slices.Clone(last.toks)})
						}
					}
					if err := m.Remove([]int64{last.id}); !c.log.ok("remove", err) {
						m.MarkComputed()
						if err := m.Remove([]int64{last.id}); err != nil {
							c.t.Errorf("remove after MarkComputed: %v", err)
						}
					}
				}
			}
		}
		p := c.prompt(r)
		tm := make([]TierMatch, 1)
		if c.log.ok("match tiers", m.MatchTiers(one(p, nil), tm)) {
			if g, h := int(tm[0].GPU), int(tm[0].Host); g < 0 || h < 0 || g%bs != 0 || h%bs != 0 || g+h >= len(p) {
				c.t.Errorf("match tiers: %+v for a prompt of %d tokens", tm[0], len(p))
			}
		}
		if len(live) > 0 {
			ids := make([]int64, len(live))
			counts := make([]int32, len(live))
			var toks []int32
			for i, s := range live {
				ids[i] = s.id
				counts[i] = int32(1 + r.IntN(bs+2))
				for range counts[i] {
					toks = append(toks, r.Int32N(3))
				}
			}
			if c.log.ok("grow tokens", m.GrowTokens(ids, counts, toks)) {
				k := 0
				for i, s := range live {
					s.toks = append(s.toks, toks[k:k+int(counts[i])]...)
					k += int(counts[i])
				}
			}
			table := make([]int32, len(live)*maxBlocks)
			lens := make([]int32, len(live))
			if _, err := m.Describe(ids, maxBlocks, table, lens, nil); c.log.ok("describe", err) {
				c.checkRows(live, maxBlocks, table, lens)
			}
		}
		if tk, _, err := m.FlushCopies(); c.log.ok("flush copies", err) && tk != 0 {
			tickets = append(tickets, tk)
		}
		if len(tickets) > 1 {
			c.log.ok("complete copies", m.CompleteCopies(tickets[0], r.IntN(16) == 0))
			tickets = tickets[1:]
		}
		if r.IntN(2) == 0 {
			m.MarkComputed()
		}
		// Remove the sequences grown to maxLen, and one at random now
		// and then.
		var ids []int64
		keep := live[:0]
		pick := -1
		if len(live) > 0 && r.IntN(3) == 0 {
			pick = r.IntN(len(live))
		}
		for i, s := range live {
			if i == pick || len(s.toks) >= c.maxLen {
				ids = append(ids, s.id)
			} else {
				keep = append(keep, s)
			}
		}
		live = keep
		if len(ids) > 0 {
			if err := m.Remove(ids); !c.log.ok("remove", err) {
				// Only blocks our sequences filled since the last
				// MarkComputed can be in use elsewhere: after it the
				// removal cannot meet one.
				m.MarkComputed()
				if err := m.Remove(ids); err != nil {
					c.t.Errorf("remove after MarkComputed: %v", err)
				}
			}
		}
		c.iters.Add(1)
	}
	for _, tk := range tickets {
		c.log.ok("complete copies", m.CompleteCopies(tk, false))
	}
	return live
}

// maxBlocks bounds a live sequence's blocks: it is removed in the step
// it reaches maxLen, after a growth of at most bs+1 tokens.
func (c *concRun) maxBlocks() int { return (c.maxLen + c.bs + c.bs) / c.bs }

func (c *concRun) stopped() bool {
	select {
	case <-c.stop:
		return true
	default:
		return false
	}
}

// operator runs the calls a serving process makes beside the scheduler
// until the workers are done: pins and unpins, priorities, matches,
// ClearPrefixCache, snapshots, stats (whose pool figures must add up at
// every call), CheckInvariants; and Close once closeAfter worker
// iterations are done (never when closeAfter is 0).
func (c *concRun) operator(seed uint64, closeAfter int64) {
	defer concGuard(c.t, "operator")
	m := c.m
	r := rand.New(rand.NewPCG(seed, 99))
	var pins []uint64
	closed := closeAfter == 0
	for it := 0; !c.stopped(); it++ {
		p := c.prompts[r.IntN(len(c.prompts))]
		switch it % 9 {
		case 0:
			if id, n, err := m.Pin(p, nil); c.log.ok("pin", err) {
				if n < 1 {
					c.t.Errorf("pin: %d blocks pinned", n)
				}
				pins = append(pins, id)
			}
		case 1:
			if len(pins) > 0 {
				c.log.ok("unpin", m.Unpin(pins[0]))
				pins = pins[1:]
			}
		case 2:
			if n, err := m.ClearPrefixCache(); c.log.ok("clear prefix cache", err) && n < 0 {
				c.t.Errorf("clear prefix cache: %d blocks", n)
			}
		case 3:
			out := make([]MatchInfo, 1)
			if c.log.ok("match", m.Match(one(c.prompt(r), nil), true, out)) && (out[0].Tokens%int32(c.bs) != 0 || out[0].PartialTokens < 0) {
				c.t.Errorf("match: %+v", out[0])
			}
		case 4:
			_, err := m.SetPriority(p, nil, int32(r.IntN(3)))
			c.log.ok("set priority", err)
		case 5:
			c.log.ok("check invariants", m.CheckInvariants())
		case 6:
			if r.IntN(4) == 0 {
				c.log.ok("event snapshot", m.RequestEventSnapshot())
			} else {
				_, _, err := m.NextEventSize()
				c.log.ok("next event size", err)
			}
		case 7:
			st := m.Stats()
			if st.FreeBlocks+st.UsedBlocks+st.CachedBlocks != st.NumBlocks || st.NumTokens < 0 {
				c.t.Errorf("stats: %d free + %d used + %d cached blocks, a pool of %d", st.FreeBlocks, st.UsedBlocks, st.CachedBlocks, st.NumBlocks)
			}
			_ = m.PrefixStats()
			_ = m.TierStats()
		case 8:
			if !closed && c.iters.Load() >= closeAfter {
				closed = true
				c.log.ok("close", m.Close())
				c.lookupsAtClose.Store(m.TierStats().Shared.Lookups)
			}
		}
	}
	for _, id := range pins {
		c.log.ok("unpin", m.Unpin(id))
	}
}

// drainer drains the KV events in limits that vary, applying them in
// order to truth, until the workers are done.
func (c *concRun) drainer(seed uint64, truth *prefix.EventIndex) {
	defer concGuard(c.t, "drainer")
	r := rand.New(rand.NewPCG(seed, 7))
	for {
		done := c.stopped()
		lim := EventLimits{Events: 1 + r.IntN(8), Tokens: c.bs * (1 + r.IntN(2)), MM: 0, Hashes: 1 + r.IntN(3)}
		evs, err := c.m.DrainEvents(lim)
		if c.log.ok("drain events", err) {
			for _, ev := range evs {
				if err := truth.Apply(ev); err != nil {
					c.t.Errorf("drained events out of order: %v", err)
					return
				}
			}
		}
		if done && len(evs) == 0 {
			return
		}
	}
}

// run runs workers and the operator and drainer beside them, then checks
// the manager against what they did, and that it drains to an empty
// cache.
func (c *concRun) run(workers, iters int, seed uint64, closeAfter int64) {
	t, m := c.t, c.m
	c.stop = make(chan struct{})
	truth := prefix.NewEventIndex()
	var side sync.WaitGroup
	side.Go(func() { c.operator(seed, closeAfter) })
	side.Go(func() { c.drainer(seed, truth) })
	lives := make([][]*concSeq, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() { lives[w] = c.worker(w, iters, seed) })
	}
	wg.Wait()
	close(c.stop)
	side.Wait()
	if t.Failed() {
		t.FailNow()
	}

	// The copies and reloads still queued, to completion.
	for range 8 {
		tk, _, err := m.FlushCopies()
		must(t, err)
		if tk == 0 {
			break
		}
		must(t, m.CompleteCopies(tk, false))
	}
	must(t, m.CheckInvariants())
	var live []*concSeq
	for _, l := range lives {
		live = append(live, l...)
	}
	c.checkState(live)
	applyEvents(t, truth, drainAll(t, m))
	sameTiers(t, m, truth, nil)

	// Everything removed: the pool is free and cached blocks, and
	// ClearPrefixCache then frees them all.
	m.MarkComputed()
	for k := 0; k < len(live); k += MaxBatch {
		ids := make([]int64, 0, MaxBatch)
		for _, s := range live[k:min(k+MaxBatch, len(live))] {
			ids = append(ids, s.id)
		}
		must(t, m.Remove(ids))
	}
	st := m.Stats()
	if st.UsedBlocks != 0 || st.NumSeqs != 0 || st.FreeBlocks+st.CachedBlocks != st.NumBlocks {
		t.Fatalf("after removing every sequence: %+v", st)
	}
	n, err := m.ClearPrefixCache()
	must(t, err)
	if st2 := m.Stats(); n != st.CachedBlocks || st2.FreeBlocks != st.NumBlocks || m.PrefixStats().CachedBlocks != 0 {
		t.Fatalf("clear freed %d of %d cached blocks: %+v", n, st.CachedBlocks, st2)
	}
	must(t, m.CheckInvariants())
	applyEvents(t, truth, drainAll(t, m))
	sameTiers(t, m, truth, nil)
	t.Logf("%d worker steps, %d tokens matched; %s; tier %+v", c.iters.Load(), c.matched.Load(), c.log, m.TierStats())
}

// checkState checks the quiet manager against the workers' live
// sequences: the stats add up, Describe gives each sequence its length
// and a table whose partial last block is its own, and every block of a
// table that the prefix cache holds is cached under the hash of the
// sequence's tokens at that place.
func (c *concRun) checkState(live []*concSeq) {
	t, m, bs := c.t, c.m, c.bs
	st := m.Stats()
	tokens := 0
	for _, s := range live {
		tokens += len(s.toks)
	}
	if st.NumSeqs != len(live) || st.NumTokens != int64(tokens) || st.FreeBlocks+st.UsedBlocks+st.CachedBlocks != st.NumBlocks {
		t.Fatalf("stats %+v; the workers hold %d sequences of %d tokens", st, len(live), tokens)
	}
	if ts := m.TierStats(); ts.InFlight != 0 || ts.Host.Reserved != 0 || ts.Host.Pinned != 0 {
		t.Fatalf("tier copies left in flight: %+v", ts)
	}
	if len(live) == 0 {
		return
	}
	maxBlocks := c.maxBlocks()
	ids := make([]int64, len(live))
	for i, s := range live {
		ids[i] = s.id
	}
	table := make([]int32, len(live)*maxBlocks)
	lens := make([]int32, len(live))
	_, err := m.Describe(ids, maxBlocks, table, lens, nil)
	must(t, err)
	c.checkRows(live, maxBlocks, table, lens)
	owner := map[int32]int64{}
	for i, s := range live {
		row := table[i*maxBlocks : (i+1)*maxBlocks]
		if len(s.toks)%bs != 0 {
			last := row[len(s.toks)/bs]
			if o, ok := owner[last]; ok {
				t.Errorf("sequences %d and %d share block %d, %d's partial last block", o, s.id, last, s.id)
			}
			owner[last] = s.id
		}
		chain := wholeChain(t, s.toks, bs, nil)
		for j, h := range chain {
			if got, ok := m.cache.BlockHash(row[j]); ok && got != h {
				t.Errorf("sequence %d's block %d (%d) is cached as %s; its tokens hash to %s", s.id, j, row[j], got, h)
			}
		}
	}
}

// Scheduler threads, an operator (pins, priorities, matches,
// ClearPrefixCache, snapshots, stats, invariant checks) and an event
// consumer on one manager with the prefix cache, KV events and a
// host tier: no call fails with a code it may not return, the invariants
// hold after every call (race builds) and at the end, the events replay
// to the cache's contents, and the host tier's reloads read the blocks
// their demotions wrote.
func TestConcurrentPrefixCache(t *testing.T) {
	const bs = 4
	m, cp := newConcMgr(t, 64, bs, 24, 8, "")
	r := rand.New(rand.NewPCG(1, 39))
	c := &concRun{t: t, m: m, bs: bs, log: &codeLog{t: t}, maxLen: 40}
	for range 3 {
		c.prompts = append(c.prompts, seqTokens(r, 3*bs))
	}
	c.run(4, 600, 1, 0)
	cp.check(t)
	ts := m.TierStats()
	if c.matched.Load() == 0 || ts.DemotionsCompleted == 0 || c.log.count("remove", kverr.OK) == 0 || c.log.count("grow tokens", kverr.OK) == 0 {
		t.Fatalf("the workload missed the prefix cache or the host tier: %d tokens matched, %+v", c.matched.Load(), ts)
	}
}

// The same with a shared tier on a real server holding prompts another
// instance stored: admissions and matches fetch them outside the
// manager's lock, concurrently with each other and with every other
// call, and the operator closes the manager half way. Reloads read the
// bytes the server held for their blocks; no fetch starts after Close
// but those already under way.
func TestConcurrentPrefixCacheSharedTier(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(2, 39))
	var stored [][]int32
	for range 3 {
		conv := seqTokens(r, 4*bs+1)
		storeConv(t, srv.Addr(), bs, conv)
		stored = append(stored, conv[:4*bs])
	}
	m, cp := newConcMgr(t, 64, bs, 12, 8, srv.Addr())
	for _, p := range stored {
		cp.know(wholeChain(t, p, bs, nil))
	}
	c := &concRun{t: t, m: m, bs: bs, log: &codeLog{t: t}, prompts: stored, maxLen: 40}
	const workers, iters = 4, 400
	c.run(workers, iters, 2, workers*iters/2)
	cp.check(t)
	ts := m.TierStats()
	if ts.Shared.Fetched == 0 || ts.Shared.Corrupt+ts.Shared.Timeouts+ts.Shared.Errors != 0 || c.log.count("close", kverr.OK) != 1 {
		t.Fatalf("the workload missed the shared tier, or met a fault: %+v", ts.Shared)
	}
	// A fetch that had begun when Close was called may still count its
	// lookup, one per worker at most; none begins after.
	if after := ts.Shared.Lookups - c.lookupsAtClose.Load(); after > workers {
		t.Fatalf("%d lookups after Close returned, with %d workers", after, workers)
	}
	// Closed: nothing looks the server up any more.
	lookups := ts.Shared.Lookups
	admit(t, m, 1, append(slices.Clone(stored[0]), 1), nil)
	tierMatch(t, m, append(slices.Clone(stored[1]), 1))
	if got := m.TierStats().Shared.Lookups; got != lookups {
		t.Fatalf("%d lookups after Close", got-lookups)
	}
}

// holdGate is a TCP proxy in front of a server that can stop a round trip at
// a known point: armed with a command name, it holds the next pipeline
// that carries the command before the server sees it, until released.
// The call that sent the pipeline then waits mid-round-trip, holding its
// connection, for as long as the test wants.
type holdGate struct {
	t      testing.TB
	ln     net.Listener
	target string

	mu       sync.Mutex
	cmd      []byte        // "\r\nNAME\r\n" of the command to hold next; nil: none
	held     chan struct{} // closed once that pipeline is held
	release  chan struct{} // closed to let it through
	releases []func()      // every hold's release (cleanup calls them; a second call does nothing)
	accepted int
	open     int
	conns    []net.Conn
}

func newHoldGate(t testing.TB, target string) *holdGate {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &holdGate{t: t, ln: ln, target: target}
	t.Cleanup(func() {
		ln.Close()
		g.mu.Lock()
		rel := g.releases
		for _, c := range g.conns {
			c.Close()
		}
		g.mu.Unlock()
		for _, f := range rel {
			f()
		}
	})
	go g.serve()
	return g
}

func (g *holdGate) addr() string { return g.ln.Addr().String() }

// hold arms the holdGate for the next pipeline carrying command cmd; held is
// closed once it is held, and release lets it through.
func (g *holdGate) hold(cmd string) (held <-chan struct{}, release func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cmd = []byte("\r\n" + cmd + "\r\n")
	g.held = make(chan struct{})
	g.release = make(chan struct{})
	rel := g.release
	release = sync.OnceFunc(func() { close(rel) })
	g.releases = append(g.releases, release)
	return g.held, release
}

// counts returns the connections accepted so far and those still open.
func (g *holdGate) counts() (accepted, open int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.accepted, g.open
}

func (g *holdGate) serve() {
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", g.target)
		if err != nil {
			c.Close()
			continue
		}
		g.mu.Lock()
		g.accepted++
		g.open++
		g.conns = append(g.conns, c, s)
		g.mu.Unlock()
		var both sync.WaitGroup
		both.Go(func() {
			io.Copy(c, s)
			c.Close()
		})
		both.Go(func() {
			defer s.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if err != nil {
					return
				}
				if rel := g.stop(buf[:n]); rel != nil {
					<-rel
				}
				if _, err := s.Write(buf[:n]); err != nil {
					return
				}
			}
		})
		go func() {
			both.Wait()
			g.mu.Lock()
			g.open--
			g.mu.Unlock()
		}()
	}
}

// stop returns the channel to wait on before forwarding chunk: the
// release of an armed hold that chunk's command triggers; nil to go on.
func (g *holdGate) stop(chunk []byte) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.cmd == nil || !bytes.Contains(chunk, g.cmd) {
		return nil
	}
	g.cmd = nil
	close(g.held)
	return g.release
}

// concWaitFor waits until cond holds, failing the test after 10 s.
func concWaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// concWaitChan waits until ch is closed or sends, failing after 10 s.
func concWaitChan[T any](t testing.TB, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

// concWithin runs f on another goroutine and fails the test unless it
// returns within 5 s: calls that must not wait on a held round trip.
// f reports with t.Error.
func concWithin(t testing.TB, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer concGuard(t, what)
		f()
	}()
	concWaitChan(t, what+" (they must not wait on the held round trip)", done)
}

// concAdmitResult is what an Admit run on its own goroutine returned.
type concAdmitResult struct {
	n, matched int
	err        error
}

// concGoClose closes m on a goroutine of its own and waits until Close
// has marked the shared tier closed; Close's result comes on the channel.
func concGoClose(t testing.TB, m *Manager) <-chan error {
	t.Helper()
	closed := make(chan error, 1)
	go func() { closed <- m.Close() }()
	concWaitFor(t, "Close to mark the shared tier closed", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.tier.SharedClosed()
	})
	return closed
}

// concGoAdmit admits sequence id with prompt p on another goroutine.
func concGoAdmit(m *Manager, id int64, p []int32) <-chan concAdmitResult {
	out := make(chan concAdmitResult, 1)
	go func() {
		matched := []int32{-1}
		n, err := m.Admit([]int64{id}, one(p, nil), matched)
		out <- concAdmitResult{n, int(matched[0]), err}
	}()
	return out
}

// concOtherCalls runs, on m, one of every call that needs no round trip to
// the shared tier (sequence id, a prompt of one partial block), checking
// that each succeeds; the events it drains go to truth.
func concOtherCalls(t testing.TB, m *Manager, id int64, r *rand.Rand, truth *prefix.EventIndex) {
	bs := m.BlockSize()
	short := seqTokens(r, bs-1) // no full block: nothing to fetch
	if n, err := m.Admit([]int64{id}, one(short, nil), nil); err != nil || n != 1 {
		t.Errorf("admit: %d, %v", n, err)
		return
	}
	for _, err := range []error{
		m.GrowTokens([]int64{id}, []int32{int32(bs)}, seqTokens(r, bs)),
		m.MatchTiers(one(short, nil), make([]TierMatch, 1)),
		m.Match(one(short, nil), true, make([]MatchInfo, 1)),
		func() error {
			_, err := m.Describe([]int64{id}, 4, make([]int32, 4), make([]int32, 1), nil)
			return err
		}(),
		func() error {
			evs, err := m.DrainEvents(NoEventLimits)
			for _, ev := range evs {
				if err := truth.Apply(ev); err != nil {
					return err
				}
			}
			return err
		}(),
		func() error {
			tk, _, err := m.FlushCopies()
			if err == nil && tk != 0 {
				err = m.CompleteCopies(tk, false)
			}
			return err
		}(),
		func() error { m.MarkComputed(); return m.Remove([]int64{id}) }(),
		m.CheckInvariants(),
	} {
		if err != nil {
			t.Error(err)
		}
	}
	_, _ = m.Stats(), m.TierStats()
}

// Admit's shared-tier fetch runs outside the manager's lock. With one
// admission's fetch stopped after it reserved its host slots (its GET
// held at the server), every call that needs no round trip runs and
// returns, and a second admission of the same prompt waits for the
// connection, not for the lock; once released, both start on the
// fetched blocks, which hold the bytes the server had.
func TestConcurrentSharedFetchAgainstAdmit(t *testing.T) {
	const bs = 4
	srv, r, conv := newStoredConv(t, 3, 39)
	g := newHoldGate(t, srv.Addr())
	m, cp := newConcMgr(t, 32, bs, 16, 0, g.addr())
	cp.know(wholeChain(t, conv, bs, nil))
	truth := prefix.NewEventIndex()

	held, release := g.hold("GET")
	a := concGoAdmit(m, 1, conv)
	concWaitChan(t, "the first admission's GET", held)
	b := concGoAdmit(m, 2, conv)
	concWithin(t, "calls while a fetch is under way", func() {
		if ts := m.TierStats(); ts.Host.Reserved != 4 || ts.Host.Resident != 0 {
			t.Errorf("while the fetch reads: %+v, want its 4 host slots reserved", ts.Host)
		}
		concOtherCalls(t, m, 10, r, truth)
	})
	select {
	case res := <-a:
		t.Fatalf("the admission returned while its fetch was held: %+v", res)
	default:
	}
	applyEvents(t, truth, drainAll(t, m))
	release()
	for i, ch := range []<-chan concAdmitResult{a, b} {
		res := concWaitChan(t, "the admissions", ch)
		if res.err != nil || res.n != 1 || res.matched != 4*bs {
			t.Fatalf("admission %d: %+v, want the 4 stored blocks matched", i+1, res)
		}
	}
	// Whichever admission takes the lock first after the release admits
	// with the host blocks: the first, counting them as its own fetch's
	// (HitTokens), or the second, whose lookup came after the fetch
	// committed, as host hits; the other then matches them on the GPU.
	ts := m.TierStats()
	if sh := ts.Shared; sh.Fetched != 4 || sh.FetchMisses != 0 || sh.Corrupt+sh.Timeouts+sh.Errors != 0 ||
		(sh.HitTokens != 4*bs && sh.HitTokens != 0) || ts.HostHitTokens != 4*bs {
		t.Fatalf("shared tier: %+v, host hit tokens %d: want the 4 blocks fetched once and admitted from the host once",
			sh, ts.HostHitTokens)
	}
	if ts.Host.Resident != 4 || ts.Host.Reserved != 0 {
		t.Fatalf("host tier: %+v", ts.Host)
	}
	tk, _, err := m.FlushCopies()
	must(t, err)
	must(t, m.CompleteCopies(tk, false))
	cp.check(t)
	if cp.ops.Load() < 4 {
		t.Fatalf("%d copies, want the 4 reloads", cp.ops.Load())
	}
	m.MarkComputed()
	must(t, m.Remove([]int64{1, 2}))
	must(t, m.CheckInvariants())
	applyEvents(t, truth, drainAll(t, m))
	sameTiers(t, m, truth, nil)
	if ts := m.TierStats(); ts.Host.Pinned != 0 || ts.InFlight != 0 {
		t.Fatalf("after the reloads: %+v", ts)
	}
}

// Close while an admission's fetch is under way (its GET held at the
// server): Close marks the tier closed at once and neither it nor the
// fetch holds the manager's lock while they wait, so every other call
// runs, and admissions begun after it look nothing up. Once released,
// the admission and Close return, the connection is closed, and no
// later call dials the server or looks anything up.
func TestConcurrentSharedFetchAgainstClose(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4
	r := rand.New(rand.NewPCG(4, 39))
	convs := make([][]int32, 3)
	for i := range convs {
		convs[i] = seqTokens(r, 4*bs+1)
		storeConv(t, srv.Addr(), bs, convs[i])
	}
	g := newHoldGate(t, srv.Addr())
	m, cp := newConcMgr(t, 32, bs, 16, 0, g.addr())
	for _, c := range convs {
		cp.know(wholeChain(t, c, bs, nil))
	}
	truth := prefix.NewEventIndex()

	held, release := g.hold("GET")
	a := concGoAdmit(m, 1, convs[0])
	concWaitChan(t, "the admission's GET", held)
	closed := concGoClose(t, m)
	lookups := m.TierStats().Shared.Lookups
	concWithin(t, "calls while Close waits on a fetch", func() {
		concOtherCalls(t, m, 10, r, truth)
		matched := []int32{-1}
		if n, err := m.Admit([]int64{2}, one(convs[1], nil), matched); err != nil || n != 1 || matched[0] != 0 {
			t.Errorf("an admission after Close began: %d, %v, matched %d; want it computed", n, err, matched[0])
		}
	})
	if got := m.TierStats().Shared.Lookups; got != lookups {
		t.Fatalf("%d lookups began after Close", got-lookups)
	}
	applyEvents(t, truth, drainAll(t, m))
	release()
	res := concWaitChan(t, "the admission", a)
	must(t, concWaitChan(t, "Close", closed))
	// The fetch sent its GET before Close: it may have read the blocks,
	// or missed them; either way its slots are given back or committed.
	ts := m.TierStats()
	if res.err != nil || res.n != 1 || res.matched != int(ts.Shared.Fetched)*bs || ts.Host.Reserved != 0 {
		t.Fatalf("admission %+v; %+v", res, ts)
	}
	concWaitFor(t, "the server connection to close", func() bool { _, open := g.counts(); return open == 0 })
	dials, _ := g.counts()
	lookups = ts.Shared.Lookups
	if got := admit(t, m, 3, convs[2], nil); got != 0 {
		t.Fatalf("after Close: matched %d tokens of a prompt only the server holds", got)
	}
	if got := tierMatch(t, m, convs[2]); got.Host != 0 {
		t.Fatalf("after Close: %+v", got)
	}
	must(t, m.Close())
	if d, open := g.counts(); d != dials || open != 0 || m.TierStats().Shared.Lookups != lookups {
		t.Fatalf("after Close: %d more connections (%d open), %d more lookups", d-dials, open, m.TierStats().Shared.Lookups-lookups)
	}
	flushCompleted(t, m)
	cp.check(t)
	m.MarkComputed()
	must(t, m.Remove([]int64{1, 2, 3}))
	must(t, m.CheckInvariants())
	applyEvents(t, truth, drainAll(t, m))
	sameTiers(t, m, truth, nil)
	if ts := m.TierStats(); ts.Host.Pinned != 0 || ts.InFlight != 0 {
		t.Fatalf("at the end: %+v", ts)
	}
}
