package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// The scenario files under testdata/scenarios (their README has the
// format) run here through the exported functions, as the C++ and Python
// runners run them through the header and ctypes: one list of calls and
// statuses, three runners.

const scenarioDir = "../testdata/scenarios"

// cLayouts are the header structs' layouts (scenario_testhooks.go).
var cLayouts = buildCLayouts()

// scValue is one argument or expected output.
type scValue struct {
	raw   string
	null  bool
	lists [][]int64 // a list, or several joined by '/'; nil when not a list
}

func (v scValue) list() []int64 {
	if len(v.lists) == 0 {
		return nil
	}
	return v.lists[0]
}

// scStmt is one call line.
type scStmt struct {
	line   int
	call   string
	args   map[string]scValue
	want   string // status without the KVP_ / KVP_ERR_ prefix
	outs   map[string]scValue
	frag   string
	source string
}

type scenario struct {
	name  string
	stmts []scStmt
}

func parseScValue(s string) (scValue, error) {
	v := scValue{raw: s}
	if s == "NULL" {
		v.null = true
		return v, nil
	}
	if !strings.HasPrefix(s, "[") {
		return v, nil
	}
	for _, part := range strings.Split(s, "/") {
		if !strings.HasPrefix(part, "[") || !strings.HasSuffix(part, "]") {
			return v, fmt.Errorf("bad list %q", part)
		}
		l := []int64{}
		body := part[1 : len(part)-1]
		if body != "" {
			for _, item := range strings.Split(body, ",") {
				if a, b, ok := strings.Cut(item, ".."); ok {
					lo, err1 := strconv.ParseInt(a, 10, 64)
					hi, err2 := strconv.ParseInt(b, 10, 64)
					if err1 != nil || err2 != nil || hi < lo {
						return v, fmt.Errorf("bad range %q", item)
					}
					for x := lo; x <= hi; x++ {
						l = append(l, x)
					}
					continue
				}
				x, err := strconv.ParseInt(item, 10, 64)
				if err != nil {
					return v, fmt.Errorf("bad list item %q", item)
				}
				l = append(l, x)
			}
		}
		v.lists = append(v.lists, l)
	}
	return v, nil
}

func parseScenarios(path string) ([]scenario, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []scenario
	sc := bufio.NewScanner(f)
	for ln := 1; sc.Scan(); ln++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if name, ok := strings.CutPrefix(line, "scenario "); ok {
			out = append(out, scenario{name: strings.TrimSpace(name)})
			continue
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("%s:%d: a call before the first scenario", path, ln)
		}
		st := scStmt{line: ln, args: map[string]scValue{}, outs: map[string]scValue{}, source: line}
		if i := strings.IndexByte(line, '"'); i >= 0 {
			j := strings.LastIndexByte(line, '"')
			if j <= i {
				return nil, fmt.Errorf("%s:%d: unterminated message fragment", path, ln)
			}
			st.frag = line[i+1 : j]
			line = strings.TrimSpace(line[:i])
		}
		lhs, rhs, ok := strings.Cut(line, "->")
		if !ok {
			return nil, fmt.Errorf("%s:%d: no '->'", path, ln)
		}
		fields := strings.Fields(lhs)
		st.call = fields[0]
		for _, kv := range fields[1:] {
			k, val, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("%s:%d: argument %q is not name=value", path, ln, kv)
			}
			if st.args[k], err = parseScValue(val); err != nil {
				return nil, fmt.Errorf("%s:%d: %v", path, ln, err)
			}
		}
		res := strings.Fields(rhs)
		if len(res) == 0 {
			return nil, fmt.Errorf("%s:%d: no expected status", path, ln)
		}
		st.want = res[0]
		for _, kv := range res[1:] {
			k, val, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, fmt.Errorf("%s:%d: output %q is not name=value", path, ln, kv)
			}
			if st.outs[k], err = parseScValue(val); err != nil {
				return nil, fmt.Errorf("%s:%d: %v", path, ln, err)
			}
		}
		if st.want == "OK" && st.frag != "" {
			return nil, fmt.Errorf("%s:%d: a message fragment for a call expected to succeed", path, ln)
		}
		if st.want != "OK" && len(st.outs) > 0 {
			return nil, fmt.Errorf("%s:%d: outputs for a call expected to fail", path, ln)
		}
		out[len(out)-1].stmts = append(out[len(out)-1].stmts, st)
	}
	return out, sc.Err()
}

