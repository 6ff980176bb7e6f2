// kernels/trellis_gemm.h: every CPU variant against the scalar reference,
// kernels::ReferenceForward and a float64 dense product; thread-count
// invariance; the kInt8 path's error; argument errors.
#include "kernels/trellis_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_lut.h"
#include "tests/testing/random_linear.h"

namespace exl3serve::kernels {
namespace {

// Tolerances, per output divided by ||x_i ⊙ suh||_2 · |svh[c]| (the natural
// size of y' = x'·W_h after the orthogonal B_n, scaled by svh), as in
// reconstruct_test.cc.
// fp32 vs float64 or vs another fp32 accumulation order: k ≤ 512 terms of
// |w| < 4, fp32 butterflies on both sides; observed worst ~3e-6.
constexpr double kFloatTol = 3e-5;
// kInt8 vs kFloat: int8 activations (step max|x'|/127 per row and 128-block) and mul1
// without its fp16 rounding; RMS over all outputs relative to the RMS of the
// normalisation above (0.8-0.9 % of the output RMS on 4096-wide Gaussian x).
constexpr double kInt8RmsTol = 2.5e-2;
// kBf16 vs float64 and vs kFloat: both factors rounded to bf16 (relative
// error <= 2^-9 each); RMS relative to the same normalisation (measured
// 0.24 % mul1, 0.29-0.30 % 3inst/mcg, K=2..4, k = 1024) and worst output.
constexpr double kBf16RmsTol = 4e-3;
constexpr double kBf16WorstTol = 2e-2;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20250713u : static_cast<uint32_t>(seed);
}

using GemmFn = absl::Status (*)(const Exl3LinearView&, const float*, int64_t, float*,
                                const TrellisGemmOptions&);

struct Variant {
  const char* name;
  cpu::CpuIsa isa;
  GemmFn fn;
};
const Variant kVariants[] = {
    {"scalar", cpu::CpuIsa::kScalar, &cpu::scalar::TrellisGemm},
    {"avx2", cpu::CpuIsa::kAvx2, &cpu::avx2::TrellisGemm},
    {"avx512", cpu::CpuIsa::kAvx512, &cpu::avx512::TrellisGemm},
};
const Codebook kCodebooks[] = {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1};

using exl3serve::testing::RandomInput;
using exl3serve::testing::RandomLinear;

std::vector<float> RunGemm(GemmFn fn, const Exl3LinearView& view, const std::vector<float>& x,
                       int64_t m, TrellisGemmOptions options = {}) {
  std::vector<float> y(static_cast<size_t>(m * view.n), std::numeric_limits<float>::quiet_NaN());
  const absl::Status s = fn(view, x.data(), m, y.data(), options);
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

// Per-output normaliser ||x_i ⊙ suh||_2 · |svh[c]| (+1 so zero channels still
// compare against an absolute bound).
double Norm(const Exl3LinearView& view, const std::vector<float>& x, int64_t i, int64_t c) {
  double s = 0;
  for (int64_t r = 0; r < view.k; ++r) {
    const double v = double(x[i * view.k + r]) * view.suh[r];
    s += v * v;
  }
  return std::sqrt(s) * std::fabs(view.svh[c]) + 1e-3;
}

void ExpectClose(const Exl3LinearView& view, const std::vector<float>& x, int64_t m,
                 const std::vector<float>& got, const std::vector<float>& want, double tol,
                 const std::string& what) {
  double worst = 0;
  int64_t worst_at = -1;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < view.n; ++c) {
      const double g = got[i * view.n + c];
      const double w = want[i * view.n + c];
      const double bias = view.bias ? std::fabs(view.bias[c]) * 2e-7 : 0.0;
      const double err = std::isfinite(g) ? std::fabs(g - w) / (Norm(view, x, i, c) + bias) : 1e30;
      if (err > worst) {
        worst = err;
        worst_at = i * view.n + c;
      }
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst relative error at flat index " << worst_at
                        << " (got " << got[worst_at] << ", want " << want[worst_at]
                        << "), seed " << TestSeed();
}

std::vector<float> DenseFloat64(const Exl3LinearView& view, const std::vector<float>& x,
                                int64_t m) {
  std::vector<double> w(static_cast<size_t>(view.k * view.n));
  EXPECT_TRUE(ReconstructEffectiveWeight(view, w.data()).ok());
  std::vector<float> y(static_cast<size_t>(m * view.n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < view.n; ++c) {
      double s = view.bias ? view.bias[c] : 0.0;
      for (int64_t r = 0; r < view.k; ++r) s += double(x[i * view.k + r]) * w[r * view.n + c];
      y[i * view.n + c] = static_cast<float>(s);
    }
  }
  return y;
}

struct Shape {
  int64_t k, n;
};
const Shape kShapes[] = {{128, 128}, {256, 384}, {384, 128}};
const int64_t kRowCounts[] = {1, 3, 5, 17, 33, 130};

TEST(TrellisGemmTest, ScalarMatchesReferenceForwardAndFloat64) {
  std::mt19937 rng(TestSeed());
  for (Codebook cb : kCodebooks) {
    for (int bits = 1; bits <= 8; ++bits) {
      const Shape shape = kShapes[bits % 3];
      const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, cb, bits % 2 == 0);
      const Exl3LinearView view = d.view();
      const int64_t m = kRowCounts[bits % 6];
      const std::vector<float> x = RandomInput(rng, m, shape.k);
      const std::vector<float> got = RunGemm(&cpu::scalar::TrellisGemm, view, x, m);
      std::vector<float> ref(static_cast<size_t>(m * shape.n));
      ASSERT_TRUE(ReferenceForward(view, x.data(), m, ref.data()).ok());
      const std::string what = std::string(CodebookName(cb)) + " K=" + std::to_string(bits) +
                               " m=" + std::to_string(m);
      ExpectClose(view, x, m, got, ref, kFloatTol, what + " vs ReferenceForward");
      ExpectClose(view, x, m, got, DenseFloat64(view, x, m), kFloatTol, what + " vs float64");
    }
  }
}

TEST(TrellisGemmTest, EverySimdVariantMatchesScalar) {
  for (const Variant& v : kVariants) {
    if (v.isa == cpu::CpuIsa::kScalar) continue;
    if (!cpu::CpuSupportsIsa(v.isa)) {
      std::printf("[  SKIPPED ] %s: this CPU lacks it\n", v.name);
      continue;
    }
    std::mt19937 rng(TestSeed());
    for (Codebook cb : kCodebooks) {
      for (int bits = 1; bits <= 8; ++bits) {
        for (const Shape& shape : kShapes) {
          const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, cb, true);
          const Exl3LinearView view = d.view();
          for (int64_t m : kRowCounts) {
            const std::vector<float> x = RandomInput(rng, m, shape.k);
            const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, m);
            const std::vector<float> got = RunGemm(v.fn, view, x, m);
            ExpectClose(view, x, m, got, want, kFloatTol,
                        std::string(v.name) + " " + CodebookName(cb) + " K=" +
                            std::to_string(bits) + " " + std::to_string(shape.k) + "x" +
                            std::to_string(shape.n) + " m=" + std::to_string(m));
          }
        }
      }
    }
  }
}

