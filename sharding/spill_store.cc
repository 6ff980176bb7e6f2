#include "sharding/spill_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <utility>
#include <cctype>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/trellis_decode.h"
#include "sharding/safetensors_atomic_file.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

// ---------------------------------------------------------------------------
// CRC32C.

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};

uint32_t Crc32cScalar(const uint8_t* p, size_t n, uint32_t crc) {
  static const Crc32cTable table;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n > 0) {
    c32 = __builtin_ia32_crc32qi(c32, *p++);
    --n;
  }
  return c32;
}
#endif

// ---------------------------------------------------------------------------
// Checksum file. Little-endian, host order (x86-64/aarch64 only):
//   "EXL3SPC1" | u32 block_bytes | u32 0 | u64 table_bytes | u64 source_size |
//   i64 source_mtime_ns | u64 source_offset | u64 name_len | name |
//   u64 num_blocks | u32 crc[num_blocks] | u32 Crc32c(everything before)
// The source fields identify the bytes the checksums describe: a changed
// checkpoint (size, mtime or offset) invalidates the file.
constexpr char kChecksumMagic[8] = {'E', 'X', 'L', '3', 'S', 'P', 'C', '1'};

struct SourceIdentity {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t offset = 0;
  uint64_t table_bytes = 0;
  std::string name;
  bool operator==(const SourceIdentity&) const = default;
};

struct ChecksumFile {
  SourceIdentity source;
  uint32_t block_bytes = 0;
  std::vector<uint32_t> crcs;
};

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof v);
}

std::string SerializeChecksums(const ChecksumFile& f) {
  std::string out(kChecksumMagic, sizeof kChecksumMagic);
  Put<uint32_t>(&out, f.block_bytes);
  Put<uint32_t>(&out, 0);
  Put<uint64_t>(&out, f.source.table_bytes);
  Put<uint64_t>(&out, f.source.size);
  Put<int64_t>(&out, f.source.mtime_ns);
  Put<uint64_t>(&out, f.source.offset);
  Put<uint64_t>(&out, f.source.name.size());
  out += f.source.name;
  Put<uint64_t>(&out, f.crcs.size());
  out.append(reinterpret_cast<const char*>(f.crcs.data()), f.crcs.size() * sizeof(uint32_t));
  Put<uint32_t>(&out, Crc32c(out.data(), out.size()));
  return out;
}

// Parses a checksum file; nullopt-like error string when malformed.
bool ParseChecksums(const std::string& bytes, ChecksumFile* f) {
  size_t pos = 0;
  auto get = [&](auto* v) {
    if (bytes.size() - pos < sizeof *v) return false;
    std::memcpy(v, bytes.data() + pos, sizeof *v);
    pos += sizeof *v;
    return true;
  };
  if (bytes.size() < sizeof kChecksumMagic + 4) return false;
  uint32_t stored_crc;
  std::memcpy(&stored_crc, bytes.data() + bytes.size() - 4, 4);
  if (Crc32c(bytes.data(), bytes.size() - 4) != stored_crc) return false;
  if (std::memcmp(bytes.data(), kChecksumMagic, sizeof kChecksumMagic) != 0) return false;
  pos = sizeof kChecksumMagic;
  uint32_t reserved;
  uint64_t name_len, num_blocks;
  if (!get(&f->block_bytes) || !get(&reserved) || !get(&f->source.table_bytes) ||
      !get(&f->source.size) || !get(&f->source.mtime_ns) || !get(&f->source.offset) ||
      !get(&name_len) || name_len > bytes.size() - pos) {
    return false;
  }
  f->source.name.assign(bytes.data() + pos, name_len);
  pos += name_len;
  if (!get(&num_blocks) || num_blocks > (bytes.size() - pos) / 4) return false;
  f->crcs.resize(num_blocks);
  std::memcpy(f->crcs.data(), bytes.data() + pos, num_blocks * 4);
  pos += num_blocks * 4;
  if (pos + 4 != bytes.size()) return false;
  const uint64_t expect_blocks =
      f->block_bytes == 0 ? 0 : (f->source.table_bytes + f->block_bytes - 1) / f->block_bytes;
  return f->block_bytes != 0 && expect_blocks == num_blocks;
}

