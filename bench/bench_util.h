/* What the C benchmarks share: a monotonic clock in microseconds, the
 * comparison qsort needs for medians, and exiting with the library's error.
 * Define BENCH_NAME (the program's name, for messages) and _POSIX_C_SOURCE
 * >= 199309L (clock_gettime) before including it, after kvplug.h.
 */
#ifndef KVPLUG_BENCH_UTIL_H
#define KVPLUG_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static inline void die(const char *what, kvp_status st) {
  fprintf(stderr, "%s: %s: %s: %s\n", BENCH_NAME, what, kvp_status_string(st), kvp_last_error());
  exit(1);
}

#endif
