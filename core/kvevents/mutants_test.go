package kvevents

import (
	"bytes"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/prefix"
)

// readAll reads one message of at most maxFrames frames of at most
// maxFrame bytes from wire, handing commands to onCommand.
func readAll(wire []byte, maxFrame, maxFrames int, onCommand func(string, []byte)) ([][]byte, error) {
	z := &zconn{c: nopConn{}, r: bufioReader(wire)}
	return z.readMessage(maxFrame, maxFrames, onCommand)
}

// Frames of every size cross the short/long header boundary (255/256
// bytes) intact: a short header for at most 255 bytes, a long one above.
func TestFrameSizesRoundTrip(t *testing.T) {
	for _, n := range []int{0, 1, 254, 255, 256, 257, 1000, 65535, 65536} {
		body := bytes.Repeat([]byte{byte(n) | 1}, n)
		hdr := 2
		if n > 255 {
			hdr = 9
		}
		if f := appendFrame(nil, body, 0); len(f) != hdr+n || (f[0]&flagLong != 0) != (n > 255) {
			t.Fatalf("a %d-byte frame has %d bytes and flags %#x, want a %d-byte header", n, len(f), f[0], hdr)
		}
		wire := appendMessage(nil, []byte("topic"), body, []byte("end"))
		fr, err := readAll(wire, 1<<20, 3, nil)
		if err != nil {
			t.Fatalf("%d bytes: %v", n, err)
		}
		if len(fr) != 3 || string(fr[0]) != "topic" || !bytes.Equal(fr[1], body) || string(fr[2]) != "end" {
			t.Fatalf("%d bytes: read %d frames", n, len(fr))
		}
	}
}

// readMessage accepts a frame of exactly its limit and refuses one byte
// more; a command frame's limit is maxCommandSize.
func TestReadFrameLimits(t *testing.T) {
	const limit = 300
	for _, c := range []struct {
		n  int
		ok bool
	}{{limit - 1, true}, {limit, true}, {limit + 1, false}} {
		_, err := readAll(appendMessage(nil, make([]byte, c.n)), limit, 1, nil)
		if c.ok && err != nil {
			t.Fatalf("a %d-byte frame under a %d-byte limit: %v", c.n, limit, err)
		}
		if !c.ok && !errors.Is(err, errProtocol) {
			t.Fatalf("a %d-byte frame under a %d-byte limit: %v, want a protocol error", c.n, limit, err)
		}
	}
	// A command (name "X") of exactly maxCommandSize bytes, then a message.
	for _, c := range []struct {
		n  int
		ok bool
	}{{maxCommandSize, true}, {maxCommandSize + 1, false}} {
		cmd := append([]byte{1, 'X'}, make([]byte, c.n-2)...)
		wire := appendFrame(nil, cmd, flagCommand)
		wire = appendMessage(wire, []byte("m"))
		got := -1
		fr, err := readAll(wire, 16, 1, func(name string, body []byte) {
			if name == "X" {
				got = len(body)
			}
		})
		if c.ok && (err != nil || got != c.n-2 || len(fr) != 1) {
			t.Fatalf("a %d-byte command: %v (body %d bytes)", c.n, err, got)
		}
		if !c.ok && !errors.Is(err, errProtocol) {
			t.Fatalf("a %d-byte command: %v, want a protocol error", c.n, err)
		}
	}
}

// A message of maxFrames frames is read; one of maxFrames+1 is refused.
func TestReadMessageFrameCount(t *testing.T) {
	frames := [][]byte{[]byte("a"), []byte("b"), []byte("c"), []byte("d")}
	fr, err := readAll(appendMessage(nil, frames[:3]...), 16, 3, nil)
	if err != nil || len(fr) != 3 {
		t.Fatalf("three frames under a limit of three: %d frames, %v", len(fr), err)
	}
	if fr, err := readAll(appendMessage(nil, frames...), 16, 3, nil); !errors.Is(err, errProtocol) {
		t.Fatalf("four frames under a limit of three: %d frames, %v; want a protocol error", len(fr), err)
	}
}

