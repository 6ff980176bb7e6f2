// coordinator/speculative_method.h — where speculative decoding's draft
// tokens come from (EngineOptions::speculative, `serve --speculative`, YAML
// `engine.speculative`). Its own unit so that the config readers (cli/) and
// their fuzzer parse it without linking the engine.
#ifndef EXL3SERVE_COORDINATOR_SPECULATIVE_METHOD_H_
#define EXL3SERVE_COORDINATOR_SPECULATIVE_METHOD_H_

#include <string_view>

#include "absl/status/statusor.h"

namespace exl3serve::coordinator {

enum class SpeculativeMethod {
  kNone,
  kNgram,       // prompt lookup over the sequence's own tokens (ngram_drafter.h)
  kDraftModel,  // a smaller model with the same tokenizer (draft_model.h)
};

// "none" / "ngram" / "draft" (the --speculative spellings); InvalidArgument
// otherwise, naming the accepted values.
absl::StatusOr<SpeculativeMethod> ParseSpeculativeMethod(std::string_view name);
const char* SpeculativeMethodName(SpeculativeMethod method);

// Draft tokens per sequence per step at most: a drafting entry of 1 + k
// tokens stays under the ranks' prefill-precision row count (17,
// worker/model/linear.h kPrefillMinRows), so it runs at the precision its
// serial decode runs at.
inline constexpr int kMaxDraftTokens = 15;

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_SPECULATIVE_METHOD_H_
