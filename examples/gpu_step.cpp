// One engine step on the GPU from C++, through kvplug.hpp: the prefix cache
// admits two prompts that share a system prompt, the prompts' K/V are written
// into the paged cache (kv_write), planned prefill attention runs over both,
// the step is marked computed, then one decode step (grow_tokens, kv_write,
// paged_decode). Every output row is checked against a float64 reference on
// the host. The model's projections are stand-ins: a token's K and V are a
// fixed function of (token, position), as a real layer's are of the prefix,
// so the prompt tokens the second request shares with the first have the
// same K/V and the cache may serve them.
//
// With --kv-dtype e4m3 the same step runs over an FP8 (e4m3) cache: kv_write
// quantises the f16 K/V into it with one float32 scale per (token, kv head)
// (KVP_KV_SCALE_TOKEN_HEAD), or with --kv-scale tensor one calibrated scale
// for all of K and one for V (KVP_KV_SCALE_TENSOR). The cache and its scales
// are downloaded after each write: every written row is checked to be the
// f16 row within half an e4m3 step, and the float64 reference reads the
// cache dequantised (e4m3 * scale). Every kernel route that reads an e4m3
// cache runs over it and is checked against that reference, one line each:
//   - paged prefill on the default plan (Hopper's mainloop on compute
//     capability 9.0, else the sm_80 one), with KVP_PREFILL_NO_HOPPER (the
//     sm_80 mainloop) and with KVP_PREFILL_FP8_QKV (FP8 Q/K/V; skipped where
//     the plan answers UNSUPPORTED off compute capability 9.0, as the header
//     says it does), each as planned (split-KV where the plan splits) and
//     with KVP_PREFILL_NO_SPLIT_KV;
//   - paged decode with the library's split count, one split and two (the
//     split combine), and a prefill plan of the decode step (its decode
//     route);
//   - shared-prefix attention (kvplug::cascade) over the two requests that
//     share the system prompt, on the default plan and with
//     KVP_CASCADE_NO_HOPPER.
// The exit status is 1 on any mismatch or failed route, 2 for a bad command
// line.
//
// Build and run (a machine with a GPU, nvcc, and the library built):
//   nvcc -std=c++17 -Iinclude -Ibindings/cpp examples/gpu_step.cpp -o build/gpu_step -ldl
//   KVPLUG_LIBRARY=$PWD/build/libkvplug.so build/gpu_step
//   KVPLUG_LIBRARY=$PWD/build/libkvplug.so build/gpu_step --kv-dtype e4m3 [--kv-scale tensor]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kvplug.hpp"

namespace {

constexpr int kQHeads = 8, kKVHeads = 2, kDim = 128, kBlock = 16, kBlocks = 64;
constexpr std::size_t kCacheElems = static_cast<std::size_t>(kBlocks) * kBlock * kKVHeads * kDim;

// Tolerances of the e4m3 mode, on the worst query row's relative L2 error
// (one row: a query token's heads; tests/gpu/gputest.py's row_err), the
// measure and the bounds tests/gpu/test_fp8_torch.py checks the same
// comparisons with on the H200.
//   kTolF16: 16-bit (f16) q over the e4m3 cache against the reference over
//     the dequantised cache: TOL[float16] of tests/gpu/test_attn_torch.py,
//     which test_fp8_torch.py applies to decode, both prefill mainloops and
//     cascade. The kernels read the dequantised values themselves (the sm_80
//     ones multiply the scales in fp32; Hopper's rounds each e4m3 * scale to
//     f16, 2^-11 relative), so what is left is fp16 accuracy: probabilities
//     rounded to f16 before P V, and the f16 output.
//   kTolQKV: KVP_PREFILL_FP8_QKV, whose q and probabilities are rounded to
//     e4m3 too (3 mantissa bits, 2^-4 relative): QKV_TOL of
//     test_fp8_torch.py (H200 runs gave 4.3e-2 to 6.0e-2 on its inputs).
// The 16-bit mode keeps its check of the largest absolute error below 1e-2.
constexpr double kTolF16 = 2e-3, kTolQKV = 8e-2, kTol16BitAbs = 1e-2;

// IEEE half precision as the device stores it, converted on the host
// (round to nearest even; the values here are normal numbers in [-1, 1]).
struct Half {
  uint16_t bits;
};

Half to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (exp <= 0) return Half{static_cast<uint16_t>(sign)};  // below half's normal range: zero
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return Half{static_cast<uint16_t>(h)};
}

