package main

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/cuda"
	"github.com/kvplug/kvplug/core/kverr"
	"github.com/kvplug/kvplug/core/limits"
)

// FuzzABI drives every entry point of kvplug.h with arbitrary integers,
// sizes, handles and struct sizes: a manager (with or without the prefix
// cache and events), a host-backend vcache, the attention calls' argument
// checks, and the process-wide calls. Each call must return a status of the
// header that is not KVP_ERR_INTERNAL, a failure must carry a message and
// leave everything a caller can observe as it was (the manager's and the
// prefix cache's stats, the cache's stats less its refusal and time
// counters), and the manager's invariants must hold after every call.
//
// Buffers always hold what the call's own counts say (a count is either
// the buffer's true length or invalid), as a correct C caller's would: the
// library cannot detect a caller that lies about a buffer's length. On a
// machine with a CUDA device the kernel launches are left out, since
// arbitrary device pointers would fault the GPU rather than the library.
//
// Long run: go test -run '^$' -fuzz FuzzABI -fuzztime 10m ./capi
func FuzzABI(f *testing.F) {
	f.Add([]byte{1, 0, 3, 1, 5, 0, 0, 0, 4, 10, 7, 2, 1, 1, 20, 3, 9, 1})
	f.Add([]byte{3, 11, 2, 0, 30, 2, 4, 1, 1, 40, 1, 0, 12, 2, 2, 25, 1, 8, 0, 3, 0, 33, 34, 35, 36, 37})
	f.Add([]byte{0, 2, 50, 1, 7, 200, 3, 41, 42, 43, 44, 45, 46, 47, 48, 49, 13, 13})
	f.Add(bytes.Repeat([]byte{7, 1, 250, 3, 0}, 8))
	// A host tier (12 blocks of 2 tokens, 4 slots, demote_ahead 12):
	// conversations demoted, flushed, completed, matched per tier and
	// reloaded.
	f.Add(hostTierSeed)
	// The host tier seed's steps on a manager that kvp_manager_create
	// makes first with a shared tier (a server that is down: port 1).
	f.Add(slices.Concat(hostTierSeed[:6],
		[]byte{20, 5, 0, 0, 11, 1, 0, 0, 2, 1, 0, 9, 1, 0, 8, 0, 3, 12, 16, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1},
		hostTierSeed[6:]))
	// The standalone stores (abi_fuzz_stores_test.go).
	f.Add(hostStoreSeed)
	f.Add(hostStoreBareSeed)
	// A manager of layer groups on the prefix cache: a window, a recurrent
	// state with checkpoints, and the layer groups' calls among the rest;
	// then the same with KV events, drained per group or group 0's only.
	f.Add(groupsSeed)
	f.Add(slices.Concat([]byte{groupsSeed[0] | 2}, groupsSeed[1:]))
	// A remove refused with KVP_ERR_IN_USE (the sequence shares a block it
	// filled this step with one that stays), a status step's check once
	// took for an unknown one.
	f.Add([]byte("\xa7.\x9a\xbeo\f\xcc_\xa0&:K\xf5A\xe3\xf7\xd4\xc5<&v_\xb4\xbf\x1dE\r\xa9\xabTt\xf9\x96\x8b%\x14U\xd6qz\x9d\x1a{\xfc\xed\x83\xff\xe2\xcczͯ%\xf9;!$4\xd2p#\xfe6?\x97\xe8\x06\xcf=\xe6D\x7f\xc4:\xa9l\xa6\xd5\xdb)$\x84\x12\xec\xa6g\xdeA@H\xc6\xc8\xf8q\x96\xe4\x84W\xce\x04\x05=W\xd4\xdc\xf0\xe2ɶ\xd2ۺ[\x83!\xa8!6xR\xe6D\x81\x05r\xb7\xf3DR\x01\xcd#p\x9bv\x9b\x9f\x1aI\xf0\xd7\xeas,.\xadF( \xb4\x1b\xb9\xf2U\xe6\xf1\x81\\\x12Y\v\x00\xf2\xb1A\x84\x010\xa6\"\xf8\xe4ҙ\x12\xcf\xe8ߗ\x90\xdey\x8b\x8e\x03@\x04e@\xa1\xb0\x14=Mh\xe8=!C<\x95\xc6@\x9f7M\x03\n\x9a|\x17h\x96\r\x0fF\x82\x0e{Ӵ\x1b(\x0fK9|\xbe\xa6\xcb\xdai\xca\xdch\x92x\xf1\xf9\xf8GX\xfe\xec\x82\xf2k3$O[\x80\x10\xc5\x15d\xbe\x9e\xeca\x1c\xd23\x13\xe2i0\x04\x93ߜ\xbc\x1eEˍ!\x06\xdb\xe0oȚ#\x0e\x12\xae\xbcŹm0\x03a\xaa\xda\xe3Y\xb3\x87\x13\xa0k\x89\a%\x8c\xab\x11\x9b\xbe\x11YTf\xd70\xa8\xa9h\xf1\x8d_\xa5\xa7ѥ%V\xfaX%\x019\xb5i\x97\xa3\x01\x06\xe4O"))
	gpu := cuda.Available()
	f.Fuzz(func(t *testing.T, data []byte) {
		lockThread(t)
		fz := &abiFuzz{t: t, r: byteReader(data), gpu: gpu, junk: newCBuf(64)}
		defer fz.close()
		fz.setup()
		for i := 0; !fz.r.done() && i < 64; i++ {
			fz.step()
		}
	})
}

// hostTierSeed: a host tier (12 blocks of 2 tokens, 4 slots, demote_ahead
// 12): conversations demoted, flushed, completed, matched per tier and
// reloaded.
var hostTierSeed = []byte{
	9, 11, 2, 3, 12, 16, 63, 254, 104, 64, 117, 59, 57, 211, 61, 62, 130, 32, 186, 86, 65, 59, 64, 52,
	208, 57, 64, 120, 32, 61, 64, 14, 66, 10, 62, 1, 62, 28, 2, 231, 194, 57, 202, 239, 57, 147, 153, 59,
	86, 74, 62, 62, 115, 57, 20, 178, 59, 46, 59, 59, 155, 59, 64, 14, 157, 57, 20, 84, 38, 21, 63, 209,
	232, 57, 237, 56, 59, 61, 245, 64, 254, 147, 147, 64, 222, 61, 64, 52, 63, 64, 57, 59, 216, 91, 64, 18,
	16, 30, 193, 223, 64, 203, 173, 209, 179, 57, 61, 59, 63, 63, 59, 60, 2, 62, 64, 59, 59, 59, 57, 137,
	59, 177, 43, 255, 194, 59, 61, 38, 113, 59, 92, 50, 121, 57, 106, 132, 62, 178, 26, 88, 106, 64, 57, 194,
	27, 64, 155, 118, 165, 178, 148, 37, 64, 64, 225, 129, 198, 171, 17, 142, 192, 151, 206, 224, 59, 64, 177, 197,
	59, 45, 6, 64, 92, 110, 70, 42, 167, 185, 64, 62, 47, 59, 57, 223, 61, 139, 33, 64, 125, 224, 50, 38,
	51, 237, 95, 57, 120, 40, 64, 63,
}

type abiFuzz struct {
	t      *testing.T
	r      *reader
	gpu    bool
	m      ptr // current manager
	c      ptr // current vcache
	staleM ptr
	staleC ptr
	junk   cbuf
	bufs   []cbuf
	pins   []uint64
	pub    ptr // current event publisher, on m
	// cBackground: c maps ahead on its own goroutine, so its mappings
	// change between any two calls.
	cBackground bool
	// The current manager's host tier (tierSlots 0: none), the tickets of
	// its batches not yet completed and some completed ones, and its tier
	// counters after the last call (they never decrease).
	numBlocks, tierSlots, demoteAhead int32
	writeThrough                      int32 // the current manager's write_through (its slack aside, it bounds a flush's stores)
	tierBytes                         int64
	tickets, doneTickets              []uint64
	tierCounters                      []int64
	// shared: the current manager has a shared tier, whose store
	// goroutine changes its counters between any two calls.
	shared bool
	// demoteEvicted: the current manager demotes the blocks allocations
	// evict, whose demotions wait (in flight, their host slots reserved)
	// for the next flush without a ticket.
	demoteEvicted bool
	nextID        int64 // conversation's sequence ids
	// stores: the standalone stores are part of the run (setup flag
	// storesFlag): the current host store (hsSlots slots of hsBytes), a
	// destroyed one, slots it handed out lately and its counters after
	// the last call; the current shared store (its server down), a
	// destroyed one and its counters.
	ok          map[string]int // successful calls by name, when not nil
	lastStatus  int            // the status of the last call
	stores      bool
	groups      bool // setup flag groupsFlag
	hs, staleHS ptr
	hsSlots     int32
	hsBytes     int64
	hsHanded    []int32
	hsCounters  []int64
	ss, staleSS ptr
	ssCounters  []int64
}

func (fz *abiFuzz) alloc(n int) ptr {
	b := newCBuf(n)
	fz.bufs = append(fz.bufs, b)
	return b.p
}

func (fz *abiFuzz) release() {
	for _, b := range fz.bufs {
		b.free()
	}
	fz.bufs = nil
}

func (fz *abiFuzz) close() {
	fz.release()
	rawPublisherDestroy(fz.pub) // before its manager, as the header asks
	rawManagerDestroy(fz.m)
	rawVcacheDestroy(fz.c)
	fz.closeStores()
	fz.junk.free()
}