absl::Status WriteChecksums(const std::string& path, const ChecksumFile& f) {
  EXL3_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(path));
  EXL3_RETURN_IF_ERROR(out->Append(SerializeChecksums(f)));
  return out->Commit();
}

// Reads exactly `size` bytes at `offset`; DataLoss on a short read.
absl::Status PreadFull(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path) {
  auto* p = static_cast<uint8_t*>(dst);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("pread ", path, " at ", offset + done));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": file ends at ", offset + done, ", expected ",
                                              offset + size, " bytes (truncated?)"));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Scans `table_bytes` bytes at `offset` of `fd` and returns their block
// checksums; when `copy_to` is set, also appends the bytes there. Uses a
// bounded buffer (kScanChunk).
constexpr uint64_t kScanChunkBytes = 4ull << 20;
absl::StatusOr<std::vector<uint32_t>> ScanBlocks(int fd, const std::string& path, uint64_t offset,
                                                 uint64_t table_bytes, uint32_t block_bytes,
                                                 AtomicFileWriter* copy_to) {
  std::vector<uint32_t> crcs;
  crcs.reserve((table_bytes + block_bytes - 1) / block_bytes);
  const uint64_t chunk = std::max<uint64_t>(kScanChunkBytes / block_bytes, 1) * block_bytes;
  std::vector<uint8_t> buffer(std::min(chunk, table_bytes));
  for (uint64_t pos = 0; pos < table_bytes; pos += chunk) {
    const uint64_t n = std::min(chunk, table_bytes - pos);
    EXL3_RETURN_IF_ERROR(PreadFull(fd, buffer.data(), n, offset + pos, path));
    for (uint64_t b = 0; b < n; b += block_bytes) {
      crcs.push_back(Crc32c(buffer.data() + b, std::min<uint64_t>(block_bytes, n - b)));
    }
    if (copy_to != nullptr) EXL3_RETURN_IF_ERROR(copy_to->Append({buffer.data(), n}));
  }
  return crcs;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) { return ReadFileToString(path); }

// A file-name-safe key for a tensor of a source file.
std::string CacheKey(const std::string& source_path, std::string_view tensor) {
  std::string safe;
  for (char c : tensor) safe += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_') ? c : '_';
  std::error_code ec;
  std::string canonical = std::filesystem::weakly_canonical(source_path, ec).string();
  if (ec) canonical = source_path;
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (char c : canonical) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return absl::StrFormat("%s-%016x", safe, h);
}

// Closes a descriptor on scope exit unless released.
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  int Release() { return std::exchange(fd, -1); }
};

uint32_t BlockCount(uint64_t table_bytes, uint32_t block_bytes) {
  return static_cast<uint32_t>((table_bytes + block_bytes - 1) / block_bytes);
}

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool have_sse42 = __builtin_cpu_supports("sse4.2");
  crc = have_sse42 ? Crc32cSse42(p, size, crc) : Crc32cScalar(p, size, crc);
#else
  crc = Crc32cScalar(p, size, crc);
#endif
  return ~crc;
}

// ---------------------------------------------------------------------------
// One shard of the row cache: a CLOCK over a fixed number of slots whose row
// bytes live in one arena (allocated untouched, so pages become resident only
// as rows are cached).
class SpillStore::CacheShard {
 public:
  CacheShard(uint64_t capacity_rows, uint64_t row_bytes)
      : capacity_(capacity_rows),
        row_bytes_(row_bytes),
        arena_(capacity_rows ? new uint8_t[capacity_rows * row_bytes] : nullptr),
        ids_(capacity_rows, -1),
        referenced_(capacity_rows, 0) {
    index_.reserve(capacity_rows);
  }

