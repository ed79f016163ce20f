package valkey

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvplug/kvplug/internal/redistest"
	"github.com/zeebo/xxh3"
)

// reads reads hashes in each way the tier has (Get, GetInto, ReadInto,
// GetSegments in two pieces) and fails t unless they agree: the same
// blocks found, with the same payloads, each way counting the same hits,
// misses, corrupt values and MAC failures. GetInto and GetSegments leave
// a missed block's buffer untouched. It returns Get's payloads.
func reads(t *testing.T, tr *Tier, hashes []Hash, size int) [][]byte {
	t.Helper()
	counts := func(s Stats) [4]int64 { return [4]int64{s.Hits, s.Misses, s.Corrupt, s.MACFailures} }
	delta := func(f func()) [4]int64 {
		before := counts(tr.Stats())
		f()
		after := counts(tr.Stats())
		for i := range after {
			after[i] -= before[i]
		}
		return after
	}
	var got [][]byte
	want := delta(func() { got = tr.Get(hashes) })
	fill := func() [][]byte {
		dst := make([][]byte, len(hashes))
		for i := range dst {
			dst[i] = bytes.Repeat([]byte{0xa5}, size)
		}
		return dst
	}
	untouched := bytes.Repeat([]byte{0xa5}, size)
	check := func(way string, found []bool, dst [][]byte, d [4]int64, keep bool) {
		t.Helper()
		if d != want {
			t.Fatalf("%s counted (hits, misses, corrupt, MAC failures) %v, Get %v", way, d, want)
		}
		for i := range hashes {
			switch {
			case found[i] != (got[i] != nil):
				t.Fatalf("%s: block %d found %v, Get %v", way, i, found[i], got[i] != nil)
			case found[i] && !bytes.Equal(dst[i], got[i]):
				t.Fatalf("%s: block %d's payload differs from Get's", way, i)
			case !found[i] && keep && !bytes.Equal(dst[i], untouched):
				t.Fatalf("%s: a missed block's buffer was written", way)
			}
		}
	}
	for _, way := range []string{"GetInto", "ReadInto", "GetSegments"} {
		dst := fill()
		var found []bool
		d := delta(func() {
			switch way {
			case "GetInto":
				found = tr.GetInto(hashes, dst)
			case "ReadInto":
				found = tr.ReadInto(hashes, dst)
			default:
				segs := make([][][]byte, len(dst))
				for i, b := range dst {
					segs[i] = [][]byte{b[:size/3], b[size/3:]}
				}
				found = tr.GetSegments(hashes, segs)
			}
		})
		check(way, found, dst, d, way != "ReadInto")
	}
	return got
}

// The values TestCorruptValuesAreMisses and TestMAC store, read every way:
// the checks made as a value streams in are decode's.
func TestStreamedChecks(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	for _, mac := range []bool{false, true} {
		t.Run(fmt.Sprint("mac=", mac), func(t *testing.T) {
			const bs = 300
			cfg := Config{Addr: srv.Addr(), Namespace: fmt.Sprint("mac", mac), Fingerprint: 42, BlockBytes: bs, OpTimeout: time.Second}
			if mac {
				cfg.MACKeys = Secret{Value: []byte(keyA)}
			}
			tr := newTier(t, cfg)
			set := func(h uint64, v []byte) { raw(t, srv.Addr(), []byte("SET"), []byte(tr.Key(hashOf(h))), v) }
			if tr.Put(hs(1), [][]byte{payload(1, bs)}) != 1 {
				t.Fatal("put")
			}
			good, _ := raw(t, srv.Addr(), []byte("GET"), []byte(tr.Key(hashOf(1)))).([]byte)
			retarget := func(v []byte, h uint64) []byte {
				v = bytes.Clone(v)
				x := hashOf(h)
				copy(v[8:24], x[:])
				return v
			}
			mut := func(h uint64, f func(v []byte)) []byte {
				v := retarget(good, h)
				f(v)
				return v
			}
			head := tr.header
			otherKey, _ := EncodeMAC(cfg.Namespace, hashOf(17), 42, []byte(keyB), payload(17, bs))
			otherNS, _ := EncodeMAC("other", hashOf(18), 42, []byte(keyA), payload(18, bs))
			values := [][]byte{
				nil, []byte("KVPB"), good[:HeaderBytes], good[:head], good[:len(good)-1], append(bytes.Clone(good), 0),
				mut(8, func(v []byte) { v[0] = 'X' }),
				mut(9, func(v []byte) { v[4] = 1 }),
				mut(10, func(v []byte) { v[6] ^= 1 }),
				mut(11, func(v []byte) { v[32]++ }),
				mut(12, func(v []byte) { v[head+7] ^= 4 }),
				mut(13, func(v []byte) { v[41] ^= 1 }),
				mut(14, func(v []byte) { binary.LittleEndian.PutUint64(v[24:], 43) }),
				Encode(hashOf(15), 42, payload(15, bs)),   // no MAC
				Encode(hashOf(16), 42, payload(16, bs-1)), // another block size
				otherKey, otherNS,
				mut(19, func(v []byte) { // altered, its checksum fixed
					v[head+3] ^= 1
					binary.LittleEndian.PutUint64(v[40:], xxh3.Hash(v[head:]))
				}),
				mut(20, func(v []byte) {}), // block 1's value, its hash rewritten to 20's
				good,                       // block 1's value under block 21's key
			}
			keys := []uint64{1}
			for i, v := range values {
				h := uint64(100 + i)
				if i >= 6 {
					h = uint64(8 + i - 6)
				}
				set(h, v)
				keys = append(keys, h)
			}
			keys = append(keys, 999) // absent
			// A key of another type: a miss and an error.
			raw(t, srv.Addr(), []byte("SADD"), []byte(tr.Key(hashOf(998))), []byte("m"))
			keys = append(keys, 998)
			got := reads(t, tr, hs(keys...), bs)
			for i, g := range got {
				h := keys[i]
				// Without a MAC a value altered with its checksum fixed, or
				// moved with its hash rewritten, passes: the MAC is what
				// stops those.
				want := h == 1 || (!mac && (h == 15 || h == 19 || h == 20))
				if (g != nil) != want {
					t.Fatalf("block %d (value %d): found %v", h, i, g != nil)
				}
			}
			if st := tr.Stats(); st.Timeouts != 0 || !st.Available || (st.MACFailures != 0) != mac {
				t.Fatalf("stats %v", st)
			}
		})
	}
}

