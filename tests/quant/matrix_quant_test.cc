// Tests of the matrix-level quantizer: Hessian finalisation, block LDL,
// LDLQ error feedback, regularisation round trip and QuantizeLinear's
// reported errors (exl3-format.md §6.2-6.6).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/hadamard.h"
#include "sharding/quant/hessian.h"
#include "sharding/quant/ldlq.h"
#include "sharding/quant/quantize_linear.h"
#include "sharding/quant/regularize.h"
#include "sharding/quant/tile_quantizer.h"
#include "sharding/quant/worker_pool.h"

namespace exl3serve::sharding::quant {
namespace {

uint32_t TestSeed() { return static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed()); }

std::vector<float> Gaussian(std::mt19937& rng, int64_t count, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& x : v) x = static_cast<float>(normal(rng));
  return v;
}

// Calibration-like inputs with strongly correlated channels: x = z · M with
// a random mixing matrix M (k x k) plus a few loud channels.
HessianAccumulator CorrelatedHessian(std::mt19937& rng, int64_t k, int64_t rows) {
  const std::vector<float> mix = Gaussian(rng, k * k, 1.0 / std::sqrt(static_cast<double>(k)));
  HessianAccumulator acc(k);
  std::vector<float> x(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> z = Gaussian(rng, k);
    for (int64_t j = 0; j < k; ++j) {
      double s = 0.0;
      for (int64_t t = 0; t < 8; ++t) s += z[(j + t) % k] * (1.0 + mix[j * k + t]);
      x[j] = static_cast<float>(s * (j % 37 == 0 ? 6.0 : 1.0));
    }
    acc.Add(x.data(), 1, k);
  }
  return acc;
}

TEST(HessianTest, FinalizeSignalsFallbackWithoutData) {
  HessianAccumulator acc(128);
  auto h = FinalizeHessian(acc);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->fallback);
  std::vector<float> zeros(128 * 4, 0.0f);
  acc.Add(zeros.data(), 4, 128);
  h = FinalizeHessian(acc);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->fallback);  // mean diag < 1e-20
}

TEST(HessianTest, DropsNonFiniteRowsAndDamps) {
  HessianAccumulator acc(128);
  std::vector<float> x(128 * 2, 1.0f);
  x[130] = NAN;
  acc.Add(x.data(), 2, 128);
  EXPECT_EQ(acc.count(), 1);
  EXPECT_EQ(acc.dropped_rows(), 1);
  auto h = FinalizeHessian(acc);  // rank-1 H: needs the damping to be PD
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->fallback);
  EXPECT_FLOAT_EQ(h->h[0], 1.0f + 0.025f);
}

TEST(HessianTest, BlockLdlReconstructsH) {
  const uint32_t seed = TestSeed();
  std::mt19937 rng(seed);
  const int64_t k = 128;
  auto fin = FinalizeHessian(CorrelatedHessian(rng, k, 512));
  ASSERT_TRUE(fin.ok());
  std::vector<float> l(k * k), d(k / 16 * 256);
  WorkerPool pool(2);
  ASSERT_TRUE(BlockLdl(fin->h.data(), k, l.data(), d.data(), &pool));
  // Restore the unit diagonal blocks, then compare L·D·Lᵀ with H.
  std::vector<double> full(k * k, 0.0);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < k; ++j) full[i * k + j] = (i / 16 == j / 16) ? (i == j) : l[i * k + j];
    for (int64_t j = i / 16 * 16; j < k; ++j) {
      EXPECT_EQ(l[i * k + j], 0.0f);
    }
  }
  double max_rel = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      double s = 0.0;
      for (int64_t b = 0; b < k / 16; ++b) {
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 16; ++c) {
            s += full[i * k + 16 * b + r] * d[b * 256 + r * 16 + c] * full[j * k + 16 * b + c];
          }
        }
      }
      max_rel = std::max(max_rel, std::fabs(s - fin->h[i * k + j]) / fin->mean_diag);
    }
  }
  EXPECT_LT(max_rel, 1e-4) << "seed=" << seed;
}

TEST(RegularizeTest, RoundTripReproducesWBeforeQuantization) {
  const uint32_t seed = TestSeed();
  std::mt19937 rng(seed);
  const int64_t k = 256, n = 384;
  std::vector<float> w = Gaussian(rng, k * n, 0.02);
  for (int64_t i = 0; i < k; ++i) w[i * n + 5] = 0.0f;  // a zero column
  for (int64_t j = 0; j < n; ++j) w[7 * n + j] *= 30.0f;  // a loud row
  RegularizeOptions opt;
  opt.bits = 3;
  opt.seed = seed;
  WorkerPool pool(2);
  auto r = Regularize(w.data(), k, n, opt, &pool);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->svh[5], 0);
  std::vector<double> back(r->w_r.begin(), r->w_r.end());
  kernels::BlockHadamardColumns(back.data(), k, n);
  kernels::BlockHadamardRows(back.data(), k, n);
  double max_err = 0.0, max_w = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double v = static_cast<double>(r->su[i]) * back[i * n + j] * r->sv[j];
      max_err = std::max(max_err, std::fabs(v - w[i * n + j]));
      max_w = std::max(max_w, std::fabs(static_cast<double>(w[i * n + j])));
    }
  }
  EXPECT_LT(max_err / max_w, 2e-6) << "seed=" << seed;  // only w_r's float rounding
  for (int64_t i = 0; i < k; ++i) EXPECT_EQ(kernels::HalfBitsToFloat(r->suh[i]), r->su[i]);
  EXPECT_GT(r->global_scale, 0.01f);
}

