// kernels/cpu/dense16_gemm.h: bf16 / fp16 weights against a float64
// reference on odd sizes, every ISA level bitwise equal to the scalar
// reference, thread-count and m invariance, poisoned outputs, exact
// 16-bit <-> float conversions.
#include "kernels/cpu/dense16_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"

namespace exl3serve::kernels::cpu {
namespace {

using Type = Dense16Type;

struct Case {
  std::vector<float> x;
  std::vector<uint16_t> w;
  std::vector<float> bias;
};

Case MakeCase(int64_t m, int64_t k, int64_t n, Type type, bool with_bias, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Case c;
  c.x.resize(m * k);
  for (float& v : c.x) v = normal(rng);
  std::vector<float> wf(n * k);
  for (float& v : wf) v = 0.05f * normal(rng);
  c.w.resize(wf.size());
  FloatToDense16(wf.data(), type, static_cast<int64_t>(wf.size()), c.w.data());
  if (with_bias) {
    c.bias.resize(n);
    for (float& v : c.bias) v = normal(rng);
  }
  return c;
}

std::vector<float> RunGemm(const Case& c, int64_t m, int64_t k, int64_t n, Type type,
                       int threads = 0) {
  // Poisoned, with a guard after the end that must stay untouched.
  std::vector<float> y(m * n + 7, std::numeric_limits<float>::quiet_NaN());
  Dense16GemmTransposed(c.x.data(), m, k, c.w.data(), type, n,
                        c.bias.empty() ? nullptr : c.bias.data(), y.data(), threads);
  for (size_t i = m * n; i < y.size(); ++i) EXPECT_TRUE(std::isnan(y[i])) << "guard " << i;
  y.resize(m * n);
  return y;
}

constexpr int64_t kMs[] = {1, 3, 17, 40};
constexpr int64_t kShapes[][2] = {{1, 1}, {7, 5}, {33, 19}, {129, 67}, {301, 131}, {1000, 13}};

TEST(Dense16Gemm, MatchesFloat64Reference) {
  for (Type type : {Type::kBf16, Type::kF16}) {
    for (int64_t m : kMs) {
      for (const auto& shape : kShapes) {
        const int64_t k = shape[0], n = shape[1];
        const Case c = MakeCase(m, k, n, type, /*with_bias=*/(k & 1) != 0, 7 * m + k + n);
        std::vector<float> wf(n * k);
        Dense16ToFloat(c.w.data(), type, n * k, wf.data());
        const std::vector<float> y = RunGemm(c, m, k, n, type);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t o = 0; o < n; ++o) {
            double ref = 0.0, mag = 0.0;
            for (int64_t j = 0; j < k; ++j) {
              ref += double{c.x[i * k + j]} * double{wf[o * k + j]};
              mag += std::abs(double{c.x[i * k + j]} * double{wf[o * k + j]});
            }
            if (!c.bias.empty()) {
              ref += c.bias[o];
              mag += std::abs(double{c.bias[o]});
            }
            // fp32 sums of <= k/16 + 5 terms per lane, then the lane tree.
            const double bound = (static_cast<double>(k) / 16 + 8) * 0x1p-24 * mag + 1e-30;
            ASSERT_TRUE(std::isfinite(y[i * n + o]));
            ASSERT_LE(std::abs(y[i * n + o] - ref), bound)
                << "type " << static_cast<int>(type) << " m " << m << " k " << k << " n " << n
                << " (" << i << ", " << o << ")";
          }
        }
      }
    }
  }
}

TEST(Dense16Gemm, EveryIsaMatchesScalarBitwise) {
  for (Type type : {Type::kBf16, Type::kF16}) {
    for (int64_t m : kMs) {
      for (const auto& shape : kShapes) {
        const int64_t k = shape[0], n = shape[1];
        const Case c = MakeCase(m, k, n, type, true, 11 * m + k);
        ASSERT_TRUE(SetCpuIsaOverride(CpuIsa::kScalar).ok());
        const std::vector<float> ref = RunGemm(c, m, k, n, type);
        for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
          if (!CpuSupportsIsa(isa)) {
            GTEST_LOG_(INFO) << "skipping " << CpuIsaName(isa) << ": not supported here";
            continue;
          }
          ASSERT_TRUE(SetCpuIsaOverride(isa).ok());
          const std::vector<float> y = RunGemm(c, m, k, n, type);
          ASSERT_EQ(0, std::memcmp(y.data(), ref.data(), sizeof(float) * y.size()))
              << CpuIsaName(isa) << " m " << m << " k " << k << " n " << n;
        }
        ASSERT_TRUE(SetCpuIsaOverride(std::nullopt).ok());
      }
    }
  }
}

