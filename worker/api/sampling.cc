#include "worker/api/sampling.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace exl3serve::worker {
namespace {

// Top logprobs reported at most (the OpenAI API's limit).
constexpr int kMaxTopLogprobs = 20;

absl::Status Bad(const char* field, const char* rule, double value) {
  return absl::InvalidArgumentError(absl::StrCat("`", field, "` must be ", rule, ", got ", value));
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || std::isinf(p.temperature)) {
    return Bad("temperature", ">= 0 and finite", p.temperature);
  }
  if (p.top_k < 0) return Bad("top_k", ">= 0 (0 = off)", p.top_k);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return Bad("top_p", "in (0, 1]", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return Bad("min_p", "in [0, 1]", p.min_p);
  if (!(p.repetition_penalty > 0.0f) || std::isinf(p.repetition_penalty)) {
    return Bad("repetition_penalty", "> 0 and finite", p.repetition_penalty);
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return Bad("presence_penalty", "in [-2, 2]", p.presence_penalty);
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return Bad("frequency_penalty", "in [-2, 2]", p.frequency_penalty);
  }
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs) {
    return Bad("top_logprobs", "in [0, 20]", p.top_logprobs);
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) return Bad("logit_bias", "keyed by token ids >= 0", id);
    if (!(bias >= -100.0f && bias <= 100.0f)) return Bad("logit_bias", "values in [-100, 100]", bias);
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
