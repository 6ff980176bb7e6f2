#include "coordinator/grpc_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace exl3serve::coordinator {
namespace {

// The fully qualified name of our service, as the health service knows it.
constexpr char kGenerationServiceName[] = "exl3serve.v1.Generation";

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);  // IPv6 literal
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

class GrpcServer::Impl {
 public:
  Impl(Engine& engine, const GrpcServerOptions& options)
      : engine_(engine), options_(options), service_(engine, options.service) {}

  ~Impl() { Shutdown(absl::Seconds(5)); }

  absl::Status Start() {
    grpc::EnableDefaultHealthCheckService(true);  // must precede the builder
    grpc::ServerBuilder builder;
    const std::string wanted = JoinHostPort(options_.host, options_.port);
    // No SO_REUSEPORT: a second server on a busy port must fail, not share it.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort(wanted, grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.grpc_service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      server_.reset();
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", wanted, " (port in use, or no such local address; --port 0 picks a free port)"));
    }
    address_ = JoinHostPort(options_.host, port_);
    SetServing(engine_.ready());
    poller_ = std::thread([this] { PollReadiness(); });
    return absl::OkStatus();
  }

  void Shutdown(absl::Duration grace) {
    if (server_ == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (poller_.joinable()) poller_.join();
    // NOT_SERVING for every service, and later SetServingStatus calls are ignored.
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->Shutdown();
    }
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
    server_.reset();
  }

  int port() const { return port_; }
  const std::string& address() const { return address_; }

 private:
  void SetServing(bool serving) {
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health == nullptr) return;
    health->SetServingStatus(serving);
    health->SetServingStatus(kGenerationServiceName, serving);
  }

  // Follows Engine::ready() until Shutdown.
  void PollReadiness() {
    bool serving = engine_.ready();
    SetServing(serving);
    absl::MutexLock lock(&mu_);
    while (!stopping_) {
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.readiness_poll_interval);
      if (stopping_) break;
      const bool ready = engine_.ready();
      if (ready != serving) {
        serving = ready;
        SetServing(serving);
      }
    }
  }

  // Constant after Start.
  Engine& engine_;
  const GrpcServerOptions options_;
  GenerationService service_;  // outlives server_ (declared before it)
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::thread poller_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(Engine& engine,
                                                              const GrpcServerOptions& options) {
  auto impl = std::make_unique<Impl>(engine, options);
  absl::Status status = impl->Start();
  if (!status.ok()) return status;
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcServer::~GrpcServer() = default;

int GrpcServer::port() const { return impl_->port(); }

std::string GrpcServer::address() const { return impl_->address(); }

void GrpcServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }

}  // namespace exl3serve::coordinator
