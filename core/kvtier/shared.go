package kvtier

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/logx"
	"github.com/zeebo/xxh3"
	"go.uber.org/zap"
)

// The shared tier in the manager (issue 23; core/kvtier/valkey): a Valkey
// or Redis server that instances share, below each one's host tier, so
// that an instance serves a prompt another instance computed.
//
// With Config.Shared set, the manager owns a valkey.Tier and uses it in
// two places.
//
// Fetch. Admit and MatchTiers look, for each prompt, past its GPU match
// and its host match: the blocks the shared tier holds under the prompt's
// next chained hashes, consecutively, are read straight into freshly
// reserved host slots and committed there (a shared-tier block always
// passes through the host tier), and the call then goes on as without a
// shared tier: Admit finds them in the host tier and reloads them like
// any host hit, MatchTiers counts them in TierMatch.Host. A block that
// cannot be read whole and checked (absent, evicted since, corrupt, short,
// another layout's) is a miss, and its slot is given back. This runs
// before the call takes the manager's lock for its own work, its round
// trips without holding it (the slots' reservations and commits take it
// briefly, so that the host tier's KV events follow them), in two round
// trips per call whatever the batch (EXISTS of every block wanted, then
// GET of those found); each is bounded by
// SharedConfig.OpTimeout, the transfer included, so the fetch adds at most
// two operation timeouts to the call. The GETs are pipelined a few
// megabytes ahead of the values read, and each value is read straight
// into its slot (valkey.Tier.ReadInto: no buffer, no copy), its header,
// length, checksum and MAC checked as it lands; a value that fails
// leaves its slot with bytes nothing reads, and the slot is given back.
// A GET that times out midway keeps the blocks read whole before it.
// A server that is down, slow or
// restarting costs one failed round trip (on each path) and is then skipped without
// touching the network for a backoff window (package valkey: lookups and
// stores each have their own); its blocks
// are misses and the prefix is computed. A call that then fails (an id
// live already, say) keeps the fetched blocks in the host tier.
//
// Store. A block whose demotion commits (CompleteCopies) is queued for
// the shared tier, its host slot pinned until the store has read it, and
// one goroutine per manager writes the queue out, up to
// sharedPutBatch blocks a round trip (each written from its slot, not
// copied: valkey.Tier.Put), leaving out those the server holds
// already (an EXISTS first: every instance demotes the same system
// prompt). The queue holds SharedConfig.PutQueue blocks: a demotion that
// finds it full is not stored (counted), so neither CompleteCopies nor a
// step ever waits on the server. Blocks fetched from the shared tier are
// not stored again. Close flushes the queue and stops the goroutine.
//
// # KV events
//
// With KV events on, a fetched block is a host block like a demoted one
// (tier.go, "KV events"): its commit announces it (BlockStored, medium
// CPU, with its hash, parent, tokens, adapter and multimodal entries from
// the prompt that wanted it), a reservation that evicts a resident host
// block announces that block's removal (BlockRemoved, CPU), and snapshots
// list it. A read that misses announces nothing. The shared tier's own
// contents have no events (no medium SHARED): the server evicts by its
// own maxmemory policy without telling the instances, so no instance
// could announce a shared block's removal, nor list the server's blocks
// in a snapshot.
//
// # Keys and model identity
//
// A block is stored under its whole 128-bit chained hash (valkey's keys),
// and its value carries the hash again with a fingerprint of the
// namespace and layout (block size, block bytes), all checked on every
// read: a block whose hash agrees with another's in 64 bits (the host
// tier's key, HostKey) never reads as the other's K/V. The chained hash
// covers the tokens, the adapter, multimodal items and the tenant salt,
// but not the model: equal prompts give equal hashes under every model.
// SharedConfig.Namespace is what keeps models apart, and the engine must set
// it to the identity of everything the K/V depends on: model and
// revision, dtype, K/V layout (layers, KV heads, head size, block layout),
// tensor-parallel rank when each rank keeps its own share of the heads,
// e.g. "llama-3.1-8b-instruct.bf16.l32.kv8.d128.tp0". Instances that may
// share blocks use the same namespace; any difference means another
// namespace. The fingerprint also stops two instances that agree on the
// namespace but not on the block size or bytes.
//
// # Memory
//
// The tier never deletes keys: the server's memory is bounded by its own
// maxmemory policy (allkeys-lru for a server dedicated to the tier;
// volatile-lru with SharedConfig.TTL on a shared one).
//
// # Security
//
// SharedConfig's Username and Password (AUTH), TLS and MACKeys (a keyed
// MAC over each value) are valkey.Config's: see package valkey,
// "Security". The manager adds nothing to them: a server that refuses
// the credentials or the handshake is a server that is down (misses,
// stores dropped, a backoff window), and a value whose MAC does not
// verify is a miss like a corrupt one.