// setup creates the objects the calls act on, from the first bytes.
func (fz *abiFuzz) setup() {
	flags := fz.r.u8()
	cfg := fz.alloc(int(cLayouts["kvp_manager_config"].size))
	setField(cfg, "kvp_manager_config", "struct_size", int64(cLayouts["kvp_manager_config"].size))
	fz.numBlocks = int32(fz.r.u8()%48) + 1
	setField(cfg, "kvp_manager_config", "num_blocks", int64(fz.numBlocks))
	setField(cfg, "kvp_manager_config", "block_size", int64(fz.r.u8()%9))
	setField(cfg, "kvp_manager_config", "enable_prefix_cache", int64(flags&1))
	setField(cfg, "kvp_manager_config", "enable_kv_events", int64(flags&1&(flags>>1)))
	if flags&groupsFlag != 0 && flags&9 != 9 { // layer groups (the host tier refuses them)
		fz.groups = true
		groups := fz.alloc(24 * 3)                                                    // three kvp_layer_group, group 0 full attention (zeros)
		*(*int32)(unsafe.Add(groups, 24)) = 1                                         // a window
		*(*int32)(unsafe.Add(groups, 28)) = int32(fz.r.u8()%8) + 1                    // of 1-8 tokens
		*(*int32)(unsafe.Add(groups, 48)) = 2                                         // a recurrent state
		*(*int64)(unsafe.Add(groups, 56)) = 64                                        // of 64 bytes
		*(*int32)(unsafe.Add(groups, 64)) = int32(flags&1) * (int32(fz.r.u8()%3) + 1) // checkpoints with the cache
		*(*ptr)(unsafe.Add(cfg, cLayouts["kvp_manager_config"].fields["layer_groups"].off)) = groups
		setField(cfg, "kvp_manager_config", "num_layer_groups", 3)
		setField(cfg, "kvp_manager_config", "block_bytes", 64)
	}
	if flags&9 == 9 { // a host tier, on the prefix cache
		fz.tierSlots = int32(fz.small(8)) + 1
		fz.demoteAhead = int32(fz.small(int(fz.numBlocks) + 1))
		fz.tierBytes = int64(fz.small(64)) + 1
		setField(cfg, "kvp_manager_config", "host_tier_slots", int64(fz.tierSlots))
		setField(cfg, "kvp_manager_config", "demote_ahead", int64(fz.demoteAhead))
		setField(cfg, "kvp_manager_config", "host_block_bytes", fz.tierBytes)
	}
	out := fz.alloc(8)
	if st := rawManagerCreate(cfg, out); st != 0 {
		fz.t.Fatalf("setup manager: %s", lastError())
	}
	fz.m = *(*ptr)(out)
	fz.tierCounters = fz.tierStats()
	if flags&4 != 0 {
		h, st := hookVcacheCreate(1, 1, 64, 4, 256, 64<<10)
		if st != 0 {
			fz.t.Fatalf("setup vcache: %s", lastError())
		}
		fz.c = h
	}
	fz.staleM = fz.tmpManager()
	rawManagerDestroy(fz.staleM)
	h, st := hookVcacheCreate(1, 1, 64, 1, 64, 1<<20)
	if st != 0 {
		fz.t.Fatalf("stale vcache: %s", lastError())
	}
	rawVcacheDestroy(h)
	fz.staleC = h
	if flags&storesFlag != 0 {
		fz.storeSetup()
	}
	fz.release()
}

func (fz *abiFuzz) tmpManager() ptr {
	h, st := hookManagerCreate(sizeofManagerConfig(), 4, 4, false, false)
	if st != 0 {
		fz.t.Fatalf("helper manager: %s", lastError())
	}
	return h
}

func setField(p ptr, name, field string, v int64) {
	f := cLayouts[name].fields[field]
	switch f.size {
	case 4:
		*(*int32)(unsafe.Add(p, f.off)) = int32(v)
	case 8:
		*(*int64)(unsafe.Add(p, f.off)) = v
	}
}

// Interesting integers: boundaries of the ABI's ranges.
var fuzzInts = []int64{0, 1, -1, 2, 3, 4, 7, 8, 16, 64, 255, 256, 1023, 1024, 1025, 4096, 65535, 65536, 65537,
	1 << 20, 1<<20 + 1, 1 << 24, 1<<24 + 1, 1 << 26, 1<<26 + 1, 1 << 30, 1<<30 + 1, math.MaxInt32, math.MinInt32,
	1 << 31, 1 << 32, 1 << 40, 1 << 47, math.MaxInt64, math.MinInt64}

// i64 is an arbitrary integer: a small one, a boundary, or raw bytes.
func (fz *abiFuzz) i64() int64 {
	switch b := fz.r.u8(); b % 4 {
	case 0, 1:
		return int64(fz.r.u8()%64) - 8
	case 2:
		return fuzzInts[int(fz.r.u8())%len(fuzzInts)]
	default:
		return int64(fz.r.i32())
	}
}

func (fz *abiFuzz) i32() int32 { return int32(fz.i64()) }

// small is a count in [0, n).
func (fz *abiFuzz) small(n int) int { return int(fz.r.u8()) % n }

// count is the length of the array it describes, or now and then an
// invalid one (below 1 or above 2^20), never a valid one that the array
// does not hold.
func (fz *abiFuzz) count(n int) int32 {
	if fz.r.u8()%6 != 0 {
		return int32(n)
	}
	return []int32{0, -1, math.MinInt32, limits.Batch + 1, math.MaxInt32}[fz.small(5)]
}

// array returns C memory with n int32 (or int64) values, or NULL (1 in 10).
func (fz *abiFuzz) array(n, elem int, gen func() int64) ptr {
	if fz.r.u8()%10 == 0 {
		return nil
	}
	p := fz.alloc(elem * max(n, 1))
	for i := range n {
		v := gen()
		if elem == 4 {
			*(*int32)(unsafe.Add(p, 4*i)) = int32(v)
		} else {
			*(*int64)(unsafe.Add(p, 8*i)) = v
		}
	}
	return p
}

func (fz *abiFuzz) id() int64 {
	if fz.r.u8()%8 == 0 {
		return fz.i64()
	}
	return int64(fz.small(8))
}

// mostlySmall generates values in [0, n) and, 1 in 6, an arbitrary int64.
func (fz *abiFuzz) mostlySmall(n int) func() int64 {
	return func() int64 {
		if fz.r.u8()%6 == 0 {
			return fz.i64()
		}
		return int64(fz.small(n))
	}
}

func (fz *abiFuzz) token() int64 { return int64(fz.small(4)) }

// outp is room for an output of n bytes, or NULL (1 in 12).
func (fz *abiFuzz) outp(n int) ptr {
	if fz.r.u8()%12 == 0 {
		return nil
	}
	return fz.alloc(n)
}

// createArgs is what a create call gets: cfg, NULL 1 in 10, and an
// output handle (outp).
func (fz *abiFuzz) createArgs(cfg ptr) (ptr, ptr) {
	if fz.r.u8()%10 == 0 {
		cfg = nil
	}
	return cfg, fz.outp(8)
}

// createFailed checks a create call that failed: it left the live handles
// as they were (live before the call) and wrote no handle to out.
func (fz *abiFuzz) createFailed(name string, live int64, out ptr) {
	if after := fz.liveHandles(); after != live {
		fz.t.Fatalf("%s failed (%s) with %d live handles before, %d after", name, lastError(), live, after)
	}
	if out != nil && *(*ptr)(out) != nil {
		fz.t.Fatalf("%s failed (%s) and wrote a handle", name, lastError())
	}
}

// pickHandle picks a handle from one input byte b, taken modulo n: 0 is
// NULL, 1 junk, 2 and on alts in order, every other value cur.
func (fz *abiFuzz) pickHandle(n uint8, cur ptr, alts ...ptr) ptr {
	switch b := int(fz.r.u8() % n); {
	case b == 0:
		return nil
	case b == 1:
		return fz.junk.p
	case b-2 < len(alts):
		return alts[b-2]
	}
	return cur
}

// handle picks the handle a call gets: mostly the current object of its
// type, else NULL, junk, a destroyed handle or the other type's.
func (fz *abiFuzz) handle(manager bool) ptr {
	if manager {
		return fz.pickHandle(16, fz.m, fz.staleM, fz.c)
	}
	return fz.pickHandle(16, fz.c, fz.staleC, fz.m)
}

// structBuf is an input struct of the named type at an arbitrary
// struct_size, with room for that size: first version, current, older,
// newer (with a byte set past ours now and then), garbage.
func (fz *abiFuzz) structBuf(name string) ptr {
	l := cLayouts[name]
	size := l.size
	switch fz.r.u8() % 10 {
	case 0:
		size = uintptr(fz.small(int(l.size) + 1))
	case 1:
		size = l.size + 8*uintptr(fz.small(4))
	case 2:
		size = []uintptr{0, 4, 8, 1 << 16, 1<<16 + 1, 1 << 20}[fz.small(6)]
	case 3:
		size = uintptr(fz.r.i32()) & 0x1ffff
	}
	alloc := max(size, l.size) + 8
	if size > 1<<16 {
		alloc = l.size + 8 // refused before any byte past struct_size is read
	}
	p := fz.alloc(int(alloc))
	*(*uintptr)(p) = size
	if size > l.size && size <= 1<<16 && fz.r.u8()%3 == 0 {
		*(*byte)(unsafe.Add(p, l.size+uintptr(fz.small(int(size-l.size))))) = 1
	}
	return p
}

// snapshot is what a caller can observe of the current objects.
func (fz *abiFuzz) snapshot() string {
	var b bytes.Buffer
	for _, s := range []struct {
		name string
		get  func(m, out ptr) int
	}{{"kvp_manager_stats", rawManagerStats}, {"kvp_prefix_stats", rawManagerPrefixStats}, {"kvp_tier_stats", rawManagerTierStats}} {
		l := cLayouts[s.name]
		p := fz.fetchStats(s.name, s.get, fz.m)
		if s.name == "kvp_prefix_stats" && fz.pub != nil {
			// A running publisher drains the manager's events on its own
			// goroutine: the pending count moves between any two calls.
			setField(p.p, s.name, "pending_events", 0)
		}
		if s.name == "kvp_tier_stats" && fz.shared {
			// The shared tier's store goroutine counts on its own, and
			// unpins the host slots of the blocks it stored.
			off := l.fields["shared_lookups"].off
			clear(unsafe.Slice((*byte)(unsafe.Add(p.p, off)), l.size-off))
			setField(p.p, s.name, "host_pinned", 0)
		}
		b.Write(unsafe.Slice((*byte)(p.p), l.size))
		p.free()
	}
	if fz.c != nil {
		l := cLayouts["kvp_vcache_stats"]
		p := fz.fetchStats("kvp_vcache_stats", rawVcacheStats, fz.c)
		fields := []string{"mapped_bytes", "held_bytes", "active_slots", "reusable_slots", "steps", "map_calls",
			"unmap_calls", "create_calls", "release_calls"}
		if fz.cBackground {
			fields = []string{"active_slots", "reusable_slots", "steps"} // the calls' alone
		}
		for _, f := range fields {
			fl := l.fields[f]
			b.Write(unsafe.Slice((*byte)(unsafe.Add(p.p, fl.off)), fl.size))
		}
		p.free()
	}
	fz.storeSnapshot(&b)
	return b.String()
}

