// coordinator/generation_service.h — the public gRPC API (exl3serve.v1.Generation,
// proto/exl3serve/v1/generation.proto) over an Engine. The service owns only
// gRPC: request ids, per-call response queues, cancellation and status codes;
// everything else (validation, scheduling, ranks) is the engine's.
//
//   GenerationService service(engine);          // engine must outlive it
//   builder.RegisterService(service.grpc_service());
//
// Most callers want coordinator/grpc_server.h, which also runs the standard
// grpc.health.v1.Health service and owns the grpc::Server.
//
// Generate: the engine's response callback (on the engine's scheduler thread)
// only appends to the call's queue and, when no write is in flight, starts
// one; it never blocks. Chunks that pile up behind a slow client are merged
// into one chunk (token ids, text and logprobs concatenated, counts the
// latest), so a stream's queue holds at most one chunk plus the final
// message. The final message (complete or error) ends the call: OK after a
// complete, the error's code and message after an error. A request without a
// request_id gets one ("grpc-<n>") before it reaches the engine, so a client
// cancel can always be turned into Engine::Abort. Submit errors finish the
// call with the same code and message (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
// UNAVAILABLE ...) and no messages.
//
// HealthCheck: shallow = engine.ready(); deep = Engine::DeepHealthCheck with
// the call's deadline (at most deep_health_timeout), run on the service's own
// thread (one deep check at a time) so no gRPC thread blocks.
//
// Thread safety: constructed and destroyed on one thread; everything else
// runs on gRPC's callback threads and the engine's scheduler thread. Destroy
// it only after the grpc::Server it is registered with has shut down.
#ifndef EXL3SERVE_COORDINATOR_GENERATION_SERVICE_H_
#define EXL3SERVE_COORDINATOR_GENERATION_SERVICE_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "coordinator/engine.h"

namespace grpc {
class Service;
}

namespace exl3serve::coordinator {

struct GenerationServiceOptions {
  // Upper bound of a deep health check when the client's deadline is later
  // (or unset); a deep check is a one-token forward through every rank.
  absl::Duration deep_health_timeout = absl::Seconds(30);
  // When non-empty, every exl3serve.v1.Generation call must carry the
  // metadata `authorization: Bearer <auth_token>` (compared in constant
  // time), else it ends UNAUTHENTICATED before reaching the engine. The
  // standard grpc.health.v1 service stays open for probes.
  std::string auth_token;
};

class GenerationService {
 public:
  // `engine` is borrowed and must outlive this object.
  explicit GenerationService(Engine& engine, GenerationServiceOptions options = {});
  ~GenerationService();
  GenerationService(const GenerationService&) = delete;
  GenerationService& operator=(const GenerationService&) = delete;

  // The gRPC service to register on a grpc::ServerBuilder; owned by this object.
  grpc::Service* grpc_service();

  // Drain: from now on Generate ends at once with UNAVAILABLE ("draining")
  // and the shallow HealthCheck says unhealthy; calls in flight go on.
  void StartDraining();
  // Generate calls in flight (created and not yet done).
  int active_generate_calls() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_GENERATION_SERVICE_H_
