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

// Thread safety: thread-safe after Open (immutable; LoadLinear/LoadTensor
// only read the memory maps).
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
};

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_EXL3_MODEL_H_
