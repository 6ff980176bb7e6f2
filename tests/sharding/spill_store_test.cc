// SpillStore: tables on disk read through a bounded row cache. Every row a
// lookup returns is compared with an independent reference — the value
// formula the file was written from, never the store's own decoding — for
// BF16/F16/F32 tables 4x larger than the cache budget, under uniform and
// Zipf(1.1) ids, while the process's resident memory growth is measured
// against the budget plus a stated slack. Corruption (a flipped byte in the
// checkpoint or in an extracted copy, a damaged checksum file) must surface
// as DataLoss naming the block, or as a re-extraction; four threads look up
// concurrently.
#include "sharding/spill_store.h"

#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"
#include "sharding/safetensors.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding {
namespace {

using ::testing::HasSubstr;

constexpr char kTable[] = "model.embed_tokens.weight";

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// The reference: element (row, col) of a table of `dtype`, chosen to be
// exactly representable in that dtype (so the expected fp32 is this value).
float Expected(DType dtype, int64_t row, int64_t col) {
  const uint64_t h = Mix(static_cast<uint64_t>(row) * 1000003ull + static_cast<uint64_t>(col) + 17);
  switch (dtype) {
    case DType::kBF16:  // 8 significant bits
      return static_cast<float>(static_cast<int>(h % 255) - 127) / 16.0f;
    case DType::kF16:  // 11 significant bits
      return static_cast<float>(static_cast<int>(h % 2001) - 1000) / 64.0f;
    default: {  // any finite float
      uint32_t bits = static_cast<uint32_t>(h);
      if (((bits >> 23) & 0xFF) == 0xFF) bits &= ~(1u << 30);
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

// Writes a [rows, width] table of `dtype` (plus a small tensor before it, so
// the table does not start the data section) to `path`.
void WriteTable(const std::string& path, DType dtype, int64_t rows, int64_t width) {
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromFloats("model.norm.weight", {3}, {1.f, 2.f, 3.f}));
  TensorToWrite table;
  table.name = kTable;
  table.dtype = dtype;
  table.shape = {rows, width};
  table.fill = [=](std::span<uint8_t> out) {
    const int64_t es = DTypeSize(dtype);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; ++c) {
        const float v = Expected(dtype, r, c);
        uint8_t* dst = out.data() + (r * width + c) * es;
        if (dtype == DType::kF32) {
          std::memcpy(dst, &v, 4);
        } else {
          uint32_t bits;
          std::memcpy(&bits, &v, 4);
          const uint16_t half = dtype == DType::kBF16 ? static_cast<uint16_t>(bits >> 16)
                                                      : kernels::FloatToHalfBits(v);
          std::memcpy(dst, &half, 2);
        }
      }
    }
    return absl::OkStatus();
  };
  tensors.push_back(std::move(table));
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}).ok());
}

