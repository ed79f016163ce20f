package valkey

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/kvplug/kvplug/internal/resp"
)

// splitSmall makes batches of a few values of size bytes split over the
// tier's connections (each given at least two values), for the test.
func splitSmall(t *testing.T, size int) {
	g, p := getSplitBytes, putSplitBytes
	getSplitBytes, putSplitBytes = 2*(size+HeaderBytes+MACBytes+1), 2*(size+HeaderBytes+MACBytes)
	t.Cleanup(func() { getSplitBytes, putSplitBytes = g, p })
}

// Batches split over four connections, each with AUTH (a server that
// wants a password: a connection without it would read NOAUTH, misses),
// over TLS, with and without a MAC: every way of reading agrees with Get
// (one connection) on good, corrupt, foreign and absent values; the
// connections are made once and kept. Conns from KVPLUG_SHARED_CONNS.
func TestConnsSplitBatches(t *testing.T) {
	const n, size = 64, 4096
	splitSmall(t, size)
	t.Setenv("KVPLUG_SHARED_CONNS", "4")
	bin := redistest.Find(t)
	pw := []byte("conns password")
	certs := redistest.NewCerts(t)
	plain := redistest.Start(t, bin, 0, "--requirepass", string(pw))
	tlsSrv := redistest.StartTLS(t, bin, redistest.TLSServer{Certs: certs})
	for _, mode := range []string{"auth", "auth+mac", "tls", "tls+mac"} {
		t.Run(mode, func(t *testing.T) {
			cfg := Config{Addr: plain.Addr(), Namespace: strings.ReplaceAll(mode, "+", "-"), Fingerprint: 9, BlockBytes: size, OpTimeout: 5 * time.Second}
			var adminPW []byte
			if strings.HasPrefix(mode, "tls") {
				cfg.Addr, cfg.TLS = tlsSrv.Addr(), &TLS{CAFile: certs.CA}
			} else {
				cfg.Password, adminPW = Secret{Value: pw}, pw
			}
			if strings.HasSuffix(mode, "mac") {
				cfg.MACKeys = Secret{Value: []byte(keyA)}
			}
			tr := newTier(t, cfg)
			if tr.cfg.Conns != 4 {
				t.Fatalf("Conns %d", tr.cfg.Conns)
			}
			ps := make([][]byte, n)
			for i := range ps {
				ps[i] = payload(uint64(i), size)
			}
			if got := tr.Put(hs(seq(n)...), ps); got != n {
				t.Fatalf("stored %d of %d: %v", got, n, tr.Stats())
			}
			if d := tr.c.DialCount(); d != 4 {
				t.Fatalf("%d connections after a split Put, want 4", d)
			}
			if strings.HasPrefix(mode, "tls") {
				return // the TLS server's values are not altered here (no admin client over TLS)
			}
			// Altered values, absent ones, a value under another key.
			// (admin clears the password it is given: a copy each time.)
			do := func(args ...[]byte) any { return admin(t, cfg.Addr, bytes.Clone(adminPW), args...) }
			set := func(h uint64, v []byte) { do([]byte("SET"), []byte(tr.Key(hashOf(h))), v) }
			good := do([]byte("GET"), []byte(tr.Key(hashOf(7)))).([]byte)
			bad := bytes.Clone(good)
			bad[len(bad)-1] ^= 1
			set(3, bad)
			set(20, good[:len(good)-5])
			set(40, good) // block 7's value under 40's key
			for _, h := range []uint64{11, 12, 50, 63} {
				do([]byte("DEL"), []byte(tr.Key(hashOf(h))))
			}
			got := reads(t, tr, hs(seq(n)...), size)
			for i, g := range got {
				miss := i == 3 || i == 20 || i == 40 || i == 11 || i == 12 || i == 50 || i == 63
				if (g == nil) != miss || (g != nil && !bytes.Equal(g, ps[i])) {
					t.Fatalf("block %d: found %v", i, g != nil)
				}
			}
			if st := tr.Stats(); st.Timeouts != 0 || st.Errors != 0 || st.AuthFailures != 0 || !st.Available {
				t.Fatalf("stats %v", st)
			}
			if d := tr.c.DialCount(); d != 4 {
				t.Fatalf("%d connections made, want 4 (kept)", d)
			}
		})
	}
	// The TLS server's values, read back split.
	tr := newTier(t, Config{Addr: tlsSrv.Addr(), Namespace: "tls", Fingerprint: 9, BlockBytes: size, OpTimeout: 5 * time.Second, TLS: &TLS{CAFile: certs.CA}})
	got := reads(t, tr, hs(seq(n)...), size)
	for i, g := range got {
		if !bytes.Equal(g, payload(uint64(i), size)) {
			t.Fatalf("over TLS: block %d", i)
		}
	}
}

