#include "worker/model/kv_disk_tier.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/logging.h"
#include "sharding/spill_store.h"  // Crc32c

namespace exl3serve::worker {
namespace {

constexpr uint64_t kMagic = 0x3176696b336c7865ull;  // "exl3kiv1"
constexpr uint32_t kFormatVersion = 1;

// The 64-byte slot header, little-endian on x86-64.
struct SlotHeader {
  uint64_t magic = kMagic;
  uint32_t version = kFormatVersion;
  uint32_t reserved = 0;
  uint64_t hash_hi = 0;
  uint64_t hash_lo = 0;
  uint64_t data_bytes = 0;
  uint32_t data_crc = 0;
  uint32_t header_crc = 0;  // of the bytes before it
  uint8_t padding[16] = {};
};
static_assert(sizeof(SlotHeader) == KvDiskTier::kHeaderBytes);

uint32_t HeaderCrc(const SlotHeader& h) {
  return sharding::Crc32c(&h, offsetof(SlotHeader, header_crc));
}

// pread/pwrite of exactly n bytes; false on an error or a short transfer.
bool ReadAll(int fd, void* buf, size_t n, off_t offset) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    const ssize_t got = pread(fd, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n, off_t offset) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    const ssize_t put = pwrite(fd, p, n, offset);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
    offset += put;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvDiskTier>> KvDiskTier::Open(const KvDiskTierOptions& options) {
  if (options.slots <= 0 || options.slot_bytes <= 0 || options.max_queued_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv disk tier: slots (", options.slots, ") and slot_bytes (", options.slot_bytes,
        ") must be > 0"));
  }
  const int64_t stride = kHeaderBytes + options.slot_bytes;
  if (options.slots > INT64_MAX / stride) {
    return absl::InvalidArgumentError(absl::StrCat("kv disk tier: ", options.slots, " slots of ",
                                                   stride, " bytes overflow a file size"));
  }
  const int fd = open(options.path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("kv disk tier: cannot create ", options.path, ": ", std::strerror(errno)));
  }
  // Truncated to zero first: a slot written by an earlier process (another
  // model, another salt) can never be read as this one's.
  if (ftruncate(fd, options.slots * stride) != 0) {
    const int e = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("kv disk tier: cannot size ", options.path,
                                                     " to ", options.slots * stride,
                                                     " bytes: ", std::strerror(e)));
  }
  return std::unique_ptr<KvDiskTier>(new KvDiskTier(options, fd));
}

KvDiskTier::KvDiskTier(const KvDiskTierOptions& options, int fd)
    : options_(options), fd_(fd), writer_([this] { WriterLoop(); }) {}

KvDiskTier::~KvDiskTier() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  writer_.join();
  close(fd_);
}

void KvDiskTier::Save(int64_t slot, uint64_t hash_hi, uint64_t hash_lo,
                      std::span<const uint8_t> page) {
  const int64_t bytes = kHeaderBytes + options_.slot_bytes;
  absl::MutexLock lock(&mu_);
  if (slot < 0 || slot >= options_.slots ||
      static_cast<int64_t>(page.size()) != options_.slot_bytes ||
      queued_bytes_ + bytes > options_.max_queued_bytes) {
    ++stats_.saves_dropped;
    // The slot may still hold an older block: it must not be served for
    // this hash, and the older one was evicted by the coordinator anyway.
    if (slot >= 0 && slot < options_.slots) pending_.erase(slot);
    return;
  }
  auto buffer = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
  SlotHeader header;
  header.hash_hi = hash_hi;
  header.hash_lo = hash_lo;
  header.data_bytes = static_cast<uint64_t>(page.size());
  header.data_crc = sharding::Crc32c(page.data(), page.size());
  header.header_crc = HeaderCrc(header);
  std::memcpy(buffer->data(), &header, sizeof(header));
  std::memcpy(buffer->data() + kHeaderBytes, page.data(), page.size());
  queue_.push_back({slot, buffer});
  pending_[slot] = buffer;
  queued_bytes_ += bytes;
  ++stats_.saves;
}