// scRunner runs one scenario's calls.
type scRunner struct {
	t        *testing.T
	st       *scStmt
	m, c     ptr // current manager and cache
	otherM   ptr // a manager for c=other
	otherC   ptr // a cache for m=other
	staleM   ptr
	staleC   ptr
	junk     cbuf
	lastPin  uint64
	pub      ptr // current event publisher, on m
	stalePub ptr
	bufs     []cbuf
	results  map[string]any // outputs of the current call
	failedAt string
}

func (r *scRunner) fatalf(format string, args ...any) {
	r.t.Helper()
	r.t.Fatalf("%s:%d: %s\n\t%s", filepath.Base(r.failedAt), r.st.line, fmt.Sprintf(format, args...), r.st.source)
}

func (r *scRunner) alloc(n int) ptr {
	b := newCBuf(n)
	r.bufs = append(r.bufs, b)
	return b.p
}

func (r *scRunner) has(k string) bool { _, ok := r.st.args[k]; return ok }

func (r *scRunner) isNull(k string) bool { return r.st.args[k].null }

func (r *scRunner) int(k string, def int64) int64 {
	v, ok := r.st.args[k]
	if !ok {
		return def
	}
	x, err := strconv.ParseInt(v.raw, 10, 64)
	if err != nil {
		r.fatalf("argument %s=%s is not an integer", k, v.raw)
	}
	return x
}

func (r *scRunner) list(k string) []int64 {
	v, ok := r.st.args[k]
	if !ok || v.null {
		return nil
	}
	if v.lists == nil {
		r.fatalf("argument %s=%s is not a list", k, v.raw)
	}
	return v.list()
}

// array returns C memory holding list k as elemSize-byte integers, or nil
// for NULL; an absent argument gives an array of n zeros.
func (r *scRunner) array(k string, elemSize int, n int) ptr {
	if r.isNull(k) {
		return nil
	}
	l := r.list(k)
	if !r.has(k) {
		l = make([]int64, n)
	}
	p := r.alloc(elemSize * max(len(l), 1))
	for i, x := range l {
		switch elemSize {
		case 4:
			*(*int32)(unsafe.Add(p, 4*i)) = int32(x)
		case 8:
			*(*int64)(unsafe.Add(p, 8*i)) = x
		}
	}
	return p
}

// out returns room for an output of size bytes, or nil for NULL.
func (r *scRunner) out(k string, size int) ptr {
	if r.isNull(k) {
		return nil
	}
	return r.alloc(size)
}

// structSize resolves a struct_size value of the named struct.
func (r *scRunner) structSize(k, name string) uintptr {
	l := cLayouts[name]
	v, ok := r.st.args[k]
	if !ok {
		return l.size
	}
	s := v.raw
	var base uintptr
	switch {
	case strings.HasPrefix(s, "FULL"):
		base, s = l.size, s[4:]
	case strings.HasPrefix(s, "FIRST"):
		if name != "kvp_manager_config" {
			r.fatalf("FIRST is known only for kvp_manager_config")
		}
		base, s = firstManagerConfigSize(), s[5:]
	default:
		x, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			r.fatalf("bad %s=%s", k, v.raw)
		}
		return uintptr(x)
	}
	if s == "" {
		return base
	}
	d, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		r.fatalf("bad %s=%s", k, v.raw)
	}
	return uintptr(int64(base) + d)
}

