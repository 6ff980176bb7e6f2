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
//   EXL3_RETURN_IF_ERROR(group->AssignPages(7, block_ids));  // the scheduler's; sent with:
//   absl::Status s = group->Forward(batch, LogitsRows::kLastToken, &logits);
//   if (absl::IsUnavailable(s) || absl::IsAborted(s)) {  // a rank died / the group re-formed
//     EXL3_RETURN_IF_ERROR(group->Recover(absl::Now() + group->options().reform_timeout));
//     // generation() > generation: every sequence is gone; add and replay them.
//   }
//
// Security: RankEndpointSecurity (TLS, mutual TLS, a rank token). Steps
// only ever travel on the streams ranks open to this endpoint — a rank never
// listens for steps (worker/rank/rank_client.h) — so a rank that verifies
// this endpoint's certificate takes steps from its coordinator only.
//
// Life of a group (the state, GroupState):
//   kForming  ranks register (a stream without the right token is refused
//             UNAUTHENTICATED before it can register); a registration is refused (the stream ends with
//             that status) for another protocol version or world size
//             (FAILED_PRECONDITION), a rank outside [0, world_size)
//             (INVALID_ARGUMENT) or a rank already held (ALREADY_EXISTS).
//   kLoading  all world_size ranks registered: generation() increases and every
//             rank gets Setup (a fresh shm segment name per generation); a rank
//             whose Ready carries an error, or no Ready within load_timeout,
//             tears the group down. A rank whose Ready reports another KV
//             layout (page count or size) than options.kv is refused: its
//             stream ends FAILED_PRECONDITION naming both layouts (the rank
//             exits with it, even with --reconnect) and the group is torn
//             down (status().last_error says why).
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
#include <functional>
#include <memory>
#include <optional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/trellis_gemm.h"
#include "sharding/spill_store.h"
#include "worker/comm/comm_factory.h"
#include "worker/api/step_executor.h"

