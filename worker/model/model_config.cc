#include "worker/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace exl3serve::worker {
namespace {

absl::Status ReadPositiveDouble(const nlohmann::json& object, const char* where, const char* key,
                                double* out) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number() || !(it->get<double>() > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": `", key, "` must be a positive number, got ", it->dump()));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

void AddTokenIds(const nlohmann::json& value, std::vector<int32_t>* ids) {
  auto add = [&](const nlohmann::json& v) {
    if (!v.is_number_integer()) return;
    const int32_t id = v.get<int32_t>();
    for (int32_t existing : *ids) {
      if (existing == id) return;
    }
    ids->push_back(id);
  };
  if (value.is_array()) {
    for (const auto& v : value) add(v);
  } else {
    add(value);
  }
}

// mscale(f, m) of YaRN (architectures.md §2.1): 0.1·m·ln f + 1 for f > 1.
double YarnMscale(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

absl::Status ReadNonNegativeDouble(const nlohmann::json& object, const char* where,
                                   const char* key, double* out) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number() || !(it->get<double>() >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": `", key, "` must be a number >= 0, got ", it->dump()));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

// rope_scaling of type yarn, as DeepSeek-V3 / Kimi K2 configs give it.
absl::Status ReadYarn(const nlohmann::json& scaling, int64_t max_positions, RopeScaling* out) {
  const char* where = "config.json rope_scaling (yarn)";
  out->type = RopeScalingType::kYarn;
  if (!scaling.contains("factor")) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": `factor` is missing"));
  }
  if (auto s = ReadPositiveDouble(scaling, where, "factor", &out->factor); !s.ok()) return s;
  if (auto it = scaling.find("attention_factor"); it != scaling.end() && !it->is_null()) {
    return absl::UnimplementedError(absl::StrCat(
        where, ": an explicit `attention_factor` is not supported (mscale/mscale_all_dim are)"));
  }
  if (auto s = ReadPositiveDouble(scaling, where, "beta_fast", &out->beta_fast); !s.ok()) return s;
  if (auto s = ReadPositiveDouble(scaling, where, "beta_slow", &out->beta_slow); !s.ok()) return s;
  // Kimi K2 gives beta_fast = beta_slow = 1 (a one-dim ramp).
  if (out->beta_fast < out->beta_slow) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": `beta_fast` (", out->beta_fast,
                                                   ") must be >= `beta_slow` (", out->beta_slow,
                                                   ")"));
  }
  if (auto s = ReadNonNegativeDouble(scaling, where, "mscale", &out->mscale); !s.ok()) return s;
  if (auto s = ReadNonNegativeDouble(scaling, where, "mscale_all_dim", &out->mscale_all_dim);
      !s.ok()) {
    return s;
  }
  double original = 0.0;
  if (auto s = ReadPositiveDouble(scaling, where, "original_max_position_embeddings", &original);
      !s.ok()) {
    return s;
  }
  if (original > 0.0 && max_positions > 0) {
    // transformers takes the frequency factor as max_position_embeddings /
    // original_max_position_embeddings, DeepSeek's own code and exllamav3's
    // softmax scale take `factor`: they agree in every published config,
    // and a config where they do not is ambiguous.
    const double ratio = static_cast<double>(max_positions) / original;
    if (std::fabs(ratio - out->factor) > 1e-6 * out->factor) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": `factor` ", out->factor, " differs from max_position_embeddings / "
          "original_max_position_embeddings = ", max_positions, " / ", original, " = ", ratio));
    }
  }
  if (original <= 0.0) original = static_cast<double>(max_positions);
  if (!(original > 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": needs `original_max_position_embeddings` or a max_position_embeddings > 0"));
  }
  out->original_max_position_embeddings = static_cast<int64_t>(original);
  return absl::OkStatus();
}

