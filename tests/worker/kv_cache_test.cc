// worker::PagedKvCache: page accounting, round trips per storage format
// against plain references, and that positions read back the same however
// they were written.
#include "worker/model/kv_cache.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
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

TEST(PagedKvCacheTest, LongReadsSplitOverPagesAndThreadsReadEveryValue) {
  // 1 237 positions on pages of 16 (78 pages, the first and last read
  // partially): 73 k values per read, past the size that splits pages over
  // the thread pool. fp32 and fp16 against the exact per-value reference,
  // the int formats against reading each position alone (one page, one
  // thread); outputs poisoned.
  constexpr int64_t kPositions = 1237, kBegin = 5, kEnd = 1230;
  const std::vector<float> k = Random(kPositions * kEntry, 7), v = Random(kPositions * kEntry, 8);
  for (KvCacheDtype dtype : {KvCacheDtype::kFp32, KvCacheDtype::kFp16, KvCacheDtype::kInt8,
                             KvCacheDtype::kInt4}) {
    PagedKvCache cache = Make(dtype, 80, 16);
    ASSERT_TRUE(cache.AddSequence(0).ok());
    ASSERT_TRUE(cache.Reserve(0, kPositions).ok());
    cache.Write(0, 1, 0, kPositions, k.data(), v.data());
    const int64_t n = (kEnd - kBegin) * kEntry;
    std::vector<float> k2(n, std::nanf("")), v2(n, std::nanf(""));
    cache.Read(0, 1, kBegin, kEnd, k2.data(), v2.data());
    for (int64_t pos = kBegin; pos < kEnd; ++pos) {
      std::vector<float> k1(kEntry, std::nanf("")), v1(kEntry, std::nanf(""));
      cache.Read(0, 1, pos, pos + 1, k1.data(), v1.data());
      for (int64_t i = 0; i < kEntry; ++i) {
        const int64_t at = (pos - kBegin) * kEntry + i, src = pos * kEntry + i;
        float want_k = k1[i], want_v = v1[i];
        if (dtype == KvCacheDtype::kFp32) {
          want_k = k[src];
          want_v = v[src];
        } else if (dtype == KvCacheDtype::kFp16) {
          want_k = kernels::HalfBitsToFloat(kernels::FloatToHalfBits(k[src]));
          want_v = kernels::HalfBitsToFloat(kernels::FloatToHalfBits(v[src]));
        }
        ASSERT_EQ(k2[at], want_k) << "dtype " << static_cast<int>(dtype) << " position " << pos;
        ASSERT_EQ(v2[at], want_v) << "dtype " << static_cast<int>(dtype) << " position " << pos;
        ASSERT_EQ(k1[i], k2[at]);
      }
    }
  }
}

