// Tests of the C API through include/kvplug.h alone, linked against
// libkvplug.so. Every bad-input case of the manager's functions is named:
// each must return its own status with a message and change nothing (the
// stats, the block tables, lengths and slots, and the caller's buffers).
#include <gtest/gtest.h>

#include <cstddef>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvplug.h"

namespace {

constexpr int32_t kHuge = (1 << 20) + 1;  // one past the largest batch
constexpr int32_t kPoison = 0x7eadbeef;

// Everything a caller can observe of a manager's state.
struct Snapshot {
  kvp_manager_stats stats;
  std::vector<int32_t> table, lens, slots;
  int32_t num_slots = 0;

  bool operator==(const Snapshot &o) const {
    const kvp_manager_stats &a = stats, &b = o.stats;
    return a.num_blocks == b.num_blocks && a.block_size == b.block_size && a.free_blocks == b.free_blocks &&
           a.used_blocks == b.used_blocks && a.peak_used_blocks == b.peak_used_blocks &&
           a.cached_blocks == b.cached_blocks && a.shared_blocks == b.shared_blocks && a.num_seqs == b.num_seqs &&
           a.num_tokens == b.num_tokens && a.allocated_slots == b.allocated_slots &&
           a.internal_waste == b.internal_waste && a.fragmentation == b.fragmentation && table == o.table &&
           lens == o.lens && slots == o.slots && num_slots == o.num_slots;
  }
};

std::ostream &operator<<(std::ostream &os, const Snapshot &s) {
  os << "{free " << s.stats.free_blocks << ", used " << s.stats.used_blocks << ", seqs " << s.stats.num_seqs
     << ", tokens " << s.stats.num_tokens << ", slots " << s.num_slots << ", lens [";
  for (int32_t l : s.lens) os << l << ' ';
  return os << "]}";
}

std::string last_error() { return kvp_last_error(); }

// A manager of 16 blocks of 4 tokens with three live sequences:
// 1 (10 tokens: 3 blocks, the last partial), 2 (4 tokens: 1 full block),
// 3 (1 token). 11 blocks are free.
class Manager : public ::testing::Test {
 protected:
  static constexpr int32_t kMaxBlocks = 16;

  void SetUp() override {
    kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
    cfg.num_blocks = 16;
    cfg.block_size = 4;
    ASSERT_EQ(kvp_manager_create(&cfg, &m_), KVP_OK) << last_error();
    ASSERT_EQ(kvp_manager_add(m_, 1, 10), KVP_OK) << last_error();
    ASSERT_EQ(kvp_manager_add(m_, 2, 4), KVP_OK) << last_error();
    ASSERT_EQ(kvp_manager_add(m_, 3, 1), KVP_OK) << last_error();
  }
  void TearDown() override { kvp_manager_destroy(m_); }

  Snapshot snap() {
    Snapshot s;
    s.stats = kvp_manager_stats{};
    s.stats.struct_size = sizeof s.stats;
    EXPECT_EQ(kvp_manager_stats_get(m_, &s.stats), KVP_OK) << last_error();
    const int32_t n = static_cast<int32_t>(live_.size());
    s.table.assign(live_.size() * kMaxBlocks, kPoison);
    s.lens.assign(live_.size(), kPoison);
    s.slots.assign(64, kPoison);
    EXPECT_EQ(kvp_manager_describe(m_, live_.data(), n, s.table.data(), kMaxBlocks, s.lens.data(), s.slots.data(),
                                   64, &s.num_slots),
              KVP_OK)
        << last_error();
    EXPECT_EQ(kvp_manager_check(m_), KVP_OK) << last_error();
    return s;
  }

  kvp_manager *m_ = nullptr;
  std::vector<int64_t> live_{1, 2, 3};
};

// A call that must fail with `code`, a message containing `needle`, and no
// change to the manager.
#define EXPECT_REJECTED(call, code, needle)                                              \
  do {                                                                                   \
    const Snapshot before_ = snap();                                                     \
    const kvp_status st_ = (call);                                                       \
    const std::string msg_ = last_error();                                               \
    EXPECT_EQ(st_, code) << kvp_status_string(st_) << ": " << msg_;                      \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "message: \"" << msg_ << "\"";    \
    EXPECT_EQ(snap(), before_) << "the failed call changed the manager";                 \
  } while (0)

// ---- creation ---------------------------------------------------------------

TEST(Create, Succeeds) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << last_error();
  ASSERT_NE(m, nullptr);
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  ASSERT_EQ(kvp_manager_stats_get(m, &s), KVP_OK);
  EXPECT_EQ(s.num_blocks, 8);
  EXPECT_EQ(s.block_size, 16);  // the default
  EXPECT_EQ(s.free_blocks, 8);
  kvp_manager_destroy(m);
}

void expect_create_fails(const kvp_manager_config *cfg, bool null_out, kvp_status code, const char *needle) {
  kvp_manager *m = reinterpret_cast<kvp_manager *>(0x1);  // must stay untouched
  kvp_status st = kvp_manager_create(cfg, null_out ? nullptr : &m);
  EXPECT_EQ(st, code) << kvp_status_string(st) << ": " << last_error();
  EXPECT_NE(last_error().find(needle), std::string::npos) << last_error();
  EXPECT_EQ(m, reinterpret_cast<kvp_manager *>(0x1));
}

kvp_manager_config config(int32_t num_blocks, int32_t block_size) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = num_blocks;
  cfg.block_size = block_size;
  return cfg;
}

