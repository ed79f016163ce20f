package resp

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// NumSlots is the number of hash slots of a Valkey or Redis cluster.
const NumSlots = 16384

var crcTable = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()

// Slot returns key's hash slot as the cluster computes it: CRC16 (XMODEM)
// of the key modulo 16384, or of its hash tag, the bytes between the first
// '{' and the first '}' after it, when there are any.
func Slot(key []byte) int {
	if i := bytes.IndexByte(key, '{'); i >= 0 {
		if j := bytes.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var c uint16
	for _, b := range key {
		c = c<<8 ^ crcTable[byte(c>>8)^b]
	}
	return int(c) % NumSlots
}

// NodeError is the reply, in a command's place, of a command that a
// Cluster could not run because its node failed (a transport error, a
// timeout, a refused AUTH or TLS handshake), was skipped after such a
// failure (ErrNodeDown), or because no node serves its slot (ErrNoNode).
type NodeError struct {
	Addr string
	Err  error
}

func (e *NodeError) Error() string {
	return "redis: node " + e.Addr + ": " + e.Err.Error()
}

func (e *NodeError) Unwrap() error { return e.Err }

// ErrNodeDown is a node skipped for a backoff window after a failure.
var ErrNodeDown = errors.New("redis: node skipped after a failure")

// ErrNoNode is a slot that no node of the cluster's map serves.
var ErrNoNode = errors.New("redis: no node serves the slot")

// ClusterOptions configure a Cluster: Options apply to the connection of
// every node. With TLS, a node other than the seed is verified for its own
// host unless FixedServerName (TLS.ServerName was configured, not taken
// from the seed's address).
type ClusterOptions struct {
	Options
	FixedServerName bool
	// NodeBackoff is the first window a node is skipped for after a
	// failure, doubling on each consecutive one up to MaxNodeBackoff.
	NodeBackoff, MaxNodeBackoff time.Duration
	// RefreshMin is the shortest gap between two refreshes of the slot
	// map that errors ask for; it doubles while errors keep asking and the
	// map does not change, up to RefreshMax (default 2 s).
	RefreshMin, RefreshMax time.Duration
}

// ClusterStats are a Cluster's counters.
type ClusterStats struct {
	Cluster   bool  // the server runs in cluster mode (as last discovered)
	Nodes     int   // the primaries of the slot map
	Redirects int64 // MOVED and ASK replies followed
	Refreshes int64 // slot maps read (discovery included)
}

const (
	modeUnknown = iota
	modeStandalone
	modeCluster
)

type node struct {
	addr string
	c    *Client

	mu        sync.Mutex
	downUntil time.Time
	backoff   time.Duration
}

// Cluster is a client of a server that may run in cluster mode: given one
// seed address, its first call asks the server (CLUSTER SHARDS, or
// CLUSTER SLOTS on a server without it) and, on a standalone server (an
// error reply: cluster support disabled, the command unknown or refused),
// it is a Client of the seed; in cluster mode it routes each command by
// its key (the command's first argument) to the primary serving the key's
// slot, pipelining each call's commands per node, the nodes concurrently.
// A MOVED reply updates the slot, asks for a refresh of the map and is
// retried once on the node it names; an ASK reply (a slot being migrated)
// is retried once on the named node after ASKING. A node that fails is
// skipped for a backoff window (its commands' replies are NodeErrors) and
// the map is refreshed in the background, at most once per RefreshMin
// (doubling), so that a failover's new primary is found.
type Cluster struct {
	seed string
	o    ClusterOptions

	mu          sync.Mutex
	mode        int
	closed      bool
	nodes       map[string]*node
	slots       *[NumSlots]*node
	nprimaries  int
	refreshing  bool
	lastRefresh time.Time
	refreshGap  time.Duration
	wg          sync.WaitGroup

	redirects, refreshes atomic.Int64
}

// NewCluster returns a client for the server (standalone or a cluster's
// node) at seed. It does not connect yet.
func NewCluster(seed string, o ClusterOptions) *Cluster {
	if o.NodeBackoff <= 0 {
		o.NodeBackoff = time.Second
	}
	o.MaxNodeBackoff = max(o.MaxNodeBackoff, o.NodeBackoff)
	if o.RefreshMin <= 0 {
		o.RefreshMin = 100 * time.Millisecond
	}
	if o.RefreshMax <= 0 {
		o.RefreshMax = 2 * time.Second
	}
	o.RefreshMax = max(o.RefreshMax, o.RefreshMin)
	c := &Cluster{seed: seed, o: o, nodes: map[string]*node{}, refreshGap: o.RefreshMin}
	c.nodes[seed] = &node{addr: seed, c: NewClientOptions(seed, o.Options)}
	return c
}

// Close closes every connection, once the calls in flight are done with
// them; every later call fails with ErrClosed.
func (c *Cluster) Close() {
	c.mu.Lock()
	c.closed = true
	nodes := make([]*node, 0, len(c.nodes))
	for _, n := range c.nodes {
		nodes = append(nodes, n)
	}
	c.mu.Unlock()
	for _, n := range nodes {
		n.c.Close()
	}
	c.wg.Wait()
}

// Reset drops every node's connection (Client.Reset): the next calls dial
// again, reading the credentials anew.
func (c *Cluster) Reset() {
	c.mu.Lock()
	nodes := mapValues(c.nodes)
	c.mu.Unlock()
	for _, n := range nodes {
		n.c.Reset()
	}
}

// DialCount returns how many connections the nodes' clients have made.
func (c *Cluster) DialCount() int64 {
	c.mu.Lock()
	nodes := mapValues(c.nodes)
	c.mu.Unlock()
	var n int64
	for _, nd := range nodes {
		n += nd.c.DialCount()
	}
	return n
}

// Primaries returns the addresses of the slot map's primaries, in slot
// order (none on a standalone server or before discovery).
func (c *Cluster) Primaries() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	seen := map[*node]bool{}
	if c.mode == modeCluster && c.slots != nil {
		for _, n := range c.slots {
			if n != nil && !seen[n] {
				seen[n] = true
				out = append(out, n.addr)
			}
		}
	}
	return out
}

