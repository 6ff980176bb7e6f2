// kernels/cuda/ops.h: every CUDA twin against its CPU op (kernels/ops.h,
// kernels/hadamard.h) on random odd sizes with NaN-poisoned outputs.
// Compiles with and without the CUDA backend; with it but without a device,
// the GPU comparisons skip with the runtime's reason (the argument checks,
// which run before the device is touched, still run).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/hadamard.h"
#include "kernels/ops.h"
#include "kernels/trellis_decode.h"

#if EXL3_HAVE_CUDA
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/ops.h"
#endif

namespace exl3serve::kernels {
namespace {

#if EXL3_HAVE_CUDA

// Tolerances against the CPU twin (see kernels/cuda/ops.h for why each op
// may differ at all).
constexpr double kNormTolerance = 2.5e-7;       // relative: one fp32 ulp of inv
constexpr double kRopeTolerance = 1e-6;         // relative to the row's max |x|
constexpr double kAttentionTolerance = 1e-5;    // absolute; |v| <= 2
constexpr double kBoundaryTolerance = 1e-9;     // sampling: u this close to a cut may differ

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20261129u : static_cast<uint32_t>(seed);
}

std::vector<float> RandomVector(std::mt19937& rng, size_t n, float lo = -2.0f, float hi = 2.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(CudaOpsTest, Fwht128IsBitIdenticalToTheCpu) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t rows : {1, 7, 301}) {
    const int64_t d = 384;
    std::vector<float> cpu = RandomVector(rng, rows * d);
    std::vector<float> gpu = cpu;
    BlockHadamardRows(cpu.data(), rows, d);
    const absl::Status status = cuda::BlockHadamardRows(gpu.data(), rows, d);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(gpu == cpu) << "rows " << rows;
  }
}

TEST(CudaOpsTest, RmsNormMatchesTheCpuWithinOneUlp) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int64_t dim : {1, 37, 129, 4097}) {
    const int64_t rows = 13;
    const std::vector<float> x = RandomVector(rng, rows * dim);
    const std::vector<float> w = RandomVector(rng, dim, 0.5f, 1.5f);
    std::vector<float> cpu(x.size(), NAN), gpu(x.size(), NAN);
    ASSERT_TRUE(RmsNorm(x.data(), rows, dim, w.data(), 1e-6, cpu.data()).ok());
    const absl::Status status = cuda::RmsNorm(x.data(), rows, dim, w.data(), 1e-6, gpu.data());
    ASSERT_TRUE(status.ok()) << status;
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(gpu[i], cpu[i], kNormTolerance * 2.0 * (std::abs(cpu[i]) + 1e-6))
          << "dim " << dim << " element " << i;
    }
  }
}

TEST(CudaOpsTest, RopeMatchesTheCpu) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t tokens = 29, heads = 5, head_dim = 78;
  std::vector<double> inv_freq(head_dim / 2);
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0, -2.0 * i / head_dim);
  std::vector<int64_t> positions(tokens);
  std::uniform_int_distribution<int64_t> pos(0, 200000);
  for (int64_t& p : positions) p = pos(rng);
  std::vector<float> cpu = RandomVector(rng, tokens * heads * head_dim);
  std::vector<float> gpu = cpu;
  ASSERT_TRUE(ApplyRope(cpu.data(), tokens, heads, head_dim, positions.data(), inv_freq.data()).ok());
  const absl::Status status =
      cuda::ApplyRope(gpu.data(), tokens, heads, head_dim, positions.data(), inv_freq.data());
  ASSERT_TRUE(status.ok()) << status;
  int64_t bit_differences = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_NEAR(gpu[i], cpu[i], kRopeTolerance * 4.0) << "element " << i;
    bit_differences += gpu[i] != cpu[i];
  }
  RecordProperty("rope_bit_differences", static_cast<int>(bit_differences));
}

struct RandomPool {
  int64_t page_size = 0, pages_per_seq = 0, num_pages = 0;
  std::vector<int32_t> table;
  std::vector<float> k, v;
  std::vector<uint16_t> k_half, v_half;
  PagedKv View(KvDtype dtype) const {
    PagedKv kv;
    kv.dtype = dtype;
    kv.k = dtype == KvDtype::kFp32 ? static_cast<const void*>(k.data()) : k_half.data();
    kv.v = dtype == KvDtype::kFp32 ? static_cast<const void*>(v.data()) : v_half.data();
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.page_table = table.data();
    kv.pages_per_seq = pages_per_seq;
    return kv;
  }
};

