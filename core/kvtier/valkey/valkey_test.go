package valkey

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/kverr"
	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// bound is what a call with a 100 ms operation timeout must return within:
// generous, so a loaded machine does not make the tests flaky.
const bound = 2 * time.Second

func newTier(t testing.TB, cfg Config) *Tier {
	t.Helper()
	if cfg.Namespace == "" {
		cfg.Namespace = "test"
	}
	if cfg.OpTimeout == 0 {
		cfg.OpTimeout = 100 * time.Millisecond
	}
	tr, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// hs returns hashes whose last eight bytes are xs's (big-endian), the
// first eight a constant, so that a hash that agrees with another in 64
// bits only is easy to write.
func hs(xs ...uint64) []Hash {
	out := make([]Hash, len(xs))
	for i, x := range xs {
		out[i] = hashOf(x)
	}
	return out
}

func hashOf(x uint64) Hash {
	var h Hash
	binary.BigEndian.PutUint64(h[:], 0x0123456789abcdef)
	binary.BigEndian.PutUint64(h[8:], x)
	return h
}

func payload(h uint64, n int) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(int64(h))).Read(b)
	return b
}

// raw sends one command to addr outside the tier.
func raw(t *testing.T, addr string, args ...[]byte) any {
	t.Helper()
	c := resp.NewClient(addr, 2*time.Second)
	defer c.Close()
	r, err := c.Do([][][]byte{args})
	if err != nil {
		t.Fatal(err)
	}
	return r[0]
}

func timed(t *testing.T, what string, f func()) {
	t.Helper()
	start := time.Now()
	f()
	if d := time.Since(start); d > bound {
		t.Fatalf("%s took %v, more than %v", what, d, bound)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	for _, c := range []Config{
		{Namespace: "x"},
		{Addr: "a:1"},
		{Addr: "a:1", Namespace: "has space"},
		{Addr: "a:1", Namespace: "x:y"},
		{Addr: "a:1", Namespace: string(make([]byte, 65))},
		{Addr: "a:1", Namespace: "x", BlockBytes: -1},
		{Addr: "a:1", Namespace: "x", OpTimeout: -1},
		{Addr: "a:1", Namespace: "x", TTL: time.Microsecond},
	} {
		if _, err := New(c); !kverr.Is(err, kverr.InvalidArgument) {
			t.Errorf("%+v: %v", c, err)
		}
	}
}

// GetSegments scatters a payload over its segments in order; a value of
// another length than theirs together is a corrupt miss that leaves them
// alone.
func TestGetSegments(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 7, OpTimeout: time.Second})
	ps := [][]byte{payload(1, 96), payload(2, 64)}
	if n := tr.Put(hs(1, 2), ps); n != 2 {
		t.Fatalf("stored %d", n)
	}
	seg := func(ls ...int) [][]byte {
		out := make([][]byte, len(ls))
		for i, l := range ls {
			out[i] = bytes.Repeat([]byte{0xee}, l)
		}
		return out
	}
	dst := [][][]byte{seg(32, 0, 64), seg(32, 48), seg(8)}
	found := tr.GetSegments(hs(1, 2, 3), dst)
	if !found[0] || found[1] || found[2] {
		t.Fatalf("GetSegments %v", found)
	}
	if !bytes.Equal(append(dst[0][0], dst[0][2]...), ps[0]) {
		t.Fatal("segments differ from the payload")
	}
	if !bytes.Equal(dst[1][0], seg(32)[0]) || !bytes.Equal(dst[1][1], seg(48)[0]) {
		t.Fatal("a miss wrote its segments")
	}
	if st := tr.Stats(); st.Hits != 1 || st.Corrupt != 1 || st.Misses != 1 {
		t.Fatalf("stats %+v", st)
	}
	if found := tr.GetSegments(hs(1), nil); found[0] {
		t.Fatal("a hit without segments")
	}
}

