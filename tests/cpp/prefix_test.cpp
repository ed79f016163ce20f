// The prefix cache through the C++ wrapper (kvplug.hpp): admit, grow_tokens,
// match, pins, priorities, stats, events (every layer group's too) and clear.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "kvplug.hpp"
#include "thrown.hpp"

namespace {

constexpr int32_t kBlock = 4;

kvplug::Manager cached_manager(int32_t blocks, bool events) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = blocks;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.enable_kv_events = events ? 1 : 0;
  return kvplug::Manager(cfg);
}

std::vector<int32_t> iota(int32_t from, int32_t n) {
  std::vector<int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t> &b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(PrefixCache, AdmitSharesAndDecodeCaches) {
  kvplug::Manager m = cached_manager(32, true);
  kvplug::PrefixCache pc(m);
  const auto system = iota(100, 2 * kBlock);
  kvplug::Prompts p;
  p.add(cat(system, {1, 2})).add(cat(system, {3, 4, 5}));
  const std::vector<int64_t> ids{1, 2};
  EXPECT_EQ(pc.admit(ids, p), (std::vector<int32_t>{0, 2 * kBlock}));
  const auto d = m.describe(ids);
  EXPECT_EQ(d.block_table[0], d.block_table[static_cast<std::size_t>(d.max_blocks)]);
  EXPECT_EQ(m.stats().shared_blocks, 2);

  // Decode two tokens into sequence 1: its third block fills and is cached.
  pc.grow_tokens(std::vector<int64_t>{1}, std::vector<int32_t>{2}, std::vector<int32_t>{6, 7});
  EXPECT_EQ(pc.stats().cached_blocks, 3);
  kvplug::Prompts q;
  q.add(cat(system, {1, 2, 6, 7, 9}));
  const auto got = pc.match(q, true);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].matched_tokens, 3 * kBlock);
  // Without recurrent groups the block match is the hit.
  const auto blocks = pc.match_blocks(q);
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].matched_tokens, 3 * kBlock);
  EXPECT_EQ(blocks[0].block_tokens, 3 * kBlock);
  // Its hit is held by the two running sequences: an admission of it can
  // have every free block, and only those (nothing is evictable).
  const auto room = pc.match_room(q);
  ASSERT_EQ(room.size(), 1u);
  EXPECT_EQ(room[0], m.stats().free_blocks);
  EXPECT_EQ(room[0], 32 - 4);

  const auto evs = pc.drain_events();
  ASSERT_EQ(evs.size(), 3u);
  for (std::size_t i = 0; i < evs.size(); ++i) {
    EXPECT_EQ(evs[i].kind, KVP_KV_EVENT_BLOCK_STORED);
    if (i > 0) {
      EXPECT_EQ(evs[i].parent, evs[i - 1].hash);
    }
  }
  EXPECT_EQ(evs[2].tokens, (std::vector<int32_t>{1, 2, 6, 7}));
  EXPECT_TRUE(pc.drain_events().empty());
  m.check();
}

TEST(PrefixCache, SaltsIsolateTenants) {
  kvplug::Manager m = cached_manager(32, false);
  kvplug::PrefixCache pc(m);
  const auto prompt = iota(7, 3 * kBlock + 1);
  const uint8_t alice[] = {'a'}, bob[] = {'b'};
  kvp_prefix_keys ka = KVP_PREFIX_KEYS_INIT, kb = KVP_PREFIX_KEYS_INIT;
  ka.salt = alice;
  ka.salt_len = 1;
  kb.salt = bob;
  kb.salt_len = 1;
  kvplug::Prompts p;
  p.add(prompt, &ka);
  pc.admit(std::vector<int64_t>{1}, p);
  kvplug::Prompts q;
  q.add(prompt, &ka).add(prompt, &kb).add(prompt);
  const auto got = pc.match(q);
  EXPECT_EQ(got[0].matched_tokens, 3 * kBlock);
  EXPECT_EQ(got[1].matched_tokens, 0);
  EXPECT_EQ(got[2].matched_tokens, 0);
}

