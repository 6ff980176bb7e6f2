#include "sharding/model_arch.h"

#include <algorithm>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace exl3serve::sharding {
namespace {

// kQwen3Next: Qwen3NextForCausalLM; kQwen35: Qwen3_5ForConditionalGeneration
// and Qwen3_5MoeForConditionalGeneration (text keys under `text_config`,
// tensors under `model.language_model.`). Both hybrid: Gated DeltaNet and
// gated attention layers (arch-gated-deltanet.md §1).
enum class Family { kDense, kMixtral, kQwen3Moe, kGlm4Moe, kDeepseekV3, kQwen3Next, kQwen35 };

struct ArchEntry {
  std::string_view name;
  Family family;
};

constexpr ArchEntry kSupported[] = {
    {"LlamaForCausalLM", Family::kDense},    {"MistralForCausalLM", Family::kDense},
    {"Qwen2ForCausalLM", Family::kDense},    {"Qwen3ForCausalLM", Family::kDense},
    {"MixtralForCausalLM", Family::kMixtral}, {"Qwen3MoeForCausalLM", Family::kQwen3Moe},
    {"Glm4MoeForCausalLM", Family::kGlm4Moe}, {"DeepseekV3ForCausalLM", Family::kDeepseekV3},
    {"Qwen3NextForCausalLM", Family::kQwen3Next},
    {"Qwen3_5ForConditionalGeneration", Family::kQwen35},
    {"Qwen3_5MoeForConditionalGeneration", Family::kQwen35},
};

absl::StatusOr<int64_t> RequiredInt(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || !it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: `", key, "` must be an integer, ",
                     it == config.end() ? std::string("it is missing") : "got " + it->dump()));
  }
  const int64_t value = it->get<int64_t>();
  if (value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: `", key, "` must be > 0, got ", value));
  }
  return value;
}

int64_t OptionalInt(const nlohmann::json& config, const char* key, int64_t fallback) {
  auto it = config.find(key);
  if (it == config.end() || !it->is_number_integer()) return fallback;
  return it->get<int64_t>();
}

bool OptionalBool(const nlohmann::json& config, const char* key, bool fallback) {
  auto it = config.find(key);
  if (it == config.end() || !it->is_boolean()) return fallback;
  return it->get<bool>();
}

}  // namespace

const char* LinearRoleName(LinearRole role) {
  switch (role) {
    case LinearRole::kQ: return "q";
    case LinearRole::kK: return "k";
    case LinearRole::kV: return "v";
    case LinearRole::kO: return "o";
    case LinearRole::kGate: return "gate";
    case LinearRole::kUp: return "up";
    case LinearRole::kDown: return "down";
    case LinearRole::kRouter: return "router";
    case LinearRole::kHead: return "head";
    case LinearRole::kQA: return "q_a";
    case LinearRole::kQB: return "q_b";
    case LinearRole::kKVA: return "kv_a";
    case LinearRole::kKVB: return "kv_b";
    case LinearRole::kGdnQkvz: return "gdn_qkvz";
    case LinearRole::kGdnBa: return "gdn_ba";
    case LinearRole::kGdnQkv: return "gdn_qkv";
    case LinearRole::kGdnZ: return "gdn_z";
    case LinearRole::kGdnB: return "gdn_b";
    case LinearRole::kGdnA: return "gdn_a";
    case LinearRole::kGdnOut: return "gdn_out";
    case LinearRole::kSharedExpertGate: return "shared_expert_gate";
  }
  return "?";
}

const LinearSpec* ModelArch::Find(int layer, LinearRole role, int expert) const {
  for (const LinearSpec& spec : linears) {
    if (spec.layer == layer && spec.role == role && spec.expert == expert) return &spec;
  }
  return nullptr;
}

const LinearSpec* ModelArch::FindByKey(std::string_view key) const {
  for (const LinearSpec& spec : linears) {
    if (spec.key == key) return &spec;
  }
  return nullptr;
}

