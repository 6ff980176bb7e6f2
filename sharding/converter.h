// sharding/converter.h — Hugging Face checkpoint -> EXL3 checkpoint.
//
// Reads HF safetensors (bf16/fp16/fp32, one file or shards), quantizes every
// linear the architecture's runtime serves (attention, MLP, expert
// projections at the allocated K; lm_head at head_bits), carries embeddings,
// norms and unquantized linears over with the dtype rules of
// exl3-format.md §2.5, and writes a directory exllamav3's loader accepts
// (§7): config.json with quantization_config, quantization_config.json with
// tensor_storage, safetensors shard(s) (+ index), other files copied.
//
// Work is done one module group at a time (a layer's attention, its MLP or
// MoE block, the head), each written to <out>/.exl3-work/ as soon as it is
// done, so an interrupted run continues with `resume` where it stopped. The
// final shards are compiled from those files at the end, streaming one tensor
// at a time.
//
//   ConvertOptions opt;  opt.in_dir = hf;  opt.out_dir = out;  opt.bits = 4.0;
//   EXL3_ASSIGN_OR_RETURN(ConvertReport report, ConvertModel(opt));
//
// Calibration seam: without a HessianProvider every tensor is quantized
// without error feedback (exl3-format.md §6.6, "identity Hessian"). The
// single-rank model will supply Hessians captured from calibration text
// through `ConvertOptions::hessians`.
#ifndef EXL3SERVE_SHARDING_CONVERTER_H_
#define EXL3SERVE_SHARDING_CONVERTER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "sharding/exl3_format.h"
#include "sharding/model_arch.h"
#include "sharding/quant/regularize.h"

namespace exl3serve::sharding {

// Supplies input Hessians for calibration (exl3-format.md §6.2).
// Thread safety: called from the converter's driver thread only.
class HessianProvider {
 public:
  // The averaged input Hessian of one linear: H = XᵀX / count over `count`
  // calibration rows, in_features x in_features row-major (unpadded), not
  // damped, not rotated. count == 0 (or an empty h) means "no data".
  struct MeanHessian {
    std::vector<float> h;
    int64_t count = 0;
  };
  virtual ~HessianProvider() = default;
  // The Hessian of `linear`'s input, or nullopt to quantize this linear
  // without error feedback (§6.6).
  virtual absl::StatusOr<std::optional<MeanHessian>> InputHessian(const LinearSpec& linear) = 0;
};

using OutScalesMode = quant::OutScalesMode;  // §6.3 step 1: always | never | auto

struct ConvertOptions {
  std::string in_dir;
  std::string out_dir;
  double bits = 4.0;               // target average bits per weight, 1.0 .. 8.0
  int head_bits = kDefaultHeadBits;  // 1..8, or 16 to keep lm_head unquantized (fp16)
  Codebook codebook = Codebook::kMul1;
  OutScalesMode out_scales = OutScalesMode::kAlways;
  int threads = 0;                 // 0: all hardware threads
  bool resume = false;             // continue an interrupted run in out_dir
  uint64_t max_shard_bytes = static_cast<uint64_t>(kDefaultShardSizeMiB) << 20;  // per file
  bool show_progress = true;       // progress bar on a terminal, log lines otherwise
  HessianProvider* hessians = nullptr;  // borrowed; may be null
  // The calibration data behind `hessians`, recorded in
  // quantization_config.json as "calibration": {"rows", "cols"} (sequences,
  // tokens in the longest; §2.2). 0 and 0 without calibration.
  int64_t calibration_rows = 0;
  int64_t calibration_cols = 0;
};

// What happened to one linear.
struct ConvertedLinear {
  std::string key;
  int64_t in_features = 0;   // unpadded
  int64_t out_features = 0;
  int bits = 0;              // 16 for an unquantized (fp16) linear
  bool quantized = true;
  double relative_error = 0.0;  // ||W_eff - W||_F / ||W||_F over the unpadded weight
  double proxy_error = 0.0;     // tr(E^T H E) / tr(W^T H W); the plain relative MSE without H
  double seconds = 0.0;
};

struct ConvertReport {
  std::vector<ConvertedLinear> linears;  // model order
  double bits_achieved = 0.0;  // the `bits` of quantization_config: budget linears only
  double bits_with_head = 0.0; // all quantized linears incl. the head
  uint64_t output_bytes = 0;   // tensor bytes written
  int shards = 0;
  int resumed_groups = 0;      // module groups taken from an earlier run
  double seconds = 0.0;
};

// Converts options.in_dir into options.out_dir.
// Errors:
//   InvalidArgument — bad option (bits outside 1..8, head_bits not 1..8/16,
//                     shard size 0), out_dir non-empty without `resume`,
//                     or a resume whose recorded options differ;
//   NotFound        — in_dir, config.json or a required tensor is missing
//                     (named);
//   Unimplemented   — an unsupported architecture or tensor dtype;
//   DataLoss        — a tensor whose shape disagrees with config.json, or a
//                     malformed input file (named).
// Nothing in out_dir is overwritten except by a complete new file; the work
// directory is removed only after the final files are written.
absl::StatusOr<ConvertReport> ConvertModel(const ConvertOptions& options);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_CONVERTER_H_
