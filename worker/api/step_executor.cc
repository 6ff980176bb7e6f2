#include "worker/api/step_executor.h"

#include "absl/strings/str_cat.h"

namespace exl3serve::worker {

absl::StatusOr<KvCacheDtype> KvCacheDtypeFromBits(int bits) {
  switch (bits) {
    case 32: return KvCacheDtype::kFp32;
    case 16: return KvCacheDtype::kFp16;
    case 8: return KvCacheDtype::kInt8;
    case 4: return KvCacheDtype::kInt4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("kv cache bits must be 32, 16, 8 or 4, got ", bits));
  }
}

}  // namespace exl3serve::worker