TEST(Create, NullConfig) { expect_create_fails(nullptr, false, KVP_ERR_NULL_POINTER, "NULL"); }
TEST(Create, NullOut) {
  kvp_manager_config cfg = config(8, 16);
  expect_create_fails(&cfg, true, KVP_ERR_NULL_POINTER, "NULL");
}
TEST(Create, StructSizeZero) {
  kvp_manager_config cfg = config(8, 16);
  cfg.struct_size = 0;
  expect_create_fails(&cfg, false, KVP_ERR_STRUCT_SIZE, "struct_size is 0");
}
TEST(Create, StructSizeSmaller) {
  kvp_manager_config cfg = config(8, 16);
  cfg.struct_size = offsetof(kvp_manager_config, block_size);  // short of block_size
  expect_create_fails(&cfg, false, KVP_ERR_STRUCT_SIZE, "struct_size");
}
TEST(Create, StructSizeOfTheFirstVersion) {
  // A host built when the struct ended at block_size: the later fields
  // take their defaults (no prefix cache), whatever lies past its end.
  kvp_manager_config cfg = config(8, 4);
  cfg.struct_size = offsetof(kvp_manager_config, block_size) + sizeof cfg.block_size;
  cfg.enable_prefix_cache = 1;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << kvp_last_error();
  uint64_t pin = 0;
  const int32_t toks[4] = {1, 2, 3, 4};
  EXPECT_EQ(kvp_manager_pin(m, toks, 4, nullptr, &pin, nullptr), KVP_ERR_INVALID_ARGUMENT);
  kvp_manager_destroy(m);
}
TEST(Create, StructSizeOfANewerHeader) {
  // A newer header's struct: accepted while its unknown fields are 0, refused
  // once one is set (it would be ignored).
  struct {
    kvp_manager_config cfg;
    int64_t newer_field;
  } big = {config(8, 16), 0};
  big.cfg.struct_size = sizeof big;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&big.cfg, &m), KVP_OK) << kvp_last_error();
  kvp_manager_destroy(m);
  big.newer_field = 1;
  expect_create_fails(&big.cfg, false, KVP_ERR_STRUCT_SIZE, "newer kvplug.h");
}
TEST(Create, ZeroBlocks) {
  kvp_manager_config cfg = config(0, 16);
  expect_create_fails(&cfg, false, KVP_ERR_INVALID_ARGUMENT, "0");
}
TEST(Create, NegativeBlocks) {
  kvp_manager_config cfg = config(-5, 16);
  expect_create_fails(&cfg, false, KVP_ERR_INVALID_ARGUMENT, "-5");
}
TEST(Create, ZeroBlockSizeIsTheDefault) {
  kvp_manager_config cfg = config(8, 0);
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK) << kvp_last_error();
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  ASSERT_EQ(kvp_manager_stats_get(m, &s), KVP_OK);
  EXPECT_EQ(s.block_size, 16);
  kvp_manager_destroy(m);
}
TEST(Create, NegativeBlockSize) {
  kvp_manager_config cfg = config(8, -1);
  expect_create_fails(&cfg, false, KVP_ERR_INVALID_ARGUMENT, "-1");
}
TEST(Create, HugeBlockSize) {
  kvp_manager_config cfg = config(8, (1 << 16) + 1);
  expect_create_fails(&cfg, false, KVP_ERR_INVALID_ARGUMENT, "65537");
}
TEST(Create, SlotsPastInt32) {
  kvp_manager_config cfg = config(1 << 16, 1 << 16);
  expect_create_fails(&cfg, false, KVP_ERR_INVALID_ARGUMENT, "2^31");
}

TEST(Create, DestroyNullIsNoOp) { kvp_manager_destroy(nullptr); }

// ---- the normal path ----------------------------------------------------------

TEST_F(Manager, StepWritesTablesLensAndSlots) {
  const int64_t ids[3] = {1, 2, 3};
  const int32_t counts[3] = {1, 1, 3};
  ASSERT_EQ(kvp_manager_grow(m_, ids, counts, 3), KVP_OK) << last_error();
  std::vector<int32_t> table(3 * kMaxBlocks, kPoison), lens(3), slots(8, kPoison);
  int32_t num = -1;
  ASSERT_EQ(kvp_manager_describe(m_, ids, 3, table.data(), kMaxBlocks, lens.data(), slots.data(), 8, &num), KVP_OK)
      << last_error();
  EXPECT_EQ(lens, (std::vector<int32_t>{11, 5, 4}));
  EXPECT_EQ(num, 5);
  // Row i holds ceil(len / 4) blocks, then -1.
  const int used[3] = {3, 2, 1};
  for (int i = 0; i < 3; i++) {
    for (int j = 0; j < kMaxBlocks; j++) {
      if (j < used[i]) {
        EXPECT_GE(table[i * kMaxBlocks + j], 0);
      } else {
        EXPECT_EQ(table[i * kMaxBlocks + j], -1);
      }
    }
  }
  // Slot of token p of sequence i = block[p / 4] * 4 + p % 4.
  auto slot = [&](int i, int p) { return table[i * kMaxBlocks + p / 4] * 4 + p % 4; };
  EXPECT_EQ(slots[0], slot(0, 10));
  EXPECT_EQ(slots[1], slot(1, 4));
  EXPECT_EQ(slots[2], slot(2, 1));
  EXPECT_EQ(slots[3], slot(2, 2));
  EXPECT_EQ(slots[4], slot(2, 3));
  EXPECT_EQ(slots[5], kPoison);
  EXPECT_EQ(kvp_manager_check(m_), KVP_OK) << last_error();
}

TEST_F(Manager, DescribeCountsSlotsWithoutBuffers) {
  int32_t num = -1;
  ASSERT_EQ(kvp_manager_describe(m_, live_.data(), 3, nullptr, 0, nullptr, nullptr, 0, &num), KVP_OK);
  EXPECT_EQ(num, 15);  // the prompts are the new tokens
}

