// Tests of kvplug::cascade::plan from a Manager without a GPU: the host-only
// plan finds the sharing forks make, and errors come back as exceptions
// with the C status.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvplug.hpp"
#include "thrown.hpp"

namespace {

kvp_cascade_plan_args host_only_args(int32_t max_blocks) {
  kvp_cascade_plan_args a = KVP_CASCADE_PLAN_ARGS_INIT;
  a.dtype = KVP_DTYPE_F16;
  a.head_dim = 128;
  a.num_q_heads = 32;
  a.num_kv_heads = 8;
  a.max_blocks_per_seq = max_blocks;
  return a;  // no workspaces: the host-only summary
}

TEST(CascadeManager, ForksShareAllButTheirTails) {
  kvplug::Manager m(1024, 16);
  m.add(1, 2000);  // 125 whole blocks
  m.fork(1, std::vector<int64_t>{2, 3, 4, 5});
  std::vector<int64_t> ids{5, 1, 3, 2, 4};
  m.grow(ids, 1);
  kvp_cascade_plan_args a = host_only_args(200);
  a.flags = KVP_CASCADE_NO_DECODE_ROUTE;  // whether it pays is the planner's cost model's call
  kvp_attn_plan p = kvplug::cascade::plan(m, ids, a);
  EXPECT_EQ(p.kind, KVP_ATTN_PLAN_CASCADE);
  EXPECT_EQ(p.route, KVP_ATTN_ROUTE_CASCADE);
  EXPECT_EQ(p.batch, 5);
  // saved: the 125 shared blocks read once, not 5 times; total: what plain decode reads
  EXPECT_EQ(p.state[KVP_PLAN_STATE_SAVED_TOKENS], 4u * 2000u);
  EXPECT_EQ(p.state[KVP_PLAN_STATE_TOTAL_TOKENS], 5u * 2001u);
  EXPECT_EQ(p.workspace, 0u);
  EXPECT_EQ(p.state[KVP_PLAN_STATE_HOST_WORKSPACE], 0u);
  // A host-only plan names no workspace: it cannot be updated.
  std::vector<int32_t> lens(5, 2001);
  EXPECT_EQ(thrown([&] { kvplug::cascade::update(p, lens.data(), 5); }), KVP_ERR_INVALID_ARGUMENT);
}

TEST(CascadeManager, NoSharingIsTheDecodeRoute) {
  kvplug::Manager m(1024, 16);
  m.add(1, 500);
  m.add(2, 700);
  kvp_attn_plan p = kvplug::cascade::plan(m, std::vector<int64_t>{1, 2}, host_only_args(64));
  EXPECT_EQ(p.route, KVP_ATTN_ROUTE_DECODE);
  EXPECT_EQ(p.state[KVP_PLAN_STATE_SAVED_TOKENS], 0u);
  EXPECT_EQ(p.state[KVP_PLAN_STATE_TOTAL_TOKENS], 1200u);
}

TEST(CascadeManager, Errors) {
  kvplug::Manager m(1024, 16);
  m.add(1, 500);  // 32 blocks
  std::vector<int64_t> one{1};
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, std::vector<int64_t>{1, 9}, host_only_args(64)); }),
            KVP_ERR_UNKNOWN_SEQUENCE);
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, one, host_only_args(16)); }), KVP_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, one, host_only_args(0)); }), KVP_ERR_INVALID_ARGUMENT);
  kvp_cascade_plan_args a = host_only_args(64);
  std::vector<int32_t> table(64, 0);
  a.block_table_host = table.data();  // the tables are the manager's
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, one, a); }), KVP_ERR_INVALID_ARGUMENT);
  a = host_only_args(64);
  a.dtype = KVP_DTYPE_F32;
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, one, a); }), KVP_ERR_UNSUPPORTED);
  a = host_only_args(64);
  auto sz = kvplug::cascade::workspace_size(1, 32, 8, 128);
  std::vector<int32_t> host(sz.host / 4);
  a.host_workspace = host.data();  // one workspace without the other: not host-only
  a.host_workspace_bytes = sz.host;
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(m, one, a); }), KVP_ERR_NULL_POINTER);
  kvplug::Manager closed(16, 16);
  closed.reset();
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(closed, one, host_only_args(64)); }), KVP_ERR_INVALID_HANDLE);
}

}  // namespace
