// kernels/cuda/trellis_gemm.h: the CUDA trellis GEMV/GEMM against the CPU
// kernels::TrellisGemm, kernels::ReferenceForward and a float64 dense product
// of the effective weight, on random linears (random trellis words, signed
// scales with a zero channel, optional bias) and Gaussian inputs of odd row
// counts that cover the GEMV (1..8 rows), the GEMV in passes (17) and the
// cuBLAS path (33, 40); the kInt8 (mul1, dp4a) path against the CPU's kInt8
// path bit for bit. Outputs are poisoned (NaN) before each call.
// Compiles with and without the CUDA backend; with it but without a device,
// the GPU tests skip with the runtime's reason.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_gemm.h"
#include "kernels/trellis_lut.h"

#if EXL3_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/trellis_gemm.h"
#endif
#include "tests/testing/random_linear.h"

namespace exl3serve::kernels {
namespace {

#if EXL3_HAVE_CUDA

// Per output, |got - want| / (||x_i ⊙ suh||_2 · |svh[c]| + 1e-3), as in
// trellis_gemm_test.cc: fp32 vs another fp32 summation order or float64 over
// k <= 4096 terms of |w| < 4 (the GPU sums 4-term groups per lane, then tile
// rows, warps and k splits).
constexpr double kFloatTol = 3e-5;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20261129u : static_cast<uint32_t>(seed);
}

const Codebook kCodebooks[] = {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1};

using exl3serve::testing::RandomInput;
using exl3serve::testing::RandomLinear;

std::vector<float> Poisoned(int64_t count) {
  return std::vector<float>(static_cast<size_t>(count), std::numeric_limits<float>::quiet_NaN());
}

double Norm(const Exl3LinearView& view, const std::vector<float>& x, int64_t i, int64_t c) {
  double s = 0;
  for (int64_t r = 0; r < view.k; ++r) {
    const double v = double(x[i * view.k + r]) * view.suh[r];
    s += v * v;
  }
  return std::sqrt(s) * std::fabs(view.svh[c]) + 1e-3;
}

void ExpectClose(const Exl3LinearView& view, const std::vector<float>& x, int64_t m,
                 const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < view.n; ++c) {
      const double g = got[i * view.n + c];
      const double w = want[i * view.n + c];
      const double bias = view.bias ? std::fabs(view.bias[c]) * 2e-7 : 0.0;
      const double err =
          std::isfinite(g) ? std::fabs(g - w) / (Norm(view, x, i, c) + bias) : 1e30;
      if (err > worst) {
        worst = err;
        worst_at = i * view.n + c;
      }
    }
  }
  EXPECT_LE(worst, kFloatTol) << what << ": worst relative error at (" << worst_at / view.n
                              << ", " << worst_at % view.n << "): got " << got[worst_at]
                              << ", want " << want[worst_at] << "; seed " << TestSeed();
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

std::string Describe(Codebook cb, int bits, int64_t k, int64_t n, int64_t m) {
  return std::string(CodebookName(cb)) + " K=" + std::to_string(bits) + " " + std::to_string(k) +
         "x" + std::to_string(n) + " m=" + std::to_string(m);
}

struct Shape {
  int64_t k, n;
};

TEST(CudaTrellisGemmTest, MatchesCpuGemmAndReferenceForEveryBitsAndCodebook) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed());
  const Shape shapes[] = {{128, 384}, {384, 256}};
  const int64_t row_counts[] = {1, 3, 5, 8, 17, 33};
  for (Codebook cb : kCodebooks) {
    for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
      for (const Shape& shape : shapes) {
        const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, cb, bits % 2 == 1);
        const Exl3LinearView view = d.view();
        for (int64_t m : row_counts) {
          const std::string what = Describe(cb, bits, shape.k, shape.n, m);
          const std::vector<float> x = RandomInput(rng, m, shape.k);
          std::vector<float> gpu = Poisoned(m * shape.n);
          const absl::Status status = cuda::TrellisGemm(view, x.data(), m, gpu.data());
          ASSERT_TRUE(status.ok()) << what << ": " << status;
          std::vector<float> cpu = Poisoned(m * shape.n);
          ASSERT_TRUE(TrellisGemm(view, x.data(), m, cpu.data()).ok());
          ExpectClose(view, x, m, gpu, cpu, what + " vs kernels::TrellisGemm");
          std::vector<float> ref = Poisoned(m * shape.n);
          ASSERT_TRUE(ReferenceForward(view, x.data(), m, ref.data()).ok());
          ExpectClose(view, x, m, gpu, ref, what + " vs ReferenceForward");
        }
      }
    }
  }
}

