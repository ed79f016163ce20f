package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/logx"
	"go.uber.org/zap"
)

// Source is where a Publisher takes its events: a kvmanager.Manager (or a
// prefix.Index behind a lock). Drain returns every pending event, in
// order; Snapshot makes the next Drain start with AllCleared and the whole
// cache. Both are called from the publisher's goroutine only.
type Source interface {
	Drain() ([]prefix.Event, error)
	Snapshot() error
}

// GroupedSource is a Source whose events belong to layer groups
// (prefix.Event.Group): GroupSpecs describes them, or is nil when the
// source has one. A Publisher started on one whose Config leaves
// Encoding.Groups nil takes them from it.
type GroupedSource interface {
	Source
	GroupSpecs() []GroupSpec
}

// Bind modes of Config.Bind: whether the PUB socket binds its endpoint
// (subscribers, such as cmd/kvindex, connect to it) or connects to it (the
// subscriber binds, as llm-d's indexer can). The zero value binds: a
// publisher is the stable end of its stream, and an endpoint that names
// the publisher's own host and port, tcp://127.0.0.1:5557, means "serve
// here". The replay (ROUTER) socket always binds.
//
// The C ABI's bind_mode numbers these differently (its 0 is vLLM's rule,
// which released hosts rely on); capi maps them.
const (
	BindDefault = 0 // bind (the same as BindListen)
	BindListen  = 1 // always bind
	BindConnect = 2 // always connect (the subscriber binds); redials
	// BindVLLM is vLLM's rule for its PUB endpoint: bind when the endpoint
	// has a wildcard host ("*", "::") or is ipc://, connect otherwise. vLLM's
	// default endpoint, tcp://*:5557, binds; tcp://10.0.0.1:5557 connects.
	BindVLLM = 3
)

// Binds reports whether a PUB socket configured with endpoint ep and bind
// mode mode binds (true) or connects (false).
func Binds(ep string, mode int) bool {
	switch mode {
	case BindConnect:
		return false
	case BindVLLM:
		return vllmBinds(ep)
	}
	return true
}

// Config configures a Publisher. Zero values take the defaults.
type Config struct {
	Endpoint       string // PUB endpoint, e.g. tcp://*:5557 (required)
	ReplayEndpoint string // ROUTER endpoint for replay; "" = none (always bound)
	Topic          string // first frame of every message; vLLM's default ""
	Bind           int    // BindDefault (bind), BindListen, BindConnect or BindVLLM
	BufferSteps    int    // batches kept for replay; default 10000
	BufferBytes    int64  // bytes of batches kept for replay; default 256 MiB
	HWM            int    // batches queued per subscriber before drops; default 10000
	MaxBatchEvents int    // events per batch (merged BlockStored count once); default 1024
	FlushInterval  time.Duration
	MaxSubscribers int // connections accepted at once per socket; default 256
	Encoding       Encoding
}

// Limits of Config.
const (
	MaxTopicLen      = 1024
	MaxBufferSteps   = 1 << 24
	MaxHWM           = 1 << 24
	MaxFlushInterval = time.Minute
	MaxMediumLen     = 64
	// MaxEndpointLen bounds an endpoint string; the C ABI reads its C
	// strings no further.
	MaxEndpointLen = 4096
)

func (c *Config) setDefaults() {
	if c.BufferSteps == 0 {
		c.BufferSteps = 10000
	}
	if c.BufferBytes == 0 {
		c.BufferBytes = 256 << 20
	}
	if c.HWM == 0 {
		c.HWM = 10000
	}
	if c.MaxBatchEvents == 0 {
		c.MaxBatchEvents = 1024
	}
	if c.FlushInterval == 0 {
		c.FlushInterval = time.Millisecond
	}
	if c.MaxSubscribers == 0 {
		c.MaxSubscribers = 256
	}
	if c.Encoding.Medium == "" {
		c.Encoding.Medium = prefix.MediumGPU.String()
	}
}

