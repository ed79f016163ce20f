package valkey

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
)

// How a pathServer answers a path's commands.
const (
	answer int32 = iota // at once
	hang                // never (the command is read, no reply)
	late                // after its delay
)

// pathServer is a scripted server (redistest.Scripted) whose lookups (GET,
// EXISTS) and stores (SET) are each answered at once, never or late, as
// lookups and stores say; it counts the commands it reads, by verb. A GET
// is answered with value, an EXISTS with 1, a SET with OK.
type pathServer struct {
	addr               string
	lookups, stores    atomic.Int32 // answer, hang or late
	gets, exists, sets atomic.Int64
}

func newPathServer(t *testing.T, value []byte, delay time.Duration) *pathServer {
	s := &pathServer{}
	s.addr = redistest.Scripted(t, func(c net.Conn, verb string) bool {
		var how int32
		switch verb {
		case "GET":
			s.gets.Add(1)
			how = s.lookups.Load()
		case "EXISTS":
			s.exists.Add(1)
			how = s.lookups.Load()
		case "SET":
			s.sets.Add(1)
			how = s.stores.Load()
		default:
			io.WriteString(c, "-ERR unknown command\r\n")
			return true
		}
		switch how {
		case hang:
			return true
		case late:
			time.Sleep(delay)
		}
		switch verb {
		case "GET":
			fmt.Fprintf(c, "$%d\r\n%s\r\n", len(value), value)
		case "EXISTS":
			io.WriteString(c, ":1\r\n")
		default:
			io.WriteString(c, "+OK\r\n")
		}
		return true
	})
	return s
}

// window returns b's skip window's end and length.
func window(b *breaker) (time.Time, time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.skipUntil, b.backoff
}

// expire ends b's skip window now, as if its backoff had passed, keeping
// its backoff.
func expire(b *breaker) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.skipUntil = time.Now().Add(-time.Nanosecond)
}

// A store that times out (a server that never answers SET, or answers past
// the operation timeout, while it answers GET and EXISTS at once) skips
// the stores for the backoff window, not the lookups: they still go to the
// server, and it answers them.
func TestStoreTimeoutKeepsLookups(t *testing.T) {
	for _, how := range []int32{hang, late} {
		t.Run(map[int32]string{hang: "never answered", late: "answered late"}[how], func(t *testing.T) {
			logs := captureLogs(t)
			const fp, bs = 7, 64
			p := payload(1, bs)
			srv := newPathServer(t, Encode(hashOf(1), fp, p), 300*time.Millisecond)
			srv.stores.Store(how)
			tr := newTier(t, Config{Addr: srv.addr, Fingerprint: fp, BlockBytes: bs, OpTimeout: 100 * time.Millisecond, Backoff: time.Hour})
			timed(t, "a store that times out", func() {
				if tr.Put(hs(1), [][]byte{p}) != 0 {
					t.Fatal("stored")
				}
			})
			if st := tr.Stats(); st.Timeouts != 1 || st.Skipped != 0 || st.Available {
				t.Fatalf("after the store: %v", st)
			}
			// The lookups and reads go to the server, which answers them.
			if got := tr.Get(hs(1)); !bytes.Equal(got[0], p) {
				t.Fatal("Get after a store's timeout: a miss")
			}
			if !tr.Exists(hs(1))[0] {
				t.Fatal("Exists after a store's timeout: not held")
			}
			dst := [][]byte{make([]byte, bs)}
			if found := tr.ReadInto(hs(1), dst); !found[0] || !bytes.Equal(dst[0], p) {
				t.Fatal("ReadInto after a store's timeout: a miss")
			}
			if g, e := srv.gets.Load(), srv.exists.Load(); g != 2 || e != 1 {
				t.Fatalf("the server read %d GETs and %d EXISTS, want 2 and 1", g, e)
			}
			// The stores (Put, StoreExists) are skipped in their window,
			// without touching the server.
			if tr.Put(hs(1), [][]byte{p}) != 0 || tr.StoreExists(hs(1))[0] {
				t.Fatal("a store in the skip window did something")
			}
			st := tr.Stats()
			if st.Skipped != 2 || st.Timeouts != 1 || st.Hits != 3 || st.Misses != 1 || st.Stores != 0 || st.Available {
				t.Fatalf("after the lookups and the skipped stores: %v", st)
			}
			if s, e := srv.sets.Load(), srv.exists.Load(); s != 1 || e != 1 {
				t.Fatalf("the server read %d SETs and %d EXISTS, want 1 and 1", s, e)
			}
			// The failure is logged once, as the stores'.
			text := logs.text()
			if strings.Count(text, "timed out on the tier's stores") != 1 || strings.Contains(text, "lookups") {
				t.Fatalf("log: %q", text)
			}
		})
	}
}

