// DeepseekV3ForCausalLM's config.json (architectures.md §2.1; DeepSeek-V3/R1
// and Kimi K2): the MLA linears and layer kinds (sharding::ModelArchFromConfig),
// YaRN RoPE and its softmax-scale correction, the routing keys
// (ModelConfigFromJson), errors naming the field, and the shard plan of MLA
// by query heads with the latent projections replicated.
#include <algorithm>
#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sharding/model_arch.h"
#include "sharding/shard_plan.h"
#include "worker/model/model_config.h"

namespace exl3serve::worker {
namespace {

using ::testing::HasSubstr;
using sharding::LinearRole;

// Kimi K2's published config (architectures.md §2.1), shrunk to 4 layers
// and 16 experts.
nlohmann::json KimiK2Config() {
  return {{"architectures", {"DeepseekV3ForCausalLM"}},
          {"model_type", "kimi_k2"},
          {"hidden_size", 7168},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 64},
          {"num_key_value_heads", 64},
          {"vocab_size", 163840},
          {"intermediate_size", 18432},
          {"moe_intermediate_size", 2048},
          {"n_routed_experts", 16},
          {"num_experts_per_tok", 8},
          {"n_shared_experts", 1},
          {"first_k_dense_replace", 1},
          {"moe_layer_freq", 1},
          {"n_group", 1},
          {"topk_group", 1},
          {"norm_topk_prob", true},
          {"scoring_func", "sigmoid"},
          {"topk_method", "noaux_tc"},
          {"routed_scaling_factor", 2.827},
          {"q_lora_rank", 1536},
          {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128},
          {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},
          {"rope_theta", 50000.0},
          {"max_position_embeddings", 131072},
          {"rope_scaling",
           {{"type", "yarn"},
            {"factor", 32.0},
            {"original_max_position_embeddings", 4096},
            {"beta_fast", 1.0},
            {"beta_slow", 1.0},
            {"mscale", 1.0},
            {"mscale_all_dim", 1.0}}},
          {"num_nextn_predict_layers", 0},
          {"rms_norm_eps", 1e-6},
          {"hidden_act", "silu"}};
}

// DeepSeek-V3's differences: 128 heads, 8 groups keep 4, factor 40, beta 32/1.
nlohmann::json DeepseekV3Config() {
  nlohmann::json c = KimiK2Config();
  c["model_type"] = "deepseek_v3";
  c["num_attention_heads"] = 128;
  c["num_key_value_heads"] = 128;
  c["n_group"] = 8;
  c["topk_group"] = 4;
  c["first_k_dense_replace"] = 3;
  c["routed_scaling_factor"] = 2.5;
  c["rope_theta"] = 10000.0;
  c["max_position_embeddings"] = 163840;
  c["rope_scaling"]["factor"] = 40.0;
  c["rope_scaling"]["beta_fast"] = 32.0;
  c["num_nextn_predict_layers"] = 1;
  return c;
}

TEST(DeepseekV3ConfigTest, MlaLinearsAndLayerKinds) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(KimiK2Config());
  ASSERT_TRUE(arch.ok()) << arch.status();
  EXPECT_TRUE(arch->mla());
  EXPECT_EQ(arch->layer_is_moe, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(arch->num_key_value_heads, 1);  // the latent, whatever the config says
  EXPECT_EQ(arch->head_dim, 192);
  EXPECT_EQ(arch->shared_expert_intermediate_size, 2048);
  const sharding::LinearSpec* q_a = arch->Find(0, LinearRole::kQA);
  ASSERT_NE(q_a, nullptr);
  EXPECT_EQ(q_a->key, "model.layers.0.self_attn.q_a_proj");
  EXPECT_EQ(q_a->out_features, 1536);
  EXPECT_TRUE(q_a->quantized);
  EXPECT_EQ(arch->Find(0, LinearRole::kQB)->out_features, 64 * 192);
  EXPECT_EQ(arch->Find(0, LinearRole::kQB)->in_features, 1536);
  EXPECT_EQ(arch->Find(0, LinearRole::kQ), nullptr);
  const sharding::LinearSpec* kv_a = arch->Find(2, LinearRole::kKVA);
  EXPECT_EQ(kv_a->key, "model.layers.2.self_attn.kv_a_proj_with_mqa");
  EXPECT_EQ(kv_a->out_features, 576);
  EXPECT_EQ(kv_a->qgroup, "model.layers.2.self_attn.qkv");  // with q_a: one input
  const sharding::LinearSpec* kv_b = arch->Find(1, LinearRole::kKVB);
  EXPECT_EQ(kv_b->key, "model.layers.1.self_attn.kv_b_proj");
  EXPECT_EQ(kv_b->in_features, 512);
  EXPECT_EQ(kv_b->out_features, 64 * 256);
  EXPECT_FALSE(kv_b->quantized);  // 16-bit, as exllamav3 keeps it (§2.4)
  EXPECT_EQ(arch->Find(1, LinearRole::kO)->in_features, 64 * 128);
  EXPECT_EQ(arch->Find(1, LinearRole::kK), nullptr);
  EXPECT_EQ(arch->Find(1, LinearRole::kRouter)->key, "model.layers.1.mlp.gate");
  EXPECT_EQ(arch->Find(3, LinearRole::kDown, sharding::kSharedExpert)->key,
            "model.layers.3.mlp.shared_experts.down_proj");
  EXPECT_EQ(arch->Find(0, LinearRole::kGate)->out_features, 18432);

  // q_lora_rank null: a plain q_proj of the layer input.
  nlohmann::json plain = KimiK2Config();
  plain["q_lora_rank"] = nullptr;
  absl::StatusOr<sharding::ModelArch> p = sharding::ModelArchFromConfig(plain);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->q_lora_rank, 0);
  EXPECT_EQ(p->Find(0, LinearRole::kQA), nullptr);
  EXPECT_EQ(p->Find(0, LinearRole::kQB), nullptr);
  EXPECT_EQ(p->Find(0, LinearRole::kQ)->key, "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(p->Find(0, LinearRole::kQ)->in_features, 7168);
  EXPECT_EQ(p->Find(0, LinearRole::kQ)->out_features, 64 * 192);

  // DeepSeek-V3: the MTP layer (index 61 there; 4 here) is counted, no linear.
  absl::StatusOr<sharding::ModelArch> ds = sharding::ModelArchFromConfig(DeepseekV3Config());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->num_mtp_layers, 1);
  EXPECT_EQ(ds->layer_is_moe, (std::vector<bool>{false, false, false, true}));
  for (const sharding::LinearSpec& l : ds->linears) EXPECT_LT(l.layer, 4) << l.key;
}