float to_float(Half h) {
  const uint32_t sign = (h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1f, mant = h.bits & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    x = sign;  // zero (no subnormals here)
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);  // inf or NaN
  } else {
    x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// An e4m3 byte's value (OCP e4m3fn, torch.float8_e4m3fn): 1 sign bit, 4
// exponent bits of bias 7, 3 mantissa bits; exponent 0 holds the subnormals
// m/8 * 2^-6; no infinities, 0x7f and 0xff are NaN; the largest is 448.
double e4m3_value(uint8_t b) {
  const int exp = (b >> 3) & 0xf, mant = b & 7;
  if (exp == 15 && mant == 7) return NAN;
  const double v = exp == 0 ? std::ldexp(mant, -9) : std::ldexp(8 + mant, exp - 10);
  return (b & 0x80) ? -v : v;
}

void cuda_check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// A device buffer of n elements of T, freed with the object.
template <class T>
struct Dev {
  T *p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) {
    void *v = nullptr;
    cuda_check(cudaMalloc(&v, sizeof(T) * (n ? n : 1)), "cudaMalloc");
    p = static_cast<T *>(v);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev &) = delete;
  Dev &operator=(const Dev &) = delete;
  uint64_t addr() const { return reinterpret_cast<uint64_t>(p); }
  void put(const std::vector<T> &h) { cuda_check(cudaMemcpy(p, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice), "upload"); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cuda_check(cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost), "download");
    return h;
  }
  // 0xff bytes: NaN in f16, f32 and e4m3, so an element a kernel leaves unwritten fails the check.
  void poison() { cuda_check(cudaMemset(p, 0xff, sizeof(T) * n), "poison"); }
};

// Pinned host memory (the cascade plan's host workspace, copied asynchronously).
struct Pinned {
  void *p = nullptr;
  uint64_t bytes = 0;
  explicit Pinned(uint64_t n) : bytes(n) { cuda_check(cudaMallocHost(&p, n ? n : 1), "cudaMallocHost"); }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(const Pinned &) = delete;
  Pinned &operator=(const Pinned &) = delete;
};

// Deterministic values in [-1, 1) from integers: the stand-in projections.
double mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull;
  x ^= (c + 1) * 0x94D049BB133111EBull ^ (d + 7) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<double>(x >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

// K (kind 0) or V (kind 1) of a token at a position, rounded to half.
float kv_of(int kind, int32_t token, int pos, int head, int d) {
  return to_float(to_half(static_cast<float>(mix(static_cast<uint64_t>(token), static_cast<uint64_t>(pos),
                                                          static_cast<uint64_t>(kind * 64 + head), static_cast<uint64_t>(d)))));
}

struct Seq {
  int64_t id;
  std::vector<int32_t> tokens;
};

// Host rows [n, heads, dim] of K or V for tokens [from, to) of a sequence.
void append_kv(std::vector<Half> &out, int kind, const Seq &s, int from, int to) {
  for (int p = from; p < to; p++)
    for (int h = 0; h < kKVHeads; h++)
      for (int d = 0; d < kDim; d++) out.push_back(to_half(kv_of(kind, s.tokens[static_cast<std::size_t>(p)], p, h, d)));
}

// ---- command line -------------------------------------------------------

struct Options {
  bool e4m3 = false;
  kvp_kv_scale scale_kind = KVP_KV_SCALE_NONE;
};

void usage(std::FILE *f, const char *prog) {
  std::fprintf(f,
               "usage: %s [--kv-dtype f16|e4m3] [--kv-scale token|tensor]\n"
               "  --kv-dtype f16     16-bit KV cache (default)\n"
               "  --kv-dtype e4m3    FP8 e4m3 KV cache; every kernel route checked against float64\n"
               "  --kv-scale token   e4m3: one float32 scale per (token, kv head) (default)\n"
               "  --kv-scale tensor  e4m3: one calibrated scale for K and one for V\n",
               prog);
}

// The options, or exit status 2 (after the usage) for a bad command line.
Options parse_options(int argc, char **argv) {
  Options o;
  std::string scale;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(stdout, argv[0]);
      std::exit(0);
    }
    const bool dtype = arg == "--kv-dtype", known = dtype || arg == "--kv-scale";
    if (!known || i + 1 == argc) {
      std::fprintf(stderr, known ? "%s: %s needs a value\n" : "%s: unknown argument %s\n", argv[0], arg.c_str());
      usage(stderr, argv[0]);
      std::exit(2);
    }
    const std::string v = argv[++i];
    if (dtype ? v != "f16" && v != "e4m3" : v != "token" && v != "tensor") {
      std::fprintf(stderr, "%s: bad value of %s: %s\n", argv[0], arg.c_str(), v.c_str());
      usage(stderr, argv[0]);
      std::exit(2);
    }
    if (dtype)
      o.e4m3 = v == "e4m3";
    else
      scale = v;
  }
  if (!scale.empty() && !o.e4m3) {
    std::fprintf(stderr, "%s: --kv-scale goes with --kv-dtype e4m3\n", argv[0]);
    usage(stderr, argv[0]);
    std::exit(2);
  }
  if (o.e4m3) o.scale_kind = scale == "tensor" ? KVP_KV_SCALE_TENSOR : KVP_KV_SCALE_TOKEN_HEAD;
  return o;
}

// ---- the cache ------------------------------------------------------------

// The paged caches, [blocks, block_size, kv_heads, dim] each: f16, or e4m3
// with float32 scales (per token and kv head, or one for K and one for V).
// Strides count elements of the cache's dtype, so both formats share them.
constexpr int64_t kTokenStride = kKVHeads * kDim, kBlockStride = kBlock * kTokenStride;

// The per-tensor scales: calibrated for the stand-in projections, which lie
// in [-1, 1], so that the largest |x| maps to e4m3's largest finite value,
// 448 (kv_write divides by the scale and saturates beyond it).
constexpr float kTensorScale = 1.0f / 448;