// cstruct builds the named struct in C memory (at least struct_size bytes
// and the struct's own size) from the call's arguments that name its
// fields, with the given defaults; nil when arg is NULL.
func (r *scRunner) cstruct(arg, name string, defaults map[string]int64, renames map[string]string) ptr {
	if r.isNull(arg) {
		return nil
	}
	l := cLayouts[name]
	size := r.structSize("struct_size", name)
	p := r.alloc(int(max(size, l.size)) + 8)
	*(*uintptr)(p) = size
	set := func(field string, x int64) {
		f, ok := l.fields[field]
		if !ok {
			r.fatalf("%s has no field %s", name, field)
		}
		switch f.size {
		case 4:
			*(*int32)(unsafe.Add(p, f.off)) = int32(x)
		case 8:
			*(*int64)(unsafe.Add(p, f.off)) = x
		default:
			r.fatalf("field %s of %d bytes", field, f.size)
		}
	}
	for f, x := range defaults {
		set(f, x)
	}
	for k := range r.st.args {
		field := k
		if rn, ok := renames[k]; ok {
			field = rn
		}
		if _, ok := l.fields[field]; ok && field != "struct_size" {
			if stringFields[field] {
				var sp ptr
				if !r.isNull(k) {
					v := r.st.args[k].raw
					sp = r.alloc(len(v) + 1)
					copy(unsafe.Slice((*byte)(sp), len(v)), v)
				}
				*(*ptr)(unsafe.Add(p, l.fields[field].off)) = sp
				continue
			}
			set(field, r.int(k, 0))
		}
	}
	if r.has("byte") {
		off := r.structSize("byte", name)
		if v := r.st.args["byte"].raw; !strings.HasPrefix(v, "FULL") {
			x, _ := strconv.ParseUint(v, 10, 64)
			off = uintptr(x)
		}
		*(*byte)(unsafe.Add(p, off)) = 1
	}
	return p
}

// stringFields are the struct fields that hold a C string, given as a word.
var stringFields = map[string]bool{"endpoint": true, "replay_endpoint": true, "topic": true, "medium": true}

// readStruct records every field of the named struct at p as an output.
func (r *scRunner) readStruct(name string, p ptr) {
	for field, f := range cLayouts[name].fields {
		switch f.size {
		case 4:
			r.results[field] = int64(*(*int32)(unsafe.Add(p, f.off)))
		case 8:
			r.results[field] = *(*int64)(unsafe.Add(p, f.off))
		}
	}
}

func i32s(p ptr, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(*(*int32)(unsafe.Add(p, 4*i)))
	}
	return out
}

func i32(p ptr) int64 { return int64(*(*int32)(p)) }

// handle resolves the m= or c= argument.
func (r *scRunner) handle(k string, manager bool) ptr {
	cur := r.c
	if manager {
		cur = r.m
	}
	v, ok := r.st.args[k]
	if !ok {
		return cur
	}
	switch v.raw {
	case "NULL":
		return nil
	case "junk":
		return r.junk.p
	case "stale":
		if manager {
			if r.staleM == nil {
				r.staleM = r.newManager()
				rawManagerDestroy(r.staleM)
			}
			return r.staleM
		}
		if r.staleC == nil {
			r.staleC = r.newVcache()
			rawVcacheDestroy(r.staleC)
		}
		return r.staleC
	case "other":
		if manager && r.c != nil {
			return r.c
		}
		if !manager && r.m != nil {
			return r.m
		}
		if manager {
			if r.otherC == nil {
				r.otherC = r.newVcache()
			}
			return r.otherC
		}
		if r.otherM == nil {
			r.otherM = r.newManager()
		}
		return r.otherM
	}
	r.fatalf("unknown handle %s=%s", k, v.raw)
	return nil
}

func (r *scRunner) newManager() ptr {
	h, st := hookManagerCreate(sizeofManagerConfig(), 4, 4, false, false)
	if st != 0 {
		r.fatalf("helper manager: %s", lastError())
	}
	return h
}

func (r *scRunner) newVcache() ptr {
	h, st := hookVcacheCreate(1, 1, 64, 1, 64, 1<<20)
	if st != 0 {
		r.fatalf("helper vcache: %s", lastError())
	}
	return h
}