// SharedConfig configures the shared tier below a manager's host tier.
type SharedConfig struct {
	// Addr is the server's host:port.
	Addr string
	// Namespace names the model and K/V layout the blocks belong to: 1 to
	// 64 characters of [A-Za-z0-9_.-] (see "Keys and model identity"
	// above). Required.
	Namespace string
	// OpTimeout bounds each round trip to the server, transfer included,
	// in [0, 1 minute]; 0: valkey.DefaultOpTimeout (250 ms). It must cover
	// the largest fetch (an admission batch's blocks) at the link's
	// bandwidth.
	OpTimeout time.Duration
	// TTL is the expiry of stored blocks (whole milliseconds); 0: none.
	TTL time.Duration
	// Backoff and MaxBackoff are the first and longest skip windows after
	// a failed call (valkey.Config); 0: valkey's defaults (1 s, 30 s).
	Backoff, MaxBackoff time.Duration
	// PutQueue is the most blocks waiting to be stored, in [0, 2^20]; 0:
	// DefaultPutQueue. Each pins its host slot until stored.
	PutQueue int

	// Security, all off when zero (valkey's "Security"): AUTH as Username
	// (an ACL user; "": the default user) with the password Password
	// holds, read from an environment variable or a file at New and on
	// every connect; TLS with the server's certificate verified; a MAC
	// over every value with the keys MACKeys holds (one or two, hex; the
	// first signs). A refused AUTH, a failed TLS handshake and a value
	// whose MAC does not verify are counted (SharedStats.AuthFailures,
	// TLSFailures, MACFailures) and logged, never errors of a call; no
	// message holds a secret.
	Username string
	Password valkey.Secret
	TLS      *valkey.TLS
	MACKeys  valkey.Secret
}

// DefaultPutQueue is the store queue's size of a SharedConfig that leaves
// PutQueue 0.
const DefaultPutQueue = 256

// maxPutQueue bounds SharedConfig.PutQueue.
const maxPutQueue = 1 << 20

// maxOpTimeout bounds SharedConfig.OpTimeout: a call waits at most two of
// them.
const maxOpTimeout = time.Minute

// sharedPutBatch is the most blocks one store round trip carries.
const sharedPutBatch = 16

// missMemory is how long a prompt's first block past its GPU and host
// matches, once the server said it lacks it, is taken as lacking without
// asking again. A prompt that waits for admission is matched and admitted
// again every step, and each would otherwise be a round trip on the
// serving path, longer while the server takes stores; with the memory it
// asks once a second. A block this instance stores is forgotten as soon as
// its store returns; one another instance stores in the meantime is found
// at the first ask after the second is over.
const missMemory = time.Second

// maxRemembered bounds the blocks remembered as lacking (rememberLacking).
const maxRemembered = 1 << 14

