package resp

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"sync"
	"testing"
	"time"
)

func getCall(keys []string) *Call {
	call := &Call{}
	for _, k := range keys {
		call.Cmds = append(call.Cmds, [][]byte{AppendCommand(nil, []byte("GET"), []byte(k))})
		call.Keys = append(call.Keys, []byte(k))
	}
	return call
}

// A call with Conns splits its commands into contiguous runs, one a
// connection, each in its window, read concurrently through Bulk; the
// connections are made once and kept; a small call stays on one.
func TestCallConns(t *testing.T) {
	s := newWindowServer(t)
	c := NewCluster(s.ln.Addr().String(), ClusterOptions{Options: Options{DialTimeout: time.Second, OpTimeout: 10 * time.Second}})
	defer c.Close()
	for _, tc := range []struct{ n, conns, splitMin, want int }{
		{23, 4, 5, 4},  // 4 runs of 5 or 6
		{23, 8, 5, 4},  // SplitMin bounds the runs
		{9, 4, 5, 1},   // too small to split
		{12, 0, 1, 1},  // Conns 0: one
		{3, 8, 1, 3},   // a run a command
		{40, 3, 10, 3}, // Conns bounds the runs
	} {
		keys := make([]string, tc.n)
		for i := range keys {
			keys[i] = fmt.Sprintf("k%d", i)
		}
		call := getCall(keys)
		call.Window, call.Conns, call.SplitMin = 2, tc.conns, tc.splitMin
		var mu sync.Mutex
		read := map[int]bool{}
		call.Bulk = func(i, n int, r *bufio.Reader) (any, error) {
			b := make([]byte, n)
			if _, err := io.ReadFull(r, b); err != nil {
				return nil, err
			}
			mu.Lock()
			read[i] = true
			mu.Unlock()
			return fmt.Sprintf("bulk %d %s", i, b), nil
		}
		s.mu.Lock()
		first := len(s.gets)
		s.mu.Unlock()
		out, err := c.Call(call)
		if err != nil {
			t.Fatal(err)
		}
		for i, x := range out {
			if want := fmt.Sprintf("bulk %d v:k%d", i, i); x != want || !read[i] {
				t.Fatalf("%+v: reply %d %#v, want %q", tc, i, x, want)
			}
		}
		// The connections used, in the order they were made, and each
		// one's GETs: the runs, contiguous, of this call.
		s.mu.Lock()
		var runs [][]string
		for _, g := range s.gets {
			if len(g) > 0 && slices.Contains(keys, g[0]) {
				runs = append(runs, g)
			}
		}
		for i := range s.gets {
			s.gets[i] = nil
		}
		made := len(s.gets) - first
		s.mu.Unlock()
		if len(runs) != tc.want {
			t.Fatalf("%+v: %d runs %v, want %d", tc, len(runs), runs, tc.want)
		}
		slices.SortFunc(runs, func(a, b []string) int { return slices.Index(keys, a[0]) - slices.Index(keys, b[0]) })
		if got := slices.Concat(runs...); !slices.Equal(got, keys) {
			t.Fatalf("%+v: runs %v", tc, runs)
		}
		for _, r := range runs {
			if len(r) < min(tc.splitMin, tc.n) {
				t.Fatalf("%+v: a run of %d commands", tc, len(r))
			}
		}
		if made > 0 && c.DialCount() != int64(len(s.gets)) {
			t.Fatalf("dialled %d, server accepted %d", c.DialCount(), len(s.gets))
		}
	}
	if c.DialCount() != 4 {
		t.Fatalf("%d connections made, want 4 (made once, kept)", c.DialCount())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.maxOpen > 2 {
		t.Fatalf("at most %d commands unanswered on a connection, window 2", s.maxOpen)
	}
}

// A connection that stops answering fails the call (standalone) at the
// deadline, the whole call's; the other connections' runs are read to
// their end through Bulk, as is its own run up to the command it hangs on.
func TestCallConnsOneFails(t *testing.T) {
	s := newWindowServer(t)
	c := NewCluster(s.ln.Addr().String(), ClusterOptions{Options: Options{DialTimeout: time.Second, OpTimeout: 400 * time.Millisecond}})
	defer c.Close()
	keys := []string{"k0", "k1", "k2", "k3", "hang4", "k5", "k6", "k7", "k8"}
	call := getCall(keys)
	call.Window, call.Conns, call.SplitMin = 2, 3, 1
	var mu sync.Mutex
	var read []int
	call.Bulk = func(i, n int, r *bufio.Reader) (any, error) {
		if _, err := r.Discard(n); err != nil {
			return nil, err
		}
		mu.Lock()
		read = append(read, i)
		mu.Unlock()
		return nil, nil
	}
	start := time.Now()
	out, err := c.Call(call)
	if !IsTimeout(err) || out != nil {
		t.Fatalf("%v, %v", out, err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("the call took %v, its timeout 400 ms", d)
	}
	slices.Sort(read)
	if !slices.Equal(read, []int{0, 1, 2, 3, 6, 7, 8}) {
		t.Fatalf("read %v", read)
	}
}
