// spill_store_bench: rows/s and p50/p99 batch-lookup latency of
// sharding::SpillStore against raw pread of the same rows, in the same run,
// for uniform and Zipf(1.1) ids, cold and warm.
//
//   spill_store_bench [--rows 65536] [--width 2048] [--cache-mib 32] [--batch 64]
//                     [--batches 400] [--block-kib 16] [--dir /tmp]
//
// The table is BF16 [rows, width] in a safetensors file written under --dir.
// "cold": before the run the file's pages are dropped from the page cache with
// posix_fadvise(POSIX_FADV_DONTNEED) (only clean pages go; the writer fsyncs)
// and the store starts with an empty row cache. "warm": the same ids again
// after reading the whole file once (page cache holds the table; the row
// cache is as the cold run left it). Raw pread reads each row (row bytes only, no checksum, no cache,
// no conversion) one pread per row, in id order of the batch.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "sharding/safetensors.h"
#include "sharding/spill_store.h"

namespace {

using namespace exl3serve::sharding;
using Clock = std::chrono::steady_clock;

struct Result {
  double rows_per_s = 0, p50_us = 0, p99_us = 0;
};

Result Summarise(std::vector<double> batch_us, int64_t rows) {
  double total = 0;
  for (double v : batch_us) total += v;
  std::sort(batch_us.begin(), batch_us.end());
  Result r;
  r.rows_per_s = rows / (total * 1e-6);
  r.p50_us = batch_us[batch_us.size() / 2];
  r.p99_us = batch_us[std::min(batch_us.size() - 1, batch_us.size() * 99 / 100)];
  return r;
}

void DropPageCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 65536, width = 2048, cache_mib = 32, batch = 64, batches = 400, block_kib = 16;
  std::string dir = "/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "--rows") rows = std::atoll(v);
    else if (flag == "--width") width = std::atoll(v);
    else if (flag == "--cache-mib") cache_mib = std::atoll(v);
    else if (flag == "--batch") batch = std::atoll(v);
    else if (flag == "--batches") batches = std::atoll(v);
    else if (flag == "--block-kib") block_kib = std::atoll(v);
    else if (flag == "--dir") dir = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const std::string work = dir + "/spill_store_bench." + std::to_string(::getpid());
  std::filesystem::create_directories(work);
  const std::string path = work + "/model.safetensors";
  const char* kName = "table";
  {
    std::vector<TensorToWrite> tensors;
    TensorToWrite t;
    t.name = kName;
    t.dtype = DType::kBF16;
    t.shape = {rows, width};
    t.fill = [](std::span<uint8_t> out) {
      uint64_t x = 12345;
      for (size_t i = 0; i + 1 < out.size(); i += 2) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const uint16_t bits = static_cast<uint16_t>(0x3C00 | ((x >> 40) & 0x01FF));  // finite
        std::memcpy(&out[i], &bits, 2);
      }
      return absl::OkStatus();
    };
    tensors.push_back(std::move(t));
    if (absl::Status s = WriteSafetensorsFile(path, std::move(tensors), {}); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto file = SafetensorsFile::Open(path);
  if (!file.ok()) return 1;
  const TensorInfo* info = (*file)->Find(kName);
  const uint64_t row_bytes = width * 2;
  const uint64_t table_offset = (*file)->data_section_offset() + info->begin;
  const int raw_fd = ::open(path.c_str(), O_RDONLY);

  // Zipf(1.1) over ranks, ranks permuted over the table.
  std::vector<double> cdf(rows);
  double sum = 0;
  for (int64_t k = 0; k < rows; ++k) cdf[k] = (sum += 1.0 / std::pow(k + 1.0, 1.1));
  for (double& c : cdf) c /= sum;
  std::vector<int64_t> perm(rows);
  for (int64_t k = 0; k < rows; ++k) perm[k] = k;
  std::mt19937_64 rng(7);
  std::shuffle(perm.begin(), perm.end(), rng);

  std::printf("table: BF16 [%lld, %lld] = %.0f MiB, row %llu B; row cache %lld MiB; batches of "
              "%lld ids x %lld; checksum block %lld KiB\n",
              (long long)rows, (long long)width, rows * row_bytes / 1048576.0,
              (unsigned long long)row_bytes, (long long)cache_mib, (long long)batch,
              (long long)batches, (long long)block_kib);
  std::printf("%-8s %-5s %-10s %12s %10s %10s %9s %11s\n", "ids", "cache", "method", "rows/s",
              "p50 us", "p99 us", "hit ratio", "MiB read");

  SpillStoreOptions options;
  options.cache_budget_bytes = static_cast<uint64_t>(cache_mib) << 20;
  options.block_bytes = static_cast<uint32_t>(block_kib << 10);
  options.cache_dir = work + "/cache";  // checksums computed once, reused per store
  std::vector<float> out(batch * width);
  std::vector<uint8_t> raw(batch * row_bytes);
  for (const char* dist : {"uniform", "zipf1.1"}) {
    std::vector<std::vector<int64_t>> id_batches(batches, std::vector<int64_t>(batch));
    std::uniform_real_distribution<double> u01(0, 1);
    for (auto& ids : id_batches) {
      for (int64_t& id : ids) {
        if (dist[0] == 'u') {
          id = static_cast<int64_t>(rng() % rows);
        } else {
          const auto it = std::lower_bound(cdf.begin(), cdf.end(), u01(rng));
          id = perm[std::min<int64_t>(it - cdf.begin(), rows - 1)];
        }
      }
    }
    auto store = SpillStore::Open(**file, kName, options);
    if (!store.ok()) {
      std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
      return 1;
    }
    for (const char* temp : {"cold", "warm"}) {
      // Spill store.
      if (temp[0] == 'c') {
        DropPageCache(path);
      } else {
        std::vector<uint8_t> chunk(8 << 20);
        for (uint64_t off = 0; ::pread(raw_fd, chunk.data(), chunk.size(), off) > 0;) {
          off += chunk.size();
        }
      }
      const SpillStoreStats before = (*store)->stats();
      std::vector<double> us;
      for (const auto& ids : id_batches) {
        const auto t0 = Clock::now();
        if (!(*store)->Lookup(ids, out.data()).ok()) return 1;
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      const SpillStoreStats after = (*store)->stats();
      Result r = Summarise(us, batch * batches);
      std::printf("%-8s %-5s %-10s %12.0f %10.1f %10.1f %9.3f %11.1f\n", dist, temp, "spill",
                  r.rows_per_s, r.p50_us, r.p99_us,
                  double(after.hits - before.hits) / (after.rows_requested - before.rows_requested),
                  (after.bytes_read - before.bytes_read) / 1048576.0);
      // Raw pread of the same rows.
      if (temp[0] == 'c') DropPageCache(path);
      us.clear();
      for (const auto& ids : id_batches) {
        const auto t0 = Clock::now();
        for (size_t i = 0; i < ids.size(); ++i) {
          if (::pread(raw_fd, raw.data() + i * row_bytes, row_bytes,
                      static_cast<off_t>(table_offset + ids[i] * row_bytes)) !=
              static_cast<ssize_t>(row_bytes)) {
            return 1;
          }
        }
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      r = Summarise(us, batch * batches);
      std::printf("%-8s %-5s %-10s %12.0f %10.1f %10.1f %9s %11.1f\n", dist, temp, "raw pread",
                  r.rows_per_s, r.p50_us, r.p99_us, "-", batch * batches * row_bytes / 1048576.0);
    }
  }
  ::close(raw_fd);
  std::filesystem::remove_all(work);
  return 0;
}
