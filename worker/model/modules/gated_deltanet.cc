#include "worker/model/modules/gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"

namespace exl3serve::worker {
namespace {

inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// PyTorch's softplus (β = 1, threshold 20: linear above).
inline float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// x / sqrt(Σx² + 1e-6) over n values, times `scale`, in place.
void L2Normalize(float* x, int64_t n, float scale) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(sum + 1e-6));
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GatedDeltaNet>> GatedDeltaNet::Load(
    const WeightLoader& weights, const ModelContext& context, int l,
    const sharding::LayerShard& part) {
  const sharding::ModelArch& arch = weights.arch();
  EXL3_RETURN_IF_ERROR(
      CheckShardRange(part.linear_key_heads, arch.gdn_key_heads, "linear-attention key heads"));
  std::unique_ptr<GatedDeltaNet> m(new GatedDeltaNet());
  m->context_ = context;
  const int64_t hk = arch.gdn_key_heads, hv = arch.gdn_value_heads;
  const int64_t dk = arch.gdn_key_dim, dv = arch.gdn_value_dim, g = hv / hk;
  const int64_t kh0 = part.linear_key_heads.begin, kh1 = part.linear_key_heads.end;
  m->nk_ = kh1 - kh0;
  m->g_ = g;
  m->nv_ = m->nk_ * g;
  m->dk_ = dk;
  m->dv_ = dv;
  m->kernel_ = arch.gdn_conv_kernel;
  m->fused_ = arch.gdn_fused_projections;
  if (m->nk_ == 0) return m;  // no heads here: outputs zeros, keeps no state

  using sharding::IndexRange;
  using sharding::LinearRole;
  const IndexRange all_hidden{0, arch.hidden_size};
  const std::string prefix = arch.LayerPrefix(l) + ".linear_attn";
  if (m->fused_) {
    // Rows grouped per key head: [q (dk), k (dk), v (G·dv), z (G·dv)] and [b (G), a (G)].
    const int64_t group = 2 * dk + 2 * g * dv;
    EXL3_ASSIGN_OR_RETURN(m->qkvz_, weights.LoadLinearWindow(l, LinearRole::kGdnQkvz, all_hidden,
                                                             {kh0 * group, kh1 * group}));
    EXL3_ASSIGN_OR_RETURN(m->ba_, weights.LoadLinearWindow(l, LinearRole::kGdnBa, all_hidden,
                                                           {kh0 * 2 * g, kh1 * 2 * g}));
  } else {
    // Flat: in_proj_qkv rows [Q (Hk·dk) | K (Hk·dk) | V (Hv·dv)].
    const int64_t key = hk * dk;
    EXL3_ASSIGN_OR_RETURN(m->q_, weights.LoadLinearWindow(l, LinearRole::kGdnQkv, all_hidden,
                                                          {kh0 * dk, kh1 * dk}));
    EXL3_ASSIGN_OR_RETURN(m->k_, weights.LoadLinearWindow(l, LinearRole::kGdnQkv, all_hidden,
                                                          {key + kh0 * dk, key + kh1 * dk}));
    EXL3_ASSIGN_OR_RETURN(m->v_, weights.LoadLinearWindow(
                                     l, LinearRole::kGdnQkv, all_hidden,
                                     {2 * key + kh0 * g * dv, 2 * key + kh1 * g * dv}));
    EXL3_ASSIGN_OR_RETURN(m->z_, weights.LoadLinearWindow(l, LinearRole::kGdnZ, all_hidden,
                                                          {kh0 * g * dv, kh1 * g * dv}));
    EXL3_ASSIGN_OR_RETURN(m->b_, weights.LoadLinearWindow(l, LinearRole::kGdnB, all_hidden,
                                                          {kh0 * g, kh1 * g}));
    EXL3_ASSIGN_OR_RETURN(m->a_, weights.LoadLinearWindow(l, LinearRole::kGdnA, all_hidden,
                                                          {kh0 * g, kh1 * g}));
  }
  EXL3_ASSIGN_OR_RETURN(m->out_, weights.LoadLinearWindow(l, LinearRole::kGdnOut,
                                                          {kh0 * g * dv, kh1 * g * dv}, all_hidden));

  // The conv taps of this rank's Q, K and V channels (flat [Q | K | V] in
  // both layouts), as [local channel][K].
  const int64_t kernel = m->kernel_;
  EXL3_ASSIGN_OR_RETURN(std::vector<float> conv,
                        weights.LoadTensor(prefix + ".conv1d.weight", {arch.gdn_conv_dim(), 1, kernel}));
  m->conv_.resize(static_cast<size_t>(m->conv_channels() * kernel));
  int64_t local = 0;
  auto take = [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c, ++local) {
      std::memcpy(&m->conv_[local * kernel], &conv[c * kernel], sizeof(float) * kernel);
    }
  };
  take(kh0 * dk, kh1 * dk);
  take(hk * dk + kh0 * dk, hk * dk + kh1 * dk);
  take(2 * hk * dk + kh0 * g * dv, 2 * hk * dk + kh1 * g * dv);