PagedKvCache MakeAssigned(int64_t pages, int page_size) {
  KvCacheOptions options;
  options.dtype = KvCacheDtype::kFp32;
  options.num_pages = pages;
  options.page_size_tokens = page_size;
  options.caller_assigns_pages = true;
  auto cache = PagedKvCache::Create(kShape, options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

std::vector<int64_t> Table(std::initializer_list<int64_t> pages) { return pages; }

TEST(PagedKvCacheTest, AssignPagesRejectsBadPagesNamingThemAndTakesNothing) {
  PagedKvCache cache = MakeAssigned(7, 3);
  ASSERT_TRUE(cache.AddSequence(10).ok());
  ASSERT_TRUE(cache.AddSequence(11).ok());
  const std::vector<int32_t> first = {4, 1};
  ASSERT_TRUE(cache.AssignPages(10, first).ok());
  EXPECT_EQ(cache.free_pages(), 5);

  auto expect = [&](std::vector<int32_t> pages, absl::StatusCode code, const std::string& words) {
    const absl::Status s = cache.AssignPages(11, pages);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(words), std::string::npos) << s;
    EXPECT_EQ(cache.free_pages(), 5) << s;  // all or nothing
    EXPECT_TRUE(cache.PageTable(11).empty()) << s;
  };
  expect({0, 7}, absl::StatusCode::kInvalidArgument, "page 7 is outside [0, 7)");
  expect({-1}, absl::StatusCode::kInvalidArgument, "page -1 is outside");
  expect({2, 1}, absl::StatusCode::kFailedPrecondition, "page 1 is already used by sequence 10");
  expect({5, 3, 5}, absl::StatusCode::kInvalidArgument, "page 5 is assigned twice");
  expect({4}, absl::StatusCode::kFailedPrecondition, "sequence 10");
  EXPECT_EQ(cache.AssignPages(12, first).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.PageTable(10), Table({4, 1}));
  // An empty call is a no-op.
  EXPECT_TRUE(cache.AssignPages(11, {}).ok());
}

TEST(PagedKvCacheTest, ACallerAssignedCacheNeverTakesAPageOnItsOwn) {
  PagedKvCache cache = MakeAssigned(5, 4);
  ASSERT_TRUE(cache.AddSequence(1).ok());
  const absl::Status short_of_pages = cache.Reserve(1, 1);
  EXPECT_EQ(short_of_pages.code(), absl::StatusCode::kFailedPrecondition) << short_of_pages;
  EXPECT_NE(short_of_pages.message().find("coordinator"), std::string::npos) << short_of_pages;
  EXPECT_EQ(cache.free_pages(), 5);
  const std::vector<int32_t> pages = {3, 0};
  ASSERT_TRUE(cache.AssignPages(1, pages).ok());
  EXPECT_TRUE(cache.Reserve(1, 8).ok());  // covered by the two pages
  EXPECT_EQ(cache.Reserve(1, 9).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.free_pages(), 3);
  ASSERT_TRUE(cache.RemoveSequence(1).ok());
  EXPECT_EQ(cache.free_pages(), 5);
  // The freed pages can be assigned to another sequence.
  ASSERT_TRUE(cache.AddSequence(2).ok());
  ASSERT_TRUE(cache.AssignPages(2, pages).ok());
  EXPECT_EQ(cache.PageTable(2), Table({3, 0}));
}

TEST(PagedKvCacheTest, AssignedPagesHoldEachSequencesValuesWithoutOverlap) {
  // Two sequences on interleaved, out-of-order pages; each reads back exactly
  // what was written (fp32), and a self-allocating cache never hands out a page
  // that was assigned.
  constexpr int kPage = 3;
  const std::vector<float> ka = Random(8 * kEntry, 11), va = Random(8 * kEntry, 12);
  const std::vector<float> kb = Random(5 * kEntry, 13), vb = Random(5 * kEntry, 14);
  for (bool assigned_mode : {true, false}) {
    KvCacheOptions options;
    options.dtype = KvCacheDtype::kFp32;
    options.num_pages = 9;
    options.page_size_tokens = kPage;
    options.caller_assigns_pages = assigned_mode;
    auto made = PagedKvCache::Create(kShape, options);
    ASSERT_TRUE(made.ok());
    PagedKvCache& cache = *made;
    ASSERT_TRUE(cache.AddSequence(1).ok());
    ASSERT_TRUE(cache.AddSequence(2).ok());
    ASSERT_TRUE(cache.AssignPages(1, std::vector<int32_t>{6, 0}).ok());
    ASSERT_TRUE(cache.AssignPages(2, std::vector<int32_t>{5}).ok());
    ASSERT_TRUE(cache.AssignPages(1, std::vector<int32_t>{2}).ok());  // appended later
    ASSERT_TRUE(cache.AssignPages(2, std::vector<int32_t>{1}).ok());
    cache.Write(1, 0, 0, 8, ka.data(), va.data());
    cache.Write(2, 0, 0, 5, kb.data(), vb.data());
    if (!assigned_mode) {
      ASSERT_TRUE(cache.AddSequence(3).ok());
      ASSERT_TRUE(cache.Reserve(3, 4 * kPage).ok());  // every free page
      for (int64_t page : cache.PageTable(3)) {
        EXPECT_TRUE(page != 6 && page != 0 && page != 2 && page != 5 && page != 1) << page;
      }
      const std::vector<float> poison(4 * kPage * kEntry, -1e30f);
      cache.Write(3, 0, 0, 4 * kPage, poison.data(), poison.data());
      EXPECT_EQ(cache.free_pages(), 0);
    }
    std::vector<float> k(8 * kEntry, 7.0f), v(8 * kEntry, 7.0f);
    cache.Read(1, 0, 0, 8, k.data(), v.data());
    EXPECT_EQ(k, ka);
    EXPECT_EQ(v, va);
    k.assign(5 * kEntry, 7.0f);
    v.assign(5 * kEntry, 7.0f);
    cache.Read(2, 0, 0, 5, k.data(), v.data());
    EXPECT_EQ(k, kb);
    EXPECT_EQ(v, vb);
    EXPECT_EQ(cache.PageTable(1), Table({6, 0, 2}));
    EXPECT_EQ(cache.PageTable(2), Table({5, 1}));
    EXPECT_TRUE(cache.PageTable(42).empty());
  }
}

TEST(PagedKvCacheTest, ACachedPrefixSharesFullPagesReadOnly) {
  // Sequence 1 writes 7 positions on pages {4, 1, 6} (page size 3); sequence
  // 2 starts with 1's first two pages as its cached prefix (6 positions),
  // reads 1's values there, and writes its own from position 6 on page 2.
  constexpr int kPage = 3;
  PagedKvCache cache = MakeAssigned(8, kPage);
  const std::vector<float> k1 = Random(7 * kEntry, 21), v1 = Random(7 * kEntry, 22);
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(cache.AssignPages(1, std::vector<int32_t>{4, 1, 6}).ok());
  ASSERT_TRUE(cache.Reserve(1, 7).ok());
  cache.Write(1, 0, 0, 7, k1.data(), v1.data());
  cache.SetLength(1, 7);

  ASSERT_TRUE(cache.AddSequence(2, 2 * kPage).ok());
  EXPECT_EQ(cache.Length(2), 6);
  // Page 6 ends outside the cached prefix: it stays 1's.
  const absl::Status third = cache.AssignPages(2, std::vector<int32_t>{4, 1, 6});
  EXPECT_EQ(third.code(), absl::StatusCode::kFailedPrecondition) << third;
  EXPECT_NE(third.message().find("page 6 is already used by sequence 1"), std::string::npos)
      << third;
  ASSERT_TRUE(cache.AssignPages(2, std::vector<int32_t>{4, 1, 2}).ok());
  EXPECT_EQ(cache.PageRefs(4), 2);
  EXPECT_EQ(cache.PageRefs(2), 1);
  EXPECT_EQ(cache.free_pages(), 4);  // 0, 3, 5, 7
  ASSERT_TRUE(cache.Reserve(2, 9).ok());
  const std::vector<float> k2 = Random(3 * kEntry, 23), v2 = Random(3 * kEntry, 24);
  cache.Write(2, 0, 6, 3, k2.data(), v2.data());
  cache.SetLength(2, 9);
  std::vector<float> k(9 * kEntry), v(9 * kEntry);
  cache.Read(2, 0, 0, 9, k.data(), v.data());
  EXPECT_TRUE(std::equal(k1.begin(), k1.begin() + 6 * kEntry, k.begin()));
  EXPECT_TRUE(std::equal(v1.begin(), v1.begin() + 6 * kEntry, v.begin()));
  EXPECT_TRUE(std::equal(k2.begin(), k2.end(), k.begin() + 6 * kEntry));
  // 1's own values are untouched.
  std::vector<float> again(7 * kEntry), again_v(7 * kEntry);
  cache.Read(1, 0, 0, 7, again.data(), again_v.data());
  EXPECT_EQ(again, k1);

  // A forward that would write into a shared page is refused.
  cache.SetLength(1, 5);  // (as if 1 were at position 5, inside page 1)
  const absl::Status write_shared = cache.Reserve(1, 7);
  EXPECT_EQ(write_shared.code(), absl::StatusCode::kFailedPrecondition) << write_shared;
  EXPECT_NE(write_shared.message().find("page 1"), std::string::npos) << write_shared;
  cache.SetLength(1, 7);

  // A shared page returns to the pool with its last holder, and keeps its
  // content: a later sequence may start from it again.
  ASSERT_TRUE(cache.RemoveSequence(1).ok());
  EXPECT_EQ(cache.PageRefs(4), 1);
  EXPECT_EQ(cache.free_pages(), 5);  // + page 6
  ASSERT_TRUE(cache.RemoveSequence(2).ok());
  EXPECT_EQ(cache.free_pages(), 8);
  ASSERT_TRUE(cache.AddSequence(3, kPage).ok());
  ASSERT_TRUE(cache.AssignPages(3, std::vector<int32_t>{4, 0}).ok());
  std::vector<float> k3(kPage * kEntry), v3(kPage * kEntry);
  ASSERT_TRUE(cache.Reserve(3, kPage + 1).ok());
  cache.Read(3, 0, 0, kPage, k3.data(), v3.data());
  EXPECT_TRUE(std::equal(k3.begin(), k3.end(), k1.begin()));
}

TEST(PagedKvCacheTest, ACachedLengthMustFitThePoolAndNeedsAssignedPages) {
  PagedKvCache assigned = MakeAssigned(4, 3);
  EXPECT_EQ(assigned.AddSequence(1, 13).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(assigned.AddSequence(1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(assigned.AddSequence(1, 12).ok());
  // Its pages must come before a forward reads them.
  EXPECT_EQ(assigned.Reserve(1, 13).code(), absl::StatusCode::kFailedPrecondition);
  KvCacheOptions options;
  options.num_pages = 4;
  options.page_size_tokens = 3;
  auto own = PagedKvCache::Create(kShape, options);
  ASSERT_TRUE(own.ok());
  const absl::Status s = own->AddSequence(1, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("caller_assigns_pages"), std::string::npos) << s;
}

// A cache with two state slots of 3 and 5 floats per sequence (a recurrent
// model's layers), caller-assigned pages of 4 positions.
PagedKvCache MakeWithState() {
  KvCacheShape shape = kShape;
  shape.state_floats = {3, 5};
  KvCacheOptions options;
  options.num_pages = 6;
  options.page_size_tokens = 4;
  options.caller_assigns_pages = true;
  auto cache = PagedKvCache::Create(shape, options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

void FillState(PagedKvCache& cache, int64_t seq, float base) {
  for (int slot = 0; slot < 2; ++slot) {
    float* s = cache.State(seq, slot);
    for (int i = 0; i < (slot == 0 ? 3 : 5); ++i) s[i] = base + 10.0f * slot + i;
  }
}

TEST(PagedKvCacheTest, ASequenceResumesFromTheStateSnapshotOfItsPrefix) {
  PagedKvCache cache = MakeWithState();
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(cache.AssignPages(1, std::vector<int32_t>{0, 1}).ok());
  ASSERT_TRUE(cache.Reserve(1, 8).ok());
  cache.SetLength(1, 8);
  FillState(cache, 1, 100.0f);
  const StateSnapshotRef snap{.slot = 4, .hash_hi = 0xabc, .hash_lo = 0xdef};
  ASSERT_TRUE(cache.SaveStateSnapshot(1, snap).ok());
  EXPECT_EQ(cache.state_snapshots_held(), 1);
  FillState(cache, 1, 900.0f);  // the sequence moves on; the snapshot stays
  ASSERT_TRUE(cache.AddSequence(2, 8, snap).ok());
  for (int slot = 0; slot < 2; ++slot) {
    const float* s = cache.State(2, slot);
    for (int i = 0; i < (slot == 0 ? 3 : 5); ++i) {
      EXPECT_EQ(s[i], 100.0f + 10.0f * slot + i) << slot << " " << i;
    }
  }
  // Saving over a slot replaces it; the count stays.
  ASSERT_TRUE(cache.SaveStateSnapshot(1, {.slot = 4, .hash_hi = 1, .hash_lo = 2}).ok());
  EXPECT_EQ(cache.state_snapshots_held(), 1);
}

TEST(PagedKvCacheTest, AResumeNeedsASnapshotOfThatHashAtThatLength) {
  PagedKvCache cache = MakeWithState();
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(cache.AssignPages(1, std::vector<int32_t>{0, 1}).ok());
  ASSERT_TRUE(cache.Reserve(1, 8).ok());
  cache.SetLength(1, 4);
  const StateSnapshotRef snap{.slot = 0, .hash_hi = 7, .hash_lo = 8};
  ASSERT_TRUE(cache.SaveStateSnapshot(1, snap).ok());
  // No snapshot, an empty slot, another hash, another length.
  absl::Status s = cache.AddSequence(2, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("snapshot"), std::string::npos) << s;
  EXPECT_EQ(cache.AddSequence(2, 4, {.slot = 3, .hash_hi = 7, .hash_lo = 8}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.AddSequence(2, 4, {.slot = 0, .hash_hi = 7, .hash_lo = 9}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.AddSequence(2, 8, snap).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(cache.HasSequence(2));
  EXPECT_TRUE(cache.AddSequence(2, 4, snap).ok());
  // A snapshot sits at a block boundary, in a slot of the pool's range,
  // outside a speculative history, of a known sequence.
  cache.SetLength(1, 6);
  EXPECT_EQ(cache.SaveStateSnapshot(1, {.slot = 1}).code(), absl::StatusCode::kFailedPrecondition);
  cache.SetLength(1, 8);
  EXPECT_EQ(cache.SaveStateSnapshot(1, {.slot = 6}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.SaveStateSnapshot(1, {.slot = -1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.SaveStateSnapshot(9, {.slot = 1}).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(cache.KeepStateHistory(1, 2).ok());
  EXPECT_EQ(cache.SaveStateSnapshot(1, {.slot = 1}).code(), absl::StatusCode::kFailedPrecondition);
  // A cache without state has none to snapshot.
  PagedKvCache plain = MakeAssigned(4, 4);
  ASSERT_TRUE(plain.AddSequence(1).ok());
  EXPECT_EQ(plain.SaveStateSnapshot(1, {.slot = 0}).code(), absl::StatusCode::kInvalidArgument);
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
// num_pages and page_size_tokens arrive in a Setup message from the cluster
// config: a pool past the machine's memory (or one whose size overflows) is
// a clear error, not a std::bad_alloc or an out-of-memory kill.
TEST(PagedKvCacheTest, RefusesAPoolLargerThanTheMachine) {
  KvCacheOptions options;
  options.page_size_tokens = 16;
  options.num_pages = int64_t{1} << 40;
  absl::StatusOr<PagedKvCache> huge = PagedKvCache::Create(kShape, options);
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(huge.status().message(), ::testing::HasSubstr("kv.num_pages"));
  options.num_pages = INT64_MAX;  // bytes overflow int64
  EXPECT_EQ(PagedKvCache::Create(kShape, options).status().code(),
            absl::StatusCode::kResourceExhausted);
  options.num_pages = 3;
  options.page_size_tokens = INT32_MAX;
  EXPECT_EQ(PagedKvCache::Create(kShape, options).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace exl3serve::worker
