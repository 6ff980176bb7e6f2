// coordinator/constrained/json_schema_ref.cc — see json_schema_ref.h.
#include "coordinator/constrained/json_schema_ref.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace exl3serve::coordinator::constrained::internal {

using json = nlohmann::json;

std::string Escape(std::string_view token) {
  std::string out;
  for (char c : token) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

absl::StatusOr<Resolved> ResolveLocalRef(const json& root, const std::string& target) {
  if (target.empty() || target[0] != '#') {
    return absl::InvalidArgumentError(absl::StrCat("reference '", target, "' is not local"));
  }
  const json* node = &root;
  const std::string path = target.substr(1);
  std::string resolved;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] != '/') return absl::InvalidArgumentError(absl::StrCat("malformed reference '", target, "'"));
    size_t j = path.find('/', i + 1);
    if (j == std::string::npos) j = path.size();
    std::string token;
    for (size_t k = i + 1; k < j; ++k) {
      if (path[k] == '~' && k + 1 < j && (path[k + 1] == '0' || path[k + 1] == '1')) {
        token += path[k + 1] == '0' ? '~' : '/';
        ++k;
      } else {
        token += path[k];
      }
    }
    if (node->is_object() && node->contains(token)) {
      node = &(*node)[token];
    } else if (node->is_array() && !token.empty() && token.find_first_not_of("0123456789") == std::string::npos &&
               token.size() < 9 && std::stoul(token) < node->size()) {
      node = &(*node)[std::stoul(token)];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("reference '", target, "' does not resolve"));
    }
    absl::StrAppend(&resolved, "/", Escape(token));
    i = j;
  }
  return Resolved{node, resolved};
}

}  // namespace exl3serve::coordinator::constrained::internal
