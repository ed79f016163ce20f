// Tests of the header-only C++ wrapper, which dlopens the library: this
// program does not link libkvplug. ctest sets KVPLUG_LIBRARY;
// KVPLUG_TEST_LIBRARY is the same path, compiled in.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kvplug.hpp"

namespace {

static_assert(!std::is_copy_constructible<kvplug::Manager>::value, "Manager must be move-only");
static_assert(std::is_nothrow_move_constructible<kvplug::Manager>::value, "");
static_assert(std::is_base_of<std::runtime_error, kvplug::Error>::value, "");

// The status a callable throws (KVP_OK if it does not), and its message.
template <class F>
std::pair<kvp_status, std::string> thrown(F &&f) {
  try {
    f();
  } catch (const kvplug::Error &e) {
    return {e.status(), e.what()};
  }
  return {KVP_OK, ""};
}

TEST(Loader, LoadsFromTheEnvironmentOnFirstUse) {
  ASSERT_STREQ(std::getenv("KVPLUG_LIBRARY"), KVPLUG_TEST_LIBRARY);
  EXPECT_EQ(kvplug::version() / 10000, static_cast<uint32_t>(KVP_VERSION_MAJOR));
  EXPECT_EQ(kvplug::load(), KVPLUG_TEST_LIBRARY);
  EXPECT_EQ(kvplug::load(KVPLUG_TEST_LIBRARY), KVPLUG_TEST_LIBRARY);  // the same path again: fine
  EXPECT_FALSE(kvplug::version_string().empty());
  EXPECT_STREQ(kvplug::status_string(KVP_ERR_OUT_OF_BLOCKS), "KVP_ERR_OUT_OF_BLOCKS");
}

TEST(Loader, StatusStringAgreesWithTheLibrary) {
  kvplug::version();  // loaded
  // Every code the library names (a library older than the header lacks the newest).
  int named = 0;
  for (int i = 0; i <= KVP_ERR_IN_USE; i++) {
    auto st = static_cast<kvp_status>(i);
    std::string lib = kvplug::detail::common().kvp_status_string(st);
    if (lib == "KVP_ERR_UNKNOWN_STATUS") continue;
    named++;
    EXPECT_EQ(kvplug::status_string(st), lib) << i;
  }
  EXPECT_GE(named, KVP_ERR_INTERNAL + 1);
}

TEST(Loader, RefusesASecondCopy) {
  kvplug::version();  // loaded
  auto [st, msg] = thrown([] { kvplug::load("/elsewhere/libkvplug.so"); });
  EXPECT_EQ(st, KVP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("already loaded"), std::string::npos) << msg;
}

TEST(Loader, MissingSymbolThrowsUnsupported) {
  struct Future {
    void (*kvp_not_there)(void) = nullptr;
    void load(const kvplug::detail::Library &lib) {
      kvp_not_there = lib.sym<void (*)(void)>("kvp_not_there");
    }
  };
  auto [st, msg] = thrown([] { kvplug::detail::table<Future>(); });
  EXPECT_EQ(st, KVP_ERR_UNSUPPORTED);
  EXPECT_NE(msg.find("kvp_not_there"), std::string::npos) << msg;
}

TEST(Manager, Step) {
  kvplug::Manager m(64, 4);
  EXPECT_TRUE(m);
  m.add(1, 10);
  m.add(2, 3);
  std::vector<int64_t> ids{1, 2};
  m.grow(ids, 1);
  kvplug::Description d = m.describe(ids);
  EXPECT_EQ(d.max_blocks, 3);
  EXPECT_EQ(d.seq_lens, (std::vector<int32_t>{11, 4}));
  ASSERT_EQ(d.slot_mapping.size(), 2u);
  EXPECT_EQ(d.slot_mapping[0], d.block_table[2] * 4 + 2);  // token 10: block 2, row 2
  EXPECT_EQ(d.slot_mapping[1], d.block_table[3] * 4 + 3);  // token 3: block 0, row 3
  EXPECT_EQ(d.block_table[4], -1);
  EXPECT_EQ(d.block_table[5], -1);

  std::vector<int32_t> counts{2, 0};
  m.grow(ids, counts);
  int32_t table[2][4], lens[2], slots[4];
  int32_t n = m.describe_into(ids, kvplug::span<int32_t>(&table[0][0], 8), 4, lens, slots);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(lens[0], 13);
  EXPECT_EQ(lens[1], 4);
  m.check();

  kvp_manager_stats s = m.stats();
  EXPECT_EQ(s.num_seqs, 2);
  EXPECT_EQ(s.num_tokens, 17);
  EXPECT_EQ(s.used_blocks, 5);
  m.remove(ids);
  EXPECT_EQ(m.stats().free_blocks, 64);
}

TEST(Manager, ForkReturnsCopies) {
  kvplug::Manager m(64, 4);
  m.add(1, 6);
  std::vector<int64_t> kids{5, 6, 7};
  std::vector<kvp_block_copy> copies = m.fork(1, kids);
  ASSERT_EQ(copies.size(), 3u);
  auto d = m.describe(std::vector<int64_t>{1, 5});
  EXPECT_EQ(copies[0].src, d.block_table[1]);
  EXPECT_EQ(copies[0].dst, d.block_table[d.max_blocks + 1]);
  EXPECT_EQ(d.block_table[0], d.block_table[d.max_blocks]);  // the full block is shared
  EXPECT_EQ(m.stats().shared_blocks, 1);

  m.add(2, 8);  // full blocks only: nothing to copy
  EXPECT_TRUE(m.fork(2, std::vector<int64_t>{8}).empty());
}

TEST(Manager, LayerGroups) {
  const kvp_layer_group groups[] = {{KVP_GROUP_FULL_ATTENTION, 0, 0, 0, 0}, {KVP_GROUP_SLIDING_WINDOW, 5, 0, 0, 0},
                                    {KVP_GROUP_RECURRENT, 0, 96, 0, 0}};
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 32;
  cfg.block_size = 4;
  cfg.layer_groups = groups;
  cfg.num_layer_groups = 3;
  cfg.block_bytes = 128;
  kvplug::Manager m(cfg);
  EXPECT_EQ(m.num_groups(), 3);
  m.add(1, 9);
  std::vector<int64_t> one{1};
  m.grow(one, 1);  // length 10: the window of 5 reads from token 5, so block 0 goes
  std::vector<kvplug::Description> d = m.describe_groups(one);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].block_table, m.describe(one).block_table);
  EXPECT_EQ(d[1].block_table[0], -1);
  EXPECT_GE(d[1].block_table[1], 0);
  EXPECT_GE(d[2].block_table[0], 0);
  EXPECT_EQ(d[2].block_table[1], -1);
  ASSERT_EQ(d[1].slot_mapping.size(), 1u);
  EXPECT_EQ(d[1].slot_mapping[0], d[1].block_table[2] * 4 + 1);
  EXPECT_EQ(d[2].slot_mapping[0], -1);  // a state has no slots
  EXPECT_EQ(m.group_blocks(), (std::vector<int32_t>{3, 2, 1}));
  // The partial block of both attention groups and the state, per child.
  EXPECT_EQ(m.fork(1, std::vector<int64_t>{2, 3}).size(), 6u);

  EXPECT_TRUE(m.take_copies().empty());  // no recurrent group in a prefix cache: nothing queued

  kvp_layer_group bad[] = {{KVP_GROUP_SLIDING_WINDOW, 5, 0, 0, 0}};
  cfg.layer_groups = bad;
  cfg.num_layer_groups = 1;
  EXPECT_EQ(thrown([&] { kvplug::Manager x(cfg); }).first, KVP_ERR_INVALID_ARGUMENT);
}

