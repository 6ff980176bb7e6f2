// sharding/safetensors_internal.h — private to the safetensors*.cc files.
#ifndef EXL3SERVE_SHARDING_SAFETENSORS_INTERNAL_H_
#define EXL3SERVE_SHARDING_SAFETENSORS_INTERNAL_H_

#include <string_view>

#include "absl/strings/string_view.h"

namespace exl3serve::sharding::internal {

// Debian 12's Abseil is built with ABSL_OPTION_USE_STD_STRING_VIEW=0, so
// absl::string_view is a distinct type that std::string_view does not
// convert to (StrCat arguments, flat_hash_map<std::string> lookups).
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace exl3serve::sharding::internal

#endif  // EXL3SERVE_SHARDING_SAFETENSORS_INTERNAL_H_