namespace {

// Limits on the sizes config.json may give, far above every published model
// (the largest have 126 layers, hidden 16384, 384 experts, vocabularies of
// ~262 k); each error names its limit. Without them a downloaded config could
// ask the loader and planner for tables of 2^60 entries.
constexpr int64_t kMaxConfigLayers = 1024;
constexpr int64_t kMaxConfigWidth = int64_t{1} << 20;  // hidden, intermediate, head_dim
constexpr int64_t kMaxConfigHeads = 4096;
constexpr int64_t kMaxConfigVocab = int64_t{1} << 22;
constexpr int64_t kMaxConfigExperts = 4096;

absl::Status OverLimit(const char* key, int64_t value, const char* limit, int64_t max) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: `", key, "` = ", value, " is over ", limit, " = ", max));
}


// Adds one linear to the architecture's list.
using AddLinear = std::function<void(std::string key, int layer, int expert, LinearRole role,
                                     int64_t in, int64_t out, std::string qgroup, int priority,
                                     std::string module_group)>;

// Grouped-query attention (§6.7: q/k/v one group, o another, attention priority 2).
void AddAttentionLinears(const ModelArch& arch, int l, const std::string& layer,
                         const AddLinear& add) {
  const std::string attn = layer + ".self_attn";
  const int64_t hidden = arch.hidden_size;
  const int64_t q_out = arch.num_attention_heads * arch.head_dim;
  const int64_t kv_out = arch.num_key_value_heads * arch.head_dim;
  // With an output gate q_proj yields [q_h | gate_h] per head.
  const int64_t q_rows = arch.attention_output_gate ? 2 * q_out : q_out;
  add(attn + ".q_proj", l, -1, LinearRole::kQ, hidden, q_rows, attn + ".qkv", 2, attn);
  add(attn + ".k_proj", l, -1, LinearRole::kK, hidden, kv_out, attn + ".qkv", 2, attn);
  add(attn + ".v_proj", l, -1, LinearRole::kV, hidden, kv_out, attn + ".qkv", 2, attn);
  add(attn + ".o_proj", l, -1, LinearRole::kO, q_out, hidden, attn + ".o", 2, attn);
}

// Gated DeltaNet (arch-gated-deltanet.md §2.1, §5): the input projections
// (fused qkvz, or split qkv + z) one group and out_proj another, both at
// attention's priority; the small β / decay projections (ba, or b and a)
// stay 16-bit and unpadded like the router (exllamav3 keeps them fp16).
void AddGatedDeltaNetLinears(ModelArch& arch, int l, const std::string& layer,
                             const AddLinear& add) {
  const std::string lin = layer + ".linear_attn";
  const int64_t hidden = arch.hidden_size;
  const int64_t key = arch.gdn_key_heads * arch.gdn_key_dim;
  const int64_t value = arch.gdn_value_heads * arch.gdn_value_dim;
  if (arch.gdn_fused_projections) {
    add(lin + ".in_proj_qkvz", l, -1, LinearRole::kGdnQkvz, hidden, 2 * key + 2 * value,
        lin + ".input", 2, lin);
    add(lin + ".in_proj_ba", l, -1, LinearRole::kGdnBa, hidden, 2 * arch.gdn_value_heads, "", 0, lin);
    arch.linears.back().quantized = false;
  } else {
    add(lin + ".in_proj_qkv", l, -1, LinearRole::kGdnQkv, hidden, 2 * key + value, lin + ".input",
        2, lin);
    add(lin + ".in_proj_z", l, -1, LinearRole::kGdnZ, hidden, value, lin + ".input", 2, lin);
    add(lin + ".in_proj_b", l, -1, LinearRole::kGdnB, hidden, arch.gdn_value_heads, "", 0, lin);
    arch.linears.back().quantized = false;
    add(lin + ".in_proj_a", l, -1, LinearRole::kGdnA, hidden, arch.gdn_value_heads, "", 0, lin);
    arch.linears.back().quantized = false;
  }
  add(lin + ".out_proj", l, -1, LinearRole::kGdnOut, value, hidden, lin + ".output", 2, lin);
}

