// kernels/reconstruct.h against independent float64 dense algebra
// (exl3-format.md §3.1-3.2, §5.1-5.3, §5.5, §11).
//
// The reference here builds W_h from the states and the §3.2 lane formula,
// the Hadamard matrices densely from popcount, and multiplies explicitly, so
// it shares nothing with the code under test except ReadTileState and
// DecodeState (proven bit-exact by trellis_decode_test.cc).
#include "kernels/reconstruct.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels {
namespace {

// Tolerances, each relative to the natural scale of the compared value.
//
// Effective weight in double vs the dense product: two 7-level butterfly
// passes vs 128-term dot products, both in float64 (eps 1.1e-16); the
// per-element error divided by |suh[r]·svh[c]| is about 3e-15 (observed).
constexpr double kDoubleWeightTol = 1e-13;
// Effective weight in float: fp32 butterflies (eps 6e-8, 14 levels, partial
// sums up to ~15x the entry RMS before the 1/sqrt(128) scale), per element
// divided by |suh[r]·svh[c]|; observed worst about 1e-6.
constexpr double kFloatWeightTol = 2e-5;
// ReferenceForward (fp32 throughout, k up to 384 accumulated terms) vs the
// float64 dense x·W_eff + b, per output divided by ||x_i ⊙ suh||_2 · |svh[c]|
// (the size of y' = x'·W_h scaled by svh); the bias adds at most one fp32
// rounding, bounded by eps·|bias[c]|. Observed worst about 2e-6.
constexpr double kForwardTol = 2e-5;
constexpr double kFloatEps = 1.2e-7;  // bound on one fp32 rounding of the bias add
// Row shards: each rank's partial has the same error size as a full forward,
// and summing in fp32 adds one rounding per rank. Observed worst about 2e-6.
constexpr double kRowShardTol = 4e-5;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20240611u : static_cast<uint32_t>(seed);
}

const Codebook kCodebooks[] = {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1};

// A random linear plus its dense float64 W_h built independently.
struct TestLinear {
  Exl3LinearData data;
  std::vector<double> w_h;  // k x n, row-major
};

// §3.2 written out from the lane description: position j = 8·lane + u.
int ReferenceRow(int j) { return 2 * ((j / 8) % 4) + (j % 8) % 2 + 8 * (((j % 8) / 2) % 2); }
int ReferenceCol(int j) { return (j / 8) / 4 + 8 * ((j % 8) / 4); }

// Signs times scales of odd sizes (not powers of two), spanning 1e-2..2e1,
// with one exact zero (an all-zero channel, §10).
std::vector<float> RandomScales(std::mt19937& rng, int64_t size, int64_t zero_at) {
  std::uniform_real_distribution<double> log_magnitude(std::log(0.01), std::log(20.0));
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(size);
  for (int64_t i = 0; i < size; ++i) {
    const float magnitude = static_cast<float>(std::exp(log_magnitude(rng)));
    v[i] = negative(rng) ? -magnitude : magnitude;
  }
  if (zero_at >= 0 && zero_at < size) v[zero_at] = 0.0f;
  return v;
}

TestLinear RandomLinear(std::mt19937& rng, int64_t k, int64_t n, int bits, Codebook codebook,
                        bool with_bias) {
  TestLinear t;
  Exl3LinearData& d = t.data;
  d.k = k;
  d.n = n;
  d.bits = bits;
  d.codebook = codebook;
  const int64_t tiles_n = n / 16;
  d.trellis.resize((k / 16) * tiles_n * TileInt16Count(bits));
  std::uniform_int_distribution<int> word(0, 0xFFFF);
  for (uint16_t& v : d.trellis) v = static_cast<uint16_t>(word(rng));  // every pattern is valid
  d.suh = RandomScales(rng, k, 3);
  d.svh = RandomScales(rng, n, 5);
  if (with_bias) {
    std::normal_distribution<float> normal(0.0f, 2.0f);
    d.bias.resize(n);
    for (float& b : d.bias) b = normal(rng);
  }
  t.w_h.assign(k * n, 0.0);
  for (int64_t tk = 0; tk < k / 16; ++tk) {
    for (int64_t tn = 0; tn < tiles_n; ++tn) {
      const uint16_t* tile = d.trellis.data() + (tk * tiles_n + tn) * TileInt16Count(bits);
      for (int j = 0; j < kTileWeights; ++j) {
        const uint16_t half = DecodeState(codebook, ReadTileState(tile, bits, j));
        t.w_h[(16 * tk + ReferenceRow(j)) * n + 16 * tn + ReferenceCol(j)] = HalfBitsToFloat(half);
      }
    }
  }
  return t;
}