// Every element of out (ids.size() rows) against the reference, bitwise.
::testing::AssertionResult RowsMatch(DType dtype, std::span<const int64_t> ids, int64_t width,
                                     const std::vector<float>& out) {
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t c = 0; c < width; ++c) {
      const float want = Expected(dtype, ids[i], c);
      const float got = out[i * width + c];
      if (std::memcmp(&want, &got, 4) != 0) {
        return ::testing::AssertionFailure() << "row " << ids[i] << " col " << c << ": got "
                                             << got << ", stored " << want;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

uint64_t RssBytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// Flips one bit of the byte at `offset` of `path`.
void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  uint8_t b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

// Zipf(s) over [0, n) with ranks permuted, so hot rows are spread over the file.
class ZipfIds {
 public:
  ZipfIds(int64_t n, double s, uint32_t seed) : cdf_(n), perm_(n) {
    double sum = 0;
    for (int64_t k = 0; k < n; ++k) cdf_[k] = (sum += 1.0 / std::pow(static_cast<double>(k + 1), s));
    for (double& c : cdf_) c /= sum;
    for (int64_t k = 0; k < n; ++k) perm_[k] = k;
    std::mt19937_64 rng(seed);
    std::shuffle(perm_.begin(), perm_.end(), rng);
  }
  int64_t Next(std::mt19937_64& rng) {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    const auto it = std::lower_bound(cdf_.begin(), cdf_.end(), u);
    return perm_[std::min<int64_t>(it - cdf_.begin(), cdf_.size() - 1)];
  }

 private:
  std::vector<double> cdf_;
  std::vector<int64_t> perm_;
};

uint32_t Seed() { return static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed()); }

TEST(Crc32cTest, MatchesTheStandardCheckValue) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // Continuing a running checksum equals one pass.
  EXPECT_EQ(Crc32c("56789", 5, Crc32c("1234", 4)), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
}

// --- a table 4x the budget, every row exact, RSS bounded -------------------

// Budget and slack of the memory test. The slack covers what the store holds
// besides the cache — the open-time scan buffer (4 MiB, freed but possibly
// kept by malloc), one gather buffer (max_read_bytes = 1 MiB) — plus the
// test's own batch buffers and allocator noise.
constexpr uint64_t kBudgetBytes = 8ull << 20;
constexpr uint64_t kSlackBytes = 8ull << 20;
constexpr uint64_t kTableBytes = 4 * kBudgetBytes;

class SpillStoreDTypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(SpillStoreDTypeTest, ReturnsStoredRowsWithResidentMemoryWithinBudget) {
  const DType dtype = GetParam();
  const int64_t width = 1024;
  const int64_t rows = static_cast<int64_t>(kTableBytes / (width * DTypeSize(dtype)));
  testing::ScratchDir dir;
  WriteTable(dir.File("model.safetensors"), dtype, rows, width);
  const uint32_t seed = Seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " dtype " << DTypeName(dtype));

  // Everything the test itself needs is allocated before the baseline.
  ZipfIds zipf(rows, 1.1, seed);
  std::mt19937_64 rng(seed);
  constexpr int kBatch = 64;
  std::vector<int64_t> ids(kBatch);
  std::vector<float> out(kBatch * width);
  auto file = SafetensorsFile::Open(dir.File("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();

  // Return freed heap pages to the kernel first, so memory the store reuses
  // from earlier frees (the table writer's buffer) counts as growth too.
  ::malloc_trim(0);
  const uint64_t rss_before = RssBytes();
  SpillStoreOptions options;
  options.cache_budget_bytes = kBudgetBytes;
  auto store = SpillStore::Open(**file, kTable, options);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ((*store)->rows(), rows);
  ASSERT_EQ((*store)->width(), width);
  uint64_t rss_peak = RssBytes();

  for (const char* dist : {"uniform", "zipf"}) {
    for (int batch = 0; batch < 120; ++batch) {
      for (int64_t& id : ids) {
        id = dist[0] == 'u' ? static_cast<int64_t>(rng() % rows) : zipf.Next(rng);
      }
      if (batch % 10 == 0) ids[1] = ids[0];  // repeats within a batch
      std::fill(out.begin(), out.end(), std::nanf(""));  // poison
      ASSERT_TRUE((*store)->Lookup(ids, out.data()).ok());
      ASSERT_TRUE(RowsMatch(dtype, ids, width, out)) << dist << " batch " << batch;
      rss_peak = std::max(rss_peak, RssBytes());
    }
  }
  const SpillStoreStats stats = (*store)->stats();
  const uint64_t growth = rss_peak > rss_before ? rss_peak - rss_before : 0;
  std::printf("[spill] %s table %llu MiB, cache budget %llu MiB: RSS growth %.2f MiB (limit %llu "
              "MiB = budget + %llu MiB slack); cached %llu/%llu rows, hit ratio %.3f, %llu preads, "
              "%.1f MiB read\n",
              std::string(DTypeName(dtype)).c_str(), (unsigned long long)(kTableBytes >> 20),
              (unsigned long long)(kBudgetBytes >> 20), growth / 1048576.0,
              (unsigned long long)((kBudgetBytes + kSlackBytes) >> 20),
              (unsigned long long)(kSlackBytes >> 20), (unsigned long long)stats.cached_rows,
              (unsigned long long)stats.cache_capacity_rows, stats.HitRatio(),
              (unsigned long long)stats.reads, stats.bytes_read / 1048576.0);
  EXPECT_LE(growth, kBudgetBytes + kSlackBytes);
  // The cache was really used up to its budget (so the bound above is tight)
  // and the table really is 4x that budget.
  EXPECT_GE(stats.cached_rows, stats.cache_capacity_rows * 9 / 10);
  EXPECT_GE(stats.cache_capacity_rows * width * DTypeSize(dtype), kBudgetBytes * 9 / 10);
  EXPECT_LE(stats.cache_capacity_rows * (width * DTypeSize(dtype) + kSpillCacheSlotOverheadBytes),
            kBudgetBytes);
  EXPECT_EQ(stats.hits + stats.misses, stats.rows_requested);
  EXPECT_GT(stats.hits, 0u);
  EXPECT_GT(stats.misses, 0u);
  uint64_t bucketed = 0;
  for (uint64_t c : stats.read_latency_buckets) bucketed += c;
  EXPECT_EQ(bucketed, stats.reads);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, SpillStoreDTypeTest,
                         ::testing::Values(DType::kBF16, DType::kF16, DType::kF32),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// --- corruption ------------------------------------------------------------

TEST(SpillStoreTest, FlippedByteInCheckpointIsDataLossNamingTheBlock) {
  testing::ScratchDir dir;
  const std::string path = dir.File("model.safetensors");
  const int64_t rows = 1024, width = 64;  // F32: 256 KiB = 16 blocks of 16 KiB (the default)
  WriteTable(path, DType::kF32, rows, width);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  const TensorInfo* info = (*file)->Find(kTable);
  const uint64_t table_offset = (*file)->data_section_offset() + info->begin;
  SpillStoreOptions options;
  options.cache_budget_bytes = 0;  // every lookup reads the disk
  options.cache_dir = dir.File("cache");
  auto store = SpillStore::Open(**file, kTable, options);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ((*store)->block_bytes(), 16u << 10);

  // Row 600 lives in block 9 (bytes 153600.. of the table; 9 * 16384 = 147456).
  FlipByte(path, table_offset + 600 * width * 4 + 5);
  std::vector<float> out(width);
  const int64_t bad = 600;
  const absl::Status status = (*store)->Lookup({&bad, 1}, out.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("block 9"));
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr(kTable));
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("[", table_offset + 9 * 16384, ", ", table_offset + 10 * 16384, ")")));
  // Rows of the other blocks are still served, exactly.
  std::vector<int64_t> good = {0, 100, 1000};
  std::vector<float> rows_out(good.size() * width);
  ASSERT_TRUE((*store)->Lookup(good, rows_out.data()).ok());
  EXPECT_TRUE(RowsMatch(DType::kF32, good, width, rows_out));
  // A batch mixing good rows with the bad one fails as a whole.
  std::vector<int64_t> mixed = {0, 600, 1000};
  EXPECT_EQ((*store)->Lookup(mixed, rows_out.data()).code(), absl::StatusCode::kDataLoss);
}

