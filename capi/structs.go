package main

/*
#include "kvplug.h"
*/
import "C"

import (
	"reflect"
	"strings"
	"unsafe"

	"github.com/kvplug/kvplug/core/kverr"
)

// The struct-evolution rule of the ABI (include/kvplug.h, "Struct versions"),
// applied to every struct that begins with struct_size, in one place:
//
//   - a struct is accepted at any struct_size from its first released size
//     (first) up to this library's size (size); an input struct's fields past
//     the caller's size take their defaults, which are always 0;
//   - a larger struct_size comes from a newer header: accepted when every
//     byte past this library's size is 0 (the caller left the fields this
//     library does not know unset), refused otherwise, since a set field
//     would be silently ignored (the rule of Linux's extensible syscalls);
//   - an output struct gets the fields the caller has room for; bytes past
//     this library's size are zeroed.
type abiStruct struct {
	name  string
	first uintptr // the size of the struct's first released version
	size  uintptr // the size of this library's version
	ptrs  []ptrField
	// whole is the appended device-address fields (uint64): like a pointer,
	// a struct_size that ends inside one is no version's size.
	whole []ptrField
}

// ptrField is a pointer field of a struct: its offset and name.
type ptrField struct {
	off  uintptr
	name string
}

// minPointer is the lowest address a pointer may hold: nothing is ever mapped
// in the first page. A Go variable of pointer type that holds a value in
// (0, minPointer) is fatal to the Go runtime when it copies a stack ("invalid
// pointer found on stack"), even if the value is never dereferenced, so
// input structs are checked for such values before they are copied into Go
// variables of their C types.
const minPointer = 4096

// maxStructSize bounds struct_size: a larger value is garbage (an
// uninitialised struct), not a newer header.
const maxStructSize = 1 << 16

var (
	managerConfigStruct        = structOf[C.kvp_manager_config]("kvp_manager_config", unsafe.Offsetof(C.kvp_manager_config{}.block_size)+4)
	managerStatsStruct         = structOf[C.kvp_manager_stats]("kvp_manager_stats", unsafe.Offsetof(C.kvp_manager_stats{}.num_blocks)+4)
	prefixStatsStruct          = structOf[C.kvp_prefix_stats]("kvp_prefix_stats", unsafe.Offsetof(C.kvp_prefix_stats{}.queries)+8)
	vcacheConfigStruct         = structOf[C.kvp_vcache_config]("kvp_vcache_config", 0)
	vcacheStatsStruct          = structOf[C.kvp_vcache_stats]("kvp_vcache_stats", unsafe.Offsetof(C.kvp_vcache_stats{}.page_size)+8)
	kvWriteArgsStruct          = structOf[C.kvp_kv_write_args]("kvp_kv_write_args", unsafe.Offsetof(C.kvp_kv_write_args{}.slot_mapping)+8)
	pagedDecodeArgsStruct      = structOf[C.kvp_paged_decode_args]("kvp_paged_decode_args", unsafe.Offsetof(C.kvp_paged_decode_args{}.q_len)+4)
	mergeStatesArgsStruct      = structOf[C.kvp_merge_states_args]("kvp_merge_states_args", 0)
	prefillPlanArgsStruct      = structOf[C.kvp_prefill_plan_args]("kvp_prefill_plan_args", 0)
	attnPlanStruct             = structOf[C.kvp_attn_plan]("kvp_attn_plan", 0)
	pagedPrefillArgsStruct     = structOf[C.kvp_paged_prefill_args]("kvp_paged_prefill_args", unsafe.Offsetof(C.kvp_paged_prefill_args{}.reserved2)+4)
	pagedKVStruct              = structOf[C.kvp_paged_kv]("kvp_paged_kv", unsafe.Offsetof(C.kvp_paged_kv{}.scale_kind))
	cascadePlanArgsStruct      = structOf[C.kvp_cascade_plan_args]("kvp_cascade_plan_args", unsafe.Offsetof(C.kvp_cascade_plan_args{}.qo_indptr_host))
	eventPublisherConfigStruct = structOf[C.kvp_event_publisher_config]("kvp_event_publisher_config", 0)
	eventPublisherStatsStruct  = structOf[C.kvp_event_publisher_stats]("kvp_event_publisher_stats", unsafe.Offsetof(C.kvp_event_publisher_stats{}.batches)+8)
	tierStatsStruct            = structOf[C.kvp_tier_stats]("kvp_tier_stats", unsafe.Offsetof(C.kvp_tier_stats{}.reserved)+4)
	kvLayersStruct             = structOf[C.kvp_kv_layers]("kvp_kv_layers", unsafe.Offsetof(C.kvp_kv_layers{}.v_block_stride)+8)
)

