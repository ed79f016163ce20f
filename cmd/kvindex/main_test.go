package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/kvevents"
	"github.com/kvplug/kvplug/core/kvindex"
	"github.com/kvplug/kvplug/core/kvmanager"
)

func TestInstanceFlag(t *testing.T) {
	var f instanceFlags
	for _, ok := range []string{"a=tcp://h:1", "b=tcp://h:2,tcp://h:3", "c=tcp://h:4,tcp://h:5,kv@c@m", "d=ipc:///run/d.sock,,kv@d"} {
		if err := f.Set(ok); err != nil {
			t.Fatalf("%s: %v", ok, err)
		}
	}
	if len(f) != 4 || f[1].ReplayEndpoint != "tcp://h:3" || f[2].Topic != "kv@c@m" || f[0].ReplayEndpoint != "" ||
		f[3].ReplayEndpoint != "" || f[3].Topic != "kv@d" {
		t.Fatalf("parsed %+v", f)
	}
	for _, bad := range []string{"", "a", "=tcp://h:1", "a=", "e=bogus://x", "e=tcp://h", "e=tcp://h:1,udp://h:2", "a=tcp://h:9"} {
		if err := f.Set(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestFlagWeight(t *testing.T) {
	for in, want := range map[float64]float64{0: -1, 0.5: 0.5, 1: 1} {
		if got := flagWeight(in); got != want {
			t.Errorf("flagWeight(%v) = %v, want %v", in, got, want)
		}
	}
}

// syncBuffer is a bytes.Buffer the test reads while run writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Bad flags are refused before anything starts, with a message naming the
// flag and exit status 2.
func TestFlagsRefused(t *testing.T) {
	inst := "-instance=e0=tcp://127.0.0.1:1"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{inst, "-block-size", "0"}, "-block-size 0: must be in [1, "},
		{[]string{inst, "-block-size", "-3"}, "-block-size -3"},
		{[]string{"-instance", "e0=bogus://x"}, `endpoint "bogus://x": only tcp://HOST:PORT and ipc:///PATH endpoints are supported`},
		{[]string{"-instance", "e0=tcp://127.0.0.1:1,bogus://y"}, `replay endpoint "bogus://y"`},
		{[]string{"-instance", "e0"}, "want NAME=PUB_ENDPOINT"},
		{[]string{"-instance", "e0=tcp://127.0.0.1:1,,,trtllm"}, `unknown engine "trtllm"`},
		{[]string{inst, "-instance", "e0=tcp://127.0.0.1:2"}, `instance "e0" given twice`},
		{nil, "give at least one -instance"},
		{[]string{inst, "-cpu-weight", "1.5"}, "-cpu-weight 1.5: must be in [0, 1]"},
		{[]string{inst, "-shared-weight", "-1"}, "-shared-weight -1: must be in [0, 1]"},
		{[]string{inst, "-idle-timeout", "-1s"}, "-idle-timeout -1s"},
		{[]string{inst, "-timeout", "0"}, "-timeout 0s: must be > 0"},
		{[]string{inst, "-log-level", "loud"}, `-log-level "loud"`},
		{[]string{inst, "-valkey-tls"}, "need -valkey"},
		{[]string{inst, "-valkey", "127.0.0.1:1", "-valkey-user", "kv"}, "-valkey-user needs -valkey-password-env or -valkey-password-file"},
		{[]string{inst, "-valkey", "127.0.0.1:1", "-valkey-password-env", "A", "-valkey-password-file", "f"}, "not both"},
		{[]string{inst, "-valkey", "127.0.0.1:1", "-valkey-tls-ca", "ca.pem"}, "need -valkey-tls"},
		{[]string{inst, "-valkey", "127.0.0.1:1", "-valkey-tls", "-valkey-tls-cert", "c.pem"}, "go together"},
		{[]string{inst, "-listen", "8090"}, `-listen "8090"`},
		{[]string{inst, "-valkey", "localhost"}, `-valkey "localhost"`},
		{[]string{inst, "extra"}, `unexpected argument "extra"`},
		{[]string{inst, "-no-such-flag"}, "flag provided but not defined: -no-such-flag"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), c.args, &stdout, &stderr, func(string) { t.Errorf("%v: served", c.args) })
		if code != 2 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, stderr.String(), c.want)
		}
		if strings.Contains(stderr.String(), "serving") {
			t.Errorf("%v: printed serving", c.args)
		}
	}
}

