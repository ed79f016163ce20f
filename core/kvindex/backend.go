package kvindex

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
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

// Op is one change of an instance's set of block keys.
type Op struct {
	Kind OpKind
	Keys []kvevents.Key
}

// Backend keeps, per instance, the set of block keys it has cached. Apply
// is called for one instance by one goroutine at a time, in the order of
// its events; Longest may run concurrently with Apply.
type Backend interface {
	// Apply applies ops in order.
	Apply(inst string, ops []Op) error
	// Longest returns, for each instance, how many leading keys of chain
	// it holds (the chain's longest cached prefix, in blocks); chains[i]
	// is instance insts[i]'s chain (instances may differ in block size and
	// hash format).
	Longest(insts []string, chains [][]kvevents.Key) ([]int, error)
	// Generation changes whenever the backend may have lost what it held
	// (a Valkey server restarted): every instance must then be rebuilt.
	Generation() int64
	Close() error
}

// Memory is the in-process Backend.
type Memory struct {
	mu   sync.RWMutex
	sets map[string]map[kvevents.Key]struct{}
}

// NewMemory returns an empty in-memory backend.
func NewMemory() *Memory { return &Memory{sets: map[string]map[kvevents.Key]struct{}{}} }

// Apply implements Backend.
func (m *Memory) Apply(inst string, ops []Op) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.sets[inst]
	if s == nil {
		s = map[kvevents.Key]struct{}{}
		m.sets[inst] = s
	}
	for _, op := range ops {
		switch op.Kind {
		case OpAdd:
			for _, k := range op.Keys {
				s[k] = struct{}{}
			}
		case OpRemove:
			for _, k := range op.Keys {
				delete(s, k)
			}
		case OpClear:
			clear(s)
		}
	}
	return nil
}

// Longest implements Backend.
func (m *Memory) Longest(insts []string, chains [][]kvevents.Key) ([]int, error) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	out := make([]int, len(insts))
	for i, inst := range insts {
		s := m.sets[inst]
		n := 0
		for _, k := range chains[i] {
			if _, ok := s[k]; !ok {
				break
			}
			n++
		}
		out[i] = n
	}
	return out, nil
}

// Len returns how many keys an instance holds.
func (m *Memory) Len(inst string) int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.sets[inst])
}

// Generation implements Backend: memory is never lost.
func (m *Memory) Generation() int64 { return 0 }

// Close implements Backend.
func (m *Memory) Close() error { return nil }

// Valkey is the Backend on a Valkey or Redis server (6.2 or later:
// SMISMEMBER): each instance's blocks are one set, <prefix>:inst:<name>,
// of 16-byte members. A query is one pipelined round trip (SMISMEMBER per
// instance); a batch of events one more.
type Valkey struct {
	c      *resp.Client
	prefix string

	mu    sync.Mutex
	gen   int64
	runID string
}

// NewValkey connects to a server at addr (host:port) and checks it.
// Keys live under prefix (e.g. "kvindex").
func NewValkey(addr, prefix string, timeout time.Duration) (*Valkey, error) {
	v := &Valkey{c: resp.NewClient(addr, timeout), prefix: prefix}
	if err := v.Ping(); err != nil {
		v.c.Close()
		return nil, err
	}
	return v, nil
}

func (v *Valkey) key(inst string) []byte { return []byte(v.prefix + ":inst:" + inst) }

// Ping checks the server and notes its run id: a new id is a restarted
// server, which may have lost every set (Generation).
func (v *Valkey) Ping() error {
	r, err := v.c.Do([][][]byte{{[]byte("INFO"), []byte("server")}})
	if err != nil {
		return err
	}
	if e, ok := r[0].(resp.Error); ok {
		return e
	}
	info, _ := r[0].([]byte)
	id := ""
	for _, line := range splitLines(info) {
		if len(line) > 7 && line[:7] == "run_id:" {
			id = line[7:]
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

// Apply implements Backend: one pipeline per call.
func (v *Valkey) Apply(inst string, ops []Op) error {
	key := v.key(inst)
	var cmds [][][]byte
	for _, op := range ops {
		switch op.Kind {
		case OpClear:
			cmds = append(cmds, [][]byte{[]byte("DEL"), key})
		case OpAdd, OpRemove:
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
		if e, ok := x.(resp.Error); ok {
			return e
		}
	}
	return nil
}

// Longest implements Backend.
func (v *Valkey) Longest(insts []string, chains [][]kvevents.Key) ([]int, error) {
	out := make([]int, len(insts))
	var cmds [][][]byte
	var which []int
	for i, inst := range insts {
		if len(chains[i]) == 0 {
			continue
		}
		args := make([][]byte, 0, 2+len(chains[i]))
		args = append(args, []byte("SMISMEMBER"), v.key(inst))
		for j := range chains[i] {
			args = append(args, chains[i][j][:])
		}
		cmds = append(cmds, args)
		which = append(which, i)
	}
	if len(cmds) == 0 {
		return out, nil
	}
	r, err := v.c.Do(cmds)
	if err != nil {
		return nil, err
	}
	for j, x := range r {
		arr, ok := x.([]any)
		if !ok {
			if e, isErr := x.(resp.Error); isErr {
				return nil, e
			}
			return nil, fmt.Errorf("redis: SMISMEMBER replied %T", x)
		}
		n := 0
		for _, m := range arr {
			if b, _ := m.(int64); b != 1 {
				break
			}
			n++
		}
		out[which[j]] = n
	}
	return out, nil
}

// Generation implements Backend.
func (v *Valkey) Generation() int64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.gen
}

// Len returns how many keys an instance holds (SCARD).
func (v *Valkey) Len(inst string) (int, error) {
	r, err := v.c.Do([][][]byte{{[]byte("SCARD"), v.key(inst)}})
	if err != nil {
		return 0, err
	}
	n, ok := r[0].(int64)
	if !ok {
		return 0, fmt.Errorf("redis: SCARD replied %v", r[0])
	}
	return int(n), nil
}

// Close implements Backend.
func (v *Valkey) Close() error {
	v.c.Close()
	return nil
}