TEST(DeepseekV3ConfigTest, YarnFrequenciesAndSoftmaxScale) {
  absl::StatusOr<ModelConfig> kimi = ModelConfigFromJson(KimiK2Config(), nullptr);
  ASSERT_TRUE(kimi.ok()) << kimi.status();
  EXPECT_EQ(kimi->rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_EQ(kimi->rotary_dim, 64);
  EXPECT_EQ(kimi->moe_router, MoeRouter::kSigmoidGrouped);
  EXPECT_DOUBLE_EQ(kimi->routed_scaling_factor, 2.827);
  // architectures.md §2.2 step 6 (calc): 0.13086 for f = 32, 0.13523 for 40.
  EXPECT_NEAR(kimi->attention_softmax_scale, 0.13086, 5e-6);
  EXPECT_DOUBLE_EQ(kimi->rope_attention_factor, 1.0);  // mscale == mscale_all_dim
  // beta 1/1 over theta 50000, 4096 positions: the correction dim is
  // 64 ln(4096 / 2π) / (2 ln 50000) = 19.16, so dims <= 19 keep their
  // frequency and dims >= 20 are divided by 32.
  std::vector<double> f = RopeInverseFrequencies(*kimi);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_NEAR(f[19], std::pow(50000.0, -38.0 / 64), 1e-15);
  EXPECT_NEAR(f[20], std::pow(50000.0, -40.0 / 64) / 32.0, 1e-15);
  EXPECT_NEAR(f[31], std::pow(50000.0, -62.0 / 64) / 32.0, 1e-15);

  absl::StatusOr<ModelConfig> ds = ModelConfigFromJson(DeepseekV3Config(), nullptr);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_NEAR(ds->attention_softmax_scale, 0.13523, 5e-6);
  EXPECT_EQ(ds->moe_n_group, 8);
  EXPECT_EQ(ds->moe_topk_group, 4);
  // beta 32/1 over theta 10000: ramp from dim floor(10.47) = 10 to
  // ceil(22.51) = 23.
  f = RopeInverseFrequencies(*ds);
  for (int j : {5, 10, 16, 23, 30}) {
    const double base = std::pow(10000.0, -2.0 * j / 64);
    const double gamma = std::clamp((j - 10.0) / 13.0, 0.0, 1.0);
    EXPECT_NEAR(f[j], gamma * base / 40.0 + (1.0 - gamma) * base, 1e-15) << j;
  }

  // mscale != mscale_all_dim: cos/sin scaled by their ratio (transformers).
  nlohmann::json c = KimiK2Config();
  c["rope_scaling"]["mscale_all_dim"] = 0.5;
  absl::StatusOr<ModelConfig> m = ModelConfigFromJson(c, nullptr);
  ASSERT_TRUE(m.ok()) << m.status();
  const double ms1 = 0.1 * std::log(32.0) + 1.0, ms05 = 0.05 * std::log(32.0) + 1.0;
  EXPECT_NEAR(m->rope_attention_factor, ms1 / ms05, 1e-12);
  EXPECT_NEAR(m->attention_softmax_scale, ms05 * ms05 / std::sqrt(192.0), 1e-12);

  // No rope_scaling: plain 1/sqrt(192), no correction.
  c = KimiK2Config();
  c.erase("rope_scaling");
  m = ModelConfigFromJson(c, nullptr);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DOUBLE_EQ(m->attention_softmax_scale, 1.0 / std::sqrt(192.0));
  EXPECT_DOUBLE_EQ(RopeInverseFrequencies(*m)[20], std::pow(50000.0, -40.0 / 64));
}

TEST(DeepseekV3ConfigTest, UnsupportedOrBadValuesNameTheField) {
  struct Case {
    const char* key;
    nlohmann::json value;  // null: removed
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"q_lora_rank", nullptr, absl::StatusCode::kInvalidArgument},  // missing, not null
      {"q_lora_rank", 0, absl::StatusCode::kInvalidArgument},
      {"kv_lora_rank", nullptr, absl::StatusCode::kInvalidArgument},
      {"qk_nope_head_dim", nullptr, absl::StatusCode::kInvalidArgument},
      {"qk_rope_head_dim", 63, absl::StatusCode::kInvalidArgument},
      {"v_head_dim", -128, absl::StatusCode::kInvalidArgument},
      {"kv_lora_rank", int64_t{1} << 30, absl::StatusCode::kInvalidArgument},
      {"moe_layer_freq", 2, absl::StatusCode::kUnimplemented},
      {"routed_scaling_factor", nullptr, absl::StatusCode::kInvalidArgument},
      {"scoring_func", "softmax", absl::StatusCode::kUnimplemented},
      {"topk_method", "group_limited_greedy", absl::StatusCode::kUnimplemented},
      {"rope_interleave", false, absl::StatusCode::kUnimplemented},
      {"attention_bias", true, absl::StatusCode::kUnimplemented},
      {"first_k_dense_replace", nullptr, absl::StatusCode::kInvalidArgument},
      {"n_group", 3, absl::StatusCode::kInvalidArgument},  // 16 % 3
  };
  for (const Case& c : cases) {
    nlohmann::json config = KimiK2Config();
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
  struct YarnCase {
    const char* key;
    nlohmann::json value;
    absl::StatusCode code;
    const char* names;
  };
  const YarnCase yarn[] = {
      {"type", "dynamic", absl::StatusCode::kUnimplemented, "dynamic"},
      {"factor", -2.0, absl::StatusCode::kInvalidArgument, "factor"},
      {"factor", 16.0, absl::StatusCode::kInvalidArgument, "original_max_position_embeddings"},
      {"beta_slow", 2.0, absl::StatusCode::kInvalidArgument, "beta_slow"},
      {"mscale", -1.0, absl::StatusCode::kInvalidArgument, "mscale"},
      {"attention_factor", 1.1, absl::StatusCode::kUnimplemented, "attention_factor"},
  };
  for (const YarnCase& c : yarn) {
    nlohmann::json config = KimiK2Config();
    config["rope_scaling"][c.key] = c.value;
    absl::StatusOr<ModelConfig> parsed = ModelConfigFromJson(config, nullptr);
    ASSERT_FALSE(parsed.ok()) << c.key << " = " << c.value.dump();
    EXPECT_EQ(parsed.status().code(), c.code) << c.key << ": " << parsed.status();
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.names));
  }
  // YaRN stays refused for the other architectures.
  nlohmann::json llama = {{"architectures", {"LlamaForCausalLM"}},
                          {"hidden_size", 64},
                          {"num_hidden_layers", 1},
                          {"num_attention_heads", 2},
                          {"vocab_size", 10},
                          {"intermediate_size", 32},
                          {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}}};
  absl::StatusOr<ModelConfig> parsed = ModelConfigFromJson(llama, nullptr);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(parsed.status().message(), HasSubstr("yarn"));
}