absl::Status ReadRopeScaling(const nlohmann::json& config, int64_t max_positions, bool allow_yarn,
                             RopeScaling* out) {
  auto it = config.find("rope_scaling");
  if (it == config.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: `rope_scaling` must be an object, got ", it->dump()));
  }
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    auto t = it->find(key);
    if (t != it->end() && t->is_string()) {
      type = t->get<std::string>();
      break;
    }
  }
  if (type.empty() || type == "default") return absl::OkStatus();
  const char* where = "config.json rope_scaling";
  if (type == "linear") {
    out->type = RopeScalingType::kLinear;
    return ReadPositiveDouble(*it, where, "factor", &out->factor);
  }
  if (type == "llama3") {
    out->type = RopeScalingType::kLlama3;
    if (auto s = ReadPositiveDouble(*it, where, "factor", &out->factor); !s.ok()) return s;
    if (auto s = ReadPositiveDouble(*it, where, "low_freq_factor", &out->low_freq_factor); !s.ok()) {
      return s;
    }
    if (auto s = ReadPositiveDouble(*it, where, "high_freq_factor", &out->high_freq_factor);
        !s.ok()) {
      return s;
    }
    double original = static_cast<double>(max_positions);
    if (auto s = ReadPositiveDouble(*it, where, "original_max_position_embeddings", &original);
        !s.ok()) {
      return s;
    }
    out->original_max_position_embeddings = static_cast<int64_t>(original);
    if (!(out->high_freq_factor > out->low_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": `high_freq_factor` (", out->high_freq_factor,
          ") must be greater than `low_freq_factor` (", out->low_freq_factor, ")"));
    }
    return absl::OkStatus();
  }
  if (type == "yarn" && allow_yarn) return ReadYarn(*it, max_positions, out);
  return absl::UnimplementedError(absl::StrCat(
      "config.json: rope_scaling type `", type, "` is not supported (default, linear, llama3",
      allow_yarn ? ", yarn" : "; yarn only for DeepseekV3ForCausalLM", ")"));
}

absl::Status ReadBool(const nlohmann::json& config, const char* key, bool fallback, bool* out) {
  *out = fallback;
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: `", key, "` must be true or false, got ", it->dump()));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

// A string key that, when present, must have the one value we implement.
absl::Status RequireStringIfPresent(const nlohmann::json& config, const char* key,
                                    const char* supported) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string() || it->get<std::string>() != supported) {
    return absl::UnimplementedError(absl::StrCat("config.json: `", key, "` ", it->dump(),
                                                 " is not supported (", supported, ")"));
  }
  return absl::OkStatus();
}

// The sigmoid/noaux_tc routing keys of Glm4MoeForCausalLM and
// DeepseekV3ForCausalLM (architectures.md §1.1, §2.3).
absl::Status ReadSigmoidRouting(const nlohmann::json& config, ModelConfig* out) {
  const sharding::ModelArch& arch = out->arch;
  bool renormalize = true;  // transformers' Glm4MoeConfig / DeepseekV3Config default
  if (auto s = ReadBool(config, "norm_topk_prob", true, &renormalize); !s.ok()) return s;
  out->moe_topk_weights = renormalize ? MoeTopKWeights::kRenormalized : MoeTopKWeights::kRaw;
  if (auto s = RequireStringIfPresent(config, "scoring_func", "sigmoid"); !s.ok()) return s;
  if (auto s = RequireStringIfPresent(config, "topk_method", "noaux_tc"); !s.ok()) return s;
  out->moe_router = MoeRouter::kSigmoidGrouped;

  // exllamav3 and transformers default a missing routed_scaling_factor
  // differently (GLM: 2.5 vs 1.0, DeepSeek: 1.0 vs 2.5): a config without it
  // is ambiguous, so it is required.
  if (!config.contains("routed_scaling_factor")) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: `routed_scaling_factor` is missing (",
                                                   arch.architecture, " needs it)"));
  }
  out->routed_scaling_factor = 0.0;
  if (auto s = ReadPositiveDouble(config, "config.json", "routed_scaling_factor",
                                  &out->routed_scaling_factor);
      !s.ok() || !(out->routed_scaling_factor > 0.0)) {
    return s.ok() ? absl::InvalidArgumentError(
                        "config.json: `routed_scaling_factor` must be a positive number, got null")
                  : s;
  }

  auto read_int = [&](const char* key, int64_t* value) -> absl::Status {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) return absl::OkStatus();  // 1: no groups
    if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.json: `", key, "` must be an integer > 0, got ", it->dump()));
    }
    *value = it->get<int64_t>();
    return absl::OkStatus();
  };
  int64_t n_group = 1, topk_group = 1;
  if (auto s = read_int("n_group", &n_group); !s.ok()) return s;
  if (auto s = read_int("topk_group", &topk_group); !s.ok()) return s;
  const int64_t experts = arch.num_experts;
  if (experts % n_group != 0 || (n_group > 1 && experts / n_group < 2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `n_group` ", n_group, " must divide `n_routed_experts` ", experts,
        " into groups of at least 2 experts (a group scores its two best)"));
  }
  if (topk_group > n_group || topk_group * (experts / n_group) < arch.num_experts_per_token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `topk_group` ", topk_group, " must be in [1, n_group ", n_group,
        "] and keep at least `num_experts_per_tok` ", arch.num_experts_per_token, " experts"));
  }
  out->moe_n_group = static_cast<int>(n_group);
  out->moe_topk_group = static_cast<int>(topk_group);
  return absl::OkStatus();
}