// snapshot is what a caller can observe of the current objects.
func (r *scRunner) snapshot() string {
	var b strings.Builder
	if r.m != nil {
		for _, s := range []struct {
			name string
			get  func(m, out ptr) int
		}{{"kvp_manager_stats", rawManagerStats}, {"kvp_prefix_stats", rawManagerPrefixStats}} {
			l := cLayouts[s.name]
			p := r.alloc(int(l.size))
			*(*uintptr)(p) = l.size
			if st := s.get(r.m, p); st != 0 {
				r.fatalf("snapshot %s: %s", s.name, lastError())
			}
			if s.name == "kvp_prefix_stats" && r.pub != nil {
				// A running publisher drains the manager's events on its own
				// goroutine: the pending count moves between any two calls.
				f := cLayouts[s.name].fields["pending_events"]
				*(*int32)(unsafe.Add(p, f.off)) = 0
			}
			b.Write(unsafe.Slice((*byte)(p), l.size))
		}
	}
	if r.c != nil {
		l := cLayouts["kvp_vcache_stats"]
		p := r.alloc(int(l.size))
		*(*uintptr)(p) = l.size
		if st := rawVcacheStats(r.c, p); st != 0 {
			r.fatalf("snapshot vcache: %s", lastError())
		}
		// Refusals and times are counted even by calls that change nothing.
		for _, f := range []string{"page_size", "budget_bytes", "tensor_bytes", "mapped_bytes", "held_bytes", "active_slots",
			"reusable_slots", "steps", "map_calls", "unmap_calls", "create_calls", "release_calls"} {
			fl := l.fields[f]
			fmt.Fprintf(&b, "%s=%x;", f, unsafe.Slice((*byte)(unsafe.Add(p, fl.off)), fl.size))
		}
	}
	return b.String()
}

func (r *scRunner) close() {
	rawPublisherDestroy(r.pub) // before its manager, as the header asks
	for _, h := range []ptr{r.m, r.otherM} {
		rawManagerDestroy(h)
	}
	for _, h := range []ptr{r.c, r.otherC} {
		rawVcacheDestroy(h)
	}
	r.junk.free()
	r.m, r.c, r.otherM, r.otherC = nil, nil, nil, nil
}

// run executes one statement and checks its status, message, outputs and,
// for a failure, that nothing observable changed.
func (r *scRunner) run(st *scStmt) {
	r.st = st
	r.results = map[string]any{}
	defer func() {
		for _, b := range r.bufs {
			b.free()
		}
		r.bufs = nil
	}()
	want := "KVP_OK"
	if st.want != "OK" {
		want = "KVP_ERR_" + st.want
	}
	var before string
	if st.want != "OK" {
		before = r.snapshot()
	}
	got := r.call()
	if statusName(got) != want {
		r.fatalf("status %s, want %s (%s)", statusName(got), want, lastError())
	}
	if got != 0 {
		msg := lastError()
		if msg == "" {
			r.fatalf("failed without a message")
		}
		if !strings.Contains(msg, st.frag) {
			r.fatalf("message %q lacks %q", msg, st.frag)
		}
		if after := r.snapshot(); after != before {
			r.fatalf("a failed call changed the state")
		}
	}
	for k, v := range st.outs {
		res, ok := r.results[k]
		if !ok {
			r.fatalf("the call has no output %s", k)
		}
		var g string
		switch x := res.(type) {
		case int64:
			g = strconv.FormatInt(x, 10)
			if v.raw != g {
				r.fatalf("output %s = %s, want %s", k, g, v.raw)
			}
		case []int64:
			if !slices.Equal(x, v.list()) {
				r.fatalf("output %s = %v, want %v", k, x, v.list())
			}
		}
	}
	if r.m != nil {
		if s := rawManagerCheck(r.m); s != 0 {
			r.fatalf("invariants broken: %s", lastError())
		}
	}
}

