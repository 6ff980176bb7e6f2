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
// Steps come only from the coordinator: the rank dials out and executes the
// Steps that arrive on the stream it opened; it never listens for steps. With
// TLS (tls_ca_file) that stream reaches only a server holding a certificate
// of the configured CA, so nobody else can drive the rank.
//
// Endings: a Shutdown from the coordinator or the coordinator going away ends
// the session (OK, with a log line); a broken group (the rank lost its peers)
// ends it with the communicator's error. With `reconnect`, the rank instead
// drops its model and communicator and registers again, so a group can
// re-form after another rank restarts. A refused registration
// (FAILED_PRECONDITION: protocol version or world size mismatch) always ends
// the process with the coordinator's message, and so does UNAUTHENTICATED (no
// or a wrong rank token); ALREADY_EXISTS (the slot is still held) is retried
// when reconnecting. A refusal after loading ends it the same way: the
// coordinator ends the stream FAILED_PRECONDITION when the KV layout in this
// rank's Ready differs from its block allocator's (both named). With a client certificate, a stream the coordinator
// closes before answering anything (typically its TLS refused the
// certificate) ends the process with UNAVAILABLE naming that, unless
// reconnecting (then it is logged and retried with a growing pause).
#ifndef EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_
#define EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/trellis_gemm.h"
#include "sharding/spill_store.h"

namespace exl3serve::worker::rank {

// The rank protocol revision this binary speaks (rank.proto RANK_PROTOCOL_CURRENT).
inline constexpr uint32_t kRankProtocolVersion = 7;

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
  // > 0: build the KV cache with this many pages instead of Setup.kv's, so
  // tests can check the coordinator's refusal of a mismatched layout.
  int64_t kv_num_pages_for_testing = 0;
  // The channel's security (`worker --tls-ca ... --rank-token-file F`).
  // tls_ca_file set = TLS: the coordinator's certificate must be signed by
  // that CA and carry tls_server_name (default: the host of
  // coordinator_address); tls_cert_file + tls_key_file: this rank's client
  // certificate (mutual TLS); token_file: its content (whitespace trimmed) is
  // sent as `authorization: Bearer <token>` on every stream. Plaintext when
  // all are empty.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  std::string token_file;
  // Row tables this rank reads from its box's disk (`worker --spill-*`);
  // when set it wins over the coordinator's Setup.spill (the cache dir and
  // memory budget are the box's own). Unset: Setup.spill, else none.
  std::optional<sharding::SpillPolicy> spill;
  // EXL3 linear arithmetic of this rank (`worker --prefill-precision`,
  // `--decode-precision`); when set each wins over the coordinator's
  // Setup.prefill_precision / decode_precision. Unset: Setup's, else kFloat.
  std::optional<kernels::TrellisGemmPrecision> prefill_precision;
  std::optional<kernels::TrellisGemmPrecision> decode_precision;
  // The rank's metrics (worker/metrics.h); borrowed, must outlive the call.
  RankObserver* observer = nullptr;
};

// Runs the rank until it is done; see the file comment for the endings.
// Errors: InvalidArgument for unreadable TLS/token files (named);
// Unavailable when the coordinator is not reachable within connect_timeout
// (with the last connection error, e.g. a TLS handshake failure) or closed
// the stream before answering; Unauthenticated for a refused rank token; FailedPrecondition / InvalidArgument when the coordinator
// refused the registration (its message); the communicator's error when the
// group broke and reconnect is off; the load error when loading failed and
// reconnect is off; FailedPrecondition ("refused by the coordinator: KV layout
// mismatch ...") when the coordinator refused the KV layout of this rank's
// Ready, reconnect or not.
absl::Status RunRankClient(const RankClientOptions& options);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_RANK_CLIENT_H_