// Glm4MoeForCausalLM's attention keys (architectures.md §1.1) and routing;
// the sizes and layer kinds are sharding::ModelArchFromConfig's.
absl::Status ReadGlm4Moe(const nlohmann::json& config, ModelConfig* out) {
  const sharding::ModelArch& arch = out->arch;
  if (auto s = ReadBool(config, "use_qk_norm", false, &out->qk_norm); !s.ok()) return s;
  if (auto s = ReadSigmoidRouting(config, out); !s.ok()) return s;
  double factor = 1.0;
  if (auto s = ReadPositiveDouble(config, "config.json", "partial_rotary_factor", &factor);
      !s.ok()) {
    return s;
  }
  const int64_t rotary = static_cast<int64_t>(static_cast<double>(arch.head_dim) * factor);
  if (factor > 1.0 || rotary <= 0 || rotary % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `partial_rotary_factor` ", factor, " x head_dim ", arch.head_dim,
        " must give an even number of rotary dims in [2, head_dim], got ", rotary));
  }
  out->rotary_dim = rotary;
  return absl::OkStatus();
}

// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2; architectures.md §2): MLA
// RoPE and softmax scale, routing as GLM's.
absl::Status ReadDeepseekV3(const nlohmann::json& config, ModelConfig* out) {
  const sharding::ModelArch& arch = out->arch;
  if (auto s = ReadSigmoidRouting(config, out); !s.ok()) return s;
  bool interleave = true;
  if (auto s = ReadBool(config, "rope_interleave", true, &interleave); !s.ok()) return s;
  if (!interleave) {
    return absl::UnimplementedError(
        "config.json: `rope_interleave` false is not supported (DeepSeek-V3 rotates interleaved "
        "pairs)");
  }
  bool bias = false;
  if (auto s = ReadBool(config, "attention_bias", false, &bias); !s.ok()) return s;
  if (bias) {
    return absl::UnimplementedError(
        "config.json: `attention_bias` true is not supported for DeepseekV3ForCausalLM");
  }
  out->rotary_dim = arch.qk_rope_head_dim;
  out->attention_softmax_scale = 1.0 / std::sqrt(static_cast<double>(arch.head_dim));
  const RopeScaling& yarn = out->rope_scaling;
  if (yarn.type == RopeScalingType::kYarn) {
    // transformers' _compute_yarn_parameters: the cos/sin factor.
    out->rope_attention_factor = yarn.mscale > 0.0 && yarn.mscale_all_dim > 0.0
                                     ? YarnMscale(yarn.factor, yarn.mscale) /
                                           YarnMscale(yarn.factor, yarn.mscale_all_dim)
                                     : YarnMscale(yarn.factor, 1.0);
    // DeepseekV3Attention: "once for q, once for k".
    if (yarn.mscale_all_dim > 0.0) {
      const double m = YarnMscale(yarn.factor, yarn.mscale_all_dim);
      out->attention_softmax_scale *= m * m;
    }
  } else if (yarn.type != RopeScalingType::kNone) {
    return absl::UnimplementedError(
        "config.json: DeepseekV3ForCausalLM supports rope_scaling yarn or none");
  }
  return absl::OkStatus();
}

