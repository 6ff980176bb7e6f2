#include "worker/model/model_config.h"

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

absl::Status ReadRopeScaling(const nlohmann::json& config, int64_t max_positions,
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
  return absl::UnimplementedError(absl::StrCat(
      "config.json: rope_scaling type `", type, "` is not supported (default, linear, llama3)"));
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

// Glm4MoeForCausalLM's attention and routing keys (architectures.md §1.1);
// the sizes and layer kinds are sharding::ModelArchFromConfig's.
absl::Status ReadGlm4Moe(const nlohmann::json& config, ModelConfig* out) {
  const sharding::ModelArch& arch = out->arch;
  if (auto s = ReadBool(config, "use_qk_norm", false, &out->qk_norm); !s.ok()) return s;
  bool renormalize = true;  // transformers' Glm4MoeConfig default
  if (auto s = ReadBool(config, "norm_topk_prob", true, &renormalize); !s.ok()) return s;
  out->moe_topk_weights = renormalize ? MoeTopKWeights::kRenormalized : MoeTopKWeights::kRaw;
  if (auto s = RequireStringIfPresent(config, "scoring_func", "sigmoid"); !s.ok()) return s;
  if (auto s = RequireStringIfPresent(config, "topk_method", "noaux_tc"); !s.ok()) return s;
  out->moe_router = MoeRouter::kSigmoidGrouped;

  // exllamav3 defaults a missing routed_scaling_factor to 2.5, transformers
  // to 1.0: a config without it is ambiguous, so it is required.
  if (!config.contains("routed_scaling_factor")) {
    return absl::InvalidArgumentError(
        "config.json: `routed_scaling_factor` is missing (Glm4MoeForCausalLM needs it)");
  }
  out->routed_scaling_factor = 0.0;
  if (auto s = ReadPositiveDouble(config, "config.json", "routed_scaling_factor",
                                  &out->routed_scaling_factor);
      !s.ok() || !(out->routed_scaling_factor > 0.0)) {
    return s.ok() ? absl::InvalidArgumentError(
                        "config.json: `routed_scaling_factor` must be a positive number, got null")
                  : s;
  }

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

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigFromJson(const nlohmann::json& config,
                                                const nlohmann::json* generation_config) {
  absl::StatusOr<sharding::ModelArch> arch = sharding::ModelArchFromConfig(config);
  if (!arch.ok()) return arch.status();
  ModelConfig out;
  out.arch = std::move(*arch);
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
  if (auto s = ReadRopeScaling(config, max_positions, &out.rope_scaling); !s.ok()) return s;

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

  if (auto it = config.find("bos_token_id"); it != config.end() && it->is_number_integer()) {
    out.bos_token_id = it->get<int32_t>();
  }
  if (auto it = config.find("eos_token_id"); it != config.end()) AddTokenIds(*it, &out.eos_token_ids);
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
  if (s.type == RopeScalingType::kLinear) {
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
