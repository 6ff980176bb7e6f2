// worker/rank/local_group.h — `exl3serve generate --tp N`'s driver: starts N
// rank processes (`exl3serve worker`, rank_server.h), each optionally behind a
// wrapper command (e.g. `ip netns exec BOX` to put it on another "box"), and
// runs them as one StepExecutor: every command goes to every rank, rank 0's
// reply carries the logits.
//
//   LocalGroupOptions options;  options.model_dir = dir;  options.world_size = 2;
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<LocalGroup> group, LocalGroup::Start(options));
//   EXL3_RETURN_IF_ERROR(group->AddSequence(0));
//   EXL3_RETURN_IF_ERROR(group->Forward(batch, LogitsRows::kLastToken, &logits));
//
// Failure: a rank that exits or stops answering within step_timeout breaks
// the group: the call returns Unavailable / DeadlineExceeded naming the rank
// (and its exit status), every later call fails the same way, and the
// destructor shuts every rank down (SIGKILL after a grace period), so no
// process outlives the group. The coordinator (issue 6) replaces this
// driver; the rank side stays.
#ifndef EXL3SERVE_WORKER_RANK_LOCAL_GROUP_H_
#define EXL3SERVE_WORKER_RANK_LOCAL_GROUP_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/trellis_gemm.h"
#include "sharding/spill_store.h"
#include "worker/comm/comm_factory.h"
#include "worker/model/kv_cache.h"
#include "worker/model/step_executor.h"

namespace exl3serve::worker::rank {

class WireWriter;  // control_wire.h

struct LocalGroupOptions {
  std::string model_dir;
  int world_size = 2;
  int expert_parallel = 0;
  // The rank binary: the `exl3serve` executable (its `worker` subcommand).
  // Empty: this process's own executable.
  std::string executable;
  // Backend "shm" (segment name chosen here when empty) or "ucx" (then
  // bootstrap_address must be reachable by every rank).
  comm::CommSpec comm;
  // Per rank, words put before the executable (empty = none); e.g.
  // {"ip", "netns", "exec", "box-a"}. Size 0 or world_size.
  std::vector<std::vector<std::string>> rank_wrappers;
  int threads_per_rank = 1;
  KvCacheOptions kv;
  // The prefix cache's disk tier of every rank (worker --kv-disk-path /
  // --kv-disk-blocks; "{rank}" in the path is the rank). 0 slots = none.
  std::string kv_disk_path;
  int64_t kv_disk_slots = 0;
  absl::Duration load_timeout = absl::Minutes(5);
  absl::Duration step_timeout = absl::Seconds(60);
  // Row tables every rank reads from disk (worker --spill-* flags; each rank
  // applies the policy to its own shard). Default: none.
  sharding::SpillPolicy spill;
  // Relative capacity per rank (RankSetup::capacities: a rank with less gets
  // proportionally less of every layer); empty = uniform, else world_size
  // finite values > 0. Passed to every rank as `worker --capacities`.
  std::vector<double> capacities;
  // Arithmetic of EXL3 linears on every rank (worker/model/linear.h), passed
  // as `worker --prefill-precision` (kFloat|kBf16) and `--decode-precision`
  // (kFloat|kInt8); a rank refuses other values (its load error).
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
  // Rank r serves /metrics on metrics_host:(metrics_port + r); 0 = off.
  int metrics_port = 0;
  std::string metrics_host = "127.0.0.1";
};

// One rank of a LocalGroup as a server's GetServerInfo lists it.
struct LocalRankStatus {
  int rank = 0;
  pid_t pid = -1;
  bool up = false;          // its process runs and the group is neither broken nor shut down
  uint64_t bytes_read = 0;  // checkpoint bytes it read while loading
  std::string address;      // "HOST pid P (local)"
};

// Thread safety: thread-compatible (one caller at a time), except
// rank_status(), which any thread may call at any time.
class LocalGroup final : public StepExecutor {
 public:
  // Starts the ranks and waits until every one has loaded (or one fails).
  // Errors: InvalidArgument for bad options; the first rank's load error
  // (prefixed "rank R: "); Unavailable when a rank exits during start-up;
  // FailedPrecondition for a rank binary speaking another control version.
  static absl::StatusOr<std::unique_ptr<LocalGroup>> Start(const LocalGroupOptions& options);
  ~LocalGroup() override;

