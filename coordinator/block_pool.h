// coordinator/block_pool.h — the coordinator's KV block allocator with its
// prefix cache: which blocks are free, which are held (and by how many
// sequences), and which hold the keys and values of a known token prefix.
// The ranks' paged caches follow it page for page (coordinator/scheduler.h).
//
//   BlockPool pool(num_blocks);
//   BlockHash h = ChainBlockHash(RootBlockHash("model|kv=int8"), tokens_of_block_0);
//   std::vector<int32_t> hit = pool.Match({&h, 1});      // cached blocks, in order
//   for (int32_t b : hit) pool.Acquire(b);                // now shared by this sequence
//   int32_t fresh = pool.Allocate();                      // free, or the LRU cached one
//   pool.Seal(fresh, h2);                                 // its tokens are in the cache now
//   pool.Release(fresh);                                  // stays cached until evicted
//
// A block is in exactly one of three states:
//   free      — in the free list, no hash, no holder;
//   held      — refs >= 1 sequences have it in their block tables; it may be
//               sealed (full, its hash known: other sequences may share it);
//   cached    — refs == 0 but sealed: its content is kept (nobody writes it)
//               and a Match can revive it; it sits in an LRU list and
//               Allocate evicts the least recently released one first.
// Invariants (CheckInvariants(), the tests after every step):
//   P1  free + cached + held == num_blocks; available() == free + cached.
//   P2  a hash maps to at most one block and that block's hash is it.
//   P3  a block's refs equal the number of block tables holding it (the
//       scheduler's side of the contract; the pool sees Acquire/Release).
//
// The hash of block k of a sequence chains over the hash of block k-1 (the
// root for k = 0) and the block's token ids, so equal hashes mean equal
// prefixes (SHA-256, truncated to 128 bits: a collision needs ~2^64 blocks,
// and a client cannot craft one to read another's cached prefix). The root
// carries whatever else changes the keys and values (model, KV precision).
//
// Thread safety: thread-compatible (the engine's scheduler thread owns it).
#ifndef EXL3SERVE_COORDINATOR_BLOCK_POOL_H_
#define EXL3SERVE_COORDINATOR_BLOCK_POOL_H_

#include <cstdint>
#include <list>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace exl3serve::coordinator {

struct BlockHash {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    return H::combine(std::move(h), b.hi, b.lo);
  }
};

// The chain's start for everything that changes the KV besides the tokens.
BlockHash RootBlockHash(std::string_view salt);
// The hash of a full block of `tokens` whose prefix hashes to `parent`.
BlockHash ChainBlockHash(const BlockHash& parent, std::span<const int32_t> tokens);

class BlockPool {
 public:
  // Requires: 0 < num_blocks <= INT32_MAX.
  explicit BlockPool(int64_t num_blocks);

  int64_t num_blocks() const { return num_blocks_; }
  // Blocks an Allocate can return: free ones plus cached unreferenced ones.
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  // Unreferenced blocks that still hold a cached prefix.
  int64_t cached_unreferenced() const { return static_cast<int64_t>(lru_.size()); }
  // Sealed blocks (held or not).
  int64_t sealed() const { return static_cast<int64_t>(by_hash_.size()); }
  int32_t refs(int32_t block) const { return blocks_[block].refs; }
  uint64_t evictions() const { return evictions_; }

  // A block for a new table entry, with refs = 1: a free one (the most
  // recently freed first), else the least recently released cached one,
  // whose hash is forgotten (an eviction). Requires: available() > 0.
  int32_t Allocate();
  // Takes one more reference on a block (a Match result or a held block).
  void Acquire(int32_t block);
  // Drops one reference; at zero a sealed block becomes cached (most
  // recently used end of the LRU), an unsealed one free.
  void Release(int32_t block);
  // Marks a held block as holding the prefix that hashes to `hash` (its
  // last position was written by a forward that ran). No-op when the block
  // is sealed already or another block holds that hash (the duplicate stays
  // unsealed and is freed normally).
  void Seal(int32_t block, const BlockHash& hash);
  // The blocks holding the longest cached prefix of `hashes` (block i holds
  // hashes[i]); takes no reference.
  std::vector<int32_t> Match(std::span<const BlockHash> hashes) const;
  // Forgets every hash (the ranks' caches are gone: a re-formed group, a
  // failed forward). Cached blocks become free; held blocks stay held.
  void ForgetCached();

  // Checks P1 and P2; returns a description of the first violation or "".
  std::string CheckInvariants() const;

  // Sealed blocks Allocate evicted since the last call (their content is
  // still in the pages until the caller's next forward writes them: the
  // disk tier's chance to save them).
  std::vector<std::pair<int32_t, BlockHash>> TakeEvicted() { return std::move(evicted_); }

 private:
  struct Block {
    int32_t refs = 0;
    bool sealed = false;
    BlockHash hash;
    std::list<int32_t>::iterator lru;  // valid while cached
    bool in_lru = false;
  };
  int64_t num_blocks_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;  // the back is taken next
  std::list<int32_t> lru_;     // front = least recently released
  absl::flat_hash_map<BlockHash, int32_t> by_hash_;
  uint64_t evictions_ = 0;
  std::vector<std::pair<int32_t, BlockHash>> evicted_;
};

// The coordinator's index of slots that hold something per block hash on
// every rank, placed by the coordinator: the disk tier (every rank's file has
// the same slots; worker/model/kv_disk_tier.h) and the recurrent-state
// snapshots (worker/model/kv_cache.h SaveStateSnapshot). Which block hash
// each slot holds, the slots' LRU order, and slots pinned while a load from
// them is in flight.
// The ranks verify every load, so this index may be wrong (a dropped save,
// a corrupted file) without ever giving wrong output: a failed load is
// Forget()-ten.
class BlockSlotIndex {
 public:
  explicit BlockSlotIndex(int64_t slots);  // 0 = no disk tier
  int64_t slots() const { return static_cast<int64_t>(slots_.size()); }
  bool enabled() const { return !slots_.empty(); }
  // The slot holding `hash`, or -1.
  int64_t Find(const BlockHash& hash) const;
  // A slot for a new `hash` (free, else the least recently used unpinned
  // one, whose hash is forgotten: an eviction); -1 when every slot is pinned.
  // Requires: Find(hash) == -1.
  int64_t Place(const BlockHash& hash);
  void Touch(int64_t slot);  // most recently used
  void Pin(int64_t slot) { ++slots_[slot].pins; }
  void Unpin(int64_t slot) { --slots_[slot].pins; }
  // The slot no longer holds `hash` (a load failed on some rank).
  void Forget(const BlockHash& hash);
  // Forgets everything (the ranks' files were re-created).
  void Clear();
  int64_t used() const { return static_cast<int64_t>(by_hash_.size()); }
  uint64_t evictions() const { return evictions_; }

 private:
  struct Slot {
    bool used = false;
    BlockHash hash;
    int pins = 0;
    std::list<int64_t>::iterator lru;
  };
  std::vector<Slot> slots_;
  std::vector<int64_t> free_;
  std::list<int64_t> lru_;  // used slots, front = least recently used
  absl::flat_hash_map<BlockHash, int64_t> by_hash_;
  uint64_t evictions_ = 0;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_BLOCK_POOL_H_