// step makes one call and checks it.
func (fz *abiFuzz) step() {
	defer fz.release()
	before := fz.snapshot()
	ops := uint8(numOps)
	if fz.stores {
		ops += numStoreOps
	}
	if fz.groups {
		ops += numGroupOps
	}
	op := fz.r.u8() % ops
	name, st := fz.call(op)
	fz.lastStatus = st
	if st < 0 {
		return // not a status call
	}
	if st == 0 && fz.ok != nil {
		fz.ok[name]++
	}
	if st == int(kverr.Internal) || statusName(st) == "KVP_ERR_UNKNOWN_STATUS" {
		fz.t.Fatalf("%s returned %s: %s", name, statusName(st), lastError())
	}
	if st != 0 {
		if lastError() == "" {
			fz.t.Fatalf("%s failed with %s and no message", name, statusName(st))
		}
		if after := fz.snapshot(); after != before {
			fz.t.Fatalf("%s failed with %s (%s) and changed the state", name, statusName(st), lastError())
		}
	}
	if s := rawManagerCheck(fz.m); s != 0 {
		fz.t.Fatalf("invariants broken after %s: %s", name, lastError())
	}
	fz.checkTier(name)
	fz.checkStores(name)
}

// tierCounterFields are kvp_tier_stats' counters, which never decrease.
var tierCounterFields = []string{"demotions_queued", "demotions_completed", "demotions_failed", "skipped_full",
	"skipped_present", "evicted_undemoted", "reloads", "reloads_completed", "reloads_failed", "host_hit_tokens",
	"match_queries", "match_gpu_tokens", "match_host_tokens", "host_evictions", "host_hits", "host_misses",
	"shared_lookups", "shared_hits", "shared_misses", "shared_fetched", "shared_fetch_misses", "shared_hit_tokens",
	"shared_match_tokens", "shared_puts_queued", "shared_puts_done", "shared_puts_present", "shared_puts_failed",
	"shared_puts_dropped", "shared_corrupt", "shared_timeouts", "shared_errors", "shared_skipped",
	"shared_bytes_read", "shared_bytes_written", "shared_remembered"}

// fetchStats fills a stats struct of the header's type layout from
// object h through get, with struct_size set to the header's size as a
// correct caller sets it. Every stats call on a live object must succeed,
// so a failure fails the run. The caller frees the buffer.
func (fz *abiFuzz) fetchStats(layout string, get func(h, out ptr) int, h ptr) cbuf {
	l := cLayouts[layout]
	p := newCBuf(int(l.size))
	*(*uintptr)(p.p) = l.size
	if st := get(h, p.p); st != 0 {
		p.free()
		fz.t.Fatalf("reading %s: %s", layout, lastError())
	}
	return p
}

// readStats fetches the stats struct layout of h (fetchStats) and returns
// its int64 fields counters, then its int32 fields gauges widened to
// int64, in the order given: the checks compare the slices call to call.
func (fz *abiFuzz) readStats(layout string, get func(h, out ptr) int, h ptr, counters, gauges []string) []int64 {
	p := fz.fetchStats(layout, get, h)
	defer p.free()
	l := cLayouts[layout]
	v := make([]int64, 0, len(counters)+len(gauges))
	for _, f := range counters {
		v = append(v, *(*int64)(unsafe.Add(p.p, l.fields[f].off)))
	}
	for _, f := range gauges {
		v = append(v, int64(*(*int32)(unsafe.Add(p.p, l.fields[f].off))))
	}
	return v
}

// tierStats returns the current manager's tier counters (in the order of
// tierCounterFields), then in_flight, host_slots, host_resident,
// host_reserved and host_pinned.
func (fz *abiFuzz) tierStats() []int64 {
	return fz.readStats("kvp_tier_stats", rawManagerTierStats, fz.m, tierCounterFields,
		[]string{"in_flight", "host_slots", "host_resident", "host_reserved", "host_pinned"})
}

// checkTier checks the host tier's stats after a call: counters never
// decrease, nothing is in flight once every ticket has completed, the
// gauges stay within the tier's slots (all zero without a tier).
func (fz *abiFuzz) checkTier(name string) {
	v := fz.tierStats()
	n := len(tierCounterFields)
	for i, f := range tierCounterFields {
		if v[i] < fz.tierCounters[i] {
			fz.t.Fatalf("after %s: tier stat %s went from %d to %d", name, f, fz.tierCounters[i], v[i])
		}
	}
	inFlight, slots, resident, reserved, pinned := v[n], v[n+1], v[n+2], v[n+3], v[n+4]
	if slots != int64(fz.tierSlots) || resident < 0 || reserved < 0 || pinned < 0 || resident+reserved > slots || pinned > slots {
		fz.t.Fatalf("after %s: tier stats %v with %d host slots", name, v[n:], fz.tierSlots)
	}
	// Once every ticket has completed, nothing is in flight: except, with
	// demote_evicted, the allocations' demotions queued for the next
	// flush, each holding its reserved host slot.
	if len(fz.tickets) == 0 && (inFlight != 0 || reserved != 0) && !(fz.demoteEvicted && inFlight == reserved) {
		fz.t.Fatalf("after %s: every ticket completed, yet in_flight %d, host_reserved %d", name, inFlight, reserved)
	}
	if fz.tierSlots == 0 {
		for i, x := range v {
			if x != 0 {
				fz.t.Fatalf("after %s: no host tier, yet tier stat %d is %d", name, i, x)
			}
		}
	}
	fz.tierCounters = v
}

