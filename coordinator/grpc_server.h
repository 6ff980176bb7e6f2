// coordinator/grpc_server.h — runs the public gRPC API of one engine on
// host:port: the exl3serve.v1.Generation service (generation_service.h) and
// the standard grpc.health.v1.Health service, whose status ("" and
// "exl3serve.v1.Generation") follows Engine::ready() so Kubernetes gRPC
// probes work.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> server,
//                         GrpcServer::Start(*engine, {.host = "127.0.0.1", .port = 0}));
//   std::printf("listening on %s\n", server->address().c_str());
//   ...
//   server->Shutdown(absl::Seconds(5));   // before the engine goes away
//
// Thread safety: Start, Shutdown and the destructor from one thread; the
// accessors from any.
#ifndef EXL3SERVE_COORDINATOR_GRPC_SERVER_H_
#define EXL3SERVE_COORDINATOR_GRPC_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/engine.h"
#include "coordinator/generation_service.h"

namespace exl3serve::coordinator {

struct GrpcServerOptions {
  // Address to listen on (a name, IPv4 or IPv6 literal; "0.0.0.0" = all).
  std::string host = "127.0.0.1";
  // TCP port; 0 = any free port (port() says which).
  int port = 50051;
  // How often the health service re-reads Engine::ready(). 100 ms: a probe
  // sees a change within a tenth of a second, at ten cheap calls a second.
  absl::Duration readiness_poll_interval = absl::Milliseconds(100);
  GenerationServiceOptions service;
};

class GrpcServer {
 public:
  // Builds and starts the server. `engine` is borrowed and must outlive the
  // returned object. Errors: Unavailable naming the address when it cannot
  // be bound (in use, bad host).
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(Engine& engine,
                                                           const GrpcServerOptions& options);

  // Shutdown(absl::Seconds(5)) unless already shut down.
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The bound port and "host:port" (IPv6 hosts in brackets).
  int port() const;
  std::string address() const;

  // Health goes NOT_SERVING, new calls are refused, calls in flight get
  // `grace` to finish and are then cancelled (their requests aborted).
  // Returns once every call is done. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  class Impl;
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_GRPC_SERVER_H_