TEST(TrellisGemmTest, ResultsAreBitIdenticalForAnyThreadCount) {
  std::mt19937 rng(TestSeed());
  const Exl3LinearData d = RandomLinear(rng, 256, 1024, 3, Codebook::kMul1, true);
  const Exl3LinearView view = d.view();
  for (const Variant& v : kVariants) {
    if (!cpu::CpuSupportsIsa(v.isa)) continue;
    for (int64_t m : {1, 5, 17, 130}) {
      const std::vector<float> x = RandomInput(rng, m, view.k);
      for (TrellisGemmPrecision p : {TrellisGemmPrecision::kFloat, TrellisGemmPrecision::kInt8,
                                     TrellisGemmPrecision::kBf16}) {
        TrellisGemmOptions one;
        one.max_threads = 1;
        one.precision = p;
        TrellisGemmOptions all;
        all.precision = p;
        TrellisGemmOptions two = all;
        two.max_threads = 2;
        const std::vector<float> a = RunGemm(v.fn, view, x, m, one);
        const std::vector<float> b = RunGemm(v.fn, view, x, m, two);
        const std::vector<float> c = RunGemm(v.fn, view, x, m, all);
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
            << v.name << " m=" << m << " precision " << int(p);
        EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)))
            << v.name << " m=" << m << " precision " << int(p);
      }
    }
  }
}

