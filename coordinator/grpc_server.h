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

// TLS of the public API. cert_file + key_file (PEM) turn TLS on; with
// client_ca_file the server asks for a client certificate and accepts only
// one signed by that CA (mutual TLS).
struct ServerTlsOptions {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;
  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

struct GrpcServerOptions {
  // Address to listen on (a name, IPv4 or IPv6 literal; "0.0.0.0" = all).
  std::string host = "127.0.0.1";
  // TCP port; 0 = any free port (port() says which).
  int port = 50051;
  // How often the health service re-reads Engine::ready(). 100 ms: a probe
  // sees a change within a tenth of a second, at ten cheap calls a second.
  // An engine that knows when readiness changes (a rank group losing a rank)
  // calls ReadinessMayHaveChanged() and the health status follows at once.
  absl::Duration readiness_poll_interval = absl::Milliseconds(100);
  GenerationServiceOptions service;
  ServerTlsOptions tls;
  // A file holding the clients' bearer token (surrounding whitespace
  // trimmed); sets service.auth_token. "" = none.
  std::string auth_token_file;
  // Without credentials the server listens on loopback only: a host that is
  // not loopback (127.0.0.0/8, ::1, localhost) needs TLS and a client check
  // (a bearer token or a client CA), unless this is set.
  bool insecure_listen_any = false;
  // How the caller names the settings, for error messages.
  std::string credentials_hint =
      "--tls-cert, --tls-key and --auth-token-file (or --tls-client-ca)";
};

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(const std::string& host);

// The loopback-only rule above, on the options alone (Start checks it too;
// callers check it before slow setup). FailedPrecondition naming the host.
absl::Status CheckListenPolicy(const GrpcServerOptions& options);

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

  // Wakes the health poller to re-read Engine::ready() now instead of at the
  // next poll. Thread-safe, never blocks on the engine (the poller thread
  // reads it), so it may be called from the engine's own callbacks.
  void ReadinessMayHaveChanged();

  // Drains, then stops. Health ("" and exl3serve.v1.Generation) goes
  // NOT_SERVING while the service "liveness" stays SERVING; the server keeps
  // answering, new Generate calls end UNAVAILABLE ("draining"); Generate
  // calls in flight get up to `grace` to finish. Then the server shuts down
  // (calls still running are cancelled, their requests aborted). Returns
  // once every call is done; as soon as the streams are, not after `grace`.
  // Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  class Impl;
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_GRPC_SERVER_H_