bool KvDiskTier::Load(int64_t slot, uint64_t hash_hi, uint64_t hash_lo, std::span<uint8_t> page) {
  Buffer buffer;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.loads;
    if (slot < 0 || slot >= options_.slots ||
        static_cast<int64_t>(page.size()) != options_.slot_bytes) {
      ++stats_.misses;
      return false;
    }
    if (auto it = pending_.find(slot); it != pending_.end()) buffer = it->second;
  }
  std::vector<uint8_t> read;
  const uint8_t* bytes;
  if (buffer != nullptr) {
    bytes = buffer->data();
  } else {
    read.resize(static_cast<size_t>(kHeaderBytes + options_.slot_bytes));
    if (!ReadAll(fd_, read.data(), read.size(), SlotOffset(slot))) {
      absl::MutexLock lock(&mu_);
      ++stats_.read_errors;
      ++stats_.misses;
      return false;
    }
    bytes = read.data();
  }
  SlotHeader header;
  std::memcpy(&header, bytes, sizeof(header));
  const uint8_t* data = bytes + kHeaderBytes;
  bool checksum_failed = false;
  bool ok = header.magic == kMagic && header.version == kFormatVersion;
  if (ok && HeaderCrc(header) != header.header_crc) {
    ok = false;
    checksum_failed = true;
  }
  ok = ok && header.hash_hi == hash_hi && header.hash_lo == hash_lo &&
       header.data_bytes == static_cast<uint64_t>(options_.slot_bytes);
  if (ok && sharding::Crc32c(data, static_cast<size_t>(options_.slot_bytes)) != header.data_crc) {
    ok = false;
    checksum_failed = true;
  }
  if (ok) std::memcpy(page.data(), data, page.size());
  absl::MutexLock lock(&mu_);
  if (buffer == nullptr) stats_.bytes_read += static_cast<uint64_t>(options_.slot_bytes);
  if (ok) {
    ++stats_.hits;
  } else {
    ++stats_.misses;
    if (checksum_failed) ++stats_.checksum_failures;
  }
  return ok;
}

void KvDiskTier::Flush() {
  absl::MutexLock lock(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.empty() && !writing_;
  };
  mu_.Await(absl::Condition(&drained));
}

KvDiskTierStats KvDiskTier::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void KvDiskTier::WriterLoop() {
  while (true) {
    PendingWrite write;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || stopping_;
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, drained
      write = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
    }
    const bool ok = WriteAll(fd_, write.bytes->data(), write.bytes->size(), SlotOffset(write.slot));
    absl::MutexLock lock(&mu_);
    writing_ = false;
    queued_bytes_ -= static_cast<int64_t>(write.bytes->size());
    if (ok) {
      stats_.bytes_written += static_cast<uint64_t>(options_.slot_bytes);
    } else {
      ++stats_.write_errors;
      EXL3_LOG(kWarning) << "kv disk tier: write of slot " << write.slot << " to "
                         << options_.path << " failed: " << std::strerror(errno);
    }
    // Served from memory until written; a failed write stays a miss on disk
    // (the header there is an older block's or none), so it is dropped too.
    auto it = pending_.find(write.slot);
    if (it != pending_.end() && it->second == write.bytes) pending_.erase(it);
  }
}

std::string KvDiskPathOfRank(const std::string& path, int rank) {
  return absl::StrReplaceAll(path, {{"{rank}", absl::StrCat(rank)}});
}

void SaveKvBlocksToDisk(const PagedKvCache& cache, KvDiskTier* tier,
                        std::span<const KvBlockTransfer> saves) {
  if (tier == nullptr) return;
  for (const KvBlockTransfer& t : saves) {
    if (t.page < 0 || t.page >= cache.options().num_pages) continue;
    tier->Save(t.slot, t.hash_hi, t.hash_lo, cache.PageBytes(t.page));
  }
}

void LoadKvBlocksFromDisk(PagedKvCache* cache, KvDiskTier* tier,
                          std::span<const KvBlockTransfer> loads, std::vector<uint8_t>* loaded) {
  loaded->assign(loads.size(), 0);
  if (tier == nullptr) return;
  for (size_t i = 0; i < loads.size(); ++i) {
    const KvBlockTransfer& t = loads[i];
    if (t.page < 0 || t.page >= cache->options().num_pages || cache->PageRefs(t.page) != 0) {
      continue;
    }
    (*loaded)[i] = tier->Load(t.slot, t.hash_hi, t.hash_lo, cache->MutablePageBytes(t.page)) ? 1 : 0;
  }
}

}  // namespace exl3serve::worker
