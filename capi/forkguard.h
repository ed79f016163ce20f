// The fork guard of the library's entry points (internal/forkguard).
#ifndef KVPLUG_FORKGUARD_H
#define KVPLUG_FORKGUARD_H
#include "kvplug.h"

#define KVP__STR2(x) #x
#define KVP__STR(x) KVP__STR2(x)
#define KVP__VERSION_STRING \
  KVP__STR(KVP_VERSION_MAJOR) "." KVP__STR(KVP_VERSION_MINOR) "." KVP__STR(KVP_VERSION_PATCH)

// Set in a child forked after the library was loaded (forkguard_rt.c).
__attribute__((visibility("hidden"))) extern volatile int kvp__forked;

// The status of entry point fn called in such a child: KVP_ERR_UNSUPPORTED,
// with kvp_last_error() saying why and what to do instead.
__attribute__((visibility("hidden"))) kvp_status kvp__forked_status(const char *fn);
#endif