TEST_F(Manager, ForkSharesFullBlocksAndCopiesThePartialOne) {
  const int64_t children[2] = {10, 11};
  kvp_block_copy copies[2];
  int32_t n = -1;
  ASSERT_EQ(kvp_manager_fork(m_, 1, children, 2, copies, 2, &n), KVP_OK) << last_error();
  ASSERT_EQ(n, 2);
  const int64_t ids[3] = {1, 10, 11};
  int32_t table[3][kMaxBlocks];
  int32_t lens[3], num = 0;
  ASSERT_EQ(kvp_manager_describe(m_, ids, 3, &table[0][0], kMaxBlocks, lens, nullptr, 0, &num), KVP_OK);
  for (int c = 1; c < 3; c++) {
    EXPECT_EQ(lens[c], 10);
    EXPECT_EQ(table[c][0], table[0][0]);
    EXPECT_EQ(table[c][1], table[0][1]);
    EXPECT_EQ(copies[c - 1].src, table[0][2]);
    EXPECT_EQ(copies[c - 1].dst, table[c][2]);
    EXPECT_NE(table[c][2], table[0][2]);
  }
  EXPECT_EQ(num, 10);  // the parent's prompt; children have no new tokens
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  ASSERT_EQ(kvp_manager_stats_get(m_, &s), KVP_OK);
  EXPECT_EQ(s.shared_blocks, 2);
  EXPECT_EQ(s.num_seqs, 5);
  EXPECT_EQ(kvp_manager_check(m_), KVP_OK) << last_error();
}

TEST_F(Manager, StatsFillOnlyTheCallersSize) {
  // A caller built against an older, shorter kvp_manager_stats.
  unsigned char buf[sizeof(kvp_manager_stats) + 16];
  std::memset(buf, 0xAB, sizeof buf);
  kvp_manager_stats *s = reinterpret_cast<kvp_manager_stats *>(buf);
  const size_t old_size = offsetof(kvp_manager_stats, free_blocks);
  s->struct_size = old_size;
  ASSERT_EQ(kvp_manager_stats_get(m_, s), KVP_OK) << last_error();
  EXPECT_EQ(s->num_blocks, 16);
  EXPECT_EQ(s->block_size, 4);
  for (size_t i = old_size; i < sizeof buf; i++) ASSERT_EQ(buf[i], 0xAB) << "byte " << i << " written";
}

TEST_F(Manager, StatsAccountFragmentation) {
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  ASSERT_EQ(kvp_manager_stats_get(m_, &s), KVP_OK);
  EXPECT_EQ(s.used_blocks, 5);
  EXPECT_EQ(s.free_blocks, 11);
  EXPECT_EQ(s.num_tokens, 15);
  EXPECT_EQ(s.allocated_slots, 20);
  EXPECT_EQ(s.internal_waste, 5);  // 2 in sequence 1's last block, 3 in sequence 3's
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.25);
}

// ---- NULL and foreign handles -------------------------------------------------

class Handles : public Manager {
 protected:
  // A destroyed handle, and a pointer that never was a handle.
  kvp_manager *destroyed() {
    kvp_manager_config cfg = config(4, 4);
    kvp_manager *h = nullptr;
    EXPECT_EQ(kvp_manager_create(&cfg, &h), KVP_OK);
    kvp_manager_destroy(h);
    return h;
  }
  kvp_manager *foreign() { return reinterpret_cast<kvp_manager *>(&dummy_); }
  int64_t dummy_ = 0;
};

TEST_F(Handles, AddNullHandle) { EXPECT_REJECTED(kvp_manager_add(nullptr, 9, 4), KVP_ERR_INVALID_HANDLE, "NULL"); }
TEST_F(Handles, AddDestroyedHandle) {
  kvp_manager *h = destroyed();
  EXPECT_REJECTED(kvp_manager_add(h, 9, 4), KVP_ERR_INVALID_HANDLE, "not live");
}
TEST_F(Handles, AddForeignPointer) {
  EXPECT_REJECTED(kvp_manager_add(foreign(), 9, 4), KVP_ERR_INVALID_HANDLE, "not live");
}
TEST_F(Handles, GrowNullHandle) {
  const int32_t one = 1;
  EXPECT_REJECTED(kvp_manager_grow(nullptr, live_.data(), &one, 1), KVP_ERR_INVALID_HANDLE, "NULL");
}
TEST_F(Handles, ForkNullHandle) {
  const int64_t child = 9;
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(nullptr, 1, &child, 1, &c, 1, &n), KVP_ERR_INVALID_HANDLE, "NULL");
}
TEST_F(Handles, RemoveNullHandle) {
  EXPECT_REJECTED(kvp_manager_remove(nullptr, live_.data(), 1), KVP_ERR_INVALID_HANDLE, "NULL");
}
TEST_F(Handles, RemoveDestroyedHandle) {
  kvp_manager *h = destroyed();
  EXPECT_REJECTED(kvp_manager_remove(h, live_.data(), 1), KVP_ERR_INVALID_HANDLE, "not live");
}
TEST_F(Handles, DescribeNullHandle) {
  int32_t num = 0;
  EXPECT_REJECTED(kvp_manager_describe(nullptr, live_.data(), 1, nullptr, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_INVALID_HANDLE, "NULL");
}
TEST_F(Handles, StatsNullHandle) {
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  EXPECT_REJECTED(kvp_manager_stats_get(nullptr, &s), KVP_ERR_INVALID_HANDLE, "NULL");
}
TEST_F(Handles, CheckNullHandle) { EXPECT_REJECTED(kvp_manager_check(nullptr), KVP_ERR_INVALID_HANDLE, "NULL"); }
TEST_F(Handles, CheckDestroyedHandle) {
  kvp_manager *h = destroyed();
  EXPECT_REJECTED(kvp_manager_check(h), KVP_ERR_INVALID_HANDLE, "not live");
}
TEST_F(Handles, DestroyTwiceIsHarmless) {
  kvp_manager *h = destroyed();
  kvp_manager_destroy(h);  // a stale handle: ignored
  EXPECT_EQ(kvp_manager_check(m_), KVP_OK);
}

// ---- NULL buffers ------------------------------------------------------------------

TEST_F(Manager, GrowNullSeqIds) {
  const int32_t one = 1;
  EXPECT_REJECTED(kvp_manager_grow(m_, nullptr, &one, 1), KVP_ERR_NULL_POINTER, "seq_ids");
}
TEST_F(Manager, GrowNullCounts) {
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), nullptr, 1), KVP_ERR_NULL_POINTER, "num_tokens");
}
TEST_F(Manager, RemoveNullSeqIds) {
  EXPECT_REJECTED(kvp_manager_remove(m_, nullptr, 1), KVP_ERR_NULL_POINTER, "seq_ids");
}
TEST_F(Manager, ForkNullChildren) {
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, nullptr, 1, &c, 1, &n), KVP_ERR_NULL_POINTER, "children");
}
TEST_F(Manager, ForkNullNumCopies) {
  const int64_t child = 9;
  kvp_block_copy c;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, &child, 1, &c, 1, nullptr), KVP_ERR_NULL_POINTER, "num_copies");
}
TEST_F(Manager, ForkNullCopiesWithCapacity) {
  const int64_t child = 9;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, &child, 1, nullptr, 1, &n), KVP_ERR_NULL_POINTER, "copies");
}
TEST_F(Manager, DescribeNullSeqIds) {
  int32_t num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, nullptr, 1, nullptr, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_NULL_POINTER, "seq_ids");
}
TEST_F(Manager, DescribeNullNumSlots) {
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 1, nullptr, 0, nullptr, nullptr, 0, nullptr),
                  KVP_ERR_NULL_POINTER, "num_slots");
}
TEST_F(Manager, StatsNullOut) { EXPECT_REJECTED(kvp_manager_stats_get(m_, nullptr), KVP_ERR_NULL_POINTER, "out"); }

