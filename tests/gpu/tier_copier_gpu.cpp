// The C++ tier copier (kvplug::TierCopier over per-layer kvp_paged_kv
// descriptors) on a GPU: blocks of a multi-layer paged K/V cache are demoted
// into pinned host slots, their GPU blocks are poisoned, and the slots are
// reloaded into other GPU blocks, every byte checked. The CPU tests
// (tests/cpp/prefix_test.cpp) only see the copier refuse bad inputs; here
// the copies themselves run.
//
// Cases: a 16-bit (f16) cache and an e4m3 cache with one float32 scale per
// (token, kv head) (KVP_KV_SCALE_TOKEN_HEAD), each demoted by the tier copy
// kernel (StoreEngine::kernel) and by the copy engines
// (StoreEngine::copy_engine), over three GPU layouts of the cache:
//   - per-layer: each layer's K, V (and scales) an allocation of its own,
//     [blocks, block_size, kv_heads, head_dim];
//   - one-tensor: every layer's K and V in one allocation,
//     [layers][K, V][blocks, ...], the scales likewise; there a block's
//     chunks sit at one pitch, which the copy engines take as one strided
//     copy a block (the other layouts as batched copies);
//   - interleaved: per layer one allocation [blocks][K, V][...], so a
//     layer's block stride is twice a block's bytes.
// Each case runs three batches through kvplug::CopyBatch:
//   1. demote blocks 1, 4, 7 into slots 0, 2, 5;
//   2. poison blocks 1, 4, 7 and 9, 10, 11, then reload slots 0, 2, 5 into
//      blocks 9, 10, 11;
//   3. one batch that demotes blocks 10 and 3 into slots 7 and 1 and
//      reloads slots 0 and 5 into those same blocks: the header's ordering
//      rule (every demotion reads its block before a reload of the batch
//      writes one) decides what lands where.
// After each batch every byte of the GPU cache (K, V and the scales of all
// blocks, named in the batch or not) and of the host slots is compared with
// a model of the header's layout ("tier copy", Layouts and FP8 caches), and
// after batch 2 each reloaded block with the original block's bytes. With
// the copy engines, a demotion on the legacy default stream must be refused
// with nothing copied.
//
// The output is one line per case, then "ok" when every case passed (exit
// 0); 1 on a mismatch, a failed call or a CUDA error, 2 for a bad command
// line.
//
// Build and run (a machine with a GPU, nvcc, and the library built):
//   nvcc -std=c++17 -Iinclude -Ibindings/cpp tests/gpu/tier_copier_gpu.cpp -o build/tier_copier_gpu -ldl
//   KVPLUG_LIBRARY=$PWD/build/libkvplug.so build/tier_copier_gpu [--seed N]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvplug.hpp"

namespace {

constexpr int kLayers = 3, kKVHeads = 2, kDim = 64, kBlock = 16, kBlocks = 12, kSlots = 8;
constexpr uint8_t kSlotFill = 0xEE;  // the host slots before any copy
constexpr uint8_t kPoison = 0xFF;    // poisoned GPU blocks: NaN in f16, e4m3 and the float32 scales

void cuda_check(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    std::exit(1);
  }
}

// A failure of a cleanup call (a destructor's free or wait), which cannot
// exit in the middle of unwinding: reported here, and main's exit status
// fails the run.
bool g_cleanup_failed = false;
void cuda_cleanup(cudaError_t e, const char *what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    g_cleanup_failed = true;
  }
}

// A device allocation of n bytes, freed with the object.
struct DevBytes {
  void *p = nullptr;
  std::size_t n = 0;
  explicit DevBytes(std::size_t bytes) : n(bytes) { cuda_check(cudaMalloc(&p, n), "cudaMalloc"); }
  ~DevBytes() { cuda_cleanup(cudaFree(p), "cudaFree"); }
  DevBytes(const DevBytes &) = delete;
  DevBytes &operator=(const DevBytes &) = delete;
  uint64_t addr(std::size_t off = 0) const { return reinterpret_cast<uint64_t>(p) + off; }
};

