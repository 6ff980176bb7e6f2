// PlanShards: every plan is checked by brute force against the split rules of
// sharding/shard_plan.h — each query head, MLP channel, expert channel and
// vocab row held by exactly one rank, each rank holding the KV heads its
// query heads use, each bias added once, units handed out in proportion to
// capacity within one unit — plus hand-computed plans for the cases the
// rules single out (GQA with fewer KV heads than ranks, head_dim 64, uneven
// capacities, expert groups) and the errors for bad worlds.
#include "sharding/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kGroup = 128;  // the TP channel unit (exl3-format.md §5.5)

struct DenseShape {
  int64_t hidden = 512;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 64;
  int64_t intermediate = 1000;
  int64_t vocab = 1003;
  int layers = 2;
};

ModelArch Dense(const DenseShape& s, const char* name = "LlamaForCausalLM") {
  nlohmann::json config = {{"architectures", {name}},
                           {"hidden_size", s.hidden},
                           {"intermediate_size", s.intermediate},
                           {"num_hidden_layers", s.layers},
                           {"num_attention_heads", s.heads},
                           {"num_key_value_heads", s.kv_heads},
                           {"head_dim", s.head_dim},
                           {"vocab_size", s.vocab}};
  auto arch = ModelArchFromConfig(config);
  EXPECT_TRUE(arch.ok()) << arch.status();
  return *arch;
}

// Qwen3-MoE: layer 0 dense (mlp_only_layers), the rest MoE.
ModelArch Qwen3Moe(int experts, int64_t moe_intermediate, int layers = 3) {
  nlohmann::json config = {{"architectures", {"Qwen3MoeForCausalLM"}},
                           {"hidden_size", 256},
                           {"intermediate_size", 700},
                           {"moe_intermediate_size", moe_intermediate},
                           {"num_experts", experts},
                           {"num_experts_per_tok", 2},
                           {"mlp_only_layers", {0}},
                           {"num_hidden_layers", layers},
                           {"num_attention_heads", 8},
                           {"num_key_value_heads", 4},
                           {"head_dim", 64},
                           {"vocab_size", 1000}};
  auto arch = ModelArchFromConfig(config);
  EXPECT_TRUE(arch.ok()) << arch.status();
  return *arch;
}

ModelArch Mixtral(int experts, int64_t intermediate) {
  nlohmann::json config = {{"architectures", {"MixtralForCausalLM"}},
                           {"hidden_size", 256},
                           {"intermediate_size", intermediate},
                           {"num_local_experts", experts},
                           {"num_experts_per_tok", 2},
                           {"num_hidden_layers", 2},
                           {"num_attention_heads", 8},
                           {"num_key_value_heads", 8},
                           {"vocab_size", 700}};
  auto arch = ModelArchFromConfig(config);
  EXPECT_TRUE(arch.ok()) << arch.status();
  return *arch;
}

WorldSpec WithCapacities(const std::vector<double>& capacities) {
  WorldSpec world = WorldSpec::Uniform(static_cast<int>(capacities.size()));
  for (size_t r = 0; r < capacities.size(); ++r) world.ranks[r].capacity = capacities[r];
  return world;
}

ShardPlan Plan(const ModelArch& arch, const WorldSpec& world, ShardOptions options = {}) {
  auto plan = PlanShards(arch, world, options, nullptr);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : ShardPlan{};
}

// The smallest count c of items of `width` channels with c·width a multiple
// of 128, or 1 when `items` is not a multiple of it — found by search, not
// by the planner's gcd.
int64_t AlignedUnit(int64_t width, int64_t items) {
  int64_t c = 1;
  while ((c * width) % kGroup != 0) ++c;
  return items % c == 0 ? c : 1;
}

// Units of `unit` items in a range of items (the last unit may be partial).
int64_t UnitsIn(const IndexRange& r, int64_t unit) { return (r.size() + unit - 1) / unit; }