TEST(PrefixCache, EvictionPinsAndClear) {
  kvplug::Manager m = cached_manager(8, true);
  kvplug::PrefixCache pc(m);
  const auto system = iota(50, 2 * kBlock);
  kvplug::Prompts p;
  p.add(cat(system, iota(0, 2 * kBlock + 1)));  // 5 blocks, 4 full
  pc.admit(std::vector<int64_t>{1}, p);
  m.mark_computed();  // the step's forward pass: pins cover computed blocks only
  int32_t pinned = 0;
  const uint64_t pin = pc.pin(system, nullptr, &pinned);
  EXPECT_EQ(pinned, 2);
  EXPECT_EQ(pc.set_priority(system, 4), 2);
  try {
    pc.clear();
    FAIL() << "clear succeeded while sequence 1 holds cached blocks";
  } catch (const kvplug::Error &e) {
    EXPECT_EQ(e.status(), KVP_ERR_INVALID_ARGUMENT);
  }
  m.remove(1);
  // 4 free (the partial last block went back) + 2 evictable (the pinned two
  // are not): a 7-block prompt waits, and the batch stops there; a 6-block
  // one evicts 2.
  kvplug::Prompts big;
  big.add(iota(900, 7 * kBlock)).add(iota(900, 1));
  EXPECT_TRUE(pc.admit(std::vector<int64_t>{2, 3}, big).empty());
  kvplug::Prompts fits;
  fits.add(iota(900, 6 * kBlock));
  EXPECT_EQ(pc.admit(std::vector<int64_t>{3}, fits).size(), 1u);
  EXPECT_EQ(pc.stats().evictions, 2);
  pc.unpin(pin);
  m.remove(3);
  EXPECT_GT(pc.clear(), 0);
  EXPECT_EQ(m.stats().free_blocks, 8);

  // Replay: stored minus removed, then cleared, leaves nothing.
  std::set<kvplug::BlockHash> replay;
  for (auto evs = pc.drain_events(2); !evs.empty(); evs = pc.drain_events(2)) {
    for (const auto &e : evs) {
      if (e.kind == KVP_KV_EVENT_BLOCK_STORED) replay.insert(e.hash);
      if (e.kind == KVP_KV_EVENT_BLOCKS_REMOVED) {
        for (const auto &h : e.hashes) {
          EXPECT_EQ(replay.erase(h), 1u);
        }
      }
      if (e.kind == KVP_KV_EVENT_ALL_CLEARED) replay.clear();
    }
  }
  EXPECT_TRUE(replay.empty());
  pc.reset_stats();
  EXPECT_EQ(pc.stats().queries, 0);
  m.check();
}

TEST(PrefixCache, BadInputThrowsAndChangesNothing) {
  kvplug::Manager m = cached_manager(8, false);
  kvplug::PrefixCache pc(m);
  kvplug::Prompts p;
  p.add(iota(0, 5));
  pc.admit(std::vector<int64_t>{1}, p);
  const auto before = m.stats();
  auto expect_status = [](kvp_status want, auto &&fn) {
    try {
      fn();
      ADD_FAILURE() << "no exception";
    } catch (const kvplug::Error &e) {
      EXPECT_EQ(e.status(), want) << e.what();
    }
  };
  expect_status(KVP_ERR_DUPLICATE_SEQUENCE, [&] { pc.admit(std::vector<int64_t>{1}, p); });
  kvplug::Prompts empty;
  empty.add(std::vector<int32_t>{});
  expect_status(KVP_ERR_INVALID_ARGUMENT, [&] { pc.admit(std::vector<int64_t>{2}, empty); });
  expect_status(KVP_ERR_INVALID_ARGUMENT, [&] { pc.admit(std::vector<int64_t>{2, 3}, p); });
  expect_status(KVP_ERR_NOT_FOUND, [&] { pc.pin(iota(70, 8)); });
  expect_status(KVP_ERR_INVALID_ARGUMENT, [&] { pc.drain_events(); });  // events off
  expect_status(KVP_ERR_OUT_OF_BLOCKS,
                [&] { pc.grow_tokens(std::vector<int64_t>{1}, std::vector<int32_t>{40}, iota(0, 40)); });
  const auto after = m.stats();
  EXPECT_EQ(after.free_blocks, before.free_blocks);
  EXPECT_EQ(after.num_tokens, before.num_tokens);
  m.check();
}

TEST(PrefixCache, ChunkedPrefillThroughAnImageAndLargeEvents) {
  // Block size 16; image placeholders at [48, 80); the first chunk (40
  // tokens) ends inside the image, whose item admit takes whole.
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 64;
  cfg.enable_prefix_cache = 1;
  cfg.enable_kv_events = 1;
  kvplug::Manager m(cfg);
  kvplug::PrefixCache pc(m);
  std::vector<int32_t> p = iota(0, 48);
  p.insert(p.end(), 32, -1);
  p = cat(p, iota(100, 10));
  kvp_mm_item img{48, 32, {}};
  std::fill(std::begin(img.hash), std::end(img.hash), uint8_t{0x11});
  kvp_prefix_keys keys = KVP_PREFIX_KEYS_INIT;
  keys.mm = &img;
  keys.num_mm = 1;
  kvplug::Prompts first;
  first.add(std::vector<int32_t>(p.begin(), p.begin() + 40), &keys);
  EXPECT_EQ(pc.admit(std::vector<int64_t>{1}, first), (std::vector<int32_t>{0}));
  pc.grow_tokens(std::vector<int64_t>{1}, std::vector<int32_t>{50}, std::vector<int32_t>(p.begin() + 40, p.end()));
  kvplug::Prompts q;
  q.add(p).add(p, &keys);
  const auto got = pc.match(q);
  EXPECT_EQ(got[0].matched_tokens, 48);  // text only: never the image's blocks
  EXPECT_EQ(got[1].matched_tokens, 80);

  // Items for tokens to come; one inside a filled block is refused.
  kvp_mm_item later{90, 2, {}};
  pc.add_mm_items(1, kvplug::span<const kvp_mm_item>(&later, 1));
  kvp_mm_item early{91, 1, {}};
  pc.grow_tokens(std::vector<int64_t>{1}, std::vector<int32_t>{8}, iota(200, 8));
  try {
    pc.add_mm_items(1, kvplug::span<const kvp_mm_item>(&early, 1));
    FAIL() << "an item inside a filled block was accepted";
  } catch (const kvplug::Error &e) {
    EXPECT_EQ(e.status(), KVP_ERR_INVALID_ARGUMENT);
  }

  // Five full blocks stored, the image's two with one entry each.
  const auto evs = pc.drain_events();
  ASSERT_EQ(evs.size(), 6u);
  EXPECT_EQ(evs[3].mm.size(), 1u);
  EXPECT_EQ(evs[4].mm.size(), 1u);
  EXPECT_EQ(evs[5].mm.size(), 1u);  // [80, 96): the item added later
}