// kInt8 is what tensor parallelism relies on: a rank of a row-parallel
// linear holds whole 128-row blocks of k, and each block's int8 activations
// and scale depend on that block's inputs alone, so the ranks' partial
// outputs sum to the whole linear's output up to fp32 summation order (with
// one scale per row, each part was quantized on its own scale: ~1 % apart).
TEST(TrellisGemmTest, Int8RowSplitAtBlocksSumsToTheWholeLinear) {
  std::mt19937 rng(TestSeed());
  for (int bits : {2, 4}) {
    const int64_t k = 640, n = 256;  // 5 blocks of k
    const Exl3LinearData d = RandomLinear(rng, k, n, bits, Codebook::kMul1, false);
    const Exl3LinearView whole = d.view();
    for (int64_t m : {1, 5}) {
      std::vector<float> x = RandomInput(rng, m, k);
      // One row with a large outlier in the last block: a shared row scale
      // would crush the first blocks' resolution.
      x[k - 3] *= 40.0f;
      TrellisGemmOptions int8;
      int8.precision = TrellisGemmPrecision::kInt8;
      for (const Variant& v : kVariants) {
        if (!cpu::CpuSupportsIsa(v.isa)) continue;
        const std::vector<float> y = RunGemm(v.fn, whole, x, m, int8);
        for (int64_t split : {1, 2, 4}) {  // blocks [0, split) and [split, 5)
          std::vector<float> sum(static_cast<size_t>(m * n), 0.0f);
          for (auto [b0, b1] : {std::pair<int64_t, int64_t>{0, split}, {split, 5}}) {
            Exl3LinearView part = whole;
            part.k = (b1 - b0) * 128;
            part.trellis = whole.trellis + b0 * 8 * (n / 16) * 16 * bits;
            part.suh = whole.suh + b0 * 128;
            std::vector<float> xs(static_cast<size_t>(m * part.k));
            for (int64_t i = 0; i < m; ++i) {
              std::copy_n(&x[i * k + b0 * 128], part.k, &xs[i * part.k]);
            }
            const std::vector<float> ys = RunGemm(v.fn, part, xs, m, int8);
            for (size_t j = 0; j < sum.size(); ++j) sum[j] += ys[j];
          }
          double worst = 0;
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t c = 0; c < n; ++c) {
              worst = std::max(worst, std::abs(double(sum[i * n + c]) - y[i * n + c]) /
                                          Norm(whole, x, i, c));
            }
          }
          EXPECT_LE(worst, 1e-5) << v.name << " K=" << bits << " m=" << m << " split=" << split;
        }
      }
    }
  }
}

