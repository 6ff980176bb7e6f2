// worker/model/calibration.h — input Hessians captured by running
// calibration text through the unquantized model, for the converter's
// block-LDL error feedback (exl3-format.md §6.2, §6.4).
//
//   EXL3_ASSIGN_OR_RETURN(auto hessians,
//                         CalibrationHessians::Collect(hf_dir, sequences));
//   ConvertOptions opt;  opt.hessians = hessians.get();  ...  ConvertModel(opt);
//
// Every calibration sequence is prefilled through the source model once;
// each linear's input rows are accumulated into H += XᵀX (float64). Linears
// that read the same input share one accumulator (q/k/v; gate/up; an
// expert's gate/up). Differences from exllamav3 (§6.1), stated: the inputs
// come from the unquantized model for all layers at once (exllamav3 advances
// the states through the already-quantized layers), and MoE experts see only
// the tokens routed to them (exllamav3 activates all experts while
// capturing); an expert that saw no token is quantized without a Hessian.
//
// Thread safety: thread-compatible; Collect runs the forward on the calling
// thread (kernels use the shared pool).
// Ownership: owns its accumulators (8·in² bytes per shared input).
#ifndef EXL3SERVE_WORKER_MODEL_CALIBRATION_H_
#define EXL3SERVE_WORKER_MODEL_CALIBRATION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "sharding/converter.h"
#include "worker/model/linear.h"

namespace exl3serve::sharding::quant {
class HessianAccumulator;
}

namespace exl3serve::worker {

class CalibrationHessians final : public sharding::HessianProvider, public InputObserver {
 public:
  ~CalibrationHessians() override;

  // Runs each sequence (token ids) through the model in `model_dir` (an HF
  // or EXL3 directory) and keeps the Hessians.
  // Errors: those of Transformer::Load; InvalidArgument for no sequences, an
  // empty sequence or a token id outside the vocabulary (naming it).
  // Cost: one prefill per sequence; memory as stated above.
  static absl::StatusOr<std::unique_ptr<CalibrationHessians>> Collect(
      const std::string& model_dir, const std::vector<std::vector<int32_t>>& sequences);

  // H = XᵀX / rows of `linear`'s input (nullopt when it saw no rows).
  absl::StatusOr<std::optional<MeanHessian>> InputHessian(
      const sharding::LinearSpec& linear) override;

  int64_t tokens() const { return tokens_; }

 private:
  CalibrationHessians() = default;
  void ObserveInput(const std::string& key, const float* x, int64_t rows,
                    int64_t in_features) override;

  // linear key -> the key whose accumulator holds its input
  absl::flat_hash_map<std::string, std::string> input_of_;
  absl::flat_hash_map<std::string, std::unique_ptr<sharding::quant::HessianAccumulator>> acc_;
  int64_t tokens_ = 0;
};

// Reads a calibration file: a JSON array of token ids, or an array of such
// arrays; anything else is text, tokenized with the model's tokenizer.json
// (by the caller, who passes `tokenize`). The result is cut into sequences of
// at most `max_tokens_per_sequence`. Errors: NotFound / I/O naming the file;
// InvalidArgument for an empty result.
struct CalibrationText {
  std::vector<std::vector<int32_t>> sequences;
  bool was_text = false;  // true: the caller must tokenize `text`
  std::string text;
};
absl::StatusOr<CalibrationText> ReadCalibrationFile(const std::string& path);
std::vector<std::vector<int32_t>> SplitIntoSequences(const std::vector<int32_t>& ids,
                                                     int64_t max_tokens_per_sequence);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_CALIBRATION_H_