TEST(PrefixCache, DrainsABlockWithMoreEntriesThanTheDefaultBuffers) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 4;
  cfg.block_size = 2048;
  cfg.enable_prefix_cache = 1;
  cfg.enable_kv_events = 1;
  kvplug::Manager m(cfg);
  kvplug::PrefixCache pc(m);
  std::vector<kvp_mm_item> items(1100);
  for (int32_t i = 0; i < 1100; ++i) {
    items[static_cast<std::size_t>(i)].offset = i;
    items[static_cast<std::size_t>(i)].length = 1;
    items[static_cast<std::size_t>(i)].hash[0] = static_cast<uint8_t>(i);
  }
  kvp_prefix_keys keys = KVP_PREFIX_KEYS_INIT;
  keys.mm = items.data();
  keys.num_mm = 1100;
  kvplug::Prompts p;
  p.add(iota(0, 2049), &keys);
  pc.admit(std::vector<int64_t>{1}, p);
  const auto evs = pc.drain_events();
  ASSERT_EQ(evs.size(), 1u);
  EXPECT_EQ(evs[0].tokens.size(), 2048u);
  ASSERT_EQ(evs[0].mm.size(), 1100u);
  EXPECT_EQ(evs[0].mm[1099].offset, 1099);
  EXPECT_TRUE(pc.drain_events().empty());
}

namespace {

// A hybrid manager: 40 blocks of 4 tokens, a full-attention group 0 and a
// sliding window of 8 tokens, the prefix cache and KV events on.
kvplug::Manager window_manager() {
  static const kvp_layer_group groups[] = {{KVP_GROUP_FULL_ATTENTION, 0, 0, 0, 0},
                                           {KVP_GROUP_SLIDING_WINDOW, 2 * kBlock, 0, 0, 0}};
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 40;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.enable_kv_events = 1;
  cfg.layer_groups = groups;
  cfg.num_layer_groups = 2;
  return kvplug::Manager(cfg);
}

// A conversation of 10 blocks that decodes a token (the window slides past
// its first 8 blocks) and ends; then a prompt of 12 blocks, whose 24 blocks
// (12 a group) need 4 of the 20 cached ones: the window's dropped blocks go
// first, alone, while group 0 keeps all 22 of its blocks.
void window_workload(kvplug::Manager &m) {
  kvplug::PrefixCache pc(m);
  kvplug::Prompts conv;
  conv.add(iota(0, 10 * kBlock));
  ASSERT_EQ(pc.admit(std::vector<int64_t>{1}, conv).size(), 1u);
  pc.grow_tokens(std::vector<int64_t>{1}, std::vector<int32_t>{1}, std::vector<int32_t>{99});
  m.mark_computed();
  m.remove(1);
  kvplug::Prompts next;
  next.add(iota(1000, 12 * kBlock));
  ASSERT_EQ(pc.admit(std::vector<int64_t>{2}, next).size(), 1u);
  m.mark_computed();
  m.remove(2);
  m.check();
}

}  // namespace