TEST(RegularizeTest, SignVectorsAreDeterministicPerSeedAndStream) {
  std::vector<float> a, b, c;
  SignVector(42, kSignStreamInput, 1000, &a);
  SignVector(42, kSignStreamInput, 1000, &b);
  SignVector(42, kSignStreamOutput, 1000, &c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  int negatives = 0;
  for (float x : a) negatives += x < 0;
  EXPECT_GT(negatives, 400);
  EXPECT_LT(negatives, 600);
}

TEST(LdlqTest, ErrorFeedbackLowersProxyErrorOnCorrelatedHessian) {
  const uint32_t seed = TestSeed();
  std::mt19937 rng(seed);
  const int64_t k = 128, n = 128;
  auto fin = FinalizeHessian(CorrelatedHessian(rng, k, 1024));
  ASSERT_TRUE(fin.ok());
  std::vector<float> sigma;
  SignVector(seed, kSignStreamInput, k, &sigma);
  RotateHessian(fin->h.data(), sigma.data(), k);
  const std::vector<float> w_r = Gaussian(rng, k * n, 1.0);
  WorkerPool pool(2);
  auto with = QuantizeMatrix(w_r.data(), k, n, 3, Codebook::kMul1, fin->h.data(), &pool, {});
  auto without = QuantizeMatrix(w_r.data(), k, n, 3, Codebook::kMul1, nullptr, &pool, {});
  ASSERT_TRUE(with.ok() && without.ok());
  // Proxy error of the no-feedback result under the same Hessian.
  double num = 0.0, den = 0.0;
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const double h = fin->h[i * k + j];
        num += (w_r[i * n + c] - without->w_q[i * n + c]) * h * (w_r[j * n + c] - without->w_q[j * n + c]);
        den += w_r[i * n + c] * h * w_r[j * n + c];
      }
    }
  }
  EXPECT_LT(with->proxy_error, 0.9 * num / den) << "seed=" << seed;
  // The strip-wise proxy equals the direct tr(EᵀHE)/tr(WᵀHW).
  double num2 = 0.0;
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        num2 += (w_r[i * n + c] - with->w_q[i * n + c]) * fin->h[i * k + j] * (w_r[j * n + c] - with->w_q[j * n + c]);
      }
    }
  }
  EXPECT_NEAR(with->proxy_error, num2 / den, 1e-3 * num2 / den) << "seed=" << seed;
}

TEST(LdlqTest, RejectsBadArguments) {
  std::vector<float> w(128 * 128, 0.0f);
  auto r = QuantizeMatrix(w.data(), 128, 100, 4, Codebook::kMul1, nullptr, nullptr, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("128x100"), std::string::npos);
  r = QuantizeMatrix(w.data(), 128, 128, 9, Codebook::kMul1, nullptr, nullptr, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(QuantizeLinearTest, ReportedErrorMatchesReconstructionAndProgressCompletes) {
  const uint32_t seed = TestSeed();
  std::mt19937 rng(seed);
  const int64_t out = 256, in = 128;
  std::vector<float> w_hf = Gaussian(rng, out * in, 0.05);
  auto fin = FinalizeHessian(CorrelatedHessian(rng, in, 512));
  ASSERT_TRUE(fin.ok());
  for (const float* hessian : {static_cast<const float*>(nullptr), static_cast<const float*>(fin->h.data())}) {
    QuantizeLinearOptions opt;
    opt.bits = 4;
    opt.seed = seed;
    opt.threads = 2;
    opt.hessian = hessian;
    int64_t last_done = 0, last_total = 0;
    auto q = QuantizeLinear(w_hf.data(), out, in, opt, [&](int64_t d, int64_t t) {
      EXPECT_GE(d, last_done);
      last_done = d;
      last_total = t;
    });
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(last_done, last_total);
    EXPECT_EQ(last_total, (in / 16) * (out / 16));
    // Decode the states, rebuild W_eff = diag(suh)·B·W_q·B·diag(svh), compare.
    const float* values = CodebookValues(Codebook::kMul1);
    std::vector<float> w_q(in * out);
    for (int64_t tk = 0; tk < in / 16; ++tk) {
      for (int64_t tn = 0; tn < out / 16; ++tn) {
        float seq[256];
        const uint16_t* st = q->states.data() + (tk * (out / 16) + tn) * 256;
        for (int j = 0; j < 256; ++j) seq[j] = values[st[j]];
        ScatterTile(seq, out, tk, tn, w_q.data());
      }
    }
    const std::vector<double> w_eff = EffectiveWeight(w_q.data(), q->suh.data(), q->svh.data(), in, out);
    double diff = 0.0, norm = 0.0;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        const double d = w_eff[i * out + o] - w_hf[o * in + i];
        diff += d * d;
        norm += static_cast<double>(w_hf[o * in + i]) * w_hf[o * in + i];
      }
    }
    EXPECT_NEAR(std::sqrt(diff / norm), q->relative_frobenius_error, 1e-9) << "seed=" << seed;
    // 4 bits: relative error around 2^-4 scale, far below 0.2.
    EXPECT_LT(q->relative_frobenius_error, 0.2) << "seed=" << seed;
  }
}

TEST(QuantizeLinearTest, RejectsUnpaddedShapes) {
  std::vector<float> w(100 * 128, 0.0f);
  QuantizeLinearOptions opt;
  auto q = QuantizeLinear(w.data(), 100, 128, opt, {});
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::sharding::quant
