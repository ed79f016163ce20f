/*
 * Host cost of launching the paged decode kernel (f16, head_dim 128, one
 * sequence of 32 tokens, 8 q / 2 kv heads, one split):
 *   1. cuLaunchKernel called directly from C (the floor: CUDA's own cost);
 *   2. kvp_paged_decode through libkvplug's C ABI (argument checks, Go
 *      runtime transition, context and module lookup, cuLaunchKernel).
 * Each figure is the median over 40 batches of the mean host time of 256
 * back-to-back launches, C and ABI batches alternating; the stream is drained
 * between batches, outside the timed region.
 *
 *   cc -O2 -o launch_cost launch_cost.c -ldl -I include -I kernels
 *   ./launch_cost kernels/kvplug.fatbin build/libkvplug.so
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvplug.h"
#include "kvplug_kernels.h"

typedef int CUresult;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;

/* The driver entry points used here: name, symbol in libcuda, parameters. */
#define CU_FUNCS(X)                                                                      \
  X(cuInit, "cuInit", (unsigned))                                                        \
  X(cuDeviceGet, "cuDeviceGet", (int *, int))                                            \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", (CUcontext *, int))            \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                                     \
  X(cuModuleLoadData, "cuModuleLoadData", (CUmodule *, const void *))                    \
  X(cuModuleGetFunction, "cuModuleGetFunction", (CUfunction *, CUmodule, const char *))  \
  X(cuFuncSetAttribute, "cuFuncSetAttribute", (CUfunction, int, int))                    \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                                \
  X(cuMemsetD8, "cuMemsetD8_v2", (CUdeviceptr, unsigned char, size_t))                   \
  X(cuMemcpyHtoD, "cuMemcpyHtoD_v2", (CUdeviceptr, const void *, size_t))                \
  X(cuStreamCreate, "cuStreamCreate", (CUstream *, unsigned))                            \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream))                              \
  X(cuLaunchKernel, "cuLaunchKernel",                                                    \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,   \
     CUstream, void **, void **))

#define DECLARE(name, symbol, params) static CUresult(*name) params;
CU_FUNCS(DECLARE)
#undef DECLARE

#define CK(x)                                                          \
  do {                                                                 \
    CUresult r_ = (x);                                                 \
    if (r_) {                                                          \
      fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #x, r_); \
      exit(1);                                                         \
    }                                                                  \
  } while (0)

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#define BATCHES 40
#define PER 256

static void *sym(void *h, const char *n) {
  void *p = dlsym(h, n);
  if (!p) {
    fprintf(stderr, "missing %s\n", n);
    exit(1);
  }
  return p;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s kvplug.fatbin libkvplug.so\n", argv[0]);
    return 2;
  }
  void *cu = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cu) {
    fprintf(stderr, "no driver\n");
    return 1;
  }
#define RESOLVE(name, symbol, params) name = sym(cu, symbol);
  CU_FUNCS(RESOLVE)