  // Copies row `id` to `dst` if cached.
  bool CopyIfPresent(int64_t id, uint8_t* dst) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(id);
    if (it == index_.end()) return false;
    referenced_[it->second] = 1;
    std::memcpy(dst, arena_.get() + it->second * row_bytes_, row_bytes_);
    return true;
  }

  void Insert(int64_t id, const uint8_t* row) {
    if (capacity_ == 0) return;
    absl::MutexLock lock(&mu_);
    if (index_.contains(id)) return;
    // CLOCK: sweep until a slot without its reference bit (clearing bits on
    // the way); at most two turns.
    while (ids_[hand_] >= 0 && referenced_[hand_]) {
      referenced_[hand_] = 0;
      hand_ = (hand_ + 1) % capacity_;
    }
    const uint64_t slot = hand_;
    hand_ = (hand_ + 1) % capacity_;
    if (ids_[slot] >= 0) index_.erase(ids_[slot]);
    else ++size_;
    ids_[slot] = id;
    referenced_[slot] = 0;
    std::memcpy(arena_.get() + slot * row_bytes_, row, row_bytes_);
    index_[id] = slot;
  }

  uint64_t size() {
    absl::MutexLock lock(&mu_);
    return size_;
  }
  uint64_t capacity() const { return capacity_; }

 private:
  // Fixed after construction.
  const uint64_t capacity_;
  const uint64_t row_bytes_;
  absl::Mutex mu_;
  // The arena's pointer is fixed; its bytes are guarded by mu_.
  const std::unique_ptr<uint8_t[]> arena_;
  std::vector<int64_t> ids_ ABSL_GUARDED_BY(mu_);  // -1: free
  std::vector<uint8_t> referenced_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int64_t, uint64_t> index_ ABSL_GUARDED_BY(mu_);
  uint64_t hand_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t size_ ABSL_GUARDED_BY(mu_) = 0;
};

// A run of adjacent blocks [first_block, end_block) to read with one pread,
// and the (sorted, unique) missing rows it serves: misses[begin, end).
struct SpillStore::Extent {
  uint64_t first_block = 0, end_block = 0;
  size_t begin = 0, end = 0;
};

