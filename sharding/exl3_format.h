// sharding/exl3_format.h — constants fixed by the EXL3 checkpoint format
// (docs/FORMAT.md; section numbers in brackets). Nothing here is
// tunable: changing a value breaks compatibility with exllamav3 files.
#ifndef EXL3SERVE_SHARDING_EXL3_FORMAT_H_
#define EXL3SERVE_SHARDING_EXL3_FORMAT_H_

#include <cstdint>
#include "absl/strings/string_view.h"

#include "kernels/trellis_decode.h"

namespace exl3serve::sharding {

using kernels::Codebook;

// Every stored EXL3 tensor has in/out dims padded to multiples of 128 (§2.4);
// it is also the tensor-parallel split granularity (§5.5).
inline constexpr int64_t kChannelGroup = 128;

// 0-d I32 codebook markers (§2.4). A loader refuses any other stored value.
inline constexpr int32_t kMcgMarkerValue = static_cast<int32_t>(0xCBAC1FEDu);
inline constexpr int32_t kMul1MarkerValue = static_cast<int32_t>(0x83DCD12Du);

// Tensor-name suffixes of one quantized linear with module key P (§2.4).
// absl::string_view, not std::: Debian's Abseil is built with its own
// string_view type, and these go straight into StrCat/EndsWith.
inline constexpr absl::string_view kTrellisSuffix = ".trellis";
inline constexpr absl::string_view kSuhSuffix = ".suh";
inline constexpr absl::string_view kSvhSuffix = ".svh";
inline constexpr absl::string_view kSuSuffix = ".su";    // legacy packed signs
inline constexpr absl::string_view kSvSuffix = ".sv";    // legacy packed signs
inline constexpr absl::string_view kMcgSuffix = ".mcg";
inline constexpr absl::string_view kMul1Suffix = ".mul1";
inline constexpr absl::string_view kBiasSuffix = ".bias";
inline constexpr absl::string_view kWeightSuffix = ".weight";

// quantization_config values (§2.2).
inline constexpr absl::string_view kQuantMethod = "exl3";
// The exllamav3 format version whose files we write (§2.2 "version").
inline constexpr absl::string_view kFormatVersion = "1.4.1";

// Converter defaults (§2.1, §2.2, §6.7).
inline constexpr int kDefaultHeadBits = 6;
inline constexpr int64_t kDefaultShardSizeMiB = 8192;

inline constexpr int64_t PadToChannelGroup(int64_t d) {
  return (d + kChannelGroup - 1) / kChannelGroup * kChannelGroup;
}

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_EXL3_FORMAT_H_
