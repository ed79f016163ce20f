package kvevents

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvplug/kvplug/core/prefix"
	"github.com/tinylib/msgp/msgp"
)

// clearedEvent returns the raw msgpack of the first event of a batch
// payload whose first event is an AllBlocksCleared.
func clearedEvent(t *testing.T, payload []byte) []byte {
	t.Helper()
	_, p, err := msgp.ReadArrayHeaderBytes(payload)
	if err != nil {
		t.Fatal(err)
	}
	if _, p, err = msgp.ReadFloat64Bytes(p); err != nil {
		t.Fatal(err)
	}
	if _, p, err = msgp.ReadArrayHeaderBytes(p); err != nil {
		t.Fatal(err)
	}
	rest, err := msgp.Skip(p)
	if err != nil {
		t.Fatal(err)
	}
	return p[:len(p)-len(rest)]
}

// The map form's AllBlocksCleared carries SnapshotRestField when batches
// follow, as its one field besides vLLM's "type"; the positional form and
// a batch that completes its set carry nothing, byte for byte vLLM's.
func TestSnapshotRestEncoding(t *testing.T) {
	evs := []prefix.Event{{Kind: prefix.AllCleared}, sampleEvents()[1]}
	for _, f := range []Format{FormatMap, FormatArray} {
		e := NewEncoder(Encoding{Format: f, DPRank: -1})
		plain := bytes.Clone(e.Encode(1, evs))
		if got := e.EncodeSnapshot(1, evs, 0); !bytes.Equal(got, plain) {
			t.Fatalf("format %d: a snapshot in one batch differs from Encode's", f)
		}
		ext := bytes.Clone(e.EncodeSnapshot(1, evs, 7))
		b, err := Decode(ext)
		if err != nil {
			t.Fatal(err)
		}
		want := int64(7)
		if f == FormatArray {
			want = 0
			if !bytes.Equal(ext, plain) {
				t.Fatalf("the positional form carries the extent: %x", ext)
			}
		}
		if b.Events[0].Kind != KindCleared || b.Events[0].SnapshotRest != want || b.Events[1].Kind != KindStored || b.Events[1].SnapshotRest != 0 {
			t.Fatalf("format %d: decoded %+v", f, b.Events)
		}
		if f == FormatArray {
			continue
		}
		// vLLM's shape: a map of "type" and fields a decoder of vLLM's
		// structs skips when it does not know them.
		raw := clearedEvent(t, ext)
		var m map[string]any
		if v, _, err := msgp.ReadIntfBytes(raw); err != nil {
			t.Fatal(err)
		} else {
			m = v.(map[string]any)
		}
		if len(m) != 2 || m["type"] != "AllBlocksCleared" || m[SnapshotRestField] != int64(7) {
			t.Fatalf("AllBlocksCleared on the wire: %#v", m)
		}
		if plainRaw := clearedEvent(t, plain); !bytes.Equal(plainRaw, msgp.AppendString(msgp.AppendString(msgp.AppendMapHeader(nil, 1), "type"), "AllBlocksCleared")) {
			t.Fatalf("vLLM's AllBlocksCleared: %x", plainRaw)
		}
	}
	// A vLLM batch's AllBlocksCleared (no extent), and the field among
	// others a later producer may add: decoded, unknown fields skipped.
	p := msgp.AppendArrayHeader(nil, 2)
	p = msgp.AppendFloat64(p, 1)
	p = msgp.AppendArrayHeader(p, 2)
	p = msgp.AppendMapHeader(p, 1)
	p = msgp.AppendString(msgp.AppendString(p, "type"), "AllBlocksCleared")
	p = msgp.AppendMapHeader(p, 3)
	p = msgp.AppendInt(msgp.AppendString(p, SnapshotRestField), 3)
	p = msgp.AppendString(msgp.AppendString(p, "medium"), "GPU")
	p = msgp.AppendString(msgp.AppendString(p, "type"), "AllBlocksCleared")
	b, err := Decode(p)
	if err != nil || len(b.Events) != 2 || b.Events[0].SnapshotRest != 0 || b.Events[1].SnapshotRest != 3 || b.Events[1].Kind != KindCleared {
		t.Fatalf("decoded %+v, %v", b, err)
	}
	// An extent out of range is a malformed batch.
	for _, bad := range []int64{-1, MaxSnapshotRest + 1} {
		q := msgp.AppendArrayHeader(nil, 2)
		q = msgp.AppendFloat64(q, 1)
		q = msgp.AppendArrayHeader(q, 1)
		q = msgp.AppendMapHeader(q, 2)
		q = msgp.AppendString(msgp.AppendString(q, "type"), "AllBlocksCleared")
		q = msgp.AppendInt64(msgp.AppendString(q, SnapshotRestField), bad)
		if _, err := Decode(q); err == nil {
			t.Fatalf("extent %d decoded", bad)
		}
	}
}

// A snapshot cut into batches names, on its AllBlocksCleared, how many
// follow: exactly those that bring the rest of the cache.
func TestSnapshotSpanningBatchesNamesItsExtent(t *testing.T) {
	for _, f := range []Format{FormatMap, FormatArray} {
		src := newIndexSource(t, 64, 2)
		p := startPub(t, src, Config{ReplayEndpoint: "tcp://127.0.0.1:0", MaxBatchEvents: 4, Encoding: Encoding{Format: f, DPRank: -1, MaxBlocks: 2}})
		s := subscribe(t, p, "")
		recvBatch(t, p, s) // the empty cache's snapshot: one batch
		for i := range 20 {
			src.insert(t, seqTokens(1000*i, 4), nil) // 20 chains of 2 blocks
		}
		for n := 0; n < 40; {
			_, b := recvBatch(t, p, s) // the insertions' events span batches too
			for _, e := range b.Events {
				n += len(e.Hashes)
			}
		}
		p.Resync()
		m, b := recvBatch(t, p, s)
		if b.Events[0].Kind != KindCleared {
			t.Fatalf("format %d: snapshot starts with %+v", f, b.Events[0])
		}
		rest := b.Events[0].SnapshotRest
		stored := 0
		count := func(b *Batch) {
			for _, e := range b.Events {
				stored += len(e.Hashes)
			}
		}
		count(b)
		if f == FormatArray {
			if rest != 0 {
				t.Fatalf("positional form: extent %d", rest)
			}
			continue
		}
		if rest < 1 {
			t.Fatalf("a snapshot of 40 blocks in batches of 4 events says %d batches follow", rest)
		}
		for i := int64(1); i <= rest; i++ {
			mi, bi := recvDecoded(t, s)
			if mi.Seq != m.Seq+i {
				t.Fatalf("batch %d of the snapshot: seq %d", i, mi.Seq)
			}
			count(bi)
		}
		if stored != 40 {
			t.Fatalf("the snapshot's %d batches store %d blocks, 40 cached", rest+1, stored)
		}
		if st := p.Stats(); st.NextSeq != m.Seq+rest+1 {
			t.Fatalf("published up to %d, the snapshot ends at %d", st.NextSeq-1, m.Seq+rest)
		}
		// Nothing more was published for it.
		_ = s.SetDeadline(time.Now().Add(50 * time.Millisecond))
		if extra, err := s.Recv(); err == nil {
			t.Fatalf("a batch after the snapshot's extent: seq %d", extra.Seq)
		}
	}
}