// Multi-head latent attention (architectures.md §2.4): the projections of
// the layer input (q_a or q, kv_a) one group, q_b and o one each, all at
// least base+2 like attention; kv_b stays 16-bit and unpadded (marked by
// the caller through `unquantized`), like the router.
void AddLatentAttentionLinears(ModelArch& arch, int l, const std::string& layer,
                               const AddLinear& add) {
  const std::string attn = layer + ".self_attn";
  const int64_t hidden = arch.hidden_size;
  const int64_t heads = arch.num_attention_heads;
  const int64_t q_out = heads * arch.head_dim;
  if (arch.q_lora_rank > 0) {
    add(attn + ".q_a_proj", l, -1, LinearRole::kQA, hidden, arch.q_lora_rank, attn + ".qkv", 2,
        attn);
    add(attn + ".q_b_proj", l, -1, LinearRole::kQB, arch.q_lora_rank, q_out, attn + ".q_b", 2,
        attn);
  } else {
    add(attn + ".q_proj", l, -1, LinearRole::kQ, hidden, q_out, attn + ".qkv", 2, attn);
  }
  add(attn + ".kv_a_proj_with_mqa", l, -1, LinearRole::kKVA, hidden,
      arch.kv_lora_rank + arch.qk_rope_head_dim, attn + ".qkv", 2, attn);
  add(attn + ".kv_b_proj", l, -1, LinearRole::kKVB, arch.kv_lora_rank,
      heads * (arch.qk_nope_head_dim + arch.v_head_dim), "", 0, attn);
  arch.linears.back().quantized = false;
  add(attn + ".o_proj", l, -1, LinearRole::kO, heads * arch.v_head_dim, hidden, attn + ".o", 2,
      attn);
}

// The dense SwiGLU MLP (§6.7: gate+up one group, down another, MLP priority 1).
void AddSwiGluLinears(const ModelArch& arch, int l, const std::string& layer,
                      const AddLinear& add) {
  const std::string mlp = layer + ".mlp";
  const int64_t hidden = arch.hidden_size, inter = arch.intermediate_size;
  add(mlp + ".gate_proj", l, -1, LinearRole::kGate, hidden, inter, mlp + ".gate_up", 1, mlp);
  add(mlp + ".up_proj", l, -1, LinearRole::kUp, hidden, inter, mlp + ".gate_up", 1, mlp);
  add(mlp + ".down_proj", l, -1, LinearRole::kDown, inter, hidden, mlp + ".down", 1, mlp);
}

// Where an architecture keeps its MoE block's tensors: `<layer><block>.gate`
// (router), `<layer><block>.experts.<e><gate|up|down>`.
struct MoeTensorNames {
  const char* block;
  const char* gate;
  const char* up;
  const char* down;
  const char* shared;  // the shared expert under the block
};

// Router (fp16, unpadded: §2.5), the routed experts (§6.7: all experts'
// projections of one layer form one group) and the shared expert (its own
// groups at priority 2: exllamav3 gives it at least base+2 bits,
// architectures.md §1.3).
void AddMoeLinears(ModelArch& arch, int l, const std::string& layer, const MoeTensorNames& names,
                   const AddLinear& add) {
  const std::string moe_block = layer + names.block;
  const int64_t hidden = arch.hidden_size, inter = arch.moe_intermediate_size;
  add(moe_block + ".gate", l, -1, LinearRole::kRouter, hidden, arch.num_experts, "", 0, moe_block);
  arch.linears.back().quantized = false;
  const std::string qgroup = moe_block + ".experts";
  for (int e = 0; e < arch.num_experts; ++e) {
    const std::string ex = absl::StrCat(moe_block, ".experts.", e);
    add(ex + names.gate, l, e, LinearRole::kGate, hidden, inter, qgroup, 1, moe_block);
    add(ex + names.up, l, e, LinearRole::kUp, hidden, inter, qgroup, 1, moe_block);
    add(ex + names.down, l, e, LinearRole::kDown, inter, hidden, qgroup, 1, moe_block);
  }
  if (arch.shared_expert_intermediate_size > 0) {
    const std::string sh = moe_block + names.shared;
    const int64_t width = arch.shared_expert_intermediate_size;
    add(sh + ".gate_proj", l, kSharedExpert, LinearRole::kGate, hidden, width, sh + ".gate_up", 2,
        moe_block);
    add(sh + ".up_proj", l, kSharedExpert, LinearRole::kUp, hidden, width, sh + ".gate_up", 2,
        moe_block);
    add(sh + ".down_proj", l, kSharedExpert, LinearRole::kDown, width, hidden, sh + ".down", 2,
        moe_block);
    if (arch.shared_expert_gated) {  // [1, hidden], 16-bit like the router
      add(moe_block + ".shared_expert_gate", l, -1, LinearRole::kSharedExpertGate, hidden, 1, "",
          0, moe_block);
      arch.linears.back().quantized = false;
    }
  }
}

}  // namespace