struct Cache {
  bool e4m3;
  kvp_kv_scale scale_kind;
  Dev<uint8_t> k, v;   // elements of 2 bytes (f16) or 1 (e4m3)
  Dev<float> ks, vs;   // e4m3: the scales (kvp_kv_scale); else unused

  explicit Cache(const Options &o)
      : e4m3(o.e4m3), scale_kind(o.scale_kind), k(kCacheElems * elem_bytes()), v(kCacheElems * elem_bytes()),
        ks(num_scales()), vs(num_scales()) {
    k.poison();  // NaN: a slot read but never written shows
    v.poison();
    if (scale_kind == KVP_KV_SCALE_TENSOR) {
      ks.put({kTensorScale});
      vs.put({kTensorScale});
    } else {
      ks.poison();  // kv_write writes each row's scale
      vs.poison();
    }
  }
  std::size_t elem_bytes() const { return e4m3 ? 1 : 2; }
  std::size_t num_scales() const {
    return scale_kind == KVP_KV_SCALE_TOKEN_HEAD ? static_cast<std::size_t>(kBlocks) * kBlock * kKVHeads
                                                 : scale_kind == KVP_KV_SCALE_TENSOR ? 1 : 0;
  }
  const char *name() const {
    return !e4m3 ? "f16" : scale_kind == KVP_KV_SCALE_TENSOR ? "e4m3, per-tensor scales" : "e4m3, per-(token, kv head) scales";
  }

  // The descriptor every launch takes (kvp_paged_kv), with a device block
  // table of max_blocks columns (0 and 0 for kv_write, which reads none).
  kvp_paged_kv desc(uint64_t table, int32_t max_blocks) const {
    kvp_paged_kv kv = KVP_PAGED_KV_INIT;
    kv.dtype = e4m3 ? KVP_DTYPE_E4M3 : KVP_DTYPE_F16;
    kv.num_kv_heads = kKVHeads;
    kv.num_blocks = kBlocks;
    kv.block_size = kBlock;
    kv.k_cache = k.addr();
    kv.v_cache = v.addr();
    kv.block_stride = kBlockStride;
    kv.token_stride = kTokenStride;
    kv.head_stride = kDim;
    kv.block_table = table;
    kv.block_table_stride = max_blocks;
    kv.max_blocks_per_seq = max_blocks;
    kv.head_dim = kDim;
    if (e4m3) {
      kv.k_scale = ks.addr();
      kv.v_scale = vs.addr();
      kv.scale_kind = scale_kind;
    }
    return kv;
  }
};

// An e4m3 cache downloaded: its elements and scales, read as the kernels
// read them.
struct HostCache {
  std::vector<uint8_t> k, v;
  std::vector<float> ks, vs;
  kvp_kv_scale scale_kind;

  explicit HostCache(const Cache &c) : k(c.k.get()), v(c.v.get()), ks(c.ks.get()), vs(c.vs.get()), scale_kind(c.scale_kind) {}
  float scale(int kind, int32_t blk, int off, int h) const {
    const std::vector<float> &s = kind == 0 ? ks : vs;
    return scale_kind == KVP_KV_SCALE_TENSOR ? s[0] : s[(static_cast<std::size_t>(blk) * kBlock + static_cast<std::size_t>(off)) * kKVHeads + static_cast<std::size_t>(h)];
  }
  // The dequantised element, e4m3 * scale, in float64.
  double value(int kind, int32_t blk, int off, int h, int d) const {
    const std::size_t i = static_cast<std::size_t>(blk) * kBlockStride + static_cast<std::size_t>(off) * kTokenStride +
                          static_cast<std::size_t>(h) * kDim + static_cast<std::size_t>(d);
    return e4m3_value((kind == 0 ? k : v)[i]) * static_cast<double>(scale(kind, blk, off, h));
  }
};

// The block and offset that hold token t of the batch's sequence i.
std::pair<int32_t, int> slot_of(const kvplug::Description &d, std::size_t i, int t) {
  return {d.block_table[i * static_cast<std::size_t>(d.max_blocks) + static_cast<std::size_t>(t / kBlock)], t % kBlock};
}

// K and V as the reference reads them, float64 per sequence [tokens, kv heads, dim].
struct KV64 {
  std::vector<std::vector<double>> kv[2];  // [kind][sequence]
  double at(int kind, std::size_t s, int t, int h, int d) const {
    return kv[kind][s][(static_cast<std::size_t>(t) * kKVHeads + static_cast<std::size_t>(h)) * kDim + static_cast<std::size_t>(d)];
  }
};

// Every sequence's K and V built by get(kind, sequence, position, kv head, d).
KV64 build_kv(const std::vector<Seq> &seqs, const std::function<double(int, std::size_t, int, int, int)> &get) {
  KV64 r;
  for (int kind = 0; kind < 2; kind++)
    for (std::size_t i = 0; i < seqs.size(); i++) {
      std::vector<double> &x = r.kv[kind].emplace_back();
      for (int t = 0; t < static_cast<int>(seqs[i].tokens.size()); t++)
        for (int h = 0; h < kKVHeads; h++)
          for (int d = 0; d < kDim; d++) x.push_back(get(kind, i, t, h, d));
    }
  return r;
}

