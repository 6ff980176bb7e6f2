#include "coordinator/grpc_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <arpa/inet.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace exl3serve::coordinator {
namespace {

// The fully qualified name of our service, as the health service knows it.
constexpr char kGenerationServiceName[] = "exl3serve.v1.Generation";
// Stays SERVING while the process is up, draining included (liveness probe).
constexpr char kLivenessServiceName[] = "liveness";

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is empty"));
  return text.str();
}

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);  // IPv6 literal
  }
  return absl::StrCat(host, ":", port);
}

// The service options with the token read from auth_token_file.
absl::StatusOr<GenerationServiceOptions> ServiceOptions(const GrpcServerOptions& options) {
  GenerationServiceOptions service = options.service;
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadFile(options.auth_token_file, "the auth token file");
    if (!token.ok()) return token.status();
    service.auth_token = std::string(absl::StripAsciiWhitespace(*token));
    if (service.auth_token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the auth token file ", options.auth_token_file, " holds only whitespace"));
    }
  }
  return service;
}

}  // namespace

class GrpcServer::Impl {
 public:
  Impl(Engine& engine, const GrpcServerOptions& options, GenerationServiceOptions service)
      : engine_(engine),
        options_(options),
        service_(engine, std::move(service)) {}

  ~Impl() { Shutdown(absl::Seconds(5)); }

  absl::Status Start() {
    grpc::EnableDefaultHealthCheckService(true);  // must precede the builder
    grpc::ServerBuilder builder;
    const std::string wanted = JoinHostPort(options_.host, options_.port);
    // No SO_REUSEPORT: a second server on a busy port must fail, not share it.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    const ServerTlsOptions& tls = options_.tls;
    if (tls.enabled()) {
      if (tls.cert_file.empty() || tls.key_file.empty()) {
        return absl::InvalidArgumentError("TLS needs both a certificate and its private key");
      }
      EXL3_ASSIGN_OR_RETURN(std::string cert, ReadFile(tls.cert_file, "the TLS certificate"));
      EXL3_ASSIGN_OR_RETURN(std::string key, ReadFile(tls.key_file, "the TLS private key"));
      grpc::SslServerCredentialsOptions ssl(
          tls.client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                     : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      if (!tls.client_ca_file.empty()) {
        EXL3_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(tls.client_ca_file, "the client CA"));
      }
      ssl.pem_key_cert_pairs.push_back({key, cert});
      credentials = grpc::SslServerCredentials(ssl);
    } else if (!tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError("a client CA (mutual TLS) needs TLS: a certificate and key");
    }
    EXL3_RETURN_IF_ERROR(CheckListenPolicy(options_));
    builder.AddListeningPort(wanted, credentials, &port_);
    builder.RegisterService(service_.grpc_service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      server_.reset();
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on ", wanted, " (port in use, or no such local address; --port 0 picks a free port)"));
    }
    address_ = JoinHostPort(options_.host, port_);
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(kLivenessServiceName, true);
    }
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
    // Drain: readiness false, liveness true, new Generate calls UNAVAILABLE,
    // the streams in flight go on for up to `grace`.
    const absl::Time deadline = absl::Now() + grace;
    SetServing(false);
    service_.StartDraining();
    while (service_.active_generate_calls() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    // NOT_SERVING for every service, and later SetServingStatus calls are ignored.
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->Shutdown();
    }
    // What is left (streams past the grace, unary calls) gets a moment, then
    // is cancelled.
    server_->Shutdown(absl::ToChronoTime(std::max(deadline, absl::Now() + absl::Milliseconds(200))));
    server_->Wait();
    server_.reset();
  }

  int port() const { return port_; }
  const std::string& address() const { return address_; }

 private:
  void SetServing(bool serving) {
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health == nullptr) return;
    // By name: SetServingStatus(bool) would set every service, "liveness" too.
    health->SetServingStatus("", serving);
    health->SetServingStatus(kGenerationServiceName, serving);
  }

  // Follows Engine::ready() until Shutdown: every poll interval, and at once
  // when poked. Engine::ready() is read without mu_ held, so an engine may
  // poke from under its own locks.
  void PollReadiness() {
    bool serving = engine_.ready();
    SetServing(serving);
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || poked_; };
        mu_.AwaitWithTimeout(absl::Condition(&woken), options_.readiness_poll_interval);
        if (stopping_) return;
        poked_ = false;
      }
      const bool ready = engine_.ready();
      if (ready != serving) {
        serving = ready;
        SetServing(serving);
      }
    }
  }

 public:
  void Poke() {
    absl::MutexLock lock(&mu_);
    poked_ = true;
  }

 private:

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
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(Engine& engine,
                                                              const GrpcServerOptions& options) {
  EXL3_ASSIGN_OR_RETURN(GenerationServiceOptions service, ServiceOptions(options));
  auto impl = std::make_unique<Impl>(engine, options, std::move(service));
  absl::Status status = impl->Start();
  if (!status.ok()) return status;
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(impl)));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcServer::~GrpcServer() = default;

int GrpcServer::port() const { return impl_->port(); }

std::string GrpcServer::address() const { return impl_->address(); }

void GrpcServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }

void GrpcServer::ReadinessMayHaveChanged() { impl_->Poke(); }

}  // namespace exl3serve::coordinator
