package hoststore

import (
	"bytes"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kvtier/host"
	"github.com/kvplug/kvplug/internal/kverr"
)

// testMemory is Go memory that counts its Alloc and Release calls and,
// at Release, overwrites the region: a copy that ran after the release
// would read the poison, and one that ran at the same time would be a data
// race the race detector reports.
type testMemory struct {
	b                []byte
	allocs, releases int
}

func (m *testMemory) Alloc(size int) ([]byte, error) {
	m.allocs++
	m.b = make([]byte, size)
	return m.b, nil
}

func (m *testMemory) Release() {
	m.releases++
	for i := range m.b {
		m.b[i] = 0xee
	}
}

func newStore(t *testing.T, slots, slotBytes int) (*Store, *testMemory) {
	t.Helper()
	mem := &testMemory{}
	s, err := New(Config{Slots: slots, SlotBytes: slotBytes, Memory: mem})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, mem
}

// batchOf splits data[i] into segs equal segments (the last takes the
// rest) for slots[i].
func batchOf(slots []host.Slot, data [][]byte, segs int) Batch {
	b := Batch{Slots: slots, Segments: Segments{Per: segs}}
	for _, d := range data {
		seg := len(d) / segs
		for j := range segs {
			l := seg
			if j == segs-1 {
				l = len(d) - seg*(segs-1)
			}
			var p unsafe.Pointer
			if l > 0 {
				p = unsafe.Pointer(&d[j*seg])
			}
			b.Ptrs, b.Lens = append(b.Ptrs, p), append(b.Lens, int64(l))
		}
	}
	return b
}

func given(b Batch) func() (Batch, error) { return func() (Batch, error) { return b, nil } }

func reserve(t *testing.T, s *Store, keys ...uint64) []host.Slot {
	t.Helper()
	slots := make([]host.Slot, len(keys))
	if _, err := s.ReserveKeys(keys, slots, make([]uint64, len(keys))); err != nil {
		t.Fatal(err)
	}
	return slots
}

func expectCode(t *testing.T, what string, err error, want kverr.Code, text string) {
	t.Helper()
	if kverr.CodeOf(err) != want || (err != nil && !strings.Contains(err.Error(), text)) {
		t.Fatalf("%s: %v (%s), want %s with %q", what, err, kverr.CodeOf(err), want, text)
	}
}

// A block's way through the store: reserved, written, completed, read back
// in other segments; the memory is the store's and released once, at
// Close.
func TestStoreRoundTrip(t *testing.T) {
	s, mem := newStore(t, 3, 40)
	if mem.allocs != 1 || len(s.Memory()) != 120 || s.SlotBytes() != 40 || s.Slots() != 3 {
		t.Fatalf("allocs %d, memory %d bytes", mem.allocs, len(s.Memory()))
	}
	slots := reserve(t, s, 10, 11)
	data := [][]byte{bytes.Repeat([]byte{1}, 40), bytes.Repeat([]byte{2}, 40)}
	data[1][39] = 9
	if err := s.Write("w", given(batchOf(slots, data, 3))); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(s.Memory()[40:80], data[1]) {
		t.Fatal("slot 1 does not hold key 11's bytes")
	}
	expectCode(t, "read pending", s.Read("r", given(batchOf(slots, data, 1))), kverr.NotFound, "r: slot 0 is not resident")
	if n := s.CompleteKeys([]uint64{10, 11}, false); n != 2 {
		t.Fatalf("completed %d", n)
	}
	expectCode(t, "write resident", s.Write("w", given(batchOf(slots, data, 1))), kverr.NotFound, "is not pending")
	back := [][]byte{make([]byte, 40), make([]byte, 40)}
	rev := []host.Slot{slots[1], slots[0]}
	if err := s.Read("r", given(batchOf(rev, back, 7))); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back[0], data[1]) || !bytes.Equal(back[1], data[0]) {
		t.Fatalf("read back %v", back)
	}
	s.Close()
	s.Close()
	if mem.releases != 1 || s.Memory() != nil {
		t.Fatalf("released %d times", mem.releases)
	}
	expectCode(t, "read after close", s.Read("r", given(batchOf(rev, back, 1))), kverr.InvalidHandle, "r: the store was destroyed")
	_, err := s.Reset()
	expectCode(t, "reset after close", err, kverr.InvalidHandle, "destroyed")
}

// A segment longer than copyChunk goes in pieces, all of them.
func TestStoreCopiesLongSegments(t *testing.T) {
	const slotBytes = 3*copyChunk + 17
	s, _ := newStore(t, 2, slotBytes)
	slots := reserve(t, s, 1)
	data := make([]byte, slotBytes)
	for i := range data {
		data[i] = byte(i * 7)
	}
	if err := s.Write("w", given(batchOf(slots, [][]byte{data}, 2))); err != nil {
		t.Fatal(err)
	}
	s.CompleteKeys([]uint64{1}, false)
	back := make([]byte, slotBytes)
	if err := s.Read("r", given(batchOf(slots, [][]byte{back}, 1))); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, data) {
		t.Fatal("a long segment came back different")
	}
}

