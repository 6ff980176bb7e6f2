// worker/model/kv_cache.h — the paged key/value cache of one model: a pool of
// fixed-size pages (page_size_tokens positions of every layer's keys and
// values), a page table per sequence, and the storage format of the entries.
//
//   KvCacheOptions options;  options.num_pages = 64;  options.dtype = KvCacheDtype::kInt8;
//   EXL3_ASSIGN_OR_RETURN(auto cache, PagedKvCache::Create({layers, kv_heads, head_dim}, options));
//   EXL3_RETURN_IF_ERROR(cache->AddSequence(7));
//   EXL3_RETURN_IF_ERROR(cache->Reserve(7, 20));          // room for positions 0..19
//   // or, when the coordinator places sequences (caller_assigns_pages):
//   //   EXL3_RETURN_IF_ERROR(cache->AssignPages(7, block_ids));
//   cache->Write(7, layer, 0, 20, k, v);                  // per layer
//   cache->Read(7, layer, 0, 20, k_out, v_out);           // dequantized
//   cache->SetLength(7, 20);                              // commit
//
// Storage per (position, kv head): head_dim values as
//   kFp32 — exact (twice the memory of fp16; for reference runs);
//   kFp16 — IEEE half (round to nearest even);
//   kInt8 — symmetric int8, one fp32 scale absmax/127, q = round(x/scale);
//   kInt4 — symmetric 4-bit in [-7, 7] (two per byte), one fp32 scale absmax/7.
// Reading returns exactly the stored values converted to float, so a position
// reads back the same whether it was written in a chunk or alone.
//
// Shared prefix pages (the coordinator's prefix cache, coordinator/block_pool.h):
// a sequence added with a cached length n starts at Length n, and the first
// pages it is assigned may already be held by other sequences (or by none:
// a freed page keeps what was written in it until it is written again, and
// with caller_assigns_pages only the coordinator decides when that is). A
// page is shared read-only: AssignPages accepts a page in use only where it
// lies wholly inside the sequence's cached prefix, and Reserve refuses to let
// a sequence write into a page another sequence also holds. Every page has a
// reference count; it returns to the pool when the last holder is removed.
#ifndef EXL3SERVE_WORKER_MODEL_KV_CACHE_H_
#define EXL3SERVE_WORKER_MODEL_KV_CACHE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

#include "worker/api/step_executor.h"

namespace exl3serve::worker {


struct KvCacheShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // width of a key entry
  // Width of a value entry; 0 = head_dim. Multi-head latent attention
  // (DeepseekV3ForCausalLM) stores one "head" per position: the normalized
  // latent c_kv (kv_lora_rank) as its key and the roped key k_pe
  // (qk_rope_head_dim) as its value, each with its own scale when int8/int4.
  int value_dim = 0;
  int v_dim() const { return value_dim > 0 ? value_dim : head_dim; }
  // Per-sequence state beyond the KV pages (a recurrent layer's fixed-size
  // state, modules/gated_deltanet.h): floats of each state slot; empty =
  // none. Allocated zeroed when a sequence is added, freed when removed.
  std::vector<int64_t> state_floats;
  int64_t state_floats_per_sequence() const {
    int64_t n = 0;
    for (int64_t f : state_floats) n += f;
    return n;
  }
};


// Thread safety: thread-compatible; the worker's step thread owns it. Write
// and Read of different (sequence, layer) pairs may run concurrently.
// Ownership: owns its page pool.
class PagedKvCache {
 public:
  // Errors: InvalidArgument for a non-positive layer count, head_dim, page
  // size or page count, negative kv heads (0 is allowed: a tensor-parallel
  // rank without attention heads), or an odd head_dim with kInt4;
  // ResourceExhausted, naming the options, for a pool larger than the
  // machine's physical memory (or whose size overflows) or one that cannot be
  // allocated. Cost: allocates the whole pool.
  static absl::StatusOr<PagedKvCache> Create(const KvCacheShape& shape,
                                             const KvCacheOptions& options);