TEST(CudaTrellisGemmTest, MatchesFloat64OnLongerKWithManySplits) {
  // k = 2304 gives the GEMV 18 rounds of 128 rows, split over several blocks;
  // m = 40 takes the cuBLAS path on the same weights.
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed() + 1);
  for (int bits : {2, 3, 4, 6}) {
    const Codebook cb = kCodebooks[bits % 3];
    const Exl3LinearData d = RandomLinear(rng, 2304, 640, bits, cb, true);
    const Exl3LinearView view = d.view();
    for (int64_t m : {1, 2, 7, 40}) {
      const std::string what = Describe(cb, bits, view.k, view.n, m);
      const std::vector<float> x = RandomInput(rng, m, view.k);
      std::vector<float> gpu = Poisoned(m * view.n);
      const absl::Status status = cuda::TrellisGemm(view, x.data(), m, gpu.data());
      ASSERT_TRUE(status.ok()) << what << ": " << status;
      ExpectClose(view, x, m, gpu, DenseFloat64(view, x, m), what + " vs float64");
    }
  }
}

TEST(CudaTrellisGemmTest, DeviceApiOnAUserStreamIsDeterministic) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed() + 2);
  const Exl3LinearData d = RandomLinear(rng, 1024, 384, 4, Codebook::kMul1, true);
  absl::StatusOr<cuda::DeviceExl3Linear> w = cuda::DeviceExl3Linear::Upload(d.view());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->device_view().k, 1024);
  EXPECT_EQ(w->device_view().n, 384);
  EXPECT_NE(w->device_view().bias, nullptr);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (int64_t m : {1, 6, 12, 35}) {
    const std::vector<float> x = RandomInput(rng, m, d.k);
    float* dx = nullptr;
    float* dy = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dx), x.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dy), m * d.n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<float> first;
    for (int run = 0; run < 2; ++run) {
      ASSERT_EQ(cudaMemset(dy, 0xFF, m * d.n * sizeof(float)), cudaSuccess);  // NaN poison
      const absl::Status status = cuda::TrellisGemm(*w, dx, m, dy, stream);
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::vector<float> y = Poisoned(m * d.n);
      ASSERT_EQ(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (run == 0) {
        std::vector<float> cpu = Poisoned(m * d.n);
        ASSERT_TRUE(TrellisGemm(d.view(), x.data(), m, cpu.data()).ok());
        ExpectClose(d.view(), x, m, y, cpu, "device API m=" + std::to_string(m));
        first = y;
      } else {
        EXPECT_EQ(std::memcmp(first.data(), y.data(), y.size() * sizeof(float)), 0)
            << "two runs differ, m=" << m;
      }
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  cudaStreamDestroy(stream);
}

TEST(CudaTrellisGemmTest, Int8PathEqualsCpuInt8PathBitForBit) {
  // kInt8 (mul1): same x', same int8 quantization, exact integer dot products
  // and the same epilogue ops, so the GPU output equals the CPU's bit for bit.
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed() + 6);
  TrellisGemmOptions int8;
  int8.precision = TrellisGemmPrecision::kInt8;
  const Shape shapes[] = {{384, 256}, {1152, 128}};
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    for (const Shape& shape : shapes) {
      const Exl3LinearData d = RandomLinear(rng, shape.k, shape.n, bits, Codebook::kMul1, true);
      for (int64_t m : {1, 3, 8, 17, 33}) {
        const std::string what = Describe(Codebook::kMul1, bits, shape.k, shape.n, m) + " int8";
        const std::vector<float> x = RandomInput(rng, m, shape.k);
        std::vector<float> gpu = Poisoned(m * shape.n);
        const absl::Status status = cuda::TrellisGemm(d.view(), x.data(), m, gpu.data(), int8);
        ASSERT_TRUE(status.ok()) << what << ": " << status;
        std::vector<float> cpu = Poisoned(m * shape.n);
        ASSERT_TRUE(TrellisGemm(d.view(), x.data(), m, cpu.data(), int8).ok());
        int64_t mismatches = 0;
        for (int64_t i = 0; i < m * shape.n; ++i) {
          if (std::memcmp(&gpu[i], &cpu[i], sizeof(float)) != 0 && mismatches++ < 3) {
            ADD_FAILURE() << what << ": (" << i / shape.n << ", " << i % shape.n << ") gpu "
                          << gpu[i] << " cpu " << cpu[i];
          }
        }
        EXPECT_EQ(mismatches, 0) << what;
      }
    }
  }
}

