// sharding/exl3_model.h — an EXL3 model directory as a typed, validated
// in-memory description that later code queries by layer and role.
//
// Format facts (exl3-format.md): a module P is a quantized linear when
// P.trellis exists with P.suh (or legacy P.su) and P.svh (or P.sv) (§2.4);
// K = trellis.shape[2] / 16; the codebook is mcg / mul1 when the 0-d I32
// marker P.mcg / P.mul1 is present (value checked exactly), 3inst otherwise;
// both markers is an error. config.json's quantization_config is advisory
// (§2.2): the tensors decide. Every other tensor (embeddings, norms, fp16
// linears such as the MoE router, lm_head when head_bits = 16) is a plain
// tensor, loaded as stored.
//
// Usage sketch:
//   EXL3_ASSIGN_OR_RETURN(auto model, Exl3Model::Open(dir));
//   const Exl3LinearInfo* q = model->FindLinear(3, LinearRole::kQ);
//   EXL3_ASSIGN_OR_RETURN(kernels::Exl3LinearData data, model->LoadLinear(q->key));
//   kernels::ReferenceForward(data.view(), x, m, y);
//
// Opening reads headers only; LoadLinear copies one layer's tensors out of
// the memory map into aligned, owned arrays.
#ifndef EXL3SERVE_SHARDING_EXL3_MODEL_H_
#define EXL3SERVE_SHARDING_EXL3_MODEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/reconstruct.h"
#include "sharding/exl3_format.h"
#include "sharding/model_arch.h"
#include "sharding/safetensors.h"

namespace exl3serve::sharding {

// One quantized linear as found in the files.
struct Exl3LinearInfo {
  std::string key;               // module key P
  int64_t k = 0;                 // padded in_features (rows of W, EXL3 orientation)
  int64_t n = 0;                 // padded out_features
  int bits = 0;                  // K
  Codebook codebook = Codebook::k3Inst;
  bool legacy_signs = false;     // su/sv bitfields instead of suh/svh (§5.4)
  bool has_bias = false;
  uint64_t stored_bytes = 0;     // sum of this module's tensor bytes
  const LinearSpec* spec = nullptr;  // its place in the architecture, if known
};

// A tensor that is not part of a quantized linear.
struct PlainTensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t stored_bytes = 0;
};

// The advisory quantization_config of config.json (§2.2), as far as present.
struct QuantizationConfigSummary {
  bool present = false;
  std::string quant_method;
  std::string version;
  double bits = 0.0;
  int head_bits = 0;
  std::string codebook;
};

// Thread safety: thread-safe after Open (immutable but for the atomic
// bytes_read() counter; the Load* methods only read the memory maps).
// Ownership: owns the checkpoint's memory maps.
class Exl3Model {
 public:
  // Opens `dir` (config.json + model.safetensors or shards with index).
  // Errors: NotFound for a missing directory/config/tensor file; DataLoss,
  // naming file, tensor and rule, for a malformed checkpoint: a trellis that
  // is not I16 rank-3 [k/16, n/16, 16K] with K in 1..8 and k, n multiples of
  // 128; missing or misshaped suh/su, svh/sv, bias; a marker that is not a
  // 0-d I32 with the exact value; both markers; sign/scale tensors without a
  // trellis; and, for a supported architecture, a linear that is missing or
  // whose padded shape disagrees with config.json.
  // config.json with an unsupported `architectures` is allowed (arch() is
  // empty then; the linears are still described).
  static absl::StatusOr<std::unique_ptr<Exl3Model>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const std::optional<ModelArch>& arch() const { return arch_; }
  const QuantizationConfigSummary& quantization_config() const { return quant_config_; }

  // In file-name order of keys (sorted).
  const std::vector<Exl3LinearInfo>& linears() const { return linears_; }
  const std::vector<PlainTensorInfo>& plain_tensors() const { return plain_; }

  const Exl3LinearInfo* FindLinear(std::string_view key) const;
  // By place in the architecture; nullptr when arch() is empty or the linear
  // is not quantized.
  const Exl3LinearInfo* FindLinear(int layer, LinearRole role, int expert = -1) const;
  const PlainTensorInfo* FindPlain(std::string_view name) const;

