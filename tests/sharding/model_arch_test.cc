// ModelArchFromConfig: the linears each supported architecture defines.
#include "sharding/model_arch.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3serve::sharding {
namespace {

using ::testing::HasSubstr;

nlohmann::json DenseConfig(const char* arch) {
  return {{"architectures", {arch}}, {"hidden_size", 512},       {"intermediate_size", 1376},
          {"num_hidden_layers", 3},  {"num_attention_heads", 8}, {"num_key_value_heads", 2},
          {"vocab_size", 32000}};
}

TEST(ModelArchTest, LlamaHasSevenLinearsPerLayerPlusHead) {
  auto arch = ModelArchFromConfig(DenseConfig("LlamaForCausalLM"));
  ASSERT_TRUE(arch.ok()) << arch.status();
  EXPECT_EQ(arch->linears.size(), 3u * 7 + 1);
  const LinearSpec* k = arch->Find(1, LinearRole::kK);
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->key, "model.layers.1.self_attn.k_proj");
  EXPECT_EQ(k->in_features, 512);
  EXPECT_EQ(k->out_features, 2 * 64);
  EXPECT_EQ(k->qgroup, arch->Find(1, LinearRole::kQ)->qgroup);
  EXPECT_NE(k->qgroup, arch->Find(1, LinearRole::kO)->qgroup);
  const LinearSpec* down = arch->Find(2, LinearRole::kDown);
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->in_features, 1376);
  EXPECT_EQ(down->out_features, 512);
  EXPECT_GT(arch->Find(0, LinearRole::kQ)->priority, down->priority);
  const LinearSpec* head = arch->Find(-1, LinearRole::kHead);
  ASSERT_NE(head, nullptr);
  EXPECT_TRUE(head->is_head);
  EXPECT_EQ(head->out_features, 32000);
}

TEST(ModelArchTest, Qwen3UsesExplicitHeadDim) {
  auto config = DenseConfig("Qwen3ForCausalLM");
  config["head_dim"] = 128;
  auto arch = ModelArchFromConfig(config);
  ASSERT_TRUE(arch.ok());
  EXPECT_EQ(arch->Find(0, LinearRole::kQ)->out_features, 8 * 128);
  EXPECT_EQ(arch->Find(0, LinearRole::kO)->in_features, 8 * 128);
}

TEST(ModelArchTest, MixtralExpertsUseW1W2W3AndAnUnquantizedRouter) {
  auto config = DenseConfig("MixtralForCausalLM");
  config["num_local_experts"] = 4;
  config["num_experts_per_tok"] = 2;
  auto arch = ModelArchFromConfig(config);
  ASSERT_TRUE(arch.ok()) << arch.status();
  const LinearSpec* router = arch->Find(0, LinearRole::kRouter);
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->key, "model.layers.0.block_sparse_moe.gate");
  EXPECT_FALSE(router->quantized);
  EXPECT_EQ(router->out_features, 4);
  EXPECT_EQ(arch->Find(0, LinearRole::kGate, 3)->key, "model.layers.0.block_sparse_moe.experts.3.w1");
  EXPECT_EQ(arch->Find(0, LinearRole::kDown, 3)->key, "model.layers.0.block_sparse_moe.experts.3.w2");
  EXPECT_EQ(arch->Find(0, LinearRole::kUp, 3)->key, "model.layers.0.block_sparse_moe.experts.3.w3");
  EXPECT_EQ(arch->Find(0, LinearRole::kGate, 0)->qgroup, arch->Find(0, LinearRole::kDown, 2)->qgroup);
}

TEST(ModelArchTest, Qwen3MoeHonoursMlpOnlyLayers) {
  auto config = DenseConfig("Qwen3MoeForCausalLM");
  config["num_experts"] = 8;
  config["num_experts_per_tok"] = 2;
  config["moe_intermediate_size"] = 256;
  config["mlp_only_layers"] = {1};
  auto arch = ModelArchFromConfig(config);
  ASSERT_TRUE(arch.ok()) << arch.status();
  EXPECT_TRUE(arch->layer_is_moe[0]);
  EXPECT_FALSE(arch->layer_is_moe[1]);
  EXPECT_NE(arch->Find(1, LinearRole::kGate), nullptr);
  EXPECT_EQ(arch->Find(1, LinearRole::kGate, 0), nullptr);
  EXPECT_EQ(arch->Find(2, LinearRole::kDown, 7)->key, "model.layers.2.mlp.experts.7.down_proj");
  EXPECT_EQ(arch->Find(2, LinearRole::kDown, 7)->in_features, 256);
}