TEST(CudaTrellisGemmTest, EmptyShapes) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed() + 3);
  // m = 0: y untouched.
  const Exl3LinearData d = RandomLinear(rng, 128, 256, 3, Codebook::kMcg, true);
  std::vector<float> y = {1.5f};
  ASSERT_TRUE(cuda::TrellisGemm(d.view(), nullptr, 0, y.data()).ok());
  EXPECT_EQ(y[0], 1.5f);
  // k = 0 (a rank with no input channels): y = bias on both paths.
  Exl3LinearData empty_k = RandomLinear(rng, 128, 256, 3, Codebook::kMcg, true);
  empty_k.k = 0;
  empty_k.trellis.clear();
  empty_k.suh.clear();
  for (int64_t m : {2, 33}) {
    std::vector<float> gpu = Poisoned(m * 256);
    const absl::Status status = cuda::TrellisGemm(empty_k.view(), nullptr, m, gpu.data());
    ASSERT_TRUE(status.ok()) << status;
    for (int64_t i = 0; i < m * 256; ++i) ASSERT_EQ(gpu[i], empty_k.bias[i % 256]) << i;
  }
  // n = 0: nothing to write.
  Exl3LinearData empty_n = RandomLinear(rng, 128, 128, 3, Codebook::kMcg, false);
  empty_n.n = 0;
  empty_n.trellis.clear();
  empty_n.svh.clear();
  const std::vector<float> x = RandomInput(rng, 3, 128);
  EXPECT_TRUE(cuda::TrellisGemm(empty_n.view(), x.data(), 3, nullptr).ok());
}

TEST(CudaTrellisGemmTest, RejectsBadArgumentsWithoutTouchingTheDevice) {
  std::mt19937 rng(TestSeed() + 4);
  const Exl3LinearData d = RandomLinear(rng, 128, 128, 2, Codebook::kMcg, false);
  const std::vector<float> x = RandomInput(rng, 2, 128);
  std::vector<float> y(256, 7.0f);
  EXPECT_EQ(cuda::TrellisGemm(d.view(), x.data(), -1, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::TrellisGemm(d.view(), nullptr, 2, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::TrellisGemm(d.view(), x.data(), 2, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  TrellisGemmOptions int8;
  int8.precision = TrellisGemmPrecision::kInt8;
  EXPECT_EQ(cuda::TrellisGemm(d.view(), x.data(), 2, y.data(), int8).code(),
            absl::StatusCode::kInvalidArgument);  // mcg
  TrellisGemmOptions unknown;
  unknown.precision = static_cast<TrellisGemmPrecision>(77);
  EXPECT_EQ(cuda::TrellisGemm(d.view(), x.data(), 2, y.data(), unknown).code(),
            absl::StatusCode::kUnimplemented);
  Exl3LinearView bad = d.view();
  bad.bits = 9;
  EXPECT_EQ(cuda::TrellisGemm(bad, x.data(), 2, y.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::DeviceExl3Linear::Upload(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (float v : y) EXPECT_EQ(v, 7.0f);  // untouched on error
}

TEST(CudaTrellisGemmTest, ReportsAMissingDeviceAsFailedPrecondition) {
  if (cuda::CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; nothing to check";
  std::mt19937 rng(TestSeed() + 5);
  const Exl3LinearData d = RandomLinear(rng, 128, 128, 2, Codebook::kMul1, false);
  const std::vector<float> x = RandomInput(rng, 1, 128);
  std::vector<float> y(128, 7.0f);
  const absl::Status status = cuda::TrellisGemm(d.view(), x.data(), 1, y.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(std::string(status.message()).rfind("no CUDA device: ", 0), 0u) << status;
  EXPECT_EQ(cuda::DeviceExl3Linear::Upload(d.view()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (float v : y) EXPECT_EQ(v, 7.0f);
}

#else  // !EXL3_HAVE_CUDA

TEST(CudaTrellisGemmTest, MatchesCpuGemmAndReferenceForEveryBitsAndCodebook) {
  GTEST_SKIP() << "built without the CUDA backend (nvcc not found or EXL3_WITH_CUDA=OFF)";
}

#endif  // EXL3_HAVE_CUDA

}  // namespace
}  // namespace exl3serve::kernels