// Each path's breaker is its own: a failure of one neither opens, extends
// nor resets the other's, and a success of one closes its own only, so a
// failing path keeps doubling its backoff while the other succeeds.
func TestBreakersIndependent(t *testing.T) {
	logs := captureLogs(t)
	const fp, bs = 7, 64
	p := payload(1, bs)
	srv := newPathServer(t, Encode(hashOf(1), fp, p), 0)
	tr := newTier(t, Config{Addr: srv.addr, Fingerprint: fp, BlockBytes: bs, OpTimeout: 100 * time.Millisecond,
		Backoff: time.Minute, MaxBackoff: time.Hour})
	get := func() bool { return bytes.Equal(tr.Get(hs(1))[0], p) }
	put := func() bool { return tr.Put(hs(1), [][]byte{p}) == 1 }

	// The stores fail: their breaker opens for Backoff; the lookups' stays
	// closed.
	srv.stores.Store(hang)
	if put() {
		t.Fatal("stored on a server that does not answer SET")
	}
	storesUntil, b := window(&tr.storesBr)
	if b != time.Minute || storesUntil.IsZero() {
		t.Fatalf("the stores' backoff after their failure: %v", b)
	}
	if _, b := window(&tr.lookupsBr); b != 0 || !tr.lookupsBr.allows() {
		t.Fatalf("a store's failure opened the lookups' breaker (backoff %v)", b)
	}

	// A lookup fails: the lookups' breaker opens; the stores' window and
	// backoff are as they were.
	srv.lookups.Store(hang)
	if get() {
		t.Fatal("a hit on a server that does not answer GET")
	}
	if _, b := window(&tr.lookupsBr); b != time.Minute {
		t.Fatalf("the lookups' backoff after their failure: %v", b)
	}
	if u, b := window(&tr.storesBr); !u.Equal(storesUntil) || b != time.Minute {
		t.Fatalf("a lookup's failure changed the stores' breaker: backoff %v, window to %v (was %v)", b, u, storesUntil)
	}

	// The lookups recover: their success closes their breaker only. A
	// store in the stores' window is still skipped, without a SET.
	srv.lookups.Store(answer)
	expire(&tr.lookupsBr)
	if !get() {
		t.Fatalf("no hit once the server answers GET: %v", tr.Stats())
	}
	if _, b := window(&tr.lookupsBr); b != 0 || !tr.lookupsBr.allows() {
		t.Fatalf("the lookups' breaker after their success: backoff %v", b)
	}
	if u, b := window(&tr.storesBr); !u.Equal(storesUntil) || b != time.Minute {
		t.Fatalf("a lookup's success changed the stores' breaker: backoff %v, window to %v (was %v)", b, u, storesUntil)
	}
	sets, skipped := srv.sets.Load(), tr.Stats().Skipped
	if put() || srv.sets.Load() != sets || tr.Stats().Skipped != skipped+1 || tr.Available() {
		t.Fatalf("a store in the stores' window after a lookup's success: %d SETs (was %d), %v", srv.sets.Load(), sets, tr.Stats())
	}

	// The stores' next failure doubles their backoff: the lookup's
	// success did not reset it.
	expire(&tr.storesBr)
	if put() || srv.sets.Load() != sets+1 {
		t.Fatalf("the store after the window: %d SETs (was %d)", srv.sets.Load(), sets)
	}
	if _, b := window(&tr.storesBr); b != 2*time.Minute {
		t.Fatalf("the stores' backoff after their second failure: %v, want %v", b, 2*time.Minute)
	}

	// The other way round: the lookups fail, the stores recover. A
	// store's success leaves the lookups skipped, and their next failure
	// doubles their backoff.
	srv.lookups.Store(hang)
	if get() {
		t.Fatal("a hit on a server that does not answer GET")
	}
	lookupsUntil, _ := window(&tr.lookupsBr)
	srv.stores.Store(answer)
	expire(&tr.storesBr)
	if !put() {
		t.Fatalf("no store once the server answers SET, while the lookups fail: %v", tr.Stats())
	}
	if _, b := window(&tr.storesBr); b != 0 || !tr.storesBr.allows() {
		t.Fatalf("the stores' breaker after their success: backoff %v", b)
	}
	if u, b := window(&tr.lookupsBr); !u.Equal(lookupsUntil) || b != time.Minute {
		t.Fatalf("a store's success changed the lookups' breaker: backoff %v, window to %v (was %v)", b, u, lookupsUntil)
	}
	gets, skipped := srv.gets.Load(), tr.Stats().Skipped
	if get() || srv.gets.Load() != gets || tr.Stats().Skipped != skipped+1 || tr.Available() {
		t.Fatalf("a lookup in the lookups' window after a store's success: %d GETs (was %d), %v", srv.gets.Load(), gets, tr.Stats())
	}
	expire(&tr.lookupsBr)
	if get() {
		t.Fatal("a hit on a server that does not answer GET")
	}
	if _, b := window(&tr.lookupsBr); b != 2*time.Minute {
		t.Fatalf("the lookups' backoff after their second failure: %v, want %v", b, 2*time.Minute)
	}
	if !put() || !tr.storesBr.allows() {
		t.Fatalf("a store while the lookups fail: %v", tr.Stats())
	}
	if st := tr.Stats(); st.Timeouts != 5 || st.Skipped != 2 || st.Stores != 2 || st.Available {
		t.Fatalf("stats %v", st)
	}

	// Each path's first failure after a success, and its recovery, is
	// logged once, naming the path.
	text := logs.text()
	for line, want := range map[string]int{
		"timed out on the tier's stores":       1,
		"timed out on the tier's lookups":      2,
		"answers the tier's lookups again":     1,
		"answers the tier's stores again":      1,
		"shared tier: server timed out on the": 3,
	} {
		if n := strings.Count(text, line); n != want {
			t.Errorf("%d log lines with %q, want %d:\n%s", n, line, want, text)
		}
	}
}

