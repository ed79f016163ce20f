/* Shared-prefix planning from C: kvp_cascade_plan over the host block table
 * of a 256-sequence batch of 4096-token sequences (block size 16, 256 blocks
 * each; 32 q / 8 kv heads, head_dim 128, f16), in the five sharing cases of
 * bench/RESULTS.md's "Planning from the host block tables (CPU)" table, and
 * kvp_manager_cascade_plan over the same batch held by a kvp_manager (the
 * tables gathered from the manager), with and without the device copy.
 * Times each call alone (the plan's asynchronous copy is waited for after
 * the timer stops, as an engine plans once per step) and prints the median
 * and p90 in microseconds over many runs, after checking that both entry
 * points write the same plan.
 *
 * The plan is copied into a device workspace, so the benchmark needs a GPU;
 * without one it prints "skipped: no GPU" and exits 0. Build and run:
 *
 *   gcc -O2 -std=c11 -Wall -Wextra -Iinclude bench/cascade_plan_bench.c \
 *       -o cascade_plan_bench -L<dir of libkvplug.so> -lkvplug -Wl,-rpath,<that dir> -ldl
 *   ./cascade_plan_bench [runs]     (default 2000 per case and call)
 *
 * On a virtual machine the medians differ between processes by up to 2x
 * (where the table and workspaces land in memory): run it several times
 * and report the range of medians.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvplug.h"

#define BENCH_NAME "cascade_plan_bench"
#include "bench_util.h"

/* A cascade plan's plan-state words (kvp_attn_plan.state). */
#define GENERATION(p) ((p).state[KVP_PLAN_STATE_GENERATION])
#define SAVED(p) ((p).state[KVP_PLAN_STATE_SAVED_TOKENS])
#define TOTAL(p) ((p).state[KVP_PLAN_STATE_TOTAL_TOKENS])

enum { B = 256, COLS = 256, BS = 16, QH = 32, KVH = 8, HD = 128, LEN = COLS * BS };

/* The few CUDA driver calls the benchmark needs for its device memory,
 * loaded at run time so that the program builds without the CUDA toolkit. */
typedef unsigned long long cu_ptr;
static struct {
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*primary_ctx_retain)(void **, int);
  int (*ctx_set_current)(void *);
  int (*mem_alloc)(cu_ptr *, size_t);
  int (*mem_alloc_host)(void **, size_t);
  int (*memset_d8)(cu_ptr, unsigned char, size_t);
  int (*memcpy_htod)(cu_ptr, const void *, size_t);
  int (*ctx_synchronize)(void);
} cu;

static void cu_check(const char *what, int r) {
  if (r != 0) {
    fprintf(stderr, "cascade_plan_bench: %s: CUDA error %d\n", what, r);
    exit(1);
  }
}

static void load_cuda(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    fprintf(stderr, "cascade_plan_bench: dlopen libcuda.so.1: %s\n", dlerror());
    exit(1);
  }
  struct {
    void **fn;
    const char *name;
  } syms[] = {
      {(void **)&cu.init, "cuInit"},
      {(void **)&cu.device_get, "cuDeviceGet"},
      {(void **)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
      {(void **)&cu.ctx_set_current, "cuCtxSetCurrent"},
      {(void **)&cu.mem_alloc, "cuMemAlloc_v2"},
      {(void **)&cu.mem_alloc_host, "cuMemAllocHost_v2"},
      {(void **)&cu.memset_d8, "cuMemsetD8_v2"},
      {(void **)&cu.memcpy_htod, "cuMemcpyHtoD_v2"},
      {(void **)&cu.ctx_synchronize, "cuCtxSynchronize"},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(h, syms[i].name);
    if (*syms[i].fn == NULL) {
      fprintf(stderr, "cascade_plan_bench: libcuda.so.1 has no %s\n", syms[i].name);
      exit(1);
    }
  }
  int dev = 0;
  void *ctx = NULL;
  cu_check("cuInit", cu.init(0));
  cu_check("cuDeviceGet", cu.device_get(&dev, 0));
  cu_check("cuDevicePrimaryCtxRetain", cu.primary_ctx_retain(&ctx, dev));
  cu_check("cuCtxSetCurrent", cu.ctx_set_current(ctx));
}

/* A sharing case: every sequence shares its first `shared` tokens, then
 * sequences of each group of `group` share `group_shared` more (0: none),
 * then own the rest; `identical` makes every row the same. */
struct sharing {
  const char *name;
  int shared, group_shared, group;
};

static const struct sharing cases[] = {
    {"no sharing (decode route)", 0, 0, 0},
    {"all share 2048 tokens", 2048, 0, 0},
    {"all share 2048, 16 groups of 16 share 1024 more", 2048, 1024, 16},
    {"forks: all share 4080 tokens, one own block each", 4080, 0, 0},
    {"all identical (4096 shared)", 4096, 0, 0},
};