TEST(TrellisGemmTest, Int8PathIsCloseToFloatAndIdenticalAcrossVariants) {
  std::mt19937 rng(TestSeed());
  for (int bits : {1, 2, 3, 4, 5, 8}) {
    const Exl3LinearData d = RandomLinear(rng, 384, 256, bits, Codebook::kMul1, false);
    const Exl3LinearView view = d.view();
    for (int64_t m : {1, 3, 17}) {
      const std::vector<float> x = RandomInput(rng, m, view.k);
      TrellisGemmOptions int8;
      int8.precision = TrellisGemmPrecision::kInt8;
      const std::vector<float> fp = RunGemm(&cpu::scalar::TrellisGemm, view, x, m);
      const std::vector<float> ref = RunGemm(&cpu::scalar::TrellisGemm, view, x, m, int8);
      double err2 = 0, norm2 = 0;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t c = 0; c < view.n; ++c) {
          const double e = double(ref[i * view.n + c]) - fp[i * view.n + c];
          err2 += e * e;
          const double nn = Norm(view, x, i, c);
          norm2 += nn * nn;
        }
      }
      EXPECT_LE(std::sqrt(err2 / norm2), kInt8RmsTol) << "K=" << bits << " m=" << m;
      for (const Variant& v : kVariants) {
        if (v.isa == cpu::CpuIsa::kScalar || !cpu::CpuSupportsIsa(v.isa)) continue;
        const std::vector<float> got = RunGemm(v.fn, view, x, m, int8);
        EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)))
            << v.name << " K=" << bits << " m=" << m;
      }
    }
  }
}

// The AVX-512 variant has two mul1 GEMV paths for K <= 4: the column-sliced
// one (VBMI/VBMI2 CPUs, trellis_gemm_gemv_avx512icl.cc, what the tests above
// run here) and the 32-bit-lane one (AVX-512 CPUs without VBMI2). Run the
// latter too, against scalar (kFloat) and bit for bit (kInt8), odd m.
TEST(TrellisGemmTest, Avx512FallbackGemvWithoutVbmi2MatchesScalar) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  if (!cpu::avx512icl::Supported()) GTEST_SKIP() << "no VBMI2: the fallback is the only path";
  std::mt19937 rng(TestSeed());
  cpu::avx512icl::SetEnabledForTest(false);
  for (int bits = 1; bits <= 4; ++bits) {
    const Exl3LinearData d = RandomLinear(rng, 256, 384, bits, Codebook::kMul1, true);
    const Exl3LinearView view = d.view();
    for (int64_t m : {1, 3, 5, 7}) {
      const std::vector<float> x = RandomInput(rng, m, view.k);
      const std::string what = "K=" + std::to_string(bits) + " m=" + std::to_string(m);
      ExpectClose(view, x, m, RunGemm(&cpu::avx512::TrellisGemm, view, x, m),
                  RunGemm(&cpu::scalar::TrellisGemm, view, x, m), kFloatTol, what);
      TrellisGemmOptions int8;
      int8.precision = TrellisGemmPrecision::kInt8;
      const std::vector<float> got = RunGemm(&cpu::avx512::TrellisGemm, view, x, m, int8);
      const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, m, int8);
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << what;
    }
  }
  cpu::avx512icl::SetEnabledForTest(true);
}

// RMS over all outputs of (got - want), relative to the RMS normaliser.
double RelativeRms(const Exl3LinearView& view, const std::vector<float>& x, int64_t m,
                   const std::vector<float>& got, const std::vector<float>& want) {
  double err2 = 0, norm2 = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < view.n; ++c) {
      const double e = double(got[i * view.n + c]) - want[i * view.n + c];
      err2 += std::isfinite(e) ? e * e : 1e30;
      const double nn = Norm(view, x, i, c);
      norm2 += nn * nn;
    }
  }
  return std::sqrt(err2 / norm2);
}

// kBf16 cases: odd m (row groups of 6 and AMX blocks of 32 with remainders).
struct Bf16Case {
  Codebook cb;
  int bits;
  int64_t k, n, m;
};
constexpr Bf16Case kBf16Cases[] = {
    {Codebook::kMul1, 2, 256, 384, 17},  {Codebook::kMul1, 4, 640, 256, 129},
    {Codebook::kMul1, 3, 128, 128, 513}, {Codebook::k3Inst, 2, 256, 128, 5},
    {Codebook::kMcg, 5, 128, 256, 33},   {Codebook::kMul1, 8, 256, 128, 1},
    {Codebook::kMul1, 1, 256, 256, 7}};

