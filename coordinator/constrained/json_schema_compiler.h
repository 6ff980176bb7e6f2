// coordinator/constrained/json_schema_compiler.h — a JSON Schema (the subset
// coordinator/constrained/README.md lists) compiled to grammar rules whose
// strings are JSON texts valid against the schema, in a fixed layout: no
// whitespace except one optional space after ':' and ',' (unbounded
// whitespace lets a model pad until max_tokens); object properties in
// schema order.
//
//   Grammar g;
//   EXL3_ASSIGN_OR_RETURN(uint32_t root, CompileJsonSchema(R"({"type":"integer"})", g));
//
// oneOf is exact: a branch is emitted only where none of its values can be
// valid against another branch (its objects may be narrowed to make it so;
// a branch whose every value matches another is dropped); branches that may
// overlap otherwise are refused ("oneOf at /x: branches 0 and 2 may both
// match the same value ..."). `format` with minLength/maxLength counts code
// points like `pattern` does (email with a maxLength: at most 66 characters).
//
// Errors: InvalidArgument for text that is not JSON, a keyword outside the
// subset or a value of the wrong shape — the message names the keyword and
// its JSON pointer ("unsupported JSON Schema keyword 'not' at /properties/a");
// ResourceExhausted when the grammar would exceed its limits; nesting deeper
// than kMaxSchemaDepth is InvalidArgument.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_COMPILER_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_COMPILER_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "coordinator/constrained/grammar.h"

namespace exl3serve::coordinator::constrained {

inline constexpr int kMaxSchemaDepth = 64;
inline constexpr size_t kMaxSchemaBytes = size_t{1} << 20;
// minItems/maxItems/minLength/maxLength above this are refused (each bound
// unrolls into grammar rules).
inline constexpr int64_t kMaxSchemaCount = 1000;

absl::StatusOr<uint32_t> CompileJsonSchema(std::string_view schema, Grammar& grammar);

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_COMPILER_H_
