// Glm4MoeForCausalLM's config.json (architectures.md §1.1): the linears and
// layer kinds (sharding::ModelArchFromConfig), the attention and routing keys
// (ModelConfigFromJson), errors naming the field, the RoPE table of a partial
// rotary, and the shard plan of the shared expert.
#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "nlohmann/json.hpp"
#include "sharding/model_arch.h"
#include "sharding/shard_plan.h"
#include "worker/model/model_config.h"

namespace exl3serve::worker {
namespace {

using ::testing::HasSubstr;
using sharding::LinearRole;

// GLM-4.5-Air's shape, shrunk (4 layers, 16 experts).
nlohmann::json AirConfig() {
  return {{"architectures", {"Glm4MoeForCausalLM"}},
          {"hidden_size", 4096},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 96},
          {"num_key_value_heads", 8},
          {"head_dim", 128},
          {"vocab_size", 151552},
          {"intermediate_size", 10944},
          {"moe_intermediate_size", 1408},
          {"n_routed_experts", 16},
          {"num_experts_per_tok", 8},
          {"n_shared_experts", 1},
          {"first_k_dense_replace", 1},
          {"n_group", 1},
          {"topk_group", 1},
          {"norm_topk_prob", true},
          {"routed_scaling_factor", 1.0},
          {"partial_rotary_factor", 0.5},
          {"attention_bias", true},
          {"use_qk_norm", false},
          {"num_nextn_predict_layers", 1},
          {"rope_theta", 1000000.0},
          {"rms_norm_eps", 1e-5},
          {"hidden_act", "silu"}};
}

TEST(Glm4MoeConfigTest, LinearsLayerKindsAndSharedExperts) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(AirConfig());
  ASSERT_TRUE(arch.ok()) << arch.status();
  EXPECT_EQ(arch->layer_is_moe, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(arch->num_experts, 16);
  EXPECT_EQ(arch->shared_expert_intermediate_size, 1408);
  EXPECT_EQ(arch->num_mtp_layers, 1);
  EXPECT_EQ(arch->Find(0, LinearRole::kQ)->out_features, 96 * 128);  // != hidden
  EXPECT_EQ(arch->Find(0, LinearRole::kGate)->out_features, 10944);
  EXPECT_EQ(arch->Find(1, LinearRole::kGate), nullptr);  // no dense MLP in MoE layers
  const sharding::LinearSpec* router = arch->Find(1, LinearRole::kRouter);
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->key, "model.layers.1.mlp.gate");
  EXPECT_FALSE(router->quantized);
  EXPECT_EQ(arch->Find(3, LinearRole::kDown, 15)->key, "model.layers.3.mlp.experts.15.down_proj");
  const sharding::LinearSpec* shared = arch->Find(2, LinearRole::kUp, sharding::kSharedExpert);
  ASSERT_NE(shared, nullptr);
  EXPECT_EQ(shared->key, "model.layers.2.mlp.shared_experts.up_proj");
  EXPECT_TRUE(shared->quantized);
  EXPECT_EQ(shared->out_features, 1408);
  EXPECT_EQ(shared->module_group, "model.layers.2.mlp");
  // No linear of the MTP layer (index 4).
  for (const sharding::LinearSpec& l : arch->linears) EXPECT_LT(l.layer, 4) << l.key;
}

TEST(Glm4MoeConfigTest, RoutingAndAttentionKeys) {
  nlohmann::json config = AirConfig();
  config["n_group"] = 4;
  config["topk_group"] = 2;
  config["routed_scaling_factor"] = 2.5;
  config["use_qk_norm"] = true;
  absl::StatusOr<ModelConfig> c = ModelConfigFromJson(config, nullptr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->moe_router, MoeRouter::kSigmoidGrouped);
  EXPECT_EQ(c->moe_n_group, 4);
  EXPECT_EQ(c->moe_topk_group, 2);
  EXPECT_EQ(c->routed_scaling_factor, 2.5);
  EXPECT_EQ(c->moe_topk_weights, MoeTopKWeights::kRenormalized);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->rotary_dim, 64);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  // θ^(-2j/64) for j < 32: the rotary dims, not head_dim, set the spacing.
  const std::vector<double> inv_freq = RopeInverseFrequencies(*c);
  ASSERT_EQ(inv_freq.size(), 32u);
  EXPECT_DOUBLE_EQ(inv_freq[1], std::pow(1e6, -2.0 / 64));
  EXPECT_DOUBLE_EQ(inv_freq[31], std::pow(1e6, -62.0 / 64));
}

