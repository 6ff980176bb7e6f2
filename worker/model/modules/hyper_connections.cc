#include "worker/model/modules/hyper_connections.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace exl3serve::worker {
namespace {

constexpr int kLanes = 16;

// Σ a[i]·b[i] in 16 lanes (lane i % 16), combined 16 → 8 → 4 → 2 → 1.
float LaneDot(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += a[i + l] * b[i + l];
  }
  for (int64_t t = i; t < n; ++t) lane[t - i] += a[t] * b[t];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  }
  return lane[0];
}

float Sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// One token's split and Sinkhorn normalisation of its mix values m.
void SplitMix(const HyperConnectionShape& shape, const HyperConnectionSite& site, const float* m,
              float* pre, float* post, float* comb) {
  const int h = shape.streams;
  const float eps = shape.hc_eps;
  for (int j = 0; j < h; ++j) {
    pre[j] = Sigmoid(m[j] * site.scale[0] + site.base[j]) + eps;
    post[j] = 2.0f * Sigmoid(m[h + j] * site.scale[1] + site.base[h + j]);
  }
  for (int a = 0; a < h; ++a) {
    float* row = comb + a * h;
    float max_logit = -INFINITY;
    for (int b = 0; b < h; ++b) {
      row[b] = m[2 * h + h * a + b] * site.scale[2] + site.base[2 * h + h * a + b];
      max_logit = std::max(max_logit, row[b]);
    }
    float sum = 0.0f;
    for (int b = 0; b < h; ++b) {
      row[b] = std::exp(row[b] - max_logit);
      sum += row[b];
    }
    for (int b = 0; b < h; ++b) row[b] = row[b] / sum + eps;
  }
  auto divide_columns = [&] {
    for (int b = 0; b < h; ++b) {
      float sum = 0.0f;
      for (int a = 0; a < h; ++a) sum += comb[a * h + b];
      const float d = sum + eps;
      for (int a = 0; a < h; ++a) comb[a * h + b] /= d;
    }
  };
  divide_columns();
  for (int iter = 1; iter < shape.sinkhorn_iters; ++iter) {
    for (int a = 0; a < h; ++a) {
      float sum = 0.0f;
      for (int b = 0; b < h; ++b) sum += comb[a * h + b];
      const float d = sum + eps;
      for (int b = 0; b < h; ++b) comb[a * h + b] /= d;
    }
    divide_columns();
  }
}

}  // namespace

absl::Status ComputeHyperConnectionMix(const HyperConnectionShape& shape,
                                       const HyperConnectionSite& site, const float* x,
                                       int64_t rows, HyperConnectionMix* mix) {
  if (shape.streams < 1 || shape.hidden < 1 || shape.sinkhorn_iters < 1 || rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hyper-connections: streams (", shape.streams, "), hidden (", shape.hidden,
        ") and sinkhorn_iters (", shape.sinkhorn_iters, ") must be >= 1 and rows (", rows,
        ") >= 0"));
  }
  const int64_t values = shape.mix_values();
  const int64_t width = shape.streams * shape.hidden;
  const auto check = [](const char* name, std::span<const float> s, int64_t want) {
    return static_cast<int64_t>(s.size()) == want
               ? absl::OkStatus()
               : absl::InvalidArgumentError(absl::StrCat("hyper-connections: ", name, " has ",
                                                         s.size(), " values, expected ", want));
  };
  if (absl::Status s = check("fn", site.fn, values * width); !s.ok()) return s;
  if (absl::Status s = check("base", site.base, values); !s.ok()) return s;
  if (absl::Status s = check("scale", site.scale, 3); !s.ok()) return s;
  if (rows > 0 && x == nullptr) {
    return absl::InvalidArgumentError("hyper-connections: x is null");
  }
  const int h = shape.streams;
  mix->pre.resize(static_cast<size_t>(rows * h));
  mix->post.resize(static_cast<size_t>(rows * h));
  mix->comb.resize(static_cast<size_t>(rows * h * h));
  std::vector<float> m(static_cast<size_t>(values));
  for (int64_t r = 0; r < rows; ++r) {
    const float* f = x + r * width;
    const float inv_rms =
        1.0f / std::sqrt(LaneDot(f, f, width) / static_cast<float>(width) + shape.norm_eps);
    for (int64_t v = 0; v < values; ++v) {
      m[v] = LaneDot(site.fn.data() + v * width, f, width) * inv_rms;
    }
    SplitMix(shape, site, m.data(), &mix->pre[r * h], &mix->post[r * h], &mix->comb[r * h * h]);
  }
  return absl::OkStatus();
}

void CollapseStreams(const HyperConnectionShape& shape, const float* pre, const float* x,
                     int64_t rows, float* out) {
  const int h = shape.streams;
  const int64_t d = shape.hidden;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * d;
    const float* xr = x + r * h * d;
    for (int64_t c = 0; c < d; ++c) o[c] = pre[r * h] * xr[c];
    for (int j = 1; j < h; ++j) {
      const float w = pre[r * h + j];
      for (int64_t c = 0; c < d; ++c) o[c] += w * xr[j * d + c];
    }
  }
}

void ExpandStreams(const HyperConnectionShape& shape, const HyperConnectionMix& mix,
                   const float* y, int64_t rows, float* x) {
  const int h = shape.streams;
  const int64_t d = shape.hidden;
  std::vector<float> residual(static_cast<size_t>(h * d));
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * h * d;
    std::copy(xr, xr + h * d, residual.begin());
    const float* yr = y + r * d;
    const float* comb = &mix.comb[r * h * h];
    for (int b = 0; b < h; ++b) {
      float* o = xr + b * d;
      const float post = mix.post[r * h + b];
      for (int64_t c = 0; c < d; ++c) o[c] = post * yr[c];
      for (int a = 0; a < h; ++a) {
        const float w = comb[a * h + b];
        for (int64_t c = 0; c < d; ++c) o[c] += w * residual[a * d + c];
      }
    }
  }
}

}  // namespace exl3serve::worker