func TestKeyAndEncoding(t *testing.T) {
	tr := newTier(t, Config{Addr: "127.0.0.1:1", Namespace: "llama3-8b.bs16"})
	if k := tr.Key(hashOf(0xab)); k != "kvplug:llama3-8b.bs16:0123456789abcdef00000000000000ab" {
		t.Fatal(k)
	}
	v := Encode(hashOf(7), 9, []byte("abc"))
	if len(v) != HeaderBytes+3 || string(v[:4]) != Magic || Hash(v[8:24]) != hashOf(7) ||
		binary.LittleEndian.Uint64(v[24:]) != 9 || binary.LittleEndian.Uint64(v[32:]) != 3 {
		t.Fatalf("%x", v)
	}
}

func TestRoundTrip(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const bs = 4096
	tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 42, BlockBytes: bs, TTL: time.Hour, OpTimeout: time.Second})
	keys := hs(1, 2, 3, 4)
	ps := [][]byte{payload(1, bs), payload(2, bs), payload(3, bs), payload(4, bs)}
	if n := tr.Put(keys[:3], ps[:3]); n != 3 {
		t.Fatalf("stored %d", n)
	}
	got := tr.Get(keys)
	for i := range 3 {
		if !bytes.Equal(got[i], ps[i]) {
			t.Fatalf("block %d differs", i)
		}
	}
	if got[3] != nil {
		t.Fatal("a hit on an absent block")
	}
	if n := tr.Prefix(hs(1, 2, 4, 3)); n != 2 {
		t.Fatalf("prefix %d", n)
	}
	dst := [][]byte{make([]byte, bs), make([]byte, bs), make([]byte, 10)}
	found := tr.GetInto(hs(3, 4, 1), dst)
	if !found[0] || found[1] || found[2] || !bytes.Equal(dst[0], ps[2]) {
		t.Fatalf("GetInto %v", found)
	}
	if ttl, _ := raw(t, srv.Addr(), []byte("PTTL"), []byte(tr.Key(hashOf(1)))).(int64); ttl <= 0 || ttl > int64(time.Hour/time.Millisecond) {
		t.Fatalf("PTTL %d", ttl)
	}
	// A payload of the wrong size is not stored.
	if n := tr.Put(hs(5), [][]byte{make([]byte, 10)}); n != 0 {
		t.Fatal("stored a wrong-sized block")
	}
	st := tr.Stats()
	if st.Stores != 3 || st.Hits != 3+3+1 || st.Misses != 1+1+1 || st.Corrupt != 1 || st.Errors != 1 || st.Timeouts != 0 || st.Skipped != 0 ||
		st.BytesWritten != 3*(HeaderBytes+bs) || st.BytesRead != 5*(HeaderBytes+bs) || !st.Available {
		t.Fatalf("stats %v", st)
	}
}