#undef RESOLVE

  FILE *f = fopen(argv[1], "rb");
  if (!f) {
    perror(argv[1]);
    return 1;
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *img = malloc(n);
  if (fread(img, 1, n, f) != (size_t)n) return 1;
  fclose(f);

  int dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmodule mod;
  CUfunction fn;
  CK(cuModuleLoadData(&mod, img));
  CK(cuModuleGetFunction(&fn, mod, "kvp_paged_decode_f16_h128"));
  unsigned smem = kvp_decode_smem_bytes(2, 128);
  CK(cuFuncSetAttribute(fn, 8, (int)smem));

  const int D = 128, QH = 8, KVH = 2, BS = 16, NB = 4, L = 32;
  CUdeviceptr q, kc, vc, table, lens, out;
  CK(cuMemAlloc(&q, QH * D * 2));
  CK(cuMemAlloc(&kc, (size_t)NB * BS * KVH * D * 2));
  CK(cuMemAlloc(&vc, (size_t)NB * BS * KVH * D * 2));
  CK(cuMemAlloc(&table, NB * 4));
  CK(cuMemAlloc(&lens, 4));
  CK(cuMemAlloc(&out, QH * D * 2));
  CK(cuMemsetD8(q, 0x11, QH * D * 2));
  CK(cuMemsetD8(kc, 0x11, (size_t)NB * BS * KVH * D * 2));
  CK(cuMemsetD8(vc, 0x11, (size_t)NB * BS * KVH * D * 2));
  int32_t tbl[4] = {2, 0, 3, 1}, len = L;
  CK(cuMemcpyHtoD(table, tbl, sizeof tbl));
  CK(cuMemcpyHtoD(lens, &len, 4));
  CUstream s;
  CK(cuStreamCreate(&s, 1));

  kvp_decode_params p;
  memset(&p, 0, sizeof p);
  p.kv.k_cache = kc, p.kv.v_cache = vc, p.kv.block_table = table;
  p.kv.block_stride = BS * KVH * D, p.kv.token_stride = KVH * D, p.kv.head_stride = D;
  p.kv.block_table_stride = NB, p.kv.num_kv_heads = KVH, p.kv.block_size = BS;
  p.kv.num_blocks = NB, p.kv.max_blocks_per_seq = NB, p.kv.dtype = KVP_DTYPE_F16;
  p.q = q, p.seq_lens = lens, p.out = out;
  p.q_batch_stride = QH * D, p.q_head_stride = D, p.out_batch_stride = QH * D, p.out_head_stride = D;
  p.batch = 1, p.num_q_heads = QH, p.num_splits = 1, p.scale = 0.088f;
  void *params[1] = {&p};

  void *kv = dlopen(argv[2], RTLD_NOW);
  if (!kv) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  kvp_status (*decode)(const kvp_paged_decode_args *, uint64_t) = sym(kv, "kvp_paged_decode");
  const char *(*last_error)(void) = sym(kv, "kvp_last_error");
  kvp_paged_decode_args a = KVP_PAGED_DECODE_ARGS_INIT;
  a.dtype = KVP_DTYPE_F16, a.head_dim = D, a.batch = 1, a.num_q_heads = QH, a.num_kv_heads = KVH;
  a.num_blocks = NB, a.block_size = BS, a.max_blocks_per_seq = NB;
  a.q = q, a.q_batch_stride = QH * D, a.q_head_stride = D;
  a.k_cache = kc, a.v_cache = vc;
  a.cache_block_stride = BS * KVH * D, a.cache_token_stride = KVH * D, a.cache_head_stride = D;
  a.block_table = table, a.block_table_stride = NB, a.seq_lens = lens;
  a.out = out, a.out_batch_stride = QH * D, a.out_head_stride = D;
  a.num_splits = 1;
  double tc[BATCHES], ta[BATCHES], td[BATCHES];
  /* Alternate C and ABI batches so that drift in the machine's speed
   * affects both alike. */
  for (int b = -2; b < BATCHES; b++) {
    double t0 = now_ns();
    for (int i = 0; i < PER; i++) CK(cuLaunchKernel(fn, KVH, 1, 1, 128, 1, 1, smem, s, params, NULL));
    double t1 = now_ns();
    CK(cuStreamSynchronize(s));
    double t2 = now_ns();
    for (int i = 0; i < PER; i++) {
      kvp_status st = decode(&a, (uint64_t)(uintptr_t)s);
      if (st) {
        fprintf(stderr, "kvp_paged_decode: %d %s\n", st, last_error());
        return 1;
      }
    }
    double t3 = now_ns();
    CK(cuStreamSynchronize(s));
    if (b >= 0) tc[b] = (t1 - t0) / PER, ta[b] = (t3 - t2) / PER, td[b] = ta[b] - tc[b];
  }
  qsort(tc, BATCHES, sizeof tc[0], cmp);
  qsort(ta, BATCHES, sizeof ta[0], cmp);
  qsort(td, BATCHES, sizeof td[0], cmp);
  printf("cuLaunchKernel from C:        %7.0f ns per launch (median of %d batches of %d)\n", tc[BATCHES / 2], BATCHES, PER);
  printf("kvp_paged_decode via the ABI: %7.0f ns per launch; ABI minus C, median of pairs: %.0f ns\n", ta[BATCHES / 2], td[BATCHES / 2]);
  return 0;
}