TEST(PrefixCache, GroupEventsReportTheWindowsBlocks) {
  kvplug::Manager m = window_manager();
  kvplug::PrefixCache pc(m);
  window_workload(m);
  ASSERT_EQ(pc.stats().cached_blocks, 22);

  // Mirror every group's set of blocks from the events, drained 3 at a time.
  std::map<kvplug::BlockHash, std::vector<int32_t>> group0;  // hash -> its tokens
  std::set<kvplug::BlockHash> group1;
  int stored1 = 0, removed_alone = 0, removed0 = 0, calls = 0;
  for (auto evs = pc.drain_group_events(3); !evs.empty(); evs = pc.drain_group_events(3)) {
    ++calls;
    EXPECT_LE(evs.size(), 3u);
    for (const kvplug::KVGroupEvent &ge : evs) {
      const kvplug::KVEvent &e = ge.event;
      ASSERT_TRUE(ge.group == 0 || ge.group == 1) << ge.group;
      if (e.kind == KVP_KV_EVENT_BLOCK_STORED) {
        ASSERT_EQ(e.tokens.size(), static_cast<std::size_t>(kBlock));
        if (ge.group == 0) {
          EXPECT_TRUE(group0.emplace(e.hash, e.tokens).second) << "group 0 stores a block twice";
        } else {
          // A window block is named by its group-0 block, whose tokens it has.
          auto it = group0.find(e.hash);
          ASSERT_NE(it, group0.end()) << "group 1 stores a block group 0 does not hold";
          EXPECT_EQ(e.tokens, it->second);
          EXPECT_TRUE(group1.insert(e.hash).second) << "group 1 stores a block twice";
          ++stored1;
        }
      } else if (e.kind == KVP_KV_EVENT_BLOCKS_REMOVED) {
        ASSERT_FALSE(e.hashes.empty());
        for (const auto &h : e.hashes) {
          if (ge.group == 0) {
            EXPECT_EQ(group0.erase(h), 1u);
            ++removed0;
          } else {
            EXPECT_EQ(group1.erase(h), 1u) << "group 1 removes a block it does not hold";
            if (group0.count(h) != 0) ++removed_alone;
          }
        }
      } else {
        ADD_FAILURE() << "event kind " << e.kind;
      }
    }
  }
  EXPECT_GT(calls, 1);
  EXPECT_EQ(stored1, 22) << "group 1 stores the companion of every group-0 block";
  EXPECT_EQ(removed_alone, 4) << "the window's evicted blocks are not reported";
  EXPECT_EQ(removed0, 0);
  EXPECT_EQ(group0.size(), 22u);
  EXPECT_EQ(group1.size(), 18u);
  EXPECT_TRUE(pc.drain_group_events().empty());
  EXPECT_TRUE(pc.drain_events().empty());

  // The same run drained the old way: group 0's 22 blocks alone, and the
  // other group's events, passed over, are gone for the group drain too.
  kvplug::Manager old = window_manager();
  kvplug::PrefixCache opc(old);
  window_workload(old);
  std::set<kvplug::BlockHash> seen;
  for (auto evs = opc.drain_events(3); !evs.empty(); evs = opc.drain_events(3)) {
    for (const kvplug::KVEvent &e : evs) {
      ASSERT_EQ(e.kind, KVP_KV_EVENT_BLOCK_STORED);
      EXPECT_EQ(group0.count(e.hash), 1u) << "the old drain reports a block group 0 does not hold";
      EXPECT_TRUE(seen.insert(e.hash).second) << "the old drain stores a block twice";
    }
  }
  EXPECT_EQ(seen.size(), 22u);
  EXPECT_TRUE(opc.drain_group_events().empty());
}

TEST(PrefixCache, GroupEventsWithoutGroupsAreTheOldOnes) {
  auto run = [](bool groups) {
    kvplug::Manager m = cached_manager(16, true);
    kvplug::PrefixCache pc(m);
    kvplug::Prompts a;
    a.add(iota(0, 5 * kBlock + 1));
    pc.admit(std::vector<int64_t>{1}, a);
    m.mark_computed();
    m.remove(1);
    kvplug::Prompts b;
    b.add(iota(500, 15 * kBlock));  // evicts some of the first prompt's blocks
    pc.admit(std::vector<int64_t>{2}, b);
    std::vector<kvplug::KVGroupEvent> out;
    for (;;) {
      std::vector<kvplug::KVGroupEvent> evs;
      if (groups) {
        evs = pc.drain_group_events(2);
      } else {
        for (auto &e : pc.drain_events(2)) evs.push_back(kvplug::KVGroupEvent{std::move(e), -1});
      }
      if (evs.empty()) return out;
      out.insert(out.end(), evs.begin(), evs.end());
    }
  };
  const auto plain = run(false), grouped = run(true);
  ASSERT_EQ(plain.size(), grouped.size());
  bool removed = false;
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(grouped[i].group, 0);
    EXPECT_EQ(grouped[i].event.kind, plain[i].event.kind);
    EXPECT_EQ(grouped[i].event.hash, plain[i].event.hash);
    EXPECT_EQ(grouped[i].event.tokens, plain[i].event.tokens);
    EXPECT_EQ(grouped[i].event.hashes, plain[i].event.hashes);
    removed = removed || plain[i].event.kind == KVP_KV_EVENT_BLOCKS_REMOVED;
  }
  EXPECT_TRUE(removed) << "nothing was evicted: the run tests stores only";

  kvplug::Manager off = cached_manager(8, false);
  kvplug::PrefixCache pc(off);
  try {
    pc.drain_group_events();
    ADD_FAILURE() << "drain_group_events without KV events succeeded";
  } catch (const kvplug::Error &e) {
    EXPECT_EQ(e.status(), KVP_ERR_INVALID_ARGUMENT) << e.what();
  }
}