  int64_t vocab_size() const override { return vocab_size_; }
  absl::Status AddSequence(int64_t seq_id) override;
  uint64_t result_bytes_received() const override { return result_bytes_; }
  absl::Status AddSampledSequence(int64_t seq_id, const SequenceSampling& sampling) override;
  absl::Status ForwardSampled(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                              std::vector<SampledToken>* tokens) override;
  // StepExecutor::ForwardVerified over the control wire (kForwardVerified):
  // every rank runs worker::RunVerifiedForward (collective under TP, as
  // Sample), rank 0 replies the runs. The arguments are checked here first
  // (CheckDraftCounts: InvalidArgument, nothing sent, staged pages kept);
  // runs no verification can produce (CheckVerifiedRuns) break the group
  // with DataLoss, as a malformed sampled reply does.
  absl::Status ForwardVerified(std::span<const SequenceTokens> batch, std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<SampledToken>>* runs) override;
  absl::Status RemoveSequence(int64_t seq_id) override;
  absl::Status Forward(std::span<const SequenceTokens> batch, LogitsRows rows,
                       std::vector<float>* logits) override;
  // Stages the pages; they go to every rank with the sequence's next Forward
  // (needs options.kv.caller_assigns_pages for the ranks to rely on them
  // alone). Unavailable once the group is broken.
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) override;
  absl::Status SaveKvBlocks(std::span<const KvBlockTransfer> saves) override;
  absl::Status SaveStateSnapshots(std::span<const StateSnapshotSave> saves) override;
  absl::Status LoadKvBlocks(std::span<const KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override;
  std::optional<KvCacheOptions> kv_options() const override { return options_.kv; }

  // Replaces a broken group with new rank processes started from the same
  // options (the survivors are shut down first); afterwards no sequence
  // exists. Errors: those of Start (the group stays broken).
  absl::Status Recover(absl::Time deadline) override;

  // Stops every rank: a shutdown command, then SIGKILL for those that have not
  // exited by `grace`. Idempotent; the destructor calls it.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  int world_size() const { return static_cast<int>(ranks_.size()); }
  pid_t rank_pid(int rank) const { return ranks_[rank].pid; }
  // Checkpoint bytes each rank read while loading, and what the plan gave it.
  uint64_t bytes_read(int rank) const { return ranks_[rank].bytes_read; }
  uint64_t planned_bytes(int rank) const { return ranks_[rank].planned_bytes; }
  // OK, or the failure that broke the group.
  const absl::Status& health() const { return broken_; }
  // Every rank, for GetServerInfo. Thread-safe, unlike the rest of the class:
  // reads a snapshot the owner publishes after Start, Recover, a break and
  // Shutdown, and checks (without reaping) that each rank's process still
  // runs, so a rank that died while the group was idle shows as down at once.
  std::vector<LocalRankStatus> rank_status() const;

 private:
  struct Rank {
    pid_t pid = -1;
    int fd = -1;  // the driver's end of the control socketpair
    uint64_t bytes_read = 0, planned_bytes = 0;
    bool exited = false;
  };
  LocalGroup() = default;
  // Sends `request` to every rank and collects every reply (rank 0's body in
  // *rank0_body). Breaks the group on a transport failure.
  absl::Status RoundTrip(const std::string& request, absl::Duration timeout,
                         std::string* rank0_body);
  // "rank R (pid P) exited with status S" / "... has not answered": for messages.
  std::string DescribeRank(int rank);
  absl::Status Break(absl::Status status);
  // Writes entry's i64 seq, i32[] tokens and i32[] staged pages (which count
  // as sent from here on: the ranks hold them now, or refuse them).
  void WriteEntry(const SequenceTokens& entry, WireWriter* w);
  // Refreshes the snapshot rank_status() reads from ranks_ / broken_ / shut_down_.
  void Publish();

  LocalGroupOptions options_;
  std::vector<Rank> ranks_;
  std::string shm_name_;
  int64_t vocab_size_ = 0;
  absl::Duration step_timeout_;
  absl::Status broken_;
  bool shut_down_ = false;
  uint64_t result_bytes_ = 0;  // rank 0's reply frames (result_bytes_received)
  // AssignPages not yet sent, per sequence (sent with its next Forward).
  absl::flat_hash_map<int64_t, std::vector<int32_t>> staged_pages_;
  // Own synchronisation: rank_status()'s snapshot (written by Publish).
  mutable absl::Mutex status_mu_;
  std::vector<LocalRankStatus> published_ ABSL_GUARDED_BY(status_mu_);
};

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_LOCAL_GROUP_H_
