package kvevents

import (
	"bufio"
	"bytes"
	"net"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/prefix"
)

func sampleEvents() []prefix.Event {
	h := func(b byte) prefix.Hash { return prefix.Hash{b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, b} }
	return []prefix.Event{
		{Kind: prefix.AllCleared},
		{Kind: prefix.BlockStored, Hash: h(1), Tokens: []int32{1, 2}, BlockSize: 2, Adapter: 4,
			MM: []prefix.BlockMM{{Offset: -1, Hash: h(9)}}},
		{Kind: prefix.BlockStored, Hash: h(2), Parent: h(1), Tokens: []int32{-3, 1 << 30}, BlockSize: 2, Adapter: 4},
		{Kind: prefix.BlockStored, Hash: h(3), Parent: h(7), Tokens: []int32{5, 6}, BlockSize: 2},
		{Kind: prefix.BlockRemoved, Hashes: []prefix.Hash{h(2), h(1)}},
		// The host tier's: a chain of CPU blocks (one event), a GPU block
		// that continues it (not merged: another medium), a removal.
		{Kind: prefix.BlockStored, Medium: prefix.MediumCPU, Hash: h(4), Parent: h(2), Tokens: []int32{7, 8}, BlockSize: 2, Adapter: 4},
		{Kind: prefix.BlockStored, Medium: prefix.MediumCPU, Hash: h(5), Parent: h(4), Tokens: []int32{9, 10}, BlockSize: 2, Adapter: 4},
		{Kind: prefix.BlockStored, Hash: h(6), Parent: h(5), Tokens: []int32{11, 12}, BlockSize: 2, Adapter: 4},
		{Kind: prefix.BlockRemoved, Medium: prefix.MediumCPU, Hashes: []prefix.Hash{h(5)}},
		{Kind: prefix.BlockStored, Medium: prefix.MediumShared, Hash: h(8), Tokens: []int32{1, 1}, BlockSize: 2},
	}
}

// Encode then Decode gives the events back, in both layouts and hash forms.
func TestWireRoundTrip(t *testing.T) {
	for _, enc := range []Encoding{
		{Format: FormatMap, Hashes: HashBytes, Medium: "GPU", DPRank: -1},
		{Format: FormatArray, Hashes: HashInt64, Medium: "CPU", DPRank: 7},
	} {
		e := NewEncoder(enc)
		b, err := Decode(bytes.Clone(e.Encode(12.5, sampleEvents())))
		if err != nil {
			t.Fatal(err)
		}
		if b.TS != 12.5 || (enc.DPRank >= 0) != (b.DPRank != nil) {
			t.Fatalf("%+v: ts %v dp %v", enc, b.TS, b.DPRank)
		}
		// The chain 1 -> 2 merges; block 3 (another parent) does not.
		if len(b.Events) != 8 {
			t.Fatalf("%+v: %d events", enc, len(b.Events))
		}
		ev := b.Events[1]
		evs := sampleEvents()
		if ev.Kind != KindStored || len(ev.Hashes) != 2 || ev.Hashes[1] != KeyOf(evs[2].Hash, enc.Hashes) || ev.Parent != nil ||
			ev.Tokens[2] != -3 || ev.Tokens[3] != 1<<30 || *ev.LoRAID != 4 || *ev.Medium != enc.Medium || len(ev.ExtraKeys) != 2 || ev.ExtraKeys[1] != nil {
			t.Fatalf("%+v: merged event %+v", enc, ev)
		}
		if p := b.Events[2].Parent; p == nil || *p != KeyOf(evs[3].Parent, enc.Hashes) || b.Events[2].LoRAID != nil || b.Events[2].ExtraKeys != nil {
			t.Fatalf("%+v: event 2 %+v", enc, b.Events[2])
		}
		if r := b.Events[3]; r.Kind != KindRemoved || len(r.Hashes) != 2 || r.Hashes[0] != KeyOf(evs[4].Hashes[0], enc.Hashes) || *r.Medium != enc.Medium {
			t.Fatalf("%+v: removed %+v", enc, r)
		}
		// Each event's medium: the configured name for the GPU's, the
		// medium's own for the host tier's and the shared tier's.
		for i, want := range []struct {
			kind, hashes int
			medium       string
			m            prefix.Medium
		}{{KindStored, 2, "CPU", prefix.MediumCPU}, {KindStored, 1, enc.Medium, prefix.MediumGPU},
			{KindRemoved, 1, "CPU", prefix.MediumCPU}, {KindStored, 1, "SHARED", prefix.MediumShared}} {
			ev := b.Events[4+i]
			m, ok := ev.MediumOf()
			if ev.Kind != want.kind || len(ev.Hashes) != want.hashes || ev.Medium == nil || *ev.Medium != want.medium ||
				(want.medium != enc.Medium && (!ok || m != want.m)) {
				t.Fatalf("%+v: event %d %+v, want %+v", enc, 4+i, ev, want)
			}
		}
		if cpu := b.Events[4]; cpu.Parent == nil || *cpu.Parent != KeyOf(evs[5].Parent, enc.Hashes) || len(cpu.Tokens) != 4 || cpu.Tokens[3] != 10 {
			t.Fatalf("%+v: CPU chain %+v", enc, cpu)
		}
	}
}