// |units held - exact quota| < 1 for every rank of `ranks`, and the ranges
// start on a unit boundary.
void ExpectProportional(const std::vector<IndexRange>& ranges, const std::vector<double>& capacity,
                        int64_t total, int64_t unit, const std::string& what) {
  const int64_t units = (total + unit - 1) / unit;
  const double sum = std::accumulate(capacity.begin(), capacity.end(), 0.0);
  for (size_t r = 0; r < ranges.size(); ++r) {
    const double quota = static_cast<double>(units) * capacity[r] / sum;
    EXPECT_LT(std::abs(static_cast<double>(UnitsIn(ranges[r], unit)) - quota), 1.0 + 1e-9)
        << what << ": rank " << r << " holds " << UnitsIn(ranges[r], unit) << " units of "
        << units << ", quota " << quota;
    if (!ranges[r].empty()) {
      EXPECT_EQ(ranges[r].begin % unit, 0) << what << ": rank " << r << " begins mid-unit";
    }
  }
}

// Every index of [0, total) in exactly one range.
void ExpectCoversOnce(const std::vector<IndexRange>& ranges, int64_t total,
                      const std::string& what) {
  std::vector<int> count(static_cast<size_t>(total), 0);
  for (size_t r = 0; r < ranges.size(); ++r) {
    const IndexRange& range = ranges[r];
    if (range.empty()) continue;
    ASSERT_GE(range.begin, 0) << what << " rank " << r;
    ASSERT_LE(range.end, total) << what << " rank " << r;
    for (int64_t i = range.begin; i < range.end; ++i) ++count[i];
  }
  for (int64_t i = 0; i < total; ++i) {
    ASSERT_EQ(count[i], 1) << what << ": index " << i << " held by " << count[i] << " ranks";
  }
}

// Brute-force check of every rule against `plan`.
void CheckInvariants(const ModelArch& arch, const WorldSpec& world, const ShardOptions& options,
                     const ShardPlan& plan) {
  const int world_size = world.world_size();
  ASSERT_EQ(static_cast<int>(plan.ranks.size()), world_size);
  EXPECT_EQ(plan.head_dim, arch.head_dim);
  std::vector<double> capacity;
  for (const auto& r : world.ranks) capacity.push_back(r.capacity);
  for (int r = 0; r < world_size; ++r) {
    EXPECT_EQ(plan.ranks[r].rank, r);
    ASSERT_EQ(static_cast<int>(plan.ranks[r].layers.size()), arch.num_layers);
  }
  const int64_t group = arch.num_attention_heads / arch.num_key_value_heads;
  const int64_t kv_unit = AlignedUnit(arch.head_dim, arch.num_key_value_heads);
  const bool split_kv = arch.num_key_value_heads / kv_unit >= world_size;

  for (int l = 0; l < arch.num_layers; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    std::vector<IndexRange> q, mlp;
    int o_bias = 0, down_bias = 0;
    for (int r = 0; r < world_size; ++r) {
      const LayerShard& s = plan.ranks[r].layers[l];
      q.push_back(s.q_heads);
      mlp.push_back(s.mlp_channels);
      // The KV heads a rank holds are exactly those its query heads use.
      std::set<int64_t> needed;
      for (int64_t h = s.q_heads.begin; h < s.q_heads.end; ++h) needed.insert(h / group);
      std::set<int64_t> held;
      for (int64_t h = s.kv_heads.begin; h < s.kv_heads.end; ++h) held.insert(h);
      EXPECT_EQ(held, needed) << "rank " << r << " q heads [" << s.q_heads.begin << ","
                              << s.q_heads.end << ")";
      if (s.o_bias) {
        ++o_bias;
        EXPECT_FALSE(s.q_heads.empty()) << "rank " << r << " adds o bias without heads";
      }
      if (s.down_bias) {
        ++down_bias;
        EXPECT_FALSE(s.mlp_channels.empty()) << "rank " << r << " adds down bias without channels";
      }
    }
    ExpectCoversOnce(q, arch.num_attention_heads, "q heads");
    EXPECT_EQ(o_bias, 1);
    if (split_kv) {
      std::vector<IndexRange> kv;
      for (int r = 0; r < world_size; ++r) kv.push_back(plan.ranks[r].layers[l].kv_heads);
      ExpectCoversOnce(kv, arch.num_key_value_heads, "kv heads");
      ExpectProportional(kv, capacity, arch.num_key_value_heads, kv_unit, "kv heads");
    } else {
      ExpectProportional(q, capacity, arch.num_attention_heads,
                         AlignedUnit(arch.head_dim, arch.num_attention_heads), "q heads");
    }

    if (!arch.layer_is_moe[l]) {
      ExpectCoversOnce(mlp, arch.intermediate_size, "mlp channels");
      ExpectProportional(mlp, capacity, arch.intermediate_size, kGroup, "mlp channels");
      EXPECT_EQ(down_bias, 1);
      for (int r = 0; r < world_size; ++r) {
        EXPECT_TRUE(plan.ranks[r].layers[l].experts.empty());
        EXPECT_FALSE(plan.ranks[r].layers[l].expert_down_bias);
      }
      continue;
    }
    EXPECT_EQ(down_bias, 0);
    const int groups = options.expert_parallel == 0 ? world_size : options.expert_parallel;
    const int group_size = world_size / groups;
    std::vector<IndexRange> group_experts;
    std::vector<double> group_capacity(groups, 0.0);
    for (int g = 0; g < groups; ++g) {
      const int first = g * group_size;
      group_experts.push_back(plan.ranks[first].layers[l].experts);
      std::vector<IndexRange> channels;
      std::vector<double> member_capacity;
      int bias = 0;
      for (int r = first; r < first + group_size; ++r) {
        const LayerShard& s = plan.ranks[r].layers[l];
        group_capacity[g] += capacity[r];
        EXPECT_TRUE(s.mlp_channels.empty());
        EXPECT_EQ(s.experts, group_experts.back()) << "rank " << r << " differs from its group";
        channels.push_back(s.expert_channels);
        member_capacity.push_back(capacity[r]);
        if (s.expert_down_bias) {
          ++bias;
          EXPECT_FALSE(s.expert_channels.empty());
          // The first rank of the group with channels.
          for (int p = first; p < r; ++p) {
            EXPECT_TRUE(plan.ranks[p].layers[l].expert_channels.empty());
          }
        }
      }
      if (group_experts.back().empty()) {
        EXPECT_EQ(bias, 0) << "group " << g;
        continue;
      }
      // Every channel of every held expert once over the group's ranks.
      ExpectCoversOnce(channels, arch.moe_intermediate_size, "expert channels");
      ExpectProportional(channels, member_capacity, arch.moe_intermediate_size, kGroup,
                         "expert channels");
      EXPECT_EQ(bias, 1) << "group " << g;
    }
    ExpectCoversOnce(group_experts, arch.num_experts, "experts over groups");
    ExpectProportional(group_experts, group_capacity, arch.num_experts, 1, "experts");
  }

  std::vector<IndexRange> vocab;
  for (const RankShard& r : plan.ranks) vocab.push_back(r.vocab);
  if (options.replicate_head) {
    for (const IndexRange& v : vocab) EXPECT_EQ(v, (IndexRange{0, arch.vocab_size}));
  } else {
    ExpectCoversOnce(vocab, arch.vocab_size, "vocab");
    ExpectProportional(vocab, capacity, arch.vocab_size, kGroup, "vocab");
  }
  for (const RankShard& r : plan.ranks) {
    EXPECT_LE(r.replicated_bytes, r.weight_bytes) << "rank " << r.rank;
  }
}

