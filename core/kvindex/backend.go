package kvindex

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvtier/valkey"
	"github.com/kvplug/kvplug/core/prefix"
	"github.com/kvplug/kvplug/internal/resp"
)

// OpKind is what an Op does to an instance's set of cached blocks.
type OpKind uint8

// The operations of a batch of events.
const (
	OpAdd OpKind = iota + 1
	OpRemove
	OpClear
)

// Op is one change of an instance's set of block keys on one medium
// (OpClear: on every medium).
type Op struct {
	Kind   OpKind
	Medium prefix.Medium // the zero value is the GPU
	Keys   []kvevents.Key
}

// Held is what an instance holds of a prompt's chain, in blocks from the
// chain's start: its longest prefix on the GPU, then the blocks that
// follow it, each one held by the CPU tier, then the blocks that follow
// those, each one held by the shared tier. It is what the engine would
// use: the GPU's cached prefix, extended by the host tier's blocks it
// reloads (a block both tiers hold counts on the GPU), as kvplug's
// manager admits (MatchTiers) and vLLM's offloading does.
type Held struct {
	GPU, CPU, Shared int
}

// Total is the blocks held on every medium.
func (h Held) Total() int { return h.GPU + h.CPU + h.Shared }

// held counts a chain's Held from a per-key membership test.
func held(chain []kvevents.Key, has func(j int, m prefix.Medium) bool) Held {
	var h Held
	j := 0
	for j < len(chain) && has(j, prefix.MediumGPU) {
		j++
	}
	h.GPU = j
	for j < len(chain) && has(j, prefix.MediumCPU) {
		j++
	}
	h.CPU = j - h.GPU
	for j < len(chain) && has(j, prefix.MediumShared) {
		j++
	}
	h.Shared = j - h.GPU - h.CPU
	return h
}

// Backend keeps, per instance and medium, the set of block keys it has
// cached. Apply is called for one instance by one goroutine at a time, in
// the order of its events; Match may run concurrently with Apply.
type Backend interface {
	// Apply applies ops in order.
	Apply(inst string, ops []Op) error
	// Match returns, for each instance, what it holds of its chain (see
	// Held); chains[i] is instance insts[i]'s chain (instances may differ
	// in block size and hash format).
	Match(insts []string, chains [][]kvevents.Key) ([]Held, error)
	// Generation changes whenever the backend may have lost what it held
	// (a Valkey server restarted): every instance must then be rebuilt.
	Generation() int64
	Close() error
}

// Memory is the in-process Backend: per instance, each key's media as a
// bit set (bit m for prefix.Medium m).
type Memory struct {
	mu   sync.RWMutex
	sets map[string]map[kvevents.Key]uint8
	lens map[string]*[prefix.NumMedia]int // keys per instance and medium
}

// NewMemory returns an empty in-memory backend.
func NewMemory() *Memory {
	return &Memory{sets: map[string]map[kvevents.Key]uint8{}, lens: map[string]*[prefix.NumMedia]int{}}
}

// Apply implements Backend. An op of a medium beyond prefix.NumMedia is
// ignored.
func (m *Memory) Apply(inst string, ops []Op) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, n := m.sets[inst], m.lens[inst]
	if s == nil {
		s, n = map[kvevents.Key]uint8{}, new([prefix.NumMedia]int)
		m.sets[inst], m.lens[inst] = s, n
	}
	for _, op := range ops {
		if op.Kind != OpClear && int(op.Medium) >= prefix.NumMedia {
			continue
		}
		bit := uint8(1) << op.Medium
		switch op.Kind {
		case OpAdd:
			for _, k := range op.Keys {
				if v := s[k]; v&bit == 0 {
					s[k] = v | bit
					n[op.Medium]++
				}
			}
		case OpRemove:
			for _, k := range op.Keys {
				if v, ok := s[k]; ok && v&bit != 0 {
					n[op.Medium]--
					if v &^= bit; v == 0 {
						delete(s, k)
					} else {
						s[k] = v
					}
				}
			}
		case OpClear:
			clear(s)
			*n = [prefix.NumMedia]int{}
		}
	}
	return nil
}

