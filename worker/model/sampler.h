// worker/model/sampler.h — turns one row of logits into the next token of a
// request: penalties, temperature, top-k / top-p / min-p filtering, a seeded
// draw, and the chosen token's log-probability on request.
//
//   EXL3_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(params, prompt_ids));
//   SampledToken t = sampler.Sample(logits_row);   // also records t.id as output
//
// Order of operations (that of Hugging Face's logits processors; penalties as
// in HF (repetition) and the OpenAI API (presence, frequency)):
//   1. repetition: for every distinct token of prompt + output so far,
//      z > 0 ? z / repetition_penalty : z · repetition_penalty;
//   2. z -= frequency_penalty · count + presence_penalty · [count > 0], count
//      over the output tokens only; then z += logit_bias[id];
//   3. temperature 0: greedy (argmax, lowest id on ties) — nothing below applies;
//      otherwise z / temperature, p = softmax(z);
//   4. top-k: keep the k most probable (lowest id first on ties);
//   5. top-p: in descending probability, keep a token while the mass before it
//      (over the tokens still kept) is < top_p;
//   6. min-p: keep tokens with p >= min_p · max p;
//   7. draw from the kept tokens with p renormalised: the kept tokens in
//      ascending id order partition [0, 1) and the one holding
//      u = CounterUniform(seed, position) is drawn (counter_rng.h; position =
//      prompt length + tokens sampled so far), so the draw of a position
//      depends on nothing else. vocab_sampler.h computes the same on the ranks.
// Log-probabilities are those of the raw logits (log-softmax before any
// step above), as the OpenAI API reports them.
#ifndef EXL3SERVE_WORKER_MODEL_SAMPLER_H_
#define EXL3SERVE_WORKER_MODEL_SAMPLER_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "worker/api/sampling.h"

namespace exl3serve::worker {




// Thread safety: thread-compatible (one per request).
// Ownership: owns its token counts and RNG.
class Sampler {
 public:
  // Errors: those of ValidateSamplingParams. `prompt` feeds the repetition penalty.
  static absl::StatusOr<Sampler> Create(const SamplingParams& params,
                                        std::span<const int32_t> prompt);

  // Draws the next token from `logits` (one row, vocab entries) and records
  // it as an output token. Requires: logits non-empty.
  SampledToken Sample(std::span<const float> logits);

  // The distribution step 7 draws from (steps 1-6; one-hot for greedy), as
  // probabilities over the whole vocabulary. Does not change state.
  std::vector<double> Distribution(std::span<const float> logits) const;

  // Records `id` as an output token without sampling (forced tokens).
  void Accept(int32_t id);

  // The seed draws use (params.seed, or the one drawn at Create).
  uint64_t seed() const { return seed_; }

 private:
  Sampler() = default;
  // Steps 1-2 applied to a copy of logits.
  std::vector<double> PenalizedLogits(std::span<const float> logits) const;

  SamplingParams params_;
  absl::flat_hash_map<int32_t, int> seen_;          // prompt + output tokens (presence only)
  absl::flat_hash_map<int32_t, int> output_counts_;  // output tokens
  uint64_t seed_ = 0;
  int64_t position_ = 0;  // prompt length + tokens accepted so far
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_SAMPLER_H_
