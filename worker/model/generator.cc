#include "worker/model/generator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::worker {
namespace {

absl::StatusOr<FinishReason> Run(StepExecutor& model, int64_t seq_id,
                                 std::span<const int32_t> prompt,
                                 const GenerationOptions& options, const StepCallback& on_step) {
  EXL3_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(options.sampling, prompt));
  std::vector<float> logits;
  const int64_t chunk = options.prefill_chunk_tokens;
  for (int64_t begin = 0; begin < static_cast<int64_t>(prompt.size()); begin += chunk) {
    const int64_t end = std::min<int64_t>(prompt.size(), begin + chunk);
    const SequenceTokens entry{seq_id, prompt.subspan(begin, end - begin)};
    EXL3_RETURN_IF_ERROR(model.Forward({&entry, 1}, LogitsRows::kLastToken, &logits));
  }
  for (int64_t generated = 0; generated < options.max_new_tokens; ++generated) {
    GeneratedStep step;
    step.token = sampler.Sample(logits);
    step.logits = logits;
    if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), step.token.id) !=
        options.stop_token_ids.end()) {
      return FinishReason::kStopToken;
    }
    if (!on_step(step)) return FinishReason::kCaller;
    if (generated + 1 == options.max_new_tokens) break;  // no forward for an unused token
    const int32_t id = step.token.id;
    const SequenceTokens entry{seq_id, {&id, 1}};
    EXL3_RETURN_IF_ERROR(model.Forward({&entry, 1}, LogitsRows::kLastToken, &logits));
  }
  return FinishReason::kLength;
}

}  // namespace

absl::StatusOr<FinishReason> Generate(StepExecutor& executor, int64_t seq_id,
                                      std::span<const int32_t> prompt,
                                      const GenerationOptions& options,
                                      const StepCallback& on_step) {
  if (prompt.empty()) return absl::InvalidArgumentError("generate: the prompt is empty");
  if (options.max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("`max_tokens` must be >= 0, got ", options.max_new_tokens));
  }
  if (options.prefill_chunk_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("`prefill_chunk_tokens` must be > 0, got ",
                                                   options.prefill_chunk_tokens));
  }
  EXL3_RETURN_IF_ERROR(executor.AddSequence(seq_id));
  absl::StatusOr<FinishReason> result = Run(executor, seq_id, prompt, options, on_step);
  absl::Status removed = executor.RemoveSequence(seq_id);
  if (!result.ok()) return result;
  EXL3_RETURN_IF_ERROR(removed);
  return result;
}

absl::StatusOr<FinishReason> Generate(const Transformer& model, PagedKvCache* cache,
                                      int64_t seq_id, std::span<const int32_t> prompt,
                                      const GenerationOptions& options,
                                      const StepCallback& on_step) {
  LocalStepExecutor executor(&model, cache);
  return Generate(executor, seq_id, prompt, options, on_step);
}

}  // namespace exl3serve::worker
