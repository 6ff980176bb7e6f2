// common/status_macros.h — the two control-flow macros exl3serve allows.
//
//   EXL3_RETURN_IF_ERROR(expr);            // returns expr's status if not OK
//   EXL3_ASSIGN_OR_RETURN(auto v, expr);   // unwraps a StatusOr or returns its status
//
// Same meaning as Abseil's later macros (absl 20220623 in Debian 12 lacks them).
// Also: Annotate(status, "context") prefixes a message as errors travel up
// ("loading model-00002.safetensors: tensor ... has shape ...").
#ifndef EXL3SERVE_COMMON_STATUS_MACROS_H_
#define EXL3SERVE_COMMON_STATUS_MACROS_H_

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace exl3serve {

// Returns `status` with "context: " prepended to its message; OK stays OK.
absl::Status Annotate(const absl::Status& status, std::string_view context);

}  // namespace exl3serve

#define EXL3_STATUS_CONCAT_INNER_(a, b) a##b
#define EXL3_STATUS_CONCAT_(a, b) EXL3_STATUS_CONCAT_INNER_(a, b)

#define EXL3_RETURN_IF_ERROR(expr)                                   \
  do {                                                               \
    ::absl::Status exl3_status_ = (expr);                            \
    if (!exl3_status_.ok()) return exl3_status_;                     \
  } while (false)

#define EXL3_ASSIGN_OR_RETURN(lhs, expr) \
  EXL3_ASSIGN_OR_RETURN_IMPL_(EXL3_STATUS_CONCAT_(exl3_statusor_, __LINE__), lhs, expr)

#define EXL3_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

#endif  // EXL3SERVE_COMMON_STATUS_MACROS_H_