// Batches larger than the GET window (values of 1 MiB: 7 in flight), with
// misses and a corrupt value among them, with and without a MAC and a TTL.
func TestLargeBatchesInAWindow(t *testing.T) {
	srv := redistest.Start(t, redistest.Find(t), 0)
	const n, bs = 40, 1 << 20
	for _, mode := range []string{"", "mac", "ttl"} {
		t.Run(mode, func(t *testing.T) {
			cfg := Config{Addr: srv.Addr(), Namespace: "w" + mode, BlockBytes: bs, OpTimeout: 30 * time.Second}
			switch mode {
			case "mac":
				cfg.MACKeys = Secret{Value: []byte(keyA)}
			case "ttl":
				cfg.TTL = time.Hour
			}
			tr := newTier(t, cfg)
			keys := hs(seq(n)...)
			ps := make([][]byte, n)
			for i := range ps {
				ps[i] = payload(uint64(i), bs)
			}
			if tr.Put(keys[:n-5], ps[:n-5]) != n-5 {
				t.Fatalf("put: %v", tr.Stats())
			}
			v, _ := raw(t, srv.Addr(), []byte("GET"), []byte(tr.Key(keys[3]))).([]byte)
			v[len(v)-1] ^= 1
			raw(t, srv.Addr(), []byte("SET"), []byte(tr.Key(keys[3])), v)
			if mode == "ttl" {
				if ttl, _ := raw(t, srv.Addr(), []byte("PTTL"), []byte(tr.Key(keys[7]))).(int64); ttl <= 0 {
					t.Fatalf("PTTL %d", ttl)
				}
			}
			got := reads(t, tr, keys, bs)
			for i, g := range got {
				if want := i != 3 && i < n-5; (g != nil) != want || (want && !bytes.Equal(g, ps[i])) {
					t.Fatalf("block %d: found %v", i, g != nil)
				}
			}
		})
	}
}

// A call that fails midway (here a server that stops in the middle of the
// third value) keeps the values read whole before: found, counted hits;
// the rest are misses, and GetInto leaves their buffers untouched.
func TestFailedMidwayKeepsWholeValues(t *testing.T) {
	const bs = 1000
	values := [][]byte{Encode(hashOf(1), 5, payload(1, bs)), Encode(hashOf(2), 6, payload(2, bs)), Encode(hashOf(3), 5, payload(3, bs))}
	var mu sync.Mutex
	sent := map[net.Conn]int{} // replies, by connection: each starts from the first value
	addr := redistest.Scripted(t, func(c net.Conn, _ string) bool {
		mu.Lock()
		i := sent[c]
		sent[c]++
		mu.Unlock()
		v := values[i]
		fmt.Fprintf(c, "$%d\r\n", len(v))
		if i == 2 {
			c.Write(v[:len(v)/2])
			time.Sleep(time.Second)
			return false
		}
		c.Write(append(bytes.Clone(v), '\r', '\n'))
		return true
	})
	tr := newTier(t, Config{Addr: addr, Fingerprint: 5, BlockBytes: bs, OpTimeout: 300 * time.Millisecond})
	for _, way := range []string{"GetInto", "ReadInto"} {
		dst := [][]byte{make([]byte, bs), make([]byte, bs), make([]byte, bs)}
		before := tr.Stats()
		var found []bool
		if way == "GetInto" {
			found = tr.GetInto(hs(1, 2, 3), dst)
		} else {
			found = tr.ReadInto(hs(1, 2, 3), dst)
		}
		st := tr.Stats()
		if !found[0] || found[1] || found[2] || !bytes.Equal(dst[0], payload(1, bs)) {
			t.Fatalf("%s: found %v", way, found)
		}
		if way == "GetInto" && (!bytes.Equal(dst[1], make([]byte, bs)) || !bytes.Equal(dst[2], make([]byte, bs))) {
			t.Fatalf("GetInto wrote a missed block's buffer")
		}
		if st.Hits-before.Hits != 1 || st.Corrupt-before.Corrupt != 1 || st.Misses-before.Misses != 1 || st.Timeouts-before.Timeouts != 1 || st.Available {
			t.Fatalf("%s: before %v\nafter %v", way, before, st)
		}
		time.Sleep(DefaultBackoff + 100*time.Millisecond) // past the skip window
	}
}