// SharedStats are the shared tier's counters (since creation) and gauges,
// in TierStats.Shared; all zero without a shared tier.
type SharedStats struct {
	Lookups      int64 // fetch calls that looked blocks up (an admission's or match's batch)
	Hits         int64 // blocks looked up and found, consecutively after a prompt's GPU and host matches
	Misses       int64 // blocks looked up and not found, or not looked up: the call failed or was skipped
	Remembered   int64 // prompts not looked up: the server lacked their first wanted block within missMemory
	Fetched      int64 // blocks read into host slots and committed there
	FetchMisses  int64 // blocks found whose read then missed (gone since, corrupt, short), or no host slot took
	HitTokens    int64 // tokens admissions matched in blocks fetched by the same call
	MatchTokens  int64 // tokens MatchTiers found in blocks fetched by the same call (in MatchHostTokens too)
	PutsQueued   int64 // committed demotions queued for a store
	PutsDone     int64 // of which stored
	PutsPresent  int64 // of which not sent: the server held them already
	PutsFailed   int64 // of which not stored: the call failed or was skipped, or the server refused
	PutsDropped  int64 // committed demotions not queued: the queue was full, or the manager closed
	Corrupt      int64 // values that failed a check (header, hash, fingerprint, length, checksum): misses
	Timeouts     int64 // round trips that ran past OpTimeout
	Errors       int64 // round trips that failed otherwise (refused connections), and commands the server refused
	Skipped      int64 // calls skipped without a round trip: the server failed on the call's path (lookups, stores) within its backoff window
	BytesRead    int64 // value bytes read, headers included
	BytesWritten int64 // value bytes written, headers included
	QueueLen     int   // blocks waiting to be stored now
	Available    bool  // neither path (lookups, stores) is in a backoff window
	AuthFailures int64 // of Errors: AUTH refused (or its password not readable), commands refused with NOAUTH or NOPERM
	TLSFailures  int64 // of Errors: TLS handshakes or verifications that failed
	MACFailures  int64 // of Corrupt: values whose MAC did not verify (no MAC, another key's, altered)
	// Cluster mode (valkey's Stats): MOVED and ASK replies followed, slot
	// maps read, whether the server is a cluster, and its primaries.
	Redirects, MapReads int64
	Cluster             bool
	Primaries           int
}

// putOp is one block to store: its hash and the host slot holding it,
// pinned until the store has read it.
type putOp struct {
	hash prefix.Hash
	slot host.Slot
}

// sharedTier is a manager's shared tier.
type sharedTier struct {
	t     *valkey.Tier
	pool  *host.Pool
	queue chan putOp
	done  chan struct{} // closed when the store goroutine has ended

	// closed is set by Close, under the manager's lock: no more fetches
	// or stores; queue is closed.
	closed bool

	// fetching: the blocks whose host slots a Fetch has reserved and not
	// yet committed or given back (by hash, the fetches holding each);
	// fetchDone, on the manager's lock, wakes the Fetches that wait for
	// them. Under the manager's lock.
	fetching  map[valkey.Hash]int
	fetchDone *sync.Cond

	// lacking: prompts' first wanted blocks that the server said it
	// lacks, with when (missMemory). Under lackMu: Fetch records them
	// without the manager's lock.
	lackMu  sync.Mutex
	lacking map[valkey.Hash]time.Time
	stores  uint64 // store batches done (forget): a lookup older than one remembers nothing

	lookups, hits, misses, fetched, fetchMisses atomic.Int64
	remembered                                  atomic.Int64
	hitTokens, matchTokens                      atomic.Int64
	putsQueued, putsDone, putsPresent           atomic.Int64
	putsFailed, putsDropped                     atomic.Int64
}

// fingerprint is the layout fingerprint of a manager's blocks in the
// shared tier: the namespace, the block size and the block bytes.
func fingerprint(ns string, blockSize, blockBytes int) uint64 {
	b := append([]byte("kvplug shared tier\x00"), ns...)
	b = append(b, 0, prefix.HashVersion)
	b = binary.LittleEndian.AppendUint64(b, uint64(blockSize))
	b = binary.LittleEndian.AppendUint64(b, uint64(blockBytes))
	return xxh3.Hash(b)
}

