// coordinator/constrained/json_schema_numbers.h — internal to
// json_schema_compiler: the regex of the numbers within JSON Schema bounds
// (minimum/maximum/exclusive*), exact against the bounds' shortest decimals
// (README.md, "Numbers"). Integers: canonical digits; decimals: no exponent,
// no -0, <= 18 integer and <= 18 fraction digits.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_NUMBERS_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_NUMBERS_H_

#include <optional>
#include <string>

namespace exl3serve::coordinator::constrained::internal {

// Bounds already read from a schema (the tighter of minimum and
// exclusiveMinimum, likewise above), |bound| <= 1e17.
struct NumberBounds {
  bool has_lo = false, lo_incl = true, has_hi = false, hi_incl = true;
  double lo = 0, hi = 0;
};

// A regex (regex_compiler.h syntax) matching exactly the integers
// (`integer`) or the decimals within `b`, at least one bound given. nullopt:
// no number lies within the bounds.
std::optional<std::string> BoundedNumberRegex(const NumberBounds& b, bool integer);

}  // namespace exl3serve::coordinator::constrained::internal

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_NUMBERS_H_