// Validate checks the configuration (after defaults).
func (c *Config) validate() error {
	bad := func(f string, a ...any) error {
		return kverr.Errorf(kverr.InvalidArgument, "event publisher: "+f, a...)
	}
	if c.Endpoint == "" {
		return kverr.Errorf(kverr.NullPointer, "event publisher: endpoint must be given (e.g. tcp://*:5557)")
	}
	if _, err := parseEndpoint(c.Endpoint); err != nil {
		return bad("%v", err)
	}
	if c.ReplayEndpoint != "" {
		if _, err := parseEndpoint(c.ReplayEndpoint); err != nil {
			return bad("replay %v", err)
		}
	}
	switch {
	case len(c.Topic) > MaxTopicLen:
		return bad("topic is %d bytes, at most %d", len(c.Topic), MaxTopicLen)
	case c.Bind < BindDefault || c.Bind > BindVLLM:
		return bad("bind mode must be 0 (bind, the default), 1 (bind), 2 (connect) or 3 (vLLM's rule): got %d", c.Bind)
	case c.BufferSteps < 0 || c.BufferSteps > MaxBufferSteps:
		return bad("buffer_steps must be in [0, 2^24] (0: 10000): got %d", c.BufferSteps)
	case c.BufferBytes < 0:
		return bad("buffer_bytes must be >= 0 (0: 256 MiB): got %d", c.BufferBytes)
	case c.HWM < 0 || c.HWM > MaxHWM:
		return bad("hwm must be in [0, 2^24] (0: 10000): got %d", c.HWM)
	case c.MaxBatchEvents < 0 || c.MaxBatchEvents > 1<<20:
		return bad("max_batch_events must be in [0, 2^20] (0: 1024): got %d", c.MaxBatchEvents)
	case c.FlushInterval < 0 || c.FlushInterval > MaxFlushInterval:
		return bad("flush interval must be in [0, 60 s]: got %v", c.FlushInterval)
	case c.MaxSubscribers < 0 || c.MaxSubscribers > 1<<16:
		return bad("max subscribers must be in [0, 65536]: got %d", c.MaxSubscribers)
	case c.Encoding.Format != FormatMap && c.Encoding.Format != FormatArray:
		return bad("event format must be 0 (maps) or 1 (arrays): got %d", c.Encoding.Format)
	case c.Encoding.Hashes != HashBytes && c.Encoding.Hashes != HashInt64:
		return bad("hash format must be 0 (bytes) or 1 (int64): got %d", c.Encoding.Hashes)
	case len(c.Encoding.Medium) > MaxMediumLen:
		return bad("medium is %d bytes, at most %d", len(c.Encoding.Medium), MaxMediumLen)
	}
	return nil
}

// Stats are a Publisher's counters since it started.
type Stats struct {
	Batches       int64 // batches published (sequence numbers used)
	Events        int64 // prefix-cache events published
	Bytes         int64 // payload bytes published
	DroppedSends  int64 // batches not queued to a subscriber whose queue was full
	Subscribers   int64 // PUB connections now
	ReplayReqs    int64 // replay requests served
	ReplayBatches int64 // batches sent by replays
	Snapshots     int64 // snapshots requested (start, replay extension, Resync)
	SourceErrors  int64 // failed drains
	BufferedSteps int64 // batches in the replay buffer now
	BufferedBytes int64
	NextSeq       int64 // the next batch's sequence number
}

// entry is a published batch: its sequence number and its whole wire
// message (three frames), shared read-only by every queue that holds it.
type entry struct {
	seq     int64
	payload []byte // the msgpack batch, a sub-slice of wire
	wire    []byte
}

// Publisher sends a Source's events on a PUB socket from its own
// goroutine and serves replays on a ROUTER socket. The engine's calls
// never wait on the network: the goroutine takes the events under the
// source's lock (a copy), then encodes and queues them without it; each
// subscriber has its own bounded queue, written by its own goroutine, and
// a full queue drops (and counts) the batch for that subscriber only, who
// sees the gap in the sequence numbers and replays it.
type Publisher struct {
	cfg  Config
	src  Source
	enc  *Encoder
	stop chan struct{}
	done chan struct{}
	wake chan struct{} // snapshot requests from replay connections

	pub    *server
	replay *server

	mu        sync.Mutex // guards ring, ringBytes, ringHead
	ring      []*entry   // oldest first, from ringHead
	ringHead  int
	ringBytes int64

	nextSeq   atomic.Int64
	snapWant  atomic.Bool
	lastSnap  atomic.Int64 // unix nanoseconds of the last snapshot a peer asked for
	batches   atomic.Int64
	events    atomic.Int64
	bytes     atomic.Int64
	dropped   atomic.Int64
	replays   atomic.Int64
	replayed  atomic.Int64
	snapshots atomic.Int64
	srcErrors atomic.Int64
	closeOnce sync.Once
}

