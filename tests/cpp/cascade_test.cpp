// Tests of the C++ wrapper's shared-prefix attention calls without a GPU:
// workspace sizes, argument errors as exceptions with the C status, and the
// args struct's _INIT (every field 0 but struct_size).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvplug.hpp"
#include "thrown.hpp"

namespace {

TEST(Cascade, WorkspaceSizesGrowWithCapacity) {
  auto a = kvplug::cascade::workspace_size(16, 32, 8, 128);
  auto b = kvplug::cascade::workspace_size(64, 32, 8, 128);
  EXPECT_GT(a.device, 0u);
  EXPECT_GT(a.host, 0u);
  EXPECT_GT(b.device, a.device);
  EXPECT_GT(b.host, a.host);
  EXPECT_EQ(thrown([] { kvplug::cascade::workspace_size(0, 32, 8, 128); }), KVP_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(thrown([] { kvplug::cascade::workspace_size(8, 32, 8, 96); }), KVP_ERR_UNSUPPORTED);
}

TEST(Cascade, InitLeavesEveryFieldZero) {
  kvp_cascade_plan_args a = KVP_CASCADE_PLAN_ARGS_INIT;
  EXPECT_EQ(a.struct_size, sizeof(kvp_cascade_plan_args));
  kvp_cascade_plan_args z;
  std::memset(&z, 0, sizeof z);
  z.struct_size = sizeof z;
  EXPECT_EQ(std::memcmp(&a, &z, sizeof a), 0);
}

TEST(Cascade, PlanErrorsAreStatuses) {
  kvp_cascade_plan_args a = KVP_CASCADE_PLAN_ARGS_INIT;
  a.dtype = KVP_DTYPE_F32;  // the cascade kernels are f16/bf16
  a.head_dim = 128;
  a.num_q_heads = 32;
  a.num_kv_heads = 8;
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(a); }), KVP_ERR_UNSUPPORTED);
  a.dtype = KVP_DTYPE_F16;
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(a); }), KVP_ERR_NULL_POINTER);  // no host workspace
  a.struct_size = 8;
  EXPECT_EQ(thrown([&] { kvplug::cascade::plan(a); }), KVP_ERR_STRUCT_SIZE);
}

TEST(Cascade, RunAndUpdateRefuseOtherPlans) {
  kvp_attn_plan plan = KVP_ATTN_PLAN_INIT;  // kind 0: not planned
  kvp_paged_prefill_args a = KVP_PAGED_PREFILL_ARGS_INIT;
  EXPECT_EQ(thrown([&] { kvplug::cascade::paged_cascade(plan, a); }), KVP_ERR_INVALID_ARGUMENT);
  std::vector<int32_t> lens{1, 2};
  EXPECT_EQ(thrown([&] { kvplug::cascade::update(plan, lens.data(), 2); }), KVP_ERR_INVALID_ARGUMENT);
}

}  // namespace
