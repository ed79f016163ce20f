/* One scheduler step from C: grow 256 sequences of about 1000 tokens by one
 * token each, then describe their block table, lengths and slots (block
 * size 16). Prints the median and p99 over many steps, in microseconds.
 * Sequences are re-admitted every RESET steps (untimed), as in the Go
 * benchmark core/kvmanager BenchmarkStep, so lengths stay near 1000.
 *
 *   step_cost [steps]        (default 20000)
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c99 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvplug.h"

enum { NUM_SEQS = 256, PROMPT = 1000, BLOCK_SIZE = 16, RESET = 128 };
#define MAX_BLOCKS ((PROMPT + RESET + BLOCK_SIZE - 1) / BLOCK_SIZE)

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void die(const char *what, kvp_status st) {
  fprintf(stderr, "%s: %s: %s\n", what, kvp_status_string(st), kvp_last_error());
  exit(1);
}

static void admit(kvp_manager *m, const int64_t *ids) {
  for (int i = 0; i < NUM_SEQS; i++) {
    kvp_status st = kvp_manager_add(m, ids[i], PROMPT);
    if (st != KVP_OK) die("add", st);
  }
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 20000;
  if (steps < 100) steps = 100;
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = NUM_SEQS * (MAX_BLOCKS + 1);
  cfg.block_size = BLOCK_SIZE;
  kvp_manager *m = NULL;
  kvp_status st = kvp_manager_create(&cfg, &m);
  if (st != KVP_OK) die("create", st);

  static int64_t ids[NUM_SEQS];
  static int32_t ones[NUM_SEQS], table[NUM_SEQS * MAX_BLOCKS], lens[NUM_SEQS], slots[NUM_SEQS];
  for (int i = 0; i < NUM_SEQS; i++) {
    ids[i] = (int64_t)i * 7919 + 3; /* arbitrary ids, not an index */
    ones[i] = 1;
  }
  admit(m, ids);
  double *t = malloc(sizeof(double) * (size_t)steps);
  if (t == NULL) return 1;
  int warmup = steps / 10, k = 0;
  for (int i = 0; i < steps + warmup; i++) {
    if (i % RESET == RESET - 1) {
      if ((st = kvp_manager_remove(m, ids, NUM_SEQS)) != KVP_OK) die("remove", st);
      admit(m, ids);
    }
    int32_t num = 0;
    double t0 = now_us();
    if ((st = kvp_manager_grow(m, ids, ones, NUM_SEQS)) != KVP_OK) die("grow", st);
    st = kvp_manager_describe(m, ids, NUM_SEQS, table, MAX_BLOCKS, lens, slots, NUM_SEQS, &num);
    double t1 = now_us();
    if (st != KVP_OK) die("describe", st);
    if (num != NUM_SEQS) die("describe: slot count", KVP_ERR_INTERNAL);
    if (i >= warmup) t[k++] = t1 - t0;
  }
  qsort(t, (size_t)k, sizeof *t, cmp_double);
  printf("C step (grow + describe, %d seqs, ~%d tokens, block size %d, max_blocks %d): "
         "median %.2f us, p99 %.2f us over %d steps\n",
         NUM_SEQS, PROMPT, BLOCK_SIZE, MAX_BLOCKS, t[k / 2], t[(k * 99) / 100], k);
  free(t);
  kvp_manager_destroy(m);
  return 0;
}
