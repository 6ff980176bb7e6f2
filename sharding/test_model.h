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

#include "absl/status/status.h"

namespace exl3serve::sharding {

struct TestModelOptions {
  std::string arch = "llama";  // llama | qwen3 | qwen3-moe | mixtral
  int num_layers = 2;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 640;  // dense MLP; MoE experts use moe_intermediate_size
  int64_t moe_intermediate_size = 128;
  int num_experts = 4;
  int num_experts_per_token = 2;
  int64_t vocab_size = 1000;  // deliberately not a multiple of 128
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
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
};

// Writes config.json, generation_config.json and the weights (BF16) into `dir`
// (created if missing). Errors: InvalidArgument for an unknown arch or bad
// size; I/O errors naming the path.
absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& options);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_TEST_MODEL_H_
