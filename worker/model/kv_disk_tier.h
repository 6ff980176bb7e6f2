// worker/model/kv_disk_tier.h — the prefix cache's second tier on one rank:
// a bounded file on local disk of fixed-size slots, each holding one KV page
// (this rank's shard of one cached block) evicted from memory, to be read
// back when a later prompt has that prefix again.
//
//   EXL3_ASSIGN_OR_RETURN(auto tier, KvDiskTier::Open({.path = "/nvme/kv-rank0", .slots = 4096,
//                                                      .slot_bytes = cache.bytes_per_page()}));
//   tier->Save(slot, hash, cache.PageBytes(page));          // copies, writes later
//   bool hit = tier->Load(slot, hash, cache.MutablePageBytes(page));
//
// The coordinator places blocks in slots (like pages: coordinator/block_pool.h
// keeps the index of what is on disk); a rank only stores and verifies. Slot
// s sits at offset s * (kHeaderBytes + slot_bytes): a 64-byte header (magic,
// format version, the block's 128-bit hash, the data length and its CRC32C,
// and a CRC32C of the header itself), then the page bytes.
//
// Never blocking a step: Save copies the page into a bounded queue and
// returns; one writer thread writes the queue to the file. A full queue
// drops the save (counted): that slot is then a miss, not a wait. Load reads
// synchronously (a disk read on a hit is the price of skipping the prefill)
// and serves a slot still in the queue from memory.
//
// Never wrong output: Load returns true only when the slot's header carries
// the expected hash and both checksums match; anything else (never written,
// dropped, overwritten, a torn or corrupted file, an I/O error) is a miss,
// counted, and the page's content is then unspecified (the coordinator
// recomputes those positions).
//
// Thread safety: Save/Load/stats from one thread (the rank's step thread)
// at a time, concurrently with the writer thread (internal mutex).
#ifndef EXL3SERVE_WORKER_MODEL_KV_DISK_TIER_H_
#define EXL3SERVE_WORKER_MODEL_KV_DISK_TIER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/api/step_executor.h"
#include "worker/model/kv_cache.h"

namespace exl3serve::worker {

struct KvDiskTierOptions {
  std::string path;        // the file (created or truncated to size)
  int64_t slots = 0;       // > 0
  int64_t slot_bytes = 0;  // one page's bytes (PagedKvCache::bytes_per_page), > 0
  // Bytes of saves waiting for the writer at most; beyond, saves are dropped.
  int64_t max_queued_bytes = int64_t{64} << 20;
};

struct KvDiskTierStats {
  uint64_t saves = 0;              // Save calls queued
  uint64_t saves_dropped = 0;      // queue full
  uint64_t bytes_written = 0;      // page bytes written to the file
  uint64_t write_errors = 0;
  uint64_t loads = 0;              // Load calls
  uint64_t hits = 0;               // verified and copied
  uint64_t misses = 0;             // anything else (includes the three below)
  uint64_t checksum_failures = 0;  // header or data CRC mismatch
  uint64_t read_errors = 0;
  uint64_t bytes_read = 0;
};

class KvDiskTier {
 public:
  static constexpr int64_t kHeaderBytes = 64;

  // Creates (or truncates) the file at its full size and starts the writer.
  // Errors: InvalidArgument for non-positive sizes or a total that overflows;
  // the OS error (path named) when the file cannot be created or sized.
  static absl::StatusOr<std::unique_ptr<KvDiskTier>> Open(const KvDiskTierOptions& options);
  ~KvDiskTier();  // drains the queue, then closes the file

  const KvDiskTierOptions& options() const { return options_; }

  // Queues `page` (slot_bytes) for slot `slot` under `hash`. A slot out of
  // range or a wrong size is dropped (counted as dropped; the coordinator
  // sent nonsense, the rank keeps serving).
  void Save(int64_t slot, uint64_t hash_hi, uint64_t hash_lo, std::span<const uint8_t> page);
  // Reads slot `slot` into `page`; true iff it holds `hash` intact.
  bool Load(int64_t slot, uint64_t hash_hi, uint64_t hash_lo, std::span<uint8_t> page);
  // Waits until every queued save is written (tests, shutdown).
  void Flush();

  KvDiskTierStats stats() const;

 private:
  using Buffer = std::shared_ptr<const std::vector<uint8_t>>;  // header + page
  struct PendingWrite {
    int64_t slot = 0;
    Buffer bytes;
  };
  explicit KvDiskTier(const KvDiskTierOptions& options, int fd);
  void WriterLoop();
  int64_t SlotOffset(int64_t slot) const { return slot * (kHeaderBytes + options_.slot_bytes); }

  const KvDiskTierOptions options_;
  const int fd_;

  mutable absl::Mutex mu_;
  std::deque<PendingWrite> queue_ ABSL_GUARDED_BY(mu_);
  // Latest queued (or being written) save per slot: Load serves it from memory.
  absl::flat_hash_map<int64_t, Buffer> pending_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  KvDiskTierStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread writer_;
};

// `path` with every "{rank}" replaced by the rank number (one file per rank
// when several ranks share a disk).
std::string KvDiskPathOfRank(const std::string& path, int rank);

// What a rank does with the coordinator's transfers. SaveKvBlocksToDisk
// queues each page (a page out of range is skipped); without a tier it does
// nothing. LoadKvBlocksFromDisk reads each slot into its page when the page
// is in range and free (no sequence holds it: a load never touches a live
// sequence), setting (*loaded)[i] = 1 on a verified hit; without a tier
// every entry misses.
void SaveKvBlocksToDisk(const PagedKvCache& cache, KvDiskTier* tier,
                        std::span<const KvBlockTransfer> saves);
void LoadKvBlocksFromDisk(PagedKvCache* cache, KvDiskTier* tier,
                          std::span<const KvBlockTransfer> loads, std::vector<uint8_t>* loaded);

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_KV_DISK_TIER_H_