const char* TokenMixerKindName(TokenMixerKind kind) {
  switch (kind) {
    case TokenMixerKind::kAttention: return "attention";
    case TokenMixerKind::kLatentAttention: return "latent_attention";
    case TokenMixerKind::kGatedDeltaNet: return "gated_deltanet";
  }
  return "?";
}

const char* FeedForwardKindName(FeedForwardKind kind) {
  switch (kind) {
    case FeedForwardKind::kDenseMlp: return "dense_mlp";
    case FeedForwardKind::kMixtureOfExperts: return "moe";
  }
  return "?";
}

static const nlohmann::json* TextConfig(const nlohmann::json& root) {
  auto archs = root.find("architectures");
  if (archs == root.end() || !archs->is_array()) return &root;
  for (const auto& name : *archs) {
    if (name.is_string() && (name.get<std::string>() == "Qwen3_5ForConditionalGeneration" ||
                             name.get<std::string>() == "Qwen3_5MoeForConditionalGeneration")) {
      auto text = root.find("text_config");
      return text != root.end() && text->is_object() ? &*text : nullptr;
    }
  }
  return &root;
}

absl::StatusOr<ModelArch> ModelArchFromConfig(const nlohmann::json& root) {
  if (!root.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  ModelArch arch;
  const ArchEntry* entry = nullptr;
  auto archs = root.find("architectures");
  if (archs != root.end() && archs->is_array()) {
    for (const auto& name : *archs) {
      if (!name.is_string()) continue;
      for (const ArchEntry& e : kSupported) {
        if (name.get<std::string>() == e.name) entry = &e;
      }
    }
  }
  if (entry == nullptr) {
    std::vector<std::string> names;
    for (const ArchEntry& e : kSupported) names.emplace_back(e.name);
    return absl::UnimplementedError(absl::StrCat(
        "config.json: `architectures` is ",
        archs == root.end() ? std::string("missing") : archs->dump(), "; supported: ",
        absl::StrJoin(names, ", ")));
  }
  arch.architecture = std::string(entry->name);
  // The text model's keys (Qwen3.5: under `text_config`).
  const nlohmann::json* text = TextConfig(root);
  if (text == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: ", arch.architecture, " needs a `text_config` object"));
  }
  const nlohmann::json& config = *text;
  const bool hybrid = entry->family == Family::kQwen3Next || entry->family == Family::kQwen35;
  if (entry->family == Family::kQwen35) arch.tensor_prefix = "model.language_model";

  auto read = [&](const char* key, int64_t* out) -> absl::Status {
    absl::StatusOr<int64_t> v = RequiredInt(config, key);
    if (!v.ok()) return v.status();
    *out = *v;
    return absl::OkStatus();
  };
  int64_t layers = 0;
  if (auto s = read("num_hidden_layers", &layers); !s.ok()) return s;
  if (layers > kMaxConfigLayers) return OverLimit("num_hidden_layers", layers, "kMaxConfigLayers", kMaxConfigLayers);
  arch.num_layers = static_cast<int>(layers);
  if (auto s = read("hidden_size", &arch.hidden_size); !s.ok()) return s;
  if (auto s = read("vocab_size", &arch.vocab_size); !s.ok()) return s;
  if (auto s = read("num_attention_heads", &arch.num_attention_heads); !s.ok()) return s;
  arch.num_key_value_heads = OptionalInt(config, "num_key_value_heads", arch.num_attention_heads);
  arch.head_dim = OptionalInt(config, "head_dim", arch.hidden_size / arch.num_attention_heads);
  if (entry->family == Family::kDeepseekV3) {
    // Multi-head latent attention (architectures.md §2.1): every width is
    // read, none defaulted; num_key_value_heads and head_dim are unused by
    // MLA and replaced by the latent "head" (see ModelArch::mla()).
    if (auto s = read("kv_lora_rank", &arch.kv_lora_rank); !s.ok()) return s;
    if (auto s = read("qk_nope_head_dim", &arch.qk_nope_head_dim); !s.ok()) return s;
    if (auto s = read("qk_rope_head_dim", &arch.qk_rope_head_dim); !s.ok()) return s;
    if (auto s = read("v_head_dim", &arch.v_head_dim); !s.ok()) return s;
    auto q_lora = config.find("q_lora_rank");
    if (q_lora == config.end() ||
        (!q_lora->is_null() && (!q_lora->is_number_integer() || q_lora->get<int64_t>() <= 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `q_lora_rank` must be an integer > 0 or null (a plain q_proj), ",
          q_lora == config.end() ? std::string("it is missing") : "got " + q_lora->dump()));
    }
    arch.q_lora_rank = q_lora->is_null() ? 0 : q_lora->get<int64_t>();
    for (const auto& [key, value] :
         {std::pair<const char*, int64_t>{"q_lora_rank", arch.q_lora_rank},
          {"kv_lora_rank", arch.kv_lora_rank},
          {"qk_nope_head_dim", arch.qk_nope_head_dim},
          {"qk_rope_head_dim", arch.qk_rope_head_dim},
          {"v_head_dim", arch.v_head_dim}}) {
      if (value > kMaxConfigWidth) return OverLimit(key, value, "kMaxConfigWidth", kMaxConfigWidth);
    }
    if (arch.qk_rope_head_dim % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `qk_rope_head_dim` must be even (rotated in pairs), got ",
          arch.qk_rope_head_dim));
    }
    if (auto it = config.find("moe_layer_freq"); it != config.end() && !it->is_null() &&
                                                 !(it->is_number_integer() && it->get<int64_t>() == 1)) {
      return absl::UnimplementedError(absl::StrCat(
          "config.json: `moe_layer_freq` ", it->dump(),
          " is not supported (1: every layer from first_k_dense_replace on is MoE)"));
    }
    arch.num_key_value_heads = 1;
    arch.head_dim = arch.qk_nope_head_dim + arch.qk_rope_head_dim;
  }
  if (arch.num_key_value_heads <= 0 || arch.num_attention_heads % arch.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `num_attention_heads` (", arch.num_attention_heads,
        ") must be a multiple of `num_key_value_heads` (", arch.num_key_value_heads, ")"));
  }
  if (arch.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: `head_dim` must be > 0, got ", arch.head_dim));
  }
  arch.tie_word_embeddings =
      OptionalBool(config, "tie_word_embeddings", OptionalBool(root, "tie_word_embeddings", false));

  // Hybrid models: which layers are linear attention, and its geometry
  // (arch-gated-deltanet.md §1.1).
  std::vector<bool> linear_layer;
  if (hybrid) {
    for (const auto& [key, out] : {std::pair<const char*, int64_t*>{"linear_num_key_heads", &arch.gdn_key_heads},
                                   {"linear_num_value_heads", &arch.gdn_value_heads},
                                   {"linear_key_head_dim", &arch.gdn_key_dim},
                                   {"linear_value_head_dim", &arch.gdn_value_dim},
                                   {"linear_conv_kernel_dim", &arch.gdn_conv_kernel}}) {
      if (auto s = read(key, out); !s.ok()) return s;
      if (*out > kMaxConfigWidth) return OverLimit(key, *out, "kMaxConfigWidth", kMaxConfigWidth);
    }
    // kernels::kGatedDeltaChunkMaxDim (the recurrence's scratch is on the stack).
    for (const auto& [key, dim] : {std::pair<const char*, int64_t>{"linear_key_head_dim", arch.gdn_key_dim},
                                   {"linear_value_head_dim", arch.gdn_value_dim}}) {
      if (dim > 512) {
        return absl::InvalidArgumentError(
            absl::StrCat("config.json: `", key, "` = ", dim, " is over 512"));
      }
    }
    if (arch.gdn_value_heads % arch.gdn_key_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `linear_num_value_heads` (", arch.gdn_value_heads,
          ") must be a multiple of `linear_num_key_heads` (", arch.gdn_key_heads, ")"));
    }
    if (arch.gdn_key_heads > kMaxConfigHeads || arch.gdn_value_heads > kMaxConfigHeads) {
      return OverLimit("linear_num_value_heads", arch.gdn_value_heads, "kMaxConfigHeads",
                       kMaxConfigHeads);
    }
    arch.gdn_fused_projections = entry->family == Family::kQwen3Next;
    arch.attention_output_gate = OptionalBool(config, "attn_output_gate", true);
    linear_layer.assign(arch.num_layers, false);
    auto types = config.find("layer_types");
    if (types != config.end()) {
      if (!types->is_array() || static_cast<int64_t>(types->size()) != layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config.json: `layer_types` must be a list of ", layers, " entries (num_hidden_layers), got ",
            types->dump().substr(0, 200)));
      }
      for (int l = 0; l < arch.num_layers; ++l) {
        const nlohmann::json& t = (*types)[l];
        if (t == "linear_attention") {
          linear_layer[l] = true;
        } else if (t != "full_attention") {
          return absl::InvalidArgumentError(absl::StrCat(
              "config.json: `layer_types[", l, "]` is ", t.dump().substr(0, 80),
              "; known: \"linear_attention\", \"full_attention\""));
        }
      }
    } else {
      const int64_t interval = OptionalInt(config, "full_attention_interval", 4);
      if (interval <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config.json: `full_attention_interval` must be > 0, got ", interval));
      }
      for (int l = 0; l < arch.num_layers; ++l) linear_layer[l] = (l + 1) % interval != 0;
    }
  }

  std::set<int64_t> mlp_only_layers;
  int64_t sparse_step = 1;
  int64_t first_k_dense = 0;  // GLM-4 MoE: layers [0, first_k_dense) are dense
  if (entry->family == Family::kMixtral) {
    if (auto s = read("intermediate_size", &arch.moe_intermediate_size); !s.ok()) return s;
    int64_t experts = 0, top_k = 0;
    if (auto s = read("num_local_experts", &experts); !s.ok()) return s;
    if (auto s = read("num_experts_per_tok", &top_k); !s.ok()) return s;
    if (experts > kMaxConfigExperts) return OverLimit("num_experts", experts, "kMaxConfigExperts", kMaxConfigExperts);
    if (top_k > experts) top_k = experts + 1;  // refused below, without truncation
    arch.num_experts = static_cast<int>(experts);
    arch.num_experts_per_token = static_cast<int>(top_k);
  } else if (hybrid) {
    // Qwen3-Next / Qwen3.5: MoE when num_experts > 0 (§1.1), a gated shared
    // expert; dense layers (mlp_only_layers, Qwen3.5 dense) use intermediate_size.
    arch.intermediate_size = OptionalInt(config, "intermediate_size", 0);
    const int64_t experts = OptionalInt(config, "num_experts", 0);
    if (experts < 0 || experts > kMaxConfigExperts) {
      return OverLimit("num_experts", experts, "kMaxConfigExperts", kMaxConfigExperts);
    }
    if (experts > 0) {
      int64_t top_k = 0;
      if (auto s = read("moe_intermediate_size", &arch.moe_intermediate_size); !s.ok()) return s;
      if (auto s = read("num_experts_per_tok", &top_k); !s.ok()) return s;
      if (top_k > experts) top_k = experts + 1;  // refused below, without truncation
      arch.num_experts = static_cast<int>(experts);
      arch.num_experts_per_token = static_cast<int>(top_k);
      arch.shared_expert_intermediate_size = OptionalInt(config, "shared_expert_intermediate_size", 0);
      if (arch.shared_expert_intermediate_size < 0) {
        return absl::InvalidArgumentError("config.json: `shared_expert_intermediate_size` must be >= 0");
      }
      arch.shared_expert_gated = arch.shared_expert_intermediate_size > 0;
    }
    sparse_step = OptionalInt(config, "decoder_sparse_step", 1);
    if (sparse_step <= 0) sparse_step = 1;
    if (auto it = config.find("mlp_only_layers"); it != config.end() && it->is_array()) {
      for (const auto& v : *it) {
        if (v.is_number_integer()) mlp_only_layers.insert(v.get<int64_t>());
      }
    }
    // MTP layers (`mtp.*`): counted, not built yet.
    arch.num_mtp_layers = static_cast<int>(std::clamp<int64_t>(
        OptionalInt(config, "mtp_num_hidden_layers", OptionalInt(config, "num_nextn_predict_layers", 0)),
        0, kMaxConfigLayers));
  } else if (entry->family == Family::kQwen3Moe) {
    if (auto s = read("moe_intermediate_size", &arch.moe_intermediate_size); !s.ok()) return s;
    arch.intermediate_size = OptionalInt(config, "intermediate_size", 0);
    int64_t experts = 0, top_k = 0;
    if (auto s = read("num_experts", &experts); !s.ok()) return s;
    if (auto s = read("num_experts_per_tok", &top_k); !s.ok()) return s;
    if (experts > kMaxConfigExperts) return OverLimit("num_experts", experts, "kMaxConfigExperts", kMaxConfigExperts);
    if (top_k > experts) top_k = experts + 1;  // refused below, without truncation
    arch.num_experts = static_cast<int>(experts);
    arch.num_experts_per_token = static_cast<int>(top_k);
    sparse_step = OptionalInt(config, "decoder_sparse_step", 1);
    if (sparse_step <= 0) sparse_step = 1;
    if (auto it = config.find("mlp_only_layers"); it != config.end() && it->is_array()) {
      for (const auto& v : *it) {
        if (v.is_number_integer()) mlp_only_layers.insert(v.get<int64_t>());
      }
    }
  } else if (entry->family == Family::kGlm4Moe || entry->family == Family::kDeepseekV3) {
    // architectures.md §1.1, §2.1: every routing key is read, none defaulted
    // (the defaults of exllamav3 and transformers differ from published
    // configs and between GLM and DeepSeek).
    if (auto s = read("intermediate_size", &arch.intermediate_size); !s.ok()) return s;
    if (auto s = read("moe_intermediate_size", &arch.moe_intermediate_size); !s.ok()) return s;
    int64_t experts = 0, top_k = 0;
    if (auto s = read("n_routed_experts", &experts); !s.ok()) return s;
    if (auto s = read("num_experts_per_tok", &top_k); !s.ok()) return s;
    if (experts > kMaxConfigExperts) return OverLimit("n_routed_experts", experts, "kMaxConfigExperts", kMaxConfigExperts);
    if (top_k > experts) top_k = experts + 1;  // refused below, without truncation
    arch.num_experts = static_cast<int>(experts);
    arch.num_experts_per_token = static_cast<int>(top_k);
    const int64_t dense = OptionalInt(config, "first_k_dense_replace", -1);
    if (dense < 0 || !config.contains("first_k_dense_replace")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `first_k_dense_replace` must be an integer >= 0, ",
          config.contains("first_k_dense_replace") ? "got " + config["first_k_dense_replace"].dump()
                                                   : std::string("it is missing")));
    }
    first_k_dense = std::min(dense, layers);
    const int64_t shared = OptionalInt(config, "n_shared_experts", -1);
    if (shared < 0 || shared > kMaxConfigExperts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `n_shared_experts` must be an integer in [0, ", kMaxConfigExperts, "], ",
          config.contains("n_shared_experts") ? "got " + config["n_shared_experts"].dump()
                                              : std::string("it is missing")));
    }
    arch.shared_expert_intermediate_size = shared * arch.moe_intermediate_size;
    const int64_t mtp = OptionalInt(config, "num_nextn_predict_layers", 0);
    if (mtp < 0 || mtp > kMaxConfigLayers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.json: `num_nextn_predict_layers` must be in [0, ", kMaxConfigLayers, "], got ",
          mtp));
    }
    arch.num_mtp_layers = static_cast<int>(mtp);
  } else {
    if (auto s = read("intermediate_size", &arch.intermediate_size); !s.ok()) return s;
  }
  // Every size bounded before any product of them is formed.
  struct Bound {
    const char* key;
    int64_t value;
    const char* limit;
    int64_t max;
  };
  for (const Bound& b : {Bound{"hidden_size", arch.hidden_size, "kMaxConfigWidth", kMaxConfigWidth},
                         Bound{"vocab_size", arch.vocab_size, "kMaxConfigVocab", kMaxConfigVocab},
                         Bound{"num_attention_heads", arch.num_attention_heads, "kMaxConfigHeads", kMaxConfigHeads},
                         Bound{"num_key_value_heads", arch.num_key_value_heads, "kMaxConfigHeads", kMaxConfigHeads},
                         Bound{"head_dim", arch.head_dim, "kMaxConfigWidth", kMaxConfigWidth},
                         Bound{"intermediate_size", arch.intermediate_size, "kMaxConfigWidth", kMaxConfigWidth},
                         Bound{"moe_intermediate_size", arch.moe_intermediate_size, "kMaxConfigWidth", kMaxConfigWidth},
                         Bound{"n_shared_experts x moe_intermediate_size", arch.shared_expert_intermediate_size, "kMaxConfigWidth", kMaxConfigWidth},
                         Bound{"num_experts", arch.num_experts, "kMaxConfigExperts", kMaxConfigExperts}}) {
    if (b.value > b.max) return OverLimit(b.key, b.value, b.limit, b.max);
  }
  if (arch.intermediate_size < 0 || arch.moe_intermediate_size < 0) {
    return absl::InvalidArgumentError("config.json: `intermediate_size` must be >= 0");
  }
  if (arch.num_experts > 0 &&
      (arch.num_experts_per_token <= 0 || arch.num_experts_per_token > arch.num_experts)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: `num_experts_per_tok` must be in [1, ", arch.num_experts, "], got ",
        arch.num_experts_per_token));
  }

  const int64_t hidden = arch.hidden_size;
  auto add = [&](std::string key, int layer, int expert, LinearRole role, int64_t in, int64_t out,
                 std::string qgroup, int priority, std::string module_group) {
    LinearSpec spec;
    spec.key = std::move(key);
    spec.layer = layer;
    spec.expert = expert;
    spec.role = role;
    spec.in_features = in;
    spec.out_features = out;
    spec.qgroup = std::move(qgroup);
    spec.priority = priority;
    spec.module_group = std::move(module_group);
    arch.linears.push_back(std::move(spec));
  };

  // The recipe: which modules each layer is made of.
  arch.layers.resize(arch.num_layers);
  arch.layer_is_moe.assign(arch.num_layers, false);
  for (int l = 0; l < arch.num_layers; ++l) {
    LayerRecipe& recipe = arch.layers[l];
    recipe.mixer = arch.mla()                           ? TokenMixerKind::kLatentAttention
                   : hybrid && linear_layer[l]            ? TokenMixerKind::kGatedDeltaNet
                                                          : TokenMixerKind::kAttention;
    bool moe = false;
    switch (entry->family) {
      case Family::kDense: moe = false; break;
      case Family::kMixtral: moe = true; break;
      case Family::kQwen3Moe: moe = mlp_only_layers.count(l) == 0 && (l + 1) % sparse_step == 0; break;
      case Family::kGlm4Moe:
      case Family::kDeepseekV3: moe = l >= first_k_dense; break;
      case Family::kQwen3Next:
      case Family::kQwen35:
        moe = arch.num_experts > 0 && mlp_only_layers.count(l) == 0 && (l + 1) % sparse_step == 0;
        break;
    }
    recipe.feed_forward = moe ? FeedForwardKind::kMixtureOfExperts : FeedForwardKind::kDenseMlp;
    arch.layer_is_moe[l] = moe;
  }
  // Tensor names of the MoE block (Mixtral's differ from the others').
  const bool mixtral = entry->family == Family::kMixtral;
  const MoeTensorNames moe_names =
      mixtral ? MoeTensorNames{".block_sparse_moe", ".w1", ".w3", ".w2", ".shared_experts"}
              : MoeTensorNames{".mlp", ".gate_proj", ".up_proj", ".down_proj",
                               arch.shared_expert_gated ? ".shared_expert" : ".shared_experts"};

  // The linears, module by module.
  for (int l = 0; l < arch.num_layers; ++l) {
    const std::string layer = arch.LayerPrefix(l);
    switch (arch.layers[l].mixer) {
      case TokenMixerKind::kAttention: AddAttentionLinears(arch, l, layer, add); break;
      case TokenMixerKind::kLatentAttention: AddLatentAttentionLinears(arch, l, layer, add); break;
      case TokenMixerKind::kGatedDeltaNet: AddGatedDeltaNetLinears(arch, l, layer, add); break;
    }
    switch (arch.layers[l].feed_forward) {
      case FeedForwardKind::kDenseMlp:
        if (arch.intermediate_size <= 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config.json: layer ", l, " is a dense MLP layer but `intermediate_size` is missing"));
        }
        AddSwiGluLinears(arch, l, layer, add);
        break;
      case FeedForwardKind::kMixtureOfExperts:
        AddMoeLinears(arch, l, layer, moe_names, add);
        break;
    }
  }
  add("lm_head", -1, -1, LinearRole::kHead, hidden, arch.vocab_size, "lm_head", 0, "lm_head");
  arch.linears.back().is_head = true;
  return arch;
}

}  // namespace exl3serve::sharding
