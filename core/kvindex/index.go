// Package kvindex is a cluster prefix index for KV-aware routing: it
// subscribes to the KV event streams of N engine instances (kvplug's
// publisher, or vLLM's and SGLang's own, whose block hashes it translates:
// see "Engines"), keeps which instance holds which block in a
// Backend (in memory, or a Valkey/Redis server shared by several routers),
// and answers, for a prompt's tokens and keys, each instance's longest
// cached prefix in tokens. It hashes prompts with core/prefix, the
// engines' own code, so its hashes always agree with theirs.
//
// # Media
//
// Events name the medium of their blocks (vLLM's "medium"): "GPU" for an
// engine's prefix cache, "CPU" for its host tier (kvplug's, or vLLM's
// CPU offloading), "SHARED" for a tier that instances share (kvplug's
// name, reserved for a shared store); an event without one is the GPU's,
// names are matched in any case, and an event of any other medium is
// ignored and counted (InstanceStatus.UnknownMedium). The index keeps each
// instance's blocks per medium, and a query reports, per instance, the
// prompt's longest prefix on the GPU and how far the CPU tier, then the
// shared tier, continue it (Held): the blocks the engine would reuse, the
// GPU's at once and the others after a copy. Instances are ranked by
//
//	score = gpu_tokens + CPUWeight*cpu_tokens + SharedWeight*shared_tokens
//
// with CPUWeight 0.75 and SharedWeight 0.25 unless configured: a token
// reloaded from host memory saves most of its prefill (issue 23's
// figures: a 2048-token Llama-3-8B prefix, 256 MB, reloads in about 5 ms
// over a 50 GB/s link against tens of ms to recompute) but costs more than
// a GPU hit, and a fetch from a shared store over the network costs more
// again. Weights are in [0, 1]: no lower tier outranks the GPU.
//
// A hybrid model's engine publishes every layer group's blocks, each event
// with vLLM's group_idx. The index keeps group 0's (full attention: the
// prefix) and passes over the others' events, which name the same hashes;
// so it reports a hybrid model's prefix without the cuts its window and
// recurrent groups make (core/kvevents, Encoding.Groups).
//
// Each instance's stream is checked as it comes: a batch whose sequence
// number skips ahead is a gap, filled from the instance's replay socket;
// a gap older than the replay buffer, an instance that restarted
// (sequence numbers going back), an undecodable batch or a backend that
// failed or restarted mark the instance stale: its set is cleared, a
// snapshot is requested, and until the snapshot's AllBlocksCleared
// arrives the index reports the instance as stale (scored 0) rather than
// guess. A snapshot cut into several batches (more blocks than the
// publisher's MaxBatchEvents) names how many follow its AllBlocksCleared
// (kvevents.SnapshotRestField): the instance is stale until the last is
// applied, also when it arrives in sequence while the instance is fresh
// (another subscriber asked for it), since the set shows only in part
// until then; a gap that cannot be replayed meanwhile restarts the wait.
// A snapshot without the field (one batch, or an older publisher's) is
// whole once its batch is applied. A batch numbered 2^63-1 or beyond (no
// publisher counts that far; the next number would wrap) is a faulty
// publisher's: counted as a bad batch, its set cleared, stale until its
// sequence restarts.
//
// # Engines
//
// An instance whose manager is kvplug's (InstanceConfig.Engine "kvplug",
// the default) publishes kvplug's block hashes, which queries look up
// directly, and answers snapshot requests. vLLM's and SGLang's own
// publishers ("vllm", "sglang") send their engines' hashes, which no
// query can compute, and no snapshots: the index translates each block
// into its own hash from the token_ids, keys and parent every BlockStored
// carries (translator says what maps). Such an instance is fresh once
// connected, its set empty (an idle engine's is), and the set is built
// from the first batch the index sees, after replaying the earlier
// batches its publisher still holds; it is stale during that replay,
// whose batches store blocks the engine may have evicted since. An
// instance joined mid-stream (its older batches gone) lacks the blocks
// stored before it joined, and their descendants, until they are stored
// again: counted (InstanceStatus.JoinedMidStream,
// Untranslated), under-reported, never routed to wrongly. A gap that
// cannot be replayed restarts its set the same way.
//
// # Liveness
//
// Each instance is in one of three states (State): fresh (connected, in
// sync and heard from: scored), stale (connected, waiting for a snapshot)
// or down (not connected: its publisher is gone, refuses the connection or
// went silent). A stale or down instance is scored as absent (0, never
// Best), and a down one's blocks are cleared from the backend, so routers
// reading a shared Valkey stop using them too; so is a set that a writer
// index finds on starting (an earlier writer's, its instance unreachable
// now) or that a restarted backend brings back while the instance is down. An engine that exits
// closes its connection, and the instance is down at once. One whose
// host vanishes or hangs is caught by silence: after IdleTimeout without a
// batch the index sends a ZMTP heartbeat (PING) on the subscription, and
// when no PONG comes within Timeout it asks the replay endpoint, which
// answers an empty replay while the publisher runs; when neither answers
// the instance is down, and the index redials until the publisher is
// back, then resynchronises from a snapshot.
package kvindex

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

// InstanceConfig names one engine instance and where its events are.
type InstanceConfig struct {
	Name string
	// Endpoint is its PUB socket, which the index connects to: the
	// publisher must bind it (kvplug's does by default; vLLM's for a
	// tcp://*:PORT or ipc:// endpoint).
	Endpoint       string
	ReplayEndpoint string // its ROUTER socket; "" when it has none
	Topic          string // subscription prefix; "" is every topic
	BlockSize      int    // tokens per block; 0: the Index's
	// HashFormat is how the instance sends hashes until its first
	// BlockStored says (a ReadOnly index never learns it).
	HashFormat kvevents.HashFormat
	// Engine is the engine behind the events (see "Engines"): "" or
	// EngineKvplug, EngineVLLM, EngineSGLang.
	Engine string
}