// Start binds (or connects) the sockets, asks the source for a snapshot
// (so subscribers learn what was cached before the publisher started) and
// starts publishing. A failure leaves nothing running.
func Start(src Source, cfg Config) (*Publisher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if gs, ok := src.(GroupedSource); ok && cfg.Encoding.Groups == nil {
		cfg.Encoding.Groups = gs.GroupSpecs()
	}
	p := &Publisher{
		cfg:  cfg,
		src:  src,
		enc:  NewEncoder(cfg.Encoding),
		stop: make(chan struct{}),
		done: make(chan struct{}),
		wake: make(chan struct{}, 1),
	}
	bind := Binds(cfg.Endpoint, cfg.Bind)
	var err error
	if p.pub, err = newServer(p, cfg.Endpoint, "PUB", bind); err != nil {
		return nil, err
	}
	if bind {
		logx.L().Info("event publisher: PUB bound; subscribers connect to it", zap.String("endpoint", cfg.Endpoint),
			zap.Stringer("address", p.pub.addr()))
	} else {
		logx.L().Info("event publisher: PUB connects to its subscriber, which must bind the endpoint", zap.String("endpoint", cfg.Endpoint))
	}
	if cfg.ReplayEndpoint != "" {
		if p.replay, err = newServer(p, cfg.ReplayEndpoint, "ROUTER", true); err != nil {
			p.pub.close()
			return nil, err
		}
	}
	if err := src.Snapshot(); err != nil {
		p.pub.close()
		if p.replay != nil {
			p.replay.close()
		}
		return nil, err
	}
	p.snapshots.Add(1)
	go p.run()
	return p, nil
}

// PubAddr returns the PUB socket's bound address (nil when it connects).
func (p *Publisher) PubAddr() net.Addr { return p.pub.addr() }

// Binds reports whether the PUB socket binds (false: it connects).
func (p *Publisher) Binds() bool { return p.pub.ln != nil }

// ReplayAddr returns the ROUTER socket's bound address (nil when none).
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.addr()
}

// Resync asks the source for a snapshot: the next batches carry
// AllBlocksCleared and every cached block.
func (p *Publisher) Resync() {
	p.snapWant.Store(true)
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Flush wakes the publisher to publish what is pending now rather than at
// its next interval: an engine may call it at the end of a step. It never
// waits.
func (p *Publisher) Flush() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Close publishes what is pending (for at most a second), then closes the
// sockets and stops the goroutines. Safe to call more than once.
func (p *Publisher) Close() {
	p.closeOnce.Do(func() {
		close(p.stop)
		<-p.done
		p.pub.close()
		if p.replay != nil {
			p.replay.close()
		}
	})
}

// Stats returns the counters.
func (p *Publisher) Stats() Stats {
	p.mu.Lock()
	steps, b := int64(len(p.ring)-p.ringHead), p.ringBytes
	p.mu.Unlock()
	return Stats{
		Batches: p.batches.Load(), Events: p.events.Load(), Bytes: p.bytes.Load(),
		DroppedSends: p.dropped.Load(), Subscribers: int64(p.pub.count()),
		ReplayReqs: p.replays.Load(), ReplayBatches: p.replayed.Load(),
		Snapshots: p.snapshots.Load(), SourceErrors: p.srcErrors.Load(),
		BufferedSteps: steps, BufferedBytes: b, NextSeq: p.nextSeq.Load(),
	}
}

func (p *Publisher) run() {
	defer close(p.done)
	t := time.NewTicker(p.cfg.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			// Publish what the engine produced before Close, once.
			p.flush()
			p.pub.drain(time.Second)
			return
		case <-t.C:
		case <-p.wake:
		}
		p.flush()
	}
}