// ---- struct sizes -------------------------------------------------------------------

TEST_F(Manager, StatsStructSizeZero) {
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  s.struct_size = 0;
  EXPECT_REJECTED(kvp_manager_stats_get(m_, &s), KVP_ERR_STRUCT_SIZE, "struct_size is 0");
  EXPECT_EQ(s.num_blocks, 0) << "a rejected call wrote the caller's struct";
}
TEST_F(Manager, StatsStructSizeTooSmallForAField) {
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  s.struct_size = sizeof(size_t) + 2;
  EXPECT_REJECTED(kvp_manager_stats_get(m_, &s), KVP_ERR_STRUCT_SIZE, "struct_size");
}

// ---- counts: zero, negative, huge -------------------------------------------------

TEST_F(Manager, AddZeroPromptLen) { EXPECT_REJECTED(kvp_manager_add(m_, 9, 0), KVP_ERR_INVALID_ARGUMENT, "got 0"); }
TEST_F(Manager, AddNegativePromptLen) {
  EXPECT_REJECTED(kvp_manager_add(m_, 9, -3), KVP_ERR_INVALID_ARGUMENT, "got -3");
}
TEST_F(Manager, AddHugePromptLen) {
  EXPECT_REJECTED(kvp_manager_add(m_, 9, (1 << 30) + 1), KVP_ERR_INVALID_ARGUMENT, "1073741825");
}
TEST_F(Manager, GrowZeroBatch) {
  const int32_t one = 1;
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), &one, 0), KVP_ERR_INVALID_ARGUMENT, "got 0");
}
TEST_F(Manager, GrowNegativeBatch) {
  const int32_t one = 1;
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), &one, -1), KVP_ERR_INVALID_ARGUMENT, "got -1");
}
TEST_F(Manager, GrowHugeBatch) {
  const int32_t one = 1;  // never read: the count is refused first
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), &one, kHuge), KVP_ERR_INVALID_ARGUMENT, "1048577");
}
TEST_F(Manager, GrowNegativeTokenCount) {
  const int32_t counts[3] = {1, -2, 1};
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), counts, 3), KVP_ERR_INVALID_ARGUMENT, "got -2");
}
TEST_F(Manager, GrowHugeTokenCount) {
  const int32_t counts[3] = {1, 1, (1 << 24) + 1};
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), counts, 3), KVP_ERR_INVALID_ARGUMENT, "16777217");
}
TEST_F(Manager, RemoveZeroBatch) {
  EXPECT_REJECTED(kvp_manager_remove(m_, live_.data(), 0), KVP_ERR_INVALID_ARGUMENT, "got 0");
}
TEST_F(Manager, RemoveNegativeBatch) {
  EXPECT_REJECTED(kvp_manager_remove(m_, live_.data(), -7), KVP_ERR_INVALID_ARGUMENT, "got -7");
}
TEST_F(Manager, RemoveHugeBatch) {
  EXPECT_REJECTED(kvp_manager_remove(m_, live_.data(), kHuge), KVP_ERR_INVALID_ARGUMENT, "1048577");
}
TEST_F(Manager, ForkZeroChildren) {
  const int64_t child = 9;
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, &child, 0, &c, 1, &n), KVP_ERR_INVALID_ARGUMENT, "got 0");
}
TEST_F(Manager, ForkHugeChildren) {
  const int64_t child = 9;
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, &child, kHuge, &c, 1, &n), KVP_ERR_INVALID_ARGUMENT, "1048577");
}
TEST_F(Manager, ForkNegativeMaxCopies) {
  const int64_t child = 9;
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, &child, 1, &c, -1, &n), KVP_ERR_INVALID_ARGUMENT, "-1");
}
TEST_F(Manager, DescribeZeroBatch) {
  int32_t num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 0, nullptr, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_INVALID_ARGUMENT, "got 0");
}
TEST_F(Manager, DescribeNegativeBatch) {
  int32_t num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), -2, nullptr, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_INVALID_ARGUMENT, "got -2");
}
TEST_F(Manager, DescribeHugeBatch) {
  int32_t num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), kHuge, nullptr, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_INVALID_ARGUMENT, "1048577");
}
TEST_F(Manager, DescribeZeroMaxBlocksWithTable) {
  int32_t table[8], num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 1, table, 0, nullptr, nullptr, 0, &num),
                  KVP_ERR_INVALID_ARGUMENT, "got 0");
}
TEST_F(Manager, DescribeNegativeSlotCapacity) {
  int32_t slots[4], num = 0;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 1, nullptr, 0, nullptr, slots, -1, &num),
                  KVP_ERR_INVALID_ARGUMENT, "got -1");
}