// The f16 K/V kv_write was given: the 16-bit cache holds exactly these.
KV64 exact_kv(const std::vector<Seq> &seqs) {
  return build_kv(seqs, [&](int kind, std::size_t i, int t, int h, int d) {
    return static_cast<double>(kv_of(kind, seqs[i].tokens[static_cast<std::size_t>(t)], t, h, d));
  });
}

// The e4m3 cache dequantised, read through the batch's block table.
KV64 dequantised_kv(const HostCache &c, const kvplug::Description &desc, const std::vector<Seq> &seqs) {
  return build_kv(seqs, [&](int kind, std::size_t i, int t, int h, int d) {
    const auto [blk, off] = slot_of(desc, i, t);
    return c.value(kind, blk, off, h, d);
  });
}

// Checks what kv_write wrote into an e4m3 cache for every token of the
// sequences: each row's scale is its max|x| / 448 (per-token-head scales;
// within 2e-7, as test_fp8_torch.py allows) and each element is the f16
// value within half an e4m3 step (|x| / 16, or scale / 1024 among the
// subnormals). Returns the (token, kv head) rows checked (K and V each), the
// largest |e4m3 * scale - x|, and the first fault found (empty when none).
struct QuantCheck {
  int rows = 0;
  double max_err = 0;
  std::string fault;
};

QuantCheck check_quantised(const HostCache &c, const kvplug::Description &desc, const std::vector<Seq> &seqs) {
  QuantCheck r;
  char msg[200];
  for (std::size_t i = 0; i < seqs.size(); i++)
    for (int t = 0; t < static_cast<int>(seqs[i].tokens.size()); t++)
      for (int kind = 0; kind < 2; kind++)
        for (int h = 0; h < kKVHeads; h++) {
          const auto [blk, off] = slot_of(desc, i, t);
          const int32_t token = seqs[i].tokens[static_cast<std::size_t>(t)];
          float amax = 0;
          for (int d = 0; d < kDim; d++) amax = std::max(amax, std::fabs(kv_of(kind, token, t, h, d)));
          const double s = c.scale(kind, blk, off, h);
          r.rows += kind == 0;
          if (c.scale_kind == KVP_KV_SCALE_TOKEN_HEAD) {
            const double want = amax > 0 ? static_cast<double>(amax / 448.0f) : 1.0;
            if (!(std::fabs(s - want) <= 2e-7 * want) && r.fault.empty()) {
              std::snprintf(msg, sizeof msg, "sequence %zu token %d %s head %d: scale %.9g, max|x| / 448 = %.9g", i, t,
                            kind ? "V" : "K", h, s, want);
              r.fault = msg;
            }
          }
          for (int d = 0; d < kDim; d++) {
            const double x = kv_of(kind, token, t, h, d), got = c.value(kind, blk, off, h, d);
            const double err = std::fabs(got - x);
            r.max_err = std::max(r.max_err, std::isnan(err) ? INFINITY : err);
            if (!(err <= std::max(std::fabs(x) / 16, s / 1024) * 1.0001) && r.fault.empty()) {
              std::snprintf(msg, sizeof msg, "sequence %zu token %d %s head %d d %d: e4m3 * scale = %.6g for %.6g", i, t,
                            kind ? "V" : "K", h, d, got, x);
              r.fault = msg;
            }
          }
        }
  return r;
}

// ---- the reference and the errors ----------------------------------------

// A query row: sequence seq (index into the batch) at position pos.
struct Row {
  int seq, pos;
};

// float64 attention of one query row (query head qh of row `row` of q, at
// position pos of sequence s) over s's tokens [0, pos] of kv, with the
// softmax scale 1/sqrt(dim).
std::vector<double> reference(const KV64 &kv, std::size_t s, const std::vector<Half> &q, std::size_t row, int qh, int pos) {
  const int kh = qh / (kQHeads / kKVHeads);
  std::vector<double> score(static_cast<std::size_t>(pos) + 1), out(kDim, 0.0);
  double mx = -1e300, sum = 0;
  for (int t = 0; t <= pos; t++) {
    double dot = 0;
    for (int d = 0; d < kDim; d++)
      dot += static_cast<double>(to_float(q[(row * kQHeads + static_cast<std::size_t>(qh)) * kDim + static_cast<std::size_t>(d)])) *
             kv.at(0, s, t, kh, d);
    score[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(kDim));
    mx = std::max(mx, score[static_cast<std::size_t>(t)]);
  }
  for (double &x : score) sum += (x = std::exp(x - mx));
  for (int t = 0; t <= pos; t++)
    for (int d = 0; d < kDim; d++) out[static_cast<std::size_t>(d)] += score[static_cast<std::size_t>(t)] / sum * kv.at(1, s, t, kh, d);
  return out;
}

// out's errors against the reference: the largest |out - reference|, and the
// worst row's relative L2 error (a row: one query token's heads). An
// unwritten element (the poison) or a NaN makes both infinite.
struct Err {
  double abs = 0, rel = 0;
};