// FuzzReadValue: a value read as it streams (readValue, into the caller's
// memory or a scratch buffer) is accepted exactly when decode accepts it,
// with the same payload, and exactly its bytes are consumed.
func FuzzReadValue(f *testing.F) {
	p := payload(3, 64)
	plain := Encode(hashOf(3), 9, p)
	withMAC, _ := EncodeMAC("fz", hashOf(3), 9, []byte(keyA), p)
	f.Add(plain, false, uint8(64), uint8(64))
	f.Add(withMAC, true, uint8(64), uint8(64))
	f.Add(plain[:60], false, uint8(0), uint8(12))
	f.Add(withMAC, false, uint8(0), uint8(64))
	f.Add(plain, true, uint8(64), uint8(64))
	f.Add([]byte("KVPB"), false, uint8(0), uint8(0))
	tiers := map[bool]map[bool]*Tier{}
	for _, mac := range []bool{false, true} {
		tiers[mac] = map[bool]*Tier{}
		for _, fixed := range []bool{false, true} {
			cfg := Config{Addr: "127.0.0.1:1", Namespace: "fz", Fingerprint: 9}
			if fixed {
				cfg.BlockBytes = 64
			}
			if mac {
				cfg.MACKeys = Secret{Value: []byte(keyA + "," + keyB)}
			}
			tr, err := New(cfg)
			if err != nil {
				f.Fatal(err)
			}
			tiers[mac][fixed] = tr
		}
	}
	f.Fuzz(func(t *testing.T, v []byte, mac bool, blockBytes, size uint8) {
		tr := tiers[mac][blockBytes == 64]
		want, ok := tr.decode(hashOf(3), v)
		if ok && len(want) != int(size) {
			ok = false // the caller's buffer is of another size: a miss
		}
		for _, direct := range []bool{false, true} {
			dst := bytes.Repeat([]byte{0xa5}, int(size))
			segs := [][]byte{dst[:size/2], dst[size/2:]}
			tail := []byte("\r\nNEXT")
			r := bufio.NewReaderSize(bytes.NewReader(append(bytes.Clone(v), tail...)), 16)
			got, err := tr.readValue(hashOf(3), len(v), r, segs, direct)
			if err != nil {
				t.Fatalf("direct %v: %v", direct, err)
			}
			if got != ok {
				t.Fatalf("direct %v: readValue %v, decode %v", direct, got, ok)
			}
			if ok && !bytes.Equal(dst, want) {
				t.Fatalf("direct %v: another payload", direct)
			}
			if !ok && !direct && !bytes.Equal(dst, bytes.Repeat([]byte{0xa5}, int(size))) {
				t.Fatal("a miss wrote the caller's buffer")
			}
			if rest, _ := io.ReadAll(r); !bytes.Equal(rest, tail) {
				t.Fatalf("direct %v: %q left after the value", direct, rest)
			}
		}
	})
}

// A lookup never waits behind a store: with a server that answers EXISTS
// at once and holds every SET without a reply, an Exists issued while a
// Put is in flight returns the server's answer, not the miss of a call
// that found the connection busy until its timeout.
func TestLookupDoesNotWaitBehindStore(t *testing.T) {
	const bs = 1000
	setSeen := make(chan struct{}, 1)
	addr := redistest.Scripted(t, func(c net.Conn, verb string) bool {
		switch verb {
		case "EXISTS":
			io.WriteString(c, ":1\r\n")
		case "SET":
			select {
			case setSeen <- struct{}{}:
			default:
			}
			// No reply: the store's call holds its connection until its timeout.
		}
		return true
	})
	tr := newTier(t, Config{Addr: addr, BlockBytes: bs, OpTimeout: 3 * time.Second})
	putDone := make(chan int)
	go func() { putDone <- tr.Put(hs(1), [][]byte{payload(1, bs)}) }()
	select {
	case <-setSeen:
	case <-time.After(bound):
		t.Fatal("the server never saw the SET")
	}
	start := time.Now()
	held := tr.Exists(hs(2, 3))
	if took := time.Since(start); !held[0] || !held[1] || took > time.Second {
		t.Fatalf("Exists behind a pending Put: held %v after %v", held, took)
	}
	select {
	case n := <-putDone:
		t.Fatalf("the Put returned %d while its SET had no reply", n)
	default:
	}
	if n := <-putDone; n != 0 {
		t.Fatalf("a Put that timed out stored %d", n)
	}
}
