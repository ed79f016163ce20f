// The host KV tier through include/kvplug.h alone, linked against
// libkvplug.so. The test plays the engine: a byte array is the GPU pool's
// K/V, and it memcpys blocks into and out of the host slots as
// kvp_manager_flush_copies' batches ask.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "kvplug.h"

namespace {

constexpr int32_t kBlocks = 8, kBlock = 4, kSlots = 16;
constexpr int64_t kBytes = 48;

kvp_manager *tier_manager(int32_t demote_ahead) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = kBlocks;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = kSlots;
  cfg.host_block_bytes = kBytes;
  cfg.demote_ahead = demote_ahead;
  kvp_manager *m = nullptr;
  EXPECT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << kvp_last_error();
  return m;
}

// The engine's part of a step: flush, copy, complete. Returns the counts.
struct Copies {
  int32_t demoted = 0, reloaded = 0;
  uint64_t ticket = 0;
};

Copies run_copies(kvp_manager *m, std::vector<uint8_t> &gpu) {
  void *base = nullptr;
  int64_t slot_bytes = 0;
  int32_t num_slots = 0;
  EXPECT_EQ(kvp_manager_host_tier_memory(m, &base, &slot_bytes, &num_slots), KVP_OK) << kvp_last_error();
  auto *host = static_cast<uint8_t *>(base);
  std::vector<kvp_tier_copy> demote(kBlocks), reload(kBlocks);
  Copies c;
  EXPECT_EQ(kvp_manager_flush_copies(m, demote.data(), kBlocks, &c.demoted, reload.data(), kBlocks, &c.reloaded,
                                     &c.ticket),
            KVP_OK)
      << kvp_last_error();
  for (int32_t i = 0; i < c.demoted; i++) {
    std::memcpy(host + demote[i].slot * slot_bytes, gpu.data() + demote[i].block * kBytes, kBytes);
  }
  for (int32_t i = 0; i < c.reloaded; i++) {
    std::memcpy(gpu.data() + reload[i].block * kBytes, host + reload[i].slot * slot_bytes, kBytes);
  }
  if (c.ticket != 0) {
    EXPECT_EQ(kvp_manager_complete_copies(m, c.ticket, 0), KVP_OK) << kvp_last_error();
  }
  return c;
}

std::vector<int32_t> table_of(kvp_manager *m, int64_t id) {
  std::vector<int32_t> table(kBlocks), lens(1);
  int32_t n = 0;
  EXPECT_EQ(kvp_manager_describe(m, &id, 1, table.data(), kBlocks, lens.data(), nullptr, 0, &n), KVP_OK)
      << kvp_last_error();
  return table;
}

int32_t admit(kvp_manager *m, int64_t id, const std::vector<int32_t> &prompt) {
  const int64_t offsets[2] = {0, static_cast<int64_t>(prompt.size())};
  int32_t matched = -1, admitted = -1;
  EXPECT_EQ(kvp_manager_admit(m, &id, 1, prompt.data(), offsets, nullptr, &matched, &admitted), KVP_OK)
      << kvp_last_error();
  EXPECT_EQ(admitted, 1);
  return matched;
}

kvp_tier_stats tier_stats(kvp_manager *m) {
  kvp_tier_stats s = KVP_TIER_STATS_INIT;
  EXPECT_EQ(kvp_manager_tier_stats(m, &s), KVP_OK) << kvp_last_error();
  return s;
}

}  // namespace

