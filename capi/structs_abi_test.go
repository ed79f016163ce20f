package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// The struct-evolution rule of the header ("Struct versions"), checked at
// every versioned struct's entry point: the first released size works (and
// the fields past it are not read), sizes below it do not, a newer header's
// larger size works when its extra bytes are 0 and is refused otherwise, and
// an output struct is written only within the caller's size.
func TestStructVersions(t *testing.T) {
	lockThread(t) // kvp_last_error is per thread
	for _, name := range []string{"kvp_manager_config", "kvp_vcache_config"} {
		first, size := structSizes(name)
		try := func(callerSize uintptr, garbageFrom uintptr, tail byte) abiStatus {
			buf := newStructBuf(size + 64)
			defer buf.free()
			b := buf.bytes()
			for i := garbageFrom; i < size; i++ {
				b[i] = 0xA5 // fields the caller's version lacks: never read
			}
			if tail != 0 {
				b[size] = tail
			}
			return hookCreateWithConfig(name, buf, callerSize)
		}
		expect(t, name+" at its first size, later fields garbage", try(first, first, 0), kverr.OK)
		expect(t, name+" at this library's size", try(size, size, 0), kverr.OK)
		expect(t, name+" one byte short of its first size", try(first-1, size, 0), kverr.StructSize)
		expect(t, name+" from a newer header, new fields 0", try(size+32, size, 0), kverr.OK)
		st := try(size+32, size, 1)
		expect(t, name+" from a newer header, a new field set", st, kverr.StructSize)
		if msg := lastError(); !strings.Contains(msg, "newer kvplug.h") {
			t.Errorf("%s: message %q does not say why", name, msg)
		}
		expect(t, name+" struct_size garbage", try(1<<40, size, 0), kverr.StructSize)
	}

	for _, name := range []string{"kvp_manager_stats", "kvp_prefix_stats", "kvp_vcache_stats", "kvp_tier_stats"} {
		first, size := structSizes(name)
		for _, callerSize := range []uintptr{first, size, size + 24} {
			buf := newStructBuf(size + 64)
			b := buf.bytes()
			for i := range b {
				b[i] = 0xEE
			}
			st := hookStatsInto(name, buf, callerSize)
			expect(t, name+" output", st, kverr.OK)
			for i := uintptr(8); i < callerSize && i >= size; i++ {
				if b[i] != 0 {
					t.Errorf("%s at size %d: byte %d past the library's struct is %#x, want 0", name, callerSize, i, b[i])
					break
				}
			}
			for i := callerSize; i < uintptr(len(b)); i++ {
				if b[i] != 0xEE {
					t.Errorf("%s at size %d: byte %d past the caller's struct was written", name, callerSize, i)
					break
				}
			}
			if got := *(*uint64)(buf.p); uintptr(got) != callerSize {
				t.Errorf("%s: struct_size became %d, the caller set %d", name, got, callerSize)
			}
			buf.free()
		}
		buf := newStructBuf(size + 64)
		expect(t, name+" short of its first size", hookStatsInto(name, buf, first-1), kverr.StructSize)
		buf.free()
	}
}

// Every struct of the header that begins with struct_size is in the table
// the rule is applied from, so no entry point checks a size its own way.
func TestEveryVersionedStructIsInTheTable(t *testing.T) {
	src, err := os.ReadFile("../include/kvplug.h")
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`typedef struct (kvp_\w+) \{\s*size_t struct_size;`)
	header := map[string]bool{}
	for _, m := range re.FindAllSubmatch(src, -1) {
		header[string(m[1])] = true
	}
	table := map[string]bool{}
	for _, s := range abiStructs {
		table[s.name] = true
		if !header[s.name] {
			t.Errorf("%s is in the table but is not a versioned struct of the header", s.name)
		}
	}
	for name := range header {
		if !table[name] {
			t.Errorf("%s begins with struct_size but is not in capi's abiStructs", name)
		}
	}
}

// A pointer field of an input struct that holds a value in the first page
// (garbage such as 0x2f, never a valid address) is refused before the struct
// is copied into a Go variable of its C type: the Go runtime treats such a
// value in a pointer-typed variable as fatal when it moves a stack, even if
// the value is never read. NULL and real addresses pass the check.
func TestStructPointerFieldsInFirstPageAreRefused(t *testing.T) {
	checked := 0
	for _, s := range abiStructs {
		for _, f := range s.ptrs {
			checked++
			try := func(v uintptr) error {
				buf := make([]uintptr, (s.size+64)/unsafe.Sizeof(uintptr(0)))
				p := unsafe.Pointer(&buf[0])
				*(*uintptr)(p) = s.size // struct_size
				*(*uintptr)(unsafe.Add(p, f.off)) = v
				dst := make([]byte, s.size)
				return s.in(p, unsafe.Pointer(&dst[0]))
			}
			if err := try(0x2f); !kverr.Is(err, kverr.InvalidArgument) || !strings.Contains(err.Error(), f.name) {
				t.Errorf("%s.%s = 0x2f: %v, want INVALID_ARGUMENT naming the field", s.name, f.name, err)
			}
			if err := try(minPointer - 1); !kverr.Is(err, kverr.InvalidArgument) {
				t.Errorf("%s.%s = %#x: %v, want INVALID_ARGUMENT", s.name, f.name, minPointer-1, err)
			}
			for _, v := range []uintptr{0, minPointer, 0x7f0000001000} {
				if err := try(v); err != nil {
					t.Errorf("%s.%s = %#x: %v, want accepted", s.name, f.name, v, err)
				}
			}
		}
	}
	if checked < 10 {
		t.Fatalf("only %d pointer fields found in the ABI's input structs; the reflection over their C types is broken", checked)
	}
}