Err errors(const KV64 &kv, const std::vector<Row> &rows, const std::vector<Half> &q, const std::vector<Half> &out) {
  Err e;
  for (std::size_t r = 0; r < rows.size(); r++) {
    double num = 0, den = 0;
    for (int h = 0; h < kQHeads; h++) {
      const auto ref = reference(kv, static_cast<std::size_t>(rows[r].seq), q, r, h, rows[r].pos);
      for (int d = 0; d < kDim; d++) {
        const float got = to_float(out[(r * kQHeads + static_cast<std::size_t>(h)) * kDim + static_cast<std::size_t>(d)]);
        if (!std::isfinite(got)) return {INFINITY, INFINITY};
        const double diff = got - ref[static_cast<std::size_t>(d)];
        e.abs = std::max(e.abs, std::fabs(diff));
        num += diff * diff;
        den += ref[static_cast<std::size_t>(d)] * ref[static_cast<std::size_t>(d)];
      }
    }
    e.rel = std::max(e.rel, den > 0 ? std::sqrt(num / den) : num > 0 ? INFINITY : 0.0);
  }
  return e;
}

std::vector<Half> random_q(std::size_t rows, uint64_t seed) {
  std::vector<Half> q;
  for (std::size_t i = 0; i < rows * kQHeads * kDim; i++) q.push_back(to_half(static_cast<float>(mix(seed, i, 3, 5))));
  return q;
}

// ---- one step's batch and the launch args ----------------------------------

// The query rows of tokens [from[i], end) of each sequence i.
std::vector<Row> query_rows(const std::vector<Seq> &seqs, const std::vector<int> &from) {
  std::vector<Row> rows;
  for (std::size_t i = 0; i < seqs.size(); i++)
    for (int p = from[i]; p < static_cast<int>(seqs[i].tokens.size()); p++) rows.push_back({static_cast<int>(i), p});
  return rows;
}

// Row offsets per sequence (qo_indptr) of rows grouped by sequence.
std::vector<int32_t> offsets(const std::vector<Row> &rows, std::size_t batch) {
  std::vector<int32_t> qo(batch + 1, 0);
  for (const Row &r : rows) qo[static_cast<std::size_t>(r.seq) + 1]++;
  for (std::size_t i = 0; i < batch; i++) qo[i + 1] += qo[i];
  return qo;
}

// A step's batch on the device: the described block table and lengths, its
// query rows (q, random) and their output.
struct Batch {
  kvplug::Description d;
  std::vector<Row> rows;
  std::vector<int32_t> qo;
  std::vector<Half> q;
  Dev<int32_t> qo_dev, lens, table;
  Dev<Half> dq, out;

  Batch(kvplug::Description desc, const std::vector<Seq> &seqs, const std::vector<int> &from, uint64_t seed)
      : d(std::move(desc)), rows(query_rows(seqs, from)), qo(offsets(rows, seqs.size())), q(random_q(rows.size(), seed)),
        qo_dev(qo.size()), lens(d.seq_lens.size()), table(d.block_table.size()), dq(q.size()), out(q.size()) {
    qo_dev.put(qo);
    lens.put(d.seq_lens);
    table.put(d.block_table);
    dq.put(q);
  }
  int32_t batch() const { return static_cast<int32_t>(d.seq_lens.size()); }
  int32_t total_q() const { return static_cast<int32_t>(rows.size()); }
};

// kv_write of tokens [from[i], end) of each sequence into the cache at d's
// slots (the slots of the batch's new tokens): f16 K/V, quantised by
// kv_write into an e4m3 cache.
void write_kv(const Cache &cache, const std::vector<Seq> &seqs, const kvplug::Description &d, const std::vector<int> &from) {
  std::vector<Half> k, v;
  for (std::size_t i = 0; i < seqs.size(); i++) {
    append_kv(k, 0, seqs[i], from[i], static_cast<int>(seqs[i].tokens.size()));
    append_kv(v, 1, seqs[i], from[i], static_cast<int>(seqs[i].tokens.size()));
  }
  const std::size_t n = d.slot_mapping.size();
  Dev<Half> dk(k.size()), dv(v.size());
  Dev<int32_t> slots(n);
  dk.put(k);
  dv.put(v);
  slots.put(d.slot_mapping);
  const kvp_paged_kv kv = cache.desc(0, 0);
  kvp_kv_write_args a = KVP_KV_WRITE_ARGS_INIT;
  a.dtype = KVP_DTYPE_F16;  // key and value's; the cache's is kv.dtype
  a.head_dim = kDim;
  a.num_tokens = static_cast<int32_t>(n);
  a.num_kv_heads = kKVHeads;
  a.key = dk.addr();
  a.key_token_stride = a.value_token_stride = kTokenStride;
  a.key_head_stride = a.value_head_stride = kDim;
  a.value = dv.addr();
  a.slot_mapping = slots.addr();
  a.kv = &kv;
  kvplug::attn::kv_write(a);
  cuda_check(cudaDeviceSynchronize(), "kv_write");
}

kvp_prefill_plan_args plan_args(const Batch &b, const Dev<uint8_t> &ws, int32_t flags) {
  kvp_prefill_plan_args pa = KVP_PREFILL_PLAN_ARGS_INIT;
  pa.dtype = KVP_DTYPE_F16;  // q's and out's, over either cache
  pa.head_dim = kDim;
  pa.num_q_heads = kQHeads;
  pa.num_kv_heads = kKVHeads;
  pa.batch = b.batch();
  pa.flags = flags;
  pa.qo_indptr_host = b.qo.data();
  pa.kv_lens_host = b.d.seq_lens.data();
  pa.qo_indptr = b.qo_dev.addr();
  pa.kv_lens = b.lens.addr();
  pa.workspace = ws.addr();
  pa.workspace_bytes = ws.n;
  return pa;
}