SpillStore::~SpillStore() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<SpillStore>> SpillStore::Open(const SafetensorsFile& file,
                                                             std::string_view tensor,
                                                             const SpillStoreOptions& options) {
  const TensorInfo* info = file.Find(tensor);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), ": no tensor `", std::string(tensor), "` to spill"));
  }
  if (info->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor `", info->name,
                                                   "` has shape ", ShapeToString(info->shape),
                                                   ", a spilled table must be 2-D [rows, width]"));
  }
  if (info->dtype != DType::kBF16 && info->dtype != DType::kF16 && info->dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor `", info->name, "` is ",
                                                   std::string(DTypeName(info->dtype)),
                                                   ", a spilled table must be BF16, F16 or F32"));
  }
  const uint32_t bb = options.block_bytes;
  if (bb < 4096 || bb > (16u << 20) || (bb & (bb - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill store: block_bytes must be a power of two in [4096, 16 MiB], got ", bb));
  }
  if (options.source == SpillSource::kExtract && options.cache_dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill store: extracting `", info->name, "` needs a cache directory (cache_dir)"));
  }

  std::unique_ptr<SpillStore> store(new SpillStore());
  store->tensor_name_ = info->name;
  store->rows_ = info->shape[0];
  store->width_ = info->shape[1];
  store->dtype_ = info->dtype;
  store->row_bytes_ = static_cast<uint64_t>(store->width_) * DTypeSize(info->dtype);
  store->table_bytes_ = info->ByteSize();
  store->max_read_bytes_ = std::max<uint64_t>(options.max_read_bytes, bb);

  // The source's identity.
  FdGuard src{::open(file.path().c_str(), O_RDONLY | O_CLOEXEC)};
  const int src_fd = src.fd;
  if (src_fd < 0) return ErrnoStatus(errno, absl::StrCat("open ", file.path()));
  struct stat st {};
  if (::fstat(src_fd, &st) != 0) return ErrnoStatus(errno, absl::StrCat("fstat ", file.path()));
  SourceIdentity source;
  source.size = static_cast<uint64_t>(st.st_size);
  source.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  source.offset = file.data_section_offset() + info->begin;
  source.table_bytes = store->table_bytes_;
  source.name = info->name;

  std::string key;
  if (!options.cache_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.cache_dir, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat("spill store: cannot create cache_dir ",
                                                      options.cache_dir, ": ", ec.message()));
    }
    key = options.cache_dir + "/" + CacheKey(file.path(), info->name);
    store->checksum_path_ = key + ".crc";
  }

  // Existing checksum file that matches the source (and our table), if any.
  ChecksumFile sums;
  bool have_sums = false;
  if (!store->checksum_path_.empty()) {
    absl::StatusOr<std::string> bytes = ReadSmallFile(store->checksum_path_);
    have_sums = bytes.ok() && ParseChecksums(*bytes, &sums) && sums.source == source;
  }

  if (options.source == SpillSource::kInPlace) {
    store->fd_ = src.Release();
    store->data_path_ = file.path();
    store->base_offset_ = source.offset;
    if (!have_sums) {
      sums.source = source;
      sums.block_bytes = bb;
      EXL3_ASSIGN_OR_RETURN(sums.crcs, ScanBlocks(src_fd, file.path(), source.offset,
                                                  source.table_bytes, bb, nullptr));
      if (!store->checksum_path_.empty()) {
        EXL3_RETURN_IF_ERROR(WriteChecksums(store->checksum_path_, sums));
      }
    }
  } else {
    const std::string rows_path = key + ".rows";
    store->data_path_ = rows_path;
    bool reuse = false;
    FdGuard rows;
    if (have_sums) {
      rows.fd = ::open(rows_path.c_str(), O_RDONLY | O_CLOEXEC);
      const int fd = rows.fd;
      struct stat rs {};
      reuse = fd >= 0 && ::fstat(fd, &rs) == 0 &&
              static_cast<uint64_t>(rs.st_size) == source.table_bytes;
      if (reuse && options.verify_extracted_on_open) {
        absl::StatusOr<std::vector<uint32_t>> now =
            ScanBlocks(fd, rows_path, 0, source.table_bytes, sums.block_bytes, nullptr);
        reuse = now.ok() && *now == sums.crcs;
      }
      if (!reuse) ::close(rows.Release());
    }
    if (!reuse) {
      // (Re)extract: copy and checksum in one pass over the source, then
      // publish the copy before its checksums (a crash in between leaves
      // checksums that do not match the copy, so the next open redoes it).
      std::error_code ec;
      std::filesystem::remove(store->checksum_path_, ec);
      EXL3_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(rows_path));
      sums.source = source;
      sums.block_bytes = bb;
      EXL3_ASSIGN_OR_RETURN(sums.crcs, ScanBlocks(src_fd, file.path(), source.offset,
                                                  source.table_bytes, bb, out.get()));
      EXL3_RETURN_IF_ERROR(out->Commit());
      EXL3_RETURN_IF_ERROR(WriteChecksums(store->checksum_path_, sums));
      rows.fd = ::open(rows_path.c_str(), O_RDONLY | O_CLOEXEC);
      if (rows.fd < 0) return ErrnoStatus(errno, absl::StrCat("open ", rows_path));
      store->extracted_now_ = true;
    }
    store->fd_ = rows.Release();
    store->base_offset_ = 0;
  }
  store->block_bytes_ = sums.block_bytes;
  store->block_crcs_ = std::move(sums.crcs);
  if (store->block_crcs_.size() != BlockCount(store->table_bytes_, store->block_bytes_)) {
    return absl::InternalError("spill store: checksum count does not match the table");
  }

  // The cache: capacity in rows, split over up to 16 shards (each shard at
  // least 64 rows, so CLOCK has room to work).
  const uint64_t per_row = store->row_bytes_ + kSpillCacheSlotOverheadBytes;
  const uint64_t capacity = std::min<uint64_t>(options.cache_budget_bytes / per_row,
                                               static_cast<uint64_t>(store->rows_));
  const uint64_t num_shards = std::clamp<uint64_t>(capacity / 64, 1, 16);
  for (uint64_t s = 0; s < num_shards; ++s) {
    const uint64_t cap = capacity / num_shards + (s < capacity % num_shards ? 1 : 0);
    store->shards_.push_back(std::make_unique<CacheShard>(cap, store->row_bytes_));
  }
  return store;
}

SpillStore::CacheShard& SpillStore::ShardFor(int64_t id) const {
  // Spread consecutive ids (hot token ranges) over shards.
  const uint64_t h = static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull;
  return *shards_[(h >> 32) % shards_.size()];
}

