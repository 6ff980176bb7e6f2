// worker/rank/rank_executor.h — what one rank does, whatever drives it: join
// the group's communicator, plan and load its shard (LoadRank), then execute
// commands on it (ExecuteRankCommand). Shared by both control transports: the
// socketpair of a local driver (rank_server.h) and the coordinator's gRPC
// stream (rank_client.h).
//
//   EXL3_ASSIGN_OR_RETURN(LoadedRank rank, LoadRank(setup));
//   RankCommand forward;  forward.op = RankCommand::Op::kForward;  ...
//   EXL3_RETURN_IF_ERROR(ExecuteRankCommand(rank, forward, &logits));
#ifndef EXL3SERVE_WORKER_RANK_RANK_EXECUTOR_H_
#define EXL3SERVE_WORKER_RANK_RANK_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/trellis_gemm.h"
#include "worker/comm/comm_factory.h"
#include "worker/rank/executor_factory.h"
#include "worker/comm/communicator.h"
#include "worker/comm/timed_communicator.h"
#include "worker/model/kv_cache.h"
#include "worker/model/kv_disk_tier.h"
#include "worker/model/transformer.h"
#include "worker/model/step_executor.h"
#include "worker/model/vocab_sampler.h"

namespace exl3serve::worker::rank {

// What a forward was: every sequence one token (decode), none (prefill), or both.
enum class ForwardPhase { kPrefill, kDecode, kMixed };
const char* ForwardPhaseName(ForwardPhase phase);  // "prefill", "decode", "mixed"

// What a rank reports as it runs (its metrics, worker/metrics.h): every
// collective call (through comm::WithCollectiveTiming) and every forward.
// Called on the rank's step thread; must be quick and must not block.
class RankObserver : public comm::CollectiveObserver {
 public:
  // One forward of `tokens` new tokens that took `elapsed` (collectives included).
  virtual void OnForward(ForwardPhase phase, int64_t tokens, absl::Duration elapsed,
                         const absl::Status& status) = 0;
  // After every forward (after OnForward): the model's cumulative counters
  // (Transformer::spill_stats, expert_tokens) are readable. `model` is
  // borrowed for the call only; a reloaded rank passes a new model whose
  // counters start again at zero. Default: ignored.
  virtual void OnModelCounters(const Transformer& model) {}
  // After every disk-tier command: the tier's cumulative counters.
  virtual void OnKvDiskTier(const KvDiskTierStats& stats) {}
};

// Everything a rank needs to join its group and load.
struct RankSetup {
  std::string model_dir;
  int rank = 0;
  int world_size = 1;
  int expert_parallel = 0;  // sharding::ShardOptions::expert_parallel
  comm::CommSpec comm;
  KvCacheOptions kv;
  // The prefix cache's disk tier: a file of kv_disk_slots pages at
  // kv_disk_path ("{rank}" is replaced by the rank), created at load.
  // kv_disk_slots 0 = none.
  std::string kv_disk_path;
  int64_t kv_disk_slots = 0;
  absl::Duration join_timeout = absl::Seconds(60);
  absl::Duration collective_timeout = absl::Seconds(60);
  // Which row-lookup tables (the token embedding) this rank reads from disk
  // (TransformerLoadOptions::spill; decided per rank by the planner's
  // numbers, sharding::PlanRowTables). Default: none.
  sharding::SpillPolicy spill;
  // Relative share of the work per rank (sharding::WorldSpec::Rank::capacity,
  // e.g. free memory): a rank with less gets proportionally fewer heads,
  // channels, experts and vocab rows. Empty = all equal; else world_size
  // finite values > 0 (CheckCapacities), the same on every rank.
  std::vector<double> capacities;
  // Arithmetic of this process's EXL3 linears (worker/model/linear.h):
  // LoadRank sets them process-wide (SetPrefillPrecision: kFloat|kBf16,
  // SetDecodePrecision: kFloat|kInt8; InvalidArgument otherwise, before
  // joining) and logs "rank R: precision prefill=P decode=D".
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
  // Borrowed, must outlive the LoadedRank; null = no observation.
  RankObserver* observer = nullptr;
};


// A rank that has joined its group and loaded its shard.
// Ownership: owns its communicator, model and cache. Thread safety: confined
// to the rank's step thread, except comm->Abort() (any thread).
struct LoadedRank {
  int rank = 0;
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<Transformer> model;
  std::optional<PagedKvCache> cache;
  // Rank-side sampling over this rank's vocabulary slice (made by LoadRank).
  std::optional<VocabSampler> sampler;
  // The prefix cache's disk tier (RankSetup::kv_disk_*); null = none.
  std::unique_ptr<KvDiskTier> disk_tier;
  absl::Duration collective_timeout = absl::Seconds(60);
  uint64_t bytes_read = 0;
  uint64_t planned_bytes = 0;
  RankObserver* observer = nullptr;  // RankSetup::observer
};

// Joins the communicator by setup.join_timeout, plans the shards, loads this
// rank's slices and creates the KV cache, then waits at a barrier until every
// rank has loaded (a rank that fails to load fails the others' barrier instead
// of leaving them waiting at the first step).
// Errors: InvalidArgument for bad capacities (before joining); those of the
// communicator, the checkpoint and the planner;
// Unimplemented for an architecture without tensor parallelism.
absl::StatusOr<LoadedRank> LoadRank(const RankSetup& setup);

// One command of a driver, transport-neutral.
struct RankCommand {
  enum class Op {
    kAddSequence,
    kRemoveSequence,
    kForward,
    kSaveKvBlocks,
    kLoadKvBlocks,
    kSaveStateSnapshots,
  };
  Op op = Op::kForward;
  int64_t seq_id = 0;                  // kAddSequence, kRemoveSequence
  // kAddSequence: set for a sequence that samples on the ranks.
  std::optional<SequenceSampling> sampling;
  std::vector<int64_t> batch_seq_ids;  // kForward: the batch, in order
  std::vector<std::vector<int32_t>> batch_tokens;
  // kForward: per batch entry, the KV pages the coordinator assigned to the
  // sequence since its last forward (appended to its page table first).
  // Empty, or one list per entry.
  std::vector<std::vector<int32_t>> batch_new_pages;
  LogitsRows rows = LogitsRows::kLastToken;
  // kForward: non-empty = a sampled forward (RunSampledForward): one flag per
  // entry, the entries with a flag draw a token; no logits are returned.
  std::vector<uint8_t> batch_sample;
  // kForward: non-empty = a verified forward (RunVerifiedForward, speculative
  // decoding; needs batch_sample): per entry, how many of its last tokens are
  // draft tokens. Runs of drawn tokens are returned, not tokens or logits.
  std::vector<int32_t> batch_draft;
  // kForward, sampled or verified: per entry, its allowed-token mask rows
  // (SequenceTokens::allowed_tokens; structured output). Empty, or one list
  // per entry (an empty list: every token).
  std::vector<std::vector<uint32_t>> batch_allowed;
  // kSaveKvBlocks / kLoadKvBlocks: pages <-> disk-tier slots.
  std::vector<KvBlockTransfer> transfers;
  // kSaveStateSnapshots: sequences' states -> snapshot slots.
  std::vector<StateSnapshotSave> snapshots;
};

// Executes `command` on `rank`. For kForward, the new pages are assigned
// (PagedKvCache::AssignPages) before the forward — with
// KvCacheOptions::caller_assigns_pages, the rank's only source of pages — and
// *logits gets the logits (every rank computes them). Errors: the cache's
// (AlreadyExists, NotFound; for pages InvalidArgument / FailedPrecondition
// naming the page, FailedPrecondition for a forward beyond the assigned
// pages), InvalidArgument for mismatched list counts, and the forward's (a
// collective failure when peers are lost). Validation errors happen before
// any collective, identically on every rank.
// A sampled forward (batch_sample non-empty) fills *tokens instead (every
// rank draws the same tokens); `tokens` may be null on ranks that do not
// report them.
// A verified forward (batch_draft non-empty) fills *runs instead
// (RunVerifiedForward: every rank draws and accepts alike, and drops the KV
// of the rejected drafts); `runs` may be null on ranks that do not report
// them. Its draft counts are checked (worker::CheckDraftCounts:
// InvalidArgument) before any page is assigned.
// kLoadKvBlocks sets *loaded (may be null on ranks that do not report):
// entry i is 1 iff every rank verified it (an all-reduce of the misses over
// the group, so every rank agrees).
absl::Status ExecuteRankCommand(LoadedRank& rank, const RankCommand& command,
                                std::vector<float>* logits,
                                std::vector<SampledToken>* tokens = nullptr,
                                std::vector<uint8_t>* loaded = nullptr,
                                std::vector<std::vector<SampledToken>>* runs = nullptr);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_RANK_EXECUTOR_H_