// Dense B_d from popcount: block-diagonal copies of H128/sqrt(128) (§5.1).
std::vector<double> DenseBlockHadamard(int64_t d) {
  std::vector<double> h(d * d, 0.0);
  const double scale = 1.0 / std::sqrt(128.0);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      if (i / 128 != j / 128) continue;
      const unsigned bits = static_cast<unsigned>((i % 128) & (j % 128));
      h[i * d + j] = (std::popcount(bits) % 2 == 0 ? 1.0 : -1.0) * scale;
    }
  }
  return h;
}

// (a x b) · (b x c), plain triple loop.
std::vector<double> MatMul(const std::vector<double>& x, const std::vector<double>& y, int64_t a,
                           int64_t b, int64_t c) {
  std::vector<double> out(a * c, 0.0);
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t p = 0; p < b; ++p) {
      const double v = x[i * b + p];
      if (v == 0.0) continue;
      for (int64_t j = 0; j < c; ++j) out[i * c + j] += v * y[p * c + j];
    }
  }
  return out;
}

// W_eff = diag(suh) · B_k · W_h · B_n · diag(svh), float64, dense (§5.2).
std::vector<double> DenseEffectiveWeight(const TestLinear& t) {
  const int64_t k = t.data.k;
  const int64_t n = t.data.n;
  std::vector<double> w = MatMul(DenseBlockHadamard(k), t.w_h, k, k, n);
  w = MatMul(w, DenseBlockHadamard(n), k, n, n);
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t c = 0; c < n; ++c) w[r * n + c] *= static_cast<double>(t.data.suh[r]) * t.data.svh[c];
  }
  return w;
}

std::vector<float> RandomInput(std::mt19937& rng, int64_t m, int64_t k) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(m * k);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<float> Forward(const Exl3LinearView& view, const std::vector<float>& x, int64_t m) {
  std::vector<float> y(m * view.n, -1.0f);
  const absl::Status status = ReferenceForward(view, x.data(), m, y.data());
  EXPECT_TRUE(status.ok()) << status;
  return y;
}

TEST(ReconstructTest, DecodedInnerMatrixPlacesEachPositionPerTheTilePermutation) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (Codebook codebook : kCodebooks) {
    for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
      SCOPED_TRACE(testing::Message() << CodebookName(codebook) << " K=" << bits);
      const TestLinear t = RandomLinear(rng, 128, 256, bits, codebook, false);
      std::vector<uint16_t> w_h(128 * 256);
      std::vector<float> w_h_float(128 * 256);
      ASSERT_TRUE(DecodeInnerMatrix(t.data.view(), w_h.data()).ok());
      ASSERT_TRUE(DecodeInnerMatrixFloat(t.data.view(), w_h_float.data()).ok());
      for (size_t i = 0; i < w_h.size(); ++i) {
        ASSERT_EQ(static_cast<double>(HalfBitsToFloat(w_h[i])), t.w_h[i]) << "element " << i;
        ASSERT_EQ(static_cast<double>(w_h_float[i]), t.w_h[i]) << "element " << i;
      }
    }
  }
}

TEST(ReconstructTest, EffectiveWeightMatchesDenseFloat64Product) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  struct Shape {
    int64_t k, n;
  };
  const Shape kShapes[] = {{256, 384}, {384, 128}};
  const int kBits[] = {1, 3, 5, 8};
  for (const Shape& shape : kShapes) {
    for (Codebook codebook : kCodebooks) {
      for (int bits : kBits) {
        SCOPED_TRACE(testing::Message() << shape.k << "x" << shape.n << " "
                                        << CodebookName(codebook) << " K=" << bits);
        const TestLinear t = RandomLinear(rng, shape.k, shape.n, bits, codebook, false);
        const std::vector<double> dense = DenseEffectiveWeight(t);
        std::vector<double> got_double(shape.k * shape.n);
        std::vector<float> got_float(shape.k * shape.n);
        ASSERT_TRUE(ReconstructEffectiveWeight(t.data.view(), got_double.data()).ok());
        ASSERT_TRUE(ReconstructEffectiveWeight(t.data.view(), got_float.data()).ok());
        double worst_double = 0.0;
        double worst_float = 0.0;
        for (int64_t r = 0; r < shape.k; ++r) {
          for (int64_t c = 0; c < shape.n; ++c) {
            const int64_t i = r * shape.n + c;
            const double scale = std::abs(static_cast<double>(t.data.suh[r]) * t.data.svh[c]);
            if (scale == 0.0) {  // a zero channel stays exactly zero
              ASSERT_EQ(got_double[i], 0.0);
              ASSERT_EQ(got_float[i], 0.0f);
              continue;
            }
            worst_double = std::max(worst_double, std::abs(got_double[i] - dense[i]) / scale);
            worst_float = std::max(worst_float, std::abs(got_float[i] - dense[i]) / scale);
          }
        }
        EXPECT_LE(worst_double, kDoubleWeightTol);
        EXPECT_LE(worst_float, kFloatWeightTol);
      }
    }
  }
}