// A breaker's window: Backoff after the first failure, doubling on each
// consecutive one up to MaxBackoff; a success closes it and the next
// failure starts again from Backoff.
func TestBreakerWindows(t *testing.T) {
	b := breaker{first: time.Minute, longest: 3 * time.Minute}
	if !b.allows() || b.succeeded() {
		t.Fatal("a new breaker is not closed")
	}
	for i, want := range []time.Duration{time.Minute, 2 * time.Minute, 3 * time.Minute, 3 * time.Minute} {
		before := time.Now()
		first, w := b.failed()
		if first != (i == 0) || w != want || b.allows() {
			t.Fatalf("failure %d: first %v, window %v, want %v; allows %v", i, first, w, want, b.allows())
		}
		if u, _ := window(&b); u.Before(before.Add(want)) || u.After(time.Now().Add(want)) {
			t.Fatalf("failure %d: the window ends at %v, not %v from now", i, u, want)
		}
		expire(&b)
		if !b.allows() {
			t.Fatalf("failure %d: closed after its window", i)
		}
	}
	b.failed()
	if !b.succeeded() || !b.allows() {
		t.Fatal("a success after failures: no recovery, or not closed")
	}
	if first, w := b.failed(); !first || w != time.Minute {
		t.Fatalf("the failure after a success: first %v, window %v", first, w)
	}
}