// Runs one configuration through the planner and the invariant check.
void PlanAndCheck(const ModelArch& arch, const WorldSpec& world, ShardOptions options = {}) {
  SCOPED_TRACE(::testing::Message() << arch.architecture << " heads " << arch.num_attention_heads
                                    << "/" << arch.num_key_value_heads << " head_dim "
                                    << arch.head_dim << ", " << world.world_size()
                                    << " ranks, ep " << options.expert_parallel);
  auto plan = PlanShards(arch, world, options, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckInvariants(arch, world, options, *plan);
}

TEST(ShardPlannerTest, DenseModelsHoldEveryHeadChannelAndRowOnceForOneToFiveRanks) {
  const std::vector<DenseShape> shapes = {
      {.heads = 32, .kv_heads = 8, .head_dim = 128},   // GQA, head_dim 128
      {.heads = 12, .kv_heads = 4, .head_dim = 64},    // KV units of 2 heads
      {.heads = 6, .kv_heads = 3, .head_dim = 64},     // 3 KV heads: units of 1
      {.heads = 16, .kv_heads = 2, .head_dim = 128},   // fewer KV heads than ranks
      {.heads = 4, .kv_heads = 2, .head_dim = 64},     // fewer q units than ranks
      {.heads = 8, .kv_heads = 8, .head_dim = 96},     // MHA, units of 4 heads
      {.heads = 5, .kv_heads = 5, .head_dim = 64, .intermediate = 128, .vocab = 100},
  };
  for (const DenseShape& shape : shapes) {
    for (int ranks = 1; ranks <= 5; ++ranks) {
      PlanAndCheck(Dense(shape), WorldSpec::Uniform(ranks));
      PlanAndCheck(Dense(shape), WorldSpec::Uniform(ranks), {.replicate_head = true});
    }
  }
}

TEST(ShardPlannerTest, RandomCapacitiesKeepEverySplitProportionalWithinOneUnit) {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<double> cap(0.1, 4.0);
  const std::vector<ModelArch> archs = {
      Dense({.heads = 32, .kv_heads = 8, .head_dim = 128, .intermediate = 11008, .vocab = 32000}),
      Dense({.heads = 16, .kv_heads = 2, .head_dim = 64, .intermediate = 1000}),
      Qwen3Moe(8, 384), Mixtral(6, 640)};
  for (int trial = 0; trial < 40; ++trial) {
    const int ranks = 1 + trial % 5;
    std::vector<double> capacity;
    for (int r = 0; r < ranks; ++r) capacity.push_back(cap(rng));
    for (const ModelArch& arch : archs) {
      for (int ep = 1; ep <= ranks; ++ep) {
        if (ranks % ep != 0 || (arch.num_experts > 0 && ep > arch.num_experts)) continue;
        PlanAndCheck(arch, WithCapacities(capacity), {.expert_parallel = ep});
      }
    }
  }
}

TEST(ShardPlannerTest, SplitsKvHeadsWhenThereAreEnoughAndQueryHeadsFollow) {
  // head_dim 128: one KV head per unit; 8 units over 3 ranks -> 3, 3, 2.
  ShardPlan plan = Plan(Dense({.heads = 32, .kv_heads = 8, .head_dim = 128}), WorldSpec::Uniform(3));
  ASSERT_EQ(plan.ranks.size(), 3u);
  const std::vector<IndexRange> kv = {{0, 3}, {3, 6}, {6, 8}};
  const std::vector<IndexRange> q = {{0, 12}, {12, 24}, {24, 32}};
  for (int r = 0; r < 3; ++r) {
    for (const LayerShard& layer : plan.ranks[r].layers) {
      EXPECT_EQ(layer.kv_heads, kv[r]) << "rank " << r;
      EXPECT_EQ(layer.q_heads, q[r]) << "rank " << r;
      EXPECT_EQ(layer.o_bias, r == 0);
    }
  }
}

TEST(ShardPlannerTest, HeadDim64GroupsKvHeadsInPairsForWhole128Channels) {
  // 4 KV heads of 64 -> units of 2 KV heads (128 channels): 2 units.
  ShardPlan two = Plan(Dense({.heads = 12, .kv_heads = 4, .head_dim = 64}), WorldSpec::Uniform(2));
  EXPECT_EQ(two.ranks[0].layers[0].kv_heads, (IndexRange{0, 2}));
  EXPECT_EQ(two.ranks[1].layers[0].kv_heads, (IndexRange{2, 4}));
  EXPECT_EQ(two.ranks[1].layers[0].q_heads, (IndexRange{6, 12}));
  // 3 ranks > 2 units: query heads in pairs (6 units, 2 each); 3 q heads per
  // KV head, so KV heads 1 and 2 are held twice.
  ShardPlan three = Plan(Dense({.heads = 12, .kv_heads = 4, .head_dim = 64}), WorldSpec::Uniform(3));
  const std::vector<IndexRange> q = {{0, 4}, {4, 8}, {8, 12}};
  const std::vector<IndexRange> kv = {{0, 2}, {1, 3}, {2, 4}};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(three.ranks[r].layers[1].q_heads, q[r]) << "rank " << r;
    EXPECT_EQ(three.ranks[r].layers[1].kv_heads, kv[r]) << "rank " << r;
  }
}