TEST(ReconstructTest, ReferenceForwardMatchesDenseProductForOddRowCounts) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t k = 384;
  const int64_t n = 256;
  for (Codebook codebook : kCodebooks) {
    for (int bits : {2, 4, 6}) {
      const TestLinear t = RandomLinear(rng, k, n, bits, codebook, true);
      const std::vector<double> w_eff = DenseEffectiveWeight(t);
      for (int64_t m : {1, 3, 7}) {
        SCOPED_TRACE(testing::Message() << CodebookName(codebook) << " K=" << bits << " m=" << m);
        const std::vector<float> x = RandomInput(rng, m, k);
        const std::vector<float> y = Forward(t.data.view(), x, m);
        double worst = 0.0;
        for (int64_t i = 0; i < m; ++i) {
          double x_norm = 0.0;
          for (int64_t r = 0; r < k; ++r) {
            const double v = static_cast<double>(x[i * k + r]) * t.data.suh[r];
            x_norm += v * v;
          }
          x_norm = std::sqrt(x_norm);
          for (int64_t c = 0; c < n; ++c) {
            double want = t.data.bias[c];
            for (int64_t r = 0; r < k; ++r) want += static_cast<double>(x[i * k + r]) * w_eff[r * n + c];
            const double error = std::abs(y[i * n + c] - want) - kFloatEps * std::abs(t.data.bias[c]);
            const double scale = x_norm * std::abs(t.data.svh[c]);
            if (scale == 0.0) {
              ASSERT_EQ(y[i * n + c], t.data.bias[c]) << "zero channel " << c;
              continue;
            }
            worst = std::max(worst, error / scale);
          }
        }
        EXPECT_LE(worst, kForwardTol);
      }
    }
  }
}

TEST(ReconstructTest, ReferenceForwardAcceptsZeroRows) {
  std::mt19937 rng(TestSeed());
  const TestLinear t = RandomLinear(rng, 128, 128, 4, Codebook::kMul1, true);
  EXPECT_TRUE(ReferenceForward(t.data.view(), nullptr, 0, nullptr).ok());
  EXPECT_EQ(ReferenceForward(t.data.view(), nullptr, -1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReconstructTest, ColumnSlicesConcatenateToTheUnslicedOutputBitForBit) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t k = 256;
  const int64_t n = 512;
  const int64_t m = 3;
  const TestLinear t = RandomLinear(rng, k, n, 3, Codebook::kMcg, true);
  const std::vector<float> x = RandomInput(rng, m, k);
  const std::vector<float> y = Forward(t.data.view(), x, m);
  std::vector<float> w_eff(k * n);
  ASSERT_TRUE(ReconstructEffectiveWeight(t.data.view(), w_eff.data()).ok());

  const int64_t kCuts[] = {0, 128, 384, 384, 512};  // includes an empty shard
  for (int s = 0; s + 1 < 5; ++s) {
    const int64_t n0 = kCuts[s];
    const int64_t n1 = kCuts[s + 1];
    SCOPED_TRACE(testing::Message() << "columns [" << n0 << ", " << n1 << ")");
    absl::StatusOr<Exl3LinearData> shard = SliceColumns(t.data.view(), n0, n1);
    ASSERT_TRUE(shard.ok()) << shard.status();
    ASSERT_EQ(shard->k, k);
    ASSERT_EQ(shard->n, n1 - n0);
    ASSERT_EQ(shard->bias.size(), static_cast<size_t>(n1 - n0));
    const std::vector<float> y_shard = Forward(shard->view(), x, m);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t c = n0; c < n1; ++c) ASSERT_EQ(y_shard[i * (n1 - n0) + c - n0], y[i * n + c]);
    }
    std::vector<float> w_shard(k * (n1 - n0));
    ASSERT_TRUE(ReconstructEffectiveWeight(shard->view(), w_shard.data()).ok());
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = n0; c < n1; ++c) ASSERT_EQ(w_shard[r * (n1 - n0) + c - n0], w_eff[r * n + c]);
    }
  }
}