TEST(HostTier, DemotesAndReloads) {
  kvp_manager *m = tier_manager(kBlocks);
  ASSERT_NE(m, nullptr);
  std::vector<uint8_t> gpu(static_cast<std::size_t>(kBlocks * kBytes), 0);
  std::vector<int32_t> conv(4 * kBlock + 1);  // four full blocks and one token
  std::iota(conv.begin(), conv.end(), 100);
  EXPECT_EQ(admit(m, 1, conv), 0);
  // The step: its flush (nothing to copy), then its forward pass writes the
  // blocks. flush_copies never demotes a block allocated since the previous
  // flush (its K/V is not written yet).
  EXPECT_EQ(run_copies(m, gpu).ticket, 0u);
  auto table = table_of(m, 1);
  for (int i = 0; i < 4; i++) std::memset(gpu.data() + table[i] * kBytes, 0xa0 + i, kBytes);
  ASSERT_EQ(kvp_manager_mark_computed(m), KVP_OK);
  int64_t id = 1;
  ASSERT_EQ(kvp_manager_remove(m, &id, 1), KVP_OK);

  // Arrays too small: BUFFER_TOO_SMALL with the room needed, nothing changed.
  kvp_tier_copy one[1];
  int32_t nd = -1, nr = -1;
  uint64_t ticket = 7;
  EXPECT_EQ(kvp_manager_flush_copies(m, one, 1, &nd, nullptr, 0, &nr, &ticket), KVP_ERR_BUFFER_TOO_SMALL);
  EXPECT_NE(std::string(kvp_last_error()), "");
  EXPECT_EQ(nd, 4);
  EXPECT_EQ(nr, 0);
  EXPECT_EQ(ticket, 7u);
  EXPECT_EQ(tier_stats(m).demotions_queued, 0);

  Copies c = run_copies(m, gpu);
  EXPECT_NE(c.ticket, 0u);
  EXPECT_EQ(c.demoted, 4);
  EXPECT_EQ(c.reloaded, 0);
  EXPECT_EQ(kvp_manager_complete_copies(m, c.ticket, 0), KVP_ERR_NOT_FOUND);

  const int64_t offsets[2] = {0, static_cast<int64_t>(conv.size())};
  kvp_tier_match tm{};
  ASSERT_EQ(kvp_manager_match_tiers(m, 1, conv.data(), offsets, nullptr, &tm), KVP_OK) << kvp_last_error();
  EXPECT_EQ(tm.gpu_tokens, 0);
  EXPECT_EQ(tm.host_tokens, 4 * kBlock);

  // The conversation returns after its K/V left the GPU.
  std::fill(gpu.begin(), gpu.end(), 0);
  EXPECT_EQ(admit(m, 2, conv), 4 * kBlock);
  c = run_copies(m, gpu);
  EXPECT_EQ(c.demoted, 0);
  EXPECT_EQ(c.reloaded, 4);
  table = table_of(m, 2);
  for (int i = 0; i < 4; i++) {
    for (int64_t b = 0; b < kBytes; b++) {
      ASSERT_EQ(gpu[static_cast<std::size_t>(table[i] * kBytes + b)], 0xa0 + i) << "block " << i;
    }
  }
  const kvp_tier_stats s = tier_stats(m);
  EXPECT_EQ(s.demotions_completed, 4);
  EXPECT_EQ(s.reloads_completed, 4);
  EXPECT_EQ(s.host_hit_tokens, 4 * kBlock);
  EXPECT_EQ(s.host_resident, 4);
  EXPECT_EQ(s.host_pinned, 0);
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(kvp_manager_check(m), KVP_OK) << kvp_last_error();
  kvp_manager_destroy(m);
}