// Check returns the error New would return for a manager with this
// shared tier (its own fields' errors), without making anything: a
// caller that allocates a host pool first may check before.
func (c *SharedConfig) Check() error {
	if c.OpTimeout < 0 || c.OpTimeout > maxOpTimeout {
		return kverr.Errorf(kverr.InvalidArgument, "shared tier: operation timeout must be in [0, %v]: got %v", maxOpTimeout, c.OpTimeout)
	}
	if c.PutQueue < 0 || c.PutQueue > maxPutQueue {
		return kverr.Errorf(kverr.InvalidArgument, "shared tier: put queue must be in [0, %d]: got %d", maxPutQueue, c.PutQueue)
	}
	// The secrets and TLS files are read (and dropped) too, so that a
	// missing password or CA file is refused before anything is made.
	return c.valkeyConfig(0, 0).CheckFiles()
}

func (c *SharedConfig) valkeyConfig(blockSize, blockBytes int) valkey.Config {
	return valkey.Config{
		Addr:        c.Addr,
		Namespace:   c.Namespace,
		Fingerprint: fingerprint(c.Namespace, blockSize, blockBytes),
		BlockBytes:  blockBytes,
		OpTimeout:   c.OpTimeout,
		TTL:         c.TTL,
		Backoff:     c.Backoff,
		MaxBackoff:  c.MaxBackoff,
		Username:    c.Username,
		Password:    c.Password,
		TLS:         c.TLS,
		MACKeys:     c.MACKeys,
	}
}

func newShared(c *SharedConfig, pool *host.Pool, blockSize int) (*sharedTier, error) {
	if err := c.Check(); err != nil {
		return nil, err
	}
	t, err := valkey.New(c.valkeyConfig(blockSize, pool.BlockBytes()))
	if err != nil {
		return nil, err
	}
	q := c.PutQueue
	if q == 0 {
		q = DefaultPutQueue
	}
	return &sharedTier{t: t, pool: pool, queue: make(chan putOp, q), done: make(chan struct{}),
		lacking: make(map[valkey.Hash]time.Time)}, nil
}

// run is the store goroutine: it writes the queue out until Close closes
// it, the blocks queued by then included.
func (s *sharedTier) run() {
	defer close(s.done)
	batch := make([]putOp, 0, sharedPutBatch)
	for op := range s.queue {
		batch = append(batch[:0], op)
	more:
		for len(batch) < sharedPutBatch {
			select {
			case op, ok := <-s.queue:
				if !ok {
					break more
				}
				batch = append(batch, op)
			default:
				break more
			}
		}
		s.store(batch)
	}
}

// store writes one batch of queued blocks that the server does not hold
// yet, then unpins their slots.
func (s *sharedTier) store(batch []putOp) {
	hashes := make([]valkey.Hash, len(batch))
	for i, op := range batch {
		hashes[i] = valkey.Hash(op.hash)
	}
	held := s.t.StoreExists(hashes) // on the stores' connection: admissions' lookups never queue behind it
	var send []valkey.Hash
	var payloads [][]byte
	for i, op := range batch {
		if held[i] {
			continue
		}
		send = append(send, hashes[i])
		payloads = append(payloads, s.pool.Bytes(op.slot))
	}
	present := int64(len(batch) - len(send))
	stored := int64(0)
	// After a failed or skipped EXISTS the stores' breaker is open: Put
	// skips the server (counted in Skipped) without a round trip. The
	// lookups' breaker has no say here.
	if len(send) > 0 {
		stored = int64(s.t.Put(send, payloads))
	}
	s.forget(hashes) // held there now (or the store failed: a lookup may ask)
	s.putsPresent.Add(present)
	s.putsDone.Add(stored)
	s.putsFailed.Add(int64(len(send)) - stored)
	for _, op := range batch {
		if err := s.pool.Unpin(op.slot); err != nil {
			logx.L().Error("shared tier: unpinning a stored block's host slot", zap.Error(err))
		}
	}
}

