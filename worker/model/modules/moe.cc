#include "worker/model/modules/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::worker {

absl::StatusOr<std::unique_ptr<MixtureOfExperts>> MixtureOfExperts::Load(
    const WeightLoader& weights, const ModelContext& context, int l,
    const sharding::LayerShard& part) {
  const sharding::ModelArch& arch = weights.arch();
  EXL3_RETURN_IF_ERROR(CheckShardRange(part.experts, arch.num_experts, "experts"));
  EXL3_RETURN_IF_ERROR(
      CheckShardRange(part.expert_channels, arch.moe_intermediate_size, "expert channels"));
  std::unique_ptr<MixtureOfExperts> m(new MixtureOfExperts());
  m->context_ = context;
  using sharding::IndexRange;
  using sharding::LinearRole;
  EXL3_ASSIGN_OR_RETURN(m->router_, weights.LoadLinear(l, LinearRole::kRouter, -1,
                                                       IndexRange{0, arch.hidden_size},
                                                       IndexRange{0, arch.num_experts}, true));
  if (context.config->moe_router == MoeRouter::kSigmoidGrouped) {
    EXL3_ASSIGN_OR_RETURN(
        m->score_bias_,
        weights.LoadVector(arch.LayerPrefix(l) + ".mlp.gate.e_score_correction_bias",
                           arch.num_experts));
  }
  if (arch.shared_expert_intermediate_size > 0) {
    EXL3_RETURN_IF_ERROR(CheckShardRange(part.mlp_channels, arch.shared_expert_intermediate_size,
                                         "shared expert channels"));
    m->has_shared_ = !part.mlp_channels.empty();
    if (m->has_shared_) {
      EXL3_ASSIGN_OR_RETURN(m->shared_, SwiGluWeights::Load(weights, l, sharding::kSharedExpert,
                                                            part.mlp_channels, part.down_bias));
      if (arch.shared_expert_gated) {  // [1, hidden], replicated
        EXL3_ASSIGN_OR_RETURN(m->shared_gate_, weights.LoadLinear(l, LinearRole::kSharedExpertGate,
                                                                  -1, IndexRange{0, arch.hidden_size},
                                                                  IndexRange{0, 1}, true));
        m->has_shared_gate_ = true;
      }
    }
  }
  m->expert_begin_ = part.experts.begin;
  m->experts_.reserve(static_cast<size_t>(part.experts.size()));
  for (int64_t i = 0; i < part.experts.size(); ++i) {
    const int e = static_cast<int>(part.experts.begin + i);
    EXL3_ASSIGN_OR_RETURN(SwiGluWeights expert,
                          SwiGluWeights::Load(weights, l, e, part.expert_channels,
                                              part.expert_down_bias));
    m->experts_.push_back(std::move(expert));
  }
  m->tokens_ = std::make_unique<std::atomic<uint64_t>[]>(m->experts_.size());
  return m;
}

void MixtureOfExperts::AddExpertTokens(std::vector<uint64_t>* per_expert) const {
  for (size_t i = 0; i < experts_.size(); ++i) {
    (*per_expert)[expert_begin_ + i] += tokens_[i].load(std::memory_order_relaxed);
  }
}

void MixtureOfExperts::ForEachLinear(const std::function<void(Linear&)>& fn) {
  fn(router_);
  fn(shared_gate_);
  for (SwiGluWeights& e : experts_) e.ForEachLinear(fn);
  // The shared expert too: without it convert --calib had no Hessian for
  // shared_experts.* and quantized them uncalibrated.
  shared_.ForEachLinear(fn);
}

