// The fork guard's state: an at-fork handler marks a child forked after
// the library was loaded, whose entry points then refuse to enter the Go
// runtime (internal/forkguard says why).
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "forkguard.h"
#include "glue.h"

volatile int kvp__forked = 0;
static pid_t kvp__loaded_pid;

static void kvp__in_child(void) { kvp__forked = 1; }

__attribute__((constructor)) static void kvp__forkguard_init(void) {
  kvp__loaded_pid = getpid();
  pthread_atfork(NULL, NULL, kvp__in_child);
}

kvp_status kvp__forked_status(const char *fn) {
  char msg[512];
  int n = snprintf(msg, sizeof msg,
                   "%s: this process (pid %ld) was forked from pid %ld after libkvplug was loaded there, and the "
                   "library's Go runtime does not survive fork(): no kvplug call works in this child. Load the "
                   "library in the child after the fork, or start workers with spawn instead of fork",
                   fn, (long)getpid(), (long)kvp__loaded_pid);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof msg) n = (int)sizeof msg - 1;
  kvp__set_error(msg, (size_t)n);
  return KVP_ERR_UNSUPPORTED;
}