func TestVersion(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-version"}, &stdout, &stderr, nil); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.HasPrefix(stdout.String(), "kvindex "+libVersion) {
		t.Fatalf("-version printed %q", stdout.String())
	}
	// libVersion is the header's version.
	h, err := os.ReadFile("../../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	var v [3]string
	for i, part := range []string{"MAJOR", "MINOR", "PATCH"} {
		m := regexp.MustCompile(`#define KVP_VERSION_` + part + ` (\d+)`).FindSubmatch(h)
		if m == nil {
			t.Fatalf("no KVP_VERSION_%s in the header", part)
		}
		v[i] = string(m[1])
	}
	if got := strings.Join(v[:], "."); got != libVersion {
		t.Fatalf("the header says %s, libVersion %s", got, libVersion)
	}
}

// A failure to start (the listen address taken) is status 1.
func TestListenInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-instance", "e0=tcp://127.0.0.1:1", "-listen", ln.Addr().String()}, &stdout, &stderr, nil)
	if code != 1 || !strings.Contains(stderr.String(), "address already in use") || strings.Contains(stderr.String(), "serving") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

// engine is a kvplug manager publishing its events on 127.0.0.1 with the
// publisher's default (bind) mode.
type engine struct {
	m   *kvmanager.Manager
	pub *kvevents.Publisher
	ep  [2]string
}