TEST(Glm4MoeConfigTest, UnsupportedOrBadValuesNameTheField) {
  struct Case {
    const char* key;
    nlohmann::json value;  // null: removed
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"scoring_func", "softmax", absl::StatusCode::kUnimplemented},
      {"topk_method", "greedy", absl::StatusCode::kUnimplemented},
      {"routed_scaling_factor", nullptr, absl::StatusCode::kInvalidArgument},
      {"routed_scaling_factor", -1.0, absl::StatusCode::kInvalidArgument},
      {"partial_rotary_factor", 0.0234375, absl::StatusCode::kInvalidArgument},  // 3 dims
      {"partial_rotary_factor", 1.5, absl::StatusCode::kInvalidArgument},
      {"n_group", 3, absl::StatusCode::kInvalidArgument},                  // 16 % 3
      {"n_group", 16, absl::StatusCode::kInvalidArgument},                 // groups of 1
      {"topk_group", 5, absl::StatusCode::kInvalidArgument},               // > n_group 4
      {"use_qk_norm", "yes", absl::StatusCode::kInvalidArgument},
      {"first_k_dense_replace", nullptr, absl::StatusCode::kInvalidArgument},
      {"n_shared_experts", nullptr, absl::StatusCode::kInvalidArgument},
      {"n_routed_experts", nullptr, absl::StatusCode::kInvalidArgument},
      {"num_nextn_predict_layers", -1, absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    nlohmann::json config = AirConfig();
    config["n_group"] = 4;
    config["topk_group"] = 4;
    if (c.value.is_null()) {
      config.erase(c.key);
    } else {
      config[c.key] = c.value;
    }
    absl::StatusOr<ModelConfig> parsed = ModelConfigFromJson(config, nullptr);
    ASSERT_FALSE(parsed.ok()) << c.key << " = " << c.value.dump();
    EXPECT_EQ(parsed.status().code(), c.code) << c.key << ": " << parsed.status();
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.key));
  }
  // topk_group 1 of 4 groups keeps 4 experts, fewer than the 8 chosen.
  nlohmann::json config = AirConfig();
  config["n_group"] = 4;
  config["topk_group"] = 1;
  absl::StatusOr<ModelConfig> parsed = ModelConfigFromJson(config, nullptr);
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(), HasSubstr("topk_group"));
}

TEST(Glm4MoeConfigTest, SharedExpertIsSplitLikeADenseMlp) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(AirConfig());
  ASSERT_TRUE(arch.ok());
  absl::StatusOr<sharding::ShardPlan> plan = sharding::PlanShards(
      *arch, sharding::WorldSpec::Uniform(3), sharding::ShardOptions{}, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 1408 = 11 groups of 128 over 3 ranks: 4, 4, 3 groups; bias on rank 0.
  int64_t covered = 0;
  for (const sharding::RankShard& rank : plan->ranks) {
    const sharding::LayerShard& moe = rank.layers[1];
    EXPECT_EQ(moe.mlp_channels.begin, covered);
    covered = moe.mlp_channels.end;
    EXPECT_EQ(moe.down_bias, rank.rank == 0);
    EXPECT_EQ(rank.layers[0].mlp_channels.size() > 0, true);  // the dense layer 0
  }
  EXPECT_EQ(covered, 1408);
}

TEST(Glm4MoeConfigTest, PartialRopeRotatesOnlyTheLeadingDims) {
  // 2 heads of 6 dims, 4 rotated: pairs (0, 2) and (1, 3); dims 4, 5 untouched.
  std::vector<float> x(12);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i + 1);
  const std::vector<float> before = x;
  const int64_t position = 3;
  const double inv_freq[2] = {1.0, 0.01};
  ASSERT_TRUE(kernels::ApplyPartialRope(x.data(), 1, 2, 6, 4, &position, inv_freq).ok());
  for (int h = 0; h < 2; ++h) {
    const float* b = before.data() + h * 6;
    const float* a = x.data() + h * 6;
    for (int i = 0; i < 2; ++i) {
      const double angle = 3.0 * inv_freq[i];
      EXPECT_NEAR(a[i], b[i] * std::cos(angle) - b[i + 2] * std::sin(angle), 1e-5);
      EXPECT_NEAR(a[i + 2], b[i + 2] * std::cos(angle) + b[i] * std::sin(angle), 1e-5);
    }
    EXPECT_EQ(a[4], b[4]);
    EXPECT_EQ(a[5], b[5]);
  }
  EXPECT_FALSE(kernels::ApplyPartialRope(x.data(), 1, 2, 6, 5, &position, inv_freq).ok());
  EXPECT_FALSE(kernels::ApplyPartialRope(x.data(), 1, 2, 6, 8, &position, inv_freq).ok());
}

}  // namespace
}  // namespace exl3serve::worker
