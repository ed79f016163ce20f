package resp

import (
	"sync"
	"time"
)

// A node's connections. A node has one Client (its first connection,
// which Do, DoNode and the slot map's reads use) and, for a Call whose
// Conns is above one, more Clients of the same address and Options (so
// the same TLS handshake and AUTH on each), made the first time a call
// needs them and kept: a call that carries a node many large values
// splits them into contiguous runs, each a pipeline (with the call's
// Window) on a connection of its own, run concurrently. One connection
// is served by one of the server's threads at a time (Redis and Valkey
// with io-threads write each client's replies on one thread), so a node's
// large batch read on several connections may move faster than on one.
//
// A call takes the connections it needs in order (the first, then the
// second...), each run waiting for its own connection alone, so calls
// never wait on each other in a cycle.

// newNode returns a node of addr whose connections have o.
func newNode(addr string, o Options) *node {
	n := &node{addr: addr, opts: o, c: NewClientOptions(addr, o)}
	n.lanes = []*Client{n.c}
	return n
}

// lane returns the node's j-th connection's Client, making it (and those
// before it) if needed. A node closed makes closed Clients.
func (n *node) lane(j int) *Client {
	n.lanesMu.Lock()
	defer n.lanesMu.Unlock()
	for len(n.lanes) <= j {
		c := NewClientOptions(n.addr, n.opts)
		if n.closed {
			c.Close()
		}
		n.lanes = append(n.lanes, c)
	}
	return n.lanes[j]
}

// clients returns the node's Clients made so far.
func (n *node) clients() []*Client {
	n.lanesMu.Lock()
	defer n.lanesMu.Unlock()
	return append([]*Client(nil), n.lanes...)
}

// close closes every connection of the node (Client.Close), and the
// Clients made later.
func (n *node) close() {
	n.lanesMu.Lock()
	n.closed = true
	n.lanesMu.Unlock()
	for _, c := range n.clients() {
		c.Close()
	}
}

// runFailed is, in run's replies, a command that its connection did not
// run to its reply: the connection failed (err).
type runFailed struct{ err error }

// runs returns how many connections a node's share of call, m commands,
// goes on: Conns at most, each with SplitMin commands at least.
func (call *Call) runs(m int) int {
	if call.Conns <= 1 || m <= 1 {
		return 1
	}
	return max(1, min(call.Conns, m/max(1, call.SplitMin), m))
}

// run runs the commands idx of call (nil: all) on the node, each after
// ASKING with ask, split into call.runs contiguous runs, each a pipeline
// on one of the node's connections, within deadline. It returns their
// replies in idx's order, a command whose connection failed having a
// runFailed in its place, and the first connection's error (nil when
// every run got its replies). A run that fails stops only itself: the
// others read their replies (and their Bulk values) to the end.
func (n *node) run(call *Call, idx []int, ask bool, deadline time.Time) ([]any, error) {
	m := len(idx)
	if idx == nil {
		m = len(call.Cmds)
	}
	cmd := func(k int) int {
		if idx == nil {
			return k
		}
		return idx[k]
	}
	window := call.Window
	if ask {
		window *= 2 // ASKING and its command
	}
	out := make([]any, m)
	runs := call.runs(m)
	errs := make([]error, runs)
	one := func(j int) {
		lo, hi := j*m/runs, (j+1)*m/runs
		// The run's pipeline: its commands' pieces, each after ASKING
		// for an ASK redirect (whose reply is not the caller's).
		per := 1
		if ask {
			per = 2
		}
		slots := make([][][]byte, 0, per*(hi-lo))
		sidx := make([]int, 0, per*(hi-lo))
		for k := lo; k < hi; k++ {
			if ask {
				slots = append(slots, [][]byte{askingCmd})
				sidx = append(sidx, -1)
			}
			slots = append(slots, call.Cmds[cmd(k)])
			sidx = append(sidx, cmd(k))
		}
		r, err := n.lane(j).call(slots, sidx, window, call.Bulk, deadline)
		if err != nil {
			errs[j] = err
			for k := lo; k < hi; k++ {
				out[k] = runFailed{err}
			}
			return
		}
		for k := lo; k < hi; k++ {
			out[k] = r[per*(k-lo)+per-1]
		}
	}
	if runs == 1 {
		one(0)
	} else {
		var wg sync.WaitGroup
		for j := 1; j < runs; j++ {
			wg.Go(func() { one(j) })
		}
		one(0)
		wg.Wait()
	}
	for _, err := range errs {
		if err != nil {
			return out, err
		}
	}
	return out, nil
}