  const KvCacheShape& shape() const { return shape_; }
  const KvCacheOptions& options() const { return options_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_pages_.size()); }
  int64_t bytes_per_page() const { return bytes_per_page_; }

  // AlreadyExists when `seq_id` is in use. `cached_length` > 0: positions
  // [0, cached_length) are already stored in the pages the caller assigns
  // next (a shared prefix): the sequence starts at that length, and the first
  // forward writes from there. InvalidArgument for a cached_length outside
  // [0, num_pages * page_size_tokens] or > 0 without caller_assigns_pages.
  // With state (has_state()), a cached prefix needs `resume_from`: a state
  // snapshot (SaveStateSnapshot) taken at exactly cached_length under the
  // same hash, copied into the new sequence's state; FailedPrecondition
  // naming the slot otherwise (none given, an empty slot, another hash or
  // position).
  absl::Status AddSequence(int64_t seq_id, int64_t cached_length = 0,
                           const StateSnapshotRef& resume_from = {});
  // Drops the sequence's hold on its pages; a page no other sequence holds
  // returns to the pool. NotFound for an unknown id.
  absl::Status RemoveSequence(int64_t seq_id);
  bool HasSequence(int64_t seq_id) const { return sequences_.contains(seq_id); }
  // Committed positions of the sequence (0 for an unknown id).
  int64_t Length(int64_t seq_id) const;

  // Makes positions [0, capacity) writable, taking pages from the pool.
  // Errors: NotFound for an unknown id; ResourceExhausted (naming the pages
  // needed and free; kv_cache.num_pages changes it) when the pool is short;
  // then nothing is taken. With options().caller_assigns_pages it never takes
  // a page: OK when the assigned pages cover `capacity`, else
  // FailedPrecondition naming the pages held and needed; FailedPrecondition
  // too when a page covering positions [Length, capacity) — the ones the
  // forward writes — is shared with another sequence.
  absl::Status Reserve(int64_t seq_id, int64_t capacity);

  // Appends the given pages, in order, to the sequence's page table (the
  // caller's allocation: the coordinator's block table of the sequence).
  // All or nothing. A page held by other sequences is accepted only at a
  // table index wholly inside the sequence's cached prefix (AddSequence's
  // cached_length): it is then shared. Errors: NotFound for an unknown id;
  // InvalidArgument naming the first page id outside [0, num_pages) or
  // repeated in `page_ids`; FailedPrecondition naming the first page already
  // used by this sequence, or by another one outside the cached prefix
  // ("sequence S" in the message).
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids);

  // The sequence's page table (page ids in position order); empty for an
  // unknown id.
  std::vector<int64_t> PageTable(int64_t seq_id) const;
  // Sequences holding `page` (0 for a free page). Requires: page in range.
  int32_t PageRefs(int64_t page) const { return refs_[static_cast<size_t>(page)]; }

  // The raw bytes of one page (every layer's entries, bytes_per_page()): what
  // the disk tier (kv_disk_tier.h) saves and loads. Requires: page in range.
  std::span<const uint8_t> PageBytes(int64_t page) const {
    return {pool_.data() + page * bytes_per_page_, static_cast<size_t>(bytes_per_page_)};
  }
  std::span<uint8_t> MutablePageBytes(int64_t page) {
    return {pool_.data() + page * bytes_per_page_, static_cast<size_t>(bytes_per_page_)};
  }

  // Stores keys and values of positions [start, start + count) of `layer`;
  // k is [count][num_kv_heads][head_dim], v [count][num_kv_heads][v_dim()].
  // Requires: the sequence
  // exists and has reserved start + count positions (CHECKed).
  void Write(int64_t seq_id, int layer, int64_t start, int64_t count, const float* k,
             const float* v);

  // Reads positions [begin, end) of `layer` into k and v, laid out as in
  // Write. Requires: the positions are reserved (CHECKed) and were written.
  // A page's run of positions is one contiguous block of entries: fp32
  // copies it, fp16 converts it in one vectorized call; a long read
  // (attention at long contexts reads the whole context every step) splits
  // its pages over the shared CPU thread pool.
  void Read(int64_t seq_id, int layer, int64_t begin, int64_t end, float* k, float* v) const;

  // Whether entries are plain fp32 or fp16 values (no scale): attention can
  // then read them in place through RowPointers instead of Read's copy.
  bool entries_in_place() const {
    return options_.dtype == KvCacheDtype::kFp32 || options_.dtype == KvCacheDtype::kFp16;
  }
  // For positions [begin, end) of `layer`: where kv head 0's key and value
  // entries lie (kv head h: h·head_dim / h·v_dim() elements further), into
  // k_rows[i] and v_rows[i] for position begin + i. Requires:
  // entries_in_place() and the positions reserved (CHECKed). The pointers
  // stay valid until the sequence's pages change.
  void RowPointers(int64_t seq_id, int layer, int64_t begin, int64_t end, const void** k_rows,
                   const void** v_rows) const;

  // Sets the committed length. Requires: length <= reserved capacity.
  void SetLength(int64_t seq_id, int64_t length);

  // Per-sequence state (KvCacheShape::state_floats): whether the cache keeps
  // any, and slot `slot` of the sequence (fp32, state_floats[slot] values).
  // A sequence's state describes all of its committed positions: it cannot
  // start from a cached prefix (AddSequence refuses cached_length > 0) nor be
  // shortened (callers refuse rollback; SetLength CHECKs length >= Length).
  // Requires for State: the sequence exists and the slot is in range (CHECKed).
  bool has_state() const { return !shape_.state_floats.empty(); }
  float* State(int64_t seq_id, int slot);

  // Speculative verification of a sequence with state: its next Forward
  // (of at most `positions` tokens) also keeps the state after each of its
  // tokens, so that a rollback to any of them is a copy
  // (RollbackWithState). The buffer grows to the largest request and is
  // reused. Errors: NotFound for an unknown id; ResourceExhausted when the
  // buffer cannot be allocated.
  absl::Status KeepStateHistory(int64_t seq_id, int64_t positions);
  // Where a recurrent layer writes the state after the token at `position`
  // during the kept Forward: slot `slot`'s copy (state_floats[slot] floats);
  // null when no history is kept for that position.
  float* StateHistory(int64_t seq_id, int slot, int64_t position);
  // Shortens the sequence to `length` (> the length at KeepStateHistory,
  // <= its length now) and makes its state the one kept after position
  // length - 1; ends the history. FailedPrecondition when no history covers
  // that position.
  absl::Status RollbackWithState(int64_t seq_id, int64_t length);
  // Ends the history (the kept Forward's state stands). No-op without one.
  void DropStateHistory(int64_t seq_id);
  // State snapshots for the prefix cache (the caller places them, as pages;
  // StepExecutor::SaveStateSnapshots): copies the sequence's state into
  // slot snapshot.slot, recording its length and hash, replacing what the
  // slot held. Slots are allocated when first used; at most num_pages of
  // them (a snapshot belongs to one cached block). Errors: NotFound for an
  // unknown sequence; InvalidArgument for a slot outside [0, num_pages) or a
  // cache without state; FailedPrecondition for a length that is not a
  // whole number of pages (a snapshot sits at a block boundary) or while a
  // speculative history is kept; ResourceExhausted when the slot cannot be
  // allocated.
  absl::Status SaveStateSnapshot(int64_t seq_id, const StateSnapshotRef& snapshot);
  // Slots holding a snapshot.
  int64_t state_snapshots_held() const { return snapshots_held_; }
  // Bytes of state one sequence holds (0 without state).
  int64_t state_bytes_per_sequence() const {
    return shape_.state_floats_per_sequence() * static_cast<int64_t>(sizeof(float));
  }

 private:
  struct Sequence {
    std::vector<int64_t> pages;
    int64_t length = 0;
    std::vector<float> state;  // every state slot, concatenated
    // KeepStateHistory: [position - history_start][every slot], for
    // positions [history_start, history_start + history_positions).
    std::vector<float> history;
    int64_t history_start = 0;
    int64_t history_positions = 0;
  };
  PagedKvCache() = default;
  // Bytes of one (position, head) entry's values of width `dim`, excluding
  // the scale.
  int64_t EntryBytes(int dim) const;
  // EntryBytes(dim) plus the fp32 scale of the int formats.
  int64_t EntryStride(int dim) const;
  uint8_t* EntryPtr(int64_t page, int layer, int which, int64_t slot, int head);
  const uint8_t* EntryPtr(int64_t page, int layer, int which, int64_t slot, int head) const;
  const Sequence& Get(int64_t seq_id) const;
  // Read's work for `count` positions from `slot` of one page (the run of
  // entries [slot, slot + count) x heads is contiguous in the page).
  void ReadRun(int64_t page, int layer, int64_t slot, int64_t count, float* k, float* v) const;

  KvCacheShape shape_;
  KvCacheOptions options_;
  int64_t bytes_per_page_ = 0;
  // Page layout: [layer][k|v][slot][head] entries of EntryStride(head_dim)
  // bytes (keys) and EntryStride(v_dim()) bytes (values) (int formats: the
  // fp32 scale, then the values).
  std::vector<uint8_t> pool_;
  std::vector<int64_t> free_pages_;
  // Holders of every page (0 = free, in free_pages_) and the latest one
  // (for error messages; -1 = free).
  std::vector<int32_t> refs_;
  std::vector<int64_t> owner_;
  std::vector<int64_t> state_offsets_;  // start of each state slot in Sequence::state
  struct Snapshot {
    std::vector<float> state;  // empty = the slot holds none
    int64_t length = 0;
    uint64_t hash_hi = 0, hash_lo = 0;
  };
  std::vector<Snapshot> snapshots_;  // by slot, grown on demand
  int64_t snapshots_held_ = 0;
  absl::flat_hash_map<int64_t, Sequence> sequences_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_KV_CACHE_H_