// DoNode sends cmds to the node at addr (a primary of the map, or the
// seed), as Client.Do.
func (c *Cluster) DoNode(addr string, cmds [][][]byte) ([]any, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	n := c.nodeLocked(addr)
	c.mu.Unlock()
	r, err := n.c.Do(cmds)
	if err != nil {
		n.failed(err, &c.o)
		c.askRefresh() // a primary of the map failing: a failover may follow
	}
	return r, err
}

// Stats returns the counters.
func (c *Cluster) Stats() ClusterStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return ClusterStats{Cluster: c.mode == modeCluster, Nodes: c.nprimaries,
		Redirects: c.redirects.Load(), Refreshes: c.refreshes.Load()}
}

// IsCluster reports whether the last discovery found a cluster.
func (c *Cluster) IsCluster() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mode == modeCluster
}

// Do sends cmds and returns their replies in order, as Client.Do does. On
// a standalone server it is the seed's Client.Do. In cluster mode each
// command goes to the node of its first argument's slot, and a command
// whose node failed has a *NodeError in its place; err is then non-nil
// only when the call could not be routed (the map unknown and the seed
// not answering) or after Close.
func (c *Cluster) Do(cmds [][][]byte) ([]any, error) {
	deadline := time.Now().Add(c.o.OpTimeout)
	mode, err := c.discover(deadline)
	if err != nil {
		return nil, err
	}
	if mode == modeStandalone {
		r, err := c.seedNode().c.DoDeadline(cmds, deadline)
		c.standaloneMoved(r)
		return r, err
	}
	var buf []byte
	offs := make([]int, len(cmds)+1)
	keys := make([][]byte, len(cmds))
	for i, args := range cmds {
		buf = AppendCommand(buf, args...)
		offs[i+1] = len(buf)
		if len(args) > 1 {
			keys[i] = args[1]
		}
	}
	enc := make([][][]byte, len(cmds))
	for i := range enc {
		enc[i] = [][]byte{buf[offs[i]:offs[i+1]:offs[i+1]]}
	}
	return c.route(&Call{Cmds: enc, Keys: keys}, deadline), nil
}

// DoEncoded is Do for commands the caller encoded: enc[i] is command i's
// bytes, keys[i] its key. On a standalone server the commands are written
// as one pipeline (a vectored write).
func (c *Cluster) DoEncoded(enc [][]byte, keys [][]byte) ([]any, error) {
	cmds := make([][][]byte, len(enc))
	for i := range enc {
		cmds[i] = enc[i : i+1 : i+1]
	}
	return c.Call(&Call{Cmds: cmds, Keys: keys})
}