// call makes the call numbered op; it returns the call's name and its
// status (-1 for calls without one).
func (fz *abiFuzz) call(op uint8) (string, int) {
	switch op {
	case 0:
		return "kvp_manager_add", rawManagerAdd(fz.handle(true), fz.id(), fz.i32())
	case 1:
		n := fz.small(5)
		ids := fz.array(n, 8, fz.id)
		counts := fz.array(n, 4, fz.mostlySmall(12))
		return "kvp_manager_grow", rawManagerGrow(fz.handle(true), ids, counts, fz.count(n))
	case 2:
		// The step's forward pass: removals before it drop the blocks
		// the step filled, after it keep them.
		return "kvp_manager_mark_computed", rawManagerMarkComputed(fz.handle(true))
	case 3:
		n := fz.small(5)
		ids := fz.array(n, 8, fz.id)
		counts := make([]int64, n)
		total := 0
		for i := range counts {
			counts[i] = int64(fz.small(10))
			if fz.r.u8()%8 == 0 { // an invalid count: the library reads no token
				counts[i] = []int64{-1, math.MinInt32, 1<<24 + 1, math.MaxInt32}[fz.small(4)]
			}
			if counts[i] > 0 && counts[i] <= 1<<24 {
				total += int(counts[i])
			}
		}
		k := 0
		cp := fz.array(n, 4, func() int64 { k++; return counts[k-1] })
		if cp == nil {
			total = 0
		}
		tokens := fz.array(total, 4, fz.token)
		return "kvp_manager_grow_tokens", rawManagerGrowTokens(fz.handle(true), ids, cp, fz.count(n), tokens)
	case 4:
		n := fz.small(5)
		maxCopies := int32(fz.small(6))
		copies := fz.array(int(maxCopies), 8, func() int64 { return 0 })
		if fz.r.u8()%8 == 0 {
			maxCopies = fz.i32()
			if maxCopies > 0 {
				copies = nil
			}
		}
		return "kvp_manager_fork", rawManagerFork(fz.handle(true), fz.id(), fz.array(n, 8, fz.id), fz.count(n), copies, maxCopies, fz.outp(4))
	case 5:
		n := fz.small(5)
		return "kvp_manager_remove", rawManagerRemove(fz.handle(true), fz.array(n, 8, fz.id), fz.count(n))
	case 6:
		n := fz.small(5)
		maxBlocks := int32(fz.small(40))
		slotCap := int32(fz.small(200))
		var table, slots ptr
		if fz.r.u8()%3 != 0 {
			table = fz.alloc(4 * n * max(int(maxBlocks), 1))
		}
		if fz.r.u8()%3 != 0 {
			slots = fz.alloc(4 * max(int(slotCap), 1))
		}
		if fz.r.u8()%8 == 0 {
			maxBlocks, slotCap = []int32{0, -1, math.MinInt32}[fz.small(3)], []int32{-1, math.MinInt32}[fz.small(2)]
			if maxBlocks < 0 {
				slotCap = 0
			}
		}
		var lens ptr
		if fz.r.u8()%2 == 0 {
			lens = fz.alloc(4 * max(n, 1))
		}
		return "kvp_manager_describe", rawManagerDescribe(fz.handle(true), fz.array(n, 8, fz.id), fz.count(n), table, maxBlocks, lens, slots, slotCap, fz.outp(4))
	case 7:
		return "kvp_manager_stats_get", rawManagerStats(fz.handle(true), fz.outStruct("kvp_manager_stats"))
	case 8:
		return "kvp_manager_prefix_stats", rawManagerPrefixStats(fz.handle(true), fz.outStruct("kvp_prefix_stats"))
	case 9, 10, 11:
		return fz.admitOrMatch(int(op) - 9)
	case 12:
		n := fz.small(20)
		tokens := fz.array(n, 4, fz.token)
		num := fz.count(n)
		if num > 0 && int(num) != n { // past 2^20 tokens: only the library's 2^30 limit refuses
			num = -1
		}
		pin := fz.outp(8)
		st := rawManagerPin(fz.handle(true), tokens, num, fz.keys(1), pin, fz.outp(4))
		if st == 0 {
			fz.pins = append(fz.pins, *(*uint64)(pin))
		}
		return "kvp_manager_pin", st
	case 13:
		id := uint64(fz.i64())
		if len(fz.pins) > 0 && fz.r.u8()%2 == 0 {
			id = fz.pins[fz.small(len(fz.pins))]
		}
		return "kvp_manager_unpin", rawManagerUnpin(fz.handle(true), id)
	case 14:
		n := fz.small(20)
		return "kvp_manager_set_priority", rawManagerSetPriority(fz.handle(true), fz.array(n, 4, fz.token), int32(n), fz.keys(1), fz.i32(), fz.outp(4))
	case 15:
		return "kvp_manager_prefix_stats_reset", rawManagerPrefixStatsReset(fz.handle(true))
	case 16:
		return "kvp_manager_clear_prefix_cache", rawManagerClearPrefixCache(fz.handle(true), fz.outp(4))
	case 17:
		me, mt, mm, mh := int32(fz.small(5)), int32(fz.small(20)), int32(fz.small(3)), int32(fz.small(4))
		ev := fz.outp(int(cLayouts["kvp_kv_event"].size) * max(int(me), 1))
		tok := fz.outp(4 * max(int(mt), 1))
		mmb := fz.outp(int(cLayouts["kvp_block_mm"].size) * max(int(mm), 1))
		hs := fz.outp(16 * max(int(mh), 1))
		if fz.r.u8()%6 == 0 {
			me, mt = min(fz.i32(), me), min(fz.i32(), mt) // never more room than there is
		}
		return "kvp_manager_drain_events", rawManagerDrainEvents(fz.handle(true), ev, me, tok, mt, mmb, mm, hs, mh, fz.outp(4))
	case 18:
		return "kvp_manager_next_event_size", rawManagerNextEventSize(fz.handle(true), fz.outp(4), fz.outp(4), fz.outp(4))
	case 19:
		n := fz.small(3)
		l := cLayouts["kvp_mm_item"]
		var items ptr
		if fz.r.u8()%8 != 0 {
			items = fz.alloc(int(l.size) * max(n, 1))
			for i := range n {
				it := unsafe.Add(items, int(l.size)*i)
				*(*int32)(it) = int32(fz.small(40))
				*(*int32)(unsafe.Add(it, 4)) = int32(fz.small(6)) - 1
			}
		}
		num := int32(n)
		if fz.r.u8()%8 == 0 {
			num = []int32{-1, math.MinInt32, 1<<20 + 1}[fz.small(3)]
		}
		return "kvp_manager_add_mm_items", rawManagerAddMMItems(fz.handle(true), fz.id(), items, num)
	case 20:
		return fz.createManager()
	case 21:
		h := fz.handle(true)
		if h == fz.m && h != nil {
			return "kvp_manager_destroy", -1 // the current one stays: the calls need it
		}
		rawManagerDestroy(h)
		return "kvp_manager_destroy", -1
	case 22:
		return fz.createVcache()
	case 23:
		h := fz.handle(false)
		if h == fz.c {
			return "kvp_vcache_destroy", -1
		}
		rawVcacheDestroy(h)
		return "kvp_vcache_destroy", -1
	case 24:
		return "kvp_vcache_layer_ptrs", rawVcacheLayerPtrs(fz.handle(false), fz.i32(), fz.outp(8), fz.outp(8))
	case 25:
		return "kvp_vcache_strides", rawVcacheStrides(fz.handle(false), fz.outp(32))
	case 26, 27:
		return "kvp_vcache_alloc_slot", rawVcacheAllocSlot(fz.handle(false), fz.outp(4))
	case 28:
		s := int32(fz.small(6)) - 1
		if fz.r.u8()%6 == 0 {
			s = fz.i32()
		}
		return "kvp_vcache_free_slot", rawVcacheFreeSlot(fz.handle(false), s)
	case 29, 30:
		n := fz.small(5)
		slots := fz.array(n, 4, func() int64 { return int64(fz.small(6)) - 1 })
		ctx := fz.array(n, 4, fz.mostlySmall(300))
		return "kvp_vcache_step", rawVcacheStep(fz.handle(false), slots, ctx, fz.count(n))
	case 31:
		return "kvp_vcache_trim", rawVcacheTrim(fz.handle(false))
	case 32:
		return "kvp_vcache_stats_get", rawVcacheStats(fz.handle(false), fz.outStruct("kvp_vcache_stats"))
	case 33:
		return "kvp_attn_workspace_size", rawAttnWorkspaceSize(fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.outp(8))
	case 34:
		return "kvp_prefill_workspace_size", rawPrefillWorkspaceSize(fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.outp(8))
	case 35:
		return "kvp_attn_num_splits", rawAttnNumSplits(fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.outp(4))
	case 36, 37, 38, 39, 40:
		return fz.launch(op)
	case 41:
		return "kvp_cuda_available", rawCudaAvailable(fz.outp(4))
	case 42:
		if fz.gpu {
			return "kvp_attn_prepare", -1
		}
		return "kvp_attn_prepare", rawAttnPrepare()
	case 43:
		return "kvp_live_handles", rawLiveHandles(fz.outp(8))
	case 44:
		// Leaves the level at OFF (or refuses): no log line reaches the
		// test's output.
		lv := fz.i32()
		if lv >= 0 && lv < 4 {
			lv = 4
		}
		return "kvp_set_log_level", rawSetLogLevel(lv)
	case 45:
		lv := fz.i32()
		if lv >= 0 && lv < 4 {
			lv = 4
		}
		return "kvp_set_logger", rawSetLoggerOff(lv)
	case 46:
		if v := rawVersion(); v/10000 != 0 || rawVersionString() == "" {
			fz.t.Fatalf("kvp_version %d, %q", v, rawVersionString())
		}
		return "kvp_version", -1
	case 47:
		if s := rawStatusString(fz.i32()); s == "" {
			fz.t.Fatal("kvp_status_string returned an empty name")
		}
		return "kvp_status_string", -1
	case 48:
		return "kvp_cascade_workspace_size", rawCascadeWorkspaceSize(fz.i32(), fz.i32(), fz.i32(), fz.i32(), fz.outp(8), fz.outp(8))
	case 49:
		return fz.cascadePlan()
	case 50:
		batch := int32(fz.small(8))
		if fz.r.u8()%8 == 0 {
			batch = []int32{-1, math.MinInt32}[fz.small(2)]
		}
		lens := fz.array(int(max(batch, 0)), 4, func() int64 { return int64(fz.small(300)) })
		return "kvp_cascade_update", rawCascadeUpdate(fz.randomPlan(), lens, batch, fz.outp(4))
	case 51:
		if fz.gpu {
			return "kvp_paged_cascade", -1
		}
		args := fz.structBuf("kvp_paged_prefill_args")
		fz.randomFields(args, "kvp_paged_prefill_args")
		return "kvp_paged_cascade", rawPagedCascade(fz.randomPlan(), args)
	case 52:
		return fz.createPublisher()
	case 53:
		return "kvp_event_publisher_flush", rawPublisherFlush(fz.pubHandle())
	case 54:
		return "kvp_event_publisher_resync", rawPublisherResync(fz.pubHandle())
	case 55:
		return "kvp_event_publisher_stats_get", rawPublisherStats(fz.pubHandle(), fz.outStruct("kvp_event_publisher_stats"))
	case 56:
		h := fz.pubHandle()
		if h == fz.pub {
			fz.pub = nil
		}
		rawPublisherDestroy(h)
		return "kvp_event_publisher_destroy", -1
	case 57, 58:
		return fz.flushCopies()
	case 59, 60:
		return fz.completeCopies()
	case 61:
		return fz.admitOrMatch(3)
	case 62:
		return "kvp_manager_tier_stats", rawManagerTierStats(fz.handle(true), fz.outStruct("kvp_tier_stats"))
	case 63:
		h := fz.handle(true)
		base, bytes, slots := fz.outp(8), fz.outp(8), fz.outp(4)
		st := rawManagerHostTierMemory(h, base, bytes, slots)
		if h == fz.m && (st == 0) != (fz.tierSlots > 0) {
			fz.t.Fatalf("kvp_manager_host_tier_memory with %d host slots: %s (%s)", fz.tierSlots, statusName(st), lastError())
		}
		if h == fz.m && st == 0 {
			if (base != nil && *(*ptr)(base) == nil) || (bytes != nil && *(*int64)(bytes) != fz.tierBytes) ||
				(slots != nil && *(*int32)(slots) != fz.tierSlots) {
				fz.t.Fatalf("kvp_manager_host_tier_memory: wrong region for %d slots of %d bytes", fz.tierSlots, fz.tierBytes)
			}
		}
		return "kvp_manager_host_tier_memory", st
	case 64:
		return fz.conversation()
	}
	extra := op - numOps
	if fz.stores {
		if extra < numStoreOps {
			return fz.storeCall(extra)
		}
		extra -= numStoreOps
	}
	if fz.groups && extra < numGroupOps {
		return fz.groupCall(extra)
	}
	panic(fmt.Sprintf("no call numbered %d", op))
}

// numOps is the number of calls call knows, before the stores' and the
// layer groups' (setup flags storesFlag and groupsFlag).
const numOps = 65

// groupsSeed is FuzzABI's seed for layer groups: the setup flags (prefix
// cache, groups), 17 blocks of 4 tokens, a window of 4 tokens, checkpoints
// every 2 blocks, then calls drawn from fixed pseudo-random bytes.
var groupsSeed = func() []byte {
	r := rand.New(rand.NewPCG(33, 33))
	b := []byte{1 | groupsFlag, 16, 4, 3, 1}
	for range 600 {
		b = append(b, byte(r.Uint32()))
	}
	return b
}()

// groupsFlag in the setup's flags byte gives the setup manager layer
// groups (a window and a recurrent state; with the prefix cache, its
// checkpoints) and adds the layer groups' calls, numbered after the
// stores', and layer groups in the configs kvp_manager_create is given.
const groupsFlag = 0x80

// numGroupOps is the number of layer-group calls (groupCall).
const numGroupOps = 5

// groupCall makes the layer-group call numbered op.
func (fz *abiFuzz) groupCall(op uint8) (string, int) {
	switch op {
	case 0:
		return fz.describeGroups()
	case 1:
		capacity := int32(fz.small(5)) - 1
		return "kvp_manager_group_blocks", rawManagerGroupBlocks(fz.handle(true), fz.outp(4*max(int(capacity), 1)), capacity, fz.outp(4))
	case 2:
		capacity := int32(fz.small(6)) - 1
		return "kvp_manager_take_copies", rawManagerTakeCopies(fz.handle(true), fz.outp(8*max(int(capacity), 1)), capacity, fz.outp(4), fz.outp(4))
	case 3:
		// kvp_manager_drain_events' fuzzing, with the group event array.
		me, mt, mm, mh := int32(fz.small(5)), int32(fz.small(20)), int32(fz.small(3)), int32(fz.small(4))
		ev := fz.outp(int(cLayouts["kvp_kv_group_event"].size) * max(int(me), 1))
		tok := fz.outp(4 * max(int(mt), 1))
		mmb := fz.outp(int(cLayouts["kvp_block_mm"].size) * max(int(mm), 1))
		hs := fz.outp(16 * max(int(mh), 1))
		if fz.r.u8()%6 == 0 {
			me, mt = min(fz.i32(), me), min(fz.i32(), mt) // never more room than there is
		}
		return "kvp_manager_drain_group_events", rawManagerDrainGroupEvents(fz.handle(true), ev, me, tok, mt, mmb, mm, hs, mh, fz.outp(4))
	default:
		return "kvp_manager_next_group_event_size", rawManagerNextGroupEventSize(fz.handle(true), fz.outp(4), fz.outp(4), fz.outp(4))
	}
}