TEST(Dense16Gemm, SameResultForAnyThreadCountAndRowCount) {
  const int64_t m = 40, k = 515, n = 397;  // several tasks (per task <= 96 outputs)
  for (Type type : {Type::kBf16, Type::kF16}) {
    const Case c = MakeCase(m, k, n, type, true, 3);
    const std::vector<float> one = RunGemm(c, m, k, n, type, 1);
    for (int threads : {2, 3, 0}) {
      const std::vector<float> y = RunGemm(c, m, k, n, type, threads);
      ASSERT_EQ(0, std::memcmp(y.data(), one.data(), sizeof(float) * y.size())) << threads;
    }
    // Row i alone (the decode path) equals row i of the batch.
    for (int64_t i : {int64_t{0}, int64_t{17}, m - 1}) {
      Case row;
      row.x.assign(c.x.begin() + i * k, c.x.begin() + (i + 1) * k);
      row.w = c.w;
      row.bias = c.bias;
      const std::vector<float> y = RunGemm(row, 1, k, n, type);
      ASSERT_EQ(0, std::memcmp(y.data(), &one[i * n], sizeof(float) * n)) << i;
    }
  }
}

TEST(Dense16Gemm, EmptyInputGivesBias) {
  Case c;
  c.bias = {1.5f, -2.0f, 0.25f};
  const std::vector<float> y = RunGemm(c, 2, 0, 3, Type::kBf16);
  EXPECT_EQ(y, (std::vector<float>{1.5f, -2.0f, 0.25f, 1.5f, -2.0f, 0.25f}));
}

TEST(Dense16Gemm, VectorConversionIsBitwiseTheScalarOneOnEveryPattern) {
  // Every 16-bit pattern (signalling NaNs included: the vector path must
  // not quiet them), converted from odd offsets and lengths so that both
  // the 8-lane body and the scalar tail run; the output is poisoned first.
  std::vector<uint16_t> bits(65536 + 13);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(i * 40503u + 7u);
  for (Type type : {Type::kBf16, Type::kF16}) {
    for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (!CpuSupportsIsa(isa)) {
        GTEST_LOG_(INFO) << "skipping " << CpuIsaName(isa) << ": not supported here";
        continue;
      }
      ASSERT_TRUE(SetCpuIsaOverride(isa).ok());
      for (int64_t offset : {0, 3}) {
        for (int64_t count : {int64_t{65536}, int64_t{7}, int64_t{8}, int64_t{29}}) {
          std::vector<float> ref(count), got(count, std::numeric_limits<float>::quiet_NaN());
          internal::Dense16ToFloatScalar(bits.data() + offset, type, count, ref.data());
          Dense16ToFloat(bits.data() + offset, type, count, got.data());
          ASSERT_EQ(std::memcmp(ref.data(), got.data(), sizeof(float) * count), 0)
              << CpuIsaName(isa) << " type " << static_cast<int>(type) << " offset " << offset
              << " count " << count;
        }
      }
    }
    ASSERT_TRUE(SetCpuIsaOverride(std::nullopt).ok());
  }
  // Every pattern is there (the multiplier is odd: a permutation mod 2^16).
  std::vector<uint8_t> seen(65536, 0);
  for (int i = 0; i < 65536; ++i) seen[bits[i]] = 1;
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 65536);
}

TEST(Dense16Gemm, ConversionsRoundTripEveryPattern) {
  for (Type type : {Type::kBf16, Type::kF16}) {
    std::vector<uint16_t> bits(65536), back(65536);
    for (int i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
    std::vector<float> f(65536);
    Dense16ToFloat(bits.data(), type, 65536, f.data());
    FloatToDense16(f.data(), type, 65536, back.data());
    for (int i = 0; i < 65536; ++i) {
      if (std::isnan(f[i])) {
        float g;
        Dense16ToFloat(&back[i], type, 1, &g);
        EXPECT_TRUE(std::isnan(g)) << i;
      } else {
        ASSERT_EQ(back[i], bits[i]) << "type " << static_cast<int>(type) << " pattern " << i;
      }
    }
  }
  // bf16 rounds to nearest even.
  const float v[] = {1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, 1.0f + 3 * 0x1p-8f};
  uint16_t out[3];
  FloatToDense16(v, Type::kBf16, 3, out);
  EXPECT_EQ(out[0], 0x3F80);  // tie -> even
  EXPECT_EQ(out[1], 0x3F81);
  EXPECT_EQ(out[2], 0x3F82);  // tie -> even (up)
}

}  // namespace
}  // namespace exl3serve::kernels::cpu
