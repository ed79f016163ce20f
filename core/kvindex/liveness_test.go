package kvindex

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
)

// waitState waits (20 s at most) until instance name is in state want.
func waitState(t *testing.T, x *Index, name string, want State) InstanceStatus {
	t.Helper()
	var st InstanceStatus
	waitFor(t, fmt.Sprintf("%s to be %s", name, want), func() bool {
		st = x.Status()[indexOf(x.Status(), name)]
		return st.State == want
	})
	return st
}

// startServed starts two engines of 64 blocks, an index over them and
// the index's HTTP server, closed at the test's end.
func startServed(t *testing.T) ([]*engine, *Index, *httptest.Server) {
	t.Helper()
	es := startEngines(t, 2, 64)
	x := startIndex(t, Config{Instances: instancesOf(es)})
	srv := httptest.NewServer(x.Handler())
	t.Cleanup(srv.Close)
	return es, x, srv
}

// An engine that stops (its publisher closes, as when the process exits)
// is down at once: scored as absent, never best, its blocks cleared; it is
// fresh again when it comes back.
func TestStoppedEngineStopsRouting(t *testing.T) {
	es, x, srv := startServed(t)
	r := rand.New(rand.NewSource(21))
	p := prompt(r, 1, 160)
	es[0].serve(t, p, nil)      // e0 holds all ten blocks
	es[1].serve(t, p[:64], nil) // e1 four
	waitConverged(t, x, es, 10*time.Second)
	if sc, err := x.Query(p, nil); err != nil || Best(sc) != "e0" || sc[0].State != StateFresh {
		t.Fatalf("before the stop: %+v %v", sc, err)
	}
	ports := es[0].ports
	es[0].close()
	st := waitState(t, x, "e0", StateDown)
	if st.Disconnects != 1 || !strings.Contains(st.WaitingFor, es[0].instance().Endpoint) {
		t.Fatalf("status of the stopped engine %+v", st)
	}
	sc, err := x.Query(p, nil)
	if err != nil || Best(sc) != "e1" || sc[0].Tokens != 0 || !sc[0].Stale || sc[0].State != StateDown || sc[1].Tokens != 64 {
		t.Fatalf("after the stop: %+v %v", sc, err)
	}
	if n := len(setOf(t, x.be, "e0")); n != 0 {
		t.Fatalf("the stopped engine still holds %d blocks in the backend", n)
	}
	// Readiness: one fresh instance is enough; liveness does not care.
	rd := getReadiness(t, srv.URL, http.StatusOK)
	if !rd.Ready || rd.Fresh != 1 || rd.Instances[0].State != StateDown || rd.Instances[1].State != StateFresh {
		t.Fatalf("readyz %+v", rd)
	}
	es[1].close()
	waitState(t, x, "e1", StateDown)
	rd = getReadiness(t, srv.URL, http.StatusServiceUnavailable)
	if rd.Ready || rd.Fresh != 0 || len(rd.Instances) != 2 {
		t.Fatalf("readyz with every engine down %+v", rd)
	}
	if code := get(t, srv.URL+"/healthz"); code != http.StatusOK {
		t.Fatalf("healthz %d with every engine down", code)
	}
	if sc, _ := x.Query(p, nil); Best(sc) != "" {
		t.Fatalf("an instance is best with every engine down: %+v", sc)
	}
	// The engine comes back (a new process on the same ports).
	es[0] = newEngine(t, "e0", 64, 16, ports, kvevents.Config{})
	t.Cleanup(es[0].close)
	es[0].serve(t, p, nil)
	waitConverged(t, x, es[:1], 10*time.Second)
	if sc, _ := x.Query(p, nil); Best(sc) != "e0" || sc[0].Tokens != 160 {
		t.Fatalf("after the restart: %+v", sc)
	}
	getReadiness(t, srv.URL, http.StatusOK)
}

