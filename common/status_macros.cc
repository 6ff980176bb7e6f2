#include "common/status_macros.h"

#include "absl/strings/str_cat.h"

namespace exl3serve {

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(absl::string_view(context.data(), context.size()), ": ", status.message()));
}

}  // namespace exl3serve