TEST(ReconstructTest, RowSlicesSumToTheUnslicedOutput) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t k = 512;
  const int64_t n = 256;
  const int64_t m = 7;
  const TestLinear t = RandomLinear(rng, k, n, 5, Codebook::k3Inst, true);
  const std::vector<float> x = RandomInput(rng, m, k);
  const std::vector<float> y = Forward(t.data.view(), x, m);
  std::vector<float> w_eff(k * n);
  ASSERT_TRUE(ReconstructEffectiveWeight(t.data.view(), w_eff.data()).ok());

  const int64_t kCuts[] = {0, 128, 128, 384, 512};  // includes an empty shard
  std::vector<float> y_sum(m * n, 0.0f);
  for (int s = 0; s + 1 < 5; ++s) {
    const int64_t k0 = kCuts[s];
    const int64_t k1 = kCuts[s + 1];
    SCOPED_TRACE(testing::Message() << "rows [" << k0 << ", " << k1 << ")");
    absl::StatusOr<Exl3LinearData> shard = SliceRows(t.data.view(), k0, k1);
    ASSERT_TRUE(shard.ok()) << shard.status();
    ASSERT_EQ(shard->k, k1 - k0);
    ASSERT_EQ(shard->n, n);
    EXPECT_EQ(shard->bias.empty(), k0 != 0) << "bias belongs to the rank with k0 = 0 only";
    std::vector<float> x_shard(m * (k1 - k0));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t r = k0; r < k1; ++r) x_shard[i * (k1 - k0) + r - k0] = x[i * k + r];
    }
    const std::vector<float> y_shard = Forward(shard->view(), x_shard, m);
    for (int64_t i = 0; i < m * n; ++i) y_sum[i] += y_shard[i];  // rank order
    std::vector<float> w_shard((k1 - k0) * n);
    ASSERT_TRUE(ReconstructEffectiveWeight(shard->view(), w_shard.data()).ok());
    for (int64_t r = k0; r < k1; ++r) {
      for (int64_t c = 0; c < n; ++c) ASSERT_EQ(w_shard[(r - k0) * n + c], w_eff[r * n + c]);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    double x_norm = 0.0;
    for (int64_t r = 0; r < k; ++r) {
      const double v = static_cast<double>(x[i * k + r]) * t.data.suh[r];
      x_norm += v * v;
    }
    x_norm = std::sqrt(x_norm);
    for (int64_t c = 0; c < n; ++c) {
      const double tolerance = kRowShardTol * x_norm * std::abs(t.data.svh[c]) +
                               4 * kFloatEps * std::abs(t.data.bias[c]);
      EXPECT_NEAR(y_sum[i * n + c], y[i * n + c], tolerance) << "row " << i << " col " << c;
    }
  }
}

TEST(ReconstructTest, InvalidViewsAndSlicesAreRejectedWithTheirValues) {
  std::mt19937 rng(TestSeed());
  const TestLinear t = RandomLinear(rng, 128, 256, 4, Codebook::kMul1, true);
  std::vector<uint16_t> w_h(128 * 256);

  Exl3LinearView view = t.data.view();
  view.k = 112;  // a multiple of 16 but not of 128
  absl::Status status = DecodeInnerMatrix(view, w_h.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("k=112"), std::string::npos) << status;

  view = t.data.view();
  view.bits = 9;
  status = ValidateExl3LinearView(view);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("got 9"), std::string::npos) << status;

  view = t.data.view();
  view.suh = nullptr;
  EXPECT_EQ(ValidateExl3LinearView(view).code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(SliceColumns(t.data.view(), 0, 192).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SliceColumns(t.data.view(), 128, 384).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SliceRows(t.data.view(), 128, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SliceRows(t.data.view(), 128, 128).ok());
}

}  // namespace
}  // namespace exl3serve::kernels
