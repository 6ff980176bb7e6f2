#include "coordinator/speculative_method.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace exl3serve::coordinator {

absl::StatusOr<SpeculativeMethod> ParseSpeculativeMethod(std::string_view name) {
  if (name == "none") return SpeculativeMethod::kNone;
  if (name == "ngram") return SpeculativeMethod::kNgram;
  if (name == "draft") return SpeculativeMethod::kDraftModel;
  return absl::InvalidArgumentError(
      absl::StrCat("speculative method '", std::string(name), "': expected none, ngram or draft"));
}

const char* SpeculativeMethodName(SpeculativeMethod method) {
  switch (method) {
    case SpeculativeMethod::kNone: return "none";
    case SpeculativeMethod::kNgram: return "ngram";
    case SpeculativeMethod::kDraftModel: return "draft";
  }
  return "none";
}

}  // namespace exl3serve::coordinator
