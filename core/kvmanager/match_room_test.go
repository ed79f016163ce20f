package kvmanager

import (
	"slices"
	"testing"

	"github.com/kvplug/kvplug/core/kverr"
)

// tokensFrom is n consecutive tokens from `from`.
func tokensFrom(from, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(from + i)
	}
	return t
}

// matchRoom is MatchRoom for one prompt.
func matchRoom(t testing.TB, m *Manager, toks []int32) int {
	t.Helper()
	var out [1]int32
	must(t, m.MatchRoom(one(toks, nil), out[:]))
	return int(out[0])
}

// The room of a prompt whose hit running sequences hold is every free and
// evictable block; of one whose hit nothing holds, that less its blocks.
// Either way Admit takes a prompt that needs the room past its hit and
// refuses one that needs a block more.
func TestMatchRoomIsWhatAdmitTakes(t *testing.T) {
	const bs, pool = 4, 16
	for _, held := range []bool{true, false} {
		m := newCached(t, pool, bs, false)
		system := tokensFrom(100, 8) // 2 blocks
		admit(t, m, 1, append(slices.Clone(system), 1, 2, 3, 4), nil)
		m.MarkComputed() // 3 blocks cached, seq 1 holds them
		if !held {
			must(t, m.Remove([]int64{1}))
		}
		prompt := append(slices.Clone(system), 7)
		room := matchRoom(t, m, prompt)
		st := m.Stats()
		want := st.FreeBlocks + m.PrefixStats().EvictableBlocks
		if !held {
			want -= 2 // the hit's blocks leave the evictable ones when admitted
		}
		if room != int(want) {
			t.Fatalf("held %v: room %d, want %d (stats %+v)", held, room, want, st)
		}
		if held && room != pool-3 {
			t.Fatalf("a hit that seq 1 holds: room %d, want the %d blocks seq 1 leaves", room, pool-3)
		}
		// A sequence of the hit and room blocks more fits; one block more does not.
		long := append(slices.Clone(system), tokensFrom(500, room*bs)...)
		over := append(slices.Clone(long), 9)
		n, err := m.Admit([]int64{2}, one(over, nil), []int32{-1})
		if len(over) > pool*bs { // the room is the whole pool: one block more never fits
			if kverr.CodeOf(err) != kverr.InvalidArgument {
				t.Fatalf("held %v: a prompt longer than the pool: %v", held, err)
			}
		} else if err != nil || n != 0 {
			t.Fatalf("held %v: a prompt one block past the room: admitted %d, %v", held, n, err)
		}
		if got := admit(t, m, 2, long, nil); got != 8 {
			t.Fatalf("held %v: the prompt that fills the room matched %d tokens", held, got)
		}
		if room := matchRoom(t, m, prompt); room != 0 {
			t.Fatalf("held %v: room %d once the pool is full", held, room)
		}
	}
}

// A query: no access, lock or counter changes; without the prefix cache
// the room is the free blocks; layer groups are refused; a short out too.
func TestMatchRoomChangesNothing(t *testing.T) {
	m := newCached(t, 16, 4, false)
	p := tokensFrom(100, 12)
	admit(t, m, 1, p, nil)
	m.MarkComputed()
	before := m.PrefixStats()
	if room := matchRoom(t, m, p); room != 13 {
		t.Fatalf("room %d, want 13", room)
	}
	if after := m.PrefixStats(); after != before {
		t.Fatalf("prefix stats moved: %+v -> %+v", before, after)
	}
	check(t, m)
	if err := m.MatchRoom(one(p, nil), nil); kverr.CodeOf(err) != kverr.InvalidArgument {
		t.Fatalf("out too short: %v", err)
	}

	plain, err := New(Config{NumBlocks: 8, BlockSize: 4})
	must(t, err)
	if room := matchRoom(t, plain, p); room != 8 {
		t.Fatalf("no prefix cache: room %d, want 8", room)
	}

	gm := newCachedGroups(t, 16, 4, Group{Kind: FullAttention}, Group{Kind: SlidingWindow, Window: 8})
	if err := gm.m.MatchRoom(one(p, nil), make([]int32, 1)); kverr.CodeOf(err) != kverr.Unsupported {
		t.Fatalf("layer groups: %v", err)
	}
}
