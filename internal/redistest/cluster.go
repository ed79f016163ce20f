package redistest

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/resp"
)

// Cluster is a throwaway cluster of servers in cluster mode on loopback:
// primaries serving the slots in equal ranges, and replicas.
type Cluster struct {
	Bin       string
	Primaries []*Server
	Replicas  []*Server // Replicas[i] replicates Primaries[i]; nil where none
	args      []string
	ids       map[*Server]string
	bus       map[*Server]int // cluster bus ports
}

// StartCluster starts a cluster of primaries (each serving an equal range
// of the slots) and, for the first replicas of them, one replica each, and
// waits until every node reports the cluster ok. Extra arguments go to
// every server. Failure detection is fast (cluster-node-timeout 500 ms).
func StartCluster(t testing.TB, bin string, primaries, replicas int, args ...string) *Cluster {
	t.Helper()
	c := &Cluster{Bin: bin, args: args, ids: map[*Server]string{}, bus: map[*Server]int{}}
	for range primaries {
		c.Primaries = append(c.Primaries, c.startNode(t))
	}
	for i := range primaries {
		lo, hi := i*resp.NumSlots/primaries, (i+1)*resp.NumSlots/primaries-1
		Cmd(t, c.Primaries[i].Addr(), "CLUSTER", "ADDSLOTSRANGE", fmt.Sprint(lo), fmt.Sprint(hi))
	}
	for _, s := range c.Primaries[1:] {
		c.meet(t, s)
	}
	c.Replicas = make([]*Server, primaries)
	for i := range min(replicas, primaries) {
		r := c.startNode(t)
		c.meet(t, r)
		c.Replicas[i] = r
	}
	c.WaitOK(t)
	for i, r := range c.Replicas {
		if r == nil {
			continue
		}
		id := c.ID(t, c.Primaries[i])
		deadline := time.Now().Add(10 * time.Second)
		for {
			// The replica must have learnt of its primary by gossip first.
			if _, err := do(r.Addr(), "CLUSTER", "REPLICATE", id); err == nil {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("CLUSTER REPLICATE on %s: %v", r.Addr(), err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for i, r := range c.Replicas {
		if r != nil {
			c.waitSynced(t, r, c.Primaries[i])
		}
	}
	return c
}

func (c *Cluster) startNode(t testing.TB) *Server {
	t.Helper()
	var bus int
	s := launch(t, c.Bin, 0, func(port int) []string {
		bus = FreePort(t) // drawn again with the node's port when a start is retried
		argv := append(plainArgs(t, port), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "500", "--cluster-port", fmt.Sprint(bus),
			"--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0")
		return append(argv, c.args...)
	}, ping, "")
	c.bus[s] = bus
	return s
}

func (c *Cluster) meet(t testing.TB, s *Server) {
	t.Helper()
	p := c.Primaries[0]
	Cmd(t, s.Addr(), "CLUSTER", "MEET", "127.0.0.1", fmt.Sprint(p.Port), fmt.Sprint(c.bus[p]))
}

// Seed is the first primary's address.
func (c *Cluster) Seed() string { return c.Primaries[0].Addr() }

// ID returns a node's cluster id.
func (c *Cluster) ID(t testing.TB, s *Server) string {
	t.Helper()
	if id, ok := c.ids[s]; ok {
		return id
	}
	id := string(Cmd(t, s.Addr(), "CLUSTER", "MYID").([]byte))
	c.ids[s] = id
	return id
}

// Live returns the nodes not stopped.
func (c *Cluster) Live() []*Server {
	var out []*Server
	for _, s := range append(append([]*Server{}, c.Primaries...), c.Replicas...) {
		if s != nil && s.Running() {
			out = append(out, s)
		}
	}
	return out
}

// WaitOK waits until every live node reports cluster_state:ok and knows
// the owner of every slot the same way.
func (c *Cluster) WaitOK(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok, why := c.consistent()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cluster did not settle: %s", why)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

func (c *Cluster) consistent() (bool, string) {
	var first string
	for _, s := range c.Live() {
		info, err := do(s.Addr(), "CLUSTER", "INFO")
		if err != nil {
			return false, err.Error()
		}
		if b, _ := info.([]byte); !strings.Contains(string(b), "cluster_state:ok") {
			return false, s.Addr() + ": " + string(b)
		}
		slots, err := do(s.Addr(), "CLUSTER", "SLOTS")
		if err != nil {
			return false, err.Error()
		}
		text := fmt.Sprint(primariesOf(slots))
		if first == "" {
			first = text
		} else if text != first {
			return false, "nodes disagree on the slots: " + first + " / " + text
		}
	}
	return true, ""
}

// primariesOf keeps each range and its primary's port of CLUSTER SLOTS.
func primariesOf(x any) []string {
	var out []string
	rs, _ := x.([]any)
	for _, r := range rs {
		a, _ := r.([]any)
		if len(a) < 3 {
			continue
		}
		p, _ := a[2].([]any)
		if len(p) < 2 {
			continue
		}
		out = append(out, fmt.Sprint(a[0], "-", a[1], "@", p[1]))
	}
	return out
}

func (c *Cluster) waitSynced(t testing.TB, r, p *Server) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		info, err := do(r.Addr(), "INFO", "replication")
		if b, _ := info.([]byte); err == nil && strings.Contains(string(b), "master_link_status:up") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %s did not sync with %s: %v %s", r.Addr(), p.Addr(), err, info)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// Owner returns the primary among c.Primaries (and promoted replicas)
// that serves slot, as the seed (or the first live node) says.
func (c *Cluster) Owner(t testing.TB, slot int) *Server {
	t.Helper()
	live := c.Live()
	x := Cmd(t, live[0].Addr(), "CLUSTER", "SLOTS")
	for _, r := range x.([]any) {
		a := r.([]any)
		if lo, hi := a[0].(int64), a[1].(int64); int64(slot) >= lo && int64(slot) <= hi {
			port := a[2].([]any)[1].(int64)
			for _, s := range live {
				if int64(s.Port) == port {
					return s
				}
			}
		}
	}
	t.Fatalf("no owner of slot %d", slot)
	return nil
}

// BeginMigration marks slot as migrating from src to dst (IMPORTING on
// dst, MIGRATING on src): a client then meets ASK for keys moved.
func (c *Cluster) BeginMigration(t testing.TB, slot int, src, dst *Server) {
	t.Helper()
	Cmd(t, dst.Addr(), "CLUSTER", "SETSLOT", fmt.Sprint(slot), "IMPORTING", c.ID(t, src))
	Cmd(t, src.Addr(), "CLUSTER", "SETSLOT", fmt.Sprint(slot), "MIGRATING", c.ID(t, dst))
}

// MoveKeys migrates up to n of slot's keys from src to dst (MIGRATE) and
// returns how many it moved.
func (c *Cluster) MoveKeys(t testing.TB, slot int, src, dst *Server, n int) int {
	t.Helper()
	keys, _ := Cmd(t, src.Addr(), "CLUSTER", "GETKEYSINSLOT", fmt.Sprint(slot), fmt.Sprint(n)).([]any)
	if len(keys) == 0 {
		return 0
	}
	args := []string{"MIGRATE", "127.0.0.1", fmt.Sprint(dst.Port), "", "0", "5000", "KEYS"}
	for _, k := range keys {
		args = append(args, string(k.([]byte)))
	}
	Cmd(t, src.Addr(), args...)
	return len(keys)
}

// FinishMigration assigns slot to dst on every live node.
func (c *Cluster) FinishMigration(t testing.TB, slot int, dst *Server) {
	t.Helper()
	id := c.ID(t, dst)
	Cmd(t, dst.Addr(), "CLUSTER", "SETSLOT", fmt.Sprint(slot), "NODE", id)
	for _, s := range c.Live() {
		if s != dst {
			// A replica refuses SETSLOT; gossip tells it.
			_, _ = do(s.Addr(), "CLUSTER", "SETSLOT", fmt.Sprint(slot), "NODE", id)
		}
	}
}

// MigrateSlot moves slot and all its keys from src to dst.
func (c *Cluster) MigrateSlot(t testing.TB, slot int, src, dst *Server) {
	t.Helper()
	c.BeginMigration(t, slot, src, dst)
	for c.MoveKeys(t, slot, src, dst, 100) > 0 {
	}
	c.FinishMigration(t, slot, dst)
}

// AddPrimary starts a node, makes it meet the cluster (it serves no slot
// yet) and waits until the cluster is ok.
func (c *Cluster) AddPrimary(t testing.TB) *Server {
	t.Helper()
	s := c.startNode(t)
	c.meet(t, s)
	c.Primaries = append(c.Primaries, s)
	c.Replicas = append(c.Replicas, nil)
	deadline := time.Now().Add(10 * time.Second)
	for {
		x := Cmd(t, c.Seed(), "CLUSTER", "NODES")
		if strings.Contains(string(x.([]byte)), c.ID(t, s)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s not known to the seed", s.Addr())
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.WaitOK(t)
	return s
}

// Promote kills nothing: it makes replica take its primary's slots over
// at once (CLUSTER FAILOVER TAKEOVER), as an automatic failover would
// after the primary's loss, and waits for the cluster to agree.
func (c *Cluster) Promote(t testing.TB, replica *Server) {
	t.Helper()
	Cmd(t, replica.Addr(), "CLUSTER", "FAILOVER", "TAKEOVER")
	for i, r := range c.Replicas {
		if r == replica {
			c.Primaries[i], c.Replicas[i] = replica, nil
		}
	}
	c.WaitOK(t)
}

// Cmd runs one command on addr and fails t on a transport error or an
// error reply.
func Cmd(t testing.TB, addr string, args ...string) any {
	t.Helper()
	r, err := do(addr, args...)
	if err != nil {
		t.Fatalf("%s on %s: %v", strings.Join(args[:min(2, len(args))], " "), addr, err)
	}
	return r
}

func do(addr string, args ...string) (any, error) {
	c := resp.NewClient(addr, 5*time.Second)
	defer c.Close()
	cmd := make([][]byte, len(args))
	for i, a := range args {
		cmd[i] = []byte(a)
	}
	r, err := c.Do([][][]byte{cmd})
	if err != nil {
		return nil, err
	}
	if e, ok := r[0].(resp.Error); ok {
		return nil, e
	}
	return r[0], nil
}
