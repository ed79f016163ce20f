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
// Build and run (a machine with a GPU, nvcc, and the library built):
//   nvcc -std=c++17 -Iinclude -Ibindings/cpp examples/gpu_step.cpp -o build/gpu_step -ldl
//   KVPLUG_LIBRARY=$PWD/build/libkvplug.so build/gpu_step
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvplug.hpp"

namespace {

constexpr int kQHeads = 8, kKVHeads = 2, kDim = 128, kBlock = 16, kBlocks = 64;

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

// float64 attention of one query row (query head qh, position pos of s)
// over s's tokens [0, pos], with the softmax scale 1/sqrt(dim).
std::vector<double> reference(const Seq &s, const std::vector<Half> &q, std::size_t row, int qh, int pos) {
  const int kh = qh / (kQHeads / kKVHeads);
  std::vector<double> score(static_cast<std::size_t>(pos) + 1), out(kDim, 0.0);
  double mx = -1e300, sum = 0;
  for (int t = 0; t <= pos; t++) {
    double dot = 0;
    for (int d = 0; d < kDim; d++)
      dot += static_cast<double>(to_float(q[(row * kQHeads + static_cast<std::size_t>(qh)) * kDim + static_cast<std::size_t>(d)])) *
             kv_of(0, s.tokens[static_cast<std::size_t>(t)], t, kh, d);
    score[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(kDim));
    mx = std::max(mx, score[static_cast<std::size_t>(t)]);
  }
  for (double &x : score) sum += (x = std::exp(x - mx));
  for (int t = 0; t <= pos; t++)
    for (int d = 0; d < kDim; d++)
      out[static_cast<std::size_t>(d)] += score[static_cast<std::size_t>(t)] / sum * kv_of(1, s.tokens[static_cast<std::size_t>(t)], t, kh, d);
  return out;
}

// The largest |out - reference| over the rows: row r is sequence seqs[row_seq[r]] at position row_pos[r].
double max_error(const std::vector<Seq> &seqs, const std::vector<int> &row_seq, const std::vector<int> &row_pos,
                 const std::vector<Half> &q, const std::vector<Half> &out) {
  double err = 0;
  for (std::size_t r = 0; r < row_seq.size(); r++)
    for (int h = 0; h < kQHeads; h++) {
      const auto ref = reference(seqs[static_cast<std::size_t>(row_seq[r])], q, r, h, row_pos[r]);
      for (int d = 0; d < kDim; d++) {
        const float got = to_float(out[(r * kQHeads + static_cast<std::size_t>(h)) * kDim + static_cast<std::size_t>(d)]);
        if (!std::isfinite(got)) return INFINITY;  // a row left unwritten (the poison) or a NaN
        err = std::max(err, std::fabs(got - ref[static_cast<std::size_t>(d)]));
      }
    }
  return err;
}

std::vector<Half> random_q(std::size_t rows, uint64_t seed) {
  std::vector<Half> q;
  for (std::size_t i = 0; i < rows * kQHeads * kDim; i++) q.push_back(to_half(static_cast<float>(mix(seed, i, 3, 5))));
  return q;
}

}  // namespace

