// coordinator/constrained/json_schema_ref.h — internal to the JSON Schema
// compiler and its oneOf analysis: local references ("#", "#/$defs/a", ...)
// resolved in a schema document, and JSON pointer tokens escaped (~0 ~1).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_REF_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_REF_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::constrained::internal {

// `token` as a JSON pointer token ('~' -> "~0", '/' -> "~1").
std::string Escape(std::string_view token);

struct Resolved {
  const nlohmann::json* node;
  std::string ptr;  // the target's JSON pointer (escaped)
};

// `target` ("#", "#/$defs/a", ...) in `root`. InvalidArgument ("malformed
// reference", "does not resolve") otherwise.
absl::StatusOr<Resolved> ResolveLocalRef(const nlohmann::json& root, const std::string& target);

}  // namespace exl3serve::coordinator::constrained::internal

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_REF_H_