TEST(SpillStoreTest, ExtractionIsReusedAndRedoneWhenCorrupted) {
  testing::ScratchDir dir;
  const std::string path = dir.File("model.safetensors");
  const int64_t rows = 2000, width = 96;
  WriteTable(path, DType::kBF16, rows, width);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  SpillStoreOptions options;
  options.source = SpillSource::kExtract;
  options.cache_dir = dir.File("cache");
  options.cache_budget_bytes = 64 << 10;
  std::vector<int64_t> ids = {0, 1, 777, 1999, 1000, 3};
  std::vector<float> out(ids.size() * width);

  auto check_rows = [&](const SpillStore& store) {
    std::fill(out.begin(), out.end(), std::nanf(""));
    absl::Status s = store.Lookup(ids, out.data());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(RowsMatch(DType::kBF16, ids, width, out));
  };
  std::string rows_path;
  {
    auto first = SpillStore::Open(**file, kTable, options);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE((*first)->extracted_now());
    EXPECT_NE((*first)->data_path(), path);
    rows_path = (*first)->data_path();
    check_rows(**first);
  }
  {
    auto second = SpillStore::Open(**file, kTable, options);
    ASSERT_TRUE(second.ok());
    EXPECT_FALSE((*second)->extracted_now()) << "a valid copy must be reused";
    check_rows(**second);
  }
  // A flipped byte in the copy: without the open-time check it is caught on
  // read; with it (the default) the copy is redone.
  FlipByte(rows_path, 777 * width * 2 + 3);
  {
    SpillStoreOptions lazy = options;
    lazy.verify_extracted_on_open = false;
    lazy.cache_budget_bytes = 0;
    auto third = SpillStore::Open(**file, kTable, lazy);
    ASSERT_TRUE(third.ok());
    EXPECT_FALSE((*third)->extracted_now());
    const int64_t id = 777;
    const absl::Status s = (*third)->Lookup({&id, 1}, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr("block 9"));  // 777*192 = 149184 bytes: block 9 of 16 KiB
    EXPECT_THAT(s.message(), HasSubstr(rows_path));
  }
  {
    auto fourth = SpillStore::Open(**file, kTable, options);
    ASSERT_TRUE(fourth.ok());
    EXPECT_TRUE((*fourth)->extracted_now()) << "a corrupted copy must be re-extracted";
    check_rows(**fourth);
  }
  // A damaged checksum file: re-extract too.
  const std::string crc_path = SpillStore::Open(**file, kTable, options).value()->checksum_path();
  FlipByte(crc_path, 20);
  {
    auto fifth = SpillStore::Open(**file, kTable, options);
    ASSERT_TRUE(fifth.ok());
    EXPECT_TRUE((*fifth)->extracted_now());
    check_rows(**fifth);
  }
}