// Qwen3-Next / Qwen3.5 hybrids (arch-gated-deltanet.md §1, §2.6, §3).
absl::Status ReadQwenHybrid(const nlohmann::json& config, ModelConfig* out) {
  const sharding::ModelArch& arch = out->arch;
  out->qk_norm = true;
  out->norm_weight_plus_one = true;
  if (auto it = config.find("output_gate_type"); it != config.end() && !it->is_null()) {
    if (!it->is_string() || (it->get<std::string>() != "silu" && it->get<std::string>() != "swish")) {
      return absl::UnimplementedError(absl::StrCat("config.json: `output_gate_type` ", it->dump(),
                                                   " is not supported (silu, swish)"));
    }
  }
  // RoPE: Qwen3-Next at the top level, Qwen3.5 under rope_parameters (text
  // only: its MRoPE sections see three equal position rows = plain RoPE).
  double factor = 0.25;
  const nlohmann::json* rope = &config;
  if (auto it = config.find("rope_parameters"); it != config.end() && it->is_object()) {
    rope = &*it;
    if (auto t = it->find("rope_type"); t != it->end() && t->is_string() &&
                                        t->get<std::string>() != "default") {
      return absl::UnimplementedError(absl::StrCat("config.json: `rope_parameters.rope_type` ",
                                                   t->dump(), " is not supported (default)"));
    }
    if (auto s = ReadPositiveDouble(*rope, "config.json rope_parameters", "rope_theta",
                                    &out->rope_theta);
        !s.ok()) {
      return s;
    }
  }
  if (auto s = ReadPositiveDouble(*rope, "config.json", "partial_rotary_factor", &factor); !s.ok()) {
    return s;
  }
  if (out->rope_scaling.type != RopeScalingType::kNone) {
    return absl::UnimplementedError(absl::StrCat("config.json: rope_scaling is not supported for ",
                                                 arch.architecture));
  }
  const int64_t rotary = static_cast<int64_t>(static_cast<double>(arch.head_dim) * factor);
  if (factor > 1.0 || rotary <= 0 || rotary % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `partial_rotary_factor` ", factor, " x head_dim ", arch.head_dim,
        " must give an even number of rotary dims in [2, head_dim], got ", rotary));
  }
  out->rotary_dim = rotary;
  // Qwen3-Next renormalises when norm_topk_prob (default true); Qwen3.5's
  // router always does.
  bool renormalize = true;
  if (arch.gdn_fused_projections) {
    if (auto s = ReadBool(config, "norm_topk_prob", true, &renormalize); !s.ok()) return s;
  }
  out->moe_topk_weights = renormalize ? MoeTopKWeights::kRenormalized : MoeTopKWeights::kRaw;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigFromJson(const nlohmann::json& root,
                                                const nlohmann::json* generation_config) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(root);
  if (!arch.ok()) return arch.status();
  ModelConfig out;
  out.arch = std::move(*arch);
  // The text model's keys: Qwen3.5 nests them under text_config (checked by
  // ModelArchFromConfig).
  const bool nested = out.arch.tensor_prefix == "model.language_model";
  const nlohmann::json& config = nested ? root.at("text_config") : root;
  const std::string& name = out.arch.architecture;
  const bool qwen = name.rfind("Qwen", 0) == 0;
  out.qk_norm = name == "Qwen3ForCausalLM" || name == "Qwen3MoeForCausalLM";

  if (auto s = ReadPositiveDouble(config, "config.json", "rms_norm_eps", &out.rms_norm_eps); !s.ok()) {
    return s;
  }
  if (auto s = ReadPositiveDouble(config, "config.json", "rope_theta", &out.rope_theta); !s.ok()) {
    return s;
  }
  int64_t max_positions = 0;
  if (auto it = config.find("max_position_embeddings");
      it != config.end() && it->is_number_integer()) {
    max_positions = it->get<int64_t>();
  }
  if (auto s = ReadRopeScaling(config, max_positions, /*allow_yarn=*/out.arch.mla(),
                               &out.rope_scaling);
      !s.ok()) {
    return s;
  }

  if (auto it = config.find("hidden_act"); it != config.end() && it->is_string() &&
                                           it->get<std::string>() != "silu") {
    return absl::UnimplementedError(absl::StrCat("config.json: `hidden_act` ", it->dump(),
                                                 " is not supported (silu)"));
  }

  if (auto it = config.find("sliding_window"); it != config.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `sliding_window` must be a positive integer or null, got ", it->dump()));
    }
    if (!qwen) {
      out.sliding_window = it->get<int64_t>();
    } else if (auto use = config.find("use_sliding_window");
               use != config.end() && use->is_boolean() && use->get<bool>()) {
      // Qwen applies the window only to some layers (max_window_layers).
      return absl::UnimplementedError(
          "config.json: `use_sliding_window` true (Qwen per-layer windows) is not supported");
    }
  }

  if (name == "Qwen3MoeForCausalLM") {
    auto it = config.find("norm_topk_prob");
    const bool renormalize = it != config.end() && it->is_boolean() && it->get<bool>();
    out.moe_topk_weights = renormalize ? MoeTopKWeights::kRenormalized : MoeTopKWeights::kRaw;
  }

  out.rotary_dim = out.arch.head_dim;
  if (name == "Glm4MoeForCausalLM") {
    if (auto s = ReadGlm4Moe(config, &out); !s.ok()) return s;
  }
  if (name == "DeepseekV3ForCausalLM") {
    if (auto s = ReadDeepseekV3(config, &out); !s.ok()) return s;
  }
  if (out.arch.gdn_key_heads > 0) {
    if (auto s = ReadQwenHybrid(config, &out); !s.ok()) return s;
  }

  for (const nlohmann::json* source : {&config, &root}) {
    if (auto it = source->find("bos_token_id");
        out.bos_token_id < 0 && it != source->end() && it->is_number_integer()) {
      out.bos_token_id = it->get<int32_t>();
    }
    if (auto it = source->find("eos_token_id"); it != source->end()) {
      AddTokenIds(*it, &out.eos_token_ids);
    }
  }
  if (generation_config != nullptr && generation_config->is_object()) {
    if (auto it = generation_config->find("eos_token_id"); it != generation_config->end()) {
      AddTokenIds(*it, &out.eos_token_ids);
    }
  }
  return out;
}