// An engine that goes silent without closing its connection (its host
// vanished, or the network between): idle, it answers heartbeats and
// stays fresh (a heartbeat has Timeout, 2 s, to be answered); silent, it
// is down after IdleTimeout, Timeout and a failed replay probe; back, it
// is fresh again.
func TestSilentEngineGoesDown(t *testing.T) {
	e := newEngine(t, "e0", 64, 16, [2]int{0, 0}, kvevents.Config{})
	t.Cleanup(e.close)
	pubProxy := newProxy(t, fmt.Sprintf("127.0.0.1:%d", e.ports[0]))
	repProxy := newProxy(t, fmt.Sprintf("127.0.0.1:%d", e.ports[1]))
	ic := e.instance()
	ic.Endpoint, ic.ReplayEndpoint = "tcp://"+pubProxy.addr, "tcp://"+repProxy.addr
	x := startIndex(t, Config{Instances: []InstanceConfig{ic}, IdleTimeout: time.Second, Timeout: 2 * time.Second})
	r := rand.New(rand.NewSource(22))
	p := prompt(r, 2, 96)
	e.serve(t, p, nil)
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	// Idle: heartbeats are answered and the instance stays fresh.
	waitFor(t, "two answered heartbeats", func() bool { return x.Status()[0].HeartbeatAnswers >= 2 })
	if st := x.Status()[0]; st.State != StateFresh || st.Disconnects != 0 {
		t.Fatalf("an idle engine that answers heartbeats: %+v", st)
	}
	pubProxy.freeze()
	repProxy.freeze()
	st := waitState(t, x, "e0", StateDown)
	if !strings.Contains(st.LastError, "refused") || st.Disconnects != 1 || st.ReplayProbes == 0 {
		t.Fatalf("silent engine %+v", st)
	}
	if sc, _ := x.Query(p, nil); sc[0].Tokens != 0 || Best(sc) != "" {
		t.Fatalf("a silent engine was scored %+v", sc)
	}
	pubProxy.thaw()
	repProxy.thaw()
	waitState(t, x, "e0", StateFresh)
	if sc, _ := x.Query(p, nil); sc[0].Tokens != 96 || Best(sc) != "e0" {
		t.Fatalf("back from silence: %+v", sc)
	}
}