// describeGroups calls kvp_manager_describe_groups with a group count that
// is mostly small (the manager's or not), arrays of table and slot
// pointers (NULL, or each entry a buffer or NULL) and the sizes of
// describe's fuzzing.
func (fz *abiFuzz) describeGroups() (string, int) {
	n := fz.small(5)
	groups := int32(fz.small(5)) - 1
	maxBlocks := int32(fz.small(40)) - 1
	slotCap := int32(fz.small(200)) - 1
	ptrs := func(each int) ptr {
		if groups < 1 || fz.r.u8()%4 == 0 {
			return nil
		}
		arr := fz.alloc(8 * int(groups))
		for g := range int(groups) {
			if fz.r.u8()%3 != 0 {
				*(*ptr)(unsafe.Add(arr, 8*g)) = fz.alloc(each)
			}
		}
		return arr
	}
	tables := ptrs(4 * max(n, 1) * max(int(maxBlocks), 1))
	slots := ptrs(4 * max(int(slotCap), 1))
	var lens ptr
	if fz.r.u8()%2 == 0 {
		lens = fz.alloc(4 * max(n, 1))
	}
	return "kvp_manager_describe_groups", rawManagerDescribeGroups(fz.handle(true), fz.array(n, 8, fz.id), fz.count(n), groups,
		tables, maxBlocks, lens, slots, slotCap, fz.outp(4))
}

// layerGroups sets a full-size config's layer groups: one to four of a
// mostly valid kind, window, state size and checkpoint interval (the
// library checks them), a count that sometimes disagrees, and the
// context limit and block size they are checked against.
func (fz *abiFuzz) layerGroups(cfg ptr) {
	l := cLayouts["kvp_manager_config"]
	n := 1 + fz.small(4)
	arr := fz.alloc(24 * n)
	for g := range n {
		e := unsafe.Add(arr, 24*g)
		kind := int32(fz.small(3))
		if g == 0 && fz.r.u8()%4 != 0 {
			kind = 0 // group 0 must be full attention: mostly it is
		}
		if fz.r.u8()%10 == 0 {
			kind = int32(fz.i64())
		}
		*(*int32)(e) = kind
		if kind == 1 || fz.r.u8()%10 == 0 {
			*(*int32)(unsafe.Add(e, 4)) = []int32{int32(fz.small(20)) + 1, 0, -1, int32(fz.i64())}[fz.small(4)]
		}
		if kind == 2 || fz.r.u8()%10 == 0 {
			*(*int64)(unsafe.Add(e, 8)) = []int64{int64(fz.small(64)) + 1, 0, fz.i64()}[fz.small(3)]
			*(*int32)(unsafe.Add(e, 16)) = []int32{int32(fz.small(3)) + 1, 0, int32(fz.i64())}[fz.small(3)]
		}
		if fz.r.u8()%16 == 0 {
			*(*int32)(unsafe.Add(e, 20)) = 1 // reserved
		}
	}
	*(*ptr)(unsafe.Add(cfg, l.fields["layer_groups"].off)) = arr
	setField(cfg, "kvp_manager_config", "num_layer_groups", []int64{int64(n), 0, int64(n) + 1, -1, 65}[fz.small(5)])
	setField(cfg, "kvp_manager_config", "max_model_len", []int64{0, int64(fz.small(64)), fz.i64()}[fz.small(3)])
	setField(cfg, "kvp_manager_config", "block_bytes", []int64{64, 0, fz.i64()}[fz.small(3)])
}

// conversation admits one of a few recurring prompts as a new sequence
// and removes it at once, with valid arguments: its step's forward pass
// runs in between (kvp_manager_mark_computed, without which the removal
// would drop the blocks it filled), so its full blocks stay cached, that
// flushes demote them and a return of the prompt reloads them from the
// host tier.
func (fz *abiFuzz) conversation() (string, int) {
	toks := make([]int32, 1+fz.small(24))
	base := int32(fz.small(3)) * 1000
	for i := range toks {
		toks[i] = base + int32(i)
	}
	tokens := fz.alloc(4 * len(toks))
	copy(unsafe.Slice((*int32)(tokens), len(toks)), toks)
	offsets := fz.alloc(16)
	*(*int64)(unsafe.Add(offsets, 8)) = int64(len(toks))
	fz.nextID++
	ids := fz.alloc(8)
	*(*int64)(ids) = 1000 + fz.nextID
	admitted := fz.alloc(4)
	st := rawManagerAdmit(fz.m, ids, 1, tokens, offsets, nil, nil, admitted)
	if st == 0 && *(*int32)(admitted) == 1 { // else out of blocks: none admitted
		if s := rawManagerMarkComputed(fz.m); s != 0 {
			fz.t.Fatalf("kvp_manager_mark_computed: %s", lastError())
		}
		if s := rawManagerRemove(fz.m, ids, 1); s != 0 {
			fz.t.Fatalf("kvp_manager_remove of an admitted sequence: %s", lastError())
		}
	}
	return "kvp_manager_admit", st
}

// flushCopies flushes the host tier's copies into arrays of arbitrary
// room (now and then too little, NULL or a hostile max), and checks the
// batch: copies within the pool and the host slots, BUFFER_TOO_SMALL
// only with a need past the room given, and success whenever the room is
// demote_ahead + write_through and num_blocks entries.
func (fz *abiFuzz) flushCopies() (string, int) {
	const name = "kvp_manager_flush_copies"
	h := fz.handle(true)
	room := fz.demoteAhead + fz.writeThrough // the header's promise (without demote_evicted, which write-through's cases leave 0)
	maxD, maxR := int32(fz.small(int(room)+2)), int32(fz.small(int(fz.numBlocks)+2))
	if fz.r.u8()%3 == 0 { // the room the header promises is enough
		maxD, maxR = room, fz.numBlocks
	}
	sz := int(cLayouts["kvp_tier_copy"].size)
	demote, reload := fz.outp(sz*max(int(maxD), 1)), fz.outp(sz*max(int(maxR), 1))
	if fz.r.u8()%10 == 0 { // a hostile max: never more room than there is
		maxD, maxR = min(fz.i32(), maxD), min(fz.i32(), maxR)
	}
	nd, nr, ticket := fz.outp(4), fz.outp(4), fz.outp(8)
	if nd != nil {
		*(*int32)(nd) = -7
	}
	if nr != nil {
		*(*int32)(nr) = -7
	}
	st := rawManagerFlushCopies(h, demote, maxD, nd, reload, maxR, nr, ticket)
	if h != fz.m {
		return name, st
	}
	valid := nd != nil && nr != nil && ticket != nil && maxD >= 0 && maxR >= 0 &&
		(demote != nil || maxD == 0) && (reload != nil || maxR == 0) && fz.tierSlots > 0
	switch {
	case !valid && st == 0:
		fz.t.Fatalf("%s accepted bad arguments (max %d and %d)", name, maxD, maxR)
	case valid && maxD >= room && maxR >= fz.numBlocks && st != 0:
		fz.t.Fatalf("%s with room for %d demotions and %d reloads: %s (%s)", name, maxD, maxR, statusName(st), lastError())
	case st == int(kverr.BufferTooSmall):
		needD, needR := *(*int32)(nd), *(*int32)(nr)
		if needD < 0 || needR < 0 || (needD <= maxD && needR <= maxR) {
			fz.t.Fatalf("%s: BUFFER_TOO_SMALL needing %d and %d with room for %d and %d", name, needD, needR, maxD, maxR)
		}
	case st == 0:
		d, r, tk := *(*int32)(nd), *(*int32)(nr), *(*uint64)(ticket)
		if d < 0 || d > maxD || r < 0 || r > maxR || (tk == 0) != (d == 0 && r == 0) {
			fz.t.Fatalf("%s: %d demotions, %d reloads (room %d, %d), ticket %d", name, d, r, maxD, maxR, tk)
		}
		for i, arr := range []ptr{demote, reload} {
			cnt := []int32{d, r}[i]
			for j := range int(cnt) {
				c := unsafe.Add(arr, sz*j)
				block, slot := *(*int32)(c), *(*int32)(unsafe.Add(c, 4))
				if block < 0 || block >= fz.numBlocks || slot < 0 || slot >= fz.tierSlots {
					fz.t.Fatalf("%s: copy (block %d, slot %d) outside %d blocks, %d slots", name, block, slot, fz.numBlocks, fz.tierSlots)
				}
			}
		}
		if tk != 0 {
			for _, o := range append(append([]uint64{}, fz.tickets...), fz.doneTickets...) {
				if o == tk {
					fz.t.Fatalf("%s handed out ticket %d twice", name, tk)
				}
			}
			fz.tickets = append(fz.tickets, tk)
		}
	}
	return name, st
}