// flush drains the source and publishes its events in batches.
func (p *Publisher) flush() {
	if p.snapWant.Swap(false) {
		if err := p.src.Snapshot(); err != nil {
			p.srcErrors.Add(1)
			logx.L().Warn("event publisher: snapshot failed", zap.Error(err))
		} else {
			p.snapshots.Add(1)
		}
	}
	evs, err := p.src.Drain()
	if err != nil {
		p.srcErrors.Add(1)
		logx.L().Warn("event publisher: drain failed", zap.Error(err))
		return
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	// The batches are counted first so that a batch with AllBlocksCleared
	// can say how many of this drain's batches follow it: a snapshot spans
	// them all, and a subscriber that scores the instance only once it is
	// whole must know where it ends (SnapshotRestField).
	rest := -1
	for e := evs; len(e) > 0; e = e[p.batchLen(e):] {
		rest++
	}
	for ; len(evs) > 0; rest-- {
		n := p.batchLen(evs)
		p.publish(ts, evs[:n], rest)
		evs = evs[n:]
	}
}

// batchLen is the length of the batch cut from the front of evs (not
// empty): MaxBatchEvents events, or more, up to 4 times that, so as never
// to split a chain of stored blocks that would merge.
func (p *Publisher) batchLen(evs []prefix.Event) int {
	n := min(len(evs), p.cfg.MaxBatchEvents)
	for n < len(evs) && evs[n].Kind == prefix.BlockStored && evs[n].Parent == evs[n-1].Hash && evs[n].Group == evs[n-1].Group && n < 4*p.cfg.MaxBatchEvents {
		n++
	}
	return n
}

// publish sends evs as the next batch; rest is the number of batches of
// the same drain after it, which an AllBlocksCleared in it carries.
func (p *Publisher) publish(ts float64, evs []prefix.Event, rest int) {
	payload := p.enc.EncodeSnapshot(ts, evs, rest)
	seq := p.nextSeq.Add(1) - 1
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], uint64(seq))
	wire := appendMessage(make([]byte, 0, len(payload)+len(p.cfg.Topic)+32), []byte(p.cfg.Topic), seqb[:], payload)
	e := &entry{seq: seq, wire: wire, payload: wire[len(wire)-len(payload):]}
	p.batches.Add(1)
	p.events.Add(int64(len(evs)))
	p.bytes.Add(int64(len(payload)))
	if p.cfg.ReplayEndpoint != "" {
		p.mu.Lock()
		p.ring = append(p.ring, e)
		p.ringBytes += int64(len(e.payload))
		for len(p.ring)-p.ringHead > p.cfg.BufferSteps || (p.ringBytes > p.cfg.BufferBytes && len(p.ring)-p.ringHead > 1) {
			p.ringBytes -= int64(len(p.ring[p.ringHead].payload))
			p.ring[p.ringHead] = nil
			p.ringHead++
		}
		if p.ringHead > len(p.ring)/2 && p.ringHead > 64 {
			p.ring = p.ring[:copy(p.ring, p.ring[p.ringHead:])]
			p.ringHead = 0
		}
		p.mu.Unlock()
	}
	p.pub.broadcast(e)
}

// replayFrom returns the buffered batches with seq >= start.
func (p *Publisher) replayFrom(start int64) []*entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	live := p.ring[p.ringHead:]
	lo := 0
	if len(live) > 0 && start > live[0].seq {
		lo = int(min(start-live[0].seq, int64(len(live))))
	}
	return append([]*entry(nil), live[lo:]...)
}

// server is a bound (or connecting) socket and its connections.
type server struct {
	p      *Publisher
	kind   string // PUB or ROUTER
	ln     net.Listener
	ep     endpoint
	mu     sync.Mutex
	conns  map[*peer]struct{}
	closed bool
	wg     sync.WaitGroup
	quit   chan struct{}
}

// peer is one connection: a subscriber (PUB) or a replay client (ROUTER).
type peer struct {
	z       *zconn
	q       chan *entry  // PUB: the subscriber's queue
	inQueue atomic.Int64 // batches queued or being written
	qBytes  atomic.Int64 // their bytes
	mu      sync.Mutex
	topics  map[string]struct{}
	gone    chan struct{}
	goneOne sync.Once
}

func (c *peer) close() {
	c.goneOne.Do(func() {
		close(c.gone)
		_ = c.z.c.Close()
	})
}

