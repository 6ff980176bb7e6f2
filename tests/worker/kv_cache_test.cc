// worker::PagedKvCache: page accounting, round trips per storage format
// against plain references, and that positions read back the same however
// they were written.
#include "worker/model/kv_cache.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::worker {
namespace {

constexpr KvCacheShape kShape = {.num_layers = 2, .num_kv_heads = 3, .head_dim = 10};
constexpr int64_t kEntry = 3 * 10;  // floats per position

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

PagedKvCache Make(KvCacheDtype dtype, int64_t pages = 4, int page_size = 4) {
  KvCacheOptions options;
  options.dtype = dtype;
  options.num_pages = pages;
  options.page_size_tokens = page_size;
  auto cache = PagedKvCache::Create(kShape, options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

TEST(PagedKvCacheTest, ReservesWholePagesAndReturnsThemOnRemove) {
  PagedKvCache cache = Make(KvCacheDtype::kFp16, 4, 4);
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(cache.AddSequence(2).ok());
  EXPECT_EQ(cache.AddSequence(1).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(cache.Reserve(1, 5).ok());  // 2 pages
  EXPECT_EQ(cache.free_pages(), 2);
  ASSERT_TRUE(cache.Reserve(1, 8).ok());  // still 2
  EXPECT_EQ(cache.free_pages(), 2);
  const absl::Status full = cache.Reserve(2, 9);  // 3 pages, 2 free
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("kv_cache.num_pages"), std::string::npos) << full;
  EXPECT_EQ(cache.free_pages(), 2);  // nothing taken
  ASSERT_TRUE(cache.RemoveSequence(1).ok());
  EXPECT_EQ(cache.free_pages(), 4);
  EXPECT_EQ(cache.RemoveSequence(1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.Reserve(7, 1).code(), absl::StatusCode::kNotFound);
}

TEST(PagedKvCacheTest, Fp32IsExactAndFp16RoundsEachValueOnce) {
  const std::vector<float> k = Random(7 * kEntry, 1), v = Random(7 * kEntry, 2);
  for (KvCacheDtype dtype : {KvCacheDtype::kFp32, KvCacheDtype::kFp16}) {
    PagedKvCache cache = Make(dtype);
    ASSERT_TRUE(cache.AddSequence(0).ok());
    ASSERT_TRUE(cache.Reserve(0, 7).ok());
    cache.Write(0, 1, 0, 7, k.data(), v.data());
    std::vector<float> k2(k.size()), v2(v.size());
    cache.Read(0, 1, 0, 7, k2.data(), v2.data());
    for (size_t i = 0; i < k.size(); ++i) {
      const float want_k = dtype == KvCacheDtype::kFp32
                               ? k[i]
                               : kernels::HalfBitsToFloat(kernels::FloatToHalfBits(k[i]));
      const float want_v = dtype == KvCacheDtype::kFp32
                               ? v[i]
                               : kernels::HalfBitsToFloat(kernels::FloatToHalfBits(v[i]));
      EXPECT_EQ(k2[i], want_k);
      EXPECT_EQ(v2[i], want_v);
    }
  }
}

TEST(PagedKvCacheTest, IntFormatsMatchAPerHeadAbsmaxReference) {
  const std::vector<float> k = Random(6 * kEntry, 3), v = Random(6 * kEntry, 4);
  for (auto [dtype, qmax] : {std::pair{KvCacheDtype::kInt8, 127}, std::pair{KvCacheDtype::kInt4, 7}}) {
    PagedKvCache cache = Make(dtype);
    ASSERT_TRUE(cache.AddSequence(0).ok());
    ASSERT_TRUE(cache.Reserve(0, 6).ok());
    cache.Write(0, 0, 0, 6, k.data(), v.data());
    std::vector<float> k2(k.size()), v2(v.size());
    cache.Read(0, 0, 0, 6, k2.data(), v2.data());
    for (int64_t head = 0; head < 6 * 3; ++head) {  // (position, head) entries
      float absmax = 0.0f;
      for (int i = 0; i < 10; ++i) absmax = std::max(absmax, std::fabs(k[head * 10 + i]));
      const float scale = absmax / qmax;
      for (int i = 0; i < 10; ++i) {
        const float want = scale * std::nearbyint(k[head * 10 + i] / scale);
        EXPECT_FLOAT_EQ(k2[head * 10 + i], want) << "entry " << head << " value " << i;
        EXPECT_LE(std::fabs(k2[head * 10 + i] - k[head * 10 + i]), 0.5f * scale * 1.0001f);
      }
    }
  }
}

TEST(PagedKvCacheTest, PositionsReadBackTheSameWhetherWrittenInChunksOrAlone) {
  const std::vector<float> k = Random(11 * kEntry, 5), v = Random(11 * kEntry, 6);
  PagedKvCache cache = Make(KvCacheDtype::kInt8, 8, 4);
  ASSERT_TRUE(cache.AddSequence(0).ok());
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(cache.Reserve(0, 11).ok());
  ASSERT_TRUE(cache.Reserve(1, 11).ok());
  cache.Write(0, 1, 0, 11, k.data(), v.data());
  for (int64_t t = 0; t < 11; t += 3) {  // chunks across page boundaries
    const int64_t n = std::min<int64_t>(3, 11 - t);
    cache.Write(1, 1, t, n, k.data() + t * kEntry, v.data() + t * kEntry);
  }
  std::vector<float> a(k.size()), b(k.size()), av(k.size()), bv(k.size());
  cache.Read(0, 1, 0, 11, a.data(), av.data());
  cache.Read(1, 1, 0, 11, b.data(), bv.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(av, bv);
  // A middle range reads the same values.
  std::vector<float> mid(5 * kEntry), midv(5 * kEntry);
  cache.Read(1, 1, 3, 8, mid.data(), midv.data());
  EXPECT_TRUE(std::equal(mid.begin(), mid.end(), a.begin() + 3 * kEntry));
}

TEST(PagedKvCacheTest, RejectsBadOptions) {
  KvCacheOptions options;
  options.num_pages = 0;
  EXPECT_EQ(PagedKvCache::Create(kShape, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.num_pages = 1;
  options.dtype = KvCacheDtype::kInt4;
  EXPECT_EQ(PagedKvCache::Create({1, 1, 7}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCacheDtypeFromBits(3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*KvCacheDtypeFromBits(8), KvCacheDtype::kInt8);
}

}  // namespace
}  // namespace exl3serve::worker