// completeCopies completes a ticket the fuzz holds (failed now and then),
// one completed already, 0 or an arbitrary one (NOT_FOUND).
func (fz *abiFuzz) completeCopies() (string, int) {
	const name = "kvp_manager_complete_copies"
	h := fz.handle(true)
	failed := int32(0)
	switch fz.r.u8() % 8 {
	case 0:
		failed = 1
	case 1:
		failed = fz.i32()
	}
	k, ticket := -1, uint64(fz.i64())
	switch b := fz.r.u8() % 8; {
	case b < 5 && len(fz.tickets) > 0:
		k = fz.small(len(fz.tickets))
		ticket = fz.tickets[k]
	case b == 5 && len(fz.doneTickets) > 0:
		ticket = fz.doneTickets[fz.small(len(fz.doneTickets))]
	case b == 6:
		ticket = 0
	}
	st := rawManagerCompleteCopies(h, ticket, failed)
	if h != fz.m {
		return name, st
	}
	switch {
	case fz.tierSlots == 0:
		if st != int(kverr.InvalidArgument) {
			fz.t.Fatalf("%s without a host tier: %s (%s)", name, statusName(st), lastError())
		}
	case k >= 0:
		if st != 0 {
			fz.t.Fatalf("%s of ticket %d, outstanding: %s (%s)", name, ticket, statusName(st), lastError())
		}
		fz.tickets = append(fz.tickets[:k], fz.tickets[k+1:]...)
		if len(fz.doneTickets) < 8 {
			fz.doneTickets = append(fz.doneTickets, ticket)
		}
	case slices.Contains(fz.tickets, ticket):
		// An arbitrary value that happens to be outstanding: no check.
		if st == 0 {
			i := slices.Index(fz.tickets, ticket)
			fz.tickets = append(fz.tickets[:i], fz.tickets[i+1:]...)
		}
	default:
		if st != int(kverr.NotFound) {
			fz.t.Fatalf("%s of unknown ticket %d: %s (%s)", name, ticket, statusName(st), lastError())
		}
	}
	return name, st
}

// pubHandle picks a publisher handle: the current one (possibly none),
// NULL, junk, or another type's.
func (fz *abiFuzz) pubHandle() ptr {
	return fz.pickHandle(8, fz.pub, fz.m)
}

// randomFields sets some of the struct's integer fields to arbitrary
// values (when its struct_size lets the library read them).
func (fz *abiFuzz) randomFields(p ptr, name string) {
	l := cLayouts[name]
	if p == nil {
		return
	}
	if size := *(*uintptr)(p); size < l.size || size > 1<<16 {
		return
	}
	for field, f := range l.fields {
		if field == "struct_size" || fz.r.u8()%3 != 0 {
			continue
		}
		switch f.size {
		case 4:
			*(*int32)(unsafe.Add(p, f.off)) = fz.i32()
		case 8:
			*(*int64)(unsafe.Add(p, f.off)) = fz.i64()
		}
	}
	if f, ok := l.fields["kv"]; ok && name != "kvp_kv_layers" {
		// The paged-KV descriptor of a launch: NULL or a struct of
		// arbitrary size and fields, never an arbitrary address (the
		// library reads it as the caller's memory, as every host pointer).
		var kv ptr
		if fz.r.u8()%2 == 0 {
			kv = fz.structBuf("kvp_paged_kv")
			fz.randomFields(kv, "kvp_paged_kv")
		}
		*(*uintptr)(unsafe.Add(p, f.off)) = uintptr(kv)
	}
}

// randomPlan is a kvp_attn_plan of arbitrary size and fields, or NULL.
func (fz *abiFuzz) randomPlan() ptr {
	p := fz.outStruct("kvp_attn_plan")
	fz.randomFields(p, "kvp_attn_plan")
	return p
}

// cascadePlan plans with arbitrary arguments whose host arrays hold what
// the arguments say. Left out where a GPU would receive the plan's copy.
func (fz *abiFuzz) cascadePlan() (string, int) {
	const name = "kvp_cascade_plan_args"
	if fz.gpu {
		return "kvp_cascade_plan", -1
	}
	args := fz.structBuf(name)
	fz.randomFields(args, name)
	if size := *(*uintptr)(args); size >= cLayouts[name].size && size <= 1<<16 {
		batch := fz.small(6)
		if fz.r.u8()%8 == 0 {
			batch = []int{-1, 65536, math.MaxInt32}[fz.small(3)]
		}
		stride, maxBlocks := fz.small(8), fz.small(8)
		setField(args, name, "batch", int64(batch))
		setField(args, name, "block_table_stride", int64(stride))
		setField(args, name, "max_blocks_per_seq", int64(maxBlocks))
		var table, lens ptr
		if batch >= 0 && batch < 64 {
			table = fz.array(batch*max(stride, maxBlocks, 1), 4, func() int64 { return int64(fz.small(64)) })
			lens = fz.array(batch, 4, func() int64 { return int64(fz.small(200)) })
		}
		setField(args, name, "block_table_host", int64(uintptr(table)))
		setField(args, name, "seq_lens_host", int64(uintptr(lens)))
		// The varlen queries' offsets: NULL (decode) or an array of batch+1
		// (arbitrary values the planner must check), never an arbitrary
		// address, which the library would read as the caller's memory.
		var qo ptr
		if batch >= 0 && batch < 64 && fz.r.u8()%2 == 0 {
			qo = fz.array(batch+1, 4, func() int64 { return int64(fz.small(64)) })
		}
		setField(args, name, "qo_indptr_host", int64(uintptr(qo)))
		hb := 4 * fz.small(4096)
		host := fz.outp(max(hb, 4))
		setField(args, name, "host_workspace", int64(uintptr(host)))
		setField(args, name, "host_workspace_bytes", int64(hb))
	}
	if fz.r.u8()%10 == 0 {
		args = nil
	}
	return "kvp_cascade_plan", rawCascadePlan(args, fz.outStruct("kvp_attn_plan"))
}

// cstr is a NUL-terminated copy of s in C memory.
func (fz *abiFuzz) cstr(s string) ptr {
	p := fz.alloc(len(s) + 1)
	copy(unsafe.Slice((*byte)(p), len(s)), s)
	return p
}

// createPublisher starts a publisher on the current manager with an
// arbitrary config: endpoints that do not parse, loopback ports, long
// topics, fields out of range. One that starts becomes the current one.
func (fz *abiFuzz) createPublisher() (string, int) {
	const name = "kvp_event_publisher_config"
	cfg := fz.structBuf(name)
	fz.randomFields(cfg, name)
	if size := *(*uintptr)(cfg); size >= cLayouts[name].size && size <= 1<<16 {
		endpoints := []string{"", "nonsense", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "udp://x:1", "tcp://"}
		for _, f := range []string{"endpoint", "replay_endpoint", "topic", "medium"} {
			var v ptr
			switch k := fz.r.u8() % 4; {
			case k == 0:
			case f == "topic" && k == 1:
				v = fz.cstr(string(bytes.Repeat([]byte{'t'}, 1025)))
			default:
				v = fz.cstr(endpoints[fz.small(len(endpoints))])
			}
			setField(cfg, name, f, int64(uintptr(v)))
		}
		for _, f := range []string{"buffer_steps", "hwm", "max_batch_events"} {
			if fz.r.u8()%2 == 0 {
				setField(cfg, name, f, int64(fz.small(64)))
			}
		}
		if fz.r.u8()%2 == 0 {
			setField(cfg, name, "buffer_bytes", int64(fz.small(1<<16)))
		}
	}
	cfg, out := fz.createArgs(cfg)
	st := rawPublisherCreate(fz.handle(true), cfg, out)
	if st == 0 {
		rawPublisherDestroy(fz.pub)
		fz.pub = *(*ptr)(out)
	}
	return "kvp_event_publisher_create", st
}

// outStruct is an output struct of an arbitrary struct_size, NULL now and
// then.
func (fz *abiFuzz) outStruct(name string) ptr {
	if fz.r.u8()%12 == 0 {
		return nil
	}
	return fz.structBuf(name)
}

// keys is an array of n kvp_prefix_keys with arbitrary salts and items,
// or NULL.
func (fz *abiFuzz) keys(n int) ptr {
	if fz.r.u8()%2 == 0 {
		return nil
	}
	l := cLayouts["kvp_prefix_keys"]
	item := cLayouts["kvp_mm_item"]
	p := fz.alloc(int(l.size) * max(n, 1))
	for i := range n {
		k := unsafe.Add(p, int(l.size)*i)
		*(*uint64)(unsafe.Add(k, l.fields["adapter"].off)) = uint64(fz.small(3))
		saltLen := int32(fz.small(4))
		if fz.r.u8()%10 == 0 {
			saltLen = []int32{-1, 1025, math.MinInt32}[fz.small(3)]
		}
		*(*int32)(unsafe.Add(k, l.fields["salt_len"].off)) = saltLen
		if saltLen > 0 && saltLen <= 1024 && fz.r.u8()%10 != 0 {
			s := fz.alloc(int(saltLen))
			*(*byte)(s) = fz.r.u8()
			*(*ptr)(unsafe.Add(k, l.fields["salt"].off)) = s
		}
		numMM := int32(fz.small(3))
		if fz.r.u8()%10 == 0 {
			numMM = []int32{-1, 1<<20 + 1, math.MinInt32}[fz.small(3)]
		}
		*(*int32)(unsafe.Add(k, l.fields["num_mm"].off)) = numMM
		if numMM > 0 && numMM <= 2 && fz.r.u8()%10 != 0 {
			items := fz.alloc(int(item.size) * int(numMM))
			for j := range int(numMM) {
				it := unsafe.Add(items, int(item.size)*j)
				*(*int32)(it) = int32(fz.small(24))
				*(*int32)(unsafe.Add(it, 4)) = int32(fz.small(8)) - 1
				*(*byte)(unsafe.Add(it, 8)) = fz.r.u8()
			}
			*(*ptr)(unsafe.Add(k, l.fields["mm"].off)) = items
		}
	}
	return p
}