// Config configures an Index.
type Config struct {
	Instances []InstanceConfig
	BlockSize int // default block size; 0: 16
	Backend   Backend
	// Timeout bounds a connection attempt, a replay and the wait for a
	// heartbeat's answer; 0: 2 s.
	Timeout time.Duration
	// IdleTimeout is how long an instance may send nothing before the
	// index checks that it is still there (see "Liveness"); 0: 5 s, < 0:
	// never (an instance is then down only when its connection closes).
	IdleTimeout time.Duration
	// ReadOnly queries a backend that another Index keeps (router
	// replicas sharing one Valkey): no subscriptions, and every instance
	// is taken as in sync (staleness is the writer's to report).
	ReadOnly bool
	// CPUWeight and SharedWeight are what a token held on the CPU tier
	// and on the shared tier count for in a score, against 1 for a GPU
	// token (see "Media"); in [0, 1]. 0 takes the default (0.75, 0.25); a
	// negative weight counts the tier's tokens for nothing.
	CPUWeight, SharedWeight float64
}

// Default weights of the tiers below the GPU (Config).
const (
	DefaultCPUWeight    = 0.75
	DefaultSharedWeight = 0.25
)

// Defaults of Config's durations.
const (
	DefaultTimeout     = 2 * time.Second
	DefaultIdleTimeout = 5 * time.Second
)

// State is an instance's state (see "Liveness").
type State string

// The states of an instance.
const (
	// StateFresh: connected, in sync and heard from; scored.
	StateFresh State = "fresh"
	// StateStale: connected, but the index cannot vouch for its set
	// (waiting for a snapshot); scored as absent.
	StateStale State = "stale"
	// StateDown: not connected (the publisher is gone, refuses the
	// connection, or went silent); scored as absent, its blocks cleared.
	StateDown State = "down"
)

// States lists the states in a fixed order (metrics).
var States = []State{StateFresh, StateStale, StateDown}

// Weights are the weights a score gives a token on each tier below the
// GPU.
type Weights struct {
	CPU    float64 `json:"cpu"`
	Shared float64 `json:"shared"`
}

// weight resolves a configured weight: 0 the default, < 0 nothing.
func weight(w, def float64, name string) (float64, error) {
	switch {
	case w == 0:
		return def, nil
	case w < 0:
		return 0, nil
	case w > 1 || w != w:
		return 0, fmt.Errorf("kvindex: %s weight %v out of [0, 1]", name, w)
	}
	return w, nil
}

// Index is the cluster prefix index. Create it with New, stop it with
// Close.
type Index struct {
	cfg     Config
	w       Weights
	be      Backend
	insts   []*instance
	byName  map[string]*instance
	stop    chan struct{}
	wg      sync.WaitGroup
	hashers sync.Pool
	updates atomic.Int64 // block keys added or removed, over all instances
	queries latency      // Query's latency and outcomes
}

// instance is one engine's stream and what the index knows of it.
type instance struct {
	cfg InstanceConfig
	x   *Index

	mu        sync.Mutex
	nextSeq   int64 // the next batch expected; -1 when none is
	stale     bool  // the backend's set may differ from the engine's
	down      bool  // no live connection (see "Liveness")
	gen       int64 // the backend generation the set was built in
	format    kvevents.HashFormat
	sub       *kvevents.SubConn
	lastErr   string
	lastReq   time.Time   // when a snapshot was last requested
	since     time.Time   // when the state last changed
	lastHeard time.Time   // the last batch or heartbeat answer
	logged    State       // the state last logged
	staleLog  time.Time   // when a long wait for a snapshot was last logged
	waiting   string      // what the instance waits for (status, logs)
	unclear   bool        // down, and the backend may hold its set (a failed clear, a writer's start, a backend restart): cleared while down
	xl        *translator // a foreign engine's hashes to the index's; nil for kvplug's

	// snapEnd is, while a snapshot cut into several batches is applied,
	// the number of its last batch (its AllBlocksCleared's batch plus its
	// kvevents.SnapshotRestField): the instance is stale, in sequence,
	// until that batch is applied. 0: none pending.
	snapEnd int64
	snapAt  time.Time // when the pending snapshot's last batch so far was applied

	batches, events, gaps, replayed, snapshots, resets, badBatches, backendErrors, unknownMedium atomic.Int64
	disconnects, heartbeats, heartbeatAnswers, probes                                            atomic.Int64
	midStream, untranslated, foreignHashes                                                       atomic.Int64
}