void SpillStore::ConvertRow(const uint8_t* raw, float* out) const {
  switch (dtype_) {
    case DType::kF32:
      std::memcpy(out, raw, row_bytes_);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < width_; ++i) {
        uint16_t b;
        std::memcpy(&b, raw + 2 * i, 2);
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        std::memcpy(&out[i], &u, 4);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < width_; ++i) {
        uint16_t b;
        std::memcpy(&b, raw + 2 * i, 2);
        out[i] = kernels::HalfBitsToFloat(b);
      }
      break;
    default:
      break;  // excluded at Open
  }
}

absl::Status SpillStore::ReadExtent(const Extent& extent, std::vector<uint8_t>* buffer) const {
  const uint64_t begin = extent.first_block * block_bytes_;
  const uint64_t end = std::min<uint64_t>(extent.end_block * block_bytes_, table_bytes_);
  buffer->resize(end - begin);
  const auto t0 = std::chrono::steady_clock::now();
  EXL3_RETURN_IF_ERROR(PreadFull(fd_, buffer->data(), end - begin, base_offset_ + begin, data_path_));
  const uint64_t ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  reads_.fetch_add(1, std::memory_order_relaxed);
  bytes_read_.fetch_add(end - begin, std::memory_order_relaxed);
  read_latency_sum_ns_.fetch_add(ns, std::memory_order_relaxed);
  const auto& bounds = SpillStoreStats::kReadLatencyBoundsUs;
  const size_t bucket =
      std::lower_bound(bounds.begin(), bounds.end(), (ns + 999) / 1000) - bounds.begin();
  read_latency_buckets_[bucket].fetch_add(1, std::memory_order_relaxed);

  for (uint64_t b = extent.first_block; b < extent.end_block; ++b) {
    const uint64_t off = (b - extent.first_block) * block_bytes_;
    const uint64_t len = std::min<uint64_t>(block_bytes_, table_bytes_ - b * block_bytes_);
    const uint32_t crc = Crc32c(buffer->data() + off, len);
    if (crc != block_crcs_[b]) {
      return absl::DataLossError(absl::StrFormat(
          "spill store: %s: tensor `%s`: block %d (file bytes [%d, %d)) checksum mismatch: "
          "stored crc32c %08x, read %08x; the file changed or is corrupt since its checksums "
          "were made (%s)",
          data_path_, tensor_name_, b, base_offset_ + b * block_bytes_,
          base_offset_ + b * block_bytes_ + len, block_crcs_[b], crc,
          checksum_path_.empty() ? std::string("checksums in memory")
                                 : absl::StrCat("delete ", checksum_path_,
                                                " only if the file is known good")));
    }
  }
  return absl::OkStatus();
}

absl::Status SpillStore::Lookup(std::span<const int64_t> ids, float* out) const {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  rows_requested_.fetch_add(ids.size(), std::memory_order_relaxed);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= rows_) {
      return absl::OutOfRangeError(absl::StrCat("spill store: tensor `", tensor_name_, "`: id ",
                                                ids[i], " at index ", i, " is outside [0, ",
                                                rows_, ")"));
    }
  }
  // Phase 1: serve what the cache holds; collect the misses (id, position).
  std::vector<uint8_t> raw(row_bytes_);
  std::vector<std::pair<int64_t, size_t>> misses;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ShardFor(ids[i]).CopyIfPresent(ids[i], raw.data())) {
      ConvertRow(raw.data(), out + i * width_);
    } else {
      misses.emplace_back(ids[i], i);
    }
  }
  hits_.fetch_add(ids.size() - misses.size(), std::memory_order_relaxed);
  misses_.fetch_add(misses.size(), std::memory_order_relaxed);
  if (misses.empty()) return absl::OkStatus();

  // Phase 2: sort the misses by offset and coalesce the blocks they touch
  // into runs of adjacent blocks, each read with one pread.
  std::sort(misses.begin(), misses.end());
  std::vector<uint8_t> buffer;
  size_t i = 0;
  while (i < misses.size()) {
    Extent extent;
    extent.begin = i;
    extent.first_block = misses[i].first * row_bytes_ / block_bytes_;
    extent.end_block = ((misses[i].first + 1) * row_bytes_ - 1) / block_bytes_ + 1;
    size_t j = i + 1;
    while (j < misses.size()) {
      const uint64_t fb = misses[j].first * row_bytes_ / block_bytes_;
      const uint64_t eb = ((misses[j].first + 1) * row_bytes_ - 1) / block_bytes_ + 1;
      if (fb > extent.end_block) break;  // a gap: start a new run
      const uint64_t new_end = std::max(extent.end_block, eb);
      if ((new_end - extent.first_block) * block_bytes_ > max_read_bytes_ &&
          misses[j].first != misses[j - 1].first) {
        break;
      }
      extent.end_block = new_end;
      ++j;
    }
    extent.end = j;
    EXL3_RETURN_IF_ERROR(ReadExtent(extent, &buffer));
    const uint64_t base = extent.first_block * block_bytes_;
    for (size_t k = extent.begin; k < extent.end; ++k) {
      const uint8_t* row = buffer.data() + (misses[k].first * row_bytes_ - base);
      ConvertRow(row, out + misses[k].second * width_);
      if (k == extent.begin || misses[k].first != misses[k - 1].first) {
        ShardFor(misses[k].first).Insert(misses[k].first, row);
      }
    }
    i = j;
  }
  return absl::OkStatus();
}

