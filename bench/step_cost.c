/* Scheduler calls timed from C, through the library's C ABI. Prints the
 * median and p99 in microseconds.
 *
 *   step_cost [steps]             grow 256 sequences of about 1000 tokens by
 *                                 one token each (kvp_manager_grow), then
 *                                 describe their block table, lengths and
 *                                 slots (block size 16, no prefix cache).
 *                                 Sequences are re-added every RESET steps
 *                                 (untimed), as in the Go benchmark
 *                                 core/kvmanager BenchmarkStep. Default 20000.
 *   step_cost decode [steps]      the decode step with the prefix cache: 256
 *                                 sequences of 1000-4000 tokens admitted by
 *                                 their tokens, each step
 *                                 kvp_manager_grow_tokens with one token each
 *                                 and kvp_manager_describe (block size 16).
 *                                 Default 1000 steps.
 *   step_cost admit BS [n]        kvp_manager_admit of one 4096-token prompt
 *                                 whose first 2048 tokens are cached and
 *                                 pinned (block size BS); its token 2048
 *                                 differs every call, so its second half is
 *                                 new. Free blocks are available: admitted
 *                                 sequences are removed in rounds of 128 and
 *                                 the cache cleared and the system prompt
 *                                 cached and pinned again, untimed (as
 *                                 bench/prefix_admit.py does). Default 5000.
 *
 * Built with -DSTEP_COST_CALLGRIND (valgrind's headers needed), the timed
 * calls alone are collected when run under
 * `valgrind --tool=callgrind --collect-atstart=no`: the instruction count
 * per call is the total divided by the calls.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c99 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvplug.h"

#define BENCH_NAME "step_cost"
#include "bench_util.h"

#ifdef STEP_COST_CALLGRIND
#include <valgrind/callgrind.h>
#define TIMED_BEGIN() CALLGRIND_TOGGLE_COLLECT
#define TIMED_END() CALLGRIND_TOGGLE_COLLECT
#else
#define TIMED_BEGIN() ((void)0)
#define TIMED_END() ((void)0)
#endif

enum { NUM_SEQS = 256, PROMPT = 1000, BLOCK_SIZE = 16, RESET = 128 };
#define MAX_BLOCKS ((PROMPT + RESET + BLOCK_SIZE - 1) / BLOCK_SIZE)

static void *xmalloc(size_t n) {
  void *p = malloc(n);
  if (p == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

/* A fixed pseudo-random stream (64-bit LCG), so runs are repeatable. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rng(void) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng_state >> 33);
}

static void report(const char *what, double *t, int k, const char *unit) {
  qsort(t, (size_t)k, sizeof *t, cmp_double);
  printf("%s: median %.2f us, p99 %.2f us over %d %s\n", what, t[k / 2], t[(k * 99) / 100], k, unit);
}

static void add_all(kvp_manager *m, const int64_t *ids) {
  for (int i = 0; i < NUM_SEQS; i++) {
    kvp_status st = kvp_manager_add(m, ids[i], PROMPT);
    if (st != KVP_OK) die("add", st);
  }
}

static int step_mode(int steps) {
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
  add_all(m, ids);
  double *t = xmalloc(sizeof(double) * (size_t)steps);
  int warmup = steps / 10, k = 0;
  for (int i = 0; i < steps + warmup; i++) {
    if (i % RESET == RESET - 1) {
      if ((st = kvp_manager_remove(m, ids, NUM_SEQS)) != KVP_OK) die("remove", st);
      add_all(m, ids);
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
  char what[160];
  snprintf(what, sizeof what, "C step (grow + describe, %d seqs, ~%d tokens, block size %d, max_blocks %d)",
           NUM_SEQS, PROMPT, BLOCK_SIZE, MAX_BLOCKS);
  report(what, t, k, "steps");
  free(t);
  kvp_manager_destroy(m);
  return 0;
}

static int decode_mode(int steps) {
  enum { MIN_LEN = 1000, MAX_LEN = 4000, DBS = 16 };
  if (steps < 10) steps = 10;
  int32_t plen[NUM_SEQS];
  int64_t total = 0;
  for (int i = 0; i < NUM_SEQS; i++) {
    plen[i] = MIN_LEN + (int32_t)(rng() % (MAX_LEN - MIN_LEN));
    total += plen[i];
  }
  int max_blocks = (MAX_LEN + steps + DBS - 1) / DBS + 1;
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = (int32_t)((total + (int64_t)NUM_SEQS * (steps + DBS)) / DBS + NUM_SEQS);
  cfg.block_size = DBS;
  cfg.enable_prefix_cache = 1;
  kvp_manager *m = NULL;
  kvp_status st = kvp_manager_create(&cfg, &m);
  if (st != KVP_OK) die("create", st);
  int32_t *prompt = xmalloc(sizeof(int32_t) * MAX_LEN);
  static int64_t ids[NUM_SEQS];
  for (int i = 0; i < NUM_SEQS; i++) {
    ids[i] = i;
    for (int j = 0; j < plen[i]; j++) prompt[j] = (int32_t)(rng() % 100000);
    int64_t offs[2] = {0, plen[i]};
    int32_t admitted = 0;
    st = kvp_manager_admit(m, &ids[i], 1, prompt, offs, NULL, NULL, &admitted);
    if (st != KVP_OK || admitted != 1) die("admit", st);
  }
  static int32_t ones[NUM_SEQS], toks[NUM_SEQS], lens[NUM_SEQS], slots[NUM_SEQS];
  int32_t *table = xmalloc(sizeof(int32_t) * (size_t)NUM_SEQS * (size_t)max_blocks);
  for (int i = 0; i < NUM_SEQS; i++) ones[i] = 1;
  double *t = xmalloc(sizeof(double) * (size_t)steps);
  for (int s = 0; s < steps; s++) {
    for (int i = 0; i < NUM_SEQS; i++) toks[i] = s;
    int32_t num = 0;
    TIMED_BEGIN();
    double t0 = now_us();
    st = kvp_manager_grow_tokens(m, ids, ones, NUM_SEQS, toks);
    if (st == KVP_OK)
      st = kvp_manager_describe(m, ids, NUM_SEQS, table, max_blocks, lens, slots, NUM_SEQS, &num);
    double t1 = now_us();
    TIMED_END();
    if (st != KVP_OK) die("grow_tokens + describe", st);
    if (num != NUM_SEQS) die("describe: slot count", KVP_ERR_INTERNAL);
    t[s] = t1 - t0;
  }
  report("C decode step (grow_tokens + describe, 256 seqs of 1000-4000 tokens, block size 16, prefix cache on)", t, steps, "steps");
  free(t);
  free(table);
  free(prompt);
  kvp_manager_destroy(m);
  return 0;
}

static int admit_mode(int bs, int n) {
  enum { PLEN = 4096, CACHED = 2048, ROUND = 128 };
  if (bs < 1 || PLEN % bs != 0) {
    fprintf(stderr, "admit: block size must divide %d\n", PLEN);
    return 2;
  }
  if (n < 10) n = 10;
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = (ROUND + 4) * (PLEN / bs);
  cfg.block_size = bs;
  cfg.enable_prefix_cache = 1;
  kvp_manager *m = NULL;
  kvp_status st = kvp_manager_create(&cfg, &m);
  if (st != KVP_OK) die("create", st);
  int32_t *prompt = xmalloc(sizeof(int32_t) * PLEN);
  for (int j = 0; j < PLEN; j++) prompt[j] = (int32_t)(rng() % 100000);
  int64_t live[ROUND];
  int nlive = 0;
  int64_t sys_offs[2] = {0, CACHED + 1}, offs[2] = {0, PLEN};
  int64_t sys_id = -1;
  int32_t admitted = 0, matched = 0;
  /* Cache and pin the system prompt (again, after each round's clear). */