func (r *scRunner) call() int {
	a := r.st.args
	switch r.st.call {
	case "manager_create":
		cfg := r.cstruct("cfg", "kvp_manager_config", nil,
			map[string]string{"prefix_cache": "enable_prefix_cache", "kv_events": "enable_kv_events"})
		out := r.out("out", 8)
		s := rawManagerCreate(cfg, out)
		if s == 0 {
			rawPublisherDestroy(r.pub)
			r.pub = nil
			rawManagerDestroy(r.m)
			r.m = *(*ptr)(out)
		}
		return s
	case "manager_destroy":
		rawManagerDestroy(r.handle("m", true))
		if !r.has("m") {
			r.m = nil
		}
		return 0
	case "manager_add":
		return rawManagerAdd(r.handle("m", true), r.int("id", 0), int32(r.int("prompt_len", 0)))
	case "manager_grow":
		n := r.int("n", int64(len(r.list("ids"))))
		return rawManagerGrow(r.handle("m", true), r.array("ids", 8, 0), r.array("counts", 4, 0), int32(n))
	case "manager_grow_tokens":
		n := r.int("n", int64(len(r.list("ids"))))
		return rawManagerGrowTokens(r.handle("m", true), r.array("ids", 8, 0), r.array("counts", 4, 0), int32(n), r.array("tokens", 4, 0))
	case "manager_fork":
		n := r.int("n", int64(len(r.list("children"))))
		maxCopies := r.int("max_copies", 0)
		copies := r.out("copies", 8*int(max(maxCopies, 0)))
		num := r.out("num_copies", 4)
		s := rawManagerFork(r.handle("m", true), r.int("parent", 0), r.array("children", 8, 0), int32(n), copies, int32(maxCopies), num)
		if s == 0 {
			r.results["num_copies"] = i32(num)
		}
		return s
	case "manager_mark_computed":
		return rawManagerMarkComputed(r.handle("m", true))
	case "manager_remove":
		n := r.int("n", int64(len(r.list("ids"))))
		return rawManagerRemove(r.handle("m", true), r.array("ids", 8, 0), int32(n))
	case "manager_describe":
		n := r.int("n", int64(len(r.list("ids"))))
		maxBlocks := r.int("max_blocks", 0)
		slotCap := r.int("slot_capacity", 0)
		table := r.out("block_table", 4*int(max(n, 0)*max(maxBlocks, 0)))
		lens := r.out("seq_lens", 4*int(max(n, 0)))
		slots := r.out("slot_mapping", 4*int(max(slotCap, 0)))
		num := r.out("num_slots", 4)
		s := rawManagerDescribe(r.handle("m", true), r.array("ids", 8, 0), int32(n), table, int32(maxBlocks), lens, slots, int32(slotCap), num)
		if s == 0 {
			r.results["num_slots"] = i32(num)
			r.results["seq_lens"] = i32s(lens, int(n))
		}
		return s
	case "manager_stats_get":
		out := r.cstruct("out", "kvp_manager_stats", nil, nil)
		s := rawManagerStats(r.handle("m", true), out)
		if s == 0 {
			r.readStruct("kvp_manager_stats", out)
		}
		return s
	case "manager_prefix_stats":
		out := r.cstruct("out", "kvp_prefix_stats", nil, nil)
		s := rawManagerPrefixStats(r.handle("m", true), out)
		if s == 0 {
			r.readStruct("kvp_prefix_stats", out)
		}
		return s
	case "manager_admit", "manager_match":
		prompts := a["prompts"].lists
		n := r.int("n", int64(len(prompts)))
		var toks []int64
		offs := []int64{0}
		for _, p := range prompts {
			toks = append(toks, p...)
			offs = append(offs, int64(len(toks)))
		}
		tokens := r.alloc(4 * max(len(toks), 1))
		for i, x := range toks {
			*(*int32)(unsafe.Add(tokens, 4*i)) = int32(x)
		}
		if r.isNull("tokens") {
			tokens = nil
		}
		var offsets ptr
		if r.has("offsets") {
			offsets = r.array("offsets", 8, 0)
		} else {
			offsets = r.alloc(8 * len(offs))
			for i, x := range offs {
				*(*int64)(unsafe.Add(offsets, 8*i)) = x
			}
		}
		keys := r.keys(len(prompts))
		if r.st.call == "manager_match" {
			out := r.out("out", 12*max(len(prompts), 1))
			s := rawManagerMatch(r.handle("m", true), int32(n), tokens, offsets, keys, int32(r.int("partial", 0)), out)
			if s == 0 {
				all := i32s(out, 3*len(prompts))
				for j, k := range []string{"matched", "partial_block", "partial_tokens"} {
					var l []int64
					for i := range prompts {
						l = append(l, all[3*i+j])
					}
					r.results[k] = l
				}
			}
			return s
		}
		matched := r.alloc(4 * max(len(prompts), 1))
		num := r.out("num_admitted", 4)
		s := rawManagerAdmit(r.handle("m", true), r.array("ids", 8, 0), int32(n), tokens, offsets, keys, matched, num)
		if s == 0 {
			r.results["num_admitted"] = i32(num)
			r.results["matched"] = i32s(matched, int(i32(num)))
		}
		return s
	case "manager_pin", "manager_set_priority":
		toks := r.list("tokens")
		n := r.int("num_tokens", int64(len(toks)))
		tokens := r.array("tokens", 4, 0)
		nb := r.alloc(4)
		if r.st.call == "manager_set_priority" {
			s := rawManagerSetPriority(r.handle("m", true), tokens, int32(n), nil, int32(r.int("priority", 0)), nb)
			if s == 0 {
				r.results["num_blocks"] = i32(nb)
			}
			return s
		}
		id := r.out("pin_id", 8)
		s := rawManagerPin(r.handle("m", true), tokens, int32(n), nil, id, nb)
		if s == 0 {
			r.lastPin = *(*uint64)(id)
			r.results["num_blocks"] = i32(nb)
		}
		return s
	case "manager_unpin":
		id := r.lastPin
		if a["pin_id"].raw != "last" {
			id = uint64(r.int("pin_id", 0))
		}
		return rawManagerUnpin(r.handle("m", true), id)
	case "manager_clear_prefix_cache":
		num := r.alloc(4)
		s := rawManagerClearPrefixCache(r.handle("m", true), num)
		if s == 0 {
			r.results["num_freed"] = i32(num)
		}
		return s
	case "manager_drain_events":
		me, mt, mm, mh := r.int("max_events", 0), r.int("max_tokens", 0), r.int("max_mm", 0), r.int("max_hashes", 0)
		ev := r.out("events", int(cLayouts["kvp_kv_event"].size)*int(max(me, 1)))
		tok := r.out("tokens", 4*int(max(mt, 1)))
		mmb := r.alloc(int(cLayouts["kvp_block_mm"].size) * int(max(mm, 1)))
		hs := r.alloc(16 * int(max(mh, 1)))
		num := r.out("num_events", 4)
		s := rawManagerDrainEvents(r.handle("m", true), ev, int32(me), tok, int32(mt), mmb, int32(mm), hs, int32(mh), num)
		if s == 0 {
			r.results["num_events"] = i32(num)
		}
		return s
	case "manager_next_event_size":
		t, m, h := r.alloc(4), r.alloc(4), r.alloc(4)
		s := rawManagerNextEventSize(r.handle("m", true), t, m, h)
		if s == 0 {
			r.results["tokens"], r.results["mm"], r.results["hashes"] = i32(t), i32(m), i32(h)
		}
		return s
	case "manager_add_mm_items":
		var items ptr
		if !r.isNull("items") {
			r.fatalf("only items=NULL is supported")
		}
		return rawManagerAddMMItems(r.handle("m", true), r.int("seq_id", 0), items, int32(r.int("num_items", 0)))
	case "vcache_create":
		cfg := r.cstruct("cfg", "kvp_vcache_config", map[string]int64{"backend": 1, "no_background": 1}, nil)
		out := r.out("out", 8)
		s := rawVcacheCreate(cfg, out)
		if s == 0 {
			rawVcacheDestroy(r.c)
			r.c = *(*ptr)(out)
		}
		return s
	case "vcache_destroy":
		rawVcacheDestroy(r.handle("c", false))
		if !r.has("c") {
			r.c = nil
		}
		return 0
	case "vcache_alloc_slot":
		slot := r.out("slot", 4)
		s := rawVcacheAllocSlot(r.handle("c", false), slot)
		if s == 0 {
			r.results["slot"] = i32(slot)
		}
		return s
	case "vcache_free_slot":
		return rawVcacheFreeSlot(r.handle("c", false), int32(r.int("slot", 0)))
	case "vcache_step":
		n := r.int("n", int64(len(r.list("slots"))))
		return rawVcacheStep(r.handle("c", false), r.array("slots", 4, 0), r.array("ctx_lens", 4, 0), int32(n))
	case "vcache_layer_ptrs":
		return rawVcacheLayerPtrs(r.handle("c", false), int32(r.int("layer", 0)), r.out("k_ptr", 8), r.out("v_ptr", 8))
	case "vcache_strides":
		return rawVcacheStrides(r.handle("c", false), r.out("strides", 32))
	case "vcache_trim":
		return rawVcacheTrim(r.handle("c", false))
	case "vcache_stats_get":
		out := r.cstruct("out", "kvp_vcache_stats", nil, nil)
		s := rawVcacheStats(r.handle("c", false), out)
		if s == 0 {
			r.readStruct("kvp_vcache_stats", out)
		}
		return s
	case "attn_workspace_size", "prefill_workspace_size":
		out := r.out("out", 8)
		var s int
		if r.st.call == "attn_workspace_size" {
			s = rawAttnWorkspaceSize(int32(r.int("max_batch", 0)), int32(r.int("num_q_heads", 0)), int32(r.int("head_dim", 0)),
				int32(r.int("max_splits", 0)), out)
		} else {
			s = rawPrefillWorkspaceSize(int32(r.int("max_batch", 0)), int32(r.int("max_tokens", 0)), int32(r.int("num_q_heads", 0)),
				int32(r.int("num_kv_heads", 0)), int32(r.int("head_dim", 0)), out)
		}
		if s == 0 {
			r.results["bytes"] = *(*int64)(out)
		}
		return s
	case "attn_num_splits":
		out := r.out("out", 4)
		s := rawAttnNumSplits(int32(r.int("dtype", 0)), int32(r.int("head_dim", 0)), int32(r.int("batch", 0)),
			int32(r.int("num_q_heads", 0)), int32(r.int("num_kv_heads", 0)), int32(r.int("max_seq_len", 0)), out)
		if s == 0 {
			r.results["splits"] = i32(out)
		}
		return s
	case "kv_write":
		return rawKVWrite(r.cstruct("args", "kvp_kv_write_args", nil, nil))
	case "paged_decode":
		return rawPagedDecode(r.cstruct("args", "kvp_paged_decode_args", nil, nil))
	case "merge_states":
		return rawMergeStates(r.cstruct("args", "kvp_merge_states_args", nil, nil))
	case "prefill_plan":
		plan := r.alloc(int(cLayouts["kvp_attn_plan"].size))
		*(*uintptr)(plan) = cLayouts["kvp_attn_plan"].size
		return rawPrefillPlan(r.cstruct("args", "kvp_prefill_plan_args", nil, nil), plan)
	case "paged_prefill":
		plan := r.alloc(int(cLayouts["kvp_attn_plan"].size))
		*(*uintptr)(plan) = cLayouts["kvp_attn_plan"].size
		return rawPagedPrefill(plan, r.cstruct("args", "kvp_paged_prefill_args", nil, nil))
	}
	if s, ok := r.callMore(); ok {
		return s
	}
	r.fatalf("unknown call %s", r.st.call)
	return -1
}