std::vector<double> RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t dim = config.rotary_dim > 0 ? config.rotary_dim : config.arch.head_dim;
  std::vector<double> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    inv_freq[i] = std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / dim);
  }
  const RopeScaling& s = config.rope_scaling;
  if (s.type == RopeScalingType::kYarn) {
    // transformers' _compute_yarn_parameters (truncate = true): dims below
    // `low` keep their frequency, above `high` take frequency / factor, a
    // linear ramp between; low/high are the dims whose wavelength makes
    // beta_fast / beta_slow turns over original_max_position_embeddings.
    const double original = static_cast<double>(s.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(original / (rotations * 2.0 * std::numbers::pi)) /
             (2.0 * std::log(config.rope_theta));
    };
    double low = std::max(0.0, std::floor(correction_dim(s.beta_fast)));
    double high = std::min(static_cast<double>(dim - 1), std::ceil(correction_dim(s.beta_slow)));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double ramp =
          std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      inv_freq[i] = inv_freq[i] / s.factor * ramp + inv_freq[i] * (1.0 - ramp);
    }
  } else if (s.type == RopeScalingType::kLinear) {
    for (double& f : inv_freq) f /= s.factor;
  } else if (s.type == RopeScalingType::kLlama3) {
    // Wavelengths shorter than original/high_freq_factor keep their frequency,
    // longer than original/low_freq_factor are divided by `factor`, and the
    // band between is interpolated linearly in original/wavelength.
    const double original = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = original / s.low_freq_factor;
    const double high_freq_wavelen = original / s.high_freq_factor;
    for (double& f : inv_freq) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen < high_freq_wavelen) continue;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;
        continue;
      }
      const double smooth =
          (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1.0 - smooth) * f / s.factor + smooth * f;
    }
  }
  return inv_freq;
}

}  // namespace exl3serve::worker