RandomPool MakePool(std::mt19937& rng, int64_t seqs, int64_t max_len, const AttentionParams& p,
                    int64_t page_size) {
  RandomPool pool;
  pool.page_size = page_size;
  pool.pages_per_seq = (max_len + page_size - 1) / page_size;
  pool.num_pages = seqs * pool.pages_per_seq + 2;
  std::vector<int32_t> ids(pool.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  pool.table.assign(ids.begin(), ids.begin() + seqs * pool.pages_per_seq);
  const size_t n = static_cast<size_t>(pool.num_pages * page_size * p.kv_heads * p.head_dim);
  pool.k = RandomVector(rng, n);
  pool.v = RandomVector(rng, n);
  pool.k_half.resize(n);
  pool.v_half.resize(n);
  for (size_t i = 0; i < n; ++i) {
    pool.k_half[i] = FloatToHalfBits(pool.k[i]);
    pool.v_half[i] = FloatToHalfBits(pool.v[i]);
  }
  return pool;
}

AttentionParams Params(int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t window) {
  AttentionParams p;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.sliding_window = window;
  return p;
}

void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_NEAR(gpu[i], cpu[i], kAttentionTolerance) << what << " element " << i;
  }
}

TEST(CudaOpsTest, DecodeAttentionMatchesTheCpu) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  // head_dim 37 (odd, one partial lane chunk), 128, 256 (the kernel's limit).
  for (const AttentionParams& p : {Params(6, 2, 37, 0), Params(8, 8, 128, 0),
                                   Params(12, 3, 256, 0), Params(6, 3, 64, 13)}) {
    const int64_t seqs = 7;
    const RandomPool pool = MakePool(rng, seqs, 301, p, 16);
    std::vector<int32_t> lens = {1, 301, 17, 16, 2, 250, 99};
    const std::vector<float> q = RandomVector(rng, seqs * p.q_heads * p.head_dim);
    for (KvDtype dtype : {KvDtype::kFp32, KvDtype::kFp16}) {
      std::vector<float> cpu(q.size(), NAN), gpu(q.size(), NAN);
      ASSERT_TRUE(DecodeAttention(q.data(), seqs, lens.data(), pool.View(dtype), p, cpu.data()).ok());
      const absl::Status status =
          cuda::DecodeAttention(q.data(), seqs, lens.data(), pool.View(dtype), p, gpu.data());
      ASSERT_TRUE(status.ok()) << status;
      ExpectClose(gpu, cpu, "decode");
    }
  }
}

TEST(CudaOpsTest, PrefillAttentionMatchesTheCpu) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const AttentionParams& p : {Params(9, 3, 45, 0), Params(4, 1, 128, 21)}) {
    const int64_t seqs = 4;
    const RandomPool pool = MakePool(rng, seqs, 157, p, 7);
    // A chunk after a cached prefix, a whole prompt, an empty entry, one token.
    std::vector<int32_t> starts = {100, 0, 5, 156};
    std::vector<int32_t> query_starts = {0, 57, 214, 214, 215};
    const int64_t total = query_starts.back();
    const std::vector<float> q = RandomVector(rng, total * p.q_heads * p.head_dim);
    std::vector<float> cpu(q.size(), NAN), gpu(q.size(), NAN);
    const PagedKv kv = pool.View(KvDtype::kFp16);
    ASSERT_TRUE(PrefillAttention(q.data(), seqs, query_starts.data(), starts.data(), kv, p,
                                 cpu.data()).ok());
    const absl::Status status = cuda::PrefillAttention(q.data(), seqs, query_starts.data(),
                                                       starts.data(), kv, p, gpu.data());
    ASSERT_TRUE(status.ok()) << status;
    ExpectClose(gpu, cpu, "prefill");
  }
}

TEST(CudaOpsTest, ArgMaxIsIdenticalIncludingTies) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  std::mt19937 rng(TestSeed());
  const int64_t rows = 9, vocab = 32001;
  std::vector<float> logits = RandomVector(rng, rows * vocab, -5.0f, 5.0f);
  logits[2 * vocab + 31000] = logits[2 * vocab + 7] = 9.0f;  // tie: 7 wins
  for (int64_t i = 0; i < vocab; ++i) logits[4 * vocab + i] = -INFINITY;  // all masked: 0
  std::vector<int32_t> cpu(rows, -1), gpu(rows, -1);
  ASSERT_TRUE(ArgMax(logits.data(), rows, vocab, cpu.data()).ok());
  const absl::Status status = cuda::ArgMax(logits.data(), rows, vocab, gpu.data());
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(gpu, cpu);
  EXPECT_EQ(gpu[2], 7);
}