// callMore runs the shared-prefix attention and event publisher calls.
func (r *scRunner) callMore() (int, bool) {
	switch r.st.call {
	case "cascade_workspace_size":
		dev, host := r.out("device_bytes", 8), r.out("host_bytes", 8)
		s := rawCascadeWorkspaceSize(int32(r.int("max_batch", 0)), int32(r.int("num_q_heads", 0)), int32(r.int("num_kv_heads", 0)),
			int32(r.int("head_dim", 0)), dev, host)
		if s == 0 {
			r.results["device_bytes"], r.results["host_bytes"] = *(*int64)(dev), *(*int64)(host)
		}
		return s, true
	case "cascade_plan":
		plan := r.alloc(int(cLayouts["kvp_attn_plan"].size))
		*(*uintptr)(plan) = cLayouts["kvp_attn_plan"].size
		return rawCascadePlan(r.cstruct("args", "kvp_cascade_plan_args", nil, nil), plan), true
	case "cascade_update":
		var plan ptr
		if !r.isNull("plan") {
			plan = r.alloc(int(cLayouts["kvp_attn_plan"].size))
			*(*uintptr)(plan) = cLayouts["kvp_attn_plan"].size
		}
		batch := r.int("batch", 0)
		return rawCascadeUpdate(plan, r.array("seq_lens_host", 4, int(max(batch, 0))), int32(batch), r.out("fits", 4)), true
	case "paged_cascade":
		plan := r.alloc(int(cLayouts["kvp_attn_plan"].size))
		*(*uintptr)(plan) = cLayouts["kvp_attn_plan"].size
		return rawPagedCascade(plan, r.cstruct("args", "kvp_paged_prefill_args", nil, nil)), true
	case "event_publisher_create":
		cfg := r.cstruct("cfg", "kvp_event_publisher_config", nil, nil)
		out := r.out("out", 8)
		s := rawPublisherCreate(r.handle("m", true), cfg, out)
		if s == 0 {
			rawPublisherDestroy(r.pub)
			r.pub = *(*ptr)(out)
		}
		return s, true
	case "event_publisher_flush":
		return rawPublisherFlush(r.publisher()), true
	case "event_publisher_resync":
		return rawPublisherResync(r.publisher()), true
	case "event_publisher_stats_get":
		out := r.cstruct("out", "kvp_event_publisher_stats", nil, nil)
		s := rawPublisherStats(r.publisher(), out)
		if s == 0 {
			r.readStruct("kvp_event_publisher_stats", out)
		}
		return s, true
	case "event_publisher_destroy":
		rawPublisherDestroy(r.publisher())
		if !r.has("p") {
			r.pub = nil
		}
		return 0, true
	}
	return 0, false
}

