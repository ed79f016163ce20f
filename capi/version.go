package main

/*
#include "kvplug.h"
#include "glue.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/kvplug/kvplug/internal/logx"
)

var versionString = func() *C.char {
	return C.CString(fmt.Sprintf("%d.%d.%d", C.KVP_VERSION_MAJOR, C.KVP_VERSION_MINOR, C.KVP_VERSION_PATCH))
}()

//export kvpgo_version
func kvpgo_version() C.uint32_t { return C.KVP_VERSION_NUMBER }

//export kvpgo_version_string
func kvpgo_version_string() *C.char { return versionString }

//export kvpgo_set_logger
func kvpgo_set_logger(fn C.kvp_log_fn, user unsafe.Pointer, level C.int) (st C.kvp_status) {
	defer guard(&st)
	if err := logx.CheckLevel(int(level)); err != nil {
		return fail(err)
	}
	if fn == nil {
		logx.SetSink(nil, logx.Level(level))
		return C.KVP_OK
	}
	// user is the host's opaque pointer: passed back, never dereferenced.
	logx.SetSink(func(l logx.Level, msg string) {
		C.kvp__call_log(fn, user, C.int(l),
			(*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
	}, logx.Level(level))
	return C.KVP_OK
}

//export kvpgo_set_log_level
func kvpgo_set_log_level(level C.int) (st C.kvp_status) {
	defer guard(&st)
	if err := logx.CheckLevel(int(level)); err != nil {
		return fail(err)
	}
	logx.SetLevel(logx.Level(level))
	return C.KVP_OK
}