// The checks come in the C ABI's order, all before anything is copied: the
// store's state, then the arguments (batch), the segments, the slots.
func TestStoreCheckOrder(t *testing.T) {
	called := false
	failing := func() (Batch, error) {
		called = true
		return Batch{}, kverr.Errorf(kverr.NullPointer, "op: slots must not be NULL")
	}
	nomem, err := New(Config{Slots: 2, SlotBytes: 0, Memory: &testMemory{}})
	if err != nil {
		t.Fatal(err)
	}
	defer nomem.Close()
	if nomem.Memory() != nil {
		t.Fatal("a store without memory has memory")
	}
	expectCode(t, "no memory", nomem.Write("op", failing), kverr.Unsupported, "op: the store has no memory (slot_bytes 0)")
	if called {
		t.Fatal("the arguments were converted before the store's state was checked")
	}

	s, mem := newStore(t, 2, 8)
	expectCode(t, "arguments", s.Write("op", failing), kverr.NullPointer, "op: slots must not be NULL")
	slots := reserve(t, s, 5)
	buf := bytes.Repeat([]byte{3}, 8)
	ok := batchOf(slots, [][]byte{buf}, 2)
	for _, c := range []struct {
		name string
		edit func(b *Batch)
		want kverr.Code
		text string
	}{
		{"short", func(b *Batch) { b.Lens[1]-- }, kverr.InvalidArgument, "op: key 0's segments total 7 bytes, not the slot's 8"},
		{"negative", func(b *Batch) { b.Lens[0] = -1 }, kverr.InvalidArgument, "op: lens[0] is -1"},
		{"NULL", func(b *Batch) { b.Ptrs[1] = nil }, kverr.NullPointer, "op: ptrs[1] is NULL with a length of 4"},
		{"out of range", func(b *Batch) { b.Slots = []host.Slot{7} }, kverr.InvalidArgument, "op: slots[0] = 7 is out of range [0, 2)"},
		{"free slot", func(b *Batch) { b.Slots = []host.Slot{1} }, kverr.NotFound, "op: slot 1 is not pending"},
		{"shape", func(b *Batch) { b.Slots = []host.Slot{0, 1} }, kverr.InvalidArgument, "2 slots for the segments of 1 keys"},
		{"segments", func(b *Batch) { b.Per = MaxSegments + 1 }, kverr.InvalidArgument, "segments of 4097 a key"},
		// A later key's NULL after an earlier key's wrong total: the total,
		// as the checks go key by key.
		{"key order", func(b *Batch) {
			b.Slots = []host.Slot{0, 0}
			b.Ptrs = append(b.Ptrs, nil, nil)
			b.Lens = []int64{4, 3, 4, 4}
		}, kverr.InvalidArgument, "key 0's segments total 7"},
	} {
		b := Batch{Slots: slices.Clone(ok.Slots), Segments: Segments{Per: ok.Per, Ptrs: slices.Clone(ok.Ptrs), Lens: slices.Clone(ok.Lens)}}
		c.edit(&b)
		expectCode(t, c.name, s.Write("op", given(b)), c.want, c.text)
		if !bytes.Equal(mem.b, make([]byte, 16)) {
			t.Fatalf("%s: a refused write copied", c.name)
		}
	}
	if err := s.Write("op", given(ok)); err != nil || !bytes.Equal(mem.b[:8], buf) {
		t.Fatalf("write: %v", err)
	}
}

func TestNewRefusesAndReleases(t *testing.T) {
	for _, c := range []struct{ slots, bytes int }{{0, 8}, {4, -1}, {1 << 30, 1 << 20}} {
		mem := &testMemory{}
		if _, err := New(Config{Slots: c.slots, SlotBytes: c.bytes, Memory: mem}); kverr.CodeOf(err) != kverr.InvalidArgument {
			t.Fatalf("%+v: %v", c, err)
		}
		if mem.allocs != 0 || mem.releases != 1 {
			t.Fatalf("%+v: %d allocs, %d releases", c, mem.allocs, mem.releases)
		}
	}
	// Go memory when no Memory is given.
	s, err := New(Config{Slots: 2, SlotBytes: 4})
	if err != nil || len(s.Memory()) != 8 {
		t.Fatalf("%v", err)
	}
	s.Close()
}

// A Close or a Reset on another goroutine never releases or reuses the
// memory under a read in progress: each read either finishes with the
// block's bytes or is told the store is gone (InvalidHandle) or the block
// is (NotFound); testMemory's poison and the race detector would see a
// read of released memory.
func TestCloseAndResetWaitForReads(t *testing.T) {
	for round := range 20 {
		const slotBytes = 1 << 20 // a large copy, so that the close meets one in progress
		s, mem := newStore(t, 2, slotBytes)
		slots := reserve(t, s, 7)
		want := bytes.Repeat([]byte{byte(round + 1)}, slotBytes)
		if err := s.Write("w", given(batchOf(slots, [][]byte{want}, 1))); err != nil {
			t.Fatal(err)
		}
		s.CompleteKeys([]uint64{7}, false)
		var wg sync.WaitGroup
		errs := make(chan string, 8)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 8 {
					got := make([]byte, slotBytes)
					switch err := s.Read("r", given(batchOf(slots, [][]byte{got}, 4))); kverr.CodeOf(err) {
					case kverr.OK:
						if !bytes.Equal(got, want) {
							errs <- "a read finished with bytes that are not the block's"
							return
						}
					case kverr.InvalidHandle, kverr.NotFound: // closed, or reset (the key gone)
					default:
						errs <- fmt.Sprintf("read: %v", err)
						return
					}
					runtime.Gosched()
				}
			}()
		}
		if round%2 == 0 {
			s.Close()
		} else if _, err := s.Reset(); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Fatal(e)
		}
		if round%2 == 0 && mem.releases != 1 {
			t.Fatalf("released %d times", mem.releases)
		}
	}
}