// Short, foreign or corrupt values under a block's key (written with a
// plain SET), and another layout's block: each a miss, counted corrupt.
func TestCorruptValuesAreMisses(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	tr := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 42, BlockBytes: 64, OpTimeout: time.Second})
	good := Encode(hashOf(100), 42, payload(100, 64))
	mut := func(f func(v []byte) []byte) []byte {
		v := bytes.Clone(good)
		return f(v)
	}
	cases := []struct {
		name string
		v    []byte
	}{
		{"empty", nil},
		{"short", []byte("KVPB")},
		{"header only", good[:HeaderBytes]},
		{"truncated payload", good[:len(good)-1]},
		{"trailing bytes", append(bytes.Clone(good), 0)},
		{"bad magic", mut(func(v []byte) []byte { v[0] = 'X'; return v })},
		{"bad version", mut(func(v []byte) []byte { v[4] = 1; return v })},
		{"flags", mut(func(v []byte) []byte { v[6] = 1; return v })},
		{"another block's value", Encode(hashOf(101), 42, payload(100, 64))},
		{"a block whose hash agrees in its last 64 bits", Encode(Hash{15: 100}, 42, payload(100, 64))},
		{"a block whose hash agrees in its first 64 bits", Encode(hashOf(1<<40+100), 42, payload(100, 64))},
		{"wrong fingerprint", Encode(hashOf(100), 43, payload(100, 64))},
		{"length field", mut(func(v []byte) []byte { v[32]++; return v })},
		{"wrong block size", Encode(hashOf(100), 42, payload(100, 32))},
		{"flipped payload bit", mut(func(v []byte) []byte { v[HeaderBytes+7] ^= 4; return v })},
		{"flipped checksum bit", mut(func(v []byte) []byte { v[41] ^= 1; return v })},
	}
	for i, c := range cases {
		raw(t, srv.Addr(), []byte("SET"), []byte(tr.Key(hashOf(100))), c.v)
		before := tr.Stats()
		if got := tr.Get(hs(100)); got[0] != nil {
			t.Fatalf("%s: a hit", c.name)
		}
		if found := tr.GetInto(hs(100), [][]byte{make([]byte, 64)}); found[0] {
			t.Fatalf("%s: GetInto hit", c.name)
		}
		st := tr.Stats()
		if st.Corrupt != before.Corrupt+2 || st.Hits != before.Hits || st.Errors != 0 || !st.Available {
			t.Fatalf("case %d %s: stats %v", i, c.name, st)
		}
	}
	raw(t, srv.Addr(), []byte("SET"), []byte(tr.Key(hashOf(100))), good)
	if got := tr.Get(hs(100)); got[0] == nil {
		t.Fatal("the good value misses")
	}
	// A key of another type is a miss and an error, not a failure.
	raw(t, srv.Addr(), []byte("SADD"), []byte(tr.Key(hashOf(200))), []byte("m"))
	if got := tr.Get(hs(200)); got[0] != nil || !tr.Available() {
		t.Fatal("a set under a block's key")
	}
}

// Instances of different layouts sharing a server never read each other's
// blocks, and the reader says so in the log (once a minute): without the
// line, a namespace shared by two layouts only shows as corrupt reads.
func TestWrongFingerprintMisses(t *testing.T) {
	logs := captureLogs(t)
	srv := redistest.Start(t, redistest.Find(t), 0)
	a := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 1, OpTimeout: time.Second})
	b := newTier(t, Config{Addr: srv.Addr(), Fingerprint: 2, OpTimeout: time.Second})
	if a.Put(hs(5), [][]byte{[]byte("layout one")}) != 1 {
		t.Fatal("put")
	}
	if got := b.Get(hs(5)); got[0] != nil || b.Stats().Corrupt != 1 {
		t.Fatalf("read another layout's block: %q %v", got[0], b.Stats())
	}
	if got := a.Get(hs(5)); string(got[0]) != "layout one" {
		t.Fatal("the writer misses its own block")
	}
	text := logs.text()
	if strings.Count(text, "another layout's fingerprint") != 1 || !strings.Contains(text, `"fingerprint": "0x1"`) ||
		!strings.Contains(text, `"ours": "0x2"`) {
		t.Fatalf("log after one foreign read: %q", text)
	}
	// Within the minute: no second line, also from the streamed read.
	if found := b.GetInto(hs(5), [][]byte{make([]byte, len("layout one"))}); found[0] {
		t.Fatal("GetInto read another layout's block")
	}
	if n := strings.Count(logs.text(), "another layout's fingerprint"); n != 1 || b.Stats().Corrupt != 2 {
		t.Fatalf("%d log lines within a minute, corrupt %d", n, b.Stats().Corrupt)
	}
	// The streamed read logs by itself once the minute is over.
	b.mu.Lock()
	b.lastLog[logForeignLayout] = time.Time{}
	b.mu.Unlock()
	if found := b.GetInto(hs(5), [][]byte{make([]byte, len("layout one"))}); found[0] {
		t.Fatal("GetInto read another layout's block")
	}
	if n := strings.Count(logs.text(), "another layout's fingerprint"); n != 2 {
		t.Fatalf("%d log lines after the streamed read's own, want 2", n)
	}
	// Each kind keeps its own clock: a refused command is logged in the
	// same minute as the foreign layout.
	if !b.logDue(logRefused) || b.logDue(logForeignLayout) {
		t.Fatal("log kinds share one clock")
	}
}