// publisher resolves the p= argument: the current publisher, NULL, junk,
// stale (one created and destroyed) or other (the current manager).
func (r *scRunner) publisher() ptr {
	v, ok := r.st.args["p"]
	if !ok {
		return r.pub
	}
	switch v.raw {
	case "NULL":
		return nil
	case "junk":
		return r.junk.p
	case "other":
		return r.m
	case "stale":
		if r.stalePub == nil {
			h, st := hookManagerCreateCached(4, 4, true, 0)
			if st != 0 {
				r.fatalf("helper manager: %s", lastError())
			}
			l := cLayouts["kvp_event_publisher_config"]
			cfg := r.alloc(int(l.size))
			*(*uintptr)(cfg) = l.size
			ep := r.alloc(32)
			copy(unsafe.Slice((*byte)(ep), 18), "tcp://127.0.0.1:0")
			*(*ptr)(unsafe.Add(cfg, l.fields["endpoint"].off)) = ep
			out := r.alloc(8)
			if st := rawPublisherCreate(h, cfg, out); st != 0 {
				r.fatalf("helper publisher: %s", lastError())
			}
			r.stalePub = *(*ptr)(out)
			rawPublisherDestroy(r.stalePub)
			rawManagerDestroy(h)
		}
		return r.stalePub
	}
	r.fatalf("unknown publisher p=%s", v.raw)
	return nil
}

