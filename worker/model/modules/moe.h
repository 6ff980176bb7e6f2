// worker/model/modules/moe.h — a mixture of SwiGLU experts with an optional
// shared expert (Mixtral, Qwen3-MoE, GLM-4 MoE, DeepSeek-V3).
//
//   softmax router (MoeRouter::kSoftmax): p = softmax(a·Wrᵀ), top-k experts,
//     weights renormalised (Mixtral, Qwen3-MoE with norm_topk_prob) or not;
//   sigmoid grouped (kSigmoidGrouped): s = sigmoid(a·Wrᵀ), experts chosen on
//     s + correction bias within the best groups, weights from s
//     (model_config.h MoeRouter);
//   out = Σ w_e · expert_e(a) [+ shared_expert(a)], the shared expert gated by
//   σ(a·w_sg) where the checkpoint has `mlp.shared_expert_gate` (Qwen3-Next, Qwen3.5)
//
// Tensor/expert parallelism: the router is replicated (every rank routes
// every token itself; the inputs are bit-identical, so every rank picks the
// same experts); a rank holds a range of experts and of each held expert's
// channels, and of the shared expert's channels. Each gathered row runs at
// its entry's kind (linear.h RowKind), so a row's result does not depend on
// what else shares the step.
#ifndef EXL3SERVE_WORKER_MODEL_MODULES_MOE_H_
#define EXL3SERVE_WORKER_MODEL_MODULES_MOE_H_

#include <atomic>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/modules/module.h"
#include "worker/model/modules/swiglu_mlp.h"
#include "worker/model/modules/weight_loader.h"

namespace exl3serve::worker {

class MixtureOfExperts final : public FeedForward {
 public:
  // Layer `layer`'s MoE block, this rank's experts and channels of `part`.
  // Errors: InvalidArgument for ranges outside the model; those of WeightLoader.
  static absl::StatusOr<std::unique_ptr<MixtureOfExperts>> Load(const WeightLoader& weights,
                                                                const ModelContext& context,
                                                                int layer,
                                                                const sharding::LayerShard& part);
  absl::Status Forward(const StepBatch& step, const float* a, float* out) const override;
  void AddExpertTokens(std::vector<uint64_t>* per_expert) const override;
  std::pair<int64_t, int64_t> held_experts() const override {
    return {expert_begin_, expert_begin_ + static_cast<int64_t>(experts_.size())};
  }
  void ForEachLinear(const std::function<void(Linear&)>& fn) override;

 private:
  MixtureOfExperts() = default;

  ModelContext context_;
  Linear router_;
  std::vector<float> score_bias_;  // kSigmoidGrouped: e_score_correction_bias
  int64_t expert_begin_ = 0;            // experts_[i] is expert expert_begin_ + i
  std::vector<SwiGluWeights> experts_;  // the ones this rank holds
  bool has_shared_ = false;             // this rank holds channels of the shared expert
  SwiGluWeights shared_;
  bool has_shared_gate_ = false;  // Qwen3-Next / Qwen3.5: σ(a·w_sg) scales the shared expert
  Linear shared_gate_;            // [1, hidden], replicated
  // Tokens routed to each held expert (relaxed; written by Forward).
  std::unique_ptr<std::atomic<uint64_t>[]> tokens_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_MODULES_MOE_H_