TEST(ShardPlannerTest, FewerKvHeadsThanRanksSplitsQueryHeadsAndReplicatesKv) {
  ShardPlan plan = Plan(Dense({.heads = 16, .kv_heads = 2, .head_dim = 128}), WorldSpec::Uniform(4));
  const std::vector<IndexRange> q = {{0, 4}, {4, 8}, {8, 12}, {12, 16}};
  const std::vector<IndexRange> kv = {{0, 1}, {0, 1}, {1, 2}, {1, 2}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.ranks[r].layers[0].q_heads, q[r]) << "rank " << r;
    EXPECT_EQ(plan.ranks[r].layers[0].kv_heads, kv[r]) << "rank " << r;
    // Every rank's KV head is also held by another rank: counted as replicated.
    EXPECT_GT(plan.ranks[r].replicated_bytes, 0u);
  }
}

TEST(ShardPlannerTest, MoreRanksThanHeadUnitsLeavesSomeRanksWithoutHeads) {
  // 4 heads of 64 in units of 2 -> 2 units for 5 ranks (ties to lower ranks).
  ShardPlan plan = Plan(Dense({.heads = 4, .kv_heads = 2, .head_dim = 64}), WorldSpec::Uniform(5));
  EXPECT_EQ(plan.ranks[0].layers[0].q_heads, (IndexRange{0, 2}));
  EXPECT_EQ(plan.ranks[1].layers[0].q_heads, (IndexRange{2, 4}));
  EXPECT_EQ(plan.ranks[1].layers[0].kv_heads, (IndexRange{1, 2}));
  for (int r = 2; r < 5; ++r) {
    EXPECT_TRUE(plan.ranks[r].layers[0].q_heads.empty()) << "rank " << r;
    EXPECT_TRUE(plan.ranks[r].layers[0].kv_heads.empty()) << "rank " << r;
    EXPECT_FALSE(plan.ranks[r].layers[0].o_bias);
  }
}