// ---- unknown and duplicate sequences -------------------------------------------------

TEST_F(Manager, GrowUnknownSequence) {
  const int64_t ids[2] = {1, 99};
  const int32_t counts[2] = {1, 1};
  EXPECT_REJECTED(kvp_manager_grow(m_, ids, counts, 2), KVP_ERR_UNKNOWN_SEQUENCE, "99");
}
TEST_F(Manager, RemoveUnknownSequence) {
  const int64_t ids[2] = {2, 99};
  EXPECT_REJECTED(kvp_manager_remove(m_, ids, 2), KVP_ERR_UNKNOWN_SEQUENCE, "99");
}
TEST_F(Manager, DoubleRemove) {
  const int64_t three = 3;
  ASSERT_EQ(kvp_manager_remove(m_, &three, 1), KVP_OK);
  live_ = {1, 2};
  EXPECT_REJECTED(kvp_manager_remove(m_, &three, 1), KVP_ERR_UNKNOWN_SEQUENCE, "3");
}
TEST_F(Manager, DescribeUnknownSequence) {
  const int64_t ids[2] = {1, 99};
  int32_t num = 0, lens[2] = {kPoison, kPoison};
  EXPECT_REJECTED(kvp_manager_describe(m_, ids, 2, nullptr, 0, lens, nullptr, 0, &num), KVP_ERR_UNKNOWN_SEQUENCE,
                  "99");
  EXPECT_EQ(lens[0], kPoison) << "a failed describe wrote seq_lens";
}
TEST_F(Manager, ForkUnknownParent) {
  const int64_t child = 9;
  kvp_block_copy c;
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 99, &child, 1, &c, 1, &n), KVP_ERR_UNKNOWN_SEQUENCE, "99");
}
TEST_F(Manager, AddLiveId) { EXPECT_REJECTED(kvp_manager_add(m_, 2, 4), KVP_ERR_DUPLICATE_SEQUENCE, "2"); }
TEST_F(Manager, GrowRepeatedId) {
  const int64_t ids[3] = {1, 2, 1};
  const int32_t counts[3] = {1, 1, 1};
  EXPECT_REJECTED(kvp_manager_grow(m_, ids, counts, 3), KVP_ERR_DUPLICATE_SEQUENCE, "1");
}
TEST_F(Manager, RemoveRepeatedId) {
  const int64_t ids[2] = {3, 3};
  EXPECT_REJECTED(kvp_manager_remove(m_, ids, 2), KVP_ERR_DUPLICATE_SEQUENCE, "3");
}
TEST_F(Manager, ForkChildLive) {
  const int64_t children[2] = {9, 2};
  kvp_block_copy c[2];
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, children, 2, c, 2, &n), KVP_ERR_DUPLICATE_SEQUENCE, "2");
}
TEST_F(Manager, ForkChildRepeated) {
  const int64_t children[2] = {9, 9};
  kvp_block_copy c[2];
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, children, 2, c, 2, &n), KVP_ERR_DUPLICATE_SEQUENCE, "9");
}

// ---- too few blocks, too small buffers -----------------------------------------------

TEST_F(Manager, AddTooFewBlocks) {
  EXPECT_REJECTED(kvp_manager_add(m_, 9, 45), KVP_ERR_OUT_OF_BLOCKS, "11 are free");
}
TEST_F(Manager, GrowTooFewBlocksForTheBatch) {
  // Each alone fits in the 11 free blocks; together they do not.
  const int32_t counts[3] = {2 + 24, 24, 1};
  EXPECT_REJECTED(kvp_manager_grow(m_, live_.data(), counts, 3), KVP_ERR_OUT_OF_BLOCKS, "11 are free");
}
TEST_F(Manager, ForkTooFewBlocksForCopies) {
  ASSERT_EQ(kvp_manager_add(m_, 4, 40), KVP_OK);  // takes 10 of the 11 free blocks
  live_ = {1, 2, 3, 4};
  const int64_t children[2] = {9, 10};
  kvp_block_copy c[2];
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, children, 2, c, 2, &n), KVP_ERR_OUT_OF_BLOCKS, "1 are free");
}
TEST_F(Manager, ForkCopiesBufferTooSmall) {
  const int64_t children[2] = {9, 10};
  kvp_block_copy c[1];
  int32_t n = 0;
  EXPECT_REJECTED(kvp_manager_fork(m_, 1, children, 2, c, 1, &n), KVP_ERR_BUFFER_TOO_SMALL, "holds 1");
}
TEST_F(Manager, DescribeMaxBlocksTooSmall) {
  int32_t table[3 * 2], num = 0;
  for (int32_t &t : table) t = kPoison;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 3, table, 2, nullptr, nullptr, 0, &num),
                  KVP_ERR_BUFFER_TOO_SMALL, "3 blocks");
  for (int32_t t : table) EXPECT_EQ(t, kPoison) << "a failed describe wrote the block table";
}
TEST_F(Manager, DescribeSlotCapacityTooSmall) {
  int32_t slots[14], num = 0;
  for (int32_t &s : slots) s = kPoison;
  EXPECT_REJECTED(kvp_manager_describe(m_, live_.data(), 3, nullptr, 0, nullptr, slots, 14, &num),
                  KVP_ERR_BUFFER_TOO_SMALL, "15 new tokens");
  for (int32_t s : slots) EXPECT_EQ(s, kPoison) << "a failed describe wrote slot_mapping";
}