// An instance whose endpoint nothing binds says what it waits for.
func TestUnboundEndpointSaysWhatItWaitsFor(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + ln.Addr().String()
	ln.Close()
	x := startIndex(t, Config{Instances: []InstanceConfig{{Name: "e0", Endpoint: ep}}})
	var st InstanceStatus
	waitFor(t, "a failed connection", func() bool {
		st = x.Status()[0]
		return st.LastError != ""
	})
	if st.State != StateDown || !strings.Contains(st.WaitingFor, "a publisher bound at "+ep) ||
		!strings.Contains(st.WaitingFor, "refused") || !strings.Contains(st.LastError, "the publisher must bind this endpoint") {
		t.Fatalf("status %+v", st)
	}
	for _, bad := range []InstanceConfig{{Name: "a", Endpoint: "bogus://x"}, {Name: "a", Endpoint: "tcp://h:1", ReplayEndpoint: "tcp://h"}} {
		if _, err := New(Config{Instances: []InstanceConfig{bad}}); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

// /metrics: the Prometheus text format, with the counters, states, index
// size and scoring latency of a live index.
func TestMetrics(t *testing.T) {
	es, x, srv := startServed(t)
	r := rand.New(rand.NewSource(23))
	p := prompt(r, 3, 128)
	es[1].serve(t, p, nil)
	waitConverged(t, x, es, 10*time.Second)
	body := fmt.Sprintf(`{"tokens": %s}`, jsonInts(p))
	for range 3 {
		resp, err := http.Post(srv.URL+"/v1/score", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
		t.Fatalf("content type %q", ct)
	}
	m := parseMetrics(t, resp.Body)
	for k, want := range map[string]float64{
		`kvindex_instances{state="fresh"}`:                             2,
		`kvindex_instances{state="down"}`:                              0,
		`kvindex_instance_state{instance="e1",state="fresh"}`:          1,
		`kvindex_index_blocks{instance="e1",medium="gpu"}`:             float64(len(es[1].src.keys())),
		`kvindex_index_blocks{instance="e0",medium="gpu"}`:             0,
		`kvindex_score_duration_seconds_count`:                         3,
		`kvindex_score_duration_seconds_bucket{le="+Inf"}`:             3,
		`kvindex_score_errors_total`:                                   0,
		`kvindex_disconnects_total{instance="e0"}`:                     0,
		`kvindex_resyncs_total{instance="e0"}`:                         float64(x.Status()[0].Resyncs),
		`kvindex_block_updates_total`:                                  float64(x.Updates()),
		`kvindex_backend_up`:                                           1,
		`kvindex_events_total{instance="e1"}`:                          float64(x.Status()[1].Events),
		`kvindex_instance_state{instance="e0",state="down"}`:           0,
		`kvindex_snapshot_requests_total{instance="e1"}`:               float64(x.Status()[1].Snapshots),
		`kvindex_instance_last_heard_timestamp_seconds{instance="e9"}`: -1, // absent
	} {
		got, ok := m[k]
		if want == -1 {
			if ok {
				t.Errorf("%s present", k)
			}
			continue
		}
		if !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", k, got, ok, want)
		}
	}
	if m[`kvindex_events_total{instance="e1"}`] == 0 || m[`kvindex_instance_last_heard_timestamp_seconds{instance="e1"}`] < float64(time.Now().Add(-time.Hour).Unix()) {
		t.Errorf("events or last heard missing: %v", m)
	}
	// The histogram's buckets are cumulative.
	prev := -1.0
	for _, le := range latencyBuckets {
		v := m[fmt.Sprintf(`kvindex_score_duration_seconds_bucket{le="%s"}`, formatFloat(le))]
		if v < prev {
			t.Fatalf("bucket %v: %v after %v", le, v, prev)
		}
		prev = v
	}
	// Label values are escaped.
	var b bytes.Buffer
	x2, _ := New(Config{Instances: []InstanceConfig{{Name: "a\"b\\c\nd", Endpoint: "tcp://127.0.0.1:1"}}, ReadOnly: true})
	if err := x2.WriteMetrics(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), `kvindex_events_total{instance="a\"b\\c\nd"} 0`) {
		t.Fatalf("label not escaped:\n%s", b.String())
	}
	parseMetrics(t, &b)
}

var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^{}]*\})? (\S+)$`)

// parseMetrics checks the text exposition format (every sample's family
// declared by HELP and TYPE before it, no family twice) and returns the
// samples by name and labels.
func parseMetrics(t *testing.T, r io.Reader) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	typed := map[string]string{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "# TYPE ") {
			f := strings.Fields(line)
			if len(f) != 4 || typed[f[2]] != "" {
				t.Fatalf("bad or repeated TYPE line %q", line)
			}
			typed[f[2]] = f[3]
			continue
		}
		if strings.HasPrefix(line, "# HELP ") {
			continue
		}
		mm := sampleLine.FindStringSubmatch(line)
		if mm == nil {
			t.Fatalf("not a sample line: %q", line)
		}
		fam := mm[1]
		if typed[fam] == "" {
			fam = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(fam, "_bucket"), "_sum"), "_count")
		}
		if typed[fam] == "" {
			t.Fatalf("sample %q before its TYPE", line)
		}
		v, err := strconv.ParseFloat(mm[3], 64)
		if err != nil {
			t.Fatalf("value of %q: %v", line, err)
		}
		out[mm[1]+mm[2]] = v
	}
	return out
}

func get(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func getReadiness(t *testing.T, base string, code int) Readiness {
	t.Helper()
	resp, err := http.Get(base + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rd Readiness
	if err := json.NewDecoder(resp.Body).Decode(&rd); err != nil || resp.StatusCode != code {
		t.Fatalf("readyz: status %d (want %d), %v", resp.StatusCode, code, err)
	}
	return rd
}

// proxy forwards TCP connections to a target; frozen, it forwards nothing
// and refuses new connections, as a host that vanished does (without
// closing what was open).
type proxy struct {
	t      *testing.T
	target string
	addr   string
	mu     sync.Mutex
	cond   *sync.Cond
	ln     net.Listener
	frozen bool
	conns  []net.Conn
}

func newProxy(t *testing.T, target string) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{t: t, target: target, addr: ln.Addr().String(), ln: ln}
	p.cond = sync.NewCond(&p.mu)
	go p.accept(ln)
	t.Cleanup(p.close)
	return p
}

func (p *proxy) accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, u)
		p.mu.Unlock()
		go p.pipe(u, c)
		go p.pipe(c, u)
	}
}

// pipe copies src to dst, holding what it read while frozen.
func (p *proxy) pipe(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		for p.frozen {
			p.cond.Wait()
		}
		p.mu.Unlock()
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *proxy) freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = true
	p.ln.Close()
}

func (p *proxy) thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Errorf("proxy: listening again on %s: %v", p.addr, err)
		return
	}
	p.ln, p.frozen = ln, false
	p.cond.Broadcast()
	go p.accept(ln)
}

func (p *proxy) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen = false
	p.cond.Broadcast()
	p.ln.Close()
	for _, c := range p.conns {
		c.Close()
	}
}

// flakyBackend fails every Apply while failing is set.
type flakyBackend struct {
	*Memory
	failing atomic.Bool
}

func (f *flakyBackend) Apply(inst string, ops []Op) error {
	if f.failing.Load() {
		return errors.New("backend unreachable")
	}
	return f.Memory.Apply(inst, ops)
}

// A down instance whose blocks could not be cleared (the backend failing
// then) has them cleared once the backend answers, though it stays down.
func TestDownInstanceClearedWhenTheBackendIsBack(t *testing.T) {
	es := startEngines(t, 1, 64)
	be := &flakyBackend{Memory: NewMemory()}
	x := startIndex(t, Config{Instances: instancesOf(es), Backend: be})
	es[0].serve(t, prompt(rand.New(rand.NewSource(24)), 1, 64), nil)
	waitConverged(t, x, es, 10*time.Second)
	be.failing.Store(true)
	es[0].close()
	waitState(t, x, "e0", StateDown)
	waitFor(t, "the failed clear", func() bool { return x.Status()[0].BackendErrors > 0 })
	if be.Len("e0") == 0 {
		t.Fatal("cleared while the backend failed")
	}
	be.failing.Store(false)
	waitFor(t, "the down instance's blocks to leave the backend", func() bool { return be.Len("e0") == 0 })
	if st := x.Status()[0]; st.State != StateDown {
		t.Fatalf("status %+v", st)
	}
}

// A status that shows an instance down counts its going down: a reader
// never sees the state before the disconnect (both paths to down, a
// closed connection and a failed probe, go through markDown).
func TestDownIsCountedWhenSeen(t *testing.T) {
	x, err := New(Config{Instances: []InstanceConfig{{Name: "e0", Endpoint: "tcp://127.0.0.1:1"}}, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	in := x.insts[0]
	const rounds = 2000
	var done atomic.Bool
	var bad atomic.Value
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !done.Load() {
			st := x.Status()[0]
			if st.State != StateDown {
				continue
			}
			// Round i's markDown made this state: i+1 went down so far.
			if i, _ := strconv.Atoi(st.LastError); st.Disconnects < int64(i)+1 {
				bad.Store(st)
				return
			}
		}
	}()
	for i := 0; i < rounds && bad.Load() == nil; i++ {
		in.mu.Lock()
		in.down, in.stale, in.lastErr = false, false, strconv.Itoa(i)
		in.mu.Unlock()
		in.markDown("test")
	}
	done.Store(true)
	wg.Wait()
	if st := bad.Load(); st != nil {
		t.Fatalf("down before its disconnect was counted: %+v", st)
	}
}

// An instance is fresh once its snapshot's blocks are in the backend, not
// before: a reader that sees it fresh scores what it holds.
func TestFreshAfterItsSnapshotIsApplied(t *testing.T) {
	e := newEngine(t, "e0", 64, 16, [2]int{0, 0}, kvevents.Config{})
	t.Cleanup(e.close)
	p := prompt(rand.New(rand.NewSource(24)), 1, 96)
	e.serve(t, p, nil)
	w := &applyWatch{Memory: NewMemory(), when: startsSnapshot}
	x, err := New(Config{Instances: []InstanceConfig{e.instance()}, Backend: w})
	if err != nil {
		t.Fatal(err)
	}
	w.x.Store(x)
	t.Cleanup(x.Close)
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	if sc, _ := x.Query(p, nil); sc[0].Tokens != 96 {
		t.Fatalf("converged: %+v", sc)
	}
	// The snapshot may have come before the backend was watched: resync
	// to see one applied.
	x.insts[0].resync("test")
	waitConverged(t, x, []*engine{e}, 10*time.Second)
	states, held := w.take()
	if len(states) == 0 {
		t.Fatal("no snapshot applied")
	}
	// A snapshot of one batch that arrives in sequence while the instance
	// is fresh replaces a whole set in one apply, so a reader sees the old
	// set or the new (one of more batches keeps it stale until its last:
	// TestNeverFreshOverAPartialSnapshot); what must never show fresh is
	// the empty set a resync leaves before its snapshot lands.
	stale := false
	for i, st := range states {
		if st == StateFresh && held[i] == 0 {
			t.Fatalf("fresh over an empty set while its snapshot was being applied: states %v, blocks held %v", states, held)
		}
		stale = stale || st == StateStale
	}
	if !stale {
		t.Fatalf("no snapshot applied while stale after the resync: states %v", states)
	}
}
