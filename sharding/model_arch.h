// sharding/model_arch.h — what a decoder-only architecture looks like as a
// list of linear layers, derived from a Hugging Face config.json.
//
// The converter uses it to know which tensors are linears to quantize (and in
// which allocation group), the loader to query a model by (layer, role), and
// the shard planner (later) to split them. Supported architectures: the ones
// the runtime serves — LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM,
// Glm4MoeForCausalLM (GLM-4.5/4.6/4.7, GLM-4.5-Air: architectures.md §1) and
// DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2: multi-head latent
// attention, architectures.md §2).
//
//   EXL3_ASSIGN_OR_RETURN(ModelArch arch, ModelArchFromConfig(config_json));
//   for (const LinearSpec& l : arch.linears) { ... l.key, l.in_features ... }
//
// Dimensions here are the model's own (unpadded); EXL3 storage pads them to
// multiples of 128 (exl3-format.md §2.4).
#ifndef EXL3SERVE_SHARDING_MODEL_ARCH_H_
#define EXL3SERVE_SHARDING_MODEL_ARCH_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace exl3serve::sharding {

// kQA, kQB, kKVA, kKVB: the MLA projections of DeepseekV3ForCausalLM
// (`self_attn.q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`); its
// plain `self_attn.q_proj` (q_lora_rank null) is kQ, `o_proj` kO.
// kGdn*: the Gated DeltaNet projections (arch-gated-deltanet.md §2.1):
// Qwen3-Next's fused `linear_attn.in_proj_qkvz` / `in_proj_ba` (grouped per
// key head), Qwen3.5's split `in_proj_qkv` / `in_proj_z` / `in_proj_b` /
// `in_proj_a` (flat), and `out_proj`. kSharedExpertGate: the [1, hidden]
// sigmoid gate of a Qwen3-Next / Qwen3.5 shared expert.
enum class LinearRole {
  kQ, kK, kV, kO, kGate, kUp, kDown, kRouter, kHead, kQA, kQB, kKVA, kKVB,
  kGdnQkvz, kGdnBa, kGdnQkv, kGdnZ, kGdnB, kGdnA, kGdnOut, kSharedExpertGate
};

const char* LinearRoleName(LinearRole role);

// LinearSpec::expert of a shared expert's projections (GLM-4 MoE
// `mlp.shared_experts.{gate,up,down}_proj`, roles kGate/kUp/kDown): one
// SwiGLU MLP of width ModelArch::shared_expert_intermediate_size that every
// token of an MoE layer runs besides its routed experts. -1 stays "not an
// expert" (attention, dense MLP, router, head).
inline constexpr int kSharedExpert = -2;

struct LinearSpec {
  std::string key;           // module key = weight name without ".weight"
  int layer = -1;            // decoder layer; -1 for the head
  int expert = -1;           // routed expert index, kSharedExpert, else -1
  LinearRole role = LinearRole::kQ;
  int64_t in_features = 0;   // unpadded
  int64_t out_features = 0;  // unpadded
  // False for linears exllamav3 never quantizes (MoE router): stored as an
  // fp16 `weight` in HF orientation, unpadded (§2.5).
  bool quantized = true;
  bool is_head = false;       // uses head_bits, outside the bits budget (§6.7)
  std::string qgroup;         // bit-allocation group (§6.7)
  int priority = 0;           // higher is raised first (§6.7)
  std::string module_group;   // unit of conversion/resume/sharding: "model.layers.3.self_attn"
};

// The module kinds a decoder layer is built from (a layer = a token mixer
// followed by a feed-forward; worker/model/modules/). The converter, the
// planner and the runtime all read an architecture as this per-layer recipe;
// nothing downstream branches on the architecture's name.
enum class TokenMixerKind {
  kAttention,        // grouped-query attention: q/k/v/o (kQ, kK, kV, kO)
  kLatentAttention,  // multi-head latent attention: q_a/q_b or q, kv_a, kv_b, o
  kGatedDeltaNet,    // linear attention with a recurrent state (kGdn*)
};
enum class FeedForwardKind {
  kDenseMlp,          // SwiGLU: gate/up/down
  kMixtureOfExperts,  // router + routed SwiGLU experts (+ a shared expert when
                      // shared_expert_intermediate_size > 0)
};
const char* TokenMixerKindName(TokenMixerKind kind);
const char* FeedForwardKindName(FeedForwardKind kind);

struct LayerRecipe {
  TokenMixerKind mixer = TokenMixerKind::kAttention;
  FeedForwardKind feed_forward = FeedForwardKind::kDenseMlp;
};