// stats returns the shared tier's counters.
func (s *sharedTier) stats() SharedStats {
	v := s.t.Stats()
	return SharedStats{
		Lookups: s.lookups.Load(), Hits: s.hits.Load(), Misses: s.misses.Load(), Remembered: s.remembered.Load(),
		Fetched: s.fetched.Load(), FetchMisses: s.fetchMisses.Load(),
		HitTokens: s.hitTokens.Load(), MatchTokens: s.matchTokens.Load(),
		PutsQueued: s.putsQueued.Load(), PutsDone: s.putsDone.Load(), PutsPresent: s.putsPresent.Load(),
		PutsFailed: s.putsFailed.Load(), PutsDropped: s.putsDropped.Load(),
		Corrupt: v.Corrupt, Timeouts: v.Timeouts, Errors: v.Errors, Skipped: v.Skipped,
		BytesRead: v.BytesRead, BytesWritten: v.BytesWritten,
		QueueLen: len(s.queue), Available: v.Available,
		AuthFailures: v.AuthFailures, TLSFailures: v.TLSFailures, MACFailures: v.MACFailures,
		Redirects: v.Redirects, MapReads: v.MapReads, Cluster: v.Cluster, Primaries: v.Primaries,
	}
}

// queueStore commits a completed demotion's host slot and queues the
// block for the shared tier (the slot stays pinned until stored); when
// the queue is full the slot is just committed. Under the manager's lock.
func (s *sharedTier) queueStore(op DemoteOp) {
	if s.closed {
		assertOK(s.pool.Commit(op.Slot), "complete copies: committing a reserved host slot")
		s.putsDropped.Add(1)
		return
	}
	assertOK(s.pool.CommitPinned(op.Slot), "complete copies: committing a reserved host slot")
	select {
	case s.queue <- putOp{hash: op.Hash, slot: op.Slot}:
		s.putsQueued.Add(1)
	default:
		assertOK(s.pool.Unpin(op.Slot), "complete copies: unpinning a host slot committed pinned")
		s.putsDropped.Add(1)
	}
}

// sharedWant is what a fetch looks up: the hashes of the blocks wanted,
// each once, with where each was first wanted (for the KV events), and
// per prompt the indexes in want of its blocks past its GPU and host
// matches, in block order (prompt i's are idx[off[i]:off[i+1]]).
type sharedWant struct {
	want []valkey.Hash
	src  []wantSrc
	idx  []int32
	off  []int
}

// wantSrc is a wanted block's place: block Block of prompt Prompt, under
// its chain's previous block Parent (zero for a first block).
type wantSrc struct {
	Prompt, Block int32
	Parent        prefix.Hash
}

// Fetched is what one Fetch fetched: the host keys of the blocks it read
// from the shared tier into the host tier.
type Fetched map[uint64]struct{}

// Prompts is a batch of prompts: Len of them, prompt i's tokens and
// extra keys (nil: none) Prompt(i).
type Prompts interface {
	Len() int
	Prompt(i int) ([]int32, *prefix.Keys)
}

// Fetch is the shared tier's part of Admit and MatchTiers, called without
// the manager's lock: it finds the blocks to look up under the lock
// (failing with check's error, which the manager's call would fail with:
// an id live or repeated, say; check nil: none), asks the
// server which it holds, reserves host slots for them under the lock,
// reads them into the slots without it, and commits them under it again.
// It returns the host keys of the blocks fetched; nil when there is no
// shared tier or nothing was fetched.
//
// The host slots change only under the manager's lock, so that the KV
// events follow them as they follow demotions: a slot that a reservation
// takes from a resident block announces that block's removal (CPU
// BlockRemoved), and a committed block is announced (CPU BlockStored),
// described from the prompt that wanted it (tokens, parent, adapter,
// multimodal entries) as its GPU BlockStored would be. While its read is
// in flight the slot is reserved: pinned, neither resident nor announced.
func (t *Tier) Fetch(prompts Prompts, check func() error) (Fetched, error) {
	if t.shared == nil {
		return nil, nil
	}
	s := t.shared
	w, err := t.sharedWanted(prompts, check)
	if err != nil || len(w.want) == 0 {
		return nil, err
	}
	s.lookups.Add(1)
	asked := s.storesDone()
	held, absent := s.t.Lookup(w.want)
	// Each prompt's run of held blocks from its first wanted one; a block
	// after a hole is of no use to it (its prefix is computed).
	need := make([]bool, len(w.want))
	var lacked []valkey.Hash
	for p := range len(w.off) - 1 {
		for k, j := range w.idx[w.off[p]:w.off[p+1]] {
			if !held[j] {
				if k == 0 && absent[j] {
					lacked = append(lacked, w.want[j])
				}
				break
			}
			need[j] = true
		}
	}
	s.rememberLacking(lacked, time.Now(), asked)
	keys, slots, joined := t.reserveFetch(prompts, &w, need)
	if len(keys) == 0 {
		return joined, nil
	}
	dst := make([][]byte, len(slots))
	for i, slot := range slots {
		dst[i] = s.pool.Bytes(slot)
	}
	// Straight into the slots: a block that misses leaves its slot with
	// unspecified bytes, and commitFetch gives it back.
	found := s.t.ReadInto(keys, dst)
	fetched := t.commitFetch(keys, slots, found)
	for k := range joined {
		if fetched == nil {
			fetched = make(Fetched, len(joined))
		}
		fetched[k] = struct{}{}
	}
	return fetched, nil
}

