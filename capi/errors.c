// C side of the ABI glue: the per-thread error message, the static status
// names, and the trampoline that calls the host's log callback. Exported Go
// functions run on the calling C thread, so a C thread-local buffer gives
// each host thread its own kvp_last_error().
#include <string.h>

#include "kvplug.h"
#include "glue.h"

#define KVP_ERR_CAP 2048

static _Thread_local char last_error[KVP_ERR_CAP];

void kvp__set_error(const char *msg, size_t n) {
  if (n >= KVP_ERR_CAP) n = KVP_ERR_CAP - 1;
  if (n > 0) memcpy(last_error, msg, n);
  last_error[n] = '\0';
}

const char *kvp_last_error(void) { return last_error; }

const char *kvp_status_string(kvp_status status) {
  switch (status) {
    case KVP_OK: return "KVP_OK";
    case KVP_ERR_INVALID_ARGUMENT: return "KVP_ERR_INVALID_ARGUMENT";
    case KVP_ERR_NULL_POINTER: return "KVP_ERR_NULL_POINTER";
    case KVP_ERR_STRUCT_SIZE: return "KVP_ERR_STRUCT_SIZE";
    case KVP_ERR_INVALID_HANDLE: return "KVP_ERR_INVALID_HANDLE";
    case KVP_ERR_UNKNOWN_SEQUENCE: return "KVP_ERR_UNKNOWN_SEQUENCE";
    case KVP_ERR_DUPLICATE_SEQUENCE: return "KVP_ERR_DUPLICATE_SEQUENCE";
    case KVP_ERR_OUT_OF_BLOCKS: return "KVP_ERR_OUT_OF_BLOCKS";
    case KVP_ERR_BUFFER_TOO_SMALL: return "KVP_ERR_BUFFER_TOO_SMALL";
    case KVP_ERR_NO_DEVICE: return "KVP_ERR_NO_DEVICE";
    case KVP_ERR_CUDA: return "KVP_ERR_CUDA";
    case KVP_ERR_UNSUPPORTED: return "KVP_ERR_UNSUPPORTED";
    case KVP_ERR_OUT_OF_MEMORY: return "KVP_ERR_OUT_OF_MEMORY";
    case KVP_ERR_NOT_FOUND: return "KVP_ERR_NOT_FOUND";
    case KVP_ERR_INTERNAL: return "KVP_ERR_INTERNAL";
  }
  return "KVP_ERR_UNKNOWN_STATUS";
}

void kvp__call_log(kvp_log_fn fn, void *user, int level, const char *msg, size_t n) {
  char buf[4096];
  if (n >= sizeof buf) n = sizeof buf - 1;
  memcpy(buf, msg, n);
  buf[n] = '\0';
  fn(user, level, buf);
}
