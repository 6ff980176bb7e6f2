// kernels/cuda/trellis_reconstruct.h: the GPU decode of W_h must equal the
// CPU decode bit for bit (exl3-format.md §1, §10, §11). Compiles with and
// without the CUDA backend; with it but without a device, the GPU tests skip
// with the runtime's reason.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"

#if EXL3_HAVE_CUDA
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/trellis_reconstruct.h"
#endif

namespace exl3serve::kernels {
namespace {

#if EXL3_HAVE_CUDA

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20240611u : static_cast<uint32_t>(seed);
}

struct RandomTrellis {
  std::vector<uint16_t> trellis;
  std::vector<float> suh;
  std::vector<float> svh;
  Exl3LinearView view;
};

// Any 16-bit patterns form a valid trellis (tail-biting by construction).
RandomTrellis MakeRandomTrellis(std::mt19937& rng, int64_t k, int64_t n, int bits,
                                Codebook codebook) {
  RandomTrellis t;
  t.trellis.resize((k / 16) * (n / 16) * TileInt16Count(bits));
  std::uniform_int_distribution<int> word(0, 0xFFFF);
  for (uint16_t& v : t.trellis) v = static_cast<uint16_t>(word(rng));
  t.suh.assign(k, 1.0f);
  t.svh.assign(n, 1.0f);
  t.view = Exl3LinearView{t.trellis.data(), k, n, bits, codebook, t.suh.data(), t.svh.data(),
                          nullptr};
  return t;
}

TEST(CudaReconstructTest, GpuDecodeEqualsCpuDecodeBitForBit) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t k = 384;
  const int64_t n = 640;
  for (Codebook codebook : {Codebook::k3Inst, Codebook::kMcg, Codebook::kMul1}) {
    for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
      SCOPED_TRACE(testing::Message() << CodebookName(codebook) << " K=" << bits);
      const RandomTrellis t = MakeRandomTrellis(rng, k, n, bits, codebook);
      std::vector<uint16_t> cpu(k * n, 0);
      std::vector<uint16_t> gpu(k * n, 0xFFFF);
      ASSERT_TRUE(DecodeInnerMatrix(t.view, cpu.data()).ok());
      const absl::Status status = cuda::DecodeInnerMatrix(t.view, gpu.data());
      ASSERT_TRUE(status.ok()) << status;
      int64_t mismatches = 0;
      for (int64_t i = 0; i < k * n; ++i) {
        if (gpu[i] != cpu[i] && mismatches++ < 5) {
          ADD_FAILURE() << "element (" << i / n << ", " << i % n << "): gpu 0x" << std::hex
                        << gpu[i] << " cpu 0x" << cpu[i];
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

TEST(CudaReconstructTest, LargeTensorUsesTheGridStrideLoop) {
  // More tiles than one grid covers (8192 blocks x 8 tiles).
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed());
  const int64_t k = 4096;
  const int64_t n = 4096 + 512;
  const RandomTrellis t = MakeRandomTrellis(rng, k, n, 4, Codebook::kMul1);
  std::vector<uint16_t> cpu(k * n, 0);
  std::vector<uint16_t> gpu(k * n, 0xFFFF);
  ASSERT_TRUE(DecodeInnerMatrix(t.view, cpu.data()).ok());
  const absl::Status status = cuda::DecodeInnerMatrix(t.view, gpu.data());
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(gpu == cpu);
}

TEST(CudaReconstructTest, ReportsAMissingDeviceAsFailedPrecondition) {
  if (cuda::CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; nothing to check";
  std::mt19937 rng(TestSeed());
  const RandomTrellis t = MakeRandomTrellis(rng, 128, 128, 2, Codebook::kMcg);
  std::vector<uint16_t> w_h(128 * 128);
  const absl::Status status = cuda::DecodeInnerMatrix(t.view, w_h.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(std::string(status.message()).rfind("no CUDA device: ", 0), 0u) << status;
}

TEST(CudaReconstructTest, RejectsAnInvalidViewBeforeTouchingTheDevice) {
  std::mt19937 rng(TestSeed());
  RandomTrellis t = MakeRandomTrellis(rng, 128, 128, 2, Codebook::kMcg);
  t.view.bits = 0;
  std::vector<uint16_t> w_h(128 * 128);
  EXPECT_EQ(cuda::DecodeInnerMatrix(t.view, w_h.data()).code(), absl::StatusCode::kInvalidArgument);
}

#else  // !EXL3_HAVE_CUDA

TEST(CudaReconstructTest, GpuDecodeEqualsCpuDecodeBitForBit) {
  GTEST_SKIP() << "built without the CUDA backend (nvcc not found or EXL3_WITH_CUDA=OFF)";
}

#endif  // EXL3_HAVE_CUDA

}  // namespace
}  // namespace exl3serve::kernels