// ---- errors are per thread, messages name the call ---------------------------------

TEST(Errors, StatusStringsAreDistinct) {
  std::vector<std::string> names;
  for (int s = KVP_OK; s <= KVP_ERR_INTERNAL; s++) {
    names.push_back(kvp_status_string(static_cast<kvp_status>(s)));
    for (size_t i = 0; i + 1 < names.size(); i++) EXPECT_NE(names[i], names.back());
  }
  EXPECT_EQ(names[KVP_ERR_OUT_OF_BLOCKS], "KVP_ERR_OUT_OF_BLOCKS");
  EXPECT_NE(kvp_status_string(static_cast<kvp_status>(999)), nullptr);
}

TEST(Errors, LastErrorIsPerThread) {
  kvp_manager_config cfg = config(4, 4);
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);
  ASSERT_EQ(kvp_manager_add(m, 5, 100), KVP_ERR_INVALID_ARGUMENT);  // more than the whole pool
  const std::string mine = last_error();
  std::string theirs;
  std::thread t([&] {
    theirs = last_error();  // nothing failed on this thread yet
    const int64_t id = 77;
    EXPECT_EQ(kvp_manager_remove(m, &id, 1), KVP_ERR_UNKNOWN_SEQUENCE);
    theirs += "|" + last_error();
  });
  t.join();
  EXPECT_EQ(theirs, "|remove: sequence 77 is not live");
  EXPECT_EQ(last_error(), mine);
  EXPECT_NE(mine.find("100 tokens"), std::string::npos) << mine;
  kvp_manager_destroy(m);
}

TEST(Version, MatchesHeader) {
  EXPECT_EQ(kvp_version() / 10000, static_cast<uint32_t>(KVP_VERSION_MAJOR));
  EXPECT_EQ(kvp_version(), static_cast<uint32_t>(KVP_VERSION_NUMBER));
  EXPECT_EQ(std::string(kvp_version_string()), std::to_string(KVP_VERSION_MAJOR) + "." +
                                                   std::to_string(KVP_VERSION_MINOR) + "." +
                                                   std::to_string(KVP_VERSION_PATCH));
}

// ---- threads ---------------------------------------------------------------------------

TEST(Threads, ConcurrentStepsOnOneManager) {
  constexpr int kThreads = 4, kSeqs = 8, kRounds = 150;
  kvp_manager_config cfg = config(kThreads * kSeqs * 8, 4);
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::vector<int64_t> ids(kSeqs);
    std::vector<int32_t> ones(kSeqs, 1), table(kSeqs * 8), lens(kSeqs), slots(kSeqs * 8);
    for (int r = 0; r < kRounds; r++) {
      for (int i = 0; i < kSeqs; i++) {
        ids[i] = int64_t(t) * 1000000 + int64_t(r) * 100 + i;
        if (kvp_manager_add(m, ids[i], 1 + (i + r) % 7) != KVP_OK) failures++;
      }
      for (int step = 0; step < 5; step++) {
        if (kvp_manager_grow(m, ids.data(), ones.data(), kSeqs) != KVP_OK) failures++;
        int32_t num = 0;
        if (kvp_manager_describe(m, ids.data(), kSeqs, table.data(), 8, lens.data(), slots.data(), kSeqs * 8,
                                 &num) != KVP_OK ||
            num != kSeqs)
          failures++;
        for (int i = 0; i < kSeqs; i++)
          if (lens[i] != 1 + (i + r) % 7 + step + 1) failures++;
      }
      // A failure on this thread reports this thread's own error.
      const int64_t ghost = -1 - t;
      if (kvp_manager_remove(m, &ghost, 1) != KVP_ERR_UNKNOWN_SEQUENCE ||
          last_error() != "remove: sequence " + std::to_string(ghost) + " is not live")
        failures++;
      if (kvp_manager_remove(m, ids.data(), kSeqs) != KVP_OK) failures++;
      kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
      if (kvp_manager_stats_get(m, &s) != KVP_OK || s.free_blocks + s.used_blocks != s.num_blocks) failures++;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) threads.emplace_back(worker, t);
  for (auto &th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(kvp_manager_check(m), KVP_OK) << last_error();
  kvp_manager_stats s = KVP_MANAGER_STATS_INIT;
  ASSERT_EQ(kvp_manager_stats_get(m, &s), KVP_OK);
  EXPECT_EQ(s.num_seqs, 0);
  EXPECT_EQ(s.free_blocks, s.num_blocks);
  kvp_manager_destroy(m);
}

// ---- logging ---------------------------------------------------------------------------

struct LogSink {
  std::mutex mu;
  std::vector<std::pair<int, std::string>> lines;
};

extern "C" void record_log(void *user, int level, const char *msg) {
  auto *sink = static_cast<LogSink *>(user);
  std::lock_guard<std::mutex> lock(sink->mu);
  sink->lines.emplace_back(level, msg);
}

TEST(Logging, RejectsBadLevels) {
  EXPECT_EQ(kvp_set_logger(record_log, nullptr, -1), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("got -1"), std::string::npos) << last_error();
  EXPECT_EQ(kvp_set_logger(record_log, nullptr, KVP_LOG_OFF + 1), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvp_set_log_level(17), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("got 17"), std::string::npos) << last_error();
}

TEST(Logging, CallbackReceivesLines) {
  LogSink sink;
  ASSERT_EQ(kvp_set_logger(record_log, &sink, KVP_LOG_DEBUG), KVP_OK) << last_error();
  kvp_manager_config cfg = config(4, 4);
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);
  kvp_manager_destroy(m);
  ASSERT_EQ(kvp_set_logger(nullptr, nullptr, KVP_LOG_OFF), KVP_OK);
  std::lock_guard<std::mutex> lock(sink.mu);
  ASSERT_FALSE(sink.lines.empty()) << "no log line delivered at KVP_LOG_DEBUG for a create/destroy";
  for (auto &line : sink.lines) {
    EXPECT_GE(line.first, KVP_LOG_DEBUG);
    EXPECT_LE(line.first, KVP_LOG_ERROR);
    EXPECT_FALSE(line.second.empty());
  }
}