// kBf16: the scalar reference emulates vdpbf16ps; every variant (AVX-512 with
// the BF16 instruction, AVX-512 with its FMA emulation, AVX2) must match it
// bit for bit, for odd m, any thread count. (AMX is off here: next test.)
TEST(TrellisGemmTest, Bf16IsBitIdenticalToScalarAcrossVariantsAndThreads) {
  std::mt19937 rng(TestSeed());
  cpu::avx512bf16::SetAmxEnabledForTest(false);
  for (const Bf16Case& cs : kBf16Cases) {
    const Exl3LinearData d = RandomLinear(rng, cs.k, cs.n, cs.bits, cs.cb, cs.bits % 2 == 0);
    const Exl3LinearView view = d.view();
    const std::vector<float> x = RandomInput(rng, cs.m, cs.k);
    const std::string what = std::string(CodebookName(cs.cb)) + " K=" + std::to_string(cs.bits) +
                             " m=" + std::to_string(cs.m);
    TrellisGemmOptions bf16;
    bf16.precision = TrellisGemmPrecision::kBf16;
    const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, cs.m, bf16);
    for (float v : want) ASSERT_TRUE(std::isfinite(v)) << what;
    ExpectClose(view, x, cs.m, want, DenseFloat64(view, x, cs.m), kBf16WorstTol, what + " vs float64");
    for (const Variant& v : kVariants) {
      if (v.isa == cpu::CpuIsa::kScalar || !cpu::CpuSupportsIsa(v.isa)) continue;
      for (bool native : {true, false}) {
        if (native && v.isa == cpu::CpuIsa::kAvx512 && !cpu::avx512bf16::Supported()) {
          std::printf("[  SKIPPED ] %s vdpbf16ps: this CPU lacks AVX512-BF16\n", v.name);
          continue;
        }
        cpu::avx512bf16::SetEnabledForTest(native);
        for (int threads : {1, 2, 0}) {
          TrellisGemmOptions o = bf16;
          o.max_threads = threads;
          const std::vector<float> got = RunGemm(v.fn, view, x, cs.m, o);
          EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
              << v.name << (native ? " native " : " emulated ") << what << " threads " << threads;
        }
      }
      cpu::avx512bf16::SetEnabledForTest(true);
    }
  }
  cpu::avx512bf16::SetAmxEnabledForTest(true);
}

// The AMX-BF16 kernel: same bf16 inputs, the hardware's own fp32 summation
// order, so within fp32 accumulation error of the scalar kBf16 reference, and
// bit-identical for any thread count.
TEST(TrellisGemmTest, Bf16AmxMatchesScalarWithinFp32ErrorAndIsThreadInvariant) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512) || !cpu::avx512bf16::AmxSupported()) {
    GTEST_SKIP() << "no AMX-BF16 (CPU, OS tile state or the kernel's XTILEDATA permission)";
  }
  std::mt19937 rng(TestSeed());
  for (const Bf16Case& cs : kBf16Cases) {
    const Exl3LinearData d = RandomLinear(rng, cs.k, cs.n, cs.bits, cs.cb, true);
    const Exl3LinearView view = d.view();
    const std::vector<float> x = RandomInput(rng, cs.m, cs.k);
    const std::string what = std::string(CodebookName(cs.cb)) + " K=" + std::to_string(cs.bits) +
                             " m=" + std::to_string(cs.m);
    TrellisGemmOptions bf16;
    bf16.precision = TrellisGemmPrecision::kBf16;
    const std::vector<float> want = RunGemm(&cpu::scalar::TrellisGemm, view, x, cs.m, bf16);
    bf16.max_threads = 1;
    const std::vector<float> one = RunGemm(&cpu::avx512::TrellisGemm, view, x, cs.m, bf16);
    ExpectClose(view, x, cs.m, one, want, kFloatTol, what + " AMX vs scalar kBf16");
    for (int threads : {2, 0}) {
      bf16.max_threads = threads;
      const std::vector<float> got = RunGemm(&cpu::avx512::TrellisGemm, view, x, cs.m, bf16);
      EXPECT_EQ(0, std::memcmp(got.data(), one.data(), got.size() * sizeof(float)))
          << what << " threads " << threads;
    }
  }
}

