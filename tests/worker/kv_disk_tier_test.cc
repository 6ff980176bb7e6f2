// worker::KvDiskTier, the prefix cache's disk tier on one rank: random pages
// of odd sizes round-trip through the file (and through the writer queue
// before they reach it); anything not exactly what was saved — another hash,
// a flipped byte in the header or the data, a truncated file, a slot never
// written, a save dropped because the queue was full — is a miss with its
// counter, never a hit with wrong bytes. Also the cache-facing helpers:
// loads go only into free pages.
#include "worker/model/kv_disk_tier.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/kv_cache.h"

namespace exl3serve::worker {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class KvDiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kv_disk_tier_test." + std::to_string(getpid()) + "." +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::unique_ptr<KvDiskTier> Open(int64_t slots, int64_t slot_bytes,
                                   int64_t max_queued = int64_t{64} << 20) {
    auto tier = KvDiskTier::Open({.path = path(), .slots = slots, .slot_bytes = slot_bytes,
                                  .max_queued_bytes = max_queued});
    EXPECT_TRUE(tier.ok()) << tier.status();
    return tier.ok() ? *std::move(tier) : nullptr;
  }
  std::string path() const { return (dir_ / "kv.bin").string(); }

  // Flips one byte of the file at `offset`.
  void FlipByte(int64_t offset) {
    const int fd = ::open(path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b = 0;
    ASSERT_EQ(pread(fd, &b, 1, offset), 1);
    b ^= 0x5a;
    ASSERT_EQ(pwrite(fd, &b, 1, offset), 1);
    ::close(fd);
  }

  fs::path dir_;
};

std::vector<uint8_t> RandomPage(int64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> page(static_cast<size_t>(bytes));
  for (uint8_t& b : page) b = static_cast<uint8_t>(rng());
  return page;
}

constexpr int64_t kSlotBytes = 1003;  // odd: not a multiple of anything

TEST_F(KvDiskTierTest, RandomPagesRoundTripFromTheQueueAndFromTheFile) {
  auto tier = Open(13, kSlotBytes);
  ASSERT_NE(tier, nullptr);
  std::mt19937_64 rng(7);
  std::vector<std::vector<uint8_t>> pages;
  std::vector<std::pair<uint64_t, uint64_t>> hashes;
  for (int64_t s = 0; s < 13; ++s) {
    pages.push_back(RandomPage(kSlotBytes, 100 + static_cast<uint32_t>(s)));
    hashes.emplace_back(rng(), rng());
    tier->Save(s, hashes.back().first, hashes.back().second, pages.back());
  }
  // Immediately (some still queued) and after the writer drained: the same bytes.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) tier->Flush();
    for (int64_t s = 12; s >= 0; --s) {
      std::vector<uint8_t> got(kSlotBytes, 0xee);  // poisoned
      ASSERT_TRUE(tier->Load(s, hashes[s].first, hashes[s].second, got)) << "slot " << s;
      EXPECT_EQ(got, pages[s]) << "slot " << s << " pass " << pass;
    }
  }
  const KvDiskTierStats st = tier->stats();
  EXPECT_EQ(st.saves, 13u);
  EXPECT_EQ(st.saves_dropped, 0u);
  EXPECT_EQ(st.hits, 26u);
  EXPECT_EQ(st.misses, 0u);
  EXPECT_EQ(st.bytes_written, 13u * kSlotBytes);
  // Reopening truncates: an earlier process's blocks are never trusted.
  tier.reset();
  tier = Open(13, kSlotBytes);
  std::vector<uint8_t> got(kSlotBytes);
  EXPECT_FALSE(tier->Load(0, hashes[0].first, hashes[0].second, got));
}

TEST_F(KvDiskTierTest, AnotherHashAnEmptySlotAndAnOverwrittenSlotAreMisses) {
  auto tier = Open(5, kSlotBytes);
  ASSERT_NE(tier, nullptr);
  const std::vector<uint8_t> a = RandomPage(kSlotBytes, 1), b = RandomPage(kSlotBytes, 2);
  tier->Save(2, 11, 12, a);
  tier->Flush();
  std::vector<uint8_t> got(kSlotBytes);
  EXPECT_FALSE(tier->Load(2, 11, 13, got));  // low half differs
  EXPECT_FALSE(tier->Load(2, 10, 12, got));  // high half differs
  EXPECT_FALSE(tier->Load(3, 11, 12, got));  // never written (zeros)
  tier->Save(2, 21, 22, b);                   // the slot is reused
  EXPECT_FALSE(tier->Load(2, 11, 12, got));   // the old block is gone (queued)
  tier->Flush();
  EXPECT_FALSE(tier->Load(2, 11, 12, got));   // ... and on disk
  ASSERT_TRUE(tier->Load(2, 21, 22, got));
  EXPECT_EQ(got, b);
  const KvDiskTierStats st = tier->stats();
  EXPECT_EQ(st.misses, 5u);
  EXPECT_EQ(st.hits, 1u);
}