// The host KV tier through the wrapper: the test plays the engine, with a
// byte vector as the GPU pool's K/V.
TEST(HostTier, DemotesAndReloadsThroughTheWrapper) {
  constexpr int32_t kBlocks = 8;
  constexpr int64_t kBytes = 32;
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = kBlocks;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = 16;
  cfg.host_block_bytes = kBytes;
  cfg.demote_ahead = kBlocks;
  kvplug::Manager m(cfg);
  kvplug::PrefixCache pc(m);
  kvplug::HostTier tier(m);
  ASSERT_EQ(tier.slot_bytes(), kBytes);
  std::vector<uint8_t> gpu(static_cast<std::size_t>(kBlocks * kBytes), 0);
  auto step = [&] {
    kvplug::CopyBatch b = tier.flush_copies();
    for (const kvp_tier_copy &c : b.demote) std::memcpy(tier.slot(c.slot), &gpu[c.block * kBytes], kBytes);
    for (const kvp_tier_copy &c : b.reload) std::memcpy(&gpu[c.block * kBytes], tier.slot(c.slot), kBytes);
    if (b.ticket != 0) tier.complete_copies(b.ticket);
    return b;
  };
  const auto conv = iota(100, 4 * kBlock + 1);
  kvplug::Prompts p;
  p.add(conv);
  EXPECT_EQ(pc.admit(std::vector<int64_t>{1}, p), (std::vector<int32_t>{0}));
  EXPECT_EQ(step().ticket, 0u);  // the step's flush (nothing to copy), then its forward pass writes the blocks
  auto d = m.describe(std::vector<int64_t>{1});
  for (int i = 0; i < 4; i++) std::memset(&gpu[d.block_table[i] * kBytes], 0xa0 + i, kBytes);
  m.mark_computed();
  m.remove(std::vector<int64_t>{1});
  EXPECT_EQ(step().demote.size(), 4u);
  const auto tm = tier.match_tiers(p);
  ASSERT_EQ(tm.size(), 1u);
  EXPECT_EQ(tm[0].gpu_tokens, 0);
  EXPECT_EQ(tm[0].host_tokens, 4 * kBlock);

  std::fill(gpu.begin(), gpu.end(), 0);
  EXPECT_EQ(pc.admit(std::vector<int64_t>{2}, p), (std::vector<int32_t>{4 * kBlock}));
  EXPECT_EQ(step().reload.size(), 4u);
  d = m.describe(std::vector<int64_t>{2});
  for (int i = 0; i < 4; i++) EXPECT_EQ(gpu[d.block_table[i] * kBytes + kBytes - 1], 0xa0 + i) << i;
  EXPECT_EQ(tier.stats().reloads_completed, 4);
  EXPECT_EQ(tier.flush_copies().ticket, 0u);
  EXPECT_THROW(tier.complete_copies(99), kvplug::Error);
  m.check();
}

// The computed-K/V contract through the wrapper: a request removed before
// its forward pass leaves nothing a later prompt matches; removing the
// filler of blocks a later sequence of the step shares throws IN_USE;
// after mark_computed the blocks stay cached.
TEST(PrefixCache, RemoveBeforeForwardPassMatchesNothing) {
  kvplug::Manager m = cached_manager(64, false);
  kvplug::PrefixCache pc(m);
  kvplug::Prompts p;
  p.add(iota(100, 20));  // 5 full blocks of 4
  EXPECT_EQ(pc.admit(std::vector<int64_t>{1}, p), (std::vector<int32_t>{0}));
  m.remove(1);  // preempted before its forward pass
  EXPECT_EQ(pc.admit(std::vector<int64_t>{2}, p), (std::vector<int32_t>{0}));
  EXPECT_EQ(pc.admit(std::vector<int64_t>{3}, p), (std::vector<int32_t>{16}));  // shares 2's blocks
  try {
    m.remove(2);
    FAIL() << "removing the filler of blocks sequence 3 shares succeeded";
  } catch (const kvplug::Error &e) {
    EXPECT_EQ(e.status(), KVP_ERR_IN_USE);
    EXPECT_NE(std::string(e.what()).find("sequence 3"), std::string::npos) << e.what();
  }
  m.mark_computed();
  m.remove(std::vector<int64_t>{2, 3});
  EXPECT_EQ(pc.admit(std::vector<int64_t>{4}, p), (std::vector<int32_t>{16}));
  EXPECT_EQ(pc.stats().dropped_uncomputed, 5);
  m.check();
}