TEST(ShardPlannerTest, TiesInRemaindersGoToLowerRanks) {
  // 640 channels = 5 units over 3 equal ranks: 2, 2, 1. 1003 vocab rows = 8
  // units: 3, 3, 2 with a partial last unit.
  ShardPlan plan = Plan(Dense({.intermediate = 640, .vocab = 1003}), WorldSpec::Uniform(3));
  EXPECT_EQ(plan.ranks[0].layers[0].mlp_channels, (IndexRange{0, 256}));
  EXPECT_EQ(plan.ranks[1].layers[0].mlp_channels, (IndexRange{256, 512}));
  EXPECT_EQ(plan.ranks[2].layers[0].mlp_channels, (IndexRange{512, 640}));
  EXPECT_EQ(plan.ranks[2].vocab, (IndexRange{768, 1003}));
  EXPECT_TRUE(plan.ranks[0].layers[0].down_bias);
  EXPECT_FALSE(plan.ranks[1].layers[0].down_bias);
}

TEST(ShardPlannerTest, UnevenCapacitiesGetProportionalShares) {
  // 1000 channels = 8 units; capacities 1 : 1 : 0.5 -> quotas 3.2, 3.2, 1.6 ->
  // 3, 3, 1 plus the leftover unit to the largest remainder (rank 2).
  ShardPlan plan = Plan(Dense({.intermediate = 1000}), WithCapacities({1.0, 1.0, 0.5}));
  EXPECT_EQ(plan.ranks[0].layers[0].mlp_channels, (IndexRange{0, 384}));
  EXPECT_EQ(plan.ranks[1].layers[0].mlp_channels, (IndexRange{384, 768}));
  EXPECT_EQ(plan.ranks[2].layers[0].mlp_channels, (IndexRange{768, 1000}));
  // 4 : 1 with 5 units -> 4 and 1.
  ShardPlan skewed = Plan(Dense({.intermediate = 640}), WithCapacities({4.0, 1.0}));
  EXPECT_EQ(skewed.ranks[0].layers[0].mlp_channels, (IndexRange{0, 512}));
  EXPECT_EQ(skewed.ranks[1].layers[0].mlp_channels, (IndexRange{512, 640}));
  EXPECT_GT(skewed.ranks[0].weight_bytes, skewed.ranks[1].weight_bytes);
}

TEST(ShardPlannerTest, PureExpertParallelGivesWholeExpertsPerRank) {
  const ModelArch arch = Qwen3Moe(8, 384);
  ShardPlan plan = Plan(arch, WorldSpec::Uniform(4));  // ep 0 = world size
  EXPECT_EQ(plan.expert_groups, 4);
  for (int r = 0; r < 4; ++r) {
    const LayerShard& moe = plan.ranks[r].layers[1];
    EXPECT_EQ(moe.experts, (IndexRange{2 * r, 2 * r + 2})) << "rank " << r;
    EXPECT_EQ(moe.expert_channels, (IndexRange{0, 384})) << "rank " << r;
    EXPECT_TRUE(moe.expert_down_bias);
    EXPECT_TRUE(moe.mlp_channels.empty());
    // Layer 0 is dense (mlp_only_layers): tensor-parallel MLP.
    EXPECT_FALSE(plan.ranks[r].layers[0].mlp_channels.empty());
    EXPECT_TRUE(plan.ranks[r].layers[0].experts.empty());
  }
  CheckInvariants(arch, WorldSpec::Uniform(4), {}, plan);
}