// reserveFetch reserves, under the lock, a host slot for each block
// needed (need[j]: w.want[j]) and returns the blocks' hashes and slots;
// with KV events on it describes each slot's block (not yet announced)
// and announces the resident blocks the reservations evicted. A block
// that another Fetch is reading already is not read twice: this call
// waits (releasing the lock) until that fetch commits or gives it back,
// and returns the ones committed as joined, for the admission to count as
// fetched (a second admission of a prompt starts on the blocks the first
// one's fetch brings, not on a recomputation).
func (t *Tier) reserveFetch(prompts Prompts, w *sharedWant, need []bool) ([]valkey.Hash, []host.Slot, Fetched) {
	t.lock.Lock()
	defer t.lock.Unlock()
	s := t.shared
	if s.closed {
		return nil, nil, nil // Close came while the lookup was in flight: fetch nothing
	}
	var keys, waiting []valkey.Hash
	var slots []host.Slot
	t.gone = t.gone[:0]
	hits, full := int64(0), false
	for j, ok := range need {
		if !ok {
			continue
		}
		hits++
		if full {
			s.fetchMisses.Add(1)
			continue
		}
		h := prefix.Hash(w.want[j])
		if s.fetching[w.want[j]] > 0 {
			waiting = append(waiting, w.want[j]) // another Fetch reads it
			continue
		}
		slot, gone, rerr := s.pool.ReserveEvict(HostKey(h))
		if kverr.Is(rerr, kverr.OutOfBlocks) {
			full = true // every host slot pinned
			s.fetchMisses.Add(1)
			continue
		}
		if rerr != nil {
			continue // the host tier got the block meanwhile
		}
		keys = append(keys, w.want[j])
		slots = append(slots, slot)
		if s.fetching == nil {
			s.fetching = make(map[valkey.Hash]int)
		}
		s.fetching[w.want[j]]++
		if t.events {
			t.hostEvicted(slot, gone, "shared tier fetch")
			src := w.src[j]
			tokens, pk := prompts.Prompt(int(src.Prompt))
			b := int(src.Block)
			ev := prefix.EvictedBlock{Hash: h, Parent: src.Parent, MM: pk.AppendBlockMM(nil, b, t.bs)}
			if pk != nil {
				ev.Adapter = pk.Adapter
			}
			t.setMeta(slot, &ev, tokens[b*t.bs:(b+1)*t.bs], 0)
		}
	}
	s.hits.Add(hits)
	s.misses.Add(int64(len(w.want)) - hits)
	if len(t.gone) > 0 {
		assertOK(t.cache.RecordTierRemoved(prefix.MediumCPU, t.gone), "shared tier fetch: recording host evictions")
	}
	if len(waiting) == 0 {
		return keys, slots, nil
	}
	// This call's own reservations stay pinned while it waits: the other
	// fetch never waits for them in turn (its blocks were reserved first,
	// and a fetch waits only on blocks it did not reserve).
	for !s.closed && t.anyFetching(waiting) {
		s.cond(t.lock).Wait()
	}
	var joined Fetched
	for _, k := range waiting {
		if hk := HostKey(prefix.Hash(k)); s.pool.Peek([]uint64{hk}) == 1 {
			if joined == nil {
				joined = make(Fetched, len(waiting))
			}
			joined[hk] = struct{}{}
		}
	}
	return keys, slots, joined
}

