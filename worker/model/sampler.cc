#include "worker/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "worker/model/counter_rng.h"
#include <random>

namespace exl3serve::worker {
namespace {

// Top logprobs reported at most (the OpenAI API's limit).
constexpr int kMaxTopLogprobs = 20;

absl::Status Bad(const char* field, const char* rule, double value) {
  return absl::InvalidArgumentError(absl::StrCat("`", field, "` must be ", rule, ", got ", value));
}

int32_t ArgMax(std::span<const double> z) {
  return static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
}

}  // namespace


absl::StatusOr<Sampler> Sampler::Create(const SamplingParams& params,
                                        std::span<const int32_t> prompt) {
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) return s;
  Sampler sampler;
  sampler.params_ = params;
  for (int32_t id : prompt) sampler.seen_[id] = 1;
  sampler.position_ = static_cast<int64_t>(prompt.size());
  if (params.seed.has_value()) {
    sampler.seed_ = *params.seed;
  } else {
    std::random_device device;
    sampler.seed_ = static_cast<uint64_t>(device()) << 32 | device();
  }
  return sampler;
}

void Sampler::Accept(int32_t id) {
  seen_[id] = 1;
  ++output_counts_[id];
  ++position_;
}

std::vector<double> Sampler::PenalizedLogits(std::span<const float> logits) const {
  std::vector<double> z(logits.begin(), logits.end());
  const int64_t vocab = static_cast<int64_t>(z.size());
  if (params_.repetition_penalty != 1.0f) {
    const double r = params_.repetition_penalty;
    for (const auto& [id, unused] : seen_) {
      if (id < 0 || id >= vocab) continue;
      z[id] = z[id] > 0.0 ? z[id] / r : z[id] * r;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    for (const auto& [id, count] : output_counts_) {
      if (id < 0 || id >= vocab) continue;
      z[id] -= static_cast<double>(params_.frequency_penalty) * count +
               static_cast<double>(params_.presence_penalty);
    }
  }
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && id < vocab) z[id] += bias;
  }
  return z;
}

std::vector<double> Sampler::Distribution(std::span<const float> logits) const {
  EXL3_CHECK(!logits.empty());
  std::vector<double> z = PenalizedLogits(logits);
  const int64_t vocab = static_cast<int64_t>(z.size());
  std::vector<double> p(vocab, 0.0);
  if (params_.temperature == 0.0f) {
    p[ArgMax(z)] = 1.0;
    return p;
  }
  const double zmax = *std::max_element(z.begin(), z.end());
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += p[i] = std::exp((z[i] - zmax) / params_.temperature);
  for (double& x : p) x /= sum;

  // Candidates in descending probability, lowest id first on ties.
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto more_likely = [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  int64_t kept = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) kept = params_.top_k;
  if (params_.top_p < 1.0f) {
    std::sort(order.begin(), order.end(), more_likely);
  } else {
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), more_likely);
  }
  if (params_.top_p < 1.0f) {
    double kept_mass = 0.0;
    for (int64_t r = 0; r < kept; ++r) kept_mass += p[order[r]];
    double before = 0.0;
    int64_t r = 0;
    for (; r < kept; ++r) {
      if (before / kept_mass >= params_.top_p) break;
      before += p[order[r]];
    }
    kept = r;
  }
  if (params_.min_p > 0.0f) {
    const double threshold = params_.min_p * p[order[0]];
    int64_t r = 1;
    while (r < kept && p[order[r]] >= threshold) ++r;
    kept = r;
  }
  std::vector<double> out(vocab, 0.0);
  double mass = 0.0;
  for (int64_t r = 0; r < kept; ++r) mass += p[order[r]];
  for (int64_t r = 0; r < kept; ++r) out[order[r]] = p[order[r]] / mass;
  return out;
}

SampledToken Sampler::Sample(std::span<const float> logits) {
  const std::vector<double> p = Distribution(logits);
  SampledToken token;
  if (params_.temperature == 0.0f) {
    token.id = ArgMax(p);
  } else {
    const double u = CounterUniform(seed_, position_);  // [0, 1)
    double cumulative = 0.0;
    token.id = -1;
    int32_t last_nonzero = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] <= 0.0) continue;
      last_nonzero = static_cast<int32_t>(i);
      cumulative += p[i];
      if (u < cumulative) {
        token.id = static_cast<int32_t>(i);
        break;
      }
    }
    if (token.id < 0) token.id = last_nonzero;  // u within rounding of 1
  }
  if (params_.logprobs || params_.top_logprobs > 0) {
    const float zmax = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (float z : logits) sum += std::exp(static_cast<double>(z) - zmax);
    const double log_z = zmax + std::log(sum);
    token.logprob = static_cast<float>(logits[token.id] - log_z);
    const int64_t n = std::min<int64_t>(params_.top_logprobs, logits.size());
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < n; ++i) {
      token.top_logprobs.push_back({order[i], static_cast<float>(logits[order[i]] - log_z)});
    }
  }
  Accept(token.id);
  return token;
}

}  // namespace exl3serve::worker