SpillStoreStats SpillStore::stats() const {
  SpillStoreStats s;
  s.lookups = lookups_.load(std::memory_order_relaxed);
  s.rows_requested = rows_requested_.load(std::memory_order_relaxed);
  s.hits = hits_.load(std::memory_order_relaxed);
  s.misses = misses_.load(std::memory_order_relaxed);
  s.reads = reads_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.read_latency_sum_ns = read_latency_sum_ns_.load(std::memory_order_relaxed);
  for (size_t b = 0; b < s.read_latency_buckets.size(); ++b) {
    s.read_latency_buckets[b] = read_latency_buckets_[b].load(std::memory_order_relaxed);
  }
  for (const auto& shard : shards_) {
    s.cached_rows += shard->size();
    s.cache_capacity_rows += shard->capacity();
  }
  return s;
}

// ---------------------------------------------------------------------------
// Policy.

SpillStoreOptions SpillPolicy::StoreOptions() const {
  SpillStoreOptions o;
  o.cache_budget_bytes = cache_budget_bytes;
  o.cache_dir = cache_dir;
  o.source = extract ? SpillSource::kExtract : SpillSource::kInPlace;
  return o;
}

absl::StatusOr<std::vector<std::string>> ChooseSpilledTensors(
    const SpillPolicy& policy, std::span<const SpillCandidate> candidates,
    uint64_t other_resident_bytes) {
  std::vector<bool> spilled(candidates.size(), false);
  for (const std::string& name : policy.spill) {
    auto it = std::find_if(candidates.begin(), candidates.end(),
                           [&](const SpillCandidate& c) { return c.name == name; });
    if (it == candidates.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("spill: `", name, "` is not a row-lookup table of this model"));
    }
    spilled[it - candidates.begin()] = true;
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (policy.auto_threshold_bytes > 0 && candidates[i].bytes >= policy.auto_threshold_bytes) {
      spilled[i] = true;
    }
  }
  if (policy.memory_budget_bytes > 0) {
    auto resident = [&]() {
      uint64_t total = other_resident_bytes;
      for (size_t i = 0; i < candidates.size(); ++i) {
        total += spilled[i] ? policy.cache_budget_bytes : candidates[i].bytes;
      }
      return total;
    };
    while (resident() > policy.memory_budget_bytes) {
      // Spilling the largest resident candidate saves the most.
      int best = -1;
      for (size_t i = 0; i < candidates.size(); ++i) {
        if (!spilled[i] && candidates[i].bytes > policy.cache_budget_bytes &&
            (best < 0 || candidates[i].bytes > candidates[best].bytes)) {
          best = static_cast<int>(i);
        }
      }
      if (best < 0) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "spill: resident weights need ", resident(), " bytes with every table spilled, over "
            "memory_budget_bytes ", policy.memory_budget_bytes));
      }
      spilled[best] = true;
    }
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (spilled[i]) names.push_back(candidates[i].name);
  }
  return names;
}

}  // namespace exl3serve::sharding