func startEngine(t *testing.T, ep [2]string) *engine {
	t.Helper()
	m, err := kvmanager.New(kvmanager.Config{NumBlocks: 64, BlockSize: 16, EnablePrefixCache: true, EnableKVEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	src, err := kvevents.ManagerSource(m)
	if err != nil {
		t.Fatal(err)
	}
	if ep[0] == "" {
		ep = [2]string{"tcp://127.0.0.1:0", "tcp://127.0.0.1:0"}
	}
	var pub *kvevents.Publisher
	deadline := time.Now().Add(10 * time.Second)
	for {
		pub, err = kvevents.Start(src, kvevents.Config{Endpoint: ep[0], ReplayEndpoint: ep[1], Topic: "kv@e0"})
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // a restarted engine's port may linger
	}
	if err != nil {
		t.Fatal(err)
	}
	e := &engine{m: m, pub: pub, ep: [2]string{"tcp://" + pub.PubAddr().String(), "tcp://" + pub.ReplayAddr().String()}}
	t.Cleanup(pub.Close)
	return e
}

// serve admits a prompt and finishes it: its full blocks stay cached.
func (e *engine) serve(t *testing.T, id int64, prompt []int32) {
	t.Helper()
	n, err := e.m.Admit([]int64{id}, kvmanager.Prompts{Tokens: prompt, Offsets: []int64{0, int64(len(prompt))}}, nil)
	if err != nil || n != 1 {
		t.Fatalf("admit: %d %v", n, err)
	}
	e.m.MarkComputed()
	if err := e.m.Remove([]int64{id}); err != nil {
		t.Fatal(err)
	}
	e.pub.Flush()
}

// The command as an operator runs it, against a real publisher on
// 127.0.0.1: "serving" once the listener is up, ready when the engine is
// in sync, scores that route to it, metrics; the engine stopped: not
// ready, not routed, logged; back: ready and routed again; a signal ends
// it with status 0.
func TestServe(t *testing.T) {
	e := startEngine(t, [2]string{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr syncBuffer
	served := make(chan string, 1)
	exited := make(chan int, 1)
	go func() {
		exited <- run(ctx, []string{"-listen", "127.0.0.1:0", "-idle-timeout", "2s",
			"-instance", fmt.Sprintf("e0=%s,%s,kv@e0", e.ep[0], e.ep[1])}, &stdout, &stderr, func(addr string) {
			if !strings.Contains(stderr.String(), "serving on http://"+addr+", 1 instance(s)") {
				t.Errorf("serving not printed before the callback: %q", stderr.String())
			}
			served <- addr
		})
	}()
	var base string
	select {
	case addr := <-served:
		base = "http://" + addr
	case code := <-exited:
		t.Fatalf("exited %d: %s", code, stderr.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("not serving after 20 s: %s", stderr.String())
	}
	if code, _ := httpGet(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("healthz %d", code)
	}
	waitReady(t, base, http.StatusOK)
	prompt := make([]int32, 80)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	e.serve(t, 1, prompt)
	var qr kvindex.QueryResponse
	poll(t, "the engine's blocks in the index", func() bool {
		qr = score(t, base, prompt)
		return qr.Best == "e0" && qr.Scores[0].Tokens == 80
	})
	_, metrics := httpGet(t, base+"/metrics")
	for _, want := range []string{`kvindex_instances{state="fresh"} 1`, `kvindex_index_blocks{instance="e0",medium="gpu"} 5`,
		`kvindex_resyncs_total{instance="e0"} 1`, `kvindex_score_duration_seconds_count `} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q:\n%s", want, metrics)
		}
	}
	if !regexp.MustCompile(`kvindex_events_total\{instance="e0"\} [1-9]`).MatchString(metrics) {
		t.Errorf("no events counted:\n%s", metrics)
	}

	// The engine exits: not ready, scored as absent.
	e.pub.Close()
	rd := waitReady(t, base, http.StatusServiceUnavailable)
	if rd.Instances[0].State != kvindex.StateDown || !strings.Contains(rd.Instances[0].WaitingFor, e.ep[0]) {
		t.Fatalf("readyz after the stop %+v", rd)
	}
	if qr = score(t, base, prompt); qr.Best != "" || qr.Scores[0].Tokens != 0 || qr.Scores[0].State != kvindex.StateDown {
		t.Fatalf("a stopped engine was scored: %+v", qr)
	}
	if code, _ := httpGet(t, base+"/healthz"); code != http.StatusOK {
		t.Fatalf("healthz %d with the engine down", code)
	}
	// It comes back on the same endpoints (a new manager: an empty cache).
	e = startEngine(t, e.ep)
	waitReady(t, base, http.StatusOK)
	e.serve(t, 2, prompt)
	poll(t, "the restarted engine's blocks", func() bool {
		qr = score(t, base, prompt)
		return qr.Best == "e0" && qr.Scores[0].Tokens == 80
	})
	cancel()
	select {
	case code := <-exited:
		if code != 0 {
			t.Fatalf("exit %d after the signal", code)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("still running 20 s after the signal")
	}
	logs := stderr.String()
	for _, want := range []string{"instance connected", "instance resynchronising", "instance stale", "instance fresh",
		"instance down", `"instance": "e0"`, "SUB connects", "kvindex: stopped"} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log lacks %q:\n%s", want, logs)
		}
	}
	if n := strings.Count(logs, "instance fresh"); n != 2 {
		t.Errorf("fresh logged %d times, want 2 (start, recovery):\n%s", n, logs)
	}
}

func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 20 s for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// waitReady polls /readyz until it answers code, and returns its body.
func waitReady(t *testing.T, base string, code int) kvindex.Readiness {
	t.Helper()
	var rd kvindex.Readiness
	poll(t, fmt.Sprintf("readyz %d", code), func() bool {
		got, body := httpGet(t, base+"/readyz")
		if err := json.Unmarshal([]byte(body), &rd); err != nil {
			t.Fatalf("readyz body %q: %v", body, err)
		}
		return got == code
	})
	return rd
}

func score(t *testing.T, base string, prompt []int32) kvindex.QueryResponse {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"tokens": prompt})
	resp, err := http.Post(base+"/v1/score", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var qr kvindex.QueryResponse
	if err := json.NewDecoder(resp.Body).Decode(&qr); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("score: status %d, %v", resp.StatusCode, err)
	}
	return qr
}

// README.md's table of kvindex's flags lists every flag, and no other.
func TestREADMEListsTheFlags(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	start := strings.Index(text, "| Flag | Default | Meaning |")
	if start < 0 {
		t.Fatal("README.md has no table of kvindex's flags")
	}
	table := text[start:]
	table = table[:strings.Index(table, "\n\n")]
	documented := map[string]bool{}
	for _, row := range strings.Split(table, "\n")[2:] {
		first := strings.SplitN(row, "|", 3)[1]
		for _, m := range regexp.MustCompile("`-([a-z-]+)").FindAllStringSubmatch(first, -1) {
			documented[m[1]] = true
		}
	}
	fs, _ := newFlags(io.Discard)
	fs.VisitAll(func(f *flag.Flag) {
		if !documented[f.Name] {
			t.Errorf("-%s is not in README.md's table", f.Name)
		}
		delete(documented, f.Name)
	})
	for name := range documented {
		t.Errorf("README.md's table lists -%s, which kvindex lacks", name)
	}
}