TEST_F(KvDiskTierTest, AFlippedByteAnywhereInTheSlotIsAChecksumMiss) {
  auto tier = Open(3, kSlotBytes);
  ASSERT_NE(tier, nullptr);
  const int64_t stride = KvDiskTier::kHeaderBytes + kSlotBytes;
  std::mt19937 rng(3);
  // Header fields (magic, version, hash, length, CRCs) and data bytes.
  std::vector<int64_t> offsets = {0, 8, 16, 24, 32, 40, 44};
  for (int i = 0; i < 6; ++i) offsets.push_back(KvDiskTier::kHeaderBytes + rng() % kSlotBytes);
  offsets.push_back(stride - 1);  // the last data byte
  uint64_t want_checksum = 0;
  for (int64_t off : offsets) {
    const std::vector<uint8_t> page = RandomPage(kSlotBytes, static_cast<uint32_t>(off));
    tier->Save(1, 5, 6, page);
    tier->Flush();
    FlipByte(stride + off);
    std::vector<uint8_t> got(kSlotBytes);
    EXPECT_FALSE(tier->Load(1, 5, 6, got)) << "byte " << off << " of the slot flipped";
    const KvDiskTierStats st = tier->stats();
    // A wrong magic or version is a plain miss (not a slot of this format);
    // every other flip is caught by the header's or the data's CRC.
    if (off >= 16) ++want_checksum;
    EXPECT_EQ(st.checksum_failures, want_checksum) << "byte " << off;
  }
  // Slots around the damaged one are untouched.
  const std::vector<uint8_t> p0 = RandomPage(kSlotBytes, 90), p2 = RandomPage(kSlotBytes, 92);
  tier->Save(0, 1, 1, p0);
  tier->Save(2, 2, 2, p2);
  tier->Flush();
  std::vector<uint8_t> got(kSlotBytes);
  ASSERT_TRUE(tier->Load(0, 1, 1, got));
  EXPECT_EQ(got, p0);
  ASSERT_TRUE(tier->Load(2, 2, 2, got));
  EXPECT_EQ(got, p2);
}

TEST_F(KvDiskTierTest, ATruncatedFileIsAReadErrorMissNotACrash) {
  auto tier = Open(4, kSlotBytes);
  ASSERT_NE(tier, nullptr);
  const std::vector<uint8_t> page = RandomPage(kSlotBytes, 4);
  tier->Save(3, 7, 8, page);
  tier->Flush();
  fs::resize_file(path(), 3 * (KvDiskTier::kHeaderBytes + kSlotBytes) + 10);
  std::vector<uint8_t> got(kSlotBytes);
  EXPECT_FALSE(tier->Load(3, 7, 8, got));
  EXPECT_EQ(tier->stats().read_errors, 1u);
  EXPECT_EQ(tier->stats().misses, 1u);
}

TEST_F(KvDiskTierTest, NonsenseFromTheCoordinatorIsDroppedOrMissed) {
  auto tier = Open(4, kSlotBytes);
  ASSERT_NE(tier, nullptr);
  const std::vector<uint8_t> page = RandomPage(kSlotBytes, 5), small = RandomPage(10, 6);
  tier->Save(-1, 1, 1, page);
  tier->Save(4, 1, 1, page);
  tier->Save(0, 1, 1, small);  // wrong size
  tier->Flush();
  std::vector<uint8_t> got(kSlotBytes), wrong(kSlotBytes + 1);
  EXPECT_FALSE(tier->Load(-1, 1, 1, got));
  EXPECT_FALSE(tier->Load(4, 1, 1, got));
  EXPECT_FALSE(tier->Load(0, 1, 1, got));
  tier->Save(0, 1, 1, page);
  EXPECT_FALSE(tier->Load(0, 1, 1, wrong));  // a buffer of the wrong size
  const KvDiskTierStats st = tier->stats();
  EXPECT_EQ(st.saves_dropped, 3u);
  EXPECT_EQ(st.hits, 0u);
}

TEST_F(KvDiskTierTest, AFullQueueDropsSavesInsteadOfBlocking) {
  // Room for one queued page: a burst of saves drops some (how many depends
  // on how fast the writer is); each is then a miss, the rest are exact.
  auto tier = Open(64, kSlotBytes, kSlotBytes + KvDiskTier::kHeaderBytes);
  ASSERT_NE(tier, nullptr);
  std::vector<std::vector<uint8_t>> pages;
  for (int64_t s = 0; s < 64; ++s) {
    pages.push_back(RandomPage(kSlotBytes, 200 + static_cast<uint32_t>(s)));
    tier->Save(s, 9, static_cast<uint64_t>(s), pages.back());
  }
  tier->Flush();
  const KvDiskTierStats st = tier->stats();
  EXPECT_EQ(st.saves + st.saves_dropped, 64u);
  uint64_t hits = 0;
  for (int64_t s = 0; s < 64; ++s) {
    std::vector<uint8_t> got(kSlotBytes, 0xee);
    if (tier->Load(s, 9, static_cast<uint64_t>(s), got)) {
      ++hits;
      EXPECT_EQ(got, pages[s]) << "slot " << s;
    }
  }
  EXPECT_EQ(hits, st.saves);
  EXPECT_GE(hits, 1u);
}

