// C side of the ABI glue: the per-thread error message, the static status
// names, and the trampoline that calls the host's log callback. Exported Go
// functions run on the calling C thread, so a C thread-local buffer gives
// each host thread its own kvp_last_error().
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvplug.h"
#include "glue.h"

#define KVP_ERR_CAP 2048

/* The message buffer is allocated per thread and found through a pthread
 * key: a _Thread_local array would sit in the library's static TLS block,
 * which dlopen must carve from glibc's small surplus (a Go c-shared library
 * is STATIC_TLS), and then fails in hosts like Python. */
static pthread_key_t err_key;
static pthread_once_t err_once = PTHREAD_ONCE_INIT;
static void err_key_init(void) { (void)pthread_key_create(&err_key, free); }

static char *err_buf(int create) {
  (void)pthread_once(&err_once, err_key_init);
  char *b = pthread_getspecific(err_key);
  if (b == NULL && create) {
    b = calloc(1, KVP_ERR_CAP);
    if (b != NULL && pthread_setspecific(err_key, b) != 0) {
      free(b);
      b = NULL;
    }
  }
  return b;
}

void kvp__set_error(const char *msg, size_t n) {
  char *b = err_buf(1);
  if (b == NULL) return;
  if (n >= KVP_ERR_CAP) n = KVP_ERR_CAP - 1;
  if (n > 0) memcpy(b, msg, n);
  b[n] = '\0';
}

const char *kvp_last_error(void) {
  const char *b = err_buf(0);
  return b != NULL ? b : "";
}

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
    case KVP_ERR_IN_USE: return "KVP_ERR_IN_USE";
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