static void fork_into(kvp_manager *m, int64_t parent, const int64_t *kids, int n) {
  static kvp_block_copy copies[B];
  int32_t num = 0;
  kvp_status st = kvp_manager_fork(m, parent, kids, n, copies, B, &num);
  if (st != KVP_OK) die("fork", st);
  if (num != 0) {
    fprintf(stderr, "cascade_plan_bench: a fork copied a partial block; the cases share whole blocks only\n");
    exit(1);
  }
}

static void grow_all(kvp_manager *m, const int64_t *ids, int n, int32_t tokens) {
  static int32_t counts[B];
  for (int i = 0; i < n; i++) counts[i] = tokens;
  kvp_status st = kvp_manager_grow(m, ids, counts, n);
  if (st != KVP_OK) die("grow", st);
}

/* Builds the case's batch in a fresh manager: ids[0..B) hold LEN tokens
 * each, sharing whole blocks through forks as the case says. */
static kvp_manager *build(const struct sharing *c, int64_t *ids) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = B * COLS + 64;
  cfg.block_size = BS;
  kvp_manager *m = NULL;
  kvp_status st = kvp_manager_create(&cfg, &m);
  if (st != KVP_OK) die("create", st);
  for (int i = 0; i < B; i++) ids[i] = 1000 + 7 * (int64_t)i;
  if (c->shared == 0) {
    for (int i = 0; i < B; i++) {
      if ((st = kvp_manager_add(m, ids[i], LEN)) != KVP_OK) die("add", st);
    }
    return m;
  }
  if ((st = kvp_manager_add(m, ids[0], c->shared)) != KVP_OK) die("add", st);
  if (c->group == 0) {
    fork_into(m, ids[0], ids + 1, B - 1);
  } else {
    /* One parent per group, each growing the group's own blocks, then the
     * group's members forked from it. */
    static int64_t parents[B];
    int groups = B / c->group;
    for (int g = 0; g < groups; g++) parents[g] = ids[g * c->group];
    fork_into(m, ids[0], parents + 1, groups - 1);
    grow_all(m, parents, groups, c->group_shared);
    for (int g = 0; g < groups; g++) fork_into(m, parents[g], ids + g * c->group + 1, c->group - 1);
  }
  int32_t done = c->shared + c->group_shared;
  if (done < LEN) grow_all(m, ids, B, LEN - done);
  return m;
}

struct timing {
  double median, p90;
};

static struct timing summarize(double *t, int runs) {
  qsort(t, (size_t)runs, sizeof t[0], cmp_double);
  struct timing r = {t[runs / 2], t[runs * 9 / 10]};
  return r;
}