TEST(ShardPlannerTest, ExpertGroupsSplitExpertChannelsInsideTheGroup) {
  const ModelArch arch = Qwen3Moe(8, 384);
  ShardPlan plan = Plan(arch, WorldSpec::Uniform(4), {.expert_parallel = 2});
  EXPECT_EQ(plan.expert_groups, 2);
  const std::vector<IndexRange> experts = {{0, 4}, {0, 4}, {4, 8}, {4, 8}};
  const std::vector<IndexRange> channels = {{0, 256}, {256, 384}, {0, 256}, {256, 384}};
  for (int r = 0; r < 4; ++r) {
    const LayerShard& moe = plan.ranks[r].layers[2];
    EXPECT_EQ(moe.experts, experts[r]) << "rank " << r;
    EXPECT_EQ(moe.expert_channels, channels[r]) << "rank " << r;
    EXPECT_EQ(moe.expert_down_bias, r % 2 == 0) << "rank " << r;
  }
  CheckInvariants(arch, WorldSpec::Uniform(4), {.expert_parallel = 2}, plan);
  // One group: all experts on every rank, channels split four ways.
  PlanAndCheck(arch, WorldSpec::Uniform(4), {.expert_parallel = 1});
}

TEST(ShardPlannerTest, ExpertsFollowGroupCapacity) {
  // Groups {0,1} (capacity 3) and {2,3} (capacity 1): 8 experts -> 6 and 2.
  const ModelArch arch = Mixtral(8, 256);
  const WorldSpec world = WithCapacities({2.0, 1.0, 0.5, 0.5});
  ShardPlan plan = Plan(arch, world, {.expert_parallel = 2});
  EXPECT_EQ(plan.ranks[0].layers[0].experts, (IndexRange{0, 6}));
  EXPECT_EQ(plan.ranks[3].layers[0].experts, (IndexRange{6, 8}));
  // Inside group 0: 2 units at 2 : 1 -> quotas 1.33, 0.67 -> 1, 1.
  EXPECT_EQ(plan.ranks[0].layers[0].expert_channels, (IndexRange{0, 128}));
  EXPECT_EQ(plan.ranks[1].layers[0].expert_channels, (IndexRange{128, 256}));
  CheckInvariants(arch, world, {.expert_parallel = 2}, plan);
}

TEST(ShardPlannerTest, ReplicatedHeadGivesEveryRankTheWholeVocab) {
  ShardPlan plan = Plan(Dense({}), WorldSpec::Uniform(3), {.replicate_head = true});
  for (const RankShard& r : plan.ranks) EXPECT_EQ(r.vocab, (IndexRange{0, 1003}));
}

TEST(ShardPlannerTest, OneRankHoldsTheWholeModelAndItsFp16Estimate) {
  const DenseShape s{.hidden = 256, .heads = 4, .kv_heads = 2, .head_dim = 64,
                     .intermediate = 640, .vocab = 1000, .layers = 2};
  const ModelArch arch = Dense(s);
  ShardPlan plan = Plan(arch, WorldSpec::Uniform(1));
  // fp16: every linear, the embedding and 2 norms per layer plus the final one.
  const uint64_t per_layer = 2 * (s.hidden * 4 * 64 + 2 * s.hidden * 2 * 64 + 4 * 64 * s.hidden +
                                  3 * s.hidden * s.intermediate);
  const uint64_t expected = s.layers * per_layer + 2 * 2 * s.vocab * s.hidden +
                            2 * (2 * s.layers + 1) * s.hidden;
  EXPECT_EQ(plan.total_bytes, expected);
  ASSERT_EQ(plan.ranks.size(), 1u);
  EXPECT_EQ(plan.ranks[0].weight_bytes, expected);
}