// Call runs call's pipeline, within the operation timeout, and returns
// the replies as Do does: on a standalone server in one pipeline on its
// connection, in cluster mode each command on its key's node.
func (c *Cluster) Call(call *Call) ([]any, error) {
	deadline := time.Now().Add(c.o.OpTimeout)
	mode, err := c.discover(deadline)
	if err != nil {
		return nil, err
	}
	if mode == modeStandalone {
		r, err := c.seedNode().c.call(call.Cmds, nil, call.Window, call.Bulk, deadline)
		c.standaloneMoved(r)
		return r, err
	}
	return c.route(call, deadline), nil
}

// standaloneMoved makes the next call ask the server again when a
// server taken for standalone answers MOVED (it joined a cluster).
func (c *Cluster) standaloneMoved(r []any) {
	for _, x := range r {
		if e, ok := x.(Error); ok && strings.HasPrefix(string(e), "MOVED ") {
			c.mu.Lock()
			if c.mode == modeStandalone {
				c.mode = modeUnknown
			}
			c.mu.Unlock()
			return
		}
	}
}

func (c *Cluster) seedNode() *node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[c.seed]
}

// discover returns the mode, asking the seed when it is not known yet.
func (c *Cluster) discover(deadline time.Time) (int, error) {
	c.mu.Lock()
	mode, closed := c.mode, c.closed
	c.mu.Unlock()
	if closed {
		return 0, ErrClosed
	}
	if mode != modeUnknown {
		return mode, nil
	}
	seed := c.seedNode()
	m, err := c.readMap(seed, deadline)
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if m == nil {
		c.mode = modeStandalone
	} else {
		c.install(m)
		c.mode = modeCluster
	}
	return c.mode, nil
}

// slotMap is what a node says of the cluster: each slot's primary.
type slotMap struct {
	owner [NumSlots]string
}

// readMap asks n for the slot map: nil, nil for a standalone server (an
// error reply to both commands, or a reply of another shape).
func (c *Cluster) readMap(n *node, deadline time.Time) (*slotMap, error) {
	host, _, _ := net.SplitHostPort(n.addr)
	r, err := n.c.DoDeadline([][][]byte{{[]byte("CLUSTER"), []byte("SHARDS")}}, deadline)
	if err != nil {
		return nil, err
	}
	c.refreshes.Add(1)
	if e, ok := r[0].(Error); ok {
		if strings.Contains(strings.ToLower(string(e)), "cluster support disabled") {
			return nil, nil
		}
		r, err = n.c.DoDeadline([][][]byte{{[]byte("CLUSTER"), []byte("SLOTS")}}, deadline)
		if err != nil {
			return nil, err
		}
		return parseSlots(r[0], host, c.o.TLS != nil), nil
	}
	return parseShards(r[0], host, c.o.TLS != nil), nil
}

func joinHostPort(host string, port int64) string {
	return net.JoinHostPort(host, strconv.FormatInt(port, 10))
}

// parseShards reads CLUSTER SHARDS' reply; nil when it has no slots.
func parseShards(x any, seedHost string, useTLS bool) *slotMap {
	shards, ok := x.([]any)
	if !ok {
		return nil
	}
	m := &slotMap{}
	found := false
	for _, s := range shards {
		f := pairs(s)
		slots, _ := f["slots"].([]any)
		nodes, _ := f["nodes"].([]any)
		// The shard's primary: an online one (a failed former primary
		// may still be listed as one after its replica took over).
		addr, online := "", false
		for _, nd := range nodes {
			nf := pairs(nd)
			if str(nf["role"]) != "master" {
				continue
			}
			up := str(nf["health"]) == "online"
			if online && !up {
				continue
			}
			host := str(nf["endpoint"])
			if host == "" || host == "?" {
				host = str(nf["ip"])
			}
			if host == "" || host == "?" {
				host = seedHost
			}
			port, _ := nf["port"].(int64)
			if tp, ok := nf["tls-port"].(int64); ok && useTLS && tp > 0 {
				port = tp
			}
			if port > 0 {
				addr, online = joinHostPort(host, port), up
			}
		}
		if addr == "" {
			continue
		}
		for i := 0; i+1 < len(slots); i += 2 {
			lo, ok1 := slots[i].(int64)
			hi, ok2 := slots[i+1].(int64)
			if !ok1 || !ok2 || lo < 0 || hi >= NumSlots || lo > hi {
				continue
			}
			for s := lo; s <= hi; s++ {
				m.owner[s] = addr
			}
			found = true
		}
	}
	if !found {
		return nil
	}
	return m
}