int main(int argc, char **argv) {
  int runs = argc > 1 ? atoi(argv[1]) : 2000;
  if (runs < 10) runs = 10;
  int32_t have = 0;
  kvp_status st = kvp_cuda_available(&have);
  if (st != KVP_OK) die("kvp_cuda_available", st);
  if (!have) {
    printf("cascade_plan_bench: skipped: no GPU (kvp_cuda_available found no CUDA driver or device; "
           "kvp_cascade_plan copies the plan into device memory)\n");
    return 0;
  }
  load_cuda();
  if ((st = kvp_attn_prepare()) != KVP_OK) die("kvp_attn_prepare", st);

  uint64_t dev_bytes = 0, host_bytes = 0;
  if ((st = kvp_cascade_workspace_size(B, QH, KVH, HD, &dev_bytes, &host_bytes)) != KVP_OK) die("workspace_size", st);
  cu_ptr ws[2], lens_dev;
  void *host[2];
  for (int i = 0; i < 2; i++) {
    cu_check("cuMemAlloc", cu.mem_alloc(&ws[i], dev_bytes));
    cu_check("cuMemAllocHost", cu.mem_alloc_host(&host[i], host_bytes));
  }
  cu_check("cuMemAlloc", cu.mem_alloc(&lens_dev, B * sizeof(int32_t)));
  static int64_t ids[B];
  static int32_t table[B * COLS], lens[B];
  double *t = malloc(sizeof(double) * (size_t)runs);
  if (t == NULL) return 1;

  printf("kvplug %s: planning a batch of %d sequences of %d tokens (block size %d, %d q / %d kv heads, head_dim %d, f16)\n",
         kvp_version_string(), B, LEN, BS, QH, KVH, HD);
  printf("median (p90) of %d calls, microseconds; the plan's copy is waited for outside the timer\n\n", runs);
  printf("| batch | kvp_cascade_plan | kvp_manager_cascade_plan | manager, host only | items | shared / total tokens |\n");
  printf("| --- | --- | --- | --- | --- | --- |\n");
  int mismatches = 0;
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const struct sharing *c = &cases[ci];
    kvp_manager *m = build(c, ids);
    int32_t num_slots = 0;
    if ((st = kvp_manager_describe(m, ids, B, table, COLS, lens, NULL, 0, &num_slots)) != KVP_OK) die("describe", st);
    cu_check("cuMemcpyHtoD", cu.memcpy_htod(lens_dev, lens, sizeof lens));

    kvp_cascade_plan_args host_args = KVP_CASCADE_PLAN_ARGS_INIT;
    host_args.dtype = KVP_DTYPE_F16;
    host_args.head_dim = HD;
    host_args.num_q_heads = QH;
    host_args.num_kv_heads = KVH;
    host_args.batch = B;
    host_args.max_batch = B;
    host_args.block_size = BS;
    host_args.max_blocks_per_seq = COLS;
    host_args.block_table_stride = COLS;
    host_args.block_table_host = table;
    host_args.seq_lens_host = lens;
    host_args.seq_lens = lens_dev;
    host_args.host_workspace = host[0];
    host_args.host_workspace_bytes = host_bytes;
    host_args.workspace = ws[0];
    host_args.workspace_bytes = dev_bytes;
    kvp_cascade_plan_args mgr_args = host_args;
    mgr_args.block_table_host = NULL; /* the manager's own tables */
    mgr_args.seq_lens_host = NULL;
    mgr_args.host_workspace = host[1];
    mgr_args.workspace = ws[1];
    kvp_cascade_plan_args summary_args = mgr_args; /* no workspaces: host only */
    summary_args.host_workspace = NULL;
    summary_args.host_workspace_bytes = 0;
    summary_args.workspace = 0;
    summary_args.workspace_bytes = 0;

    /* Both entry points write the same plan into zeroed workspaces. */
    kvp_attn_plan pa = KVP_ATTN_PLAN_INIT, pb = KVP_ATTN_PLAN_INIT, ph = KVP_ATTN_PLAN_INIT;
    for (int i = 0; i < 2; i++) {
      memset(host[i], 0, host_bytes);
      cu_check("cuMemsetD8", cu.memset_d8(ws[i], 0, dev_bytes));
    }
    if ((st = kvp_cascade_plan(&host_args, &pa, 0)) != KVP_OK) die("kvp_cascade_plan", st);
    if ((st = kvp_manager_cascade_plan(m, ids, B, &mgr_args, &pb, 0)) != KVP_OK) die("kvp_manager_cascade_plan", st);
    if ((st = kvp_manager_cascade_plan(m, ids, B, &summary_args, &ph, 0)) != KVP_OK) die("host-only plan", st);
    cu_check("cuCtxSynchronize", cu.ctx_synchronize());
    if (memcmp(host[0], host[1], host_bytes) != 0 || pa.route != pb.route || pa.num_items != pb.num_items ||
        pa.max_kv_len != pb.max_kv_len || GENERATION(pa) != GENERATION(pb) || SAVED(pa) != SAVED(pb) ||
        TOTAL(pa) != TOTAL(pb) || ph.route != pa.route || SAVED(ph) != SAVED(pa) || TOTAL(ph) != TOTAL(pa)) {
      fprintf(stderr, "cascade_plan_bench: %s: the manager's plan differs from kvp_cascade_plan's\n", c->name);
      mismatches++;
    }

    struct timing tt[3];
    for (int which = 0; which < 3; which++) {
      for (int i = -runs / 10; i < runs; i++) { /* the first tenth warms up, untimed */
        kvp_attn_plan p = KVP_ATTN_PLAN_INIT;
        double t0 = now_us();
        if (which == 0) {
          st = kvp_cascade_plan(&host_args, &p, 0);
        } else {
          st = kvp_manager_cascade_plan(m, ids, B, which == 1 ? &mgr_args : &summary_args, &p, 0);
        }
        double t1 = now_us();
        if (st != KVP_OK) die("plan", st);
        /* The next plan may not overwrite the host workspace before this
         * plan's copy has executed (the header's rule). */
        if (which < 2) cu_check("cuCtxSynchronize", cu.ctx_synchronize());
        if (i >= 0) t[i] = t1 - t0;
      }
      tt[which] = summarize(t, runs);
    }
    printf("| %s | %.1f (%.1f) | %.1f (%.1f) | %.1f (%.1f) | %d | %.2f |\n", c->name, tt[0].median, tt[0].p90,
           tt[1].median, tt[1].p90, tt[2].median, tt[2].p90, pa.num_items,
           TOTAL(pa) ? (double)SAVED(pa) / (double)TOTAL(pa) : 0.0);
    fflush(stdout);
    kvp_manager_destroy(m);
  }
  free(t);
  if (mismatches) {
    fprintf(stderr, "cascade_plan_bench: %d case(s) planned differently from the manager\n", mismatches);
    return 1;
  }
  printf("\nthe manager's plans equal kvp_cascade_plan's in every case (host workspace, route, items, sharing)\n");
  return 0;
}