// admitOrMatch calls kvp_manager_admit (kind 0 and 1), kvp_manager_match
// or kvp_manager_match_blocks or kvp_manager_match_room (2: one byte
// picks the call and match's partial flag) or kvp_manager_match_tiers (3) with prompts of arbitrary
// tokens.
func (fz *abiFuzz) admitOrMatch(kind int) (string, int) {
	n := fz.small(4)
	var toks []int64
	offs := []int64{0}
	for range n {
		for range fz.small(24) {
			toks = append(toks, fz.token())
		}
		offs = append(offs, int64(len(toks)))
	}
	if fz.r.u8()%8 == 0 && n > 0 { // offsets that lie about the tokens
		offs[fz.small(n+1)] = fz.i64()
	}
	tokens := fz.array(len(toks), 4, func() int64 { return toks[0] })
	if tokens != nil {
		for i, x := range toks {
			*(*int32)(unsafe.Add(tokens, 4*i)) = int32(x)
		}
	}
	// An offset past the tokens given is refused by the ABI only when it
	// is past n * 2^30; within that, the caller's array must hold it, so
	// a lying offset stays within the array or goes past that bound.
	for i, o := range offs {
		if o > int64(len(toks)) && o <= int64(max(n, 1))<<30 {
			offs[i] = int64(len(toks))
		}
	}
	k := 0
	offsets := fz.array(len(offs), 8, func() int64 { k++; return offs[k-1] })
	cnt := fz.count(n)
	keys := fz.keys(n)
	if kind == 3 {
		out := fz.outp(int(cLayouts["kvp_tier_match"].size) * max(n, 1))
		return "kvp_manager_match_tiers", rawManagerMatchTiers(fz.handle(true), cnt, tokens, offsets, keys, out)
	}
	if kind == 2 {
		b := fz.r.u8()
		if b%8 >= 6 {
			out := fz.outp(4 * max(n, 1))
			return "kvp_manager_match_room", rawManagerMatchRoom(fz.handle(true), cnt, tokens, offsets, keys, out)
		}
		if b%4 >= 2 {
			out := fz.outp(int(cLayouts["kvp_block_match"].size) * max(n, 1))
			return "kvp_manager_match_blocks", rawManagerMatchBlocks(fz.handle(true), cnt, tokens, offsets, keys, out)
		}
		out := fz.outp(12 * max(n, 1))
		return "kvp_manager_match", rawManagerMatch(fz.handle(true), cnt, tokens, offsets, keys, int32(b%2), out)
	}
	ids := fz.array(n, 8, fz.id)
	var matched ptr
	if fz.r.u8()%2 == 0 {
		matched = fz.alloc(4 * max(n, 1))
	}
	return "kvp_manager_admit", rawManagerAdmit(fz.handle(true), ids, cnt, tokens, offsets, keys, matched, fz.outp(4))
}

// createManager makes a manager from an arbitrary config; one that is
// created becomes the current manager.
func (fz *abiFuzz) createManager() (string, int) {
	cfg := fz.structBuf("kvp_manager_config")
	l := cLayouts["kvp_manager_config"]
	badTier := false // a host tier field the header refuses
	var slots, ahead, evicted, wt, slack int32
	var bytes int64
	badShared, shared := false, false // a shared tier field the header refuses; a shared tier
	if size := *(*uintptr)(cfg); size >= 16 && size <= 1<<16 {
		nb := []int64{fz.i64(), int64(fz.small(64)) + 1}[fz.small(2)]
		if nb > 4096 && nb <= 1<<26 {
			nb = 4096 // valid, but a pool of millions of blocks costs each call's invariant check
		}
		setField(cfg, "kvp_manager_config", "num_blocks", nb)
		setField(cfg, "kvp_manager_config", "block_size", []int64{fz.i64(), int64(fz.small(9))}[fz.small(2)])
		if size >= 20 {
			setField(cfg, "kvp_manager_config", "enable_prefix_cache", fz.i64())
		}
		if size >= 24 {
			setField(cfg, "kvp_manager_config", "enable_kv_events", int64(fz.small(3))-1)
		}
		if size >= 28 {
			setField(cfg, "kvp_manager_config", "max_pending_events", fz.i64())
		}
		if size >= l.size && fz.r.u8()%2 == 0 {
			nb := int64(*(*int32)(unsafe.Add(cfg, l.fields["num_blocks"].off)))
			slots, ahead, bytes = int32(fz.small(8))+1, int32(fz.small(int(min(max(nb, 0), 64))+1)), int64(fz.small(64))+1
			switch fz.r.u8() % 8 {
			case 0:
				slots = []int32{-1, math.MinInt32, 1<<30 + 1}[fz.small(3)]
			case 1:
				bytes = []int64{0, -1, 1 << 46, math.MaxInt64, math.MinInt64}[fz.small(5)]
			case 2:
				ahead = []int32{-1, int32(nb) + 1, math.MaxInt32, math.MinInt32}[fz.small(4)]
			case 3:
				evicted = []int32{1, 2, -1, int32(fz.i64() | 1)}[fz.small(4)]
			case 4:
				slots = 0 // no tier: bytes and ahead must be 0 too
				if fz.r.u8()%2 == 0 {
					bytes, ahead = 0, 0
				}
			case 5: // write-through, with a slack (0: store every flush) in [0, num_blocks]
				wb := int(min(max(nb, 0), 64))
				wt = int32(fz.small(wb+1)) + 1 // past num_blocks only when it is 0 (refused)
				slack = []int32{0, int32(fz.small(wb + 1)), int32(min(max(nb, 0), math.MaxInt32))}[fz.small(3)]
			case 6: // a bad write-through or slack
				wt = []int32{-1, int32(nb) + 1, math.MinInt32, 0, 1, 1}[fz.small(6)]
				slack = []int32{1, -1, int32(nb) + 1, math.MaxInt32, math.MinInt32, 0}[fz.small(6)]
				if fz.r.u8()%4 == 0 {
					slots = 0 // no tier: write_through and the slack must be 0 too
				}
			}
			badTier = slots < 0 || slots > 1<<30 || (evicted != 0 && evicted != 1) ||
				(slots == 0 && (bytes != 0 || ahead != 0 || evicted != 0 || wt != 0 || slack != 0)) ||
				(slots > 0 && (bytes < 1 || bytes > (1<<46)/int64(slots) || ahead < 0 || int64(ahead) > nb ||
					wt < 0 || int64(wt) > nb || slack < 0 || int64(slack) > nb || (slack != 0 && wt == 0) || (slack > 0 && ahead > slack)))
			setField(cfg, "kvp_manager_config", "host_tier_slots", int64(slots))
			setField(cfg, "kvp_manager_config", "demote_ahead", int64(ahead))
			setField(cfg, "kvp_manager_config", "demote_evicted", int64(evicted))
			setField(cfg, "kvp_manager_config", "host_block_bytes", bytes)
			setField(cfg, "kvp_manager_config", "write_through", int64(wt))
			setField(cfg, "kvp_manager_config", "write_through_slack", int64(slack))
			if fz.r.u8()%3 == 0 {
				badShared, shared = fz.sharedConfig(cfg, slots)
			}
		}
		if size >= l.size && fz.groups && fz.r.u8()%3 == 0 {
			fz.layerGroups(cfg)
		}
	}
	cfg, out := fz.createArgs(cfg)
	live := fz.liveHandles()
	st := rawManagerCreate(cfg, out)
	if st == 0 {
		if badTier {
			fz.t.Fatalf("kvp_manager_create accepted host tier slots %d, demote_ahead %d, demote_evicted %d, bytes %d, write_through %d, write_through_slack %d",
				slots, ahead, evicted, bytes, wt, slack)
		}
		if badShared {
			fz.t.Fatalf("kvp_manager_create accepted a bad shared tier config")
		}
		rawPublisherDestroy(fz.pub)
		fz.pub = nil
		rawManagerDestroy(fz.m)
		fz.m = *(*ptr)(out)
		fz.pins = nil
		fz.numBlocks = *(*int32)(unsafe.Add(cfg, l.fields["num_blocks"].off))
		fz.tierSlots, fz.demoteAhead, fz.tierBytes, fz.shared, fz.demoteEvicted, fz.writeThrough = 0, 0, 0, false, false, 0
		if *(*uintptr)(cfg) >= l.size {
			fz.tierSlots, fz.demoteAhead, fz.tierBytes, fz.shared, fz.writeThrough = slots, ahead, bytes, shared, wt
			fz.demoteEvicted = slots > 0 && evicted == 1
		}
		fz.tickets, fz.doneTickets = nil, nil
		fz.tierCounters = make([]int64, len(tierCounterFields)) // a new manager's counters start at 0
		return "kvp_manager_create", st
	}
	fz.createFailed("kvp_manager_create", live, out)
	if (badTier || badShared) && cfg != nil && out != nil && *(*uintptr)(cfg) == l.size && st != int(kverr.InvalidArgument) {
		fz.t.Fatalf("kvp_manager_create of a bad host (%v) or shared (%v) tier: %s (%s)", badTier, badShared, statusName(st), lastError())
	}
	return "kvp_manager_create", st
}

// sharedConfig sets the shared tier fields of a full-size config whose
// host tier has slots (0: none): an address nothing listens on (port 1,
// refused at once), an empty or too long one, or NULL; a namespace valid,
// empty, with a character the header refuses, too long, or NULL; a
// timeout and a queue length in range or not. It reports whether the
// header refuses them, and whether they make a shared tier.
func (fz *abiFuzz) sharedConfig(cfg ptr, slots int32) (bad, shared bool) {
	l := cLayouts["kvp_manager_config"]
	str := func(v string, null bool) ptr {
		if null {
			return nil
		}
		p := fz.alloc(len(v) + 1)
		copy(unsafe.Slice((*byte)(p), len(v)), v)
		return p
	}
	addrs := []string{"127.0.0.1:1", "", strings.Repeat("a", 1025)}
	nss := []string{"fuzz.bs4", "", "meta/x", strings.Repeat("n", 65)}
	ai, ni := fz.small(len(addrs)+1), fz.small(len(nss)+1) // the last: NULL
	timeout := []int64{0, 100, -1, 60001, fz.i64()}[fz.small(5)]
	queue := []int64{0, 4, -1, 1<<20 + 1, fz.i64()}[fz.small(5)]
	timeout, queue = int64(int32(timeout)), int64(int32(queue))
	*(*ptr)(unsafe.Add(cfg, l.fields["shared_tier_addr"].off)) = str(addrs[min(ai, len(addrs)-1)], ai == len(addrs))
	*(*ptr)(unsafe.Add(cfg, l.fields["shared_tier_namespace"].off)) = str(nss[min(ni, len(nss)-1)], ni == len(nss))
	setField(cfg, "kvp_manager_config", "shared_tier_timeout_ms", timeout)
	setField(cfg, "kvp_manager_config", "shared_tier_put_queue", queue)
	if ai == len(addrs) {
		return ni != len(nss) || timeout != 0 || queue != 0, false
	}
	bad = slots <= 0 || ai != 0 || ni != 0 || timeout < 0 || timeout > 60000 || queue < 0 || queue > 1<<20
	return bad, !bad
}

// liveHandles is kvp_live_handles' count.
func (fz *abiFuzz) liveHandles() int64 {
	p := newCBuf(8)
	defer p.free()
	if st := rawLiveHandles(p.p); st != 0 {
		fz.t.Fatalf("kvp_live_handles: %s", lastError())
	}
	return *(*int64)(p.p)
}

