// cli/http_flags.h — the OpenAI HTTP API flags that `serve` and
// `coordinator` share (--http-port, --http-host, --served-model-name,
// --tool-call-parser, --reasoning-parser, --http-threads, the connection
// limits and deadlines --http-listen-backlog, --http-max-connections,
// --http-max-connections-per-ip, --http-{head,request,idle}-timeout) and the server
// they start beside the gRPC API, with the gRPC API's credentials (TLS
// files, bearer token) and listen policy.
//
//   HttpFlags http;  AddHttpFlags(app, &http);
//   ... EXL3_ASSIGN_OR_RETURN(auto server, StartHttpServer(*engine, http, grpc_options, metrics, model_dir));
//
// Thread safety: plain values, filled by CLI11 while parsing.
#ifndef EXL3SERVE_CLI_HTTP_FLAGS_H_
#define EXL3SERVE_CLI_HTTP_FLAGS_H_

#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "coordinator/engine.h"
#include "coordinator/grpc_server.h"
#include "coordinator/http/http_server.h"
#include "coordinator/metrics.h"

namespace exl3serve::cli {

struct HttpFlags {
  int port = -1;                            // --http-port: -1 = off, 0 = any free port
  std::string host;                         // --http-host: "" = the gRPC --host
  std::vector<std::string> served_model_names;  // --served-model-name (repeatable)
  std::string tool_call_parser = "auto";
  std::string reasoning_parser = "auto";
  int threads = 512;
  // The connection layer's limits (coordinator/http/http1_server.h).
  int listen_backlog = 4096;
  size_t max_connections = 8192;
  size_t max_connections_per_ip = 1024;
  double head_timeout_s = 10;
  double request_timeout_s = 60;
  double idle_timeout_s = 60;
  bool enabled() const { return port >= 0; }
};

void AddHttpFlags(CLI::App& app, HttpFlags* flags);

// Starts the HTTP API on `engine` when flags.enabled() (else returns null),
// with `grpc`'s TLS files, bearer token and listen policy; /metrics renders
// `metrics` (may be null) and the HTTP series register in it. The served
// names default to the model directory's last component. Prints
// "http: listening on HOST:PORT".
absl::StatusOr<std::unique_ptr<coordinator::http::HttpServer>> StartHttpServer(
    coordinator::Engine& engine, const HttpFlags& flags, const coordinator::GrpcServerOptions& grpc,
    coordinator::ServingMetrics* metrics, const std::string& model_dir);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_HTTP_FLAGS_H_