// A shared tier through the wrapper's config: a server that is down (port
// 1) costs the admission nothing but a counted failure.
TEST(HostTier, SharedTierConfigThroughTheWrapper) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = 16;
  cfg.host_block_bytes = 32;
  {
    const std::string addr = "127.0.0.1:1", ns = "cpp-wrapper.bs4";
    cfg.shared_tier_addr = addr.c_str();
    cfg.shared_tier_namespace = ns.c_str();
    cfg.shared_tier_timeout_ms = 100;
    kvplug::Manager m(cfg);
    cfg.shared_tier_addr = cfg.shared_tier_namespace = nullptr;  // read by the constructor only
    kvplug::PrefixCache pc(m);
    kvplug::HostTier tier(m);
    kvplug::Prompts p;
    p.add(iota(100, 4 * kBlock + 1));
    EXPECT_EQ(pc.admit(std::vector<int64_t>{1}, p), (std::vector<int32_t>{0}));
    const kvp_tier_stats s = tier.stats();
    EXPECT_EQ(s.shared_errors + s.shared_timeouts, 1);
    EXPECT_EQ(s.shared_available, 0);
  }
  cfg.shared_tier_namespace = "no-address";
  EXPECT_THROW(kvplug::Manager{cfg}, kvplug::Error);
}

// The tier copier through the wrapper: bad layouts throw with the library's
// status; a good one over a manager's host tier answers as the kernels do on
// this machine (kvplug::attn::prepare): a copier with a GPU and kernels,
// NO_DEVICE without a GPU, UNSUPPORTED in a build without kernels.
TEST(TierCopier, WrapperChecksAndCreates) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = 4;
  cfg.host_block_bytes = 2 * 2 * 64;
  kvplug::Manager m(cfg);
  kvplug::HostTier tier(m);
  ASSERT_EQ(tier.num_slots(), 4);
  const std::vector<uint64_t> k{0x10000, 0x20000}, v{0x30000, 0x40000};
  EXPECT_EQ(thrown([&] { kvplug::TierCopier c(k, {0x30000}, 8, 64, 64, 64, tier); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { kvplug::TierCopier c(k, v, 8, 64, 64, 64, tier.slot(0), 240, 4); }),
            KVP_ERR_INVALID_ARGUMENT);  // slots smaller than 2 layers x K and V x 64 bytes
  EXPECT_EQ(thrown([&] { kvplug::TierCopier c(k, v, 8, 40, 64, 64, tier); }), KVP_ERR_INVALID_ARGUMENT);
  const kvp_status here = thrown([] { kvplug::attn::prepare(); });
  ASSERT_TRUE(here == KVP_OK || here == KVP_ERR_NO_DEVICE || here == KVP_ERR_UNSUPPORTED) << here;
  const kvp_status st = thrown([&] {
    kvplug::TierCopier c(k, v, 8, 64, 64, 64, tier);
    EXPECT_NE(c.get(), nullptr);
    c.run(kvplug::CopyBatch{});  // nothing to copy
  });
  EXPECT_EQ(st, here) << "the copier answers " << kvplug::status_string(st) << ", the kernels "
                      << kvplug::status_string(here);
}