TEST(ShardPlannerTest, RanksTogetherHoldTheModelPlusReplicatedCopies) {
  // A real (Hugging Face, bf16) checkpoint supplies the sizes.
  testing::ScratchDir dir;
  TestModelOptions opt;
  opt.hidden_size = 256;
  opt.num_attention_heads = 8;
  opt.num_key_value_heads = 8;  // head_dim 32: units of 4 KV heads, 2 units
  ASSERT_TRUE(WriteTestModel(dir.path(), opt).ok());
  auto model = Exl3Model::Open(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->arch().has_value());
  auto plan = PlanShards(*(*model)->arch(), WorldSpec::Uniform(2), {}, model->get());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->total_bytes, (*model)->TotalStoredBytes());
  // No KV replication, head split: the unique parts add up to the model, the
  // replicated part (embedding, norms) is held by both ranks.
  const RankShard& a = plan->ranks[0];
  const RankShard& b = plan->ranks[1];
  EXPECT_EQ(a.replicated_bytes, b.replicated_bytes);
  const double unique = static_cast<double>(a.weight_bytes - a.replicated_bytes) +
                        static_cast<double>(b.weight_bytes - b.replicated_bytes);
  EXPECT_NEAR(unique + static_cast<double>(a.replicated_bytes),
              static_cast<double>(plan->total_bytes), 2.0);
  // The embedding (1000 x 256 bf16) is in the replicated part.
  EXPECT_GE(a.replicated_bytes, 1000u * 256u * 2u);
  auto one = PlanShards(*(*model)->arch(), WorldSpec::Uniform(1), {}, model->get());
  ASSERT_TRUE(one.ok());
  EXPECT_NEAR(static_cast<double>(one->ranks[0].weight_bytes),
              static_cast<double>((*model)->TotalStoredBytes()), 1.0);
}

TEST(ShardPlannerTest, DescribePrintsOneLinePerRankAndATotal) {
  ShardPlan plan = Plan(Qwen3Moe(8, 384), WorldSpec::Uniform(3), {.expert_parallel = 1});
  const std::string text = plan.Describe();
  EXPECT_THAT(text, HasSubstr("Qwen3MoeForCausalLM"));
  EXPECT_THAT(text, HasSubstr("q heads"));
  EXPECT_THAT(text, HasSubstr("experts"));
  EXPECT_THAT(text, HasSubstr("MiB"));
  EXPECT_THAT(text, HasSubstr("model: "));
  for (const char* line : {"\n   0  local", "\n   1  local", "\n   2  local"}) {
    EXPECT_THAT(text, HasSubstr(line));
  }
  EXPECT_THAT(text, ::testing::Not(HasSubstr("\n   3  local")));
}

struct BadWorld {
  const char* name;
  WorldSpec world;
  ShardOptions options;
  const char* message;
};

TEST(ShardPlannerTest, RejectsBadWorldsWithInvalidArgument) {
  WorldSpec no_boxes = WorldSpec::Uniform(2);
  no_boxes.boxes.clear();
  WorldSpec bad_box = WorldSpec::Uniform(2);
  bad_box.ranks[1].box = 1;
  const std::vector<BadWorld> cases = {
      {"empty", WorldSpec::Uniform(0), {}, "no ranks"},
      {"no boxes", no_boxes, {}, "no boxes"},
      {"zero capacity", WithCapacities({1.0, 0.0}), {}, "rank 1: capacity"},
      {"negative capacity", WithCapacities({-1.0}), {}, "rank 0: capacity"},
      {"nan capacity", WithCapacities({1.0, std::nan("")}), {}, "rank 1: capacity"},
      {"box out of range", bad_box, {}, "rank 1: box 1 is out of range"},
      {"ep not dividing", WorldSpec::Uniform(6), {.expert_parallel = 4}, "must divide the world size 6"},
      {"ep negative", WorldSpec::Uniform(2), {.expert_parallel = -1}, "must be >= 0"},
      {"ep above experts", WorldSpec::Uniform(8), {.expert_parallel = 8}, "number of experts 4"},
      {"default ep above experts", WorldSpec::Uniform(8), {}, "number of experts 4"},
  };
  const ModelArch moe = Qwen3Moe(4, 256);
  for (const BadWorld& c : cases) {
    auto plan = PlanShards(moe, c.world, c.options, nullptr);
    ASSERT_FALSE(plan.ok()) << c.name;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr(c.message)) << c.name;
  }
  // ep that does not divide the world is an error for dense models too.
  auto dense = PlanShards(Dense({}), WorldSpec::Uniform(3), {.expert_parallel = 2}, nullptr);
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::sharding