TEST(CudaOpsTest, SampleDrawsTheCpuTokenAwayFromBoundaries) {
  if (absl::Status s = cuda::CudaDeviceAvailable(); !s.ok()) GTEST_SKIP() << s.message();
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t vocab = 5003;
  const std::vector<SamplingFilter> filters = {
      {0.0f, 0, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f}, {0.7f, 40, 1.0f, 0.0f},
      {1.3f, 0, 0.9f, 0.0f}, {0.9f, 0, 1.0f, 0.05f}, {1.0f, 17, 0.5f, 0.02f},
      {2.0f, 1, 1.0f, 0.0f}, {0.5f, 0, 0.95f, 0.1f}};
  const int64_t rows = static_cast<int64_t>(filters.size());
  std::vector<float> logits = RandomVector(rng, rows * vocab, -6.0f, 6.0f);
  logits[2 * vocab + 5] = logits[2 * vocab + 4000] = 9.0f;  // a tie at the top
  logits[3 * vocab + 10] = -INFINITY;
  int64_t disagreements = 0;
  for (int step = 0; step < 32; ++step) {
    std::vector<double> u(rows);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    for (double& x : u) x = uniform(rng);
    std::vector<int32_t> cpu(rows, -1), gpu(rows, -1);
    ASSERT_TRUE(Sample(logits.data(), rows, vocab, filters.data(), u.data(), cpu.data()).ok());
    const absl::Status status =
        cuda::Sample(logits.data(), rows, vocab, filters.data(), u.data(), gpu.data());
    ASSERT_TRUE(status.ok()) << status;
    for (int64_t r = 0; r < rows; ++r) {
      if (gpu[r] == cpu[r]) continue;
      // Only acceptable when u lies within rounding of a cumulative boundary.
      ++disagreements;
      std::vector<double> p(vocab);
      SamplingDistribution(logits.data() + r * vocab, vocab, filters[r], p.data());
      double cumulative = 0.0, nearest = 1.0;
      for (int64_t i = 0; i < vocab; ++i) {
        cumulative += p[i];
        if (p[i] > 0.0) nearest = std::min(nearest, std::abs(cumulative - u[r]));
      }
      EXPECT_LT(nearest, kBoundaryTolerance)
          << "row " << r << " u " << u[r] << ": gpu " << gpu[r] << " cpu " << cpu[r];
    }
  }
  RecordProperty("sample_boundary_disagreements", static_cast<int>(disagreements));
}

TEST(CudaOpsTest, ReportsAMissingDeviceAsFailedPrecondition) {
  if (cuda::CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present; nothing to check";
  std::vector<float> x(7 * 9, 1.0f), w(9, 1.0f), out(x.size(), NAN);
  const absl::Status status = cuda::RmsNorm(x.data(), 7, 9, w.data(), 1e-6, out.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(std::string(status.message()).rfind("no CUDA device: ", 0), 0u) << status;
}

TEST(CudaOpsTest, RejectsBadArgumentsBeforeTouchingTheDevice) {
  std::mt19937 rng(TestSeed());
  std::vector<float> x(256, 1.0f);
  EXPECT_EQ(cuda::BlockHadamardRows(x.data(), 1, 100).code(), absl::StatusCode::kInvalidArgument);
  std::vector<double> inv_freq(4, 1.0);
  std::vector<int64_t> positions = {-3};
  EXPECT_EQ(cuda::ApplyRope(x.data(), 1, 1, 8, positions.data(), inv_freq.data()).code(),
            absl::StatusCode::kInvalidArgument);
  const AttentionParams p = Params(4, 2, 8, 0);
  RandomPool pool = MakePool(rng, 1, 10, p, 4);
  pool.table[1] = -1;
  std::vector<int32_t> lens = {6};
  std::vector<float> q(4 * 8, 1.0f), out(q.size(), NAN);
  EXPECT_EQ(cuda::DecodeAttention(q.data(), 1, lens.data(), pool.View(KvDtype::kFp16), p,
                                  out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> big_q(4 * 512, 1.0f), big_out(big_q.size(), NAN);
  RandomPool big = MakePool(rng, 1, 10, Params(4, 2, 512, 0), 4);
  EXPECT_EQ(cuda::DecodeAttention(big_q.data(), 1, lens.data(), big.View(KvDtype::kFp16),
                                  Params(4, 2, 512, 0), big_out.data()).code(),
            absl::StatusCode::kUnimplemented);
  SamplingFilter f;
  f.top_p = 1.5f;
  double u = 0.5;
  int32_t id = -1;
  EXPECT_EQ(cuda::Sample(x.data(), 1, 256, &f, &u, &id).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(id, -1);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return std::isnan(v); }));
}

#else  // !EXL3_HAVE_CUDA

TEST(CudaOpsTest, Fwht128IsBitIdenticalToTheCpu) {
  GTEST_SKIP() << "built without the CUDA backend (nvcc not found or EXL3_WITH_CUDA=OFF)";
}

#endif  // EXL3_HAVE_CUDA

}  // namespace
}  // namespace exl3serve::kernels
