package vmem

import "time"

// The background mapper runs between Steps, while the GPU executes the
// step's kernels. It maps each active slot ahead to its last context length
// plus the lookahead, so the next Step usually finds its pages mapped, and
// reclaims freed slots' pages when the free budget falls under the
// threshold. It takes the lock only to pick a job and to commit it: driver
// calls run unlocked, so Step's fast path never waits for them. A slot with
// a job in flight is marked busy; a Step that needs more of that slot's
// pages waits for the job instead of mapping the same addresses.

type job struct {
	slot    int
	reclaim bool
	from    int    // first unit
	handles []Page // map: pages to map (from the pool); reclaim: pages to unmap
	create  int    // map: units still to create
}

func (c *Cache) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

func (c *Cache) backgroundLoop() {
	defer close(c.done)
	for {
		select {
		case <-c.stop:
			return
		case <-c.wake:
		}
		c.backgroundPass()
	}
}

func (c *Cache) backgroundPass() {
	c.mu.Lock()
	c.passStart++
	gen := c.passStart
	c.mu.Unlock()
	for {
		c.mu.Lock()
		j, ok := c.nextJobLocked()
		c.mu.Unlock()
		if !ok {
			break
		}
		start := time.Now()
		res := c.runJob(j)
		c.bgNs.Add(int64(time.Since(start)))
		c.mu.Lock()
		c.finishJobLocked(j, res)
		c.mu.Unlock()
		if res.err != nil {
			// Step maps what it needs itself; retrying here could spin.
			c.bgErrors.Add(1)
			break
		}
	}
	c.mu.Lock()
	c.passEnd = gen
	c.cond.Broadcast()
	c.mu.Unlock()
}

// nextJobLocked picks the next job and marks its slot busy.
func (c *Cache) nextJobLocked() (job, bool) {
	if c.closed {
		return job{}, false
	}
	n := len(c.slots)
	maxCtx := int32(c.layout.MaxContext)
	for i := 0; i < n; i++ {
		s := (c.cursor + i) % n
		st := &c.slots[s]
		if !st.active || st.busy {
			continue
		}
		want := c.unitsFor(min(st.lastCtx+c.lookahead, maxCtx))
		if want <= st.units {
			continue
		}
		k := want - st.units
		if free := c.freeUnitsLocked(); free < k {
			if r := c.reclaimCandidateLocked(); r >= 0 {
				return c.startReclaimLocked(r), true
			}
			k = free
		}
		if k <= 0 {
			continue
		}
		c.cursor = (s + 1) % n
		handles, create := c.takeLocked(k)
		st.busy = true
		return job{slot: s, from: st.units, handles: handles, create: create}, true
	}
	if c.freeUnitsLocked() < c.reclaimBelow {
		if r := c.reclaimCandidateLocked(); r >= 0 {
			return c.startReclaimLocked(r), true
		}
	}
	return job{}, false
}

// startReclaimLocked detaches all of freed slot r's pages for unmapping.
// The slot shows nothing mapped from now on, so a Step after an Alloc of it
// waits for the job rather than trusting pages on their way out.
func (c *Cache) startReclaimLocked(r int) job {
	st := &c.slots[r]
	pages := make([]Page, st.units*c.nbuf)
	copy(pages, st.pages)
	c.mapped -= st.units
	c.reclaiming += st.units
	st.pages, st.units, st.tokens = st.pages[:0], 0, 0
	st.busy = true
	return job{slot: r, reclaim: true, handles: pages}
}

type jobResult struct {
	created []Page // map: pages created by the job
	undone  int    // reclaim: trailing units unmapped
	err     error
}

// runJob makes the driver calls of a job, without the lock.
func (c *Cache) runJob(j job) jobResult {
	if j.reclaim {
		n, err := c.unmapUnits(j.slot, j.from, j.handles)
		return jobResult{undone: n, err: err}
	}
	created, err := c.createUnits(j.create)
	if err == nil {
		all := append(j.handles, created...)
		err = c.mapUnits(j.slot, j.from, all)
	}
	return jobResult{created: created, err: err}
}

func (c *Cache) finishJobLocked(j job, res jobResult) {
	st := &c.slots[j.slot]
	st.busy = false
	defer c.cond.Broadcast()
	if j.reclaim {
		units := len(j.handles) / c.nbuf
		c.reclaiming -= units
		c.pool = append(c.pool, j.handles[(units-res.undone)*c.nbuf:]...)
		if res.err != nil {
			// Units below the one that failed were never touched: they go
			// back to the slot. The failed unit stays held but unusable.
			keep := units - res.undone - 1
			st.pages = append(st.pages[:0], j.handles[:keep*c.nbuf]...)
			st.units = keep
			st.tokens = c.tokensFor(keep)
			c.mapped += keep
		}
		return
	}
	all := append(j.handles, res.created...)
	if res.err != nil {
		c.held -= j.create - len(res.created)/c.nbuf
		c.pool = append(c.pool, all...)
		return
	}
	c.commitMapLocked(st, all)
}

// WaitBackground returns once a background pass that started after the call
// has finished, so every job the cache's state called for at the call is
// done (or failed). It returns at once when background mapping is off.
func (c *Cache) WaitBackground() {
	if !c.background {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	target := c.passStart + 1
	c.signal()
	for c.passEnd < target && !c.closed {
		c.cond.Wait()
	}
}