TEST(SpillStoreTest, InPlaceChecksumsAreStoredAndReused) {
  testing::ScratchDir dir;
  const std::string path = dir.File("model.safetensors");
  WriteTable(path, DType::kF16, 500, 64);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  SpillStoreOptions options;
  options.cache_dir = dir.File("cache");
  auto first = SpillStore::Open(**file, kTable, options);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)->data_path(), path);
  ASSERT_FALSE((*first)->checksum_path().empty());
  EXPECT_TRUE(std::filesystem::exists((*first)->checksum_path()));
  // Corrupting the stored checksums themselves is noticed (they are
  // recomputed from the unchanged checkpoint), never trusted.
  FlipByte((*first)->checksum_path(), 60);
  auto second = SpillStore::Open(**file, kTable, options);
  ASSERT_TRUE(second.ok());
  std::vector<int64_t> ids = {0, 499, 250};
  std::vector<float> out(ids.size() * 64);
  ASSERT_TRUE((*second)->Lookup(ids, out.data()).ok());
  EXPECT_TRUE(RowsMatch(DType::kF16, ids, 64, out));
}

// --- concurrency -----------------------------------------------------------

TEST(SpillStoreTest, FourThreadsLookUpConcurrentlyAndExactly) {
  testing::ScratchDir dir;
  const std::string path = dir.File("model.safetensors");
  const int64_t rows = 8192, width = 256;  // BF16: 4 MiB
  WriteTable(path, DType::kBF16, rows, width);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  SpillStoreOptions options;
  options.cache_budget_bytes = 512 << 10;  // ~1/8 of the table: constant eviction
  auto store = SpillStore::Open(**file, kTable, options);
  ASSERT_TRUE(store.ok());
  const uint32_t seed = Seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  ZipfIds zipf(rows, 1.1, seed);

  constexpr int kThreads = 4;
  std::latch start(kThreads);
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      ZipfIds local = zipf;
      std::vector<int64_t> ids(32);
      std::vector<float> out(ids.size() * width);
      start.arrive_and_wait();  // all threads enter the store together
      for (int batch = 0; batch < 150 && failures[t].empty(); ++batch) {
        for (int64_t& id : ids) id = (t % 2) ? local.Next(rng) : static_cast<int64_t>(rng() % rows);
        std::fill(out.begin(), out.end(), std::nanf(""));
        absl::Status s = (*store)->Lookup(ids, out.data());
        if (!s.ok()) {
          failures[t] = s.ToString();
        } else if (auto m = RowsMatch(DType::kBF16, ids, width, out); !m) {
          failures[t] = m.message();
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  const SpillStoreStats stats = (*store)->stats();
  EXPECT_EQ(stats.rows_requested, uint64_t{kThreads} * 150 * 32);
  EXPECT_EQ(stats.hits + stats.misses, stats.rows_requested);
}

// --- argument errors -------------------------------------------------------

TEST(SpillStoreTest, RejectsIdsOutsideTheTableAndBadTensors) {
  testing::ScratchDir dir;
  const std::string path = dir.File("model.safetensors");
  WriteTable(path, DType::kF32, 10, 8);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto store = SpillStore::Open(**file, kTable, {});
  ASSERT_TRUE(store.ok());
  std::vector<int64_t> ids = {3, 10};
  std::vector<float> out(16);
  const absl::Status s = (*store)->Lookup(ids, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("id 10 at index 1"));
  EXPECT_EQ(SpillStore::Open(**file, "model.norm.weight", {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // 1-D
  EXPECT_EQ(SpillStore::Open(**file, "nope", {}).status().code(), absl::StatusCode::kNotFound);
  SpillStoreOptions extract;
  extract.source = SpillSource::kExtract;  // without cache_dir
  EXPECT_EQ(SpillStore::Open(**file, kTable, extract).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --- policy ----------------------------------------------------------------

TEST(SpillPolicyTest, SpillsNamedTablesThoseOverTheThresholdAndTheLargestOverBudget) {
  const std::vector<SpillCandidate> candidates = {
      {"embed", 1000}, {"ngram_a", 5000}, {"ngram_b", 3000}};
  SpillPolicy named;
  named.spill = {"ngram_b"};
  EXPECT_THAT(*ChooseSpilledTensors(named, candidates, 0), ::testing::ElementsAre("ngram_b"));

  SpillPolicy threshold;
  threshold.auto_threshold_bytes = 3000;
  EXPECT_THAT(*ChooseSpilledTensors(threshold, candidates, 0),
              ::testing::ElementsAre("ngram_a", "ngram_b"));

  SpillPolicy budget;
  budget.cache_budget_bytes = 100;
  budget.memory_budget_bytes = 500 + 1000 + 3000 + 100;  // other + embed + ngram_b + one cache
  EXPECT_THAT(*ChooseSpilledTensors(budget, candidates, 500), ::testing::ElementsAre("ngram_a"));
  budget.memory_budget_bytes = 500 + 1000 + 100 + 100;
  EXPECT_THAT(*ChooseSpilledTensors(budget, candidates, 500),
              ::testing::ElementsAre("ngram_a", "ngram_b"));
  budget.memory_budget_bytes = 600;  // even all spilled needs 500 + 300
  EXPECT_EQ(ChooseSpilledTensors(budget, candidates, 500).status().code(),
            absl::StatusCode::kResourceExhausted);

  SpillPolicy unknown;
  unknown.spill = {"lm_head.weight"};
  EXPECT_EQ(ChooseSpilledTensors(unknown, candidates, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::sharding