// kBf16 error against float64 and the fp32 path on Gaussian inputs, K = 2..4;
// prints the measured RMS (the figure quoted in trellis_gemm.h).
TEST(TrellisGemmTest, Bf16ErrorIsBounded) {
  std::mt19937 rng(TestSeed());
  for (Codebook cb : kCodebooks) {
    for (int bits : {2, 3, 4}) {
      const Exl3LinearData d = RandomLinear(rng, 1024, 256, bits, cb, false);
      const Exl3LinearView view = d.view();
      const int64_t m = 19;
      const std::vector<float> x = RandomInput(rng, m, view.k);
      TrellisGemmOptions bf16;
      bf16.precision = TrellisGemmPrecision::kBf16;
      const std::vector<float> got = RunGemm(&TrellisGemm, view, x, m, bf16);
      const std::vector<float> fp32 = RunGemm(&TrellisGemm, view, x, m);
      const std::vector<float> exact = DenseFloat64(view, x, m);
      const double vs_fp32 = RelativeRms(view, x, m, got, fp32);
      const double vs_exact = RelativeRms(view, x, m, got, exact);
      std::printf("kBf16 %s K=%d: RMS error %.3g %% vs fp32, %.3g %% vs float64 (fp32: %.3g %%)\n",
                  CodebookName(cb), bits, 100 * vs_fp32, 100 * vs_exact,
                  100 * RelativeRms(view, x, m, fp32, exact));
      EXPECT_LE(vs_exact, kBf16RmsTol) << CodebookName(cb) << " K=" << bits;
      EXPECT_LE(vs_fp32, kBf16RmsTol) << CodebookName(cb) << " K=" << bits;
      ExpectClose(view, x, m, got, exact, kBf16WorstTol,
                  std::string(CodebookName(cb)) + " K=" + std::to_string(bits) + " worst");
    }
  }
}

// The packing rounding: RNE, ties to even, bf16 subnormals flushed, NaN kept.
TEST(TrellisGemmTest, FloatToBf16RoundsToNearestEven) {
  using cpu::internal::FloatToBf16;
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3F80);              // tie -> even
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3F82);          // tie -> even (up)
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);   // above the tie
  EXPECT_EQ(FloatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBf16(0x1p-127f), 0x0000);                   // subnormal -> +0
  EXPECT_EQ(FloatToBf16(-0x1p-127f), 0x8000);                  // -> -0
  EXPECT_EQ(FloatToBf16(3.4e38f), 0x7F80);                     // rounds to inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::quiet_NaN()) & 0x7FC0, 0x7FC0);
}

// The SIMD mul1 weight formula (Veltkamp RNE in fp32, no fp16 conversion)
// against the fp16 table value, exhaustively over every byte sum t.
TEST(TrellisGemmTest, SimdMul1WeightIsExactForEveryByteSum) {
  std::vector<int32_t> t(1024);
  for (int i = 0; i < 1024; ++i) t[i] = std::min(i, 1020);
  std::vector<float> want(1024);
  for (int i = 0; i < 1024; ++i) {
    // DecodeState of a state with this byte sum: search the table once.
    want[i] = std::numeric_limits<float>::quiet_NaN();
  }
  const CodebookTable& table = GetCodebookTable(Codebook::kMul1);
  std::vector<bool> seen(1021, false);
  for (uint32_t s = 0; s < 65536; ++s) {
    const uint32_t bt = Mul1ByteSum(static_cast<uint16_t>(s));
    if (!seen[bt]) {
      seen[bt] = true;
      want[bt] = table.value[s];
    }
  }
  // Byte sums no state reaches: the exact definition (§4.3), RNE via double.
  for (int i = 0; i <= 1020; ++i) {
    if (seen[i]) continue;
    const uint16_t h = FloatToHalfBits(static_cast<float>(1774 * i - 905216) * 3.814697265625e-6f);
    want[i] = HalfBitsToFloat(h);
  }
  for (int i = 1021; i < 1024; ++i) want[i] = want[1020];
  struct Hook {
    const char* name;
    cpu::CpuIsa isa;
    void (*fn)(const int32_t*, int64_t, float*);
  };
  for (const Hook& h : {Hook{"avx2", cpu::CpuIsa::kAvx2, &cpu::avx2::Mul1WeightsForTest},
                        Hook{"avx512", cpu::CpuIsa::kAvx512, &cpu::avx512::Mul1WeightsForTest}}) {
    if (!cpu::CpuSupportsIsa(h.isa)) continue;
    std::vector<float> got(1024, std::numeric_limits<float>::quiet_NaN());
    h.fn(t.data(), 1024, got.data());
    for (int i = 0; i <= 1020; ++i) {
      EXPECT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
          << h.name << " t=" << i << " got " << got[i] << " want " << want[i];
    }
  }
}

