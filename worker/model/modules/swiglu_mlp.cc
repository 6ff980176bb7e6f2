#include "worker/model/modules/swiglu_mlp.h"

#include <cmath>

#include "common/status_macros.h"

namespace exl3serve::worker {
namespace {

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

absl::StatusOr<SwiGluWeights> SwiGluWeights::Load(const WeightLoader& weights, int layer,
                                                  int expert, sharding::IndexRange channels,
                                                  bool down_bias) {
  using sharding::LinearRole;
  const sharding::IndexRange all_hidden{0, weights.arch().hidden_size};
  SwiGluWeights w;
  EXL3_ASSIGN_OR_RETURN(w.gate,
                        weights.LoadLinear(layer, LinearRole::kGate, expert, all_hidden, channels, true));
  EXL3_ASSIGN_OR_RETURN(w.up,
                        weights.LoadLinear(layer, LinearRole::kUp, expert, all_hidden, channels, true));
  EXL3_ASSIGN_OR_RETURN(w.down, weights.LoadLinear(layer, LinearRole::kDown, expert, channels,
                                                   all_hidden, down_bias));
  return w;
}

absl::Status SwiGluWeights::Forward(const float* x, int64_t rows, std::span<const RowRun> plan,
                                    float* y) const {
  const int64_t inter = gate.out_features();
  std::vector<float> g(rows * inter), u(rows * inter);
  EXL3_RETURN_IF_ERROR(gate.Forward(x, rows, g.data(), plan));
  EXL3_RETURN_IF_ERROR(up.Forward(x, rows, u.data(), plan));
  for (size_t i = 0; i < g.size(); ++i) g[i] = Silu(g[i]) * u[i];
  return down.Forward(g.data(), rows, y, plan);
}

void SwiGluWeights::ForEachLinear(const std::function<void(Linear&)>& fn) {
  for (Linear* l : {&gate, &up, &down}) fn(*l);
}

absl::StatusOr<std::unique_ptr<SwiGluMlp>> SwiGluMlp::Load(const WeightLoader& weights, int layer,
                                                           const sharding::LayerShard& part) {
  EXL3_RETURN_IF_ERROR(
      CheckShardRange(part.mlp_channels, weights.arch().intermediate_size, "mlp channels"));
  std::unique_ptr<SwiGluMlp> m(new SwiGluMlp());
  EXL3_ASSIGN_OR_RETURN(m->mlp_,
                        SwiGluWeights::Load(weights, layer, -1, part.mlp_channels, part.down_bias));
  return m;
}

absl::Status SwiGluMlp::Forward(const StepBatch& step, const float* a, float* out) const {
  return mlp_.Forward(a, step.total, step.plan, out);
}

}  // namespace exl3serve::worker
