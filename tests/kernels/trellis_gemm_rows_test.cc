// kernels/trellis_gemm.h at every GEMV row count: the mul1 K <= 4 GEMV
// (kernels/cpu/trellis_gemm_gemv_avx512icl.cc on VBMI2 CPUs) runs passes of
// up to 16 (kInt8) / 8 (kFloat) rows that decode each tile once, with the
// tiles per pass chosen from the rows (8, 4, 2 or 1) and, for kInt8 passes of
// >= 3 rows, a different MAC form (vpdpwssd on byte sums instead of vpdpbusd
// on bytes). Every m = 1..16 (and a few multi-pass m) therefore runs its own
// code; all must equal the scalar reference bit for bit (kInt8: exact int32
// sums), for odd shapes, K = 1..4, any thread count, with every output
// written (outputs poisoned first), and the 32-bit-lane fallback
// (avx512icl::SetEnabledForTest(false)) too. K = 5..8 (real checkpoints'
// 6- and 8-bit heads) and the fallback at 5+ rows run the strip form
// (trellis_gemm_avx512.cc GemvStripsInt8: each tile decoded once into a
// buffer, rows in groups of 8 over it; a 1152-deep shape is 72 rows of
// tiles, so two strips of 64 and 8). kFloat: within fp32 accumulation
// error of the scalar reference, and a row's result does not depend on the
// rows it shares a pass with (bitwise equal to the row alone).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/trellis_gemm.h"
#include "tests/testing/random_linear.h"

namespace exl3serve::kernels {
namespace {

using exl3serve::testing::RandomInput;
using exl3serve::testing::RandomLinear;

// kFloat vs the scalar reference, per output divided by ||x_i ⊙ suh||_2 ·
// |svh[c]| (as trellis_gemm_test.cc): k <= 1024 terms of |w| < 4.
constexpr double kFloatTol = 3e-5;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20261203u : static_cast<uint32_t>(seed);
}

struct Shape {
  int64_t k, n;
};
// (k, n multiples of 128.) One column block of 8 rows of tiles; 24 rows of
// tiles x 5 column blocks; 72 rows of tiles x 2 blocks.
constexpr Shape kShapes[] = {{128, 128}, {384, 640}, {1152, 256}};

std::vector<int64_t> RowCounts() {
  std::vector<int64_t> ms;
  for (int64_t m = 1; m <= 16; ++m) ms.push_back(m);
  for (int64_t m : {17, 20, 33}) ms.push_back(m);  // several passes
  return ms;
}

// y poisoned with `poison` bytes, so an output a kernel does not write shows.
using GemmFn = absl::Status (*)(const Exl3LinearView&, const float*, int64_t, float*,
                                const TrellisGemmOptions&);

std::vector<float> RunGemm(GemmFn fn, const Exl3LinearView& view, const std::vector<float>& x,
                           int64_t m, TrellisGemmPrecision precision, int threads,
                           uint8_t poison) {
  std::vector<float> y(static_cast<size_t>(m * view.n));
  std::memset(y.data(), poison, y.size() * sizeof(float));
  TrellisGemmOptions options;
  options.precision = precision;
  options.max_threads = threads;
  const absl::Status s = fn(view, x.data(), m, y.data(), options);
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double WorstRelativeError(const Exl3LinearView& view, const std::vector<float>& x, int64_t m,
                          const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0;
  for (int64_t i = 0; i < m; ++i) {
    double norm = 0;
    for (int64_t r = 0; r < view.k; ++r) {
      const double v = double(x[i * view.k + r]) * view.suh[r];
      norm += v * v;
    }
    norm = std::sqrt(norm);
    for (int64_t c = 0; c < view.n; ++c) {
      const double g = got[i * view.n + c];
      const double bias = view.bias == nullptr ? 0.0 : std::fabs(view.bias[c]) * 2e-7;
      const double err = std::isfinite(g) ? std::fabs(g - want[i * view.n + c]) /
                                                (norm * std::fabs(view.svh[c]) + 1e-3 + bias)
                                          : 1e30;
      worst = std::max(worst, err);
    }
  }
  return worst;
}

// The AVX-512 variant (VBMI2 GEMV when the CPU has it, else the 32-bit-lane
// one) and the AVX2 variant against the scalar reference, every m.
void CheckInt8AllRows(const char* path) {
  std::mt19937 rng(TestSeed());
  for (const Shape& shape : kShapes) {
    for (int bits = 1; bits <= 8; ++bits) {
      const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, Codebook::kMul1,
                                            bits % 2 == 1);
      const Exl3LinearView view = d.view();
      for (int64_t m : RowCounts()) {
        const std::vector<float> x = RandomInput(rng, m, view.k);
        const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, m,
                                            TrellisGemmPrecision::kInt8, 1, 0x00);
        const std::string what = std::string(path) + " " + std::to_string(shape.k) + "x" +
                                 std::to_string(shape.n) + " K=" + std::to_string(bits) +
                                 " m=" + std::to_string(m);
        for (int threads : {1, 2, 0}) {
          if (cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512)) {
            EXPECT_TRUE(BitEqual(RunGemm(&cpu::avx512::TrellisGemm, view, x, m,
                                     TrellisGemmPrecision::kInt8, threads, 0xFF),
                                 want))
                << "avx512 " << what << " threads " << threads << ", seed " << TestSeed();
          }
        }
        if (cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx2)) {
          EXPECT_TRUE(BitEqual(RunGemm(&cpu::avx2::TrellisGemm, view, x, m,
                                   TrellisGemmPrecision::kInt8, 2, 0xFF),
                               want))
              << "avx2 " << what << ", seed " << TestSeed();
        }
      }
    }
  }
}

