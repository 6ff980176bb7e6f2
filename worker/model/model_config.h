// worker/model/model_config.h — everything the forward pass needs to know
// about a decoder-only model beyond its list of linears: norm epsilon, RoPE
// (theta, scaling), sliding window, per-head q/k norms, MoE routing rule and
// the special token ids, read from config.json (+ generation_config.json).
//
//   EXL3_ASSIGN_OR_RETURN(ModelConfig config, ModelConfigFromJson(config_json));
//   std::vector<double> inv_freq = RopeInverseFrequencies(config);
//
// Model equations are those of the Hugging Face implementations of
// LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
// MixtralForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM (the
// transformers `modeling_glm4_moe.py` equations; architectures.md §1) and
// DeepseekV3ForCausalLM (`modeling_deepseek_v3.py`, MLA with YaRN;
// architectures.md §2; also Kimi K2).
#ifndef EXL3SERVE_WORKER_MODEL_MODEL_CONFIG_H_
#define EXL3SERVE_WORKER_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "sharding/model_arch.h"

namespace exl3serve::worker {

enum class RopeScalingType {
  kNone,    // rope_scaling absent, null or "default"
  kLinear,  // positions divided by `factor` (inverse frequencies / factor)
  kLlama3,  // Llama 3.1: per-frequency interpolation between 1 and 1/factor
  // YaRN (DeepseekV3ForCausalLM only): a linear ramp between the original
  // frequency and frequency/factor over the dims between the correction
  // dims of beta_fast and beta_slow (RopeInverseFrequencies), cos/sin scaled
  // by ModelConfig::rope_attention_factor.
  kYarn,
};

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;                  // llama3 only
  double high_freq_factor = 4.0;                 // llama3 only
  int64_t original_max_position_embeddings = 0;  // llama3, yarn
  double beta_fast = 32.0;                       // yarn only
  double beta_slow = 1.0;                        // yarn only
  double mscale = 0.0;                           // yarn only; 0 = absent
  double mscale_all_dim = 0.0;                   // yarn only; 0 = absent
};

// How the top-k router weights of an MoE layer are turned into mixing weights
// (softmax over all experts first, in both cases).
enum class MoeTopKWeights {
  kRenormalized,  // divided by their sum (Mixtral; Qwen3-MoE with norm_topk_prob)
  kRaw,           // the softmax probabilities as they are (Qwen3-MoE otherwise)
};

// How an MoE layer picks its experts.
enum class MoeRouter {
  // Mixtral, Qwen3-MoE: p = softmax(router logits) over all experts, the top
  // k of p (lower index first on ties), weights per MoeTopKWeights.
  kSoftmax,
  // GLM-4 MoE (topk_method noaux_tc, scoring_func sigmoid): s = sigmoid(router
  // logits), c = s + e_score_correction_bias; with n_group > 1 each group
  // scores the sum of its two largest c, the best topk_group groups stay and
  // the others' c become 0.0; the top k of c are chosen (lower index first on
  // ties). Weights w_e = s_e (unbiased) / (Σ_chosen s + 1e-20) when
  // renormalized (else s_e), times routed_scaling_factor.
  kSigmoidGrouped,
};