TEST(Logging, SilencedLoggerReceivesNothing) {
  LogSink sink;
  ASSERT_EQ(kvp_set_logger(record_log, &sink, KVP_LOG_OFF), KVP_OK);
  kvp_manager_config cfg = config(4, 4);
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);
  kvp_manager_destroy(m);
  ASSERT_EQ(kvp_set_logger(nullptr, nullptr, KVP_LOG_OFF), KVP_OK);
  std::lock_guard<std::mutex> lock(sink.mu);
  EXPECT_TRUE(sink.lines.empty());
}

// The prefix cache's computed-K/V contract through the C API alone: a
// request removed before its forward pass leaves nothing a later prompt
// matches; a sharer of its uncomputed blocks makes its removal IN_USE;
// after kvp_manager_mark_computed the blocks stay cached.
TEST(ComputedKV, RemoveBeforeForwardPassMatchesNothing) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 64;
  cfg.block_size = 16;
  cfg.enable_prefix_cache = 1;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);
  std::vector<int32_t> p(80);
  for (int32_t i = 0; i < 80; ++i) p[static_cast<std::size_t>(i)] = 100 + i;
  const int64_t off[2] = {0, 80};
  auto admit = [&](int64_t id) {
    int32_t matched = -1, admitted = 0;
    EXPECT_EQ(kvp_manager_admit(m, &id, 1, p.data(), off, nullptr, &matched, &admitted), KVP_OK);
    EXPECT_EQ(admitted, 1);
    return matched;
  };
  EXPECT_EQ(admit(1), 0);
  int64_t one = 1, two = 2, three = 3;
  ASSERT_EQ(kvp_manager_remove(m, &one, 1), KVP_OK);  // preempted before its forward pass
  EXPECT_EQ(admit(2), 0);                              // nothing of sequence 1 matches
  EXPECT_EQ(admit(3), 64);                             // same step: shares sequence 2's blocks
  EXPECT_EQ(kvp_manager_remove(m, &two, 1), KVP_ERR_IN_USE);
  EXPECT_NE(std::string(kvp_last_error()).find("sequence 3"), std::string::npos) << kvp_last_error();
  EXPECT_STREQ(kvp_status_string(KVP_ERR_IN_USE), "KVP_ERR_IN_USE");
  kvp_prefix_stats st = KVP_PREFIX_STATS_INIT;
  ASSERT_EQ(kvp_manager_prefix_stats(m, &st), KVP_OK);
  EXPECT_EQ(st.uncomputed_blocks, 5);   // sequence 2's (3's fifth block is a private twin)
  EXPECT_EQ(st.dropped_uncomputed, 5);  // sequence 1's
  ASSERT_EQ(kvp_manager_mark_computed(m), KVP_OK);  // the step's forward pass ran
  ASSERT_EQ(kvp_manager_remove(m, &two, 1), KVP_OK);
  ASSERT_EQ(kvp_manager_remove(m, &three, 1), KVP_OK);
  EXPECT_EQ(admit(4), 64);
  ASSERT_EQ(kvp_manager_prefix_stats(m, &st), KVP_OK);
  EXPECT_EQ(st.uncomputed_blocks, 0);  // sequence 4 matched 4 blocks; its fifth is a twin of 2's
  EXPECT_EQ(st.dropped_uncomputed, 5);
  EXPECT_EQ(kvp_manager_mark_computed(nullptr), KVP_ERR_INVALID_HANDLE);
  EXPECT_EQ(kvp_manager_check(m), KVP_OK);
  kvp_manager_destroy(m);
}

// A child forked after the library was loaded gets UNSUPPORTED at once from
// every entry point, with a message naming the cause, instead of entering
// a Go runtime that did not survive the fork.
TEST(Fork, ChildCallsFailAtOnce) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  kvp_manager *m = nullptr;
  ASSERT_EQ(kvp_manager_create(&cfg, &m), KVP_OK);  // the runtime is running
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(fds[0]);
    kvp_manager *c = nullptr;
    int code = kvp_manager_create(&cfg, &c) == KVP_ERR_UNSUPPORTED ? 0 : 1;
    const char *msg = kvp_last_error();
    if (write(fds[1], msg, strlen(msg)) < 0) code = 2;
    if (kvp_manager_add(m, 1, 4) != KVP_ERR_UNSUPPORTED) code = 3;
    if (kvp_version() != static_cast<uint32_t>(KVP_VERSION_NUMBER)) code = 4;
    kvp_manager_destroy(m);  // does nothing in the child
    _exit(code);
  }
  close(fds[1]);
  int status = 0;
  bool done = false;
  for (int i = 0; i < 2000 && !done; i++) {  // 20 s
    done = waitpid(pid, &status, WNOHANG) == pid;
    if (!done) usleep(10000);
  }
  if (!done) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  char buf[1024] = {0};
  ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  ASSERT_TRUE(done) << "the forked child hung in a kvplug call";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status << ": " << buf;
  EXPECT_GT(n, 0);
  EXPECT_NE(std::string(buf).find("forked"), std::string::npos) << buf;
  EXPECT_EQ(kvp_manager_add(m, 1, 4), KVP_OK);  // the parent is unaffected
  kvp_manager_destroy(m);
}

}  // namespace