// vLLM's OffloadingConnector sends its CPU blocks without tokens or parent
// (token_ids [], block_size the offloaded block's or 0): Decode takes them;
// an event without token_ids at all is still refused.
func TestDecodeHashOnlyStored(t *testing.T) {
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	for _, bs := range []byte{0, 16} {
		p := []byte{0x92, 0x01, 0x91, 0x86}
		p = str(p, "type")
		p = str(p, "BlockStored")
		p = str(p, "block_hashes")
		p = append(p, 0x92, 0x05, 0x06)
		p = str(p, "parent_block_hash")
		p = append(p, 0xc0)
		p = str(p, "token_ids")
		p = append(p, 0x90)
		p = str(p, "block_size")
		p = append(p, bs)
		p = str(p, "medium")
		p = str(p, "cpu")
		b, err := Decode(p)
		if err != nil {
			t.Fatalf("block size %d: %v", bs, err)
		}
		ev := b.Events[0]
		m, ok := ev.MediumOf()
		if len(ev.Hashes) != 2 || ev.Hashes[1][15] != 6 || len(ev.Tokens) != 0 || ev.BlockSize != int(bs) || !ok || m != prefix.MediumCPU {
			t.Fatalf("decoded %+v (%v %v)", ev, m, ok)
		}
	}
	if m, ok := (&DecodedEvent{}).MediumOf(); !ok || m != prefix.MediumGPU {
		t.Fatal("no medium is the GPU")
	}
	pinned := "CPU_PINNED" // SGLang's host tier
	if m, ok := (&DecodedEvent{Medium: &pinned}).MediumOf(); !ok || m != prefix.MediumCPU {
		t.Fatal("SGLang's CPU_PINNED is the CPU tier")
	}
	s := "DISK"
	if _, ok := (&DecodedEvent{Medium: &s}).MediumOf(); ok {
		t.Fatal("an unknown medium")
	}
}

// vLLM's SHA-256 block hashes (32 bytes) decode as digests: names of
// the engine's blocks, distinct per hash, never taken for kvplug's.
func TestDecodeForeignHashes(t *testing.T) {
	str := func(b []byte, s string) []byte { return append(append(b, 0xa0|byte(len(s))), s...) }
	hash := func(b []byte, fill byte, n int) []byte {
		b = append(b, 0xc4, byte(n))
		return append(b, bytes.Repeat([]byte{fill}, n)...)
	}
	p := []byte{0x92, 0x01, 0x91, 0x82}
	p = str(p, "type")
	p = str(p, "BlockRemoved")
	p = str(p, "block_hashes")
	p = append(p, 0x93)
	p = hash(p, 1, 32)
	p = hash(p, 2, 32)
	p = hash(p, 3, 16)
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	ev := b.Events[0]
	if len(ev.Hashes) != 3 || ev.Hashes[0] == ev.Hashes[1] || ev.Hashes[0] != Key(prefix.Sum(bytes.Repeat([]byte{1}, 32))) ||
		ev.Hashes[2] != Key(bytes.Repeat([]byte{3}, 16)) {
		t.Fatalf("decoded %+v", ev)
	}
	// The event's format is its last hash's; a 32-byte one alone is a digest.
	p = []byte{0x92, 0x01, 0x91, 0x82}
	p = str(p, "type")
	p = str(p, "BlockRemoved")
	p = str(p, "block_hashes")
	p = hash(append(p, 0x91), 7, 32)
	if b, err = Decode(p); err != nil || b.Events[0].HashFormat != HashDigest {
		t.Fatalf("a 32-byte hash: %v %+v", err, b)
	}
	q := []byte{0x92, 0x01, 0x91, 0x82}
	q = str(q, "type")
	q = str(q, "BlockRemoved")
	q = str(q, "block_hashes")
	q = append(q, 0x91, 0xc4, 65)
	q = append(q, make([]byte, 65)...)
	if _, err := Decode(q); err == nil {
		t.Fatal("a 65-byte hash decoded")
	}
}