absl::Status MixtureOfExperts::Forward(const StepBatch& step, const float* a, float* out) const {
  const ModelConfig& config = *context_.config;
  const sharding::ModelArch& arch = config.arch;
  const int64_t hidden = arch.hidden_size;
  const int64_t m = step.total;
  const std::span<const RowRun> plan = step.plan;
  // Route (model_config.h MoeRouter): every rank routes every token itself.
  const int experts = arch.num_experts, top_k = arch.num_experts_per_token;
  const int64_t held_begin = expert_begin_;
  const int64_t held_end = held_begin + static_cast<int64_t>(experts_.size());
  std::vector<float> router(m * experts);
  EXL3_RETURN_IF_ERROR(router_.Forward(a, m, router.data(), plan));
  std::vector<std::vector<int64_t>> rows_of(experts);
  std::vector<std::vector<float>> weights_of(experts);
  std::vector<int> order(experts);
  std::vector<double> p(experts);
  std::vector<double> choice(experts), group_score(config.moe_n_group);
  std::vector<int> group_order(config.moe_n_group);
  for (int64_t r = 0; r < m; ++r) {
    const float* z = router.data() + r * experts;
    if (config.moe_router == MoeRouter::kSigmoidGrouped) {
      // s = sigmoid(z); the correction bias only steers the choice.
      for (int e = 0; e < experts; ++e) {
        p[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(z[e])));
        choice[e] = p[e] + static_cast<double>(score_bias_[e]);
      }
      const int groups = config.moe_n_group;
      if (groups > 1) {
        const int per_group = experts / groups;
        for (int g = 0; g < groups; ++g) {
          double best = -INFINITY, second = -INFINITY;
          for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
            if (choice[e] > best) {
              second = best;
              best = choice[e];
            } else if (choice[e] > second) {
              second = choice[e];
            }
          }
          group_score[g] = best + second;
        }
        std::iota(group_order.begin(), group_order.end(), 0);
        std::stable_sort(group_order.begin(), group_order.end(),
                         [&](int x, int y) { return group_score[x] > group_score[y]; });
        // Experts of the groups not kept score 0.0 (as transformers'
        // masked_fill), not -inf: they can still beat negative scores.
        for (int i = config.moe_topk_group; i < groups; ++i) {
          const int g = group_order[i];
          std::fill(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group, 0.0);
        }
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int x, int y) { return choice[x] > choice[y]; });
      double top_sum = 0.0;
      for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
      const double norm =
          config.moe_topk_weights == MoeTopKWeights::kRenormalized ? top_sum + 1e-20 : 1.0;
      for (int i = 0; i < top_k; ++i) {
        rows_of[order[i]].push_back(r);
        weights_of[order[i]].push_back(
            static_cast<float>(p[order[i]] / norm * config.routed_scaling_factor));
      }
      continue;
    }
    const float zmax = *std::max_element(z, z + experts);
    double sum = 0.0;
    for (int e = 0; e < experts; ++e) sum += p[e] = std::exp(static_cast<double>(z[e] - zmax));
    for (int e = 0; e < experts; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return p[x] > p[y]; });
    double top_sum = 0.0;
    for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
    const double norm = config.moe_topk_weights == MoeTopKWeights::kRenormalized ? top_sum : 1.0;
    for (int i = 0; i < top_k; ++i) {
      rows_of[order[i]].push_back(r);
      weights_of[order[i]].push_back(static_cast<float>(p[order[i]] / norm));
    }
  }
  // The shared expert runs on every row; the routed experts add to it.
  if (has_shared_) {
    EXL3_RETURN_IF_ERROR(shared_.Forward(a, m, plan, out));
    if (has_shared_gate_) {  // out = σ(a·w_sg) · shared(a): this rank's channels' share
      std::vector<float> g(static_cast<size_t>(m));
      EXL3_RETURN_IF_ERROR(shared_gate_.Forward(a, m, g.data(), plan));
      for (int64_t r = 0; r < m; ++r) {
        const float s = 1.0f / (1.0f + std::exp(-g[r]));
        float* o = out + r * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] *= s;
      }
    }
  } else {
    std::fill(out, out + m * hidden, 0.0f);
  }
  // Each gathered row keeps its entry's kind: an expert's plan is the kinds
  // of its rows in row order (runs of the batch plan stay runs).
  std::vector<RowKind> kind_of_row;
  kind_of_row.reserve(static_cast<size_t>(m));
  for (const RowRun& run : plan) {
    kind_of_row.insert(kind_of_row.end(), static_cast<size_t>(run.rows), run.kind);
  }
  std::vector<RowRun> expert_plan;
  std::vector<float> x, y;
  for (int64_t e = held_begin; e < held_end; ++e) {  // the experts this rank holds
    const std::vector<int64_t>& rows = rows_of[e];
    if (rows.empty()) continue;
    const int64_t count = static_cast<int64_t>(rows.size());
    x.resize(count * hidden);
    y.resize(count * hidden);
    expert_plan.clear();
    for (int64_t i = 0; i < count; ++i) {
      std::memcpy(&x[i * hidden], &a[rows[i] * hidden], sizeof(float) * hidden);
      AppendRowRun(&expert_plan, 1, kind_of_row[rows[i]]);
    }
    tokens_[e - held_begin].fetch_add(static_cast<uint64_t>(count), std::memory_order_relaxed);
    EXL3_RETURN_IF_ERROR(experts_[e - held_begin].Forward(x.data(), count, expert_plan, y.data()));
    for (int64_t i = 0; i < count; ++i) {
      float* o = out + rows[i] * hidden;
      const float w = weights_of[e][i];
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[i * hidden + c];
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
