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
		if len(b.Events) != 4 {
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
		if r := b.Events[3]; r.Kind != KindRemoved || len(r.Hashes) != 2 || r.Hashes[0] != KeyOf(evs[4].Hashes[0], enc.Hashes) {
			t.Fatalf("%+v: removed %+v", enc, r)
		}
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
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := Decode(p)
		if err != nil {
			return
		}
		for _, ev := range b.Events {
			if ev.Kind == KindStored && len(ev.Tokens) != len(ev.Hashes)*ev.BlockSize {
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
