// worker/api/sampling.h — how a sequence samples, and what a draw returns:
// the types that cross between the coordinator and the ranks (part of the
// step-executor seam, worker/api/step_executor.h). The semantics are those of
// worker/model/sampler.h (float64 reference) and vocab_sampler.h (the ranks).
#ifndef EXL3SERVE_WORKER_API_SAMPLING_H_
#define EXL3SERVE_WORKER_API_SAMPLING_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace exl3serve::worker {

struct SamplingParams {
  float temperature = 1.0f;          // >= 0; 0 = greedy
  int top_k = 0;                     // >= 0; 0 = off
  float top_p = 1.0f;                // (0, 1]; 1 = off
  float min_p = 0.0f;                // [0, 1]; 0 = off
  float repetition_penalty = 1.0f;   // > 0; 1 = off
  float presence_penalty = 0.0f;     // [-2, 2]
  float frequency_penalty = 0.0f;    // [-2, 2]
  // Added to the logit of a token id after the penalties, each in [-100, 100]
  // (the OpenAI API's `logit_bias`).
  std::vector<std::pair<int32_t, float>> logit_bias{};
  std::optional<uint64_t> seed{};     // none: a random seed (std::random_device)
  bool logprobs = false;             // report the chosen token's log-probability
  int top_logprobs = 0;              // and the n most likely tokens' (0..20)
};

// InvalidArgument naming the field, its rule and the value for any field out
// of the ranges above (NaN included).
absl::Status ValidateSamplingParams(const SamplingParams& params);

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};

struct SampledToken {
  int32_t id = 0;
  float logprob = 0.0f;                   // when params.logprobs
  std::vector<TokenLogprob> top_logprobs;  // params.top_logprobs entries, descending
};

// How one sequence samples on the ranks, fixed when it is added.
struct SequenceSampling {
  SamplingParams params;  // params.seed must be set (the coordinator draws one)
  // Tokens at positions >= prompt_len are output tokens (presence and
  // frequency penalties count those); all observed tokens count for the
  // repetition penalty.
  int64_t prompt_len = 0;
  // Tokens [0, n) whose keys and values are already in the first pages the
  // coordinator assigns to the sequence (its prefix cache: full pages only,
  // so n is a multiple of the page size): the sequence starts at position n,
  // the sampler has observed them (penalties, the generator's position), and
  // the first forward feeds the tokens from n on. Empty: nothing cached.
  std::vector<int32_t> cached_prefix{};
  // A model with a recurrent state (KvCacheShape::state_floats): the state
  // snapshot after cached_prefix (step_executor.h StateSnapshotRef; slot -1
  // = none, which such a model refuses with a non-empty cached_prefix).
  int64_t cached_state_slot = -1;
  uint64_t cached_state_hash_hi = 0;
  uint64_t cached_state_hash_lo = 0;
};

// Row kinds by position (worker/model/linear.h RowKind): a sampled
// sequence's rows at positions [0, PrefillKindEnd(prompt_len)) run at the
// prefill precision, every other row at the decode precision — the kinds
// the prompt gets as one uncut forward followed by one forward per token.
// A row's kind thus depends only on its sequence and position, never on how
// the scheduler cut the tokens into forwards (a prefix-cache hit's short
// tail, a short last prefill chunk, a long verify chunk, a replay of prompt
// and output in one forward), so every exactness property holds at the
// default precisions. A prompt shorter than kPrefillKindMinTokens is decode
// kind as a whole (as an uncut forward of it would be). The coordinator
// salts the hashes of blocks holding decode-kind rows with this rule
// (coordinator/scheduler.cc), so a prompt never reuses decoded KV.
inline constexpr int64_t kPrefillKindMinTokens = 17;
inline int64_t PrefillKindEnd(int64_t prompt_len) {
  return prompt_len >= kPrefillKindMinTokens ? prompt_len : 0;
}

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_API_SAMPLING_H_