TEST(DeepseekV3ConfigTest, ShardPlanSplitsQueryHeadsAndReplicatesTheLatent) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(KimiK2Config());
  ASSERT_TRUE(arch.ok());
  absl::StatusOr<sharding::ShardPlan> plan = sharding::PlanShards(
      *arch, sharding::WorldSpec::Uniform(3), sharding::ShardOptions{}, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // 64 heads of 192 q channels in units of 2 heads (384 = 3 x 128): 32
  // units over 3 ranks give 11, 11, 10 units = 22, 22, 20 heads
  // (architectures.md §2.5 for Kimi K2 at TP3).
  const int64_t expected[] = {22, 22, 20};
  int64_t covered = 0;
  double q_b = 0.0;
  for (const sharding::RankShard& rank : plan->ranks) {
    const sharding::LayerShard& layer = rank.layers[1];
    EXPECT_EQ(layer.q_heads.begin, covered);
    EXPECT_EQ(layer.q_heads.size(), expected[rank.rank]);
    covered = layer.q_heads.end;
    EXPECT_EQ(layer.kv_heads, (sharding::IndexRange{0, 1}));  // the latent on every rank
    q_b += static_cast<double>(layer.q_heads.size());
  }
  EXPECT_EQ(covered, 64);
  // Replicated bytes include q_a and kv_a of every layer (fp16 estimate).
  const double replicated_attention = 4.0 * 2.0 * 7168.0 * (1536.0 + 576.0);
  for (const sharding::RankShard& rank : plan->ranks) {
    EXPECT_GE(static_cast<double>(rank.replicated_bytes), replicated_attention);
  }
  // Summed over ranks, the split linears count once and the replicated
  // ones three times.
  double sum = 0.0;
  for (const sharding::RankShard& rank : plan->ranks) sum += static_cast<double>(rank.weight_bytes);
  double replicated = 0.0;
  for (const sharding::RankShard& rank : plan->ranks) replicated += static_cast<double>(rank.replicated_bytes);
  EXPECT_NEAR(sum - replicated + replicated / 3.0, static_cast<double>(plan->total_bytes),
              1e-6 * static_cast<double>(plan->total_bytes));
}

}  // namespace
}  // namespace exl3serve::worker