namespace {

// An e4m3 layer [8 blocks, kBlock tokens, 2 kv heads, 64] with per-token-head
// scales [8, kBlock, 2] float32, at made-up device addresses (a copier
// keeps the addresses, and its creation reads none).
constexpr int32_t kE4m3Heads = 2, kE4m3HeadDim = 64;
constexpr int64_t kE4m3Block = int64_t{kBlock} * kE4m3Heads * kE4m3HeadDim;  // bytes of a block (one byte an element)
constexpr int64_t kScaleBlock = int64_t{kBlock} * kE4m3Heads * 4;            // bytes of a block's scales

kvp_paged_kv e4m3_layer(uint64_t base) {
  kvp_paged_kv d = KVP_PAGED_KV_INIT;
  d.dtype = KVP_DTYPE_E4M3;
  d.num_kv_heads = kE4m3Heads;
  d.num_blocks = 8;
  d.block_size = kBlock;
  d.head_dim = kE4m3HeadDim;
  d.k_cache = base;
  d.v_cache = base + 0x10000;
  d.block_stride = kE4m3Block;  // elements
  d.token_stride = int64_t{kE4m3Heads} * kE4m3HeadDim;
  d.head_stride = kE4m3HeadDim;
  d.k_scale = base + 0x20000;
  d.v_scale = base + 0x30000;
  d.scale_kind = KVP_KV_SCALE_TOKEN_HEAD;
  return d;
}

// Whether status st of a copier that should have been created matches this
// machine's kernels (here, what kvplug::attn::prepare answers): NO_DEVICE or
// UNSUPPORTED where they do, and a copier where they run, except that stores
// by the copy engines answer UNSUPPORTED on a driver older than CUDA 12.8.
::testing::AssertionResult created_as_here(kvp_status st, kvp_status here, kvplug::StoreEngine e) {
  if (st == here || (here == KVP_OK && e == kvplug::StoreEngine::copy_engine && st == KVP_ERR_UNSUPPORTED)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "the copier answers " << kvplug::status_string(st) << ", the kernels "
                                       << kvplug::status_string(here);
}

// Whether f throws a kvplug::Error of status want whose message has
// fragment (the library's words for what it refused).
template <class F>
::testing::AssertionResult refuses(F &&f, kvp_status want, const std::string &fragment) {
  try {
    f();
  } catch (const kvplug::Error &e) {
    const std::string what = e.what();
    if (e.status() == want && what.find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << kvplug::status_string(e.status()) << " \"" << what << "\", not "
                                         << kvplug::status_string(want) << " naming \"" << fragment << "\"";
  }
  return ::testing::AssertionFailure() << "nothing thrown, not " << kvplug::status_string(want);
}

}  // namespace

// The tier copier over per-layer kvp_paged_kv descriptors, the form that
// takes an e4m3 cache with its scales: the library checks the layers, the
// scales, the host slots and the store engine before it touches a device,
// so each bad input is refused with its own status on any machine, and a
// good layout is created as this machine's kernels allow.
TEST(TierCopier, E4m3LayersWithScales) {
  constexpr int64_t kv_bytes = 2 * 2 * kE4m3Block;          // 2 layers x K, V of e4m3 bytes
  constexpr int64_t slot = kv_bytes + 2 * 2 * kScaleBlock;  // and their scales
  static_assert(slot % 16 == 0 && kScaleBlock % 16 == 0, "the layout must be valid");
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.host_tier_slots = 4;
  cfg.host_block_bytes = slot;
  kvplug::Manager m(cfg);
  kvplug::HostTier tier(m);
  ASSERT_EQ(tier.slot_bytes(), slot);
  const std::vector<kvp_paged_kv> good{e4m3_layer(0x1000000), e4m3_layer(0x2000000)};
  const kvp_status here = thrown([] { kvplug::attn::prepare(); });
  ASSERT_TRUE(here == KVP_OK || here == KVP_ERR_NO_DEVICE || here == KVP_ERR_UNSUPPORTED) << here;

  // Good layouts, by either engine, over the manager's slots and over raw
  // memory, the descriptors in one array or by address.
  for (const auto e : {kvplug::StoreEngine::kernel, kvplug::StoreEngine::copy_engine}) {
    EXPECT_TRUE(created_as_here(thrown([&] {
                                  kvplug::TierCopier c(good, tier, e);
                                  EXPECT_NE(c.get(), nullptr);
                                  c.run(kvplug::CopyBatch{});  // nothing to copy
                                }),
                                here, e));
    const std::vector<const kvp_paged_kv *> ptrs{&good[0], &good[1]};
    EXPECT_TRUE(created_as_here(thrown([&] { kvplug::TierCopier c(ptrs, tier.slot(0), slot, 4, e); }), here, e));
  }
  // K only: a scale array a layer, and slots of K and its scales.
  {
    auto k_only = good;
    for (auto &d : k_only) d.v_cache = d.v_scale = 0;
    EXPECT_TRUE(created_as_here(
        thrown([&] { kvplug::TierCopier c(k_only, tier.slot(0), 2 * (kE4m3Block + kScaleBlock), 4); }), here,
        kvplug::StoreEngine::kernel));
  }
  // A per-cache (tensor) scale stays with the engine: slots of the e4m3
  // bytes alone take such a cache, and not one with token-head scales.
  {
    auto tensor = good;
    for (auto &d : tensor) d.scale_kind = KVP_KV_SCALE_TENSOR;
    EXPECT_TRUE(created_as_here(thrown([&] { kvplug::TierCopier c(tensor, tier.slot(0), kv_bytes, 4); }), here,
                                kvplug::StoreEngine::kernel));
    const std::string need = "at least the layout's " + std::to_string(slot);
    EXPECT_TRUE(refuses([&] { kvplug::TierCopier c(good, tier.slot(0), kv_bytes, 4); }, KVP_ERR_INVALID_ARGUMENT,
                        need));
    EXPECT_TRUE(refuses([&] { kvplug::TierCopier c(good, tier.slot(0), slot - 16, 4); }, KVP_ERR_INVALID_ARGUMENT,
                        need));
  }

  // Bad layers, refused before any device is touched.
  auto refused = [&](auto &&change, kvp_status want, const std::string &fragment) {
    auto layers = good;
    change(layers);
    return refuses([&] { kvplug::TierCopier c(layers, tier); }, want, fragment);
  };
  // Scales missing: V scales (K scales without them), K scales, both.
  EXPECT_TRUE(refused([](auto &l) { l[1].v_scale = 0; }, KVP_ERR_NULL_POINTER, "kv[1] is e4m3 without"));
  EXPECT_TRUE(refused([](auto &l) { l[0].k_scale = 0; }, KVP_ERR_NULL_POINTER, "kv[0] is e4m3 without"));
  EXPECT_TRUE(refused([](auto &l) { l[0].k_scale = l[0].v_scale = 0; }, KVP_ERR_NULL_POINTER, "kv[0] is e4m3 without"));
  // No scale kind, an unknown one, or another one in a later layer.
  EXPECT_TRUE(refused([](auto &l) { l[0].scale_kind = KVP_KV_SCALE_NONE; }, KVP_ERR_INVALID_ARGUMENT, "scale_kind 0"));
  EXPECT_TRUE(refused([](auto &l) { l[0].scale_kind = 3; }, KVP_ERR_INVALID_ARGUMENT, "scale_kind 3"));
  EXPECT_TRUE(refused([](auto &l) { l[1].scale_kind = KVP_KV_SCALE_TENSOR; }, KVP_ERR_INVALID_ARGUMENT,
                      "kv[1] has another shape"));
  // Scales on a 16-bit cache.
  EXPECT_TRUE(refused(
      [](auto &l) {
        for (auto &d : l) d.dtype = KVP_DTYPE_F16;
      },
      KVP_ERR_INVALID_ARGUMENT, "not e4m3 but has"));
  // A block's scales not a multiple of 16 bytes (1 token x 2 heads x 4 bytes).
  EXPECT_TRUE(refused(
      [](auto &l) {
        for (auto &d : l) {
          d.block_size = 1;
          d.block_stride = d.token_stride;
        }
      },
      KVP_ERR_INVALID_ARGUMENT, "block's scales"));
  // A scale array not 16-byte aligned.
  EXPECT_TRUE(refused([](auto &l) { l[1].v_scale += 8; }, KVP_ERR_INVALID_ARGUMENT, "layer 1's V scale address"));
  // Layers of different shapes; tokens that are not dense rows.
  EXPECT_TRUE(refused([](auto &l) { l[1].num_kv_heads = 1; }, KVP_ERR_INVALID_ARGUMENT, "kv[1] has another shape"));
  EXPECT_TRUE(refused(
      [](auto &l) {
        for (auto &d : l) d.head_stride *= 2;
      },
      KVP_ERR_INVALID_ARGUMENT, "dense rows"));
  // No layers; a NULL descriptor; a store engine the library does not know
  // (kvp_kv_layers.flags), through both forms.
  EXPECT_TRUE(refuses([&] { kvplug::TierCopier c(std::vector<kvp_paged_kv>{}, tier); }, KVP_ERR_INVALID_ARGUMENT,
                      "num_layers"));
  EXPECT_TRUE(refuses(
      [&] {
        const std::vector<const kvp_paged_kv *> ptrs{&good[0], nullptr};
        kvplug::TierCopier c(ptrs, tier);
      },
      KVP_ERR_NULL_POINTER, "kv[1] must not be NULL"));
  const auto unknown = static_cast<kvplug::StoreEngine>(2);
  EXPECT_TRUE(refuses([&] { kvplug::TierCopier c(good, tier, unknown); }, KVP_ERR_INVALID_ARGUMENT, "flags"));
  EXPECT_TRUE(refuses(
      [&] { kvplug::TierCopier c({0x10000, 0x20000}, {0x30000, 0x40000}, 8, 64, 64, 64, tier, unknown); },
      KVP_ERR_INVALID_ARGUMENT, "flags"));
  // The address form takes the store engine too.
  EXPECT_TRUE(created_as_here(thrown([&] {
                                kvplug::TierCopier c({0x10000, 0x20000}, {0x30000, 0x40000}, 8, 64, 64, 64, tier,
                                                     kvplug::StoreEngine::copy_engine);
                              }),
                              here, kvplug::StoreEngine::copy_engine));
}

// A block the host tier stores is reported with its medium: the GPU's
// BLOCK_STORED first, then, once the demotion's copy completes, the same
// hash again with medium CPU.
TEST(PrefixCache, EventsCarryTheirMedium) {
  kvp_manager_config cfg = KVP_MANAGER_CONFIG_INIT;
  cfg.num_blocks = 8;
  cfg.block_size = kBlock;
  cfg.enable_prefix_cache = 1;
  cfg.enable_kv_events = 1;
  cfg.host_tier_slots = 16;
  cfg.host_block_bytes = 64;
  cfg.demote_ahead = 8;
  kvplug::Manager m(cfg);
  kvplug::PrefixCache pc(m);
  kvplug::HostTier tier(m);
  kvplug::Prompts p;
  p.add(iota(100, 2 * kBlock + 1));
  pc.admit(std::vector<int64_t>{1}, p);
  EXPECT_EQ(tier.flush_copies().ticket, 0u);  // the step's flush: its blocks are not written yet
  m.mark_computed();
  m.remove(std::vector<int64_t>{1});
  const auto b = tier.flush_copies();
  ASSERT_EQ(b.demote.size(), 2u);
  tier.complete_copies(b.ticket);
  std::map<int32_t, std::vector<kvplug::BlockHash>> stored;  // medium -> hashes
  for (const auto &e : pc.drain_events()) {
    if (e.kind == KVP_KV_EVENT_BLOCK_STORED) stored[e.medium].push_back(e.hash);
  }
  ASSERT_EQ(stored[KVP_MEDIUM_GPU].size(), 2u);
  EXPECT_EQ(stored[KVP_MEDIUM_CPU], stored[KVP_MEDIUM_GPU]);
  m.check();
}
