// sharding/spill_store.h — row-lookup tables (token embeddings, n-gram
// tables) that stay on local disk and are read row by row into a bounded
// in-memory cache, plus the policy that decides which tensors spill.
//
// A table is a 2-D tensor [rows, width] of BF16, F16 or F32 whose rows are
// contiguous in a file. Two sources:
//   - kInPlace: the tensor is read where it sits inside the checkpoint's
//     safetensors file (no copy);
//   - kExtract: the tensor is copied once into `cache_dir` (a `.rows` file),
//     atomically (temp name, fsync, rename), and reused by later opens while
//     its checksum file still matches the source and the bytes.
// Either way the table is covered by CRC32C checksums over fixed blocks
// (default 16 KiB, relative to the table's first byte). They are computed
// when the table is extracted or — in place — on first use (a sequential scan;
// stored in `cache_dir` when one is given, else kept in memory for this open),
// and every block read from disk is verified before any of its rows is used,
// so a changed or corrupted file gives DataLoss naming file, tensor, block and
// byte range, never a wrong row. (In place, the checksums can only vouch that
// the file is unchanged since they were computed.)
//
// Usage sketch:
//   SpillStoreOptions opt;  opt.cache_budget_bytes = 256 << 20;  opt.cache_dir = "/var/cache/x";
//   EXL3_ASSIGN_OR_RETURN(auto store, SpillStore::Open(*ckpt_file, "model.embed_tokens.weight", opt));
//   std::vector<float> rows(ids.size() * store->width());
//   EXL3_RETURN_IF_ERROR(store->Lookup(ids, rows.data()));
//
// Cost model: a missing row costs reading (and checksumming) every block it
// touches; a batch's missing rows are gathered first, sorted by offset and
// read with one pread per run of adjacent blocks (at most max_read_bytes
// each), so rows sharing a block cost one read. Reads go through the page
// cache (no O_DIRECT); the page cache is not part of this process's RSS.
#ifndef EXL3SERVE_SHARDING_SPILL_STORE_H_
#define EXL3SERVE_SHARDING_SPILL_STORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sharding/safetensors.h"

namespace exl3serve::sharding {

// CRC32C (Castagnoli), as in iSCSI/ext4: Crc32c("123456789") == 0xE3069283.
// Uses SSE4.2 when the CPU has it, else a table. `crc` continues a running
// checksum (0 to start).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

enum class SpillSource {
  kInPlace,  // read the tensor inside the checkpoint file
  kExtract,  // copy it once into cache_dir and read the copy
};

struct SpillStoreOptions {
  // --- behaviour
  SpillSource source = SpillSource::kInPlace;
  // Where extracted tables and checksum files live (created if missing).
  // Required for kExtract; for kInPlace empty means "checksums in memory,
  // recomputed (one scan of the table) at every open".
  std::string cache_dir;
  // kExtract: on open, re-read the whole extracted copy and check every block
  // against its checksums; a mismatch re-extracts. false only checks the
  // checksum file itself and the copy's size (corruption is then still caught
  // on read, as DataLoss). Cost: one sequential read of the table per open.
  bool verify_extracted_on_open = true;

  // --- performance
  // Bytes of row data the in-memory cache holds at most (rows are cached in
  // their stored dtype; each cached row also costs kSpillCacheSlotOverheadBytes
  // of index, which counts against this budget). 0 disables the cache.
  uint64_t cache_budget_bytes = 64ull << 20;
  // Checksum block size for newly written checksum files (a power of two,
  // 4 KiB..16 MiB). Smaller blocks read fewer bytes per missing row; larger
  // ones make smaller checksum files. An existing checksum file keeps its own.
  // 16 KiB: a missing row of a 4 KiB-row table reads 4x its bytes instead of
  // 16x with 64 KiB; 1.4-3.6x more rows/s for uniform ids (docs/BENCHMARKS.md).
  uint32_t block_bytes = 16u << 10;
  // Largest single pread when gathering a batch's missing rows; also bounds
  // the transient read buffer of one Lookup (plus one block).
  uint64_t max_read_bytes = 1ull << 20;
};

// Per-cached-row index overhead charged against cache_budget_bytes (slot id,
// reference bit, hash-map entry with its control byte and load factor).
inline constexpr uint64_t kSpillCacheSlotOverheadBytes = 48;

// Counters, readable at any time (each field is read atomically; the set is
// not a consistent snapshot). The metrics exporter turns these into
// exl3serve:spill_* series.
struct SpillStoreStats {
  // Upper bounds (inclusive, microseconds) of the read-latency buckets; the
  // last bucket of `read_latency_buckets` counts everything above the last.
  static constexpr std::array<uint64_t, 12> kReadLatencyBoundsUs = {
      10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000, 250000};
  uint64_t lookups = 0;       // Lookup calls
  uint64_t rows_requested = 0;
  uint64_t hits = 0;          // requested rows served from the cache
  uint64_t misses = 0;        // requested rows read from disk
  uint64_t reads = 0;         // pread calls (after coalescing)
  uint64_t bytes_read = 0;    // bytes those preads returned
  uint64_t read_latency_sum_ns = 0;
  std::array<uint64_t, kReadLatencyBoundsUs.size() + 1> read_latency_buckets{};
  uint64_t cached_rows = 0;   // rows in the cache now
  uint64_t cache_capacity_rows = 0;