// The layer args of kvp_paged_prefill and kvp_paged_cascade: b's q and out over the cache kv.
kvp_paged_prefill_args prefill_args(const Batch &b, const kvp_paged_kv &kv) {
  kvp_paged_prefill_args a = KVP_PAGED_PREFILL_ARGS_INIT;
  a.q = b.dq.addr();
  a.q_token_stride = a.out_token_stride = kQHeads * kDim;
  a.q_head_stride = a.out_head_stride = kDim;
  a.out = b.out.addr();
  a.kv = &kv;
  return a;
}

kvp_paged_decode_args decode_args(const Batch &b, const kvp_paged_kv &kv, const Dev<uint8_t> &ws, int32_t num_splits) {
  kvp_paged_decode_args a = KVP_PAGED_DECODE_ARGS_INIT;
  a.dtype = KVP_DTYPE_F16;
  a.head_dim = kDim;
  a.batch = b.batch();
  a.num_q_heads = kQHeads;
  a.q = b.dq.addr();
  a.q_batch_stride = a.out_batch_stride = kQHeads * kDim;
  a.q_head_stride = a.out_head_stride = kDim;
  a.seq_lens = b.lens.addr();
  a.out = b.out.addr();
  a.workspace = ws.addr();
  a.workspace_bytes = ws.n;
  a.num_splits = num_splits;
  a.kv = &kv;
  return a;
}

// Runs launch, a kernel writing b.out, over b.out poisoned with NaN, and
// returns b.out's errors against the reference over kv.
Err run(Batch &b, const KV64 &kv, const std::function<void()> &launch, const char *what) {
  b.out.poison();
  launch();
  cuda_check(cudaDeviceSynchronize(), what);
  return errors(kv, b.rows, b.q, b.out.get());
}

// ---- the e4m3 mode's report ---------------------------------------------------

const char *mainloop_name(uint64_t m) { return m == 0 ? "sm80" : m == 1 ? "sm90" : m == 2 ? "sm90-fp8" : "?"; }

// One line per route; ok while every route passed.
struct Report {
  bool ok = true;
  void line(const std::string &name, const std::string &route, Err e, double tol, const std::string &fault = "") {
    const bool pass = fault.empty() && e.rel < tol;  // an infinite (unwritten) or NaN error fails
    ok = ok && pass;
    std::printf("%-40s %-34s max |kvplug - float64| = %.2e, worst row rel. err %.2e (tol %.0e): %s%s\n", name.c_str(),
                route.c_str(), e.abs, e.rel, tol, pass ? "ok" : "MISMATCH", fault.empty() ? "" : (" (" + fault + ")").c_str());
  }
  void failed(const std::string &name, const std::string &why) {
    ok = false;
    std::printf("%-40s FAILED: %s\n", name.c_str(), why.c_str());
  }
  void skipped(const std::string &name, const std::string &why) { std::printf("%-40s skipped: %s\n", name.c_str(), why.c_str()); }
  // Runs one route; a kvplug error fails that route only.
  void attempt(const std::string &name, const std::function<void()> &route) {
    try {
      route();
    } catch (const kvplug::Error &e) {
      failed(name, std::string(kvplug::status_string(e.status())) + ": " + e.what());
    }
  }
};

// "route R[, mainloop M], S split(s)" of a prefill plan.
std::string plan_text(const kvp_attn_plan &p) {
  std::string s = "route " + std::to_string(p.route);
  if (p.route == KVP_ATTN_ROUTE_PREFILL) s += ", mainloop " + std::string(mainloop_name(p.state[KVP_PLAN_STATE_MAINLOOP]));
  return s + ", " + std::to_string(p.num_splits) + (p.num_splits == 1 ? " split" : " splits");
}

}  // namespace