TEST_F(KvDiskTierTest, OpenRefusesBadSizesAndNamesAPathItCannotCreate) {
  EXPECT_EQ(KvDiskTier::Open({.path = path(), .slots = 0, .slot_bytes = 8}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvDiskTier::Open({.path = path(), .slots = 4, .slot_bytes = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvDiskTier::Open({.path = path(), .slots = int64_t{1} << 62, .slot_bytes = 1 << 20})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::string missing = (dir_ / "no" / "such" / "dir" / "kv.bin").string();
  absl::StatusOr<std::unique_ptr<KvDiskTier>> bad =
      KvDiskTier::Open({.path = missing, .slots = 4, .slot_bytes = 8});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr(missing));
}

TEST(KvDiskPathOfRankTest, ReplacesEveryRankPlaceholder) {
  EXPECT_EQ(KvDiskPathOfRank("/nvme/kv-{rank}.bin", 3), "/nvme/kv-3.bin");
  EXPECT_EQ(KvDiskPathOfRank("/d{rank}/kv-{rank}", 12), "/d12/kv-12");
  EXPECT_EQ(KvDiskPathOfRank("/nvme/kv.bin", 1), "/nvme/kv.bin");
}

TEST_F(KvDiskTierTest, LoadsGoOnlyIntoFreePagesOfTheCache) {
  KvCacheOptions options;
  options.dtype = KvCacheDtype::kInt8;
  options.num_pages = 6;
  options.page_size_tokens = 4;
  options.caller_assigns_pages = true;
  auto cache = PagedKvCache::Create({.num_layers = 2, .num_kv_heads = 3, .head_dim = 10}, options);
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto tier = Open(8, cache->bytes_per_page());
  ASSERT_NE(tier, nullptr);
  for (int32_t p = 0; p < 6; ++p) {
    const std::vector<uint8_t> bytes = RandomPage(cache->bytes_per_page(), 300 + p);
    std::copy(bytes.begin(), bytes.end(), cache->MutablePageBytes(p).begin());
  }
  const std::vector<KvBlockTransfer> saves = {{.page = 1, .slot = 5, .hash_hi = 1, .hash_lo = 1},
                                              {.page = 4, .slot = 2, .hash_hi = 4, .hash_lo = 4},
                                              {.page = 99, .slot = 3, .hash_hi = 9, .hash_lo = 9}};
  SaveKvBlocksToDisk(*cache, tier.get(), saves);
  const std::vector<uint8_t> page1(cache->PageBytes(1).begin(), cache->PageBytes(1).end());
  const std::vector<uint8_t> page4(cache->PageBytes(4).begin(), cache->PageBytes(4).end());
  // Page 0 belongs to a live sequence: a load must not touch it.
  ASSERT_TRUE(cache->AddSequence(7).ok());
  const int32_t held[] = {0};
  ASSERT_TRUE(cache->AssignPages(7, held).ok());
  const std::vector<uint8_t> page0(cache->PageBytes(0).begin(), cache->PageBytes(0).end());
  const std::vector<KvBlockTransfer> loads = {{.page = 3, .slot = 5, .hash_hi = 1, .hash_lo = 1},
                                              {.page = 0, .slot = 2, .hash_hi = 4, .hash_lo = 4},
                                              {.page = 5, .slot = 2, .hash_hi = 4, .hash_lo = 4},
                                              {.page = 2, .slot = 3, .hash_hi = 9, .hash_lo = 9},
                                              {.page = -1, .slot = 5, .hash_hi = 1, .hash_lo = 1}};
  std::vector<uint8_t> loaded;
  LoadKvBlocksFromDisk(&*cache, tier.get(), loads, &loaded);
  EXPECT_EQ(loaded, (std::vector<uint8_t>{1, 0, 1, 0, 0}));
  EXPECT_TRUE(std::equal(page1.begin(), page1.end(), cache->PageBytes(3).begin()));
  EXPECT_TRUE(std::equal(page4.begin(), page4.end(), cache->PageBytes(5).begin()));
  EXPECT_TRUE(std::equal(page0.begin(), page0.end(), cache->PageBytes(0).begin()));
  // Without a tier every load misses.
  LoadKvBlocksFromDisk(&*cache, nullptr, loads, &loaded);
  EXPECT_EQ(loaded, (std::vector<uint8_t>(5, 0)));
}

}  // namespace
}  // namespace exl3serve::worker