int main() try {
  if (!kvplug::attn::cuda_available()) {
    std::printf("no CUDA device: nothing to run\n");
    return 0;
  }
  kvplug::attn::prepare();
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

  // The caches, [blocks, block_size, kv_heads, dim] each, and the step's K/V.
  const std::size_t cache_elems = static_cast<std::size_t>(kBlocks) * kBlock * kKVHeads * kDim;
  Dev<Half> k_cache(cache_elems), v_cache(cache_elems);
  const int64_t cs_tok = kKVHeads * kDim, cs_blk = kBlock * cs_tok;
  auto write_kv = [&](const kvplug::Description &d, const std::vector<int> &from) {
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
    kvp_kv_write_args a = KVP_STRUCT_INIT(kvp_kv_write_args);
    a.dtype = KVP_DTYPE_F16;
    a.head_dim = kDim;
    a.num_tokens = static_cast<int32_t>(n);
    a.num_kv_heads = kKVHeads;
    a.num_blocks = kBlocks;
    a.block_size = kBlock;
    a.key = dk.addr();
    a.key_token_stride = a.value_token_stride = cs_tok;
    a.key_head_stride = a.value_head_stride = kDim;
    a.value = dv.addr();
    a.k_cache = k_cache.addr();
    a.v_cache = v_cache.addr();
    a.cache_block_stride = cs_blk;
    a.cache_token_stride = cs_tok;
    a.cache_head_stride = kDim;
    a.slot_mapping = slots.addr();
    kvplug::attn::kv_write(a);
    cuda_check(cudaDeviceSynchronize(), "kv_write");
  };

  // Prefill: each request's new tokens (after its match) attend to its whole prefix.
  kvplug::Description d = m.describe(ids);
  write_kv(d, {matched[0], matched[1]});
  const std::vector<int32_t> qo{0, static_cast<int32_t>(seqs[0].tokens.size()) - matched[0],
                                static_cast<int32_t>(seqs[0].tokens.size() + seqs[1].tokens.size()) - matched[0] - matched[1]};
  const std::vector<int32_t> kv_lens{d.seq_lens[0], d.seq_lens[1]};
  const std::size_t rows = static_cast<std::size_t>(qo[2]);
  Dev<int32_t> d_qo(3), d_kvl(2), table(d.block_table.size()), lens(2);
  d_qo.put(qo);
  d_kvl.put(kv_lens);
  table.put(d.block_table);
  const uint64_t ws_bytes = kvplug::attn::prefill_workspace_size(2, static_cast<int32_t>(rows), kQHeads, kKVHeads, kDim);
  Dev<uint8_t> ws(ws_bytes);
  kvp_prefill_plan_args pa = KVP_STRUCT_INIT(kvp_prefill_plan_args);
  pa.dtype = KVP_DTYPE_F16;
  pa.head_dim = kDim;
  pa.num_q_heads = kQHeads;
  pa.num_kv_heads = kKVHeads;
  pa.batch = 2;
  pa.qo_indptr_host = qo.data();
  pa.kv_lens_host = kv_lens.data();
  pa.qo_indptr = d_qo.addr();
  pa.kv_lens = d_kvl.addr();
  pa.workspace = ws.addr();
  pa.workspace_bytes = ws_bytes;
  const kvp_attn_plan plan = kvplug::attn::prefill_plan(pa);
  std::vector<Half> q = random_q(rows, 11);
  Dev<Half> dq(q.size()), out(q.size());
  dq.put(q);
  cuda_check(cudaMemset(out.p, 0xff, sizeof(Half) * out.n), "poison");  // NaN: an unwritten row fails the check
  kvp_paged_prefill_args pf = KVP_STRUCT_INIT(kvp_paged_prefill_args);
  pf.num_blocks = kBlocks;
  pf.block_size = kBlock;
  pf.max_blocks_per_seq = d.max_blocks;
  pf.q = dq.addr();
  pf.q_token_stride = pf.out_token_stride = kQHeads * kDim;
  pf.q_head_stride = pf.out_head_stride = kDim;
  pf.k_cache = k_cache.addr();
  pf.v_cache = v_cache.addr();
  pf.cache_block_stride = cs_blk;
  pf.cache_token_stride = cs_tok;
  pf.cache_head_stride = kDim;
  pf.block_table = table.addr();
  pf.block_table_stride = d.max_blocks;
  pf.out = out.addr();
  kvplug::attn::paged_prefill(plan, pf);
  cuda_check(cudaDeviceSynchronize(), "paged_prefill");
  std::vector<int> row_seq, row_pos;
  for (int i = 0; i < 2; i++)
    for (int p = matched[static_cast<std::size_t>(i)]; p < static_cast<int>(seqs[static_cast<std::size_t>(i)].tokens.size()); p++) {
      row_seq.push_back(i);
      row_pos.push_back(p);
    }
  const double prefill_err = max_error(seqs, row_seq, row_pos, q, out.get());
  std::printf("prefill: %zu rows (plan route %d), max |kvplug - float64| = %.2e\n", rows, plan.route, prefill_err);
  m.mark_computed();  // the step's forward pass is done: its blocks stay cached

  // Decode: one sampled token each.
  const std::vector<int32_t> next{42, 43}, ones{1, 1};
  pc.grow_tokens(ids, ones, next);
  seqs[0].tokens.push_back(42);
  seqs[1].tokens.push_back(43);
  d = m.describe(ids);
  write_kv(d, {static_cast<int>(seqs[0].tokens.size()) - 1, static_cast<int>(seqs[1].tokens.size()) - 1});
  Dev<int32_t> table2(d.block_table.size());
  table2.put(d.block_table);
  lens.put(d.seq_lens);
  const uint64_t dws_bytes = kvplug::attn::workspace_size(2, kQHeads, kDim);
  Dev<uint8_t> dws(dws_bytes);
  std::vector<Half> q1 = random_q(2, 12);
  Dev<Half> dq1(q1.size()), out1(q1.size());
  dq1.put(q1);
  cuda_check(cudaMemset(out1.p, 0xff, sizeof(Half) * out1.n), "poison");
  kvp_paged_decode_args da = KVP_STRUCT_INIT(kvp_paged_decode_args);
  da.dtype = KVP_DTYPE_F16;
  da.head_dim = kDim;
  da.batch = 2;
  da.num_q_heads = kQHeads;
  da.num_kv_heads = kKVHeads;
  da.num_blocks = kBlocks;
  da.block_size = kBlock;
  da.max_blocks_per_seq = d.max_blocks;
  da.q = dq1.addr();
  da.q_batch_stride = da.out_batch_stride = kQHeads * kDim;
  da.q_head_stride = da.out_head_stride = kDim;
  da.k_cache = k_cache.addr();
  da.v_cache = v_cache.addr();
  da.cache_block_stride = cs_blk;
  da.cache_token_stride = cs_tok;
  da.cache_head_stride = kDim;
  da.block_table = table2.addr();
  da.block_table_stride = d.max_blocks;
  da.seq_lens = lens.addr();
  da.out = out1.addr();
  da.workspace = dws.addr();
  da.workspace_bytes = dws_bytes;
  kvplug::attn::paged_decode(da);
  cuda_check(cudaDeviceSynchronize(), "paged_decode");
  const double decode_err = max_error(seqs, {0, 1}, {static_cast<int>(seqs[0].tokens.size()) - 1, static_cast<int>(seqs[1].tokens.size()) - 1},
                                      q1, out1.get());
  std::printf("decode: lengths %d and %d, max |kvplug - float64| = %.2e\n", d.seq_lens[0], d.seq_lens[1], decode_err);
  m.mark_computed();
  m.remove(ids);
  std::printf("cached after the requests finished: %d blocks\n", pc.stats().cached_blocks);
  const bool ok = prefill_err < 1e-2 && decode_err < 1e-2;
  std::printf("%s\n", ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
} catch (const kvplug::Error &e) {
  std::fprintf(stderr, "%s: %s\n", kvplug::status_string(e.status()), e.what());
  return 1;
}