  // Average bits per weight over quantized linears: Σ numel·K / Σ numel.
  // `include_head` false excludes the head, as quantization_config.bits does.
  double AverageBitsPerWeight(bool include_head) const;
  uint64_t TotalStoredBytes() const { return checkpoint_->total_tensor_bytes(); }

  // Copies one quantized linear into owned arrays (trellis as uint16, suh/svh
  // as float — ±1 from legacy sign bits —, bias as float or empty).
  // Errors: NotFound for an unknown key; DataLoss for unreadable data.
  absl::StatusOr<kernels::Exl3LinearData> LoadLinear(std::string_view key) const;

  // A plain tensor converted to float (F16/BF16/F32/F64).
  absl::StatusOr<std::vector<float>> LoadTensorAsFloat(std::string_view name) const;

  // Rank-local loading (tensor parallelism, sharding/shard_plan.h): only the
  // bytes of the slice are read from the checkpoint.
  //
  // Rows [row_begin, row_end) (input channels, k) and columns
  // [col_begin, col_end) (output channels, n) of quantized linear `key`, all
  // four multiples of 128 within the padded k x n: suh[rows], the trellis
  // tiles of the block, svh[cols], and bias[cols] when `with_bias` and the
  // linear has one (else empty). Equals kernels::SliceRows/SliceColumns
  // applied to the whole linear (SliceRows keeps the bias only for row 0:
  // pass with_bias = row_begin == 0 for a row-parallel shard). Empty ranges
  // are allowed. Cost: the trellis block is one contiguous read when the
  // columns are complete, else one read of (col_end - col_begin)/16 tiles per
  // row of tiles; nothing outside the block is touched.
  // Errors: NotFound for an unknown key; InvalidArgument for a range that is
  // unaligned or outside the linear (named); DataLoss for unreadable data.
  absl::StatusOr<kernels::Exl3LinearData> LoadLinearSlice(std::string_view key,
                                                          int64_t row_begin, int64_t row_end,
                                                          int64_t col_begin, int64_t col_end,
                                                          bool with_bias) const;

  // Block [dim0_begin, dim0_end) x [dim1_begin, dim1_end) of a plain 2-d
  // tensor (1-d: dim1 range must be [0, 1)), converted to float, row-major;
  // one contiguous read per row of the block (one in all when the dim1 range
  // is full). Empty ranges are allowed (empty result).
  // Errors: NotFound for an unknown tensor; InvalidArgument for a range
  // outside the shape (named), a tensor that is not 1-d or 2-d, or a dtype
  // other than F16/BF16/F32/F64.
  absl::StatusOr<std::vector<float>> LoadTensorSliceAsFloat(std::string_view name,
                                                            int64_t dim0_begin, int64_t dim0_end,
                                                            int64_t dim1_begin,
                                                            int64_t dim1_end) const;

  // The same block of a BF16 or F16 tensor as its stored 16-bit patterns (no
  // conversion; worker::Linear holds such weights in 16 bits).
  // Errors: those of LoadTensorSliceAsFloat; InvalidArgument for a dtype
  // other than F16/BF16.
  absl::StatusOr<std::vector<uint16_t>> LoadTensorSlice16(std::string_view name,
                                                          int64_t dim0_begin, int64_t dim0_end,
                                                          int64_t dim1_begin,
                                                          int64_t dim1_end) const;

  // Bytes copied out of the checkpoint by LoadLinear*, LoadTensor* since
  // Open (all threads), counted as stored (an F16 element is 2 bytes); the
  // header reads and marker checks of Open are not counted. The measure of
  // rank-local loading.
  uint64_t bytes_read() const;

  const SafetensorsCheckpoint& checkpoint() const { return *checkpoint_; }

 private:
  Exl3Model() = default;
  absl::Status Describe();

  std::string dir_;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
  std::optional<ModelArch> arch_;
  QuantizationConfigSummary quant_config_;
  std::vector<Exl3LinearInfo> linears_;
  std::vector<PlainTensorInfo> plain_;
  absl::flat_hash_map<std::string, size_t> linear_index_;
  absl::flat_hash_map<std::string, size_t> plain_index_;

  // Own synchronisation: relaxed increments, a statistic only.
  mutable std::atomic<uint64_t> bytes_read_{0};
};

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_EXL3_MODEL_H_