TEST(TrellisGemmTest, EmptyInnerDimensionGivesBias) {
  std::mt19937 rng(TestSeed());
  const Exl3LinearData d = RandomLinear(rng, 0, 128, 2, Codebook::kMcg, true);
  for (const Variant& v : kVariants) {
    if (!cpu::CpuSupportsIsa(v.isa)) continue;
    const std::vector<float> y = RunGemm(v.fn, d.view(), {}, 2);
    for (int64_t i = 0; i < 2 * 128; ++i) EXPECT_EQ(y[i], d.bias[i % 128]) << v.name;
  }
}

TEST(TrellisGemmTest, RejectsBadArgumentsWithoutTouchingY) {
  std::mt19937 rng(TestSeed());
  const Exl3LinearData d = RandomLinear(rng, 128, 128, 2, Codebook::kMcg, false);
  std::vector<float> x(128), y(128, 7.0f);
  EXPECT_EQ(TrellisGemm(d.view(), x.data(), -1, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TrellisGemm(d.view(), nullptr, 1, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  TrellisGemmOptions int8;
  int8.precision = TrellisGemmPrecision::kInt8;
  EXPECT_EQ(TrellisGemm(d.view(), x.data(), 1, y.data(), int8).code(),
            absl::StatusCode::kInvalidArgument);
  Exl3LinearView bad = d.view();
  bad.bits = 9;
  EXPECT_EQ(TrellisGemm(bad, x.data(), 1, y.data()).code(), absl::StatusCode::kInvalidArgument);
  for (float v : y) EXPECT_EQ(v, 7.0f);
}

TEST(TrellisGemmTest, DispatcherFollowsTheIsaOverride) {
  std::mt19937 rng(TestSeed());
  const Exl3LinearData d = RandomLinear(rng, 256, 256, 4, Codebook::k3Inst, true);
  const std::vector<float> x = RandomInput(rng, 3, 256);
  for (const Variant& v : kVariants) {
    if (!cpu::CpuSupportsIsa(v.isa)) {
      GTEST_LOG_(INFO) << "skipping " << v.name << ": this CPU lacks it";
      continue;
    }
    ASSERT_TRUE(cpu::SetCpuIsaOverride(v.isa).ok());
    const std::vector<float> via_dispatch = RunGemm(&TrellisGemm, d.view(), x, 3);
    const std::vector<float> direct = RunGemm(v.fn, d.view(), x, 3);
    EXPECT_EQ(0, std::memcmp(via_dispatch.data(), direct.data(), direct.size() * sizeof(float)))
        << v.name;
  }
  ASSERT_TRUE(cpu::SetCpuIsaOverride(std::nullopt).ok());
}

TEST(TrellisGemmTest, Avx512VariantRunsWhenAvailable) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512 F/BW/VL/DQ";
  SUCCEED();
}

TEST(TrellisGemmTest, Avx2VariantRunsWhenAvailable) {
  if (!cpu::CpuSupportsIsa(cpu::CpuIsa::kAvx2)) GTEST_SKIP() << "this CPU lacks AVX2+FMA+F16C+BMI2";
  SUCCEED();
}

}  // namespace
}  // namespace exl3serve::kernels