TEST(HostTier, BadInputs) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = kBlocks;
  cfg.block_size = kBlock;
  cfg.host_tier_slots = kSlots;
  cfg.host_block_bytes = kBytes;
  kvp_manager *m = nullptr;
  EXPECT_EQ(kvp_manager_create(&cfg, &m), KVP_ERR_INVALID_ARGUMENT);  // no prefix cache
  EXPECT_EQ(m, nullptr);
  cfg.enable_prefix_cache = 1;
  cfg.host_block_bytes = 0;
  EXPECT_EQ(kvp_manager_create(&cfg, &m), KVP_ERR_INVALID_ARGUMENT);
  cfg.host_block_bytes = kBytes;
  cfg.demote_evicted = 2;  // 0 or 1
  EXPECT_EQ(kvp_manager_create(&cfg, &m), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);

  m = tier_manager(2);
  ASSERT_NE(m, nullptr);
  int32_t nd = 0, nr = 0;
  uint64_t ticket = 0;
  EXPECT_EQ(kvp_manager_flush_copies(m, nullptr, 0, nullptr, nullptr, 0, &nr, &ticket), KVP_ERR_NULL_POINTER);
  EXPECT_EQ(kvp_manager_flush_copies(m, nullptr, 2, &nd, nullptr, 0, &nr, &ticket), KVP_ERR_NULL_POINTER);
  EXPECT_EQ(kvp_manager_flush_copies(m, nullptr, -1, &nd, nullptr, 0, &nr, &ticket), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvp_manager_complete_copies(m, 42, 0), KVP_ERR_NOT_FOUND);
  EXPECT_EQ(kvp_manager_tier_stats(m, nullptr), KVP_ERR_NULL_POINTER);
  kvp_tier_stats s = KVP_TIER_STATS_INIT;
  s.struct_size = 0;
  EXPECT_EQ(kvp_manager_tier_stats(m, &s), KVP_ERR_STRUCT_SIZE);
  EXPECT_EQ(kvp_manager_match_tiers(m, 1, nullptr, nullptr, nullptr, nullptr), KVP_ERR_NULL_POINTER);
  kvp_manager_destroy(m);

  // A manager without a host tier refuses the tier's calls.
  kvp_manager_config plain = KVP_MANAGER_CONFIG_INIT;
  plain.num_blocks = kBlocks;
  ASSERT_EQ(kvp_manager_create(&plain, &m), KVP_OK);
  void *base = nullptr;
  EXPECT_EQ(kvp_manager_host_tier_memory(m, &base, nullptr, nullptr), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvp_manager_flush_copies(m, nullptr, 0, &nd, nullptr, 0, &nr, &ticket), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvp_manager_complete_copies(m, 1, 0), KVP_ERR_INVALID_ARGUMENT);
  kvp_manager_destroy(m);
}

// The shared tier's config through the header: with the server down (port
// 1 refuses at once) admissions go on, computing the prefix, and the
// failure is counted; bad fields are refused with nothing created.
TEST(SharedTier, ServerDownAndBadInputs) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = kBlocks;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = kSlots;
  cfg.host_block_bytes = kBytes;
  cfg.demote_ahead = kBlocks;
  const std::string addr = "127.0.0.1:1", ns = "cpp-test.bs4";
  cfg.shared_tier_addr = addr.c_str();
  cfg.shared_tier_namespace = ns.c_str();
  cfg.shared_tier_timeout_ms = 100;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << kvp_last_error();
  std::vector<int32_t> conv(4 * kBlock + 1);
  std::iota(conv.begin(), conv.end(), 100);
  EXPECT_EQ(admit(m, 1, conv), 0);
  kvp_tier_stats s = KVP_TIER_STATS_INIT;
  ASSERT_EQ(kvp_manager_tier_stats(m, &s), KVP_OK);
  EXPECT_EQ(s.shared_errors + s.shared_timeouts, 1);
  EXPECT_EQ(s.shared_misses, 4);
  EXPECT_EQ(s.shared_available, 0);
  kvp_manager_destroy(m);

  m = nullptr;
  kvp_manager_config bad = cfg;
  bad.shared_tier_namespace = "meta-llama/Llama-3";
  EXPECT_EQ(kvp_manager_create(&bad, &m), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvp_last_error()).find("namespace"), std::string::npos) << kvp_last_error();
  bad = cfg;
  bad.shared_tier_addr = nullptr;  // a namespace and a timeout without an address
  EXPECT_EQ(kvp_manager_create(&bad, &m), KVP_ERR_INVALID_ARGUMENT);
  bad = cfg;
  bad.host_tier_slots = 0;
  bad.host_block_bytes = 0;
  bad.demote_ahead = 0;
  EXPECT_EQ(kvp_manager_create(&bad, &m), KVP_ERR_INVALID_ARGUMENT);  // no host tier below it
  bad = cfg;
  bad.shared_tier_timeout_ms = 60001;
  EXPECT_EQ(kvp_manager_create(&bad, &m), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
}