// anyFetching reports whether a Fetch still reads one of keys. Under the lock.
func (t *Tier) anyFetching(keys []valkey.Hash) bool {
	for _, k := range keys {
		if t.shared.fetching[k] > 0 {
			return true
		}
	}
	return false
}

// cond is the condition the Fetches that wait for another's blocks wait
// on, on the manager's lock (made on first use). Under the lock.
func (s *sharedTier) cond(l sync.Locker) *sync.Cond {
	if s.fetchDone == nil {
		s.fetchDone = sync.NewCond(l)
	}
	return s.fetchDone
}

// commitFetch commits, under the lock, the slots whose reads found their
// block (found[i]) and gives the others back; with KV events on it
// announces the committed blocks, in want order (a prompt's parents
// first). It returns the committed blocks' host keys.
func (t *Tier) commitFetch(keys []valkey.Hash, slots []host.Slot, found []bool) Fetched {
	t.lock.Lock()
	defer t.lock.Unlock()
	s := t.shared
	for _, k := range keys {
		if s.fetching[k]--; s.fetching[k] <= 0 {
			delete(s.fetching, k)
		}
	}
	s.cond(t.lock).Broadcast() // the Fetches waiting for these blocks
	fetched := make(Fetched, len(keys))
	for i, slot := range slots {
		if !found[i] {
			assertOK(s.pool.Abort(slot), "shared tier: giving back a missed block's host slot")
			if t.events {
				t.meta[slot] = hostMeta{}
			}
			continue
		}
		assertOK(s.pool.Commit(slot), "shared tier: committing a fetched block's host slot")
		fetched[HostKey(prefix.Hash(keys[i]))] = struct{}{}
		if t.events {
			t.meta[slot].resident = true
			t.nResident++
			blk := t.block(slot)
			assertOK(t.cache.RecordTierStored(&blk), "shared tier: recording a fetched block")
		}
	}
	s.fetched.Add(int64(len(fetched)))
	s.fetchMisses.Add(int64(len(keys) - len(fetched)))
	if len(fetched) == 0 {
		return nil
	}
	return fetched
}

// sharedWanted finds, under the lock, the blocks of each prompt that
// neither the GPU prefix cache nor the host tier holds, up to the block
// holding its last token, at most the host tier's slots in all. It
// changes nothing: it looks (prefix.Index.Lookup, host.Pool.Peek)
// without touching or counting.
func (t *Tier) sharedWanted(prompts Prompts, check func() error) (sharedWant, error) {
	t.lock.Lock()
	defer t.lock.Unlock()
	var w sharedWant
	if t.shared.closed {
		return w, nil
	}
	if check != nil {
		if err := check(); err != nil {
			return w, err
		}
	}
	room := t.cfg.Pool.Stats().Slots
	seen := make(map[prefix.Hash]int32)
	now := time.Now()
	n := prompts.Len()
	w.off = make([]int, 1, n+1)
	for i := range n {
		tokens, keys := prompts.Prompt(i)
		limit := 0
		if len(tokens) > 0 {
			limit = (len(tokens) - 1) / t.bs
		}
		if limit > 0 && len(w.want) < room {
			t.chain(tokens, keys, limit, "shared tier: hashing a validated prompt")
			g := 0
			for g < limit {
				if _, ok := t.cache.Lookup(t.hashes[g]); !ok {
					break
				}
				g++
			}
			t.hostKeysFrom(g)
			first := g + t.cfg.Pool.Peek(t.keys)
			if first < len(t.hashes) && t.shared.lacks(valkey.Hash(t.hashes[first]), now) {
				first = len(t.hashes) // asked within missMemory: not again
				t.shared.remembered.Add(1)
			}
			for b := first; b < len(t.hashes); b++ {
				h := t.hashes[b]
				j, ok := seen[h]
				if !ok {
					if len(w.want) == room {
						break
					}
					j = int32(len(w.want))
					seen[h] = j
					w.want = append(w.want, valkey.Hash(h))
					src := wantSrc{Prompt: int32(i), Block: int32(b)}
					if b > 0 {
						src.Parent = t.hashes[b-1]
					}
					w.src = append(w.src, src)
				}
				w.idx = append(w.idx, j)
			}
		}
		w.off = append(w.off, len(w.idx))
	}
	return w, nil
}