// parseSlots reads CLUSTER SLOTS' reply; nil when it is not one.
func parseSlots(x any, seedHost string, _ bool) *slotMap {
	ranges, ok := x.([]any)
	if !ok || len(ranges) == 0 {
		return nil
	}
	m := &slotMap{}
	for _, rg := range ranges {
		a, ok := rg.([]any)
		if !ok || len(a) < 3 {
			return nil
		}
		lo, ok1 := a[0].(int64)
		hi, ok2 := a[1].(int64)
		p, ok3 := a[2].([]any)
		if !ok1 || !ok2 || !ok3 || len(p) < 2 || lo < 0 || hi >= NumSlots || lo > hi {
			return nil
		}
		host := str(p[0])
		if host == "" || host == "?" {
			host = seedHost
		}
		port, _ := p[1].(int64)
		for s := lo; s <= hi; s++ {
			m.owner[s] = joinHostPort(host, port)
		}
	}
	return m
}

func pairs(x any) map[string]any {
	a, _ := x.([]any)
	f := make(map[string]any, len(a)/2)
	for i := 0; i+1 < len(a); i += 2 {
		f[str(a[i])] = a[i+1]
	}
	return f
}

func str(x any) string {
	switch v := x.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// nodeLocked returns the node of addr, making it. c.mu is held.
func (c *Cluster) nodeLocked(addr string) *node {
	if n := c.nodes[addr]; n != nil {
		return n
	}
	o := c.o.Options
	if o.TLS != nil && !c.o.FixedServerName {
		o.TLS = o.TLS.Clone()
		if host, _, err := net.SplitHostPort(addr); err == nil {
			o.TLS.ServerName = host
		}
	}
	n := &node{addr: addr, c: NewClientOptions(addr, o)}
	if c.closed {
		n.c.Close()
	}
	c.nodes[addr] = n
	return n
}

// install makes m the slot map. c.mu is held. It reports whether the map
// changed.
func (c *Cluster) install(m *slotMap) bool {
	s := new([NumSlots]*node)
	prim := map[*node]bool{}
	changed := c.slots == nil
	for i, a := range m.owner {
		if a != "" {
			s[i] = c.nodeLocked(a)
			prim[s[i]] = true
		}
		if !changed && s[i] != c.slots[i] {
			changed = true
		}
	}
	c.slots, c.nprimaries = s, len(prim)
	return changed
}

// askRefresh starts a refresh of the slot map in the background unless one
// runs or the last one is too recent.
func (c *Cluster) askRefresh() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.refreshing || time.Since(c.lastRefresh) < c.refreshGap {
		return
	}
	c.refreshing = true
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		c.refresh()
	}()
}