// New starts subscribing to every instance.
func New(cfg Config) (*Index, error) {
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 16
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("kvindex: timeout %v is negative", cfg.Timeout)
	}
	if cfg.Backend == nil {
		cfg.Backend = NewMemory()
	}
	if cfg.BlockSize < 1 || cfg.BlockSize > prefix.MaxBlockSize {
		return nil, fmt.Errorf("kvindex: block size %d out of [1, %d]", cfg.BlockSize, prefix.MaxBlockSize)
	}
	x := &Index{cfg: cfg, be: cfg.Backend, byName: map[string]*instance{}, stop: make(chan struct{})}
	var err error
	if x.w.CPU, err = weight(cfg.CPUWeight, DefaultCPUWeight, "CPU"); err != nil {
		return nil, err
	}
	if x.w.Shared, err = weight(cfg.SharedWeight, DefaultSharedWeight, "shared"); err != nil {
		return nil, err
	}
	x.hashers.New = func() any { return new(prefix.Hasher) }
	for _, ic := range cfg.Instances {
		if ic.Name == "" || ic.Endpoint == "" {
			return nil, fmt.Errorf("kvindex: an instance needs a name and an endpoint: %+v", ic)
		}
		if err := kvevents.CheckEndpoint(ic.Endpoint); err != nil {
			return nil, fmt.Errorf("kvindex: instance %q: %v", ic.Name, err)
		}
		if ic.ReplayEndpoint != "" {
			if err := kvevents.CheckEndpoint(ic.ReplayEndpoint); err != nil {
				return nil, fmt.Errorf("kvindex: instance %q: replay %v", ic.Name, err)
			}
		}
		if _, dup := x.byName[ic.Name]; dup {
			return nil, fmt.Errorf("kvindex: instance %q given twice", ic.Name)
		}
		if ic.BlockSize == 0 {
			ic.BlockSize = cfg.BlockSize
		}
		if ic.BlockSize < 1 || ic.BlockSize > prefix.MaxBlockSize {
			return nil, fmt.Errorf("kvindex: instance %q: block size %d out of range", ic.Name, ic.BlockSize)
		}
		foreign, err := engineOf(ic.Engine)
		if err != nil {
			return nil, fmt.Errorf("kvindex: instance %q: %v", ic.Name, err)
		}
		if foreign && cfg.ReadOnly {
			return nil, fmt.Errorf("kvindex: instance %q: a read-only index cannot translate %s hashes (only the writer sees the events)", ic.Name, ic.Engine)
		}
		// A writer starts each instance unclear: a shared backend may still
		// hold the set an earlier writer built (it restarted while the
		// engine went away), which readers route by until this one clears
		// it, so it clears it until it reaches the instance (whose
		// connection then resynchronises).
		in := &instance{cfg: ic, x: x, nextSeq: -1, stale: !cfg.ReadOnly, down: !cfg.ReadOnly, unclear: !cfg.ReadOnly,
			format: ic.HashFormat, since: time.Now()}
		if foreign {
			in.xl = newTranslator(ic.BlockSize)
			in.format = kvevents.HashBytes // the index's own hashes
		}
		in.logged = in.stateLocked()
		if in.down {
			in.waiting = in.dialWaiting(nil)
		}
		x.insts = append(x.insts, in)
		x.byName[ic.Name] = in
	}
	if cfg.ReadOnly {
		return x, nil
	}
	for _, in := range x.insts {
		x.wg.Add(1)
		go in.run()
	}
	x.wg.Add(1)
	go x.watchBackend()
	return x, nil
}

// Close stops the subscriptions (the backend stays open: it is the
// caller's).
func (x *Index) Close() {
	select {
	case <-x.stop:
		return
	default:
	}
	close(x.stop)
	for _, in := range x.insts {
		in.mu.Lock()
		if in.sub != nil {
			_ = in.sub.Close()
		}
		in.mu.Unlock()
	}
	x.wg.Wait()
}

// watchBackend pings a Valkey backend twice a second, so that a server
// restart is noticed (Generation) even while no event arrives.
func (x *Index) watchBackend() {
	defer x.wg.Done()
	v, ok := x.be.(*Valkey)
	if !ok {
		return
	}
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-x.stop:
			return
		case <-t.C:
			_ = v.Ping()
		}
	}
}

func (x *Index) stopped() bool {
	select {
	case <-x.stop:
		return true
	default:
		return false
	}
}

// waitingLogEvery is how often an instance that stays unreachable, or
// connected without a snapshot, says again what it waits for.
const waitingLogEvery = time.Minute