func newServer(p *Publisher, ep string, kind string, bind bool) (*server, error) {
	e, err := parseEndpoint(ep)
	if err != nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "event publisher: %v", err)
	}
	s := &server{p: p, kind: kind, ep: e, conns: map[*peer]struct{}{}, quit: make(chan struct{})}
	if !bind {
		s.wg.Add(1)
		go s.dialLoop()
		return s, nil
	}
	if e.network == "unix" {
		// A stale socket file of a dead process would make bind fail.
		if fi, err := os.Lstat(e.addr); err == nil && fi.Mode()&os.ModeSocket != 0 {
			_ = os.Remove(e.addr)
		}
	}
	s.ln, err = net.Listen(e.network, e.addr)
	if err != nil {
		return nil, kverr.Errorf(kverr.InvalidArgument, "event publisher: %s endpoint %s: %v", kind, ep, err)
	}
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

func (s *server) addr() net.Addr {
	if s.ln == nil {
		return nil
	}
	return s.ln.Addr()
}

func (s *server) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return // closed
		}
		if s.count() >= s.p.cfg.MaxSubscribers {
			_ = c.Close()
			continue
		}
		s.wg.Add(1)
		go s.serve(c, true)
	}
}

// dialLoop keeps one outgoing connection up (connect mode: the
// subscriber binds), redialling with a backoff.
func (s *server) dialLoop() {
	defer s.wg.Done()
	backoff := 100 * time.Millisecond
	failing := "" // the last failure logged, so a refused endpoint is said once
	for {
		select {
		case <-s.quit:
			return
		default:
		}
		c, err := net.DialTimeout(s.ep.network, s.ep.addr, 2*time.Second)
		if err == nil {
			failing = ""
			logx.L().Info("event publisher: connected to the subscriber", zap.String("socket", s.kind), zap.String("endpoint", s.ep.String()))
			s.wg.Add(1)
			s.serve(c, false)
			backoff = 100 * time.Millisecond
		} else if err.Error() != failing {
			failing = err.Error()
			logx.L().Warn("event publisher: waiting for a subscriber to bind the endpoint (connect mode); retrying",
				zap.String("socket", s.kind), zap.String("endpoint", s.ep.String()), zap.Error(err))
		}
		select {
		case <-s.quit:
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (s *server) serve(c net.Conn, asServer bool) {
	defer s.wg.Done()
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetKeepAlive(true)
		_ = tc.SetNoDelay(true)
	}
	z, err := handshake(c, s.kind, asServer)
	if err != nil {
		logx.L().Debug("event publisher: handshake failed", zap.String("socket", s.kind), zap.Error(err))
		_ = c.Close()
		return
	}
	pr := &peer{z: z, topics: map[string]struct{}{}, gone: make(chan struct{})}
	if s.kind == "PUB" {
		pr.q = make(chan *entry, s.p.cfg.HWM)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = c.Close()
		return
	}
	s.conns[pr] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, pr)
		s.mu.Unlock()
		pr.close()
	}()
	if s.kind == "PUB" {
		go s.subscriptions(pr)
		s.writeLoop(pr)
		return
	}
	s.replayLoop(pr)
}

// subscriptions reads a subscriber's (un)subscriptions until it goes.
func (s *server) subscriptions(pr *peer) {
	defer pr.close()
	const maxTopics = 256
	set := func(on bool, t []byte) {
		pr.mu.Lock()
		defer pr.mu.Unlock()
		if !on {
			delete(pr.topics, string(t))
		} else if len(pr.topics) < maxTopics {
			pr.topics[string(t)] = struct{}{}
		}
	}
	for {
		fr, err := pr.z.readMessage(MaxTopicLen+1, 1, func(name string, body []byte) {
			switch name {
			case "SUBSCRIBE":
				set(true, body)
			case "CANCEL":
				set(false, body)
			}
		})
		if err != nil {
			return
		}
		if len(fr[0]) > 0 && (fr[0][0] == 0 || fr[0][0] == 1) {
			set(fr[0][0] == 1, fr[0][1:])
		}
	}
}

func (pr *peer) subscribed(topic string) bool {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	for t := range pr.topics {
		if len(topic) >= len(t) && topic[:len(t)] == t {
			return true
		}
	}
	return false
}

// maxQueueBytes bounds the bytes queued for one subscriber besides the
// HWM's count of batches, so a stalled subscriber holds at most this much
// (a batch larger than this still goes to an empty queue).
const maxQueueBytes = 64 << 20

// writeTimeout bounds one write to a subscriber: a peer that stops
// reading for this long is dropped (it reconnects and replays).
const writeTimeout = 10 * time.Second

