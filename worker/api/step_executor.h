// worker/api/step_executor.h — the one seam between the coordinator and the
// ranks: what a generation loop needs from "the model" (sequences with cached
// state, forwards over a batch of their new tokens, tokens drawn on the
// ranks), whatever runs it — a model in this process
// (worker/model/step_executor.h LocalStepExecutor), local rank processes
// (worker/rank/local_group.h) or remote ranks (coordinator/rank_group.h).
// Nothing here knows kernels or models: the coordinator includes only this
// folder of worker/ (and worker/rank/executor_factory.h to build one).
//
//   EXL3_RETURN_IF_ERROR(executor.AddSampledSequence(7, {.params = p, .prompt_len = 12}));
//   EXL3_RETURN_IF_ERROR(executor.ForwardSampled(batch, sample_flags, &tokens));
#ifndef EXL3SERVE_WORKER_API_STEP_EXECUTOR_H_
#define EXL3SERVE_WORKER_API_STEP_EXECUTOR_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/api/sampling.h"

namespace exl3serve::worker {

// New tokens of one sequence in a forward: they take positions
// cache.Length(seq_id) .. + tokens.size() - 1.
struct SequenceTokens {
  int64_t seq_id = 0;
  std::span<const int32_t> tokens;
  // Structured output (coordinator/constrained/): the tokens each of this
  // entry's draws may take, as bitmask rows of ceil(vocab_size() / 32)
  // words (bit id % 32 of word id / 32 set = allowed; bits past the
  // vocabulary ignored). Empty: every token. Otherwise one row per draw of
  // a sampled entry — 1 for ForwardSampled, 1 + its draft count for
  // ForwardVerified (row r for the draw after draft r - 1, computed as if
  // drafts 0..r-1 were accepted) — and none for an unsampled entry
  // (CheckAllowedTokens, worker/api/verified_forward.h). Ranks set the
  // logits of masked tokens to -inf after penalties and bias, before the
  // draw; logprobs stay those of the raw logits. A row that allows no token
  // is refused (InvalidArgument) before anything runs.
  std::span<const uint32_t> allowed_tokens{};
  // The sequence's prompt length (SequenceSampling::prompt_len), which
  // chooses each row's precision by position (sampling.h PrefillKindEnd);
  // -1 (a forward without sampling): the entry's size chooses
  // (worker/model/linear.h RowKindForRows). The sampled and verified
  // forwards set it from the sequence's sampling parameters.
  int64_t prompt_len = -1;
};

enum class LogitsRows {
  kLastToken,  // one row per sequence: its last new token
  kAllTokens,  // one row per new token, sequences in batch order
};

// The paged KV cache's element format and layout (worker/model/kv_cache.h
// PagedKvCache; the coordinator's block allocator mirrors num_pages and
// page_size_tokens).
enum class KvCacheDtype { kFp32, kFp16, kInt8, kInt4 };

// 32, 16, 8, 4 -> dtype (the --kv-bits spellings). InvalidArgument otherwise.
absl::StatusOr<KvCacheDtype> KvCacheDtypeFromBits(int bits);

struct KvCacheOptions {
  // Positions per page. 16 keeps the tail waste of a sequence under 16
  // positions while a page of a 64-head x 128 fp16 layer is still 256 KiB.
  int page_size_tokens = 16;
  // Pages in the pool; a sequence of L positions holds ceil(L / page) pages.
  int64_t num_pages = 256;
  KvCacheDtype dtype = KvCacheDtype::kFp16;
  // Who places sequences on pages. false: Reserve takes free pages from the
  // pool (a model driven by worker::Generate). true: only AssignPages does
  // (the coordinator's block tables, coordinator/scheduler.h); Reserve never
  // takes a page then and fails with FailedPrecondition when the assigned
  // pages are short. Ranks of a coordinator always run with true.
  bool caller_assigns_pages = false;
};

// One KV block moved between a page of every rank's cache and a slot of
// every rank's disk tier (the prefix cache's second tier,
// worker/model/kv_disk_tier.h; the coordinator places both, like pages).
struct KvBlockTransfer {
  int32_t page = 0;
  int64_t slot = 0;
  uint64_t hash_hi = 0;  // the block's prefix hash (coordinator/block_pool.h)
  uint64_t hash_lo = 0;
};

// A snapshot of a sequence's recurrent state (KvCacheShape::state_floats),
// kept in slot `slot` of every rank's snapshot store for the prefix cache
// (coordinator/scheduler.h): the state after the sequence's first
// `position` tokens, whose last full block's chained hash is (hash_hi,
// hash_lo). The coordinator places snapshots, as it places pages; a rank
// checks the hash and the position when a sequence resumes from one.
struct StateSnapshotRef {
  int64_t slot = -1;  // -1: none
  uint64_t hash_hi = 0;
  uint64_t hash_lo = 0;
};

// Save the current state of sequence `seq_id` (after its forwards so far:
// its committed length must be a multiple of the page size) into a slot.
struct StateSnapshotSave {
  int64_t seq_id = 0;
  StateSnapshotRef snapshot;
};

// Thread safety: one caller at a time.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual int64_t vocab_size() const = 0;
  // AlreadyExists when seq_id is in use; Unavailable when the executor is
  // broken (a rank died).
  virtual absl::Status AddSequence(int64_t seq_id) = 0;
  // NotFound for an unknown seq_id.
  virtual absl::Status RemoveSequence(int64_t seq_id) = 0;
  // As Transformer::Forward, with the executor's own cache.
  virtual absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                               std::vector<float>* logits) = 0;

  // Appends `page_ids` to the sequence's KV page table on every rank (the
  // coordinator's block allocator placed it; PagedKvCache::AssignPages). For
  // an executor whose caches have KvCacheOptions::caller_assigns_pages this is
  // the only way a sequence gets pages: a Forward needing positions beyond its
  // assigned pages fails (FailedPrecondition). Executors over rank processes
  // send the pages with the sequence's next Forward, so their errors
  // (InvalidArgument / FailedPrecondition naming the page, as AssignPages)
  // come from that Forward; this process's cache answers at once.
  // Unimplemented when the executor allocates pages itself.
  virtual absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) {
    return absl::UnimplementedError("this executor allocates its own KV pages");
  }

  // Rank-side sampling (vocab_sampler.h). A sequence added this way carries
  // its sampling parameters for its whole life (set once, not per step) and
  // is fed through ForwardSampled: only token ids — and logprobs when asked —
  // come back from the ranks. AlreadyExists / InvalidArgument as
  // AddSequence / VocabSampler::AddSequence. Unimplemented where the executor
  // cannot sample.
  virtual absl::Status AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) {
    return absl::UnimplementedError("this executor does not sample on its ranks");
  }
  // One forward of `batch` (last-token rows); for every entry i with
  // sample[i] != 0, (*tokens)[i] is the token drawn for that sequence
  // (tokens is resized to batch.size(); other entries are left default).
  // Errors: Forward's; NotFound for a sampled entry not added with
  // AddSampledSequence; InvalidArgument when sample.size() != batch.size().
  virtual absl::Status ForwardSampled(std::span<const SequenceTokens> batch,
                                      std::span<const uint8_t> sample,
                                      std::vector<SampledToken>* tokens) {
    return absl::UnimplementedError("this executor does not sample on its ranks");
  }

  // Speculative verification (worker/model/step_executor.h
  // RunVerifiedForward): the last draft_counts[i] tokens of entry i are
  // draft tokens; (*runs)[i] is what serial decoding draws from there — the
  // accepted draft tokens, then one more — and the ranks drop the KV of the
  // rejected positions. Errors: ForwardSampled's; InvalidArgument for a
  // draft count that leaves no accepted token or sits on an unsampled entry.
  // Unimplemented where the executor cannot verify drafts (then the caller
  // decodes without them).
  virtual absl::Status ForwardVerified(std::span<const SequenceTokens> batch,
                                       std::span<const uint8_t> sample,
                                       std::span<const int32_t> draft_counts,
                                       std::vector<std::vector<SampledToken>>* runs) {
    return absl::UnimplementedError("this executor does not verify draft tokens");
  }

  // Drops the sequence's last dropped.size() positions, whose tokens were
  // `dropped` (in order): its cache length shrinks (pages stay assigned) and
  // a sampled sequence's penalty counts and draw position rewind as if those
  // tokens had never been fed. A draft model's rollback after verification
  // (coordinator/draft_model.h). NotFound for an unknown sequence;
  // InvalidArgument when it holds fewer positions; Unimplemented where the
  // executor cannot.
  virtual absl::Status TruncateSequence(int64_t seq_id, std::span<const int32_t> dropped) {
    return absl::UnimplementedError("this executor cannot truncate a sequence");
  }

  // The disk tier (kv_disk_tier.h) of every rank. SaveKvBlocks copies each
  // page's bytes to its slot (written asynchronously; a save the rank cannot
  // take is dropped, and that slot is later a miss) and must run before the
  // pages are reused. LoadKvBlocks reads each slot into its page — a page no
  // sequence holds — and sets (*loaded)[i] = 1 iff entry i was verified
  // (hash and checksums) on every rank; a miss leaves the page unspecified.
  // Unimplemented where there is no disk tier.
  virtual absl::Status SaveKvBlocks(std::span<const KvBlockTransfer> saves) {
    return absl::UnimplementedError("this executor has no KV disk tier");
  }
  virtual absl::Status LoadKvBlocks(std::span<const KvBlockTransfer> loads,
                                    std::vector<uint8_t>* loaded) {
    return absl::UnimplementedError("this executor has no KV disk tier");
  }

  // Prefix caching with a recurrent state: copies each sequence's state into
  // its snapshot slot on every rank (after the forward that brought it to a
  // block boundary; PagedKvCache::SaveStateSnapshot). A sequence resumes from
  // one with SequenceSampling::cached_state. Errors: NotFound for an unknown
  // sequence, InvalidArgument for a slot out of range, FailedPrecondition for
  // a length that is not a whole number of pages. Unimplemented where the
  // executor keeps no state snapshots.
  virtual absl::Status SaveStateSnapshots(std::span<const StateSnapshotSave> saves) {
    return absl::UnimplementedError("this executor keeps no state snapshots");
  }

  // Bytes of step results received from the ranks so far (what crossed
  // from rank 0 to the caller); 0 for a model in this process.
  virtual uint64_t result_bytes_received() const { return 0; }

  // The page layout of the executor's caches (every rank's), which the
  // coordinator's block allocator must equal; nullopt when unknown (fakes).
  virtual std::optional<KvCacheOptions> kv_options() const { return std::nullopt; }

  // Re-forms a broken executor by `deadline` — new rank processes, or ranks
  // that re-registered — after which it holds no sequences (callers replay
  // them). Unimplemented when the executor cannot (a model in this process
  // does not break that way); the error that prevented it otherwise.
  virtual absl::Status Recover(absl::Time deadline) {
    return absl::UnimplementedError("this executor cannot be re-formed");
  }
};


}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_API_STEP_EXECUTOR_H_
