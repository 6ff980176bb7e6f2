// worker/model/generator.h — one request end to end on one rank: prefill the
// prompt in chunks, then decode one token per forward, sampling each with the
// request's Sampler, until max_new_tokens, a stop token, or the caller says
// stop.
//
//   GenerationOptions options;  options.max_new_tokens = 20;
//   options.sampling.temperature = 0;
//   EXL3_ASSIGN_OR_RETURN(FinishReason why,
//       Generate(model, &cache, /*seq_id=*/0, prompt, options,
//                [&](const GeneratedStep& step) { Print(step.token.id); return true; }));
//
// The scheduler (coordinator) will batch many requests per forward; this loop
// is the single-request path used by `exl3serve generate` and the tests.
#ifndef EXL3SERVE_WORKER_MODEL_GENERATOR_H_
#define EXL3SERVE_WORKER_MODEL_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/kv_cache.h"
#include "worker/model/sampler.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {

struct GenerationOptions {
  SamplingParams sampling;
  int64_t max_new_tokens = 256;          // >= 0
  std::vector<int32_t> stop_token_ids;   // e.g. the model's EOS ids
  // Prompt tokens per prefill forward: bounds the activation memory of a long
  // prompt (about 4·(hidden + heads·head_dim + vocab) bytes per token).
  int64_t prefill_chunk_tokens = 512;
};

enum class FinishReason {
  kLength,     // max_new_tokens generated
  kStopToken,  // a stop token was sampled (not reported to the callback)
  kCaller,     // the callback returned false
};

struct GeneratedStep {
  SampledToken token;
  std::span<const float> logits;  // the row the token was sampled from
};

// Called once per generated token; return false to stop after it.
using StepCallback = std::function<bool(const GeneratedStep& step)>;

// Runs `prompt` (non-empty) as new sequence `seq_id` of `cache` and generates.
// The sequence is removed from the cache when Generate returns.
// Errors: InvalidArgument for an empty prompt, bad sampling params, a
// negative max_new_tokens or prefill chunk <= 0; AlreadyExists when seq_id is
// in the cache; those of Transformer::Forward (ResourceExhausted when the
// cache is too small for prompt + max_new_tokens).
absl::StatusOr<FinishReason> Generate(StepExecutor& executor, int64_t seq_id,
                                      std::span<const int32_t> prompt,
                                      const GenerationOptions& options,
                                      const StepCallback& on_step);

// The same on a model of this process and a cache.
absl::StatusOr<FinishReason> Generate(const Transformer& model, PagedKvCache* cache,
                                      int64_t seq_id, std::span<const int32_t> prompt,
                                      const GenerationOptions& options,
                                      const StepCallback& on_step);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_GENERATOR_H_