func (s *server) writeLoop(pr *peer) {
	for {
		select {
		case e := <-pr.q:
			_ = pr.z.c.SetWriteDeadline(time.Now().Add(writeTimeout))
			_, err := pr.z.c.Write(e.wire)
			pr.inQueue.Add(-1)
			pr.qBytes.Add(-int64(len(e.wire)))
			if err != nil {
				return
			}
		case <-pr.gone:
			return
		}
	}
}

// broadcast queues e to every subscriber of its topic, never waiting.
func (s *server) broadcast(e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for pr := range s.conns {
		if !pr.subscribed(s.p.cfg.Topic) {
			continue
		}
		if pr.qBytes.Load()+int64(len(e.wire)) > maxQueueBytes && pr.inQueue.Load() > 0 {
			s.p.dropped.Add(1)
			continue
		}
		pr.inQueue.Add(1)
		pr.qBytes.Add(int64(len(e.wire)))
		select {
		case pr.q <- e:
		default:
			pr.inQueue.Add(-1)
			pr.qBytes.Add(-int64(len(e.wire)))
			s.p.dropped.Add(1)
		}
	}
}

// drain waits up to d for the subscribers' queues to empty.
func (s *server) drain(d time.Duration) {
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		s.mu.Lock()
		n := 0
		for pr := range s.conns {
			select {
			case <-pr.gone:
			default:
				n += int(pr.inQueue.Load())
			}
		}
		s.mu.Unlock()
		if n == 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (s *server) close() {
	s.mu.Lock()
	s.closed = true
	conns := make([]*peer, 0, len(s.conns))
	for pr := range s.conns {
		conns = append(conns, pr)
	}
	s.mu.Unlock()
	close(s.quit)
	if s.ln != nil {
		_ = s.ln.Close()
		if s.ep.network == "unix" {
			_ = os.Remove(s.ep.addr)
		}
	}
	for _, pr := range conns {
		pr.close()
	}
	s.wg.Wait()
}

// snapshotInterval bounds how often replay clients may ask for a snapshot
// (each one re-sends the whole cache).
const snapshotInterval = time.Second

// replayLoop serves one replay client: each request is [start] or
// ["", start] (a DEALER with or without the delimiter, or a REQ); each
// reply starts with the empty delimiter, then [topic, seq, payload] per
// batch, then [empty, -1, empty].
func (s *server) replayLoop(pr *peer) {
	var seqb [8]byte
	end := make([]byte, 8)
	binary.BigEndian.PutUint64(end, ^uint64(0)) // EndSeq, -1
	for {
		fr, err := pr.z.readMessage(64, 4, nil)
		if err != nil {
			return
		}
		last := fr[len(fr)-1]
		if len(last) != 8 {
			logx.L().Debug("event publisher: malformed replay request", zap.Int("bytes", len(last)))
			continue
		}
		start := int64(binary.BigEndian.Uint64(last))
		s.p.replays.Add(1)
		var out []byte
		if start == SnapshotSeq {
			now := time.Now().UnixNano()
			if last := s.p.lastSnap.Load(); now-last >= int64(snapshotInterval) && s.p.lastSnap.CompareAndSwap(last, now) {
				s.p.Resync()
			}
		} else if start >= 0 {
			for _, e := range s.p.replayFrom(start) {
				binary.BigEndian.PutUint64(seqb[:], uint64(e.seq))
				out = appendMessage(out, nil, []byte(s.p.cfg.Topic), seqb[:], e.payload)
				s.p.replayed.Add(1)
				if len(out) > 1<<20 {
					if !s.write(pr, out) {
						return
					}
					out = out[:0]
				}
			}
		}
		out = appendMessage(out, nil, nil, end, nil)
		if !s.write(pr, out) {
			return
		}
	}
}

func (s *server) write(pr *peer, b []byte) bool {
	_ = pr.z.c.SetWriteDeadline(time.Now().Add(writeTimeout))
	_, err := pr.z.c.Write(b)
	return err == nil
}

// String describes the publisher for logs.
func (p *Publisher) String() string {
	return fmt.Sprintf("event publisher %s (replay %q, topic %q)", p.cfg.Endpoint, p.cfg.ReplayEndpoint, p.cfg.Topic)
}