// A frame whose flags set a reserved bit is a protocol error.
func TestReservedFrameFlagsRefused(t *testing.T) {
	for _, fl := range []byte{0x08, 0x10, 0x40, 0x80} {
		if fr, err := readAll([]byte{fl, 1, 'x'}, 16, 1, nil); !errors.Is(err, errProtocol) {
			t.Fatalf("flags %#x: %d frames, %v; want a protocol error", fl, len(fr), err)
		}
	}
	if fr, err := readAll([]byte{0, 1, 'x'}, 16, 1, nil); err != nil || len(fr) != 1 {
		t.Fatalf("flags 0: %d frames, %v", len(fr), err)
	}
}

// A batch message's sequence frame is 8 bytes: shorter or longer ones are
// refused, not read as a number.
func TestSequenceFrameIsEightBytes(t *testing.T) {
	for _, n := range []int{0, 7, 9, 16} {
		if _, err := parseMessage([][]byte{[]byte("t"), make([]byte, n), []byte("p")}); err == nil {
			t.Fatalf("a %d-byte sequence frame was accepted", n)
		}
	}
	m, err := parseMessage([][]byte{[]byte("t"), {0, 0, 0, 0, 0, 0, 1, 2}, []byte("p")})
	if err != nil || m.Seq != 258 || m.Topic != "t" || string(m.Payload) != "p" {
		t.Fatalf("%+v, %v", m, err)
	}
}

// One BlockStored carries a chain: blocks each of whose parent is the
// block before it, at most MaxBlocks of them.
func TestEncodeMergesOnlyChainsUpToMaxBlocks(t *testing.T) {
	h := func(b byte) prefix.Hash { return prefix.Hash{15: b, 0: 0xaa} }
	stored := func(hash, parent byte) prefix.Event {
		ev := prefix.Event{Kind: prefix.BlockStored, Hash: h(hash), Tokens: []int32{int32(hash), 0}, BlockSize: 2, Adapter: 3}
		if parent != 0 {
			ev.Parent = h(parent)
		}
		return ev
	}
	hashesOf := func(b *Batch) [][]Key {
		var out [][]Key
		for _, ev := range b.Events {
			out = append(out, ev.Hashes)
		}
		return out
	}
	keys := func(bs ...byte) []Key {
		var out []Key
		for _, b := range bs {
			out = append(out, KeyOf(h(b), HashBytes))
		}
		return out
	}
	// 1 <- 2, then 4 whose parent 9 is not 2, then 5 under 4.
	evs := []prefix.Event{stored(1, 0), stored(2, 1), stored(4, 9), stored(5, 4)}
	b, err := Decode(NewEncoder(Encoding{DPRank: -1}).Encode(1, evs))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := hashesOf(b), [][]Key{keys(1, 2), keys(4, 5)}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("events of hashes %v, want %v", got, want)
	}
	if b.Events[1].Parent == nil || *b.Events[1].Parent != KeyOf(h(9), HashBytes) {
		t.Fatalf("the second chain's parent: %v", b.Events[1].Parent)
	}
	// A chain of five under MaxBlocks 2: 2 + 2 + 1.
	evs = []prefix.Event{stored(1, 0), stored(2, 1), stored(3, 2), stored(4, 3), stored(5, 4)}
	b, err = Decode(NewEncoder(Encoding{DPRank: -1, MaxBlocks: 2}).Encode(1, evs))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := hashesOf(b), [][]Key{keys(1, 2), keys(3, 4), keys(5)}; !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("events of hashes %v, want %v", got, want)
	}
}

// waitFor polls cond until it holds, failing after five seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// publishOne flushes p and waits until it has published batch n-1 (n
// batches in all).
func publishOne(t *testing.T, p *Publisher, n int64) {
	t.Helper()
	p.Flush()
	waitFor(t, "a batch", func() bool { return p.Stats().Batches >= n })
}

