// Hyper-connections (DeepSeek-V4.1 mHC) against a float64 reference written
// here from the formulas (hyper_connections.h), on odd sizes: mixes, split,
// Sinkhorn, collapse and expand; batch independence; bad parameters refused.
#include "worker/model/modules/hyper_connections.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::worker {
namespace {

struct Params {
  std::vector<float> fn, base, scale;
  HyperConnectionSite site() const { return {fn, base, scale}; }
};

Params RandomParams(const HyperConnectionShape& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> small(0.0f, 0.05f), unit(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.5f, 2.0f);
  Params p;
  p.fn.resize(static_cast<size_t>(shape.mix_values() * shape.streams * shape.hidden));
  for (float& v : p.fn) v = small(rng);
  p.base.resize(static_cast<size_t>(shape.mix_values()));
  for (float& v : p.base) v = unit(rng);
  p.scale = {scale(rng), scale(rng), scale(rng)};
  return p;
}

std::vector<float> RandomStreams(const HyperConnectionShape& shape, int64_t rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * shape.streams * shape.hidden));
  for (float& v : x) v = unit(rng);
  return x;
}

// The float64 reference of one token: pre, post, comb from its stack f.
struct RefMix {
  std::vector<double> pre, post, comb;
};
RefMix Reference(const HyperConnectionShape& shape, const Params& p, const float* f) {
  const int h = shape.streams;
  const int64_t width = h * shape.hidden;
  double sq = 0;
  for (int64_t i = 0; i < width; ++i) sq += double(f[i]) * f[i];
  const double inv_rms = 1.0 / std::sqrt(sq / width + shape.norm_eps);
  std::vector<double> m(static_cast<size_t>(shape.mix_values()));
  for (size_t v = 0; v < m.size(); ++v) {
    double dot = 0;
    for (int64_t i = 0; i < width; ++i) dot += double(p.fn[v * width + i]) * f[i];
    m[v] = dot * inv_rms;
  }
  const double eps = shape.hc_eps;
  auto sigmoid = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  RefMix r;
  for (int j = 0; j < h; ++j) {
    r.pre.push_back(sigmoid(m[j] * p.scale[0] + p.base[j]) + eps);
    r.post.push_back(2.0 * sigmoid(m[h + j] * p.scale[1] + p.base[h + j]));
  }
  std::vector<std::vector<double>> c(h, std::vector<double>(h));
  for (int a = 0; a < h; ++a) {
    double sum = 0;
    for (int b = 0; b < h; ++b) {
      c[a][b] = std::exp(m[2 * h + h * a + b] * p.scale[2] + p.base[2 * h + h * a + b]);
      sum += c[a][b];
    }
    for (int b = 0; b < h; ++b) c[a][b] = c[a][b] / sum + eps;
  }
  auto columns = [&] {
    for (int b = 0; b < h; ++b) {
      double s = 0;
      for (int a = 0; a < h; ++a) s += c[a][b];
      for (int a = 0; a < h; ++a) c[a][b] /= s + eps;
    }
  };
  columns();
  for (int it = 1; it < shape.sinkhorn_iters; ++it) {
    for (int a = 0; a < h; ++a) {
      double s = 0;
      for (int b = 0; b < h; ++b) s += c[a][b];
      for (int b = 0; b < h; ++b) c[a][b] /= s + eps;
    }
    columns();
  }
  for (int a = 0; a < h; ++a) {
    for (int b = 0; b < h; ++b) r.comb.push_back(c[a][b]);
  }
  return r;
}

class HyperConnectionsTest : public ::testing::TestWithParam<std::tuple<int, int64_t, int64_t>> {};