int main(int argc, char **argv) try {
  const Options opt = parse_options(argc, argv);
  if (!kvplug::attn::cuda_available()) {
    std::printf("no CUDA device: nothing to run\n");
    return 0;
  }
  kvplug::attn::prepare();
  int device = 0, major = 0, minor = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
  cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "compute capability");
  const bool hopper = major == 9 && minor == 0;  // where the header's Hopper mainloop and FP8 Q/K/V run
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = kBlocks;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  kvplug::Manager m(cfg);
  kvplug::PrefixCache pc(m);

  // Two requests sharing a 64-token system prompt.
  std::vector<Seq> seqs{{1, {}}, {2, {}}};
  for (int i = 0; i < 64; i++) {
    seqs[0].tokens.push_back(1000 + i);
    seqs[1].tokens.push_back(1000 + i);
  }
  for (int i = 0; i < 36; i++) seqs[0].tokens.push_back(7 * i % 251);
  for (int i = 0; i < 6; i++) seqs[1].tokens.push_back(500 + i);
  const std::vector<int64_t> ids{1, 2};
  kvplug::Prompts prompts;
  prompts.add(seqs[0].tokens).add(seqs[1].tokens);
  const std::vector<int32_t> matched = pc.admit(ids, prompts);  // request 2 starts on request 1's blocks
  std::printf("admitted: matched tokens %d and %d\n", matched[0], matched[1]);

  Cache cache(opt);
  Report report;
  if (opt.e4m3) std::printf("kv cache: %s; device compute capability %d.%d\n", cache.name(), major, minor);
  // The reference's K/V after a write: what kv_write was given (16-bit), or
  // the e4m3 cache downloaded and dequantised, after checking its rows.
  auto written_kv = [&](const kvplug::Description &d, const char *step) {
    if (!opt.e4m3) return exact_kv(seqs);
    const HostCache host(cache);
    const QuantCheck qc = check_quantised(host, d, seqs);
    const bool pass = qc.fault.empty();
    report.ok = report.ok && pass;
    std::printf("%-40s K and V of %d (token, kv head) rows: max |e4m3 * scale - f16| = %.2e, each within half an e4m3 step: %s%s\n",
                (std::string("kv_write (") + step + ")").c_str(), qc.rows, qc.max_err, pass ? "ok" : "MISMATCH",
                pass ? "" : (" (" + qc.fault + ")").c_str());
    return dequantised_kv(host, d, seqs);
  };

  // Prefill: each request's new tokens (after its match) attend to its whole prefix.
  {
    kvplug::Description d = m.describe(ids);
    write_kv(cache, seqs, d, {matched[0], matched[1]});
    const KV64 ref = written_kv(d, "prefill");
    Batch b(std::move(d), seqs, {matched[0], matched[1]}, 11);
    const kvp_paged_kv kv = cache.desc(b.table.addr(), b.d.max_blocks);
    Dev<uint8_t> ws(kvplug::attn::prefill_workspace_size(b.batch(), b.total_q(), kQHeads, kKVHeads, kDim));
    kvp_attn_plan plan = KVP_ATTN_PLAN_INIT;
    auto plan_prefill = [&](int32_t flags) { plan = kvplug::attn::prefill_plan(plan_args(b, ws, flags)); };
    auto run_prefill = [&] {
      return run(b, ref, [&] { kvplug::attn::paged_prefill(plan, prefill_args(b, kv)); }, "paged_prefill");
    };
    if (!opt.e4m3) {
      plan_prefill(0);
      const double err = run_prefill().abs;
      report.ok = report.ok && err < kTol16BitAbs;
      std::printf("prefill: %d rows (plan route %d), max |kvplug - float64| = %.2e\n", b.total_q(), plan.route, err);
    } else {
      // Each prefill mainloop that reads an e4m3 cache, split (where the plan
      // splits this small batch) and not; mainloop: the one the plan must pick.
      struct Route {
        const char *name;
        int32_t flags;
        uint64_t mainloop;
        double tol;
      };
      const int32_t one = KVP_PREFILL_NO_SPLIT_KV;
      const uint64_t dflt = hopper ? 1 : 0;
      const Route routes[] = {
          {"prefill, default plan", 0, dflt, kTolF16},
          {"prefill, default plan, NO_SPLIT_KV", one, dflt, kTolF16},
          {"prefill, NO_HOPPER", KVP_PREFILL_NO_HOPPER, 0, kTolF16},
          {"prefill, NO_HOPPER | NO_SPLIT_KV", KVP_PREFILL_NO_HOPPER | one, 0, kTolF16},
          {"prefill, FP8_QKV", KVP_PREFILL_FP8_QKV, 2, kTolQKV},
          {"prefill, FP8_QKV | NO_SPLIT_KV", KVP_PREFILL_FP8_QKV | one, 2, kTolQKV},
      };
      for (const Route &r : routes)
        report.attempt(r.name, [&] {
          try {
            plan_prefill(r.flags);
          } catch (const kvplug::Error &e) {
            // The header: FP8 Q/K/V plans answer UNSUPPORTED off Hopper (compute capability 9.0).
            if ((r.flags & KVP_PREFILL_FP8_QKV) && !hopper && e.status() == KVP_ERR_UNSUPPORTED) {
              report.skipped(r.name, std::string(kvplug::status_string(e.status())) + " (compute capability " +
                                         std::to_string(major) + "." + std::to_string(minor) + "): " + e.what());
              return;
            }
            throw;
          }
          const Err e = run_prefill();
          std::string fault;
          if (plan.route != KVP_ATTN_ROUTE_PREFILL || plan.state[KVP_PLAN_STATE_MAINLOOP] != r.mainloop)
            fault = "expected route 1, mainloop " + std::string(mainloop_name(r.mainloop));
          report.line(r.name, plan_text(plan), e, r.tol, fault);
        });
    }
  }
  m.mark_computed();  // the step's forward pass is done: its blocks stay cached

  // Decode: one sampled token each.
  const std::vector<int32_t> next{42, 43}, ones{1, 1};
  pc.grow_tokens(ids, ones, next);
  seqs[0].tokens.push_back(42);
  seqs[1].tokens.push_back(43);
  {
    const std::vector<int> last{static_cast<int>(seqs[0].tokens.size()) - 1, static_cast<int>(seqs[1].tokens.size()) - 1};
    kvplug::Description d = m.describe(ids);
    write_kv(cache, seqs, d, last);
    const KV64 ref = written_kv(d, "decode");
    Batch b(std::move(d), seqs, last, 12);
    const kvp_paged_kv kv = cache.desc(b.table.addr(), b.d.max_blocks);
    Dev<uint8_t> dws(kvplug::attn::workspace_size(b.batch(), kQHeads, kDim));
    auto decode = [&](int32_t num_splits) {
      return run(b, ref, [&] { kvplug::attn::paged_decode(decode_args(b, kv, dws, num_splits)); }, "paged_decode");
    };
    if (!opt.e4m3) {
      const double err = decode(0).abs;
      report.ok = report.ok && err < kTol16BitAbs;
      std::printf("decode: lengths %d and %d, max |kvplug - float64| = %.2e\n", b.d.seq_lens[0], b.d.seq_lens[1], err);
    } else {
      // paged_decode: the library's split count, one split, and two (chunks
      // of 64 tokens: both sequences split, and the second kernel combines).
      const int32_t chosen = kvplug::attn::num_splits(KVP_DTYPE_E4M3, kDim, b.batch(), kQHeads, kKVHeads,
                                                      b.d.max_blocks * kBlock);
      const std::pair<const char *, int32_t> splits[] = {{"decode, num_splits 0", 0}, {"decode, num_splits 1", 1}, {"decode, num_splits 2", 2}};
      for (const auto &split : splits)
        report.attempt(split.first, [&, name = split.first, n = split.second] {
          const std::string route = "decode kernel, " + std::to_string(n == 0 ? chosen : n) +
                                    (n == 0 ? " split(s), the library's choice" : " split(s), forced");
          report.line(name, route, decode(n), kTolF16);
        });
      // A prefill plan of the decode step takes the decode route.
      Dev<uint8_t> pws(kvplug::attn::prefill_workspace_size(b.batch(), b.total_q(), kQHeads, kKVHeads, kDim));
      report.attempt("prefill plan of the decode step", [&] {
        const kvp_attn_plan plan = kvplug::attn::prefill_plan(plan_args(b, pws, 0));
        const Err e = run(b, ref, [&] { kvplug::attn::paged_prefill(plan, prefill_args(b, kv)); }, "paged_prefill");
        report.line("prefill plan of the decode step", plan_text(plan), e, kTolF16,
                    plan.route == KVP_ATTN_ROUTE_DECODE ? "" : "expected route 2");
      });
      // Shared-prefix attention: the system prompt's 4 blocks, which both
      // requests hold in their first columns, read once for both queries.
      // NO_DECODE_ROUTE keeps the cascade kernels where the planner would
      // find sharing 64 tokens between 2 sequences not worth it.
      const kvplug::cascade::WorkspaceSizes sz = kvplug::cascade::workspace_size(b.batch(), kQHeads, kKVHeads, kDim);
      Dev<uint8_t> cws(sz.device);
      Pinned chost(sz.host);
      const std::pair<const char *, int32_t> cascades[] = {
          {"cascade, default plan", KVP_CASCADE_NO_DECODE_ROUTE},
          {"cascade, NO_HOPPER", KVP_CASCADE_NO_DECODE_ROUTE | KVP_CASCADE_NO_HOPPER}};
      for (const auto &c : cascades)
        report.attempt(c.first, [&, name = c.first, flags = c.second] {
          kvp_cascade_plan_args ca = KVP_CASCADE_PLAN_ARGS_INIT;
          ca.dtype = KVP_DTYPE_F16;
          ca.head_dim = kDim;
          ca.num_q_heads = kQHeads;
          ca.num_kv_heads = kKVHeads;
          ca.batch = b.batch();
          ca.max_batch = b.batch();
          ca.block_size = kBlock;
          ca.max_blocks_per_seq = b.d.max_blocks;  // the manager gives the table and lengths
          ca.seq_lens = b.lens.addr();
          ca.host_workspace = chost.p;
          ca.host_workspace_bytes = chost.bytes;
          ca.workspace = cws.addr();
          ca.workspace_bytes = cws.n;
          ca.flags = flags;
          const kvp_attn_plan plan = kvplug::cascade::plan(m, ids, ca);
          const Err e = run(b, ref, [&] { kvplug::cascade::paged_cascade(plan, prefill_args(b, kv)); }, "paged_cascade");
          const uint64_t saved = plan.state[KVP_PLAN_STATE_SAVED_TOKENS], total = plan.state[KVP_PLAN_STATE_TOTAL_TOKENS];
          report.line(name, "route " + std::to_string(plan.route) + ", reads " + std::to_string(total - saved) + " of " +
                                std::to_string(total) + " tokens",
                      e, kTolF16, plan.route == KVP_ATTN_ROUTE_CASCADE ? "" : "expected route 3");
        });
    }
  }
  m.mark_computed();
  m.remove(ids);
  std::printf("cached after the requests finished: %d blocks\n", pc.stats().cached_blocks);
  std::printf("%s\n", report.ok ? "ok" : "MISMATCH");
  return report.ok ? 0 : 1;
} catch (const kvplug::Error &e) {
  std::fprintf(stderr, "%s: %s\n", kvplug::status_string(e.status()), e.what());
  return 1;
}