// Pinned, mapped host memory: the engine's own host slots, which the copier
// uses as they are (it registers only memory that is not pinned yet).
struct PinnedBytes {
  uint8_t *p = nullptr;
  std::size_t n = 0;
  explicit PinnedBytes(std::size_t bytes) : n(bytes) {
    void *v = nullptr;
    cuda_check(cudaHostAlloc(&v, n, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
    p = static_cast<uint8_t *>(v);
  }
  ~PinnedBytes() { cuda_cleanup(cudaFreeHost(p), "cudaFreeHost"); }
  PinnedBytes(const PinnedBytes &) = delete;
  PinnedBytes &operator=(const PinnedBytes &) = delete;
};

// Waits for the device when it goes out of scope: declared after a copier,
// it runs before the copier's destructor, which no copy may be in flight
// for (also when a check throws between a run and its synchronisation).
struct SyncOnExit {
  ~SyncOnExit() { cuda_cleanup(cudaDeviceSynchronize(), "cudaDeviceSynchronize before destroying a copier"); }
};

enum class Layout { per_layer, one_tensor, interleaved };

const char *layout_name(Layout l) {
  return l == Layout::per_layer ? "per-layer" : l == Layout::one_tensor ? "one-tensor" : "interleaved";
}

const char *tensor_name(int t) { return t == 0 ? "K" : "V"; }

// An image of every allocation of a cache, one byte vector each.
using Image = std::vector<std::vector<uint8_t>>;

// Where block 0 of one (layer, tensor) array lies: an allocation and a byte
// offset in it.
struct Place {
  int alloc = 0;
  std::size_t off = 0;
};

// A paged K/V cache of kLayers layers in GPU memory, with the model of what
// its bytes should be.
class Cache {
 public:
  Cache(bool e4m3, Layout layout, std::mt19937_64 &rng) : e4m3_(e4m3) {
    const std::size_t c = chunk(), sc = scale_chunk();
    switch (layout) {
      case Layout::per_layer:
        for (int l = 0; l < kLayers; l++)
          for (int t = 0; t < 2; t++) kv_[l][t] = {add("layer " + std::to_string(l) + " " + tensor_name(t), kBlocks * c, false), 0};
        kv_stride_ = c;
        break;
      case Layout::one_tensor: {
        const int a = add("K/V [layers][K, V][blocks]", static_cast<std::size_t>(kLayers) * 2 * kBlocks * c, false);
        for (int l = 0; l < kLayers; l++)
          for (int t = 0; t < 2; t++) kv_[l][t] = {a, static_cast<std::size_t>(l * 2 + t) * kBlocks * c};
        kv_stride_ = c;
        break;
      }
      case Layout::interleaved:
        for (int l = 0; l < kLayers; l++) {
          const int a = add("layer " + std::to_string(l) + " [blocks][K, V]", 2 * kBlocks * c, false);
          for (int t = 0; t < 2; t++) kv_[l][t] = {a, t * c};
        }
        kv_stride_ = 2 * c;
        break;
    }
    // The scales: float32 [blocks, block_size, kv_heads] per layer and
    // tensor (kvp_kv_scale), dense, as kv_write writes them and as the
    // copier reads them; in the layout's kind of allocations.
    if (e4m3_) {
      if (layout == Layout::one_tensor) {
        const int a = add("scales [layers][K, V][blocks]", static_cast<std::size_t>(kLayers) * 2 * kBlocks * sc, true);
        for (int l = 0; l < kLayers; l++)
          for (int t = 0; t < 2; t++) sc_[l][t] = {a, static_cast<std::size_t>(l * 2 + t) * kBlocks * sc};
      } else {
        for (int l = 0; l < kLayers; l++) {
          if (layout == Layout::interleaved) {
            const int a = add("layer " + std::to_string(l) + " scales [K, V][blocks]", 2 * kBlocks * sc, true);
            for (int t = 0; t < 2; t++) sc_[l][t] = {a, t * kBlocks * sc};
          } else {
            for (int t = 0; t < 2; t++)
              sc_[l][t] = {add("layer " + std::to_string(l) + " " + tensor_name(t) + " scales", kBlocks * sc, true), 0};
          }
        }
      }
    }
    fill(rng);
  }

  bool e4m3() const { return e4m3_; }
  std::size_t elem_bytes() const { return e4m3_ ? 1 : 2; }
  // One block of one layer's K (or V), the header's block_bytes.
  std::size_t chunk() const { return static_cast<std::size_t>(kBlock) * kKVHeads * kDim * elem_bytes(); }
  // One block's scales of one layer's K (or V): block_size * num_kv_heads * 4
  // bytes with token-head scales, none for a 16-bit cache.
  std::size_t scale_chunk() const { return e4m3_ ? static_cast<std::size_t>(kBlock) * kKVHeads * 4 : 0; }
  // The slot size the header's layout needs: per layer and tensor (K, V) a
  // block's bytes, and for token-head scales its scales after all of them
  // (include/kvplug.h, "tier copy": num_layers * kv * block_bytes, plus
  // num_layers * kv * block_size * num_kv_heads * 4).
  std::size_t slot_bytes() const { return static_cast<std::size_t>(kLayers) * 2 * (chunk() + scale_chunk()); }
  // Where (layer l, tensor t)'s chunk, or with scales its scale chunk, sits in a slot.
  std::size_t slot_offset(int l, int t, bool scales) const {
    const std::size_t i = static_cast<std::size_t>(l * 2 + t);
    return scales ? static_cast<std::size_t>(kLayers) * 2 * chunk() + i * scale_chunk() : i * chunk();
  }

  // The descriptors of the layers, as the attention calls take them (no
  // block table: the copier reads none).
  std::vector<kvp_paged_kv> descriptors() const {
    std::vector<kvp_paged_kv> out;
    for (int l = 0; l < kLayers; l++) {
      kvp_paged_kv kv = KVP_PAGED_KV_INIT;
      kv.dtype = e4m3_ ? KVP_DTYPE_E4M3 : KVP_DTYPE_F16;
      kv.num_kv_heads = kKVHeads;
      kv.num_blocks = kBlocks;
      kv.block_size = kBlock;
      kv.k_cache = dev_[kv_[l][0].alloc]->addr(kv_[l][0].off);
      kv.v_cache = dev_[kv_[l][1].alloc]->addr(kv_[l][1].off);
      kv.block_stride = static_cast<int64_t>(kv_stride_ / elem_bytes());  // elements of the cache's dtype
      kv.token_stride = kKVHeads * kDim;
      kv.head_stride = kDim;
      kv.head_dim = kDim;
      if (e4m3_) {
        kv.k_scale = dev_[sc_[l][0].alloc]->addr(sc_[l][0].off);
        kv.v_scale = dev_[sc_[l][1].alloc]->addr(sc_[l][1].off);
        kv.scale_kind = KVP_KV_SCALE_TOKEN_HEAD;
      }
      out.push_back(kv);
    }
    return out;
  }

  // Block b's chunk of (layer l, tensor t), or its scales, in an image.
  std::size_t index(int l, int t, int b, bool scales) const {
    const Place &p = scales ? sc_[l][t] : kv_[l][t];
    return p.off + static_cast<std::size_t>(b) * (scales ? scale_chunk() : kv_stride_);
  }
  int alloc_of(int l, int t, bool scales) const { return (scales ? sc_[l][t] : kv_[l][t]).alloc; }
  uint8_t *at(Image &img, int l, int t, int b, bool scales) const { return img[alloc_of(l, t, scales)].data() + index(l, t, b, scales); }
  const uint8_t *at(const Image &img, int l, int t, int b, bool scales) const {
    return img[alloc_of(l, t, scales)].data() + index(l, t, b, scales);
  }
  std::size_t bytes_of(bool scales) const { return scales ? scale_chunk() : chunk(); }
  // The chunk kinds a block has: its K/V bytes, and with scales those.
  int kinds() const { return e4m3_ ? 2 : 1; }

  Image &want() { return want_; }
  const Image &want() const { return want_; }
  const Image &original() const { return orig_; }

  // The device's bytes, every allocation.
  Image download() const {
    Image img;
    for (const auto &d : dev_) {
      img.emplace_back(d->n);
      cuda_check(cudaMemcpy(img.back().data(), d->p, d->n, cudaMemcpyDeviceToHost), "download the cache");
    }
    return img;
  }

  // Poisons block b's K, V and scales of every layer, on the device and in
  // the model.
  void poison(int b, cudaStream_t stream) {
    for (int l = 0; l < kLayers; l++)
      for (int t = 0; t < 2; t++)
        for (int k = 0; k < kinds(); k++) {
          const bool scales = k == 1;
          std::memset(at(want_, l, t, b, scales), kPoison, bytes_of(scales));
          const DevBytes &d = *dev_[alloc_of(l, t, scales)];
          cuda_check(cudaMemsetAsync(static_cast<uint8_t *>(d.p) + index(l, t, b, scales), kPoison, bytes_of(scales), stream),
                     "poison a block");
        }
  }

  // What a byte offset of allocation a holds, in words.
  std::string locate(int a, std::size_t off) const {
    for (int l = 0; l < kLayers; l++)
      for (int t = 0; t < 2; t++)
        for (int k = 0; k < kinds(); k++) {
          const bool scales = k == 1;
          if (alloc_of(l, t, scales) != a) continue;
          for (int b = 0; b < kBlocks; b++) {
            const std::size_t first = index(l, t, b, scales);
            if (off >= first && off < first + bytes_of(scales))
              return "layer " + std::to_string(l) + "'s " + tensor_name(t) + (scales ? " scales" : "") + " of block " +
                     std::to_string(b) + ", byte " + std::to_string(off - first);
          }
        }
    return "byte " + std::to_string(off) + " of " + names_[static_cast<std::size_t>(a)] + ", in no block";
  }
  const std::string &name(int a) const { return names_[static_cast<std::size_t>(a)]; }
  std::size_t total_bytes() const {
    std::size_t n = 0;
    for (const auto &d : dev_) n += d->n;
    return n;
  }

 private:
  int add(const std::string &name, std::size_t bytes, bool scales) {
    dev_.push_back(std::make_unique<DevBytes>(bytes));
    names_.push_back(name);
    is_scales_.push_back(scales);
    return static_cast<int>(dev_.size()) - 1;
  }

  // Random bytes for K and V (a byte copy needs no valid numbers), finite
  // positive float32 values for the scales, uploaded and kept as the model.
  void fill(std::mt19937_64 &rng) {
    want_.clear();
    for (std::size_t a = 0; a < dev_.size(); a++) {
      std::vector<uint8_t> bytes(dev_[a]->n);
      if (is_scales_[a]) {
        for (std::size_t i = 0; i + 4 <= bytes.size(); i += 4) {
          const float mant = 1.0f + static_cast<float>(rng() >> 40) / static_cast<float>(1u << 24);  // [1, 2)
          const float f = std::ldexp(mant, -static_cast<int>(rng() % 20));
          std::memcpy(&bytes[i], &f, 4);
        }
      } else {
        for (std::size_t i = 0; i < bytes.size(); i += 8) {
          const uint64_t x = rng();
          std::memcpy(&bytes[i], &x, std::min<std::size_t>(8, bytes.size() - i));
        }
      }
      cuda_check(cudaMemcpy(dev_[a]->p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "upload the cache");
      want_.push_back(std::move(bytes));
    }
    // cudaMemcpy from pageable memory may return before its DMA lands;
    // the copies run on other streams.
    cuda_check(cudaDeviceSynchronize(), "upload the cache");
    orig_ = want_;
  }

  bool e4m3_;
  std::vector<std::unique_ptr<DevBytes>> dev_;
  std::vector<std::string> names_;
  std::vector<bool> is_scales_;
  Place kv_[kLayers][2], sc_[kLayers][2];
  std::size_t kv_stride_ = 0;  // bytes from a block's K (or V) to the next block's
  Image want_, orig_;
};

kvp_tier_copy op(int32_t block, int32_t slot) {
  kvp_tier_copy o{};
  o.block = block;
  o.slot = slot;
  return o;
}

// The model of one batch (include/kvplug.h, "tier copy"): each demotion
// copies every layer's K and V chunk of its GPU block, and their scales, to
// its host slot at the header's offsets, each reload the other way; the
// demotions before the reloads.
void model(Cache &c, std::vector<uint8_t> &slots, const kvplug::CopyBatch &b) {
  const std::size_t sb = c.slot_bytes();
  for (const kvp_tier_copy &o : b.demote)
    for (int l = 0; l < kLayers; l++)
      for (int t = 0; t < 2; t++)
        for (int k = 0; k < c.kinds(); k++)
          std::memcpy(&slots[static_cast<std::size_t>(o.slot) * sb + c.slot_offset(l, t, k == 1)], c.at(c.want(), l, t, o.block, k == 1),
                      c.bytes_of(k == 1));
  for (const kvp_tier_copy &o : b.reload)
    for (int l = 0; l < kLayers; l++)
      for (int t = 0; t < 2; t++)
        for (int k = 0; k < c.kinds(); k++)
          std::memcpy(c.at(c.want(), l, t, o.block, k == 1), &slots[static_cast<std::size_t>(o.slot) * sb + c.slot_offset(l, t, k == 1)],
                      c.bytes_of(k == 1));
}

std::string hex(uint8_t b) {
  char s[8];
  std::snprintf(s, sizeof s, "0x%02x", b);
  return s;
}

// The first difference between the device cache and the model, and between
// the host slots and their model, in words; empty when every byte matches.
std::string compare(const Cache &c, const uint8_t *host, const std::vector<uint8_t> &slots) {
  const Image got = c.download();
  const Image &want = c.want();
  for (std::size_t a = 0; a < got.size(); a++)
    for (std::size_t i = 0; i < got[a].size(); i++)
      if (got[a][i] != want[a][i])
        return "GPU " + c.locate(static_cast<int>(a), i) + " is " + hex(got[a][i]) + ", want " + hex(want[a][i]) + " (" +
               c.name(static_cast<int>(a)) + ")";
  const std::size_t sb = c.slot_bytes();
  for (std::size_t i = 0; i < slots.size(); i++)
    if (host[i] != slots[i]) {
      const std::size_t s = i / sb, r = i % sb, kv = static_cast<std::size_t>(kLayers) * 2 * c.chunk();
      const bool scales = r >= kv;
      const std::size_t idx = scales ? (r - kv) / c.scale_chunk() : r / c.chunk();
      const std::size_t byte = scales ? (r - kv) % c.scale_chunk() : r % c.chunk();
      return "host slot " + std::to_string(s) + "'s layer " + std::to_string(idx / 2) + " " + tensor_name(static_cast<int>(idx % 2)) +
             (scales ? " scales" : "") + ", byte " + std::to_string(byte) + " is " + hex(host[i]) + ", want " + hex(slots[i]);
    }
  return "";
}

// After the reload: each reloaded block of the device holds exactly the
// bytes its original block had when the cache was filled, in every layer,
// K, V and scales (independent of the model's layout of the slots).
std::string compare_reloaded(const Cache &c, const std::vector<std::pair<int, int>> &moved) {
  const Image got = c.download();
  for (const auto &m : moved)
    for (int l = 0; l < kLayers; l++)
      for (int t = 0; t < 2; t++)
        for (int k = 0; k < c.kinds(); k++) {
          const bool scales = k == 1;
          if (std::memcmp(c.at(got, l, t, m.second, scales), c.at(c.original(), l, t, m.first, scales), c.bytes_of(scales)) != 0)
            return "block " + std::to_string(m.second) + "'s layer " + std::to_string(l) + " " + tensor_name(t) + (scales ? " scales" : "") +
                   " differ from original block " + std::to_string(m.first) + "'s";
        }
  return "";
}

struct Case {
  bool e4m3;
  Layout layout;
  kvplug::StoreEngine engine;
};

std::string case_name(const Case &k) {
  return std::string(k.e4m3 ? "e4m3 token-head" : "f16") + ", " + layout_name(k.layout) + ", " +
         (k.engine == kvplug::StoreEngine::kernel ? "kernel" : "copy-engine");
}

// Runs one case; returns the first fault, empty when it passed.
std::string run_case(const Case &k, uint64_t seed, cudaStream_t stream) {
  std::mt19937_64 rng(seed);
  Cache cache(k.e4m3, k.layout, rng);
  const std::size_t sb = cache.slot_bytes();
  PinnedBytes host(static_cast<std::size_t>(kSlots) * sb);
  std::memset(host.p, kSlotFill, host.n);
  std::vector<uint8_t> slots(host.n, kSlotFill);
  const std::vector<kvp_paged_kv> descs = cache.descriptors();

  // The derived slot size is the layout's least: 16 bytes fewer are refused.
  try {
    kvplug::TierCopier small(descs, host.p, static_cast<int64_t>(sb) - 16, kSlots, k.engine);
    return "slots of " + std::to_string(sb - 16) + " bytes were accepted: the layout needs " + std::to_string(sb);
  } catch (const kvplug::Error &e) {
    if (e.status() != KVP_ERR_INVALID_ARGUMENT)
      return std::string("slots 16 bytes short: ") + kvplug::status_string(e.status()) + ", want KVP_ERR_INVALID_ARGUMENT: " + e.what();
  }

  std::unique_ptr<kvplug::TierCopier> copier;
  try {
    copier = std::make_unique<kvplug::TierCopier>(descs, host.p, static_cast<int64_t>(sb), kSlots, k.engine);
  } catch (const kvplug::Error &e) {
    if (e.status() == KVP_ERR_UNSUPPORTED && k.engine == kvplug::StoreEngine::copy_engine) {
      int driver = 0;
      cuda_check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
      return "stores by the copy engines are unsupported here (the header: they need a CUDA 12.8 or newer driver; "
             "this driver is CUDA " + std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) + "): " + e.what();
    }
    throw;
  }
  const SyncOnExit sync;  // after the copier: waits before it is destroyed
  std::string fault;

  // 1. Demote blocks 1, 4, 7 into slots 0, 2, 5.
  kvplug::CopyBatch demote;
  demote.demote = {op(1, 0), op(4, 2), op(7, 5)};
  if (k.engine == kvplug::StoreEngine::copy_engine) {
    // The header: demotions of a copy-engine copier on the legacy default
    // stream are INVALID_ARGUMENT, checked before anything is enqueued.
    try {
      copier->run(demote);
      cuda_check(cudaDeviceSynchronize(), "a refused run");
      return "demotions by the copy engines on the legacy default stream were accepted";
    } catch (const kvplug::Error &e) {
      if (e.status() != KVP_ERR_INVALID_ARGUMENT)
        return std::string("demotions on the legacy default stream: ") + kvplug::status_string(e.status()) +
               ", want KVP_ERR_INVALID_ARGUMENT: " + e.what();
    }
    cuda_check(cudaDeviceSynchronize(), "after a refused run");
    if (!(fault = compare(cache, host.p, slots)).empty()) return "a refused run copied: " + fault;
    copier->run(demote, stream);
    cuda_check(cudaStreamSynchronize(stream), "demote");
  } else {
    copier->run(demote);  // the kernel runs on the legacy default stream too
    cuda_check(cudaDeviceSynchronize(), "demote");
  }
  model(cache, slots, demote);
  if (!(fault = compare(cache, host.p, slots)).empty()) return "after the demotions: " + fault;

  // 2. The GPU copies are lost (poisoned), and so are the blocks the slots
  // reload into; reload them elsewhere.
  for (const int b : {1, 4, 7, 9, 10, 11}) cache.poison(b, stream);
  cuda_check(cudaStreamSynchronize(stream), "poison");
  kvplug::CopyBatch reload;
  reload.reload = {op(9, 0), op(10, 2), op(11, 5)};
  copier->run(reload, stream);
  cuda_check(cudaStreamSynchronize(stream), "reload");
  model(cache, slots, reload);
  if (!(fault = compare(cache, host.p, slots)).empty()) return "after the reloads: " + fault;
  if (!(fault = compare_reloaded(cache, {{1, 9}, {4, 10}, {7, 11}})).empty()) return "after the reloads: " + fault;

  // 3. One batch whose reloads overwrite the blocks its demotions read
  // (the header's ordering: every demotion reads its block first): slot 7
  // gets block 10 as reloaded in step 2, slot 1 block 3 as filled, and
  // blocks 10 and 3 then hold slots 0 and 5.
  kvplug::CopyBatch mixed;
  mixed.demote = {op(10, 7), op(3, 1)};
  mixed.reload = {op(10, 0), op(3, 5)};
  copier->run(mixed, stream);
  cuda_check(cudaStreamSynchronize(stream), "mixed batch");
  model(cache, slots, mixed);
  if (!(fault = compare(cache, host.p, slots)).empty()) return "after the mixed batch: " + fault;
  return "";
}

void usage(std::FILE *f, const char *prog) {
  std::fprintf(f, "usage: %s [--seed N]\n  --seed N  the host generator's seed of the cache's bytes (default 1)\n", prog);
}

}  // namespace

int main(int argc, char **argv) try {
  uint64_t seed = 1;
  for (int i = 1; i < argc; i++) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage(stdout, argv[0]);
      return 0;
    }
    char *end = nullptr;
    const bool good = arg == "--seed" && i + 1 < argc && argv[i + 1][0] != '\0' && argv[i + 1][0] != '-';
    if (good) seed = std::strtoull(argv[i + 1], &end, 0);
    if (!good || *end != '\0') {
      std::fprintf(stderr, "%s: bad argument %s\n", argv[0], arg.c_str());
      usage(stderr, argv[0]);
      return 2;
    }
    i++;
  }

  int devices = 0;
  cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (devices < 1) {
    std::fprintf(stderr, "no CUDA device: the tier copier cannot be tested\n");
    return 1;
  }
  // The primary context current on this thread before the copiers are
  // created: a copier belongs to the context current at its creation, and
  // its runs need it current.
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  cuda_check(cudaFree(nullptr), "initialise the CUDA context");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int driver = 0;
  cuda_check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  const std::string path = kvplug::load();
  std::printf("kvplug %s from %s; %s, CUDA driver %d.%d; seed %llu\n", kvplug::version_string().c_str(), path.c_str(), prop.name,
              driver / 1000, driver % 1000 / 10, static_cast<unsigned long long>(seed));

  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  int passed = 0, total = 0;
  for (const bool e4m3 : {false, true})
    for (const Layout layout : {Layout::per_layer, Layout::one_tensor, Layout::interleaved})
      for (const kvplug::StoreEngine engine : {kvplug::StoreEngine::kernel, kvplug::StoreEngine::copy_engine}) {
        const Case k{e4m3, layout, engine};
        std::string fault;
        try {
          fault = run_case(k, seed + static_cast<uint64_t>(total), stream);
        } catch (const kvplug::Error &e) {
          fault = std::string(kvplug::status_string(e.status())) + ": " + e.what();
        }
        total++;
        if (fault.empty()) {
          passed++;
          std::printf("%-42s demote, poison and reload elsewhere, mixed batch; every byte of %d layers' K/V%s and the slots: ok\n",
                      case_name(k).c_str(), kLayers, e4m3 ? ", scales" : "");
        } else {
          std::printf("%-42s FAILED: %s\n", case_name(k).c_str(), fault.c_str());
        }
      }
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  std::printf("%d of %d cases passed\n", passed, total);
  if (passed != total || g_cleanup_failed) return 1;
  std::printf("ok\n");
  return 0;
} catch (const kvplug::Error &e) {
  std::fprintf(stderr, "%s: %s\n", kvplug::status_string(e.status()), e.what());
  return 1;
}
