// sharding/inspect.h — what `exl3serve inspect` shows: the table of a
// model's layers (bits, codebook, shapes, bytes, average bpw) and one layer's
// effective weight dequantized for outside checks.
#ifndef EXL3SERVE_SHARDING_INSPECT_H_
#define EXL3SERVE_SHARDING_INSPECT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "sharding/exl3_model.h"

namespace exl3serve::sharding {

// A human-readable table: one row per quantized linear (key, in x out padded,
// K, codebook, sign format, bias, bytes), the plain tensors summarised, and
// the average bits per weight (without and with the head).
std::string FormatModelSummary(const Exl3Model& model);

// The effective weight of `name` in HF orientation (out, in), float32:
// W_eff^T for a quantized linear (exl3-format.md §5.2), trimmed to the
// unpadded dims when the architecture is known; a 2-D plain tensor as stored.
// `name` may be the module key or end in ".weight"/".trellis".
// Errors: NotFound naming the tensor (with a hint to run inspect); DataLoss
// from the checkpoint.
struct DequantizedWeight {
  std::vector<int64_t> shape;  // {out, in}
  std::vector<float> values;   // row-major
};
absl::StatusOr<DequantizedWeight> DequantizeWeight(const Exl3Model& model, std::string_view name);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_INSPECT_H_