// createVcache makes a host-backend cache from an arbitrary config (the
// CUDA backend where no GPU is, for its refusal); physical memory stays
// under a small budget.
func (fz *abiFuzz) createVcache() (string, int) {
	const name = "kvp_vcache_config"
	cfg := fz.structBuf(name)
	background := false
	if size := *(*uintptr)(cfg); size >= cLayouts[name].size && size <= 1<<16 {
		backend := int64(1)
		if !fz.gpu && fz.r.u8()%8 == 0 {
			backend = 0
		} else if fz.r.u8()%8 == 0 {
			backend = fz.i64()
			if backend == 0 {
				backend = 2
			}
		}
		setField(cfg, name, "backend", backend)
		for _, f := range []string{"num_layers", "num_kv_heads", "head_dim", "max_batch", "max_context"} {
			v := int64(fz.small(8)) + 1
			if f == "head_dim" || f == "max_context" {
				v *= 32
			}
			if fz.r.u8()%6 == 0 {
				v = fz.i64()
			}
			setField(cfg, name, f, v)
		}
		setField(cfg, name, "dtype_bytes", []int64{0, 1, 2, 4, 8, 3, -1}[fz.small(7)])
		setField(cfg, name, "page_size", []int64{0, 4096, 8192, 1000, -4096, 1 << 31}[fz.small(6)])
		setField(cfg, name, "budget_bytes", []int64{64 << 10, 1 << 20, 4 << 20, 0, -1, 4096, math.MaxInt64}[fz.small(7)])
		setField(cfg, name, "reclaim_below_bytes", []int64{0, -1, 1 << 16, math.MinInt64}[fz.small(4)])
		setField(cfg, name, "lookahead_tokens", fz.i64())
		setField(cfg, name, "no_background", int64(fz.small(2)))
		background = *(*int32)(unsafe.Add(cfg, cLayouts[name].fields["no_background"].off)) == 0
	}
	cfg, out := fz.createArgs(cfg)
	st := rawVcacheCreate(cfg, out)
	if st == 0 {
		if *(*int64)(unsafe.Add(cfg, cLayouts[name].fields["budget_bytes"].off)) > 4<<20 {
			rawVcacheDestroy(*(*ptr)(out)) // valid, but the fuzz keeps memory small
			return "kvp_vcache_create", st
		}
		rawVcacheDestroy(fz.c)
		fz.c, fz.cBackground = *(*ptr)(out), background
		return "kvp_vcache_create", st
	}
	return "kvp_vcache_create", st
}

// launch calls one of the kernel launches with an args struct of arbitrary
// size and fields; the host arrays of kvp_prefill_plan hold what its batch
// says. Left out where a GPU would run the kernels.
func (fz *abiFuzz) launch(op uint8) (string, int) {
	names := map[uint8][2]string{36: {"kvp_kv_write", "kvp_kv_write_args"}, 37: {"kvp_paged_decode", "kvp_paged_decode_args"},
		38: {"kvp_merge_states", "kvp_merge_states_args"}, 39: {"kvp_prefill_plan", "kvp_prefill_plan_args"},
		40: {"kvp_paged_prefill", "kvp_paged_prefill_args"}}
	call, sname := names[op][0], names[op][1]
	if fz.gpu {
		return call, -1
	}
	args := fz.structBuf(sname)
	l := cLayouts[sname]
	if size := *(*uintptr)(args); size >= l.size && size <= 1<<16 {
		fz.randomFields(args, sname)
		if op == 39 {
			// Host arrays: batch+1 offsets and batch lengths, or NULL.
			batch := fz.small(6)
			if fz.r.u8()%8 == 0 {
				batch = []int{-1, 65536, math.MaxInt32}[fz.small(3)]
			}
			setField(args, sname, "batch", int64(batch))
			if batch >= 0 && batch < 64 {
				setField(args, sname, "qo_indptr_host", int64(uintptr(fz.array(batch+1, 4, func() int64 { return int64(fz.small(9)) }))))
				setField(args, sname, "kv_lens_host", int64(uintptr(fz.array(batch, 4, func() int64 { return int64(fz.small(12)) }))))
			} else {
				setField(args, sname, "qo_indptr_host", 0)
				setField(args, sname, "kv_lens_host", 0)
			}
		}
	}
	if fz.r.u8()%10 == 0 {
		args = nil
	}
	switch op {
	case 36:
		return call, rawKVWrite(args)
	case 37:
		return call, rawPagedDecode(args)
	case 38:
		return call, rawMergeStates(args)
	case 39:
		return call, rawPrefillPlan(args, fz.outStruct("kvp_attn_plan"))
	}
	return call, rawPagedPrefill(fz.outStruct("kvp_attn_plan"), args)
}

// The seed corpus in a plain test run is the fuzz target's short budget;
// this checks that the target reaches every group of entry points.
func TestFuzzABIReachesEveryEntryPoint(t *testing.T) {
	lockThread(t)
	seen := map[string]bool{}
	// reach makes the call that setup (its bytes first) and op choose
	// among ops calls.
	reachWith := func(fill byte, setup []byte, op, ops uint8) {
		data := append(append(slices.Clone(setup), op), bytes.Repeat([]byte{fill}, 64)...)
		fz := &abiFuzz{t: t, r: byteReader(data), junk: newCBuf(64), gpu: cuda.Available()}
		fz.setup()
		name, _ := fz.call(fz.r.u8() % ops)
		fz.close()
		seen[name] = true
	}
	reach := func(setup []byte, op, ops uint8) { reachWith(1, setup, op, ops) }
	for op := range uint8(numOps) {
		reach([]byte{5, 8, 4}, op, numOps)
	}
	reachWith(3, []byte{5, 8, 4}, 11, numOps) // admitOrMatch(2) with its byte picking kvp_manager_match_blocks
	reachWith(7, []byte{5, 8, 4}, 11, numOps) // and with its byte picking kvp_manager_match_room
	for op := range uint8(numGroupOps) {
		// Layer groups (flag groupsFlag) on the prefix cache: a window of 3, checkpoints every 2 blocks.
		reach([]byte{1 | groupsFlag, 8, 4, 2, 1}, numOps+op, numOps+numGroupOps)
	}
	for op := range uint8(numStoreOps) {
		// Stores (flag storesFlag) on a host store of 4 slots of 16 bytes.
		reach([]byte{5 | storesFlag, 8, 4, 3, 1}, numOps+op, numOps+numStoreOps)
	}
	want := []string{"kvp_manager_add", "kvp_manager_grow", "kvp_manager_grow_tokens", "kvp_manager_fork", "kvp_manager_remove", "kvp_manager_mark_computed",
		"kvp_manager_describe", "kvp_manager_describe_groups", "kvp_manager_group_blocks", "kvp_manager_take_copies", "kvp_manager_stats_get", "kvp_manager_prefix_stats", "kvp_manager_admit", "kvp_manager_match",
		"kvp_manager_pin", "kvp_manager_unpin", "kvp_manager_set_priority", "kvp_manager_prefix_stats_reset",
		"kvp_manager_clear_prefix_cache", "kvp_manager_drain_events", "kvp_manager_next_event_size", "kvp_manager_add_mm_items",
		"kvp_manager_drain_group_events", "kvp_manager_next_group_event_size",
		"kvp_manager_create", "kvp_manager_destroy", "kvp_vcache_create", "kvp_vcache_destroy", "kvp_vcache_layer_ptrs",
		"kvp_vcache_strides", "kvp_vcache_alloc_slot", "kvp_vcache_free_slot", "kvp_vcache_step", "kvp_vcache_trim",
		"kvp_vcache_stats_get", "kvp_attn_workspace_size", "kvp_prefill_workspace_size", "kvp_attn_num_splits",
		"kvp_kv_write", "kvp_paged_decode", "kvp_merge_states", "kvp_prefill_plan", "kvp_paged_prefill",
		"kvp_cuda_available", "kvp_attn_prepare", "kvp_live_handles", "kvp_set_log_level", "kvp_set_logger",
		"kvp_version", "kvp_status_string", "kvp_cascade_workspace_size", "kvp_cascade_plan", "kvp_cascade_update",
		"kvp_paged_cascade", "kvp_event_publisher_create", "kvp_event_publisher_flush", "kvp_event_publisher_resync",
		"kvp_event_publisher_stats_get", "kvp_event_publisher_destroy", "kvp_manager_flush_copies",
		"kvp_manager_complete_copies", "kvp_manager_match_tiers", "kvp_manager_match_blocks", "kvp_manager_match_room", "kvp_manager_tier_stats", "kvp_manager_host_tier_memory",
		"kvp_host_store_create", "kvp_host_store_destroy", "kvp_host_store_state", "kvp_host_store_lookup_prefix",
		"kvp_host_store_reserve", "kvp_host_store_complete", "kvp_host_store_pin", "kvp_host_store_unpin",
		"kvp_host_store_touch", "kvp_host_store_reset", "kvp_host_store_stats_get", "kvp_host_store_memory",
		"kvp_host_store_write", "kvp_host_store_read", "kvp_shared_store_create", "kvp_shared_store_destroy",
		"kvp_shared_store_exists", "kvp_shared_store_put", "kvp_shared_store_get", "kvp_shared_store_stats_get"}
	for _, w := range want {
		if !seen[w] {
			t.Errorf("FuzzABI never calls %s", w)
		}
	}
	if len(seen) != len(want) {
		t.Errorf("FuzzABI calls %d entry points, the list names %d: %v", len(seen), len(want), fmt.Sprint(seen))
	}
}

// FuzzABI's body over seeded random inputs, in every plain test run: the
// fuzzer's coverage guidance finds deep sequences, this finds the shallow
// ones a change breaks (an arbitrary address left in a host pointer field,
// a status the checks did not know), each with its input in the failure.
func TestFuzzABIRandomInputs(t *testing.T) {
	lockThread(t)
	gpu := cuda.Available()
	r := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		data := make([]byte, r.IntN(400))
		for i := range data {
			data[i] = byte(r.Uint32())
		}
		t.Run("", func(t *testing.T) {
			fz := &abiFuzz{t: t, r: byteReader(data), gpu: gpu, junk: newCBuf(64)}
			defer fz.close()
			fz.setup()
			for i := 0; !fz.r.done() && i < 64; i++ {
				fz.step()
			}
		})
		if t.Failed() {
			t.Fatalf("input %q", data)
		}
	}
}