// keys builds one kvp_prefix_keys per prompt when the call gives salt_len
// or num_mm: salt_len bytes of salt, num_mm items with mm NULL.
func (r *scRunner) keys(n int) ptr {
	if !r.has("salt_len") && !r.has("num_mm") {
		return nil
	}
	l := cLayouts["kvp_prefix_keys"]
	p := r.alloc(int(l.size) * max(n, 1))
	saltLen := r.int("salt_len", 0)
	salt := r.alloc(int(max(saltLen, 1)))
	for i := range n {
		k := unsafe.Add(p, int(l.size)*i)
		*(*int32)(unsafe.Add(k, l.fields["salt_len"].off)) = int32(saltLen)
		*(*ptr)(unsafe.Add(k, l.fields["salt"].off)) = salt
		*(*int32)(unsafe.Add(k, l.fields["num_mm"].off)) = int32(r.int("num_mm", 0))
	}
	return p
}

func TestScenarios(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(scenarioDir, "*.txt"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no scenario files in %s (%v)", scenarioDir, err)
	}
	for _, file := range files {
		scs, err := parseScenarios(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, sc := range scs {
			t.Run(strings.TrimSuffix(filepath.Base(file), ".txt")+"/"+sc.name, func(t *testing.T) {
				lockThread(t)
				r := &scRunner{t: t, junk: newCBuf(64), failedAt: file}
				defer r.close()
				for i := range sc.stmts {
					r.run(&sc.stmts[i])
				}
			})
		}
	}
}

// The parser reads what the README promises.
func TestScenarioValues(t *testing.T) {
	v, err := parseScValue("[1,3..5,-2]/[]")
	if err != nil || len(v.lists) != 2 || !slices.Equal(v.lists[0], []int64{1, 3, 4, 5, -2}) || len(v.lists[1]) != 0 {
		t.Fatalf("parsed %+v, %v", v, err)
	}
	if v, _ := parseScValue("NULL"); !v.null {
		t.Fatal("NULL is not null")
	}
	for _, bad := range []string{"[1,2", "[5..3]", "[x]"} {
		if _, err := parseScValue(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	if cLayouts["kvp_manager_config"].fields["num_blocks"].off != 8 || cLayouts["kvp_kv_event"].size == 0 {
		t.Fatalf("layouts: %+v", cLayouts["kvp_manager_config"])
	}
}