func TestDecodeRejects(t *testing.T) {
	e := NewEncoder(Encoding{DPRank: -1, Medium: "GPU"})
	good := bytes.Clone(e.Encode(1, sampleEvents()))
	for name, p := range map[string][]byte{
		"empty":        nil,
		"truncated":    good[:len(good)-3],
		"trailing":     append(bytes.Clone(good), 0xc0),
		"not a batch":  {0xa3, 'a', 'b', 'c'},
		"one element":  {0x91, 0x01},
		"huge events":  {0x92, 0x01, 0xdd, 0x7f, 0xff, 0xff, 0xff},
		"unknown type": {0x92, 0x01, 0x91, 0x81, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'F', 'o', 'o'},
		"stored, no tokens": {0x92, 0x01, 0x91, 0x83, 0xa4, 't', 'y', 'p', 'e', 0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd',
			0xac, 'b', 'l', 'o', 'c', 'k', '_', 'h', 'a', 's', 'h', 'e', 's', 0x91, 0x05,
			0xaa, 'b', 'l', 'o', 'c', 'k', '_', 's', 'i', 'z', 'e', 0x02},
	} {
		if _, err := Decode(p); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
}

// FuzzDecode feeds the decoder hostile payloads: it must return an error
// or a batch whose stored events are consistent, never panic or allocate
// beyond what the input can describe.
func FuzzDecode(f *testing.F) {
	for _, enc := range []Encoding{{DPRank: -1, Medium: "GPU"}, {Format: FormatArray, Hashes: HashInt64, DPRank: 2}} {
		f.Add(bytes.Clone(NewEncoder(enc).Encode(3, sampleEvents())))
	}
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90})
	// A BlockRemoved of one 32-byte hash (vLLM's SHA-256 form).
	removed := append([]byte{0x92, 0x01, 0x91, 0x82, 0xa4, 't', 'y', 'p', 'e', 0xac}, "BlockRemoved"...)
	removed = append(append(removed, 0xac), "block_hashes"...)
	f.Add(append(append(removed, 0x91, 0xc4, 32), bytes.Repeat([]byte{7}, 32)...))
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := Decode(p)
		if err != nil {
			return
		}
		for _, ev := range b.Events {
			if ev.Kind == KindStored && len(ev.Tokens) != 0 && len(ev.Tokens) != len(ev.Hashes)*ev.BlockSize {
				t.Fatalf("inconsistent stored event %+v", ev)
			}
		}
	})
}

// FuzzReadMessage feeds the frame reader hostile bytes after a valid handshake.
func FuzzReadMessage(f *testing.F) {
	f.Add(appendMessage(nil, []byte("kv"), make([]byte, 8), []byte{0x90}))
	f.Add([]byte{flagLong, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{flagCommand, 5, 4, 'P', 'I', 'N', 'G'})
	f.Fuzz(func(t *testing.T, p []byte) {
		z := &zconn{c: nopConn{}, r: bufioReader(p)}
		for range 4 {
			fr, err := z.readMessage(1<<16, 8, nil)
			if err != nil {
				return
			}
			if len(fr) == 0 || len(fr) > 8 {
				t.Fatalf("%d frames", len(fr))
			}
		}
	})
}

// A read deadline that expires in the middle of a message (subscribers
// poll with short deadlines) loses nothing: the next read goes on.
func TestRecvResumesAfterTimeout(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	payload := bytes.Repeat([]byte{7}, 1000)
	var seq [8]byte
	seq[7] = 42
	wire := appendMessage(nil, []byte("topic"), seq[:], payload)
	go func() {
		for i := 0; i < len(wire); i += 97 {
			_, _ = b.Write(wire[i:min(i+97, len(wire))])
			time.Sleep(3 * time.Millisecond)
		}
	}()
	s := &SubConn{z: &zconn{c: a, r: bufio.NewReaderSize(a, 64)}}
	timeouts := 0
	for {
		_ = s.SetDeadline(time.Now().Add(time.Millisecond))
		m, err := s.Recv()
		if err != nil {
			if !isTimeout(err) {
				t.Fatal(err)
			}
			timeouts++
			continue
		}
		if m.Topic != "topic" || m.Seq != 42 || !bytes.Equal(m.Payload, payload) {
			t.Fatalf("message %q %d %d bytes", m.Topic, m.Seq, len(m.Payload))
		}
		break
	}
	if timeouts == 0 {
		t.Fatal("no read timed out mid-message: the test tested nothing")
	}
}