  EXL3_ASSIGN_OR_RETURN(std::vector<float> a_log, weights.LoadVector(prefix + ".A_log", hv));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> dt_bias, weights.LoadVector(prefix + ".dt_bias", hv));
  for (int64_t h = kh0 * g; h < kh1 * g; ++h) {
    m->neg_a_.push_back(-std::exp(a_log[h]));
    m->dt_bias_.push_back(dt_bias[h]);
  }
  EXL3_ASSIGN_OR_RETURN(m->norm_, weights.LoadVector(prefix + ".norm.weight", dv));
  return m;
}

void GatedDeltaNet::ForEachLinear(const std::function<void(Linear&)>& fn) {
  for (Linear* l : {&qkvz_, &ba_, &q_, &k_, &v_, &z_, &b_, &a_, &out_}) fn(*l);
}

absl::Status GatedDeltaNet::Project(const StepBatch& step, const float* x, float* mixed, float* z,
                                    float* b, float* a) const {
  const int64_t total = step.total;
  const int64_t channels = conv_channels();
  const int64_t key = nk_ * dk_, value = nv_ * dv_;
  if (fused_) {
    const int64_t group = 2 * dk_ + 2 * g_ * dv_;
    std::vector<float> qkvz(static_cast<size_t>(total * nk_ * group));
    std::vector<float> ba(static_cast<size_t>(total * nk_ * 2 * g_));
    EXL3_RETURN_IF_ERROR(qkvz_.Forward(x, total, qkvz.data(), step.plan));
    EXL3_RETURN_IF_ERROR(ba_.Forward(x, total, ba.data(), step.plan));
    for (int64_t t = 0; t < total; ++t) {
      float* row = mixed + t * channels;
      for (int64_t j = 0; j < nk_; ++j) {
        const float* src = &qkvz[(t * nk_ + j) * group];
        std::memcpy(row + j * dk_, src, sizeof(float) * dk_);
        std::memcpy(row + key + j * dk_, src + dk_, sizeof(float) * dk_);
        std::memcpy(row + 2 * key + j * g_ * dv_, src + 2 * dk_, sizeof(float) * g_ * dv_);
        std::memcpy(z + t * value + j * g_ * dv_, src + 2 * dk_ + g_ * dv_,
                    sizeof(float) * g_ * dv_);
        const float* bas = &ba[(t * nk_ + j) * 2 * g_];
        std::memcpy(b + t * nv_ + j * g_, bas, sizeof(float) * g_);
        std::memcpy(a + t * nv_ + j * g_, bas + g_, sizeof(float) * g_);
      }
    }
    return absl::OkStatus();
  }
  std::vector<float> part(static_cast<size_t>(total * std::max(key, value)));
  auto place = [&](const Linear& linear, int64_t width, int64_t offset) -> absl::Status {
    EXL3_RETURN_IF_ERROR(linear.Forward(x, total, part.data(), step.plan));
    for (int64_t t = 0; t < total; ++t) {
      std::memcpy(mixed + t * channels + offset, &part[t * width], sizeof(float) * width);
    }
    return absl::OkStatus();
  };
  EXL3_RETURN_IF_ERROR(place(q_, key, 0));
  EXL3_RETURN_IF_ERROR(place(k_, key, key));
  EXL3_RETURN_IF_ERROR(place(v_, value, 2 * key));
  EXL3_RETURN_IF_ERROR(z_.Forward(x, total, z, step.plan));
  EXL3_RETURN_IF_ERROR(b_.Forward(x, total, b, step.plan));
  return a_.Forward(x, total, a, step.plan);
}

