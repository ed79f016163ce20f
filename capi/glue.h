// Internal declarations shared by the Go glue and errors.c; not installed.
#ifndef KVPLUG_GLUE_H
#define KVPLUG_GLUE_H
#include <stddef.h>
#include <stdint.h>

#include "kvplug.h"

__attribute__((visibility("hidden"))) void kvp__set_error(const char *msg, size_t n);
__attribute__((visibility("hidden"))) void kvp__call_log(void (*fn)(void *, int, const char *),
                                                         void *user, int level, const char *msg,
                                                         size_t n);

// Public functions implemented in C (errors.c). The package is compiled with
// KVPLUG_NO_PROTOTYPES, so the Go glue declares them here.
const char *kvp_last_error(void);
const char *kvp_status_string(kvp_status status);
#endif
