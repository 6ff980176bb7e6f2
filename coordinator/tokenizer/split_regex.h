// coordinator/tokenizer/split_regex.h — the regular-expression subset that
// Hugging Face tokenizer.json pre-tokenizers use (GPT-2, Llama 3, Qwen 2/3 and
// similar Split patterns), matched over code points with Oniguruma/Perl
// semantics: leftmost match, alternatives tried in order, greedy quantifiers
// with backtracking.
//
//   EXL3_ASSIGN_OR_RETURN(SplitRegex re, SplitRegex::Compile(R"(\p{L}+|\s+)"));
//   for (MatchRange m : re.FindAll(DecodeUtf8(text))) { ... }
//
// Supported: literals and escapes (\r \n \t \f \v \\ \' ...), `.`, classes
// `[...]` / `[^...]` with ranges, \s \S \d \D \w \W \p{..} \P{..} (general
// categories, see CategoryMaskForName), groups `(...)` `(?:...)` `(?i:...)`,
// lookahead `(?=...)` `(?!...)`, alternation, greedy `? * + {n} {n,} {n,m}`.
// Quantifiers on groups are limited to a maximum of 16 repetitions so the
// matcher's recursion stays bounded; on single characters they are unbounded
// and iterative. Anything else is rejected by Compile.
//
// Internal to coordinator/tokenizer.
// Thread safety: a compiled SplitRegex is immutable; FindAll is thread-safe.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_SPLIT_REGEX_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_SPLIT_REGEX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::coordinator::internal {

// A half-open range of code point indices.
struct MatchRange {
  size_t begin = 0, end = 0;
};

class SplitRegex {
 public:
  // Compiles `pattern` (UTF-8).
  // Errors: Unimplemented naming the construct and its offset for syntax
  // outside the subset; InvalidArgument for malformed patterns.
  static absl::StatusOr<SplitRegex> Compile(std::string_view pattern);

  // All non-overlapping, non-empty matches in `text`, left to right.
  std::vector<MatchRange> FindAll(const std::vector<char32_t>& text) const;

  // The first match starting exactly at `pos`, if any (for tests).
  bool MatchAtForTesting(const std::vector<char32_t>& text, size_t pos, size_t* end) const;

  struct Program;  // the parsed pattern (defined in split_regex.cc)

 private:
  explicit SplitRegex(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  // Shared by copies of this immutable object only.
  std::shared_ptr<const Program> program_;
};

}  // namespace exl3serve::coordinator::internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_SPLIT_REGEX_H_