// One of three connections stops answering midway: its run's values from
// there are misses, the values read whole before on it and every value of
// the other runs stay found, the call ends at its timeout (one Timeout,
// the breaker opened), and a small batch after the skip window is one
// round trip on one connection.
func TestConnsOneFails(t *testing.T) {
	const bs = 1000
	splitSmall(t, bs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	tr := newTier(t, Config{Addr: ln.Addr().String(), Fingerprint: 5, BlockBytes: bs, OpTimeout: 300 * time.Millisecond, Backoff: 50 * time.Millisecond, Conns: 3})
	hang := fmt.Sprintf("%x", hashOf(5))
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					cmd, err := resp.ReadReply(r)
					if err != nil {
						return
					}
					args, _ := cmd.([]any)
					if len(args) > 0 && strings.EqualFold(string(args[0].([]byte)), "CLUSTER") {
						io.WriteString(c, "-ERR This instance has cluster support disabled\r\n")
						continue
					}
					key := string(args[1].([]byte))
					var h uint64
					fmt.Sscanf(key[len(key)-16:], "%x", &h)
					v := Encode(hashOf(h), 5, payload(h, bs))
					fmt.Fprintf(c, "$%d\r\n", len(v))
					if strings.HasSuffix(key, hang) {
						c.Write(v[:len(v)/2])
						time.Sleep(time.Second)
						return
					}
					c.Write(append(v, '\r', '\n'))
				}
			}()
		}
	}()
	// Blocks 1..9 in three runs: 1-3, 4-6 (5 hangs), 7-9.
	for _, way := range []string{"GetInto", "ReadInto"} {
		dst := make([][]byte, 9)
		for i := range dst {
			dst[i] = make([]byte, bs)
		}
		before := tr.Stats()
		start := time.Now()
		var found []bool
		if way == "GetInto" {
			found = tr.GetInto(hs(seq(10)[1:]...), dst)
		} else {
			found = tr.ReadInto(hs(seq(10)[1:]...), dst)
		}
		if d := time.Since(start); d > 700*time.Millisecond {
			t.Fatalf("%s took %v, its timeout 300 ms", way, d)
		}
		st := tr.Stats()
		for i, f := range found {
			h := uint64(i + 1)
			if f != (h != 5 && h != 6) || (f && !bytes.Equal(dst[i], payload(h, bs))) {
				t.Fatalf("%s: found %v", way, found)
			}
			if way == "GetInto" && !f && !bytes.Equal(dst[i], make([]byte, bs)) {
				t.Fatalf("GetInto wrote a missed block's buffer")
			}
		}
		if st.Hits-before.Hits != 7 || st.Misses-before.Misses != 2 || st.Timeouts-before.Timeouts != 1 || st.Available {
			t.Fatalf("%s: before %v\nafter %v", way, before, st)
		}
		time.Sleep(100 * time.Millisecond) // past the skip window
	}
	// The connections that failed are dialled again; a small batch (one
	// value a run at most) goes on one.
	d := tr.c.DialCount()
	if found := tr.GetInto(hs(1), [][]byte{make([]byte, bs)}); !found[0] {
		t.Fatal("after the skip window")
	}
	if tr.c.DialCount() > d+1 {
		t.Fatalf("a one-value batch dialled %d connections", tr.c.DialCount()-d)
	}
}

// slotHashes returns n block numbers from first whose keys (tr's) share
// slot.
func slotHashes(tr *Tier, slot, n int, first uint64) []uint64 {
	var out []uint64
	for x := first; len(out) < n; x++ {
		if resp.Slot([]byte(tr.Key(hashOf(x)))) == slot {
			out = append(out, x)
		}
	}
	return out
}

// A cluster's nodes each given their share split over connections: Put
// and ReadInto, and a slot holding many of the blocks migrated (ASK
// redirects, each after ASKING, split over the target's connections;
// then MOVED).
func TestClusterConns(t *testing.T) {
	const n, size = 90, 4096
	splitSmall(t, size)
	cl := redistest.StartCluster(t, redistest.Find(t), 3, 0)
	tr := newTier(t, Config{Addr: cl.Seed(), BlockBytes: size, OpTimeout: 2 * time.Second, Backoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, Conns: 4})
	slot := resp.Slot([]byte(tr.Key(hashOf(0))))
	blocks := append(seq(n), slotHashes(tr, slot, 20, n)...) // 21 blocks in slot
	keys := hs(blocks...)
	ps := make([][]byte, len(blocks))
	for i, b := range blocks {
		ps[i] = payload(b, size)
	}
	readAll := func(what string) {
		t.Helper()
		dst := make([][]byte, len(keys))
		for i := range dst {
			dst[i] = make([]byte, size)
		}
		for i, f := range tr.ReadInto(keys, dst) {
			if !f || !bytes.Equal(dst[i], ps[i]) {
				t.Fatalf("%s: block %d found %v: %v", what, blocks[i], f, tr.Stats())
			}
		}
	}
	if got := tr.Put(keys, ps); got != len(keys) {
		t.Fatalf("stored %d of %d: %v", got, len(keys), tr.Stats())
	}
	readAll("split over each node's connections")
	if d := tr.c.DialCount(); d != 3*4 {
		t.Fatalf("%d connections, want 4 a node", d)
	}
	src := cl.Owner(t, slot)
	dst := cl.Primaries[1]
	if dst == src {
		dst = cl.Primaries[2]
	}
	cl.BeginMigration(t, slot, src, dst)
	if moved := cl.MoveKeys(t, slot, src, dst, 1000); moved != 21 {
		t.Fatalf("%d keys moved", moved)
	}
	r0 := tr.Stats().Redirects
	readAll("mid-migration (ASK)")
	if r := tr.Stats().Redirects - r0; r != 21 {
		t.Fatalf("%d redirects followed, want 21", r)
	}
	if got := tr.Put(keys, ps); got != len(keys) {
		t.Fatalf("mid-migration: stored %d of %d: %v", got, len(keys), tr.Stats())
	}
	readAll("mid-migration, after the stores")
	cl.FinishMigration(t, slot, dst)
	cl.WaitOK(t)
	readAll("after the migration (MOVED)")
	if st := tr.Stats(); st.Timeouts != 0 || st.Errors != 0 || !st.Available {
		t.Fatalf("stats %v", st)
	}
}
