// coordinator/constrained/regex_compiler.h — regular expressions (an
// ECMAScript-like subset) compiled to a DFA over bytes and emitted as
// right-linear grammar rules (one rule per DFA state; tail calls, so matching
// never grows the automaton's stack).
//
//   EXL3_ASSIGN_OR_RETURN(uint32_t rule, CompileRegex("[a-z]+\\d{2}", {}, grammar, "id"));
//
// Supported: literals (UTF-8), `.` (any character but \n \r U+2028 U+2029),
// classes `[...]` with ranges and `^` negation, escapes \d \w \s \D \W \S
// \n \t \r \f \v \0 \xHH \uHHHH \u{H..} and escaped punctuation, groups
// `(...)` `(?:...)` `(?<name>...)`, alternation, `* + ? {m} {m,} {m,n}`
// (a trailing lazy `?` is accepted: the language is the same), `^` at the
// start and `$` at the end of a top-level branch. Classes and `.` match
// whole characters (a class of non-ASCII code points becomes byte
// sequences). Refused with InvalidArgument naming the offset:
// backreferences, lookaround, word boundaries, inline flags, anchors
// elsewhere, malformed syntax, counts above kMaxRegexRepeat, nesting deeper
// than kMaxRegexNesting. ResourceExhausted: the automaton would exceed
// kMaxRegexNfaStates / kMaxRegexDfaStates.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_REGEX_COMPILER_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_REGEX_COMPILER_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/constrained/grammar.h"

namespace exl3serve::coordinator::constrained {

inline constexpr int kMaxRegexNesting = 100;
inline constexpr int kMaxRegexRepeat = 1000;
inline constexpr size_t kMaxRegexNfaStates = 200000;
inline constexpr size_t kMaxRegexDfaStates = 10000;

struct RegexOptions {
  // The pattern constrains a JSON string's decoded content: characters JSON
  // must escape (", \, U+0000..U+001F) are emitted as their canonical escape
  // (\" \\ \n \t \r \b \f, else \u00XX); every other character is raw UTF-8.
  bool json_string_content = false;
  // JSON Schema `pattern` semantics (a search): a top-level branch without
  // `^` may have any text before it, one without `$` any text after it.
  bool search = false;
  // Length limits in code points (a JSON escape is one code point): the
  // matches are intersected with "between min_code_points and
  // max_code_points characters" (max < 0: unbounded) by a product of the
  // DFA with a character counter, under the same kMaxRegexDfaStates limit.
  int64_t min_code_points = 0;
  int64_t max_code_points = -1;
};

// Adds the rules for `pattern` to `grammar` and returns the start rule (its
// strings are exactly the pattern's matches). `name` prefixes rule names.
absl::StatusOr<uint32_t> CompileRegex(std::string_view pattern, const RegexOptions& options,
                                      Grammar& grammar, std::string_view name);

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_REGEX_COMPILER_H_
