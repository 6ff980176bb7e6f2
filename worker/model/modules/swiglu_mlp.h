// worker/model/modules/swiglu_mlp.h — the gated MLP every supported model
// uses, as a feed-forward module (dense layers) and as the function the
// mixture of experts runs per expert:
//
//   out = (silu(a·Wgᵀ) ⊙ a·Wuᵀ)·Wdᵀ
//
// Tensor parallelism: a rank holds a range of the intermediate channels
// (gate/up column-parallel, down row-parallel; only one rank adds down's bias).
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_SWIGLU_MLP_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_SWIGLU_MLP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

// The three projections of one gated MLP (an expert, a shared expert, a dense MLP).
struct SwiGluWeights {
  Linear gate, up, down;

  // Loads (layer, expert)'s gate/up/down for this rank's intermediate
  // channels `channels` (down_bias: whether this rank adds down's bias).
  static absl::StatusOr<SwiGluWeights> Load(const WeightLoader& weights, int layer, int expert,
                                            sharding::IndexRange channels, bool down_bias);
  // y [rows][hidden] = the MLP of x [rows][hidden], each run at its kind.
  absl::Status Forward(const float* x, int64_t rows, std::span<const RowRun> plan, float* y) const;
  void ForEachLinear(const std::function<void(Linear&)>& fn);
};

class SwiGluMlp final : public FeedForward {
 public:
  // Layer `layer`'s dense MLP, this rank's part.mlp_channels. Errors:
  // InvalidArgument for channels out of range; those of WeightLoader.
  static absl::StatusOr<std::unique_ptr<SwiGluMlp>> Load(const WeightLoader& weights, int layer,
                                                         const sharding::LayerShard& part);
  absl::Status Forward(const StepBatch& step, const float* a, float* out) const override;
  void ForEachLinear(const std::function<void(Linear&)>& fn) override { mlp_.ForEachLinear(fn); }

 private:
  SwiGluMlp() = default;
  SwiGluWeights mlp_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_SWIGLU_MLP_H_