// structOf is the abiStruct of C struct T (name), first released at size
// first; 0: T's size, a struct that has not grown since.
func structOf[T any](name string, first uintptr) abiStruct {
	size := unsafe.Sizeof(*new(T))
	if first == 0 {
		first = size
	}
	var ptrs, whole []ptrField
	t := reflect.TypeFor[T]()
	for i := range t.NumField() {
		f := t.Field(i)
		if k := f.Type.Kind(); k == reflect.Pointer || k == reflect.UnsafePointer {
			ptrs = append(ptrs, ptrField{f.Offset, f.Name})
		} else if wholeFields[name+"."+f.Name] {
			whole = append(whole, ptrField{f.Offset, f.Name})
		}
	}
	return abiStruct{name, first, size, ptrs, whole}
}

// wholeFields names, as struct.field, the 8-byte fields appended to a
// released struct that no struct_size may cut: the device addresses
// kvp_paged_decode_args.sinks and kvp_paged_prefill_args.sinks, and
// kvp_paged_decode_args.window_size with its reserved word (0.6). A size
// ending inside one is no version's size.
var wholeFields = map[string]bool{"kvp_paged_decode_args.sinks": true, "kvp_paged_prefill_args.sinks": true,
	"kvp_paged_decode_args.window_size": true}

// abiStructs is every versioned struct of the ABI.
var abiStructs = []abiStruct{managerConfigStruct, managerStatsStruct, prefixStatsStruct, vcacheConfigStruct,
	vcacheStatsStruct, kvWriteArgsStruct, pagedDecodeArgsStruct, mergeStatesArgsStruct, prefillPlanArgsStruct,
	attnPlanStruct, pagedPrefillArgsStruct, cascadePlanArgsStruct, eventPublisherConfigStruct, eventPublisherStatsStruct,
	tierStatsStruct, kvLayersStruct, pagedKVStruct}

func (s abiStruct) checkSize(got C.size_t) error {
	n := uintptr(got)
	if n < s.first || n > maxStructSize {
		return kverr.Errorf(kverr.StructSize,
			"%s.struct_size is %d; this library accepts %d (the struct's first version) up to %d, "+
				"or a newer header's larger size (initialise the struct with %s)", s.name, uint64(got), s.first, s.size, s.initMacro())
	}
	return nil
}

func (s abiStruct) initMacro() string { return strings.ToUpper(s.name) + "_INIT" }

// in reads the caller's input struct p (whose first field is struct_size)
// into dst, a zeroed value of this library's version.
func (s abiStruct) in(p unsafe.Pointer, dst unsafe.Pointer) error {
	got := *(*C.size_t)(p)
	if err := s.checkSize(got); err != nil {
		return err
	}
	n := uintptr(got)
	for _, f := range s.ptrs {
		if f.off+unsafe.Sizeof(uintptr(0)) > n {
			if f.off < n {
				// A size that ends inside a pointer would leave half an
				// address: no header ever had such a size.
				return kverr.Errorf(kverr.StructSize, "%s.struct_size is %d, which ends inside %s: not the size of any version of the struct (initialise it with %s)", s.name, n, f.name, s.initMacro())
			}
			continue // past the caller's version: zero
		}
		if v := *(*uintptr)(unsafe.Add(p, f.off)); v != 0 && v < minPointer {
			return kverr.Errorf(kverr.InvalidArgument, "%s.%s is %#x: not NULL and not a valid address", s.name, f.name, v)
		}
	}
	for _, f := range s.whole {
		if f.off < n && n < f.off+8 {
			return kverr.Errorf(kverr.StructSize, "%s.struct_size is %d, which ends inside %s: not the size of any version of the struct (initialise it with %s)", s.name, n, f.name, s.initMacro())
		}
	}
	if n > s.size {
		for i, b := range unsafe.Slice((*byte)(unsafe.Add(p, s.size)), n-s.size) {
			if b != 0 {
				return kverr.Errorf(kverr.StructSize,
					"%s: byte %d of the caller's %d-byte struct is set, a field of a newer kvplug.h that this library "+
						"(%d bytes, version %d.%d.%d) does not know; use a newer library or leave the field 0",
					s.name, s.size+uintptr(i), n, s.size, C.KVP_VERSION_MAJOR, C.KVP_VERSION_MINOR, C.KVP_VERSION_PATCH)
			}
		}
	}
	copyStruct(dst, p, n, s.size)
	return nil
}

// out writes src, a value of this library's version, into the caller's
// output struct p up to the caller's struct_size, leaving struct_size as the
// caller set it.
func (s abiStruct) out(p unsafe.Pointer, src unsafe.Pointer) error {
	got := *(*C.size_t)(p)
	if err := s.checkSize(got); err != nil {
		return err
	}
	n := uintptr(got)
	copyStruct(p, src, n, s.size)
	if n > s.size {
		clear(unsafe.Slice((*byte)(unsafe.Add(p, s.size)), n-s.size))
	}
	*(*C.size_t)(p) = got
	return nil
}
