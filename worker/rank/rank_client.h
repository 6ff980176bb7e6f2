// worker/rank/rank_client.h — a rank process driven by a coordinator over
// gRPC (`exl3serve worker --coordinator HOST:PORT --rank R`): the rank dials
// the coordinator's RankControl endpoint (proto/exl3serve/rank/v1/rank.proto),
// registers, receives Setup, joins the communicator and loads its shard
// (rank_executor.h), reports Ready, heartbeats on its own thread and executes
// Steps in order.
//
//   RankClientOptions options;  options.coordinator_address = "10.0.0.1:50061";
//   options.rank = 1;  options.reconnect = true;
//   return RunRankClient(options);
//
// Endings: a Shutdown from the coordinator or the coordinator going away ends
// the session (OK, with a log line); a broken group (the rank lost its peers)
// ends it with the communicator's error. With `reconnect`, the rank instead
// drops its model and communicator and registers again, so a group can
// re-form after another rank restarts. A refused registration
// (FAILED_PRECONDITION: protocol version or world size mismatch) always ends
// the process with the coordinator's message; ALREADY_EXISTS (the slot is
// still held) is retried when reconnecting.
#ifndef EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_
#define EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace exl3serve::worker::rank {

// The rank protocol revision this binary speaks (rank.proto RANK_PROTOCOL_CURRENT).
inline constexpr uint32_t kRankProtocolVersion = 1;

class RankObserver;  // rank_executor.h

struct RankClientOptions {
  std::string coordinator_address;  // host:port of the coordinator's rank endpoint
  int rank = 0;
  int world_size = 0;     // 0 = whatever the coordinator's group has
  std::string model_dir;  // informational (Register.model_dir); Setup decides
  int threads = 1;        // kernel threads unless Setup says otherwise
  // Register again after the group is torn down or the coordinator goes away.
  bool reconnect = false;
  // How long to wait for the coordinator to accept a connection, per attempt
  // (the first one and each reconnection).
  absl::Duration connect_timeout = absl::Seconds(60);
  // The version sent in Register; tests override it to check refusal.
  uint32_t protocol_version = kRankProtocolVersion;
  // The rank's metrics (worker/metrics.h); borrowed, must outlive the call.
  RankObserver* observer = nullptr;
};

// Runs the rank until it is done; see the file comment for the endings.
// Errors: Unavailable when the coordinator is not reachable within
// connect_timeout; FailedPrecondition / InvalidArgument when the coordinator
// refused the registration (its message); the communicator's error when the
// group broke and reconnect is off; the load error when loading failed and
// reconnect is off.
absl::Status RunRankClient(const RankClientOptions& options);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_