// countShared counts, after a prompt's host match (t.keys[:hit]), the
// blocks among them that this call fetched from the shared tier.
func (t *Tier) countShared(fetched Fetched, hit int) int {
	if len(fetched) == 0 {
		return 0
	}
	n := 0
	for _, k := range t.keys[:hit] {
		if _, ok := fetched[k]; ok {
			n++
		}
	}
	return n
}

// Close ends the tier's background work, called without the manager's
// lock: the shared tier's queued stores are written (each round trip
// bounded by SharedConfig.OpTimeout; a server that is down skips them at
// once) and its connection is closed. The tier stays usable without the
// shared tier (nothing is fetched or stored after Close), unless it made
// its pool (Config.Slots): then the pool is closed and its memory
// released, and the tier must not be used again. Closing twice does
// nothing more.
func (t *Tier) Close() error {
	var err error
	if s := t.closeShared(); s != nil {
		<-s.done
		err = s.t.Close()
	}
	t.release()
	return err
}

// closeShared marks the shared tier closed and closes its queue; nil when
// there is none or it was closed already.
func (t *Tier) closeShared() *sharedTier {
	t.lock.Lock()
	defer t.lock.Unlock()
	if t.shared == nil || t.shared.closed {
		return nil
	}
	s := t.shared
	s.closed = true
	close(s.queue)
	s.cond(t.lock).Broadcast() // Fetches waiting for another's blocks fetch nothing more
	return s
}

// SharedClosed reports whether Close has closed the shared tier (or
// there is none). Under the manager's lock.
func (t *Tier) SharedClosed() bool { return t.shared == nil || t.shared.closed }

// lacks reports whether the server said it lacks h within missMemory of
// now.
func (s *sharedTier) lacks(h valkey.Hash, now time.Time) bool {
	s.lackMu.Lock()
	defer s.lackMu.Unlock()
	at, ok := s.lacking[h]
	if ok && now.Sub(at) >= missMemory {
		delete(s.lacking, h)
		return false
	}
	return ok
}

// forget drops hs from the blocks remembered as lacking: this instance
// has just stored them.
func (s *sharedTier) forget(hs []valkey.Hash) {
	s.lackMu.Lock()
	defer s.lackMu.Unlock()
	s.stores++
	if len(s.lacking) == 0 {
		return
	}
	for _, h := range hs {
		delete(s.lacking, h)
	}
}

// storesDone is the count of store batches done so far (forget).
func (s *sharedTier) storesDone() uint64 {
	s.lackMu.Lock()
	defer s.lackMu.Unlock()
	return s.stores
}

// rememberLacking notes that the server lacked hs at now, as a lookup
// asked when storesDone was asked; a store batch done since may hold some
// of them (its forget ran before this), so then nothing is remembered.
// Past maxRemembered entries, those older than half of missMemory are
// forgotten first, and all of them when that is not enough.
func (s *sharedTier) rememberLacking(hs []valkey.Hash, now time.Time, asked uint64) {
	if len(hs) == 0 {
		return
	}
	s.lackMu.Lock()
	defer s.lackMu.Unlock()
	if s.stores != asked {
		return
	}
	if len(s.lacking)+len(hs) > maxRemembered {
		cut := now.Add(-missMemory / 2)
		for h, at := range s.lacking {
			if at.Before(cut) {
				delete(s.lacking, h)
			}
		}
		if len(s.lacking)+len(hs) > maxRemembered {
			clear(s.lacking)
		}
	}
	for _, h := range hs {
		s.lacking[h] = now
	}
}
