// coordinator/constrained/gbnf_parser.h — GBNF grammars (llama.cpp's text
// form) parsed into grammar rules.
//
//   root  ::= "yes" | "no" | item+      # comment
//   item  ::= [a-z0-9_-]{1,8} ("," ws)?
//   ws    ::= [ \t]?
//
// Rules: `name ::= alternatives`, a rule body runs until the next
// `name ::=` or the end. Terms: "literal" (escapes \n \t \r \\ \" \' \[ \]
// \xHH \uHHHH \UHHHHHHHH), [class] ([^...] negated; ranges of code points),
// `.` (any character), rule names, ( groups ), postfix * + ? {m} {m,} {m,n}.
// The start rule is `root`. Errors are InvalidArgument with "line:column":
// syntax, an undefined rule, a repetition count above kMaxGbnfRepeat,
// nesting deeper than kMaxGbnfNesting, and left recursion (not supported:
// rewrite `list ::= list "," item | item` as `list ::= item ("," item)*`).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_GBNF_PARSER_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_GBNF_PARSER_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/constrained/grammar.h"

namespace exl3serve::coordinator::constrained {

inline constexpr int kMaxGbnfNesting = 100;
inline constexpr int kMaxGbnfRepeat = 1000;

// Adds the grammar's rules to `grammar`; returns the rule `root`.
absl::StatusOr<uint32_t> ParseGbnf(std::string_view text, Grammar& grammar);

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_GBNF_PARSER_H_