// Match implements Backend.
func (m *Memory) Match(insts []string, chains [][]kvevents.Key) ([]Held, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([]Held, len(insts))
	for i, inst := range insts {
		s, chain := m.sets[inst], chains[i]
		out[i] = held(chain, func(j int, md prefix.Medium) bool { return s[chain[j]]&(1<<md) != 0 })
	}
	return out, nil
}

// Len returns how many keys an instance holds on the GPU.
func (m *Memory) Len(inst string) int { return m.LenIn(inst, prefix.MediumGPU) }

// LenIn returns how many keys an instance holds on medium md.
func (m *Memory) LenIn(inst string, md prefix.Medium) int {
	if int(md) >= prefix.NumMedia {
		return 0
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if n := m.lens[inst]; n != nil {
		return n[md]
	}
	return 0
}

// Sizes implements Sizer.
func (m *Memory) Sizes(insts []string) ([][prefix.NumMedia]int, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([][prefix.NumMedia]int, len(insts))
	for i, inst := range insts {
		if n := m.lens[inst]; n != nil {
			out[i] = *n
		}
	}
	return out, nil
}

// Generation implements Backend: memory is never lost.
func (m *Memory) Generation() int64 { return 0 }

// Close implements Backend.
func (m *Memory) Close() error { return nil }

// Valkey is the Backend on a Valkey or Redis server (6.2 or later:
// SMISMEMBER): each instance's blocks on each medium are one set of
// 16-byte members, <prefix>:inst:<name> for the GPU's (the only set
// before media were kept), <prefix>:inst-cpu:<name> and
// <prefix>:inst-shared:<name> for the others. A query is one pipelined
// round trip (SMISMEMBER per instance and medium); a batch of events one
// more.
//
// On a server in cluster mode (found at NewValkey: CLUSTER SHARDS or
// SLOTS, as the shared tier's client does) the instance's name in its
// sets' keys is a hash tag, <prefix>:inst:{<name>}, so that an instance's
// sets live in one slot (DEL of all three is one command) while the
// instances spread over the primaries; each command goes to its slot's
// primary (MOVED and ASK followed), and the generation changes whenever
// the primaries or any one's run id do (a failover, a restart, a node
// added), so that every instance is rebuilt on the new primaries.
type Valkey struct {
	c       *resp.Cluster
	prefix  string
	cluster bool

	mu    sync.Mutex
	gen   int64
	runID string
}

// NewValkey connects to a server at addr (host:port) and checks it.
// Keys live under prefix (e.g. "kvindex").
func NewValkey(addr, prefix string, timeout time.Duration) (*Valkey, error) {
	return NewValkeySecure(addr, prefix, timeout, ValkeySecurity{})
}

// ValkeySecurity is how the backend authenticates to its server and
// encrypts the connection, as the shared KV tier does (valkey.ConnOptions):
// AUTH as Username ("" for the default user) with Password (zero: no
// AUTH), TLS when not nil. Secrets come from an environment variable or a
// file, never from the command line.
type ValkeySecurity struct {
	Username string
	Password valkey.Secret
	TLS      *valkey.TLS
}

// NewValkeySecure is NewValkey with AUTH and TLS. A refused AUTH or a
// failed TLS handshake fails it, naming which, never with the password.
func NewValkeySecure(addr, prefix string, timeout time.Duration, sec ValkeySecurity) (*Valkey, error) {
	if sec.Username != "" && sec.Password.IsZero() {
		return nil, kverr.Errorf(kverr.InvalidArgument, "kvindex: a Valkey username needs a password")
	}
	opts, err := valkey.ConnOptions(addr, sec.Username, sec.Password, sec.TLS, timeout, timeout)
	if err != nil {
		return nil, err
	}
	v := &Valkey{c: resp.NewCluster(addr, resp.ClusterOptions{
		Options:         opts,
		FixedServerName: sec.TLS != nil && sec.TLS.ServerName != "",
		NodeBackoff:     50 * time.Millisecond, MaxNodeBackoff: time.Second,
	}), prefix: prefix}
	if err := v.Ping(); err != nil {
		v.c.Close()
		return nil, err
	}
	v.cluster = v.c.IsCluster()
	return v, nil
}

// setNames are the media's set name parts, by medium.
var setNames = [prefix.NumMedia]string{":inst:", ":inst-cpu:", ":inst-shared:"}

// keyIn is the set of an instance's blocks on medium md.
func (v *Valkey) keyIn(inst string, md prefix.Medium) []byte {
	if v.cluster {
		return []byte(v.prefix + setNames[md] + "{" + inst + "}")
	}
	return []byte(v.prefix + setNames[md] + inst)
}

// Ping checks the server and notes its run id: a new id is a restarted
// server, which may have lost every set (Generation). In cluster mode the
// id is every primary's address and run id: a failover, a restart or a
// node added changes it.
func (v *Valkey) Ping() error {
	info := [][][]byte{{[]byte("INFO"), []byte("server")}}
	r, err := v.c.Do(info)
	if err != nil {
		return err
	}
	id, err := runID(r[0])
	if err != nil {
		return err
	}
	if prim := v.c.Primaries(); len(prim) > 0 {
		id = ""
		for _, addr := range prim {
			r, err := v.c.DoNode(addr, info)
			if err != nil {
				return err
			}
			one, err := runID(r[0])
			if err != nil {
				return err
			}
			id += addr + "=" + one + " "
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if id != v.runID {
		if v.runID != "" {
			v.gen++
		}
		v.runID = id
	}
	return nil
}

// runID reads the run id from INFO's reply.
func runID(x any) (string, error) {
	if e, ok := x.(error); ok {
		return "", e
	}
	info, _ := x.([]byte)
	id := ""
	for _, line := range splitLines(info) {
		if len(line) > 7 && line[:7] == "run_id:" {
			id = line[7:]
		}
	}
	return id, nil
}

func splitLines(b []byte) []string {
	var out []string
	start := 0
	for i, c := range b {
		if c == '\n' {
			l := b[start:i]
			if len(l) > 0 && l[len(l)-1] == '\r' {
				l = l[:len(l)-1]
			}
			out = append(out, string(l))
			start = i + 1
		}
	}
	return out
}

// maxArgs bounds the members of one SADD/SREM, so a large batch becomes
// several commands of one pipeline.
const maxArgs = 4096

// Apply implements Backend: one pipeline per call. An op of a medium
// beyond prefix.NumMedia is ignored.
func (v *Valkey) Apply(inst string, ops []Op) error {
	var cmds [][][]byte
	for _, op := range ops {
		if op.Kind != OpClear && int(op.Medium) >= prefix.NumMedia {
			continue
		}
		switch op.Kind {
		case OpClear:
			del := [][]byte{[]byte("DEL")}
			for md := range prefix.Medium(prefix.NumMedia) {
				del = append(del, v.keyIn(inst, md))
			}
			cmds = append(cmds, del)
		case OpAdd, OpRemove:
			key := v.keyIn(inst, op.Medium)
			name := []byte("SADD")
			if op.Kind == OpRemove {
				name = []byte("SREM")
			}
			for ks := op.Keys; len(ks) > 0; {
				n := min(len(ks), maxArgs)
				args := make([][]byte, 0, 2+n)
				args = append(args, name, key)
				for i := range ks[:n] {
					args = append(args, ks[i][:])
				}
				cmds = append(cmds, args)
				ks = ks[n:]
			}
		}
	}
	if len(cmds) == 0 {
		return nil
	}
	dials := v.c.DialCount()
	r, err := v.c.Do(cmds)
	if err == nil && v.c.DialCount() != dials {
		// A new connection: check whether the server is a new one.
		err = v.Ping()
	}
	if err != nil {
		return err
	}
	for _, x := range r {
		if e, ok := x.(error); ok {
			return e // an error reply, or a cluster node's failure
		}
	}
	return nil
}

// smismember is SMISMEMBER's name, shared by Match's commands.
var smismember = []byte("SMISMEMBER")

// Match implements Backend: one SMISMEMBER per instance and medium, in
// one pipeline.
func (v *Valkey) Match(insts []string, chains [][]kvevents.Key) ([]Held, error) {
	out := make([]Held, len(insts))
	var cmds [][][]byte
	var which []int
	for i, inst := range insts {
		if len(chains[i]) == 0 {
			continue
		}
		// Every medium asks after the same members: the first medium's
		// command lists them, the others copy its list, all in one backing
		// array (Do only reads the commands).
		n := 2 + len(chains[i])
		buf := make([][]byte, 0, prefix.NumMedia*n)
		buf = append(buf, smismember, v.keyIn(inst, prefix.MediumGPU))
		for j := range chains[i] {
			buf = append(buf, chains[i][j][:])
		}
		for md := prefix.Medium(1); md < prefix.NumMedia; md++ {
			buf = append(buf, smismember, v.keyIn(inst, md))
			buf = append(buf, buf[2:n]...)
		}
		for md := range prefix.NumMedia {
			cmds = append(cmds, buf[md*n:(md+1)*n:(md+1)*n])
		}
		which = append(which, i)
	}
	if len(cmds) == 0 {
		return out, nil
	}
	r, err := v.c.Do(cmds)
	if err != nil {
		return nil, err
	}
	var member [prefix.NumMedia][]any
	for k, i := range which {
		for md := range member {
			x := r[k*prefix.NumMedia+md]
			arr, ok := x.([]any)
			if !ok {
				if e, isErr := x.(error); isErr {
					return nil, e
				}
				return nil, fmt.Errorf("redis: SMISMEMBER replied %T", x)
			}
			if len(arr) != len(chains[i]) {
				return nil, fmt.Errorf("redis: SMISMEMBER replied %d flags for %d members", len(arr), len(chains[i]))
			}
			member[md] = arr
		}
		out[i] = held(chains[i], func(j int, md prefix.Medium) bool {
			b, _ := member[md][j].(int64)
			return b == 1
		})
	}
	return out, nil
}

// Generation implements Backend.
func (v *Valkey) Generation() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.gen
}

// Len returns how many keys an instance holds on the GPU (SCARD).
func (v *Valkey) Len(inst string) (int, error) { return v.LenIn(inst, prefix.MediumGPU) }

// LenIn returns how many keys an instance holds on medium md (SCARD).
func (v *Valkey) LenIn(inst string, md prefix.Medium) (int, error) {
	r, err := v.c.Do([][][]byte{{[]byte("SCARD"), v.keyIn(inst, md)}})
	if err != nil {
		return 0, err
	}
	n, ok := r[0].(int64)
	if !ok {
		return 0, fmt.Errorf("redis: SCARD replied %v", r[0])
	}
	return int(n), nil
}

// Sizes implements Sizer: one SCARD per instance and medium, in one
// pipeline.
func (v *Valkey) Sizes(insts []string) ([][prefix.NumMedia]int, error) {
	out := make([][prefix.NumMedia]int, len(insts))
	if len(insts) == 0 {
		return out, nil
	}
	cmds := make([][][]byte, 0, len(insts)*prefix.NumMedia)
	for _, inst := range insts {
		for md := range prefix.Medium(prefix.NumMedia) {
			cmds = append(cmds, [][]byte{[]byte("SCARD"), v.keyIn(inst, md)})
		}
	}
	r, err := v.c.Do(cmds)
	if err != nil {
		return nil, err
	}
	for i := range insts {
		for md := range prefix.NumMedia {
			n, ok := r[i*prefix.NumMedia+md].(int64)
			if !ok {
				return nil, fmt.Errorf("redis: SCARD replied %v", r[i*prefix.NumMedia+md])
			}
			out[i][md] = int(n)
		}
	}
	return out, nil
}

// Close implements Backend.
func (v *Valkey) Close() error {
	v.c.Close()
	return nil
}