  double HitRatio() const {
    return rows_requested == 0 ? 0.0 : static_cast<double>(hits) / rows_requested;
  }
};

// A table on disk with a bounded row cache.
//
// Thread safety: thread-safe. Lookup may run concurrently from any number of
// threads: the cache is split into shards, each behind its own mutex (held
// only to probe, copy a row out, or insert one; never during I/O); preads use
// one shared read-only descriptor at explicit offsets. Two threads missing
// the same row may both read it; the second insert is a no-op.
// Ownership: owns its file descriptor, checksums and cache. Keeps no pointer
// to the SafetensorsFile it was opened from.
class SpillStore {
 public:
  // Opens tensor `tensor` of `file` ([rows, width], BF16/F16/F32) per
  // `options`. kInPlace computes the block checksums (one scan) unless a
  // matching checksum file sits in cache_dir; kExtract reuses a valid
  // extracted copy or (re)extracts it (one scan of the tensor, one write).
  // Errors: NotFound for a missing tensor; InvalidArgument for a tensor that
  // is not 2-D, an unsupported dtype, kExtract without cache_dir or a bad
  // block_bytes; errno-derived codes (naming the path) for I/O failures.
  // Cost: see above; memory is the cache (filled lazily) plus 4 bytes of
  // checksum per block.
  static absl::StatusOr<std::unique_ptr<SpillStore>> Open(const SafetensorsFile& file,
                                                          std::string_view tensor,
                                                          const SpillStoreOptions& options);

  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  int64_t rows() const { return rows_; }
  int64_t width() const { return width_; }
  DType dtype() const { return dtype_; }
  // The file rows are read from (the checkpoint, or the extracted copy).
  const std::string& data_path() const { return data_path_; }
  // The checksum file, or "" when the checksums live only in memory.
  const std::string& checksum_path() const { return checksum_path_; }
  // kExtract: whether this open (re)wrote the copy (false: reused).
  bool extracted_now() const { return extracted_now_; }
  uint32_t block_bytes() const { return block_bytes_; }

  // Writes row ids[i] converted to fp32 to out[i * width() ..], for every i
  // (ids may repeat, in any order). Rows come from the cache or are read
  // from disk, verified and then cached.
  // Errors: OutOfRange for an id outside [0, rows()) (naming it and its
  // index); DataLoss for a block whose checksum does not match or a short
  // read (naming file, tensor, block and byte range); errno codes for read
  // failures. On error the contents of `out` are unspecified (possibly
  // partly written) and must not be used.
  // Requires: out holds ids.size() * width() floats.
  absl::Status Lookup(std::span<const int64_t> ids, float* out) const;

  SpillStoreStats stats() const;

 private:
  class CacheShard;
  struct Extent;
  SpillStore() = default;

  absl::Status ReadExtent(const Extent& extent, std::vector<uint8_t>* buffer) const;
  void ConvertRow(const uint8_t* raw, float* out) const;
  CacheShard& ShardFor(int64_t id) const;

  // Fixed after Open.
  std::string tensor_name_;
  std::string data_path_;
  std::string checksum_path_;
  int fd_ = -1;
  uint64_t base_offset_ = 0;  // file offset of the table's first byte
  uint64_t table_bytes_ = 0;
  int64_t rows_ = 0, width_ = 0;
  DType dtype_ = DType::kF32;
  uint64_t row_bytes_ = 0;
  uint32_t block_bytes_ = 0;
  uint64_t max_read_bytes_ = 0;
  std::vector<uint32_t> block_crcs_;
  bool extracted_now_ = false;
  std::vector<std::unique_ptr<CacheShard>> shards_;  // each has its own mutex

  // Own synchronisation (relaxed atomics: counters only).
  mutable std::atomic<uint64_t> lookups_{0}, rows_requested_{0}, hits_{0}, misses_{0};
  mutable std::atomic<uint64_t> reads_{0}, bytes_read_{0}, read_latency_sum_ns_{0};
  mutable std::array<std::atomic<uint64_t>, SpillStoreStats::kReadLatencyBoundsUs.size() + 1>
      read_latency_buckets_{};
};

// ---------------------------------------------------------------------------
// Policy: which tensors spill.

struct SpillPolicy {
  // Tensors to spill by name (e.g. "model.embed_tokens.weight").
  std::vector<std::string> spill;
  // Also spill every candidate at least this large; 0 = off.
  uint64_t auto_threshold_bytes = 0;
  // The box's memory budget for resident weights plus spill caches; when the
  // resident total would exceed it, the largest remaining candidates spill
  // too. 0 = unlimited.
  uint64_t memory_budget_bytes = 0;
  // Row cache of each spilled table (SpillStoreOptions::cache_budget_bytes).
  uint64_t cache_budget_bytes = 64ull << 20;
  // SpillStoreOptions::cache_dir; empty: tables are read in place with
  // in-memory checksums.
  std::string cache_dir;
  // Extract into cache_dir instead of reading in place (needs cache_dir).
  bool extract = false;

  SpillStoreOptions StoreOptions() const;
};

// A tensor that may spill: a row-lookup table and its resident size.
struct SpillCandidate {
  std::string name;
  uint64_t bytes = 0;  // what it costs when resident
};

// The names (in `candidates` order) that spill under `policy`:
//   1. every name in policy.spill;
//   2. every candidate with bytes >= auto_threshold_bytes (when non-zero);
//   3. while other_resident_bytes + resident candidates + a cache budget per
//      spilled table exceeds memory_budget_bytes (when non-zero), the largest
//      resident candidate.
// Errors: InvalidArgument for a policy.spill name that is not a candidate
// (naming it); ResourceExhausted when the budget cannot be met even with
// every candidate spilled (naming budget and need).
absl::StatusOr<std::vector<std::string>> ChooseSpilledTensors(
    const SpillPolicy& policy, std::span<const SpillCandidate> candidates,
    uint64_t other_resident_bytes);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_SPILL_STORE_H_