namespace exl3serve::coordinator {

// The coordinator's rank protocol version (rank.proto RANK_PROTOCOL_CURRENT).
inline constexpr uint32_t kCoordinatorRankProtocolVersion = 7;

// Who may register as a rank (the coordinator<->rank channel's security).
// cert_file + key_file (PEM) turn TLS on for the rank endpoint; with
// client_ca_file a rank must present a client certificate signed by that CA
// (mutual TLS: the TLS handshake fails otherwise, so the rank never reaches
// Register); with token_file every Connect stream must carry the metadata
// `authorization: Bearer <token>` (the file's content, surrounding
// whitespace trimmed), or it ends UNAUTHENTICATED before any message is read.
// Without TLS and a rank check (client CA or token) the endpoint listens on
// loopback only, unless insecure_listen_any (Start refuses otherwise).
struct RankEndpointSecurity {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  std::string token_file;
  bool insecure_listen_any = false;
  bool tls() const { return !cert_file.empty() || !key_file.empty(); }
  bool rank_check() const { return !client_ca_file.empty() || !token_file.empty(); }
};

// The loopback-only rule above for `listen_address` (HOST:PORT); callers
// check it before slow setup, Start checks it too. FailedPrecondition naming
// the host and `hint` (how the caller's user sets the credentials).
absl::Status CheckRankListenPolicy(const std::string& listen_address,
                                   const RankEndpointSecurity& security, const std::string& hint);

struct RankGroupOptions {
  // --- behaviour
  // host:port where ranks connect; port 0 picks a free port (see port()).
  // A host other than loopback needs `security` (see RankEndpointSecurity).
  std::string listen_address = "127.0.0.1:50061";
  RankEndpointSecurity security;
  // The model directory as the ranks see it.
  std::string model_dir;
  int world_size = 1;
  int expert_parallel = 0;  // 0 = one expert group per rank
  // Collectives between the ranks. shm with an empty shm_name: a fresh
  // segment name per group generation (a broken group's segment is never
  // reused); ucx: bootstrap_address must be reachable by every rank.
  worker::comm::CommSpec comm;
  worker::KvCacheOptions kv;  // the cache every rank creates
  // The prefix cache's disk tier of every rank (Setup.kv.disk_*; "{rank}" in
  // the path is the rank, on the rank's own machine). 0 slots = none.
  std::string kv_disk_path;
  int64_t kv_disk_slots = 0;
  int threads_per_rank = 0;   // 0 = each rank's own --threads
  // Row tables every rank reads from its box's disk (Setup.spill; a rank
  // started with its own `worker --spill-*` flags uses those). nullopt: none.
  std::optional<sharding::SpillPolicy> spill;
  // Relative capacity per rank (Setup.capacities); empty = uniform, else
  // world_size finite values > 0 (Start: InvalidArgument otherwise).
  std::vector<double> capacities;
  // Arithmetic of every rank's EXL3 linears (Setup.prefill_precision /
  // decode_precision; a rank started with its own `worker --*-precision`
  // flag uses that): prefill kFloat|kBf16, decode kFloat|kInt8 (a rank
  // refuses other values: its load fails).
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
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
  // --- observation
  // Called after every state change (forming, loading, ready, stopped), with
  // none of the group's locks held, from a gRPC or the group's monitor
  // thread; must not block (e.g. GrpcServer::ReadinessMayHaveChanged, so
  // grpc.health.v1 follows a lost rank at once). Empty = none.
  std::function<void()> on_change;
};

enum class GroupState { kForming, kLoading, kReady, kStopped };
const char* GroupStateName(GroupState state);

// One rank slot of the group, for GetServerInfo.
struct RankSlotInfo {
  int rank = 0;
  bool up = false;                   // registered and its stream open
  bool loaded = false;               // reported Ready in this generation
  uint64_t bytes_read = 0;           // checkpoint bytes it read loading (its Ready)
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
  // Aborted ("replay them") when the caller still holds sequences added in
  // an earlier generation: the group re-formed between two steps (no step
  // saw it break), so those sequences are gone; the caller treats it as a
  // broken group: Recover, then re-add and replay. Every step carries the
  // generation it was meant for (Step.group_generation) and a rank of
  // another generation refuses it (Aborted) too.
  // vocab_size() is 0 until the first group is ready.
  int64_t vocab_size() const override;
  absl::Status AddSequence(int64_t seq_id) override;
  uint64_t result_bytes_received() const override;
  absl::Status AddSampledSequence(int64_t seq_id, const worker::SequenceSampling& sampling) override;
  absl::Status ForwardSampled(std::span<const worker::SequenceTokens> batch,
                              std::span<const uint8_t> sample,
                              std::vector<worker::SampledToken>* tokens) override;
  // Speculative verification (rank protocol v5: ForwardBatch.verified,
  // SequenceTokens.num_draft, StepResult.runs). InvalidArgument before
  // anything is sent (staged pages kept) for draft counts that
  // worker::CheckDraftCounts refuses; DataLoss when rank 0's runs are not a
  // possible answer (worker::CheckVerifiedRuns), as for ForwardSampled's
  // token count.
  absl::Status ForwardVerified(std::span<const worker::SequenceTokens> batch,
                               std::span<const uint8_t> sample,
                               std::span<const int32_t> draft_counts,
                               std::vector<std::vector<worker::SampledToken>>* runs) override;
  absl::Status RemoveSequence(int64_t seq_id) override;
  absl::Status Forward(std::span<const worker::SequenceTokens> batch, worker::LogitsRows rows,
                       std::vector<float>* logits) override;
  // Staged; sent as the sequence's SequenceTokens.block_ids with its next
  // Forward (ranks run with KvCacheOptions::caller_assigns_pages: these are
  // their only pages).
  absl::Status AssignPages(int64_t seq_id, std::span<const int32_t> page_ids) override;
  absl::Status SaveKvBlocks(std::span<const worker::KvBlockTransfer> saves) override;
  absl::Status SaveStateSnapshots(std::span<const worker::StateSnapshotSave> saves) override;
  absl::Status LoadKvBlocks(std::span<const worker::KvBlockTransfer> loads,
                            std::vector<uint8_t>* loaded) override;
  std::optional<worker::KvCacheOptions> kv_options() const override;
  // Waits (by `deadline`) for the group to re-form from ranks that register
  // again (`worker --reconnect`, or restarted ranks): WaitReady. Then the
  // caller holds no sequences (and no staged pages) in the group.
  absl::Status Recover(absl::Time deadline) override;

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