// The recipe: each layer names its token mixer and feed-forward, and every
// linear of a layer belongs to one of them (the converter, the planner and
// the runtime read the same recipe).
TEST(ModelArchTest, RecipeNamesEachLayersModules) {
  auto qwen = DenseConfig("Qwen3MoeForCausalLM");
  qwen["num_experts"] = 8;
  qwen["num_experts_per_tok"] = 2;
  qwen["moe_intermediate_size"] = 256;
  qwen["mlp_only_layers"] = {1};
  auto arch = ModelArchFromConfig(qwen);
  ASSERT_TRUE(arch.ok()) << arch.status();
  ASSERT_EQ(arch->layers.size(), 3u);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(arch->layers[l].mixer, TokenMixerKind::kAttention);
    EXPECT_EQ(arch->layers[l].feed_forward == FeedForwardKind::kMixtureOfExperts,
              arch->layer_is_moe[l]);
  }
  EXPECT_EQ(arch->layers[1].feed_forward, FeedForwardKind::kDenseMlp);

  nlohmann::json ds = DenseConfig("DeepseekV3ForCausalLM");
  const nlohmann::json mla = {{"kv_lora_rank", 56},       {"qk_nope_head_dim", 24},
                              {"qk_rope_head_dim", 16},   {"v_head_dim", 20},
                              {"q_lora_rank", nullptr},   {"moe_intermediate_size", 96},
                              {"n_routed_experts", 12},   {"num_experts_per_tok", 3},
                              {"first_k_dense_replace", 2}, {"n_shared_experts", 1}};
  for (const auto& [key, value] : mla.items()) ds[key] = value;
  auto deepseek = ModelArchFromConfig(ds);
  ASSERT_TRUE(deepseek.ok()) << deepseek.status();
  EXPECT_EQ(deepseek->layers[0].mixer, TokenMixerKind::kLatentAttention);
  EXPECT_EQ(deepseek->layers[1].feed_forward, FeedForwardKind::kDenseMlp);
  EXPECT_EQ(deepseek->layers[2].feed_forward, FeedForwardKind::kMixtureOfExperts);
  EXPECT_STREQ(TokenMixerKindName(deepseek->layers[2].mixer), "latent_attention");
  EXPECT_STREQ(FeedForwardKindName(deepseek->layers[2].feed_forward), "moe");
  // Layer 2: plain q (q_lora_rank null), kv_a, kv_b (16-bit), o; router,
  // 12 x 3 expert projections, 3 shared-expert projections.
  int layer2 = 0;
  for (const LinearSpec& spec : deepseek->linears) layer2 += spec.layer == 2;
  EXPECT_EQ(layer2, 4 + 1 + 12 * 3 + 3);
  EXPECT_FALSE(deepseek->Find(2, LinearRole::kKVB)->quantized);
  EXPECT_EQ(deepseek->Find(2, LinearRole::kQA), nullptr);
  EXPECT_EQ(deepseek->Find(2, LinearRole::kUp, kSharedExpert)->key,
            "model.layers.2.mlp.shared_experts.up_proj");
}

TEST(ModelArchTest, UnknownArchitectureIsUnimplementedAndListsSupported) {
  auto arch = ModelArchFromConfig(DenseConfig("GPT2LMHeadModel"));
  ASSERT_FALSE(arch.ok());
  EXPECT_EQ(arch.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(arch.status().message()), HasSubstr("Qwen3MoeForCausalLM"));
}

TEST(ModelArchTest, MissingOrBadKeysNameTheKey) {
  auto config = DenseConfig("LlamaForCausalLM");
  config.erase("hidden_size");
  auto arch = ModelArchFromConfig(config);
  ASSERT_FALSE(arch.ok());
  EXPECT_EQ(arch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(arch.status().message()), HasSubstr("`hidden_size`"));
  config = DenseConfig("LlamaForCausalLM");
  config["num_key_value_heads"] = 3;
  arch = ModelArchFromConfig(config);
  ASSERT_FALSE(arch.ok());
  EXPECT_THAT(std::string(arch.status().message()), HasSubstr("num_key_value_heads"));
}

}  // namespace
// Found by the model_config fuzzer (30-minute run): num_hidden_layers of
// 2.3e15 threw std::length_error out of a vector assign (an abort). Every
// size is bounded and the error names the limit.
TEST(ModelArchTest, SizesPastTheirLimitsAreErrorsNamingTheLimit) {
  struct Case {
    const char* key;
    int64_t value;
    const char* limit;
  };
  for (const Case& c : {Case{"num_hidden_layers", 2333333333333333, "kMaxConfigLayers"},
                        Case{"hidden_size", int64_t{1} << 40, "kMaxConfigWidth"},
                        Case{"intermediate_size", int64_t{1} << 50, "kMaxConfigWidth"},
                        Case{"vocab_size", int64_t{1} << 33, "kMaxConfigVocab"},
                        Case{"num_attention_heads", 1 << 20, "kMaxConfigHeads"},
                        Case{"head_dim", int64_t{1} << 61, "kMaxConfigWidth"}}) {
    nlohmann::json config = DenseConfig("LlamaForCausalLM");
    config[c.key] = c.value;
    if (std::string(c.key) == "num_attention_heads") {
      config["num_key_value_heads"] = 1;
      config["head_dim"] = 64;
    }
    auto arch = ModelArchFromConfig(config);
    ASSERT_FALSE(arch.ok()) << c.key;
    EXPECT_EQ(arch.status().code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(std::string(arch.status().message()), ::testing::HasSubstr(c.limit)) << c.key;
    EXPECT_THAT(std::string(arch.status().message()), ::testing::HasSubstr(c.key));
  }
  nlohmann::json moe = DenseConfig("MixtralForCausalLM");
  moe["num_local_experts"] = 1 << 20;
  moe["num_experts_per_tok"] = 2;
  EXPECT_THAT(std::string(ModelArchFromConfig(moe).status().message()),
              ::testing::HasSubstr("kMaxConfigExperts"));
}

}  // namespace exl3serve::sharding