// refresh reads the map from the first node that answers: the primaries
// not skipped, then the seed, then the others.
func (c *Cluster) refresh() {
	c.mu.Lock()
	var order []*node
	seen := map[*node]bool{}
	if c.slots != nil {
		for _, n := range c.slots {
			if n != nil && !seen[n] && !n.isDown(time.Now()) {
				seen[n] = true
				order = append(order, n)
			}
		}
	}
	for _, n := range append([]*node{c.nodes[c.seed]}, mapValues(c.nodes)...) {
		if !seen[n] {
			seen[n] = true
			order = append(order, n)
		}
	}
	c.mu.Unlock()
	var m *slotMap
	for _, n := range order {
		got, err := c.readMap(n, time.Now().Add(c.o.OpTimeout))
		if err == nil && got != nil {
			m = got
			break
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.refreshing = false
	c.lastRefresh = time.Now()
	if m != nil && !c.closed && c.install(m) {
		c.refreshGap = c.o.RefreshMin
	} else {
		c.refreshGap = min(2*c.refreshGap, c.o.RefreshMax)
	}
}

func mapValues(m map[string]*node) []*node {
	out := make([]*node, 0, len(m))
	for _, n := range m {
		out = append(out, n)
	}
	return out
}

func (n *node) isDown(now time.Time) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return now.Before(n.downUntil)
}

func (n *node) failed(err error, o *ClusterOptions) {
	if errors.Is(err, ErrClosed) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.backoff == 0 {
		n.backoff = o.NodeBackoff
	} else {
		n.backoff = min(2*n.backoff, o.MaxNodeBackoff)
	}
	n.downUntil = time.Now().Add(n.backoff)
}

func (n *node) ok() {
	n.mu.Lock()
	n.backoff, n.downUntil = 0, time.Time{}
	n.mu.Unlock()
}

var askingCmd = AppendCommand(nil, []byte("ASKING"))

type batch struct {
	idx []int
	ask bool
}

// route runs the call's commands on their nodes, then their redirects.
func (c *Cluster) route(call *Call, deadline time.Time) []any {
	enc, keys := call.Cmds, call.Keys
	out := make([]any, len(enc))
	c.mu.Lock()
	slots := c.slots
	c.mu.Unlock()
	groups := map[*node]*batch{}
	for i := range enc {
		n := slots[Slot(keys[i])]
		if n == nil {
			out[i] = &NodeError{Addr: "?", Err: ErrNoNode}
			continue
		}
		b := groups[n]
		if b == nil {
			b = &batch{}
			groups[n] = b
		}
		b.idx = append(b.idx, i)
	}
	c.runGroups(groups, call, out, deadline)
	// Redirects: each followed once.
	groups = map[*node]*batch{}
	askGroups := map[*node]*batch{}
	moved := false
	for i, x := range out {
		e, ok := x.(Error)
		if !ok {
			continue
		}
		kind, rest, _ := strings.Cut(string(e), " ")
		if kind != "MOVED" && kind != "ASK" {
			continue
		}
		slotText, addr, _ := strings.Cut(rest, " ")
		slot, err := strconv.Atoi(slotText)
		if err != nil || slot < 0 || slot >= NumSlots || addr == "" {
			continue
		}
		if strings.HasPrefix(addr, ":") { // an unknown endpoint: the host of the node that answered
			addr = c.seedHost() + addr
		}
		c.redirects.Add(1)
		c.mu.Lock()
		n := c.nodeLocked(addr)
		if kind == "MOVED" {
			moved = true
			if c.slots != nil && c.slots[slot] != n {
				s := *c.slots
				s[slot] = n
				c.slots = &s
			}
		}
		c.mu.Unlock()
		g := groups
		if kind == "ASK" {
			g = askGroups
		}
		b := g[n]
		if b == nil {
			b = &batch{ask: kind == "ASK"}
			g[n] = b
		}
		b.idx = append(b.idx, i)
	}
	if moved {
		c.askRefresh()
	}
	if len(groups)+len(askGroups) > 0 {
		var wg sync.WaitGroup
		wg.Go(func() { c.runGroups(groups, call, out, deadline) })
		c.runGroups(askGroups, call, out, deadline)
		wg.Wait()
	}
	return out
}

func (c *Cluster) seedHost() string {
	host, _, _ := net.SplitHostPort(c.seed)
	return host
}

// runGroups runs each node's batch, the nodes concurrently, writing the
// replies into out.
func (c *Cluster) runGroups(groups map[*node]*batch, call *Call, out []any, deadline time.Time) {
	if len(groups) == 0 {
		return
	}
	var wg sync.WaitGroup
	for n, b := range groups {
		if len(groups) == 1 {
			c.runBatch(n, b, call, out, deadline)
			break
		}
		wg.Go(func() { c.runBatch(n, b, call, out, deadline) })
	}
	wg.Wait()
}

func (c *Cluster) runBatch(n *node, b *batch, call *Call, out []any, deadline time.Time) {
	fail := func(err error) {
		for _, i := range b.idx {
			out[i] = &NodeError{Addr: n.addr, Err: err}
		}
	}
	if n.isDown(time.Now()) {
		fail(ErrNodeDown)
		c.askRefresh()
		return
	}
	// The node's pipeline: its commands' pieces, each after ASKING for
	// an ASK redirect (whose reply is not the caller's).
	slots := make([][][]byte, 0, 2*len(b.idx))
	idx := make([]int, 0, 2*len(b.idx))
	window := call.Window
	for _, i := range b.idx {
		if b.ask {
			slots = append(slots, [][]byte{askingCmd})
			idx = append(idx, -1)
		}
		slots = append(slots, call.Cmds[i])
		idx = append(idx, i)
	}
	if b.ask {
		window *= 2
	}
	r, err := n.c.call(slots, idx, window, call.Bulk, deadline)
	if err != nil {
		n.failed(err, &c.o)
		fail(err)
		c.askRefresh()
		return
	}
	n.ok()
	for k, i := range b.idx {
		if b.ask {
			out[i] = r[2*k+1]
		} else {
			out[i] = r[k]
		}
		if e, ok := out[i].(Error); ok && (strings.HasPrefix(string(e), "CLUSTERDOWN") || strings.HasPrefix(string(e), "TRYAGAIN")) {
			c.askRefresh()
		}
	}
}

// String describes the cluster's state, for logs.
func (c *Cluster) String() string {
	s := c.Stats()
	return fmt.Sprintf("seed %s cluster %v primaries %d redirects %d refreshes %d", c.seed, s.Cluster, s.Nodes, s.Redirects, s.Refreshes)
}