TEST_P(HyperConnectionsTest, MatchesTheFloat64Reference) {
  const auto [streams, hidden, rows] = GetParam();
  HyperConnectionShape shape{.streams = streams, .hidden = hidden};
  const Params p = RandomParams(shape, 7 + streams);
  const std::vector<float> x = RandomStreams(shape, rows, 11 + static_cast<uint32_t>(hidden));
  HyperConnectionMix mix;
  ASSERT_TRUE(ComputeHyperConnectionMix(shape, p.site(), x.data(), rows, &mix).ok());
  const int h = streams;
  const int64_t d = hidden;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const RefMix ref = Reference(shape, p, &x[r * h * d]);
    for (int j = 0; j < h; ++j) {
      worst = std::max(worst, std::abs(mix.pre[r * h + j] - ref.pre[j]));
      worst = std::max(worst, std::abs(mix.post[r * h + j] - ref.post[j]));
    }
    for (int i = 0; i < h * h; ++i) {
      worst = std::max(worst, std::abs(mix.comb[r * h * h + i] - ref.comb[i]));
    }
    // Sinkhorn ends with a column normalisation: columns sum to ~1.
    for (int b = 0; b < h; ++b) {
      double column = 0;
      for (int a = 0; a < h; ++a) column += mix.comb[r * h * h + a * h + b];
      EXPECT_NEAR(column, 1.0, 1e-4) << "row " << r << " column " << b;
    }
  }
  std::printf("H=%d d=%lld rows=%lld: largest |mix - float64| %.3g\n", h,
              static_cast<long long>(d), static_cast<long long>(rows), worst);
  EXPECT_LE(worst, 2e-6);  // measured 0.5-2.7e-7

  // Collapse and expand against float64 on the same mix.
  std::vector<float> collapsed(static_cast<size_t>(rows * d),
                               std::numeric_limits<float>::quiet_NaN());
  CollapseStreams(shape, mix.pre.data(), x.data(), rows, collapsed.data());
  std::vector<float> y(static_cast<size_t>(rows * d));
  for (size_t i = 0; i < y.size(); ++i) y[i] = std::sin(0.37 * static_cast<double>(i));
  std::vector<float> expanded = x;
  ExpandStreams(shape, mix, y.data(), rows, expanded.data());
  double worst_collapse = 0, worst_expand = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      double want = 0;
      for (int j = 0; j < h; ++j) want += double(mix.pre[r * h + j]) * x[(r * h + j) * d + c];
      ASSERT_TRUE(std::isfinite(collapsed[r * d + c]));
      worst_collapse = std::max(worst_collapse, std::abs(collapsed[r * d + c] - want));
      for (int b = 0; b < h; ++b) {
        double out = double(mix.post[r * h + b]) * y[r * d + c];
        for (int a = 0; a < h; ++a) {
          out += double(mix.comb[r * h * h + a * h + b]) * x[(r * h + a) * d + c];
        }
        worst_expand = std::max(worst_expand, std::abs(expanded[(r * h + b) * d + c] - out));
      }
    }
  }
  EXPECT_LE(worst_collapse, 1e-5);
  EXPECT_LE(worst_expand, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(OddShapes, HyperConnectionsTest,
                         ::testing::Values(std::make_tuple(4, int64_t{37}, int64_t{3}),
                                           std::make_tuple(3, int64_t{16}, int64_t{2}),
                                           std::make_tuple(4, int64_t{129}, int64_t{5}),
                                           std::make_tuple(1, int64_t{9}, int64_t{1})));

TEST(HyperConnectionsTest, EachTokenMixesAsItWouldAlone) {
  HyperConnectionShape shape{.streams = 4, .hidden = 53};
  const Params p = RandomParams(shape, 3);
  const int64_t rows = 5;
  const std::vector<float> x = RandomStreams(shape, rows, 5);
  HyperConnectionMix all;
  ASSERT_TRUE(ComputeHyperConnectionMix(shape, p.site(), x.data(), rows, &all).ok());
  const int64_t width = shape.streams * shape.hidden;
  for (int64_t r = 0; r < rows; ++r) {
    HyperConnectionMix one;
    ASSERT_TRUE(ComputeHyperConnectionMix(shape, p.site(), &x[r * width], 1, &one).ok());
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(one.pre[j], all.pre[r * 4 + j]);
      EXPECT_EQ(one.post[j], all.post[r * 4 + j]);
    }
    for (int i = 0; i < 16; ++i) EXPECT_EQ(one.comb[i], all.comb[r * 16 + i]);
  }
}

TEST(HyperConnectionsTest, RefusesParametersOfTheWrongShape) {
  HyperConnectionShape shape{.streams = 4, .hidden = 8};
  Params p = RandomParams(shape, 1);
  const std::vector<float> x = RandomStreams(shape, 1, 2);
  HyperConnectionMix mix;
  p.fn.pop_back();
  absl::Status s = ComputeHyperConnectionMix(shape, p.site(), x.data(), 1, &mix);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("fn"), std::string::npos) << s;
  p = RandomParams(shape, 1);
  p.scale.push_back(1.0f);
  s = ComputeHyperConnectionMix(shape, p.site(), x.data(), 1, &mix);
  EXPECT_NE(s.message().find("scale"), std::string::npos) << s;
  p = RandomParams(shape, 1);
  shape.sinkhorn_iters = 0;
  EXPECT_EQ(ComputeHyperConnectionMix(shape, p.site(), x.data(), 1, &mix).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::worker