// Valkey down: nothing listens on the port. Calls miss at once, counted,
// then skip during the backoff window without touching the network: one
// failed call per path (lookups, stores), each path's breaker its own.
func TestServerDown(t *testing.T) {
	addr := fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t))
	tr := newTier(t, Config{Addr: addr, Backoff: time.Hour})
	timed(t, "Get on a down server", func() {
		if got := tr.Get(hs(1, 2)); got[0] != nil || got[1] != nil {
			t.Fatal("a hit")
		}
	})
	st := tr.Stats()
	if st.Errors+st.Timeouts != 1 || st.Misses != 2 || st.Available {
		t.Fatalf("stats %v", st)
	}
	timed(t, "calls in the skip window", func() {
		for range 100 {
			tr.Put(hs(1), [][]byte{{1}})
			tr.Get(hs(1))
			tr.Exists(hs(1))
		}
	})
	// The first Put tried the server on the stores' connection and
	// failed; every other call was skipped.
	if st := tr.Stats(); st.Skipped != 299 || st.Errors+st.Timeouts != 2 || st.Stores != 0 || st.Available {
		t.Fatalf("stats %v", st)
	}
}

// Valkey slow: a server that never answers, or answers after the deadline.
// Each call returns within the bound, counted as a timeout, and its path
// (lookups, stores) is then skipped.
func TestServerSlow(t *testing.T) {
	for _, delay := range []time.Duration{0, 700 * time.Millisecond} {
		t.Run(fmt.Sprint("delay ", delay), func(t *testing.T) {
			tr := newTier(t, Config{Addr: redistest.Slow(t, delay), OpTimeout: 100 * time.Millisecond, Backoff: time.Hour})
			timed(t, "Get on a slow server", func() {
				if got := tr.Get(hs(1)); got[0] != nil {
					t.Fatal("a hit")
				}
			})
			timed(t, "Put on a slow server", func() { tr.Put(hs(1), [][]byte{{1}}) })
			timed(t, "calls in the skip windows", func() {
				tr.Get(hs(1))
				tr.Put(hs(1), [][]byte{{1}})
			})
			st := tr.Stats()
			if st.Timeouts != 2 || st.Skipped != 2 || st.Available {
				t.Fatalf("stats %v", st)
			}
		})
	}
	// Concurrent callers queue on the one connection; each still returns
	// within the bound.
	tr := newTier(t, Config{Addr: redistest.Slow(t, 0), OpTimeout: 100 * time.Millisecond, Backoff: time.Nanosecond, MaxBackoff: time.Nanosecond})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { timed(t, "concurrent Get", func() { tr.Get(hs(1)) }) })
	}
	wg.Wait()
	if st := tr.Stats(); st.Timeouts+st.Skipped != 8 || st.Timeouts == 0 {
		t.Fatalf("stats %v", st)
	}
}