// run keeps the instance's subscription up and applies its batches.
func (in *instance) run() {
	defer in.x.wg.Done()
	backoff := 50 * time.Millisecond
	var said string // the dial failure last logged
	var saidAt time.Time
	for !in.x.stopped() {
		sub, err := kvevents.DialSub(in.cfg.Endpoint, in.cfg.Topic, in.x.cfg.Timeout)
		if err != nil {
			in.setErr(err)
			w := in.dialWaiting(err)
			g := in.x.be.Generation()
			in.mu.Lock()
			in.waiting = w
			if g != in.gen {
				// The backend restarted while the instance was down (a
				// Valkey loading an RDB or AOF taken while it was up):
				// the set it brings back is cleared again.
				in.gen, in.unclear = g, true
			}
			unclear := in.unclear
			in.mu.Unlock()
			if unclear {
				in.clearDown()
			}
			if err.Error() != said || time.Since(saidAt) >= waitingLogEvery {
				said, saidAt = err.Error(), time.Now()
				logx.L().Warn("kvindex: instance waiting for its publisher", zap.String("instance", in.cfg.Name),
					zap.String("endpoint", in.cfg.Endpoint), zap.String("mode", "SUB connects; the publisher must bind"),
					zap.Error(err))
			}
			select {
			case <-in.x.stop:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		backoff, said = 50*time.Millisecond, ""
		in.mu.Lock()
		in.sub = sub
		in.down, in.unclear = false, false // resync clears the set
		in.lastHeard = time.Now()
		in.mu.Unlock()
		if in.x.stopped() {
			_ = sub.Close()
			return
		}
		logx.L().Info("kvindex: instance connected", zap.String("instance", in.cfg.Name),
			zap.String("endpoint", in.cfg.Endpoint), zap.String("mode", "SUB connects"), zap.String("topic", in.cfg.Topic))
		// A new connection may have missed anything: rebuild from a
		// snapshot (the publisher's first batch is one anyway).
		in.resync("connected")
		in.consume(sub)
		_ = sub.Close()
	}
}

// dialWaiting says what an instance that is not connected waits for.
func (in *instance) dialWaiting(err error) string {
	w := "a publisher bound at " + in.cfg.Endpoint + " (the index's SUB connects)"
	if err != nil {
		var de *kvevents.DialError
		if errors.As(err, &de) {
			err = de.Err
		}
		w += ": " + err.Error()
	}
	return w
}

// pollInterval is the read deadline of a subscription: how often the loop
// looks at the backend, a snapshot's lateness and the instance's silence
// while no batch arrives.
const pollInterval = 500 * time.Millisecond

// consume applies batches until the connection fails or goes silent.
func (in *instance) consume(sub *kvevents.SubConn) {
	idle, timeout := in.x.cfg.IdleTimeout, in.x.cfg.Timeout
	heard := time.Now()
	var pinged time.Time // when a heartbeat went unanswered so far; zero: none pending
	pongs := sub.Pongs()
	for {
		_ = sub.SetDeadline(time.Now().Add(pollInterval))
		m, err := sub.Recv()
		now := time.Now()
		if p := sub.Pongs(); p != pongs {
			in.heartbeatAnswers.Add(p - pongs)
			pongs, heard, pinged = p, now, time.Time{}
			in.setHeard(now)
		}
		if err != nil {
			if in.x.stopped() {
				return
			}
			var ne interface{ Timeout() bool }
			if !errors.As(err, &ne) || !ne.Timeout() {
				in.setErr(err)
				in.markDown("its connection to " + in.cfg.Endpoint + " closed: " + err.Error())
				return
			}
			in.checkGeneration()
			in.retrySnapshot()
			if idle <= 0 || now.Sub(heard) < idle {
				continue
			}
			if pinged.IsZero() {
				in.heartbeats.Add(1)
				if err := sub.Ping(); err != nil {
					in.setErr(err)
					in.markDown("a heartbeat to " + in.cfg.Endpoint + " failed: " + err.Error())
					return
				}
				pinged = now
				continue
			}
			if now.Sub(pinged) < timeout {
				continue
			}
			if why := in.probe(now.Sub(heard)); why != "" {
				in.markDown(why)
				return
			}
			heard, pinged = now, time.Time{}
			in.setHeard(now)
			continue
		}
		heard, pinged = now, time.Time{}
		in.setHeard(now)
		in.checkGeneration()
		in.handle(m)
	}
}

// probe asks the replay endpoint of an instance whose subscription went
// silent and left a heartbeat unanswered; it returns why the instance is
// down, or "" when the publisher answered.
func (in *instance) probe(silent time.Duration) string {
	why := fmt.Sprintf("silent for %v: no batch, and no answer to a heartbeat on %s in %v",
		silent.Round(100*time.Millisecond), in.cfg.Endpoint, in.x.cfg.Timeout)
	if in.cfg.ReplayEndpoint == "" {
		return why
	}
	in.probes.Add(1)
	err := kvevents.ProbeReplay(in.cfg.ReplayEndpoint, in.x.cfg.Timeout)
	if err != nil {
		in.setErr(err)
		return why + ", nor from its replay endpoint " + in.cfg.ReplayEndpoint + " (" + err.Error() + ")"
	}
	// The publisher runs; its PUB socket does not answer heartbeats.
	logx.L().Debug("kvindex: instance silent, its replay endpoint answers", zap.String("instance", in.cfg.Name))
	return ""
}

// setHeard notes when the instance was last heard from.
func (in *instance) setHeard(t time.Time) {
	in.mu.Lock()
	in.lastHeard = t
	in.mu.Unlock()
}

// markDown takes the instance out of routing until it reconnects: its set
// is cleared (readers of a shared backend stop routing to it too).
func (in *instance) markDown(why string) {
	if in.x.stopped() {
		return
	}
	in.mu.Lock()
	// Counted before the state shows: Status reads the counters after the
	// state, so a status that says down has counted the disconnect.
	in.disconnects.Add(1)
	in.down, in.stale, in.nextSeq, in.snapEnd = true, true, -1, 0
	in.waiting = in.dialWaiting(nil)
	in.gen = in.x.be.Generation()
	in.mu.Unlock()
	in.clearDown()
	in.noteState(why)
}

// clearDown clears a down instance's set in the backend; when that fails
// (a Valkey server unreachable), run tries again while the instance stays
// down, so that readers of a shared backend stop routing to it.
func (in *instance) clearDown() {
	ok := in.clearSet()
	in.mu.Lock()
	in.unclear = !ok
	in.mu.Unlock()
}

// clearSet clears the instance's set in the backend, and the engine's
// block names a translator keeps; false (counted, the error kept) when the
// backend failed.
func (in *instance) clearSet() bool {
	if in.xl != nil {
		in.xl.reset()
	}
	if err := in.x.be.Apply(in.cfg.Name, []Op{{Kind: OpClear}}); err != nil {
		in.backendErrors.Add(1)
		in.setErr(err)
		return false
	}
	return true
}

// stateLocked is the instance's state; in.mu is held.
func (in *instance) stateLocked() State {
	switch {
	case in.down:
		return StateDown
	case in.stale:
		return StateStale
	}
	return StateFresh
}

// freshUnlessSnapshotPending marks the instance fresh after an apply that
// completed its set, unless a snapshot cut into several batches still
// has batches to come (it stays stale until their last, applyBatch).
func (in *instance) freshUnlessSnapshotPending() {
	in.mu.Lock()
	if in.snapEnd == 0 {
		in.stale, in.waiting = false, ""
	}
	in.mu.Unlock()
	in.noteState("")
}

// noteState logs the instance's state when it changed since last logged.
func (in *instance) noteState(why string) {
	in.mu.Lock()
	st, was := in.stateLocked(), in.logged
	if st == was {
		in.mu.Unlock()
		return
	}
	in.logged = st
	now := time.Now()
	after := now.Sub(in.since)
	in.since, in.staleLog = now, now
	seq, waiting := in.nextSeq, in.waiting
	in.mu.Unlock()
	l := logx.L()
	name := zap.String("instance", in.cfg.Name)
	switch st {
	case StateFresh:
		l.Info("kvindex: instance fresh: in sync, routed", name, zap.Int64("next_seq", seq),
			zap.String("was", string(was)), zap.Duration("after", after.Round(time.Millisecond)))
	case StateStale:
		lvl := l.Warn
		if was == StateDown || why == catchingUp || why == snapshotArriving {
			lvl = l.Info // connecting: a snapshot (a replay) is the normal way in
		}
		lvl("kvindex: instance stale: not routed until in sync", name, zap.String("why", why), zap.String("waiting_for", waiting))
	case StateDown:
		l.Warn("kvindex: instance down: not routed until it is back", name, zap.String("why", why),
			zap.String("waiting_for", waiting))
	}
}

// checkGeneration resyncs when the backend lost its data since the set
// was built.
func (in *instance) checkGeneration() {
	g := in.x.be.Generation()
	in.mu.Lock()
	lost := g != in.gen
	in.mu.Unlock()
	if lost {
		in.resync("backend restarted")
	}
}

func (in *instance) setErr(err error) {
	in.mu.Lock()
	in.lastErr = err.Error()
	in.mu.Unlock()
}

// resync marks the instance stale, clears its set and asks for a
// snapshot; the set is rebuilt from the snapshot's AllBlocksCleared on.
func (in *instance) resync(why string) {
	in.mu.Lock()
	in.stale = true
	in.nextSeq, in.snapEnd = -1, 0
	in.gen = in.x.be.Generation()
	in.waiting = in.snapshotWaiting()
	in.mu.Unlock()
	in.resets.Add(1)
	logx.L().Info("kvindex: instance resynchronising", zap.String("instance", in.cfg.Name), zap.String("why", why))
	if in.clearSet() && in.xl != nil {
		// An engine that sends no snapshots is routed from an empty set
		// on: it under-reports until its batches come, and an idle
		// engine's set is rightly empty.
		in.mu.Lock()
		in.stale, in.waiting = false, ""
		in.mu.Unlock()
	}
	in.noteState(why)
	in.requestSnapshot()
}

// snapshotWaiting says what a connected, stale instance waits for.
func (in *instance) snapshotWaiting() string {
	if in.xl != nil {
		return "the next batch on " + in.cfg.Endpoint + " (a " + in.cfg.Engine + " publisher sends no snapshot: the set is rebuilt from there)"
	}
	w := "a snapshot (a batch with AllBlocksCleared) on " + in.cfg.Endpoint
	if in.cfg.ReplayEndpoint == "" {
		return w + "; no replay endpoint to ask for one: the publisher's next start or resync sends it"
	}
	return w + ", asked for on " + in.cfg.ReplayEndpoint
}

// snapshotRetry is how long a stale instance waits for its snapshot before
// asking again (a publisher grants one request a second; a request can be
// lost with its connection).
const snapshotRetry = 1500 * time.Millisecond

// requestSnapshot asks the instance's publisher for a snapshot.
func (in *instance) requestSnapshot() {
	if in.cfg.ReplayEndpoint == "" || in.xl != nil {
		return // the publisher's next start (or resync) sends one
	}
	in.mu.Lock()
	in.lastReq = time.Now()
	in.mu.Unlock()
	if err := kvevents.RequestSnapshot(in.cfg.ReplayEndpoint, in.x.cfg.Timeout); err != nil {
		in.setErr(err)
		return
	}
	in.snapshots.Add(1)
}

// retrySnapshot asks again when the instance has been stale for a while,
// and says so now and then.
func (in *instance) retrySnapshot() {
	in.mu.Lock()
	// A snapshot whose batches are still arriving is not asked for again
	// (a new one would start over), unless they stopped coming.
	due := in.stale && time.Since(in.lastReq) > snapshotRetry && (in.snapEnd == 0 || time.Since(in.snapAt) > snapshotRetry)
	say := in.stale && !in.down && time.Since(in.staleLog) >= waitingLogEvery
	if say {
		in.staleLog = time.Now()
	}
	waiting, since, lastErr := in.waiting, in.since, in.lastErr
	in.mu.Unlock()
	if say {
		logx.L().Warn("kvindex: instance still stale", zap.String("instance", in.cfg.Name),
			zap.Duration("for", time.Since(since).Round(time.Second)), zap.String("waiting_for", waiting),
			zap.String("last_error", lastErr))
	}
	if due {
		in.requestSnapshot()
	}
}

// handle applies one received batch, filling a gap by replay first.
func (in *instance) handle(m kvevents.Message) {
	if m.Seq < 0 || m.Seq == math.MaxInt64 {
		in.badSeq(m.Seq)
		return
	}
	in.mu.Lock()
	next, stale, inSnap := in.nextSeq, in.stale, in.snapEnd > 0
	in.mu.Unlock()
	switch {
	case stale && !inSnap || next < 0:
		in.start(m)
	case m.Seq == next:
		in.apply(m, false)
	case m.Seq > next:
		in.gaps.Add(1)
		if !in.fill(next, m.Seq) {
			in.resync(fmt.Sprintf("gap %d..%d not replayable", next, m.Seq-1))
			in.start(m)
			return
		}
		in.apply(m, false)
	default:
		// Sequence numbers went back: the publisher restarted. Its first
		// batch is a snapshot; anything else needs one.
		in.resync(fmt.Sprintf("sequence went back from %d to %d", next, m.Seq))
		in.start(m)
	}
}

// badSeq drops a batch whose sequence number the index cannot follow: one
// past 2^63-1 on the wire (read as negative), or 2^63-1 itself, after
// which the next batch's number would wrap. Publishers count from 0 and
// never get there, so this is a faulty one: the set built from its
// batches is cleared and the instance stays stale, whatever its engine,
// until its sequence restarts (the next batch numbered below 2^63-1
// starts the set again, as after a publisher's restart).
func (in *instance) badSeq(seq int64) {
	in.badBatches.Add(1)
	why := fmt.Sprintf("batch sequence number %d is beyond 2^63-2, which the index cannot follow", uint64(seq))
	in.setErr(fmt.Errorf("instance %q: %s: a faulty publisher, stale until its sequence restarts", in.cfg.Name, why))
	in.mu.Lock()
	was := in.stale
	in.stale, in.nextSeq, in.snapEnd = true, -1, 0
	in.gen = in.x.be.Generation()
	in.waiting = "a batch numbered below 2^63-1 on " + in.cfg.Endpoint + " (its publisher restarting its sequence)"
	in.mu.Unlock()
	if !was {
		// A stale set was cleared when it went stale; one that failed to
		// clear is cleared before it is built again (a snapshot's
		// AllBlocksCleared, or start).
		in.resets.Add(1)
		logx.L().Info("kvindex: instance resynchronising", zap.String("instance", in.cfg.Name), zap.String("why", why))
		in.clearSet()
	}
	in.noteState(why)
}

// start (re)builds a stale instance's set from batch m: from its
// AllBlocksCleared for kvplug's publisher (only a snapshot says what the
// whole set is), from m itself for an engine that sends no snapshots,
// after the batches before it that its publisher can replay.
func (in *instance) start(m kvevents.Message) {
	if in.xl == nil {
		in.applyFromClear(m)
		in.retrySnapshot()
		return
	}
	in.mu.Lock()
	stale := in.stale
	in.mu.Unlock()
	if stale && !in.clearSet() {
		return // the last clear failed too: still stale; the next batch tries again
	}
	// The batches before m are the engine's past: they store blocks it
	// may have evicted since, and remove them only later in the stream.
	// Replayed over the set, they show such blocks until the replay
	// reaches m, so the instance is stale until then (fresh again with
	// m applied, or with the set rebuilt from m when they are gone).
	replay := m.Seq > 0 && in.cfg.ReplayEndpoint != ""
	in.mu.Lock()
	in.stale, in.nextSeq, in.snapEnd = replay, 0, 0
	in.waiting = ""
	if replay {
		in.waiting = fmt.Sprintf("the replay of batches 0..%d from %s", m.Seq-1, in.cfg.ReplayEndpoint)
	}
	in.mu.Unlock()
	in.noteState(catchingUp)
	if m.Seq > 0 && !in.fill(0, m.Seq) {
		// Batches before m are gone: start from m, with what it missed
		// cleared (a partial replay may have applied some).
		in.midStream.Add(1)
		if !in.clearSet() {
			in.resync("backend failed")
			return
		}
	}
	if in.apply(m, false) {
		in.freshUnlessSnapshotPending()
	}
	// (A failed apply resynchronised the instance.)
}

// catchingUp is why a foreign instance is stale while its publisher's
// earlier batches are replayed: the normal way in, logged as such.
const catchingUp = "replaying the batches its publisher holds before the first one seen"

// snapshotArriving is why an instance is stale while the batches of a
// snapshot cut into several arrive: the normal way in, and what any
// subscriber's request for a snapshot brings every other one.
const snapshotArriving = "a snapshot spans several batches: not routed until its last is applied"

// fill replays batches [from, to) and applies them; false when the
// publisher no longer holds them all.
func (in *instance) fill(from, to int64) bool {
	if in.cfg.ReplayEndpoint == "" {
		return false
	}
	msgs, err := kvevents.Replay(in.cfg.ReplayEndpoint, from, in.x.cfg.Timeout)
	if err != nil {
		in.setErr(err)
		return false
	}
	want := from
	for _, r := range msgs {
		if r.Seq >= to {
			break
		}
		if r.Seq != want {
			return false
		}
		if !in.apply(r, true) {
			return false
		}
		want++
	}
	return want == to
}

// applyFromClear applies a batch that contains AllBlocksCleared from that
// event on, and ends the instance's staleness; other batches are ignored.
func (in *instance) applyFromClear(m kvevents.Message) {
	b, err := kvevents.Decode(m.Payload)
	if err != nil {
		in.badBatches.Add(1)
		in.setErr(err)
		return
	}
	for i := len(b.Events) - 1; i >= 0; i-- {
		if b.Events[i].Kind == kvevents.KindCleared {
			b.Events = b.Events[i:]
			// Fresh once the set is in the backend: a reader that sees
			// the state scores what the snapshot holds. (A failed apply
			// resynchronises: still stale; one cut into more batches
			// stays stale until its last, applyBatch.)
			if in.applyBatch(m.Seq, b, false) {
				in.freshUnlessSnapshotPending()
			}
			return
		}
	}
}

// apply decodes and applies the next batch; false (and the instance
// resynchronising) when it cannot.
func (in *instance) apply(m kvevents.Message, replayed bool) bool {
	b, err := kvevents.Decode(m.Payload)
	if err != nil {
		in.badBatches.Add(1)
		in.setErr(err)
		in.resync("undecodable batch")
		return false
	}
	return in.applyBatch(m.Seq, b, replayed)
}

func (in *instance) applyBatch(seq int64, b *kvevents.Batch, replayed bool) bool {
	ops := make([]Op, 0, len(b.Events))
	n, keys := 0, 0
	rest := int64(-1) // the SnapshotRestField of the batch's last AllBlocksCleared; -1: none
	for _, ev := range b.Events {
		if ev.Group() != 0 {
			// Another layer group's blocks (a hybrid model's, vLLM's
			// group_idx) under group 0's hashes: the index keeps group
			// 0's, the prefix, which those events would corrupt.
			continue
		}
		var md prefix.Medium
		if ev.Kind != kvevents.KindCleared {
			var ok bool
			if md, ok = ev.MediumOf(); !ok {
				in.unknownMedium.Add(1)
				continue
			}
		}
		if ev.HashFormat == kvevents.HashDigest && in.xl == nil && ev.Kind != kvevents.KindCleared {
			// An engine's own hashes, which no query computes.
			in.foreignHashes.Add(1)
			in.setErr(fmt.Errorf("instance %q publishes its engine's own block hashes, not kvplug's: configure its engine (vllm, sglang)", in.cfg.Name))
			continue
		}
		hashes := ev.Hashes
		if in.xl != nil {
			var skipped int
			switch ev.Kind {
			case kvevents.KindStored:
				hashes, skipped = in.xl.stored(&ev, md)
				if skipped > 0 && loraWithoutID(&ev) {
					in.setErr(fmt.Errorf("instance %q stores blocks of LoRA adapter %q without its lora_id: not indexed (the index knows adapters by id)", in.cfg.Name, *ev.LoRAName))
				}
			case kvevents.KindRemoved:
				hashes, _ = in.xl.removed(&ev, md) // an unknown block is one the index never added
			case kvevents.KindCleared:
				in.xl.reset()
			}
			in.untranslated.Add(int64(skipped))
		}
		keys += len(hashes)
		switch ev.Kind {
		case kvevents.KindStored:
			ops = append(ops, Op{Kind: OpAdd, Medium: md, Keys: hashes})
			// (A hash-only event, vLLM's offloaded blocks, says nothing of
			// the engine's block size.)
			if len(ev.Tokens) > 0 && ev.BlockSize != in.cfg.BlockSize {
				in.setErr(fmt.Errorf("instance %q publishes blocks of %d tokens, configured %d", in.cfg.Name, ev.BlockSize, in.cfg.BlockSize))
			}
			if in.xl == nil {
				in.mu.Lock()
				in.format = ev.HashFormat
				in.mu.Unlock()
			}
		case kvevents.KindRemoved:
			ops = append(ops, Op{Kind: OpRemove, Medium: md, Keys: hashes})
		case kvevents.KindCleared:
			ops = append(ops, Op{Kind: OpClear})
			rest = ev.SnapshotRest
		}
		n++
	}
	// A set cut into more batches shows in part until its last one is
	// applied: the instance is stale from before its clear reaches the
	// backend, also when a snapshot another subscriber asked for arrives
	// in sequence while it is fresh.
	if rest > 0 {
		end := seq + min(rest, math.MaxInt64-1-seq) // (past the end: never reached, a faulty publisher's)
		in.mu.Lock()
		in.stale, in.snapEnd, in.snapAt = true, end, time.Now()
		in.waiting = fmt.Sprintf("the rest of a snapshot, batches %d..%d, on %s", seq+1, end, in.cfg.Endpoint)
		in.mu.Unlock()
		in.noteState(snapshotArriving)
	}
	if err := in.x.be.Apply(in.cfg.Name, ops); err != nil {
		in.backendErrors.Add(1)
		in.setErr(err)
		in.resync("backend failed")
		return false
	}
	in.mu.Lock()
	in.nextSeq = seq + 1
	// Whole with the snapshot's last batch, or with a later clear that
	// says it is whole with its own (rest 0).
	whole := in.snapEnd > 0 && (seq >= in.snapEnd || rest == 0)
	if whole {
		in.stale, in.snapEnd, in.waiting = false, 0, ""
	} else if in.snapEnd > 0 {
		in.snapAt = time.Now()
	}
	in.mu.Unlock()
	if whole {
		in.noteState("")
	}
	in.batches.Add(1)
	in.events.Add(int64(n))
	in.x.updates.Add(int64(keys))
	if replayed {
		in.replayed.Add(1)
	}
	return true
}

// Score is one instance's answer for a prompt; all 0 when stale.
type Score struct {
	Instance string `json:"instance"`
	// Tokens is the instance's longest cached prefix of the prompt over
	// every medium (GPUTokens + CPUTokens + SharedTokens), in tokens of
	// full blocks, and Blocks the same in blocks.
	Tokens int `json:"tokens"`
	Blocks int `json:"blocks"`
	// GPUTokens is the prefix on the GPU; CPUTokens the tokens of the
	// blocks after it that the CPU tier holds, SharedTokens those of the
	// blocks after these that the shared tier holds (see Held).
	GPUTokens    int `json:"gpu_tokens"`
	CPUTokens    int `json:"cpu_tokens"`
	SharedTokens int `json:"shared_tokens"`
	// Score ranks the instances (Best): GPU tokens, plus the lower tiers'
	// at their weights (see "Media" in the package comment).
	Score float64 `json:"score"`
	// Stale is true when the instance is not fresh: the index cannot vouch
	// for it now, and scores it as absent (State says why).
	Stale bool  `json:"stale"`
	State State `json:"state"`
}

// Query returns every instance's longest cached prefix of a prompt (keys
// may be nil) per medium, and its score, in the instances' configured
// order.
func (x *Index) Query(tokens []int32, keys *prefix.Keys) (_ []Score, err error) {
	defer x.queries.since(time.Now(), &err)
	h := x.hashers.Get().(*prefix.Hasher)
	defer x.hashers.Put(h)
	chains := make([][]kvevents.Key, len(x.insts))
	names := make([]string, len(x.insts))
	out := make([]Score, len(x.insts))
	byBS := map[int][]prefix.Hash{}
	for i, in := range x.insts {
		bs := in.cfg.BlockSize
		hs, ok := byBS[bs]
		if !ok {
			var err error
			if hs, err = h.Chain(nil, tokens, bs, keys); err != nil {
				return nil, err
			}
			byBS[bs] = hs
		}
		in.mu.Lock()
		f, st := in.format, in.stateLocked()
		in.mu.Unlock()
		names[i] = in.cfg.Name
		out[i] = Score{Instance: in.cfg.Name, Stale: st != StateFresh, State: st}
		if st != StateFresh {
			continue
		}
		ks := make([]kvevents.Key, len(hs))
		for j, hh := range hs {
			ks[j] = kvevents.KeyOf(hh, f)
		}
		chains[i] = ks
	}
	n, err := x.be.Match(names, chains)
	if err != nil {
		return nil, err
	}
	for i := range out {
		bs := x.insts[i].cfg.BlockSize
		s := &out[i]
		s.Blocks = n[i].Total()
		s.Tokens = s.Blocks * bs
		s.GPUTokens, s.CPUTokens, s.SharedTokens = n[i].GPU*bs, n[i].CPU*bs, n[i].Shared*bs
		s.Score = float64(s.GPUTokens) + x.w.CPU*float64(s.CPUTokens) + x.w.Shared*float64(s.SharedTokens)
	}
	return out, nil
}

// Best returns the instance with the highest score among those not stale
// (ties: the first in configured order), or "" when none.
func Best(scores []Score) string {
	best, bestScore := "", -1.0
	for _, s := range scores {
		if !s.Stale && s.Score > bestScore {
			best, bestScore = s.Instance, s.Score
		}
	}
	return best
}

// InstanceStatus is what the index knows of one instance's stream.
type InstanceStatus struct {
	Name  string `json:"name"`
	State State  `json:"state"`
	// Since is when the instance entered State; LastHeard when it last
	// sent a batch or answered a heartbeat (zero: never).
	Since     time.Time `json:"since"`
	LastHeard time.Time `json:"last_heard,omitzero"`
	// WaitingFor says, when the instance is not fresh, what the index waits
	// for (a publisher to bind the endpoint, a snapshot).
	WaitingFor     string `json:"waiting_for,omitempty"`
	Endpoint       string `json:"endpoint"`
	ReplayEndpoint string `json:"replay_endpoint,omitempty"`
	Stale          bool   `json:"stale"` // not fresh: scored as absent
	NextSeq        int64  `json:"next_seq"`
	Batches        int64  `json:"batches"`
	Events         int64  `json:"events"`
	Gaps           int64  `json:"gaps"`
	Replayed       int64  `json:"replayed_batches"`
	Snapshots      int64  `json:"snapshots_requested"`
	Resyncs        int64  `json:"resyncs"`
	BadBatches     int64  `json:"bad_batches"`
	BackendErrors  int64  `json:"backend_errors"`
	UnknownMedium  int64  `json:"unknown_medium_events"` // events of a medium the index does not know, ignored
	// Engine is the instance's engine (see "Engines"). For vLLM's and
	// SGLang's: JoinedMidStream counts the (re)starts whose earlier
	// batches could not be replayed, Untranslated the stored blocks the
	// index could not translate (not indexed), TranslatedBlocks the
	// engine blocks it knows now. ForeignHashEvents counts events of an
	// engine's own hashes from an instance configured as kvplug's
	// (ignored: configure its engine).
	Engine            string `json:"engine"`
	JoinedMidStream   int64  `json:"joined_mid_stream,omitempty"`
	Untranslated      int64  `json:"untranslated_blocks,omitempty"`
	TranslatedBlocks  int    `json:"translated_blocks,omitempty"`
	ForeignHashEvents int64  `json:"foreign_hash_events,omitempty"`
	// Disconnects counts the times the instance went down; Heartbeats the
	// PINGs sent to it while it was silent, HeartbeatAnswers its PONGs,
	// ReplayProbes the checks of its replay endpoint after an unanswered
	// heartbeat.
	Disconnects      int64  `json:"disconnects"`
	Heartbeats       int64  `json:"heartbeats"`
	HeartbeatAnswers int64  `json:"heartbeat_answers"`
	ReplayProbes     int64  `json:"replay_probes"`
	LastError        string `json:"last_error,omitempty"`
}

// Status returns every instance's status, sorted by name.
func (x *Index) Status() []InstanceStatus {
	out := make([]InstanceStatus, 0, len(x.insts))
	for _, in := range x.insts {
		in.mu.Lock()
		st := in.stateLocked()
		s := InstanceStatus{Name: in.cfg.Name, State: st, Since: in.since, LastHeard: in.lastHeard, Stale: st != StateFresh,
			Endpoint: in.cfg.Endpoint, ReplayEndpoint: in.cfg.ReplayEndpoint, NextSeq: in.nextSeq, LastError: in.lastErr}
		if st != StateFresh {
			s.WaitingFor = in.waiting
		}
		in.mu.Unlock()
		s.Disconnects, s.Heartbeats = in.disconnects.Load(), in.heartbeats.Load()
		s.HeartbeatAnswers, s.ReplayProbes = in.heartbeatAnswers.Load(), in.probes.Load()
		s.Batches, s.Events, s.Gaps = in.batches.Load(), in.events.Load(), in.gaps.Load()
		s.Replayed, s.Snapshots, s.Resyncs = in.replayed.Load(), in.snapshots.Load(), in.resets.Load()
		s.BadBatches, s.BackendErrors, s.UnknownMedium = in.badBatches.Load(), in.backendErrors.Load(), in.unknownMedium.Load()
		s.Engine, s.JoinedMidStream, s.Untranslated, s.ForeignHashEvents = EngineKvplug, in.midStream.Load(), in.untranslated.Load(), in.foreignHashes.Load()
		if in.xl != nil {
			s.Engine, s.TranslatedBlocks = in.cfg.Engine, in.xl.size()
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Updates returns how many block keys the index has added or removed,
// over all instances.
func (x *Index) Updates() int64 { return x.updates.Load() }

// Readiness is the answer of GET /readyz: ready when at least one
// instance is fresh (a router can be given a useful answer).
type Readiness struct {
	Ready     bool             `json:"ready"`
	Fresh     int              `json:"fresh"`
	Instances []InstanceStatus `json:"instances"`
}

// Readiness returns whether the index can route, with every instance's
// status.
func (x *Index) Readiness() Readiness {
	r := Readiness{Instances: x.Status()}
	for _, s := range r.Instances {
		if s.State == StateFresh {
			r.Fresh++
		}
	}
	r.Ready = r.Fresh > 0
	return r
}
