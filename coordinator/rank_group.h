// coordinator/rank_group.h — rank membership and the remote rank group: the
// coordinator's RankControl endpoint (proto/exl3serve/rank/v1/rank.proto),
// where `exl3serve worker --coordinator` processes register and heartbeat,
// and RemoteRankGroup, a worker::StepExecutor over the connected ranks.
//
//   RankGroupOptions options;  options.listen_address = "0.0.0.0:50061";
//   options.model_dir = dir;  options.world_size = 2;
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<RemoteRankGroup> group, RemoteRankGroup::Start(options));
//   EXL3_RETURN_IF_ERROR(group->WaitReady(absl::Now() + absl::Minutes(5)));
//   const uint64_t generation = group->generation();
//   EXL3_RETURN_IF_ERROR(group->AddSequence(7));
//   absl::Status s = group->Forward(batch, LogitsRows::kLastToken, &logits);
//   if (absl::IsUnavailable(s)) {  // a rank died: the group is forming again
//     EXL3_RETURN_IF_ERROR(group->WaitReady(absl::Now() + group->options().reform_timeout));
//     // generation() > generation: every sequence is gone; add and replay them.
//   }
//
// Life of a group (the state, GroupState):
//   kForming  ranks register; a registration is refused (the stream ends with
//             that status) for another protocol version or world size
//             (FAILED_PRECONDITION), a rank outside [0, world_size)
//             (INVALID_ARGUMENT) or a rank already held (ALREADY_EXISTS).
//   kLoading  all world_size ranks registered: generation() increases and every
//             rank gets Setup (a fresh shm segment name per generation); a rank
//             whose Ready carries an error, or no Ready within load_timeout,
//             tears the group down.
//   kReady    every rank reported Ready. Steps run.
// Teardown (any state, any cause: a rank's stream ended, its heartbeat is older
// than heartbeat_timeout, a step passed step_timeout, a load failed): every
// rank still connected gets Shutdown{reason} and its stream ends; the step in
// flight fails with UNAVAILABLE naming the rank and the cause; the state goes
// back to kForming, where ranks (restarted ones, and `--reconnect` ones)
// register again. Nothing here waits on a rank without a deadline.
//
// Thread safety: thread-safe; the StepExecutor calls are for one caller at a
// time (a second concurrent step fails with FailedPrecondition). gRPC
// reactors never block: they update the membership under a mutex and return.
#ifndef EXL3SERVE_COORDINATOR_RANK_GROUP_H_
#define EXL3SERVE_COORDINATOR_RANK_GROUP_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/comm_factory.h"
#include "worker/model/kv_cache.h"
#include "worker/model/step_executor.h"

namespace exl3serve::coordinator {

// The coordinator's rank protocol version (rank.proto RANK_PROTOCOL_CURRENT).
inline constexpr uint32_t kCoordinatorRankProtocolVersion = 1;

struct RankGroupOptions {
  // --- behaviour
  // host:port where ranks connect; port 0 picks a free port (see port()).
  std::string listen_address = "0.0.0.0:50061";
  // The model directory as the ranks see it.
  std::string model_dir;
  int world_size = 1;
  int expert_parallel = 0;  // 0 = one expert group per rank
  // Collectives between the ranks. shm with an empty shm_name: a fresh
  // segment name per group generation (a broken group's segment is never
  // reused); ucx: bootstrap_address must be reachable by every rank.
  worker::comm::CommSpec comm;
  worker::KvCacheOptions kv;  // the cache every rank creates
  int threads_per_rank = 0;   // 0 = each rank's own --threads
  // --- timeouts
  absl::Duration join_timeout = absl::Seconds(60);        // ranks joining the communicator
  absl::Duration collective_timeout = absl::Seconds(60);  // one collective on a rank
  absl::Duration load_timeout = absl::Minutes(5);         // Setup to every rank Ready
  absl::Duration step_timeout = absl::Seconds(60);        // one step, every rank answered
  // Ranks send a heartbeat this often; one older than heartbeat_timeout means
  // the rank is dead (5 missed beats: tolerates a busy box, detects a hung
  // process within seconds).
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(5);
  // How long the engine should wait for a broken group to re-form before
  // failing its requests (carried here so it is configured in one place; the
  // group itself keeps forming indefinitely).
  absl::Duration reform_timeout = absl::Seconds(60);
};

enum class GroupState { kForming, kLoading, kReady, kStopped };
const char* GroupStateName(GroupState state);

// One rank slot of the group, for GetServerInfo.
struct RankSlotInfo {
  int rank = 0;
  bool up = false;                   // registered and its stream open
  bool loaded = false;               // reported Ready in this generation
  std::string address;               // "host pid P (peer ipv4:...)"
  absl::Duration last_heartbeat_age; // since Register or the last heartbeat
};

struct RankGroupStatus {
  GroupState state = GroupState::kForming;
  uint64_t generation = 0;  // groups formed so far
  int world_size = 0;
  std::vector<RankSlotInfo> ranks;  // world_size entries
  std::string last_error;           // why the last group was torn down
};

class RemoteRankGroup final : public worker::StepExecutor {
 public:
  // Starts the RankControl endpoint on options.listen_address. Returns at
  // once; ranks register whenever they come.
  // Errors: InvalidArgument for bad options (named); Unavailable when the
  // address cannot be bound.
  static absl::StatusOr<std::unique_ptr<RemoteRankGroup>> Start(const RankGroupOptions& options);
  // Shutdown(), then stops the endpoint.
  ~RemoteRankGroup() override;

  // The bound port (the chosen one when listen_address asked for port 0).
  int port() const;
  const RankGroupOptions& options() const;

  // worker::StepExecutor. Each call sends one Step to every rank and waits
  // for every StepResult for at most options().step_timeout.
  // Errors: Unavailable when the group is not ready, when a rank died or was
  // torn down during the step, or when a rank did not answer in time (the
  // group is then torn down) — the message names the rank and the cause;
  // otherwise the first failing rank's own error, prefixed "rank R: ".
  // vocab_size() is 0 until the first group is ready.
  int64_t vocab_size() const override;
  absl::Status AddSequence(int64_t seq_id) override;
  absl::Status RemoveSequence(int64_t seq_id) override;
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override;
  // Waits (by `deadline`) for the group to re-form from ranks that register
  // again (`worker --reconnect`, or restarted ranks): WaitReady.
  absl::Status Recover(absl::Time deadline) override { return WaitReady(deadline); }

  // True when every rank of the current group is loaded.
  bool ready() const;
  // Increases each time a group forms (Setup sent). Sequences added under one
  // generation are gone in the next: the caller re-adds and replays them.
  uint64_t generation() const;
  // Blocks until the group is ready or `deadline`. Errors: Unavailable
  // describing what is missing (ranks not registered / not loaded, and the
  // last teardown's cause); Cancelled after Shutdown().
  absl::Status WaitReady(absl::Time deadline) const;
  RankGroupStatus status() const;

  // Tears the group down (ranks get Shutdown{reason}) and refuses new
  // registrations. Idempotent.
  void Shutdown(const std::string& reason = "the coordinator is shutting down");

  class Impl;  // rank_group.cc

 private:
  explicit RemoteRankGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_RANK_GROUP_H_