// Valkey restarted: the tier skips while the server is gone and recovers
// by itself when it is back (with its data lost).
func TestServerRestart(t *testing.T) {
	bin := redistest.Find(t)
	srv := redistest.Start(t, bin, 0)
	tr := newTier(t, Config{Addr: srv.Addr(), OpTimeout: 500 * time.Millisecond, Backoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	p := payload(1, 1024)
	if tr.Put(hs(1), [][]byte{p}) != 1 || tr.Get(hs(1))[0] == nil {
		t.Fatal("before the restart")
	}
	srv.Stop()
	timed(t, "Get on a stopped server", func() {
		if tr.Get(hs(1))[0] != nil {
			t.Fatal("a hit")
		}
	})
	if st := tr.Stats(); st.Errors+st.Timeouts != 1 || st.Available {
		t.Fatalf("after the stop: %v", st)
	}
	for range 10 { // in the window or failing again: never blocking long
		timed(t, "Get while down", func() { tr.Get(hs(1)) })
	}
	if tr.Stats().Skipped == 0 {
		t.Fatal("nothing skipped")
	}
	srv = redistest.Start(t, bin, srv.Port)
	deadline := time.Now().Add(10 * time.Second)
	for tr.Put(hs(1), [][]byte{p}) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("no recovery: %v", tr.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The store's success closed the stores' breaker only: the lookups
	// recover on their own, once their window is over.
	for !bytes.Equal(tr.Get(hs(1))[0], p) {
		if time.Now().After(deadline) {
			t.Fatalf("no recovery of the lookups: %v", tr.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !tr.Available() {
		t.Fatalf("after the restart: %v", tr.Stats())
	}
}

// Concurrent stores and loads (run with -race).
func TestConcurrent(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	tr := newTier(t, Config{Addr: srv.Addr(), BlockBytes: 256, OpTimeout: 5 * time.Second})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				h := uint64(g*1000 + i)
				if tr.Put(hs(h), [][]byte{payload(h, 256)}) != 1 {
					t.Error("put failed")
					return
				}
				if got := tr.Get(hs(h)); !bytes.Equal(got[0], payload(h, 256)) {
					t.Error("get differs")
					return
				}
			}
		})
	}
	wg.Wait()
	if st := tr.Stats(); st.Stores != 200 || st.Hits != 200 || st.Timeouts+st.Errors+st.Skipped+st.Corrupt != 0 {
		t.Fatalf("stats %v", st)
	}
}

// A batch of n blocks of bs bytes against a local server: in plaintext,
// over TLS (TLS 1.3, ECDSA P-256 certificates, AES-GCM), with the MAC, or
// both; "direct" reads with ReadInto instead of GetInto. GetInto and
// ReadInto read into the same destinations each time (the host slots),
// Put writes from the payloads.
func benchBatch(b *testing.B, n, bs int, get bool, mode string) {
	cfg := Config{BlockBytes: bs, OpTimeout: time.Minute}
	var srv *redistest.Server
	if strings.Contains(mode, "tls") {
		certs := redistest.NewCerts(b)
		srv = redistest.StartTLS(b, redistest.Find(b), redistest.TLSServer{Certs: certs})
		cfg.TLS = &TLS{CAFile: certs.CA}
	} else {
		srv = redistest.Start(b, redistest.Find(b), 0)
	}
	if strings.Contains(mode, "mac") {
		cfg.MACKeys = Secret{Value: []byte(keyA)}
	}
	cfg.Addr = srv.Addr()
	tr := newTier(b, cfg)
	keys := make([]Hash, n)
	ps := make([][]byte, n)
	dst := make([][]byte, n)
	for i := range keys {
		keys[i], ps[i], dst[i] = hashOf(uint64(i+1)), payload(uint64(i), bs), make([]byte, bs)
		clear(dst[i]) // touched: the host slots are resident
	}
	if tr.Put(keys, ps) != n {
		b.Fatal("put")
	}
	b.SetBytes(int64(n * bs))
	for b.Loop() {
		if get {
			found := tr.GetInto
			if strings.Contains(mode, "direct") {
				found = tr.ReadInto
			}
			for _, ok := range found(keys, dst) {
				if !ok {
					b.Fatal("miss")
				}
			}
		} else if tr.Put(keys, ps) != n {
			b.Fatal("put")
		}
	}
}

const kib64 = 64 << 10

func BenchmarkGet64x64KiB(b *testing.B)       { benchBatch(b, 64, kib64, true, "") }
func BenchmarkPut64x64KiB(b *testing.B)       { benchBatch(b, 64, kib64, false, "") }
func BenchmarkGet64x64KiBTLS(b *testing.B)    { benchBatch(b, 64, kib64, true, "tls") }
func BenchmarkPut64x64KiBTLS(b *testing.B)    { benchBatch(b, 64, kib64, false, "tls") }
func BenchmarkGet64x64KiBMAC(b *testing.B)    { benchBatch(b, 64, kib64, true, "mac") }
func BenchmarkPut64x64KiBMAC(b *testing.B)    { benchBatch(b, 64, kib64, false, "mac") }
func BenchmarkGet64x64KiBTLSMAC(b *testing.B) { benchBatch(b, 64, kib64, true, "tls+mac") }
func BenchmarkPut64x64KiBTLSMAC(b *testing.B) { benchBatch(b, 64, kib64, false, "tls+mac") }