absl::Status GatedDeltaNet::Forward(const StepBatch& step, const float* x, PagedKvCache* cache,
                                    float* out) const {
  const int64_t hidden = context_.config->arch.hidden_size;
  const int64_t total = step.total;
  if (nk_ == 0) {  // no heads here: nothing to add
    std::fill(out, out + total * hidden, 0.0f);
    return absl::OkStatus();
  }
  const int64_t channels = conv_channels();
  const int64_t key = nk_ * dk_, value = nv_ * dv_;
  std::vector<float> mixed(static_cast<size_t>(total * channels));
  std::vector<float> z(static_cast<size_t>(total * value));
  std::vector<float> b(static_cast<size_t>(total * nv_)), a(b.size());
  EXL3_RETURN_IF_ERROR(Project(step, x, mixed.data(), z.data(), b.data(), a.data()));

  const float eps = static_cast<float>(context_.config->rms_norm_eps);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk_));
  kernels::cpu::ThreadPool& pool = kernels::cpu::SharedThreadPool();
  std::vector<float> y(static_cast<size_t>(total * value));  // gated-norm output, out_proj's input
  int64_t row0 = 0;
  for (size_t e = 0; e < step.batch.size(); ++e) {
    const int64_t n = static_cast<int64_t>(step.batch[e].tokens.size());
    float* conv_state = cache->State(step.batch[e].seq_id, state_slot_);
    float* matrices = conv_state + conv_floats();
    // Causal depthwise conv over [last K−1 inputs ; the n new ones], SiLU.
    const int64_t history = kernel_ - 1;
    std::vector<float> ext(static_cast<size_t>((history + n) * channels));
    std::memcpy(ext.data(), conv_state, sizeof(float) * history * channels);
    std::memcpy(ext.data() + history * channels, &mixed[row0 * channels],
                sizeof(float) * n * channels);
    std::vector<float> act(static_cast<size_t>(n * channels));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < channels; ++c) {
        const float* w = &conv_[c * kernel_];
        float sum = 0.0f;
        for (int64_t j = 0; j < kernel_; ++j) sum += w[j] * ext[(t + j) * channels + c];
        act[t * channels + c] = Silu(sum);
      }
    }
    std::memcpy(conv_state, ext.data() + n * channels, sizeof(float) * history * channels);
    // Speculative verification: the state after each token (conv window now,
    // the matrices in the recurrence below).
    float* kept = cache->StateHistory(step.batch[e].seq_id, state_slot_, step.starts[e]);
    const int64_t kept_stride = cache->shape().state_floats_per_sequence();
    if (kept != nullptr) {
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(kept + t * kept_stride, ext.data() + (t + 1) * channels,
                    sizeof(float) * history * channels);
      }
    }
    // q̂, k̂ per key head; β and g (the log of the decay) per value head.
    std::vector<float> gate(static_cast<size_t>(n * nv_)), beta(gate.size());
    for (int64_t t = 0; t < n; ++t) {
      float* row = &act[t * channels];
      for (int64_t j = 0; j < nk_; ++j) {
        L2Normalize(row + j * dk_, dk_, q_scale);
        L2Normalize(row + key + j * dk_, dk_, 1.0f);
      }
      for (int64_t h = 0; h < nv_; ++h) {
        const int64_t i = (row0 + t) * nv_ + h;
        beta[t * nv_ + h] = Sigmoid(b[i]);
        gate[t * nv_ + h] = neg_a_[h] * Softplus(a[i] + dt_bias_[h]);
      }
    }
    // The recurrence, each value head on its own (its own state).
    std::vector<float> o(static_cast<size_t>(n * value));
    const int64_t head_floats = kernels::GatedDeltaHeadStateFloats(dk_, dv_);
    const int64_t position = step.starts[e];
    pool.ParallelFor(nv_, 0, [&](int64_t h, int) {
      const int64_t j = h / g_;  // its key head
      kernels::GatedDeltaChunked(
          position, n, dk_, dv_, &act[j * dk_], channels, &act[key + j * dk_], channels,
          &act[2 * key + h * dv_], channels, &gate[h], &beta[h], nv_, matrices + h * head_floats,
          &o[h * dv_], value,
          kept == nullptr ? nullptr : kept + conv_floats() + h * head_floats, kept_stride);
    });
    // Gated RMSNorm per value head (plain weight), then SiLU(z).
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < nv_; ++h) {
        const float* oh = &o[t * value + h * dv_];
        double ss = 0.0;
        for (int64_t d = 0; d < dv_; ++d) ss += static_cast<double>(oh[d]) * oh[d];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dv_) + eps));
        const float* zh = &z[(row0 + t) * value + h * dv_];
        float* yh = &y[(row0 + t) * value + h * dv_];
        for (int64_t d = 0; d < dv_; ++d) yh[d] = norm_[d] * (oh[d] * inv) * Silu(zh[d]);
      }
    }
    row0 += n;
  }
  return out_.Forward(y.data(), total, out, step.plan);
}

}  // namespace exl3serve::worker