#define FRESH()                                                                     \
  do {                                                                              \
    uint64_t pin = 0;                                                               \
    if ((st = kvp_manager_clear_prefix_cache(m, NULL)) != KVP_OK) die("clear", st); \
    st = kvp_manager_admit(m, &sys_id, 1, prompt, sys_offs, NULL, NULL, &admitted); \
    if (st != KVP_OK || admitted != 1) die("admit system prompt", st);              \
    if ((st = kvp_manager_mark_computed(m)) != KVP_OK) die("mark computed", st);    \
    if ((st = kvp_manager_remove(m, &sys_id, 1)) != KVP_OK) die("remove", st);      \
    st = kvp_manager_pin(m, prompt, CACHED, NULL, &pin, NULL);                      \
    if (st != KVP_OK) die("pin", st);                                               \
  } while (0)
  FRESH();
  double *t = xmalloc(sizeof(double) * (size_t)n);
  for (int i = 0; i < n; i++) {
    int64_t id = i;
    prompt[CACHED] = i; /* a new second half every call */
    TIMED_BEGIN();
    double t0 = now_us();
    st = kvp_manager_admit(m, &id, 1, prompt, offs, NULL, &matched, &admitted);
    double t1 = now_us();
    TIMED_END();
    if (st != KVP_OK || admitted != 1) die("admit", st);
    if (matched != CACHED) die("admit: matched tokens", KVP_ERR_INTERNAL);
    t[i] = t1 - t0;
    live[nlive++] = id;
    if (nlive == ROUND) {
      if ((st = kvp_manager_mark_computed(m)) != KVP_OK) die("mark computed", st);
      if ((st = kvp_manager_remove(m, live, nlive)) != KVP_OK) die("remove", st);
      nlive = 0;
      FRESH();
    }
  }
#undef FRESH
  char what[160];
  snprintf(what, sizeof what, "C admit (4096-token prompt, 2048 cached, block size %d)", bs);
  report(what, t, n, "calls");
  free(t);
  free(prompt);
  kvp_manager_destroy(m);
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "admit") == 0) {
    if (argc < 3) {
      fprintf(stderr, "usage: step_cost admit BLOCK_SIZE [n]\n");
      return 2;
    }
    return admit_mode(atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 5000);
  }
  if (argc > 1 && strcmp(argv[1], "decode") == 0) return decode_mode(argc > 2 ? atoi(argv[2]) : 1000);
  return step_mode(argc > 1 ? atoi(argv[1]) : 20000);
}
