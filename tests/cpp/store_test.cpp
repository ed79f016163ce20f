// Tests of the C++ wrapper's standalone stores (kvplug::HostStore,
// kvplug::SharedStore): the host store's round trips and its refusals as
// exceptions carrying the C status; the shared store against a server that
// is down (misses and skipped stores, counted, never a throw). No test here
// starts a server: the live round trip of the shared store is covered by
// the Go and Python tests (internal/redistest).
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kvplug.hpp"
#include "thrown.hpp"

namespace {

static_assert(!std::is_copy_constructible<kvplug::HostStore>::value, "HostStore must be move-only");
static_assert(std::is_nothrow_move_constructible<kvplug::HostStore>::value, "");
static_assert(!std::is_copy_constructible<kvplug::SharedStore>::value, "SharedStore must be move-only");
static_assert(std::is_nothrow_move_constructible<kvplug::SharedStore>::value, "");

using Keys = std::vector<uint64_t>;
using Slots = std::vector<int32_t>;

// The counters and gauges of two stats, compared field by field.
void expect_same(const kvp_host_store_stats &a, const kvp_host_store_stats &b, const char *what) {
  EXPECT_EQ(a.reserves, b.reserves) << what;
  EXPECT_EQ(a.commits, b.commits) << what;
  EXPECT_EQ(a.aborts, b.aborts) << what;
  EXPECT_EQ(a.refused_full, b.refused_full) << what;
  EXPECT_EQ(a.skipped_present, b.skipped_present) << what;
  EXPECT_EQ(a.evictions, b.evictions) << what;
  EXPECT_EQ(a.hits, b.hits) << what;
  EXPECT_EQ(a.misses, b.misses) << what;
  EXPECT_EQ(a.stale, b.stale) << what;
  EXPECT_EQ(a.resets, b.resets) << what;
  EXPECT_EQ(a.resident, b.resident) << what;
  EXPECT_EQ(a.pending, b.pending) << what;
  EXPECT_EQ(a.pinned, b.pinned) << what;
}

// A block's way through the store: reserved, written in two segments,
// completed, found by lookup_prefix, pinned, read back in four, unpinned.
TEST(HostStore, RoundTrip) {
  kvplug::HostStore s(4, 32);
  EXPECT_EQ(s.num_slots(), 4);
  EXPECT_EQ(s.slot_bytes(), 32);
  ASSERT_NE(s.base(), nullptr);

  auto r = s.reserve(Keys{10, 11});
  EXPECT_EQ(r.slots, (Slots{0, 1}));
  EXPECT_TRUE(r.evicted.empty());
  auto st = s.state(Keys{10, 12});
  EXPECT_EQ(st.states, (Slots{KVP_HOST_KEY_PENDING, KVP_HOST_KEY_ABSENT}));
  EXPECT_EQ(st.slots, (Slots{0, -1}));

  std::vector<uint8_t> a(32, 1), b(32, 2);
  b[31] = 9;
  std::vector<const void *> in{a.data(), a.data() + 16, b.data(), b.data() + 16};
  std::vector<int64_t> halves(4, 16);
  s.write(r.slots, in, halves, 2);
  EXPECT_EQ(std::memcmp(s.slot(r.slots[1]), b.data(), 32), 0);

  // Pending: not readable, a pin misses.
  std::vector<uint8_t> back(32);
  EXPECT_EQ(thrown([&] { s.read(r.slots[0], back.data(), 32); }), KVP_ERR_NOT_FOUND);
  auto miss = s.pin(Keys{10});
  EXPECT_EQ(miss.pinned, 0);
  EXPECT_EQ(miss.slots, (Slots{-1}));

  EXPECT_EQ(s.complete(Keys{10, 11, 12}), 2);  // 12 is stale
  EXPECT_EQ(s.lookup_prefix(Keys{10, 11, 12, 10}), 2);
  st = s.state(Keys{11, 12});
  EXPECT_EQ(st.states, (Slots{KVP_HOST_KEY_RESIDENT, KVP_HOST_KEY_ABSENT}));
  EXPECT_EQ(st.slots, (Slots{1, -1}));

  auto p = s.pin(Keys{11, 10});
  EXPECT_EQ(p.pinned, 2);
  EXPECT_EQ(p.slots, (Slots{1, 0}));
  std::vector<uint8_t> o0(32), o1(32);
  std::vector<void *> out{o0.data(), o0.data() + 8, o0.data() + 16, o0.data() + 24,
                          o1.data(), o1.data() + 8, o1.data() + 16, o1.data() + 24};
  s.read(p.slots, out, std::vector<int64_t>(8, 8), 4);
  EXPECT_EQ(o0, b);
  EXPECT_EQ(o1, a);
  s.read(p.slots[0], back.data(), 32);
  EXPECT_EQ(back, b);
  EXPECT_EQ(s.unpin(Keys{10, 11, 10}), 2);  // the second 10 has no pin: stale

  const auto x = s.stats();
  EXPECT_EQ(x.num_slots, 4);
  EXPECT_EQ(x.reserves, 2);
  EXPECT_EQ(x.commits, 2);
  EXPECT_EQ(x.aborts, 0);
  EXPECT_EQ(x.stale, 2);
  EXPECT_EQ(x.resident, 2);
  EXPECT_EQ(x.pending, 0);
  EXPECT_EQ(x.pinned, 0);
  EXPECT_GE(x.hits, 4);    // lookup_prefix 2, pin 2
  EXPECT_GE(x.misses, 2);  // pin of the pending 10, lookup_prefix's 12
}

// A failed copy gives the slot back; a repeated key is skipped.
TEST(HostStore, AbortAndSkip) {
  kvplug::HostStore s(2);
  EXPECT_EQ(s.base(), nullptr);
  EXPECT_EQ(thrown([&] { s.slot(0); }), KVP_ERR_UNSUPPORTED);
  auto r = s.reserve(Keys{5, 5});
  EXPECT_EQ(r.slots[1], -1);
  EXPECT_GE(r.slots[0], 0);
  EXPECT_EQ(s.complete(Keys{5}, /*failed=*/true), 1);
  EXPECT_EQ(s.state(Keys{5}).states, (Slots{KVP_HOST_KEY_ABSENT}));
  EXPECT_EQ(s.reserve(Keys{5}).slots, (Slots{r.slots[0]}));
  EXPECT_EQ(s.reserve(Keys{5}).slots, (Slots{-1}));  // pending already
  const auto x = s.stats();
  EXPECT_EQ(x.aborts, 1);
  EXPECT_EQ(x.skipped_present, 2);
  EXPECT_EQ(x.pending, 1);
  EXPECT_EQ(x.pinned, 1);  // a pending slot is pinned
}

// Eviction follows the LRU (touch moves a key up); pinned and pending
// slots are never evicted; a batch that does not fit changes nothing.
TEST(HostStore, EvictionAndRefusal) {
  kvplug::HostStore s(2);
  s.reserve(Keys{1, 2});
  s.complete(Keys{1, 2});
  s.touch(Keys{1, 99});  // 2 is now the least recently used; 99 is ignored
  auto r = s.reserve(Keys{3});
  EXPECT_EQ(r.evicted, (Keys{2}));
  s.complete(Keys{3});
  EXPECT_EQ(s.pin(Keys{1}).pinned, 1);

  const auto before = s.stats();
  EXPECT_EQ(thrown([&] { s.reserve(Keys{4, 5}); }), KVP_ERR_OUT_OF_BLOCKS);
  kvplug::HostStoreReservation kept;
  kept.slots = {7};
  EXPECT_FALSE(s.try_reserve(Keys{4, 5}, kept));
  EXPECT_EQ(kept.slots, (Slots{7}));  // untouched
  auto after = s.stats();
  EXPECT_EQ(after.refused_full, before.refused_full + 4);
  after.refused_full = before.refused_full;
  expect_same(before, after, "a refused reserve");

  // One fits: 3 is evicted, 1 stays (pinned).
  ASSERT_TRUE(s.try_reserve(Keys{4}, kept));
  EXPECT_EQ(kept.evicted, (Keys{3}));
  EXPECT_EQ(s.stats().evictions, 2);
}

// clear() (kvp_host_store_reset) drops pending and pinned blocks; later
// completes and unpins of their keys are stale, pins miss.
TEST(HostStore, ClearMakesKeysStale) {
  kvplug::HostStore s(4, 8);
  s.reserve(Keys{1, 2});
  s.complete(Keys{1});
  s.pin(Keys{1});
  const auto r = s.reserve(Keys{3});
  EXPECT_EQ(s.clear(), 3);
  auto x = s.stats();
  EXPECT_EQ(x.resets, 1);
  EXPECT_EQ(x.resident + x.pending + x.pinned, 0);
  EXPECT_EQ(s.complete(Keys{2, 3}), 0);
  EXPECT_EQ(s.unpin(Keys{1}), 0);
  EXPECT_EQ(s.pin(Keys{1}).slots, (Slots{-1}));
  EXPECT_EQ(s.lookup_prefix(Keys{1}), 0);
  uint64_t v = 0;
  EXPECT_EQ(thrown([&] { s.write(r.slots[0], &v, 8); }), KVP_ERR_NOT_FOUND);  // no longer pending
  EXPECT_EQ(s.stats().stale, x.stale + 3);
  EXPECT_EQ(s.clear(), 0);
}

// Bad configs and arguments throw with the C status and change nothing.
TEST(HostStore, BadInputsThrow) {
  EXPECT_EQ(thrown([] { kvplug::HostStore(0); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::HostStore(-3); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::HostStore((1 << 30) + 1); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::HostStore(4, -1); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::HostStore(1 << 20, int64_t(1) << 30); }), KVP_ERR_INVALID_ARGUMENT);
  kvp_host_store_config cfg = KVP_HOST_STORE_CONFIG_INIT;
  cfg.num_slots = 4;
  cfg.reserved = 1;
  EXPECT_EQ(thrown([&] { kvplug::HostStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg.reserved = 0;
  cfg.struct_size = 0;
  EXPECT_EQ(thrown([&] { kvplug::HostStore{cfg}; }), KVP_ERR_STRUCT_SIZE);

  kvplug::HostStore s(2, 16);
  auto r = s.reserve(Keys{1});
  const auto before = s.stats();
  const Keys none;
  EXPECT_EQ(thrown([&] { s.reserve(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.complete(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.pin(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.unpin(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.touch(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.lookup_prefix(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.state(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.reserve(Keys(KVP_MAX_BATCH + 1, 7)); }), KVP_ERR_INVALID_ARGUMENT);

  std::vector<uint8_t> buf(16);
  const void *p = buf.data();
  void *q = buf.data();
  EXPECT_EQ(thrown([&] { s.write(2, p, 16); }), KVP_ERR_INVALID_ARGUMENT);   // slot out of range
  EXPECT_EQ(thrown([&] { s.write(-1, p, 16); }), KVP_ERR_INVALID_ARGUMENT);  // slot out of range
  EXPECT_EQ(thrown([&] { s.write(r.slots[0], p, 15); }), KVP_ERR_INVALID_ARGUMENT);  // not slot_bytes
  EXPECT_EQ(thrown([&] { s.write(r.slots[0], p, -16); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.write(r.slots[0], nullptr, 16); }), KVP_ERR_NULL_POINTER);
  EXPECT_EQ(thrown([&] { s.write(1 - r.slots[0], p, 16); }), KVP_ERR_NOT_FOUND);  // free slot
  EXPECT_EQ(thrown([&] { s.read(r.slots[0], q, 16); }), KVP_ERR_NOT_FOUND);       // pending
  // Scatter lists whose sizes disagree, and segs out of range.
  const std::vector<const void *> ptrs{p, p};
  EXPECT_EQ(thrown([&] { s.write(r.slots, ptrs, std::vector<int64_t>{16}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.write(r.slots, ptrs, std::vector<int64_t>{8, 8}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.write(r.slots, ptrs, std::vector<int64_t>{8, 8}, 0); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.write(r.slots, ptrs, std::vector<int64_t>{8, 8}, 4097); }), KVP_ERR_INVALID_ARGUMENT);
  expect_same(before, s.stats(), "failed calls");

  // A bookkeeping-only store has nothing to copy.
  kvplug::HostStore bare(2);
  auto rb = bare.reserve(Keys{1});
  EXPECT_EQ(thrown([&] { bare.write(rb.slots[0], p, 16); }), KVP_ERR_UNSUPPORTED);

  // A moved-from or reset store is no handle.
  kvplug::HostStore moved = std::move(s);
  EXPECT_FALSE(s);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(thrown([&] { s.stats(); }), KVP_ERR_INVALID_HANDLE);
  EXPECT_EQ(moved.state(Keys{1}).states, (Slots{KVP_HOST_KEY_PENDING}));
  moved.reset();
  EXPECT_EQ(thrown([&] { moved.pin(Keys{1}); }), KVP_ERR_INVALID_HANDLE);
}

TEST(HostStore, ReleaseAndAdopt) {
  kvplug::HostStore s(3);
  s.reserve(Keys{42});
  kvp_host_store *h = s.release();
  ASSERT_NE(h, nullptr);
  EXPECT_FALSE(s);
  auto t = kvplug::HostStore::adopt(h);
  EXPECT_EQ(t.get(), h);
  EXPECT_EQ(t.stats().pending, 1);
}

kvplug::SharedKey key(uint8_t b) {
  kvplug::SharedKey k{};
  k.fill(b);
  return k;
}

// Against a port nothing listens on: every call returns (misses, nothing
// stored), the buffers of a get are left alone, the faults are counted,
// and none throws.
TEST(SharedStore, DownServerMisses) {
  kvp_shared_store_config cfg = KVP_SHARED_STORE_CONFIG_INIT;
  cfg.address = "127.0.0.1:1";
  cfg.key_space = "cpp_test";
  cfg.op_timeout_ms = 200;
  cfg.dial_timeout_ms = 100;
  kvplug::SharedStore s(cfg);
  const std::vector<kvplug::SharedKey> keys{key(1), key(2)};
  EXPECT_EQ(s.exists(keys), (Slots{0, 0}));

  std::vector<uint8_t> a(64, 3), b(64, 4);
  EXPECT_EQ(s.put(keys, std::vector<const void *>{a.data(), b.data()}, std::vector<int64_t>{64, 64}), 0);
  std::vector<uint8_t> o0(64, 0xee), o1(64, 0xee);
  std::vector<void *> out{o0.data(), o0.data() + 32, o1.data(), o1.data() + 32};
  EXPECT_EQ(s.get(keys, out, std::vector<int64_t>(4, 32), 2), (Slots{0, 0}));
  EXPECT_EQ(o0, std::vector<uint8_t>(64, 0xee));
  EXPECT_EQ(o1, std::vector<uint8_t>(64, 0xee));

  const auto x = s.stats();
  EXPECT_EQ(x.hits, 0);
  EXPECT_EQ(x.stores, 0);
  EXPECT_EQ(x.misses, 4);  // every key of exists and get
  EXPECT_GE(x.errors + x.timeouts, 1);
  EXPECT_EQ(x.errors + x.timeouts + x.skipped, 3);  // each call failed or was skipped
  EXPECT_EQ(x.available, 0);                         // in the skip window
  EXPECT_EQ(x.bytes_read, 0);
  EXPECT_EQ(x.bytes_written, 0);
}

// The security fields (AUTH, TLS, the MAC): their form is checked at
// create, a secret's variable is read with getenv (a variable the host set
// after loading the library counts), and a config of the first released
// size still works.
TEST(SharedStore, SecurityFields) {
  auto base = [] {
    kvp_shared_store_config c = KVP_SHARED_STORE_CONFIG_INIT;
    c.address = "127.0.0.1:1";
    c.key_space = "cpp_test";
    c.op_timeout_ms = 200;
    return c;
  };
  kvp_shared_store_config cfg = base();
  cfg.tls_ca_file = "ca.pem";  // TLS settings on a plaintext connection
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg = base();
  cfg.username = "kv";  // no password
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg = base();
  cfg.tls = 2;
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg = base();
  cfg.reserved2 = 1;
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg = base();
  cfg.password_env = "KVPLUG_CPP_TEST_UNSET";
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg.password_env = "not a variable name";  // perhaps the secret itself: not quoted back
  try {
    kvplug::SharedStore{cfg};
    ADD_FAILURE() << "an environment variable name with spaces accepted";
  } catch (const kvplug::Error &e) {
    EXPECT_EQ(e.status(), KVP_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(e.what()).find("not a variable name"), std::string::npos) << e.what();
  }

  // Set after the library was loaded: seen through getenv.
  ASSERT_EQ(setenv("KVPLUG_CPP_TEST_MAC", "00112233445566778899aabbccddeeff", 1), 0);
  ASSERT_EQ(setenv("KVPLUG_CPP_TEST_PASSWORD", "a password", 1), 0);
  cfg = base();
  cfg.username = "kv";
  cfg.password_env = "KVPLUG_CPP_TEST_PASSWORD";
  cfg.mac_keys_env = "KVPLUG_CPP_TEST_MAC";
  cfg.tls = 1;  // the system's roots, the address's host
  kvplug::SharedStore s(cfg);
  EXPECT_EQ(s.exists(std::vector<kvplug::SharedKey>{key(1)}), (Slots{0}));
  const auto x = s.stats();
  EXPECT_EQ(x.errors + x.timeouts, 1);  // nothing listens: not a TLS or AUTH failure
  EXPECT_EQ(x.tls_failures, 0);
  EXPECT_EQ(x.auth_failures, 0);
  EXPECT_EQ(x.mac_failures, 0);

  cfg = base();
  cfg.struct_size = offsetof(kvp_shared_store_config, reserved) + sizeof cfg.reserved;  // the first released size
  kvplug::SharedStore old(cfg);
  kvp_shared_store_stats st = KVP_SHARED_STORE_STATS_INIT;
  st.struct_size = offsetof(kvp_shared_store_stats, reserved) + sizeof st.reserved;
  st.auth_failures = 77;
  ASSERT_EQ(kvplug::detail::shared_store_api().kvp_shared_store_stats_get(old.get(), &st), KVP_OK);
  EXPECT_EQ(st.auth_failures, 77);  // past the caller's size: untouched
}

TEST(SharedStore, BadInputsThrow) {
  EXPECT_EQ(thrown([] { kvplug::SharedStore("127.0.0.1:1", "bad space"); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::SharedStore("127.0.0.1:1", std::string(65, 'a')); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::SharedStore("127.0.0.1:1", "ok", 0, -1); }), KVP_ERR_INVALID_ARGUMENT);
  kvp_shared_store_config cfg = KVP_SHARED_STORE_CONFIG_INIT;
  cfg.key_space = "ok";
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_NULL_POINTER);  // no address
  cfg.address = "127.0.0.1:1";
  cfg.op_timeout_ms = -1;
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg.op_timeout_ms = 0;
  cfg.reserved = 1;
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_INVALID_ARGUMENT);
  cfg.reserved = 0;
  cfg.struct_size = 0;
  EXPECT_EQ(thrown([&] { kvplug::SharedStore{cfg}; }), KVP_ERR_STRUCT_SIZE);

  kvplug::SharedStore s("127.0.0.1:1", "cpp_test");
  const std::vector<kvplug::SharedKey> none, one{key(9)};
  std::vector<uint8_t> buf(8);
  const std::vector<const void *> in{buf.data()};
  const std::vector<void *> out{buf.data()};
  EXPECT_EQ(thrown([&] { s.exists(none); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.put(none, {}, {}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.put(one, in, std::vector<int64_t>{-8}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.put(one, in, std::vector<int64_t>{8}, 0); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.put(one, in, std::vector<int64_t>{8, 8}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.get(one, out, std::vector<int64_t>{-1}); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([&] { s.get(none, {}, {}); }), KVP_ERR_INVALID_ARGUMENT);
  // Argument errors never reach the server: nothing counted.
  const auto x = s.stats();
  EXPECT_EQ(x.misses + x.errors + x.timeouts + x.skipped, 0);
  EXPECT_EQ(x.available, 1);

  kvplug::SharedStore moved = std::move(s);
  EXPECT_EQ(thrown([&] { s.stats(); }), KVP_ERR_INVALID_HANDLE);  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(moved);
  kvp_shared_store *h = moved.release();
  auto back = kvplug::SharedStore::adopt(h);
  EXPECT_EQ(back.get(), h);
}

}  // namespace