TEST(Manager, ErrorsAreExceptionsWithStatusAndMessage) {
  kvplug::Manager m(4, 4);
  m.add(1, 8);
  std::vector<int64_t> ids{1};
  auto [st, msg] = thrown([&] { m.grow(ids, 100); });
  EXPECT_EQ(st, KVP_ERR_OUT_OF_BLOCKS);
  EXPECT_NE(msg.find("2 are free"), std::string::npos) << msg;
  EXPECT_EQ(m.stats().num_tokens, 8) << "a failed grow changed the manager";

  EXPECT_EQ(thrown([&] { m.add(1, 1); }).first, KVP_ERR_DUPLICATE_SEQUENCE);
  EXPECT_EQ(thrown([&] { m.remove(42); }).first, KVP_ERR_UNKNOWN_SEQUENCE);
  EXPECT_EQ(thrown([&] { m.add(2, 0); }).first, KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { m.grow(ids, std::vector<int32_t>{1, 1}); }).first, KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { m.remove(std::vector<int64_t>{}); }).first, KVP_ERR_INVALID_ARGUMENT);
  int32_t small[1];
  EXPECT_EQ(thrown([&] { m.describe_into(ids, small, 2, {}, {}); }).first, KVP_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(thrown([&] { m.describe(ids, 1); }).first, KVP_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(thrown([] { kvplug::Manager bad(0); }).first, KVP_ERR_INVALID_ARGUMENT);
  m.check();
}

TEST(Manager, MoveTransfersOwnership) {
  kvplug::Manager a(16, 4);
  a.add(1, 4);
  kvp_manager *h = a.get();
  kvplug::Manager b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(b.get(), h);
  EXPECT_EQ(b.stats().num_seqs, 1);
  EXPECT_EQ(thrown([&] { a.add(2, 1); }).first, KVP_ERR_INVALID_HANDLE);

  kvplug::Manager c(8, 4);
  c = std::move(b);  // c's own manager is destroyed
  EXPECT_EQ(c.get(), h);
  EXPECT_EQ(c.stats().num_seqs, 1);

  kvp_manager *raw = c.release();
  EXPECT_FALSE(c);
  kvplug::Manager d = kvplug::Manager::adopt(raw);
  EXPECT_EQ(d.block_size(), 4);
  d.reset();
  EXPECT_FALSE(d);
}

TEST(Manager, DestroyedHandleIsRejectedNotDereferenced) {
  kvplug::Manager m(8, 4);
  kvp_manager *stale = m.get();
  m.reset();
  kvplug::Manager again = kvplug::Manager::adopt(stale);  // a stale handle
  auto [st, msg] = thrown([&] { again.check(); });
  EXPECT_EQ(st, KVP_ERR_INVALID_HANDLE);
  EXPECT_NE(msg.find("not live"), std::string::npos) << msg;
  again.release();
}

TEST(Manager, ThreadsShareOneManager) {
  kvplug::Manager m(4 * 64, 1);  // token mode
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; t++) {
    threads.emplace_back([&m, &failures, t] {
      try {
        for (int r = 0; r < 100; r++) {
          std::vector<int64_t> ids{t * 1000 + r * 2, t * 1000 + r * 2 + 1};
          m.add(ids[0], 5);
          m.add(ids[1], 7);
          m.grow(ids, 3);
          auto d = m.describe(ids);
          if (d.seq_lens != std::vector<int32_t>{8, 10} || d.slot_mapping.size() != 6) failures++;
          m.remove(ids);
        }
      } catch (const kvplug::Error &e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto &th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  m.check();
  EXPECT_EQ(m.stats().free_blocks, 256);
}

struct Lines {
  std::mutex mu;
  int count = 0;
};

TEST(Logging, SetLoggerAndLevel) {
  Lines lines;
  kvplug::set_logger(
      [](void *user, int, const char *) {
        auto *l = static_cast<Lines *>(user);
        std::lock_guard<std::mutex> lock(l->mu);
        l->count++;
      },
      &lines, KVP_LOG_DEBUG);
  kvplug::set_log_level(KVP_LOG_WARN);
  EXPECT_EQ(thrown([] { kvplug::set_log_level(9); }).first, KVP_ERR_INVALID_ARGUMENT);
  kvplug::set_logger(nullptr, nullptr, KVP_LOG_OFF);
}

}  // namespace