struct ModelConfig {
  sharding::ModelArch arch;  // dimensions, layer kinds, the linears
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // Keys at positions j with i - j < sliding_window are visible to the query
  // at i; 0 = unlimited. Honoured for Llama/Mistral/Mixtral.
  int64_t sliding_window = 0;
  bool qk_norm = false;  // Qwen3 / Qwen3-MoE: RMSNorm per head on q and k before RoPE
  // Zero-centred RMSNorms (Qwen3-Next, Qwen3.5: x·rsqrt(mean(x²)+eps)·(1 + w)
  // for the input, post-attention, q/k and final norms; the Gated DeltaNet
  // output norm keeps its plain w). The loader adds the 1 in fp32 once.
  bool norm_weight_plus_one = false;
  MoeTopKWeights moe_topk_weights = MoeTopKWeights::kRenormalized;
  // RoPE rotates the first rotary_dim dims of every q/k head (pairs i and
  // i + rotary_dim/2, rotate-half/NEOX); the rest pass through. head_dim
  // unless GLM-4 MoE's partial_rotary_factor says less (0.5: half).
  int64_t rotary_dim = 0;
  MoeRouter moe_router = MoeRouter::kSoftmax;
  int moe_n_group = 1;              // kSigmoidGrouped: expert groups (n_group)
  int moe_topk_group = 1;           // kSigmoidGrouped: groups kept (topk_group)
  double routed_scaling_factor = 1.0;  // multiplies the routed experts' weights
  // MLA (arch.mla(), DeepseekV3ForCausalLM): RoPE acts on the last
  // qk_rope_head_dim dims of every query head and on the shared rope key, in
  // GPT-J style (pairs 2i, 2i + 1: transformers' rope_interleave, the only
  // layout supported), with cos and sin multiplied by rope_attention_factor
  // (YaRN: mscale(f', mscale) / mscale(f', mscale_all_dim), f' the frequency
  // factor; 1 without YaRN). The attention softmax scale is
  // (qk_nope + qk_rope)^-0.5, times mscale(rope_scaling.factor,
  // mscale_all_dim)^2 under YaRN when mscale_all_dim is given
  // (architectures.md §2.2 step 6); mscale(f, m) = 0.1·m·ln f + 1 for f > 1.
  double rope_attention_factor = 1.0;
  double attention_softmax_scale = 0.0;  // 0: 1/sqrt(head_dim)
  int32_t bos_token_id = -1;            // -1: none
  std::vector<int32_t> eos_token_ids;   // config.json and generation_config.json, merged
};

// Reads `config` (a parsed config.json). `generation_config` may be null or a
// parsed generation_config.json; its eos_token_id (int or list) is added.
// Errors: those of sharding::ModelArchFromConfig; InvalidArgument naming the
// key for a bad rms_norm_eps, rope_theta, rope_scaling or sliding_window;
// Unimplemented for a rope_scaling type other than default/linear/llama3, a
// hidden_act other than silu, or Qwen's use_sliding_window = true.
// Glm4MoeForCausalLM: InvalidArgument naming the key for a missing or bad
// routed_scaling_factor, partial_rotary_factor (rotary dims must be even and
// > 0), n_group (must divide n_routed_experts into groups of >= 2 when > 1),
// topk_group (1..n_group, keeping at least num_experts_per_tok experts) or
// use_qk_norm / norm_topk_prob of the wrong type; Unimplemented for a
// scoring_func other than sigmoid or a topk_method other than noaux_tc.
// Qwen3NextForCausalLM, Qwen3_5ForConditionalGeneration,
// Qwen3_5MoeForConditionalGeneration (arch-gated-deltanet.md §1; Qwen3.5 keys
// under `text_config`, RoPE under `rope_parameters`): zero-centred norms,
// q/k norms, partial RoPE (`partial_rotary_factor`, default 0.25);
// Unimplemented for an `output_gate_type` other than silu/swish, a
// `rope_parameters.rope_type` other than default, or a rope_scaling.
// DeepseekV3ForCausalLM: the same routing keys (routed_scaling_factor is
// required: exllamav3 defaults it to 1.0, transformers to 2.5); rope_scaling
// may be yarn (factor > 0; beta_fast >= beta_slow > 0; mscale and
// mscale_all_dim >= 0; original_max_position_embeddings > 0, else
// max_position_embeddings); Unimplemented for rope_interleave false,
// attention_bias true or a yarn attention_factor (not in published
// configs). The yarn type is refused for the other architectures.
absl::StatusOr<ModelConfig> ModelConfigFromJson(const nlohmann::json& config,
                                                const nlohmann::json* generation_config);

// The rotary_dim/2 RoPE inverse frequencies θ^(-2i/rotary_dim), with the
// scaling applied. The angle of pair i at position p is p · inv_freq[i].
std::vector<double> RopeInverseFrequencies(const ModelConfig& config);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODEL_CONFIG_H_