namespace {

// A bf16 decode of 2 sequences, 8 q heads, head_dim 128, over the cache kv
// (addresses that no device reads: the checks come first).
kvp_paged_decode_args bf16_decode_over(const kvp_paged_kv *kv) {
  kvp_paged_decode_args a = KVP_PAGED_DECODE_ARGS_INIT;
  a.dtype = KVP_DTYPE_BF16;
  a.head_dim = 128;
  a.batch = 2;
  a.num_q_heads = 8;
  a.q = 0x400000;
  a.q_batch_stride = 8 * 128;
  a.q_head_stride = 128;
  a.seq_lens = 0x500000;
  a.out = 0x600000;
  a.out_batch_stride = 8 * 128;
  a.out_head_stride = 128;
  a.kv = kv;
  return a;
}

}  // namespace

// The paged-KV descriptor (0.4): a cache described once, through kv; a
// descriptor beside the args' own cache fields, a scale array or another
// dtype is refused before any device is needed, with a message.
TEST(PagedKV, DescriptorIsCheckedBeforeTheDevice) {
  kvp_paged_kv kv = KVP_PAGED_KV_INIT;
  kv.dtype = KVP_DTYPE_BF16;
  kv.num_kv_heads = 2;
  kv.num_blocks = 64;
  kv.block_size = 16;
  kv.k_cache = 0x100000;
  kv.v_cache = 0x200000;
  kv.block_stride = 16 * 2 * 128;
  kv.token_stride = 2 * 128;
  kv.head_stride = 128;
  kv.block_table = 0x300000;
  kv.max_blocks_per_seq = 8;

  kvp_paged_decode_args a = bf16_decode_over(&kv);
  // Valid: what is left to say comes from the device (no GPU, no kernels
  // or a bad address), never from the arguments.
  kvp_status s = kvp_paged_decode(&a, 0);
  EXPECT_NE(s, KVP_ERR_INVALID_ARGUMENT) << kvp_last_error();
  EXPECT_NE(s, KVP_ERR_NULL_POINTER) << kvp_last_error();

  kvp_paged_decode_args twice = a;
  twice.k_cache = kv.k_cache;
  EXPECT_EQ(kvp_paged_decode(&twice, 0), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvp_last_error()).find("described once"), std::string::npos) << kvp_last_error();

  kvp_paged_kv scaled = kv;
  scaled.k_scale = 0x700000;
  a.kv = &scaled;
  EXPECT_EQ(kvp_paged_decode(&a, 0), KVP_ERR_INVALID_ARGUMENT);

  kvp_paged_kv f16 = kv;
  f16.dtype = KVP_DTYPE_F16;
  a.kv = &f16;
  EXPECT_EQ(kvp_paged_decode(&a, 0), KVP_ERR_INVALID_ARGUMENT);

  kvp_paged_kv old = kv;
  old.struct_size = 4;
  a.kv = &old;
  EXPECT_EQ(kvp_paged_decode(&a, 0), KVP_ERR_STRUCT_SIZE);

  // A 0.4 descriptor (through v_scale) is still taken.
  kvp_paged_kv v04 = kv;
  v04.struct_size = offsetof(kvp_paged_kv, scale_kind);
  a.kv = &v04;
  s = kvp_paged_decode(&a, 0);
  EXPECT_NE(s, KVP_ERR_INVALID_ARGUMENT) << kvp_last_error();
  EXPECT_NE(s, KVP_ERR_STRUCT_SIZE) << kvp_last_error();
}

// An e4m3 (FP8) cache under a bf16 decode (0.5): byte strides, a scale kind
// and both scale arrays; the checks come before the device.
TEST(PagedKV, E4M3DescriptorIsCheckedBeforeTheDevice) {
  kvp_paged_kv kv = KVP_PAGED_KV_INIT;
  kv.dtype = KVP_DTYPE_E4M3;
  kv.num_kv_heads = 2;
  kv.num_blocks = 64;
  kv.block_size = 16;
  kv.k_cache = 0x100000;
  kv.v_cache = 0x200000;
  kv.block_stride = 16 * 2 * 128;  // bytes: e4m3 elements
  kv.token_stride = 2 * 128;
  kv.head_stride = 128;
  kv.block_table = 0x300000;
  kv.max_blocks_per_seq = 8;
  kv.k_scale = 0x800000;
  kv.v_scale = 0x900000;
  kv.scale_kind = KVP_KV_SCALE_TOKEN_HEAD;

  kvp_paged_decode_args a = bf16_decode_over(&kv);
  kvp_status s = kvp_paged_decode(&a, 0);
  EXPECT_NE(s, KVP_ERR_INVALID_ARGUMENT) << kvp_last_error();
  EXPECT_NE(s, KVP_ERR_NULL_POINTER) << kvp_last_error();

  kvp_paged_decode_args nodtype = a;
  nodtype.dtype = 0;  // q's dtype cannot come from an e4m3 descriptor
  EXPECT_EQ(kvp_paged_decode(&nodtype, 0), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvp_last_error()).find("must be set"), std::string::npos) << kvp_last_error();

  kvp_paged_kv nokind = kv;
  nokind.scale_kind = KVP_KV_SCALE_NONE;
  a.kv = &nokind;
  EXPECT_EQ(kvp_paged_decode(&a, 0), KVP_ERR_INVALID_ARGUMENT);

  kvp_paged_kv noscale = kv;
  noscale.v_scale = 0;
  a.kv = &noscale;
  EXPECT_EQ(kvp_paged_decode(&a, 0), KVP_ERR_NULL_POINTER);

  kvp_paged_decode_args f32 = a;
  f32.dtype = KVP_DTYPE_F32;
  f32.kv = &kv;
  EXPECT_EQ(kvp_paged_decode(&f32, 0), KVP_ERR_INVALID_ARGUMENT);
}
