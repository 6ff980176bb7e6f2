#include "sharding/test_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
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

}  // namespace

absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& o) {
  nlohmann::json config = {
      {"hidden_size", o.hidden_size},
      {"num_hidden_layers", o.num_layers},
      {"num_attention_heads", o.num_attention_heads},
      {"num_key_value_heads", o.num_key_value_heads},
      {"head_dim", o.hidden_size / o.num_attention_heads},
      {"vocab_size", o.vocab_size},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 10000.0},
      {"max_position_embeddings", 2048},
      {"tie_word_embeddings", o.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"torch_dtype", "bfloat16"},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
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
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arch must be llama, qwen3, qwen3-moe or mixtral, got `", o.arch, "`"));
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
  std::vector<uint16_t> embed = RandomLinear(rng, o.vocab_size, hidden);
  if (o.peaked_logits) {
    // Embedding rows of norm ~sqrt(hidden) dominate the residual stream.
    for (uint16_t& b : embed) b = FloatToBf16Bits(16.0f * BitsToFloatBf16(b));
  }
  tensors.push_back(TensorFromHalfBits("model.embed_tokens.weight", DType::kBF16,
                                       {o.vocab_size, hidden}, embed));
  const bool qwen3 = o.arch == "qwen3" || o.arch == "qwen3-moe";
  for (const LinearSpec& l : arch.linears) {
    if (l.is_head && o.tie_word_embeddings) continue;
    if (l.layer >= 0 && l.role == LinearRole::kQ) {
      const std::string layer = absl::StrCat("model.layers.", l.layer);
      tensors.push_back(TensorFromHalfBits(layer + ".input_layernorm.weight", DType::kBF16,
                                           {hidden}, RandomNorm(rng, hidden)));
      tensors.push_back(TensorFromHalfBits(layer + ".post_attention_layernorm.weight",
                                           DType::kBF16, {hidden}, RandomNorm(rng, hidden)));
      if (qwen3) {
        const int64_t hd = arch.head_dim;
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.q_norm.weight", DType::kBF16,
                                             {hd}, RandomNorm(rng, hd)));
        tensors.push_back(TensorFromHalfBits(layer + ".self_attn.k_norm.weight", DType::kBF16,
                                             {hd}, RandomNorm(rng, hd)));
      }
    }
    std::vector<uint16_t> weight = RandomLinear(rng, l.out_features, l.in_features);
    if (o.peaked_logits && l.is_head) {
      for (int64_t v = 0; v < l.out_features; ++v) {
        const int64_t src = (7 * v + 3) % o.vocab_size;
        std::memcpy(&weight[v * hidden], &embed[src * hidden], sizeof(uint16_t) * hidden);
      }
    } else if (o.peaked_logits &&
               (l.role == LinearRole::kO || l.role == LinearRole::kDown)) {
      for (uint16_t& b : weight) {
        b = FloatToBf16Bits(0.1f * BitsToFloatBf16(b));
      }
    }
    tensors.push_back(TensorFromHalfBits(l.key + ".weight", DType::kBF16,
                                         {l.out_features, l.in_features}, std::move(weight)));
  }
  tensors.push_back(TensorFromHalfBits("model.norm.weight", DType::kBF16, {hidden},
                                       RandomNorm(rng, hidden)));

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
  nlohmann::json generation = {{"bos_token_id", 1}, {"eos_token_id", 2}, {"do_sample", false}};
  return WriteFileAtomically(dir + "/generation_config.json", generation.dump(2));
}

}  // namespace exl3serve::sharding