TEST(TrellisGemmRowsTest, Int8IsBitIdenticalToScalarForEveryRowCount) {
  CheckInt8AllRows(cpu::avx512icl::Supported() ? "vbmi2" : "no-vbmi2");
}

TEST(TrellisGemmRowsTest, Int8FallbackWithoutVbmi2IsBitIdenticalForEveryRowCount) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  if (!cpu::avx512icl::Supported()) GTEST_SKIP() << "no VBMI2: the previous test ran it";
  cpu::avx512icl::SetEnabledForTest(false);
  CheckInt8AllRows("fallback");
  cpu::avx512icl::SetEnabledForTest(true);
}

TEST(TrellisGemmRowsTest, FloatMatchesScalarAndEachRowAlone) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  std::mt19937 rng(TestSeed());
  for (const Shape& shape : kShapes) {
    for (int bits = 1; bits <= 4; ++bits) {
      const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, Codebook::kMul1,
                                            bits % 2 == 0);
      const Exl3LinearView view = d.view();
      for (int64_t m = 1; m <= 16; ++m) {  // the GEMV range (kGemvMaxRows)
        const std::vector<float> x = RandomInput(rng, m, view.k);
        const std::string what = std::to_string(shape.k) + "x" + std::to_string(shape.n) +
                                 " K=" + std::to_string(bits) + " m=" + std::to_string(m);
        const std::vector<float> got = RunGemm(&cpu::avx512::TrellisGemm, view, x, m,
                                           TrellisGemmPrecision::kFloat, 2, 0xFF);
        const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, m,
                                            TrellisGemmPrecision::kFloat, 1, 0x00);
        EXPECT_LE(WorstRelativeError(view, x, m, got, want), kFloatTol)
            << what << ", seed " << TestSeed();
        if (!cpu::avx512icl::Supported()) continue;
        // Rows of a pass never interact: each row's sums run in the same
        // order as when it is alone (passes of 1 row).
        for (int64_t i = 0; i < m; i += 3) {
          const std::vector<float> xi(x.begin() + i * view.k, x.begin() + (i + 1) * view.k);
          const std::vector<float> alone = RunGemm(&cpu::avx512::TrellisGemm, view, xi, 1,
                                               TrellisGemmPrecision::kFloat, 1, 0x00);
          EXPECT_EQ(0, std::memcmp(alone.data(), got.data() + i * view.n,
                                   view.n * sizeof(float)))
              << what << " row " << i << ", seed " << TestSeed();
        }
      }
    }
  }
}

}  // namespace
}  // namespace exl3serve::kernels