struct ModelArch {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  int num_layers = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width
  int64_t moe_intermediate_size = 0;  // per-expert width (MoE)
  int64_t vocab_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int num_experts = 0;           // 0 for dense models
  int num_experts_per_token = 0;
  // GLM-4 MoE: width of the shared expert MLP of every MoE layer
  // (n_shared_experts x moe_intermediate_size); 0 = no shared expert.
  int64_t shared_expert_intermediate_size = 0;
  // Next-token-prediction (MTP) layers stored after the last decoder layer
  // (`num_nextn_predict_layers`, GLM-4 MoE): counted, never built or converted.
  int num_mtp_layers = 0;
  bool tie_word_embeddings = false;
  // Multi-head latent attention (DeepseekV3ForCausalLM, architectures.md §2):
  // kv_lora_rank > 0. Then head_dim = qk_nope_head_dim + qk_rope_head_dim
  // (a query head's width), num_key_value_heads = 1 (the latent "head" every
  // query head reads: c_kv of kv_lora_rank plus the rope key of
  // qk_rope_head_dim per token), o_proj's input is heads x v_head_dim, and
  // q_lora_rank 0 means a plain q_proj (config null).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool mla() const { return kv_lora_rank > 0; }
  // Gated DeltaNet layers (Qwen3NextForCausalLM, Qwen3_5*; arch-gated-deltanet.md):
  // Hk key heads of gdn_key_dim, Hv = G·Hk value heads of gdn_value_dim, a
  // causal conv of gdn_conv_kernel taps over the [Q | K | V] channels.
  int64_t gdn_key_heads = 0;
  int64_t gdn_value_heads = 0;
  int64_t gdn_key_dim = 0;
  int64_t gdn_value_dim = 0;
  int64_t gdn_conv_kernel = 0;
  bool gdn_fused_projections = false;  // Qwen3-Next: in_proj_qkvz / in_proj_ba
  int64_t gdn_conv_dim() const { return 2 * gdn_key_heads * gdn_key_dim + gdn_value_heads * gdn_value_dim; }
  // Gated attention (Qwen3-Next, Qwen3.5): q_proj also yields a per-head
  // sigmoid gate on the attention output, interleaved per head [q | gate].
  bool attention_output_gate = false;
  // Shared experts with a sigmoid gate (`mlp.shared_expert_gate`) under
  // `mlp.shared_expert.` (Qwen3-Next / Qwen3.5-MoE) rather than
  // `mlp.shared_experts.` (GLM, DeepSeek).
  bool shared_expert_gated = false;
  // Where the text model's tensors live: "model" (model.embed_tokens,
  // model.layers.N, model.norm) or "model.language_model" (Qwen3.5).
  std::string tensor_prefix = "model";
  std::string LayerPrefix(int layer) const {
    return tensor_prefix + ".layers." + std::to_string(layer);
  }
  std::string EmbedName() const { return tensor_prefix + ".embed_tokens.weight"; }
  std::string FinalNormName() const { return tensor_prefix + ".norm.weight"; }
  std::vector<LayerRecipe> layers;      // per layer: which modules it is made of
  // Some layer keeps a recurrent per-sequence state (Gated DeltaNet): such a
  // sequence cannot yet resume from a cached prefix or roll back drafts.
  bool has_recurrent_state() const {
    for (const LayerRecipe& l : layers) {
      if (l.mixer == TokenMixerKind::kGatedDeltaNet) return true;
    }
    return false;
  }
  // Bytes of that state per sequence over all ranks: per Gated DeltaNet layer
  // the last K−1 conv inputs and, per value head, a [dk][dv] matrix and the
  // open chunk's 15 rows of dk + dv + 1 (kernels::GatedDeltaHeadStateFloats,
  // chunks of 16), fp32.
  int64_t recurrent_state_bytes_per_sequence() const {
    int64_t bytes = 0;
    for (const LayerRecipe& l : layers) {
      if (l.mixer != TokenMixerKind::kGatedDeltaNet) continue;
      const int64_t head = gdn_key_dim * gdn_value_dim + 15 * (gdn_key_dim + gdn_value_dim + 1);
      bytes += 4 * ((gdn_conv_kernel - 1) * gdn_conv_dim() + gdn_value_heads * head);
    }
    return bytes;
  }
  std::vector<bool> layer_is_moe;       // per layer: layers[l].feed_forward is MoE
  std::vector<LinearSpec> linears;      // layer order, head last

  // nullptr when absent.
  const LinearSpec* Find(int layer, LinearRole role, int expert = -1) const;
  const LinearSpec* FindByKey(std::string_view key) const;
};

// Builds the description from a parsed config.json. Errors:
//   Unimplemented   — `architectures` names none of the supported ones;
//   InvalidArgument — a required key is missing or has a bad value (named).
absl::StatusOr<ModelArch> ModelArchFromConfig(const nlohmann::json& config);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_MODEL_ARCH_H_
