#include "cli/http_flags.h"

#include <malloc.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/metrics.h"
#include "common/status_macros.h"

namespace exl3serve::cli {

void AddHttpFlags(CLI::App& app, HttpFlags* flags) {
  app.add_option("--http-port", flags->port,
                 "OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
                 "/tokenize, /health, /metrics) on this port; -1 = off, 0 = any free port")
      ->capture_default_str();
  app.add_option("--http-host", flags->host, "address of the HTTP API (default: --host)");
  app.add_option("--served-model-name", flags->served_model_names,
                 "names clients may send as `model` (repeatable; default: the model directory's name)");
  app.add_option("--tool-call-parser", flags->tool_call_parser,
                 "tool-call format of the model's output: auto (from the chat template), hermes, "
                 "llama3_json, mistral, none")
      ->capture_default_str();
  app.add_option("--reasoning-parser", flags->reasoning_parser,
                 "split <think>...</think> into reasoning_content: auto (the template uses it), "
                 "think, none")
      ->capture_default_str();
  app.add_option("--http-threads", flags->threads,
                 "HTTP requests handled at once (each live stream holds one; idle and slow "
                 "connections hold none)")
      ->capture_default_str();
  app.add_option("--http-listen-backlog", flags->listen_backlog,
                 "connections the kernel queues before they are accepted (capped by net.core.somaxconn)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--http-max-connections", flags->max_connections,
                 "open HTTP connections; beyond it a new one gets 503 + Retry-After")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 24));
  app.add_option("--http-max-connections-per-ip", flags->max_connections_per_ip,
                 "open HTTP connections from one client address; beyond it 503 + Retry-After")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 24));
  app.add_option("--http-head-timeout", flags->head_timeout_s,
                 "seconds for a request's line and headers (and the TLS handshake) to arrive; then 408")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--http-request-timeout", flags->request_timeout_s,
                 "seconds for a whole request, body included, to arrive; then 408")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--http-idle-timeout", flags->idle_timeout_s,
                 "seconds a keep-alive connection may wait without a request before it is closed")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 86400.0));
}

absl::StatusOr<std::unique_ptr<coordinator::http::HttpServer>> StartHttpServer(
    coordinator::Engine& engine, const HttpFlags& flags, const coordinator::GrpcServerOptions& grpc,
    coordinator::ServingMetrics* metrics, const std::string& model_dir) {
  if (!flags.enabled()) return std::unique_ptr<coordinator::http::HttpServer>();
  coordinator::GrpcServerOptions policy = grpc;
  policy.host = flags.host.empty() ? grpc.host : flags.host;
  if (absl::Status s = coordinator::CheckListenPolicy(policy); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--http-host: ", s.message()));
  }
  coordinator::http::HttpServerOptions options;
  options.host = policy.host;
  options.port = flags.port;
  options.served_model_names = flags.served_model_names;
  if (options.served_model_names.empty()) options.served_model_names.push_back(ModelNameLabel(model_dir));
  options.tls_cert_file = grpc.tls.cert_file;
  options.tls_key_file = grpc.tls.key_file;
  options.tls_client_ca_file = grpc.tls.client_ca_file;
  options.auth_token_file = grpc.auth_token_file;
  options.threads = flags.threads;
  options.limits.listen_backlog = flags.listen_backlog;
  options.limits.max_connections = flags.max_connections;
  options.limits.max_connections_per_ip = flags.max_connections_per_ip;
  options.limits.head_timeout = absl::Seconds(flags.head_timeout_s);
  options.limits.request_timeout = absl::Seconds(flags.request_timeout_s);
  options.limits.idle_timeout = absl::Seconds(flags.idle_timeout_s);
  options.tool_call_parser = flags.tool_call_parser;
  options.reasoning_parser = flags.reasoning_parser;
  options.system_fingerprint = "exl3serve";
  options.model_name_label = ModelNameLabel(model_dir);
  if (metrics != nullptr) {
    options.metrics_text = [metrics] { return metrics->RenderText(); };
    options.registry = &metrics->registry();
  }
  // Request bodies of up to 8 MiB, and their parsed copies, come and go on
  // many threads. glibc's dynamic thresholds would rise to the largest block
  // freed (then up to 32 MiB stays in each arena's top, which malloc_trim
  // does not release for non-main arenas: the coordinator grew 30 -> 56 MiB
  // in soak.sh's abuse phase and stayed). Fixed thresholds keep big blocks
  // mmapped and arenas trimmed. The coordinator process only: ranks run in
  // their own processes.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  mallopt(M_TRIM_THRESHOLD, 512 << 10);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::http::HttpServer> server,
                        coordinator::http::HttpServer::Start(engine, options));
  std::printf("http: listening on %s\n", server->address().c_str());
  std::fflush(stdout);
  return server;
}

}  // namespace exl3serve::cli