// A batch larger than BufferBytes is still kept for replay, alone: the
// buffer never drops its newest batch.
func TestReplayKeepsTheNewestBatchPastBufferBytes(t *testing.T) {
	src := newIndexSource(t, 64, 2)
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0", BufferBytes: 1})
	publishOne(t, p, 1) // the snapshot taken at start
	src.insert(t, seqTokens(0, 4), nil)
	publishOne(t, p, 2)
	got, err := Replay(ep(p.ReplayAddr()), 0, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	if len(got) != 1 || got[0].Seq != 1 || st.BufferedSteps != 1 || st.BufferedBytes != int64(len(got[0].Payload)) {
		t.Fatalf("replay of %d batches (%+v), stats %+v; want batch 1 alone", len(got), got, st)
	}
}

// The replay buffer's byte count is that of the batches it holds.
func TestReplayBufferCountsWhatItHolds(t *testing.T) {
	src := newIndexSource(t, 64, 2)
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 2})
	publishOne(t, p, 1)
	for i := range 3 {
		src.insert(t, seqTokens(10*i, 2*(i+1)), nil)
		publishOne(t, p, int64(i+2))
	}
	got, err := Replay(ep(p.ReplayAddr()), 0, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var size int64
	for _, m := range got {
		size += int64(len(m.Payload))
	}
	if st := p.Stats(); len(got) != 2 || got[0].Seq != 2 || st.BufferedSteps != 2 || st.BufferedBytes != size {
		t.Fatalf("replay of %d batches, stats %+v; want batches 2 and 3, %d bytes", len(got), st, size)
	}
}

// A chain of stored blocks goes in one batch even past MaxBatchEvents, so
// that it stays one BlockStored.
func TestFlushNeverSplitsAChain(t *testing.T) {
	src := newIndexSource(t, 64, 2)
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0", MaxBatchEvents: 1})
	publishOne(t, p, 1)
	src.insert(t, seqTokens(0, 6), nil) // three blocks, one chain
	p.Flush()
	waitFor(t, "the chain's events", func() bool { return p.Stats().Events >= 4 })
	if st := p.Stats(); st.Batches != 2 {
		t.Fatalf("the chain went out in %d batches, want 1 (stats %+v)", st.Batches-1, st)
	}
	got, err := Replay(ep(p.ReplayAddr()), 1, 5*time.Second)
	if err != nil || len(got) != 1 {
		t.Fatalf("replay: %d batches, %v", len(got), err)
	}
	b, err := Decode(got[0].Payload)
	if err != nil || len(b.Events) != 1 || len(b.Events[0].Hashes) != 3 {
		t.Fatalf("the chain's batch: %+v, %v; want one BlockStored of 3 blocks", b, err)
	}
}

// countingSource counts a source's snapshots and drains.
type countingSource struct {
	*indexSource
	snaps, drains atomic.Int64
}

func (c *countingSource) Drain() ([]prefix.Event, error) {
	c.drains.Add(1)
	return c.indexSource.Drain()
}

func (c *countingSource) Snapshot() error {
	c.snaps.Add(1)
	return c.indexSource.Snapshot()
}

// Replay clients get one snapshot per snapshotInterval: a second request
// within it is answered (the end marker) but takes no snapshot.
func TestSnapshotRequestsAreRateLimited(t *testing.T) {
	// The check needs the two requests within one interval; on a machine
	// too busy for that, the attempt starts over with a new publisher.
	for attempt := range 5 {
		if snapshotRateLimitOnce(t) {
			return
		}
		t.Logf("attempt %d: the two requests were a whole interval apart; again", attempt)
	}
	t.Fatalf("five attempts could not place two snapshot requests within %v", snapshotInterval)
}

// snapshotRateLimitOnce runs the check once; false when the requests came
// too far apart for it to tell anything.
func snapshotRateLimitOnce(t *testing.T) bool {
	src := &countingSource{indexSource: newIndexSource(t, 64, 2)}
	p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	if n := src.snaps.Load(); n != 1 {
		t.Fatalf("%d snapshots at start, want 1", n)
	}
	t0 := time.Now()
	if err := RequestSnapshot(ep(p.ReplayAddr()), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the requested snapshot", func() bool { return src.snaps.Load() == 2 })
	if err := RequestSnapshot(ep(p.ReplayAddr()), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d >= snapshotInterval {
		return false
	}
	// Two drains after the second request's answer: a whole flush ran
	// after it, which would have taken a snapshot it granted.
	d0 := src.drains.Load()
	waitFor(t, "two flushes", func() bool {
		p.Flush()
		return src.drains.Load() >= d0+2
	})
	if n, st := src.snaps.Load(), p.Stats(); n != 2 || st.Snapshots != 2 || st.ReplayReqs != 2 {
		t.Fatalf("%d snapshots taken, stats %+v; want the second request refused", n, st)
	}
	return true
}
