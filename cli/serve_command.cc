// `exl3serve serve --model DIR [--tp N] [--ep M] [--host H] [--port P] ...`:
// one box, the whole cluster: the coordinator (scheduler, KV block tables,
// tokenizer) with N local rank processes, and the public gRPC API
// (exl3serve.v1.Generation + grpc.health.v1.Health) on HOST:PORT.
//
// Prints "listening on HOST:PORT" as soon as the port is bound (--port 0
// picks a free one), then "serving MODEL on HOST:PORT (tp=N)" once every
// rank is loaded and warmed up (until then health says NOT_SERVING).
// --metrics-port P (0 = off) serves the coordinator's Prometheus /metrics on
// --metrics-host:P and rank r's on P+1+r; it prints "metrics: coordinator
// URL" and "metrics: rank R URL" once they are bound.
// SIGINT/SIGTERM drains: grpc.health.v1 NOT_SERVING ("liveness" stays
// SERVING), new Generate calls end UNAVAILABLE, streams in flight get up to
// --shutdown-grace-ms to finish (then they are cancelled), the engine stops
// its ranks, and the command returns 0 (as soon as the streams are done).
// Security (coordinator/grpc_server.h): --tls-cert/--tls-key, mutual TLS with
// --tls-client-ca, a bearer token with --auth-token-file; without them only a
// loopback --host is accepted (--insecure-listen-any overrides).
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "cli/capacity_flags.h"
#include "cli/http_flags.h"
#include "cli/precision_flags.h"
#include "cli/spill_flags.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/grpc_server.h"
#include "coordinator/local_engine.h"
#include "coordinator/metrics.h"

namespace exl3serve::cli {
namespace {

// SIGINT/SIGTERM -> one byte on a pipe the main thread polls (self-pipe: the
// handler only calls write(2), which is async-signal-safe).
int g_signal_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int signal) {
  const char byte = static_cast<char>(signal);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
}

absl::Status InstallStopSignals() {
  if (g_signal_pipe[0] < 0 && ::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError("serve: cannot create the signal pipe");
  }
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  return absl::OkStatus();
}

// Waits up to `timeout` for a stop signal; returns it, or 0.
int WaitStopSignal(absl::Duration timeout) {
  pollfd fd = {g_signal_pipe[0], POLLIN, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
  if (::poll(&fd, 1, ms) <= 0) return 0;
  char byte = 0;
  if (::read(g_signal_pipe[0], &byte, 1) != 1) return 0;
  return byte;
}

}  // namespace

CommandRunner RegisterServeCommand(CLI::App& app) {
  struct Args {
    coordinator::EngineOptions engine;
    coordinator::GrpcServerOptions server;
    int64_t shutdown_grace_ms = 5000;
    int64_t ready_timeout_ms = 600'000;
    int metrics_port = 0;
    std::string metrics_host = "127.0.0.1";
    SpillFlags spill;
    std::string capacities;
    std::string speculative = "none";
    PrecisionFlags precision;
    HttpFlags http;
  };
  auto args = std::make_shared<Args>();
  args->server.port = 50051;
  args->server.credentials_hint =
      "--tls-cert and --tls-key, with --auth-token-file and/or --tls-client-ca";
  app.add_option("--model", args->engine.model_dir, "model directory (EXL3 or Hugging Face)")
      ->required();
  app.add_option("--tp", args->engine.tensor_parallel, "rank processes (tensor parallelism)")
      ->capture_default_str();
  app.add_option("--ep", args->engine.expert_parallel,
                 "MoE: expert-parallel groups among the ranks (0 = one per rank)");
  app.add_option("--capacities", args->capacities,
                 "relative capacity per rank, e.g. 1,1,0.5 (a rank with less gets "
                 "proportionally less of every layer; default: all equal)");
  app.add_option("--host", args->server.host, "address to listen on (0.0.0.0 = all)")
      ->capture_default_str();
  app.add_option("--port", args->server.port, "TCP port (0 = any free port)")->capture_default_str();
  app.add_option("--tls-cert", args->server.tls.cert_file, "TLS: the server's PEM certificate (chain)");
  app.add_option("--tls-key", args->server.tls.key_file, "TLS: its PEM private key");
  app.add_option("--tls-client-ca", args->server.tls.client_ca_file,
                 "mutual TLS: accept only clients with a certificate signed by this PEM CA");
  app.add_option("--auth-token-file", args->server.auth_token_file,
                 "clients must send `authorization: Bearer <the token in this file>`");
  app.add_flag("--insecure-listen-any", args->server.insecure_listen_any,
               "allow a non-loopback --host without TLS and a client check");
  app.add_option("--threads-per-rank", args->engine.threads_per_rank,
                 "kernel threads of each rank process")
      ->capture_default_str();
  app.add_option("--kv-pages", args->engine.kv.num_pages,
                 "KV cache pages of 16 positions on every rank (the pool all sequences share)")
      ->capture_default_str();
  app.add_option("--kv-disk-path", args->engine.kv_disk_path,
                 "the prefix cache's disk tier: one file per rank at this path ({rank} = the "
                 "rank), holding --kv-disk-blocks evicted KV blocks");
  app.add_option("--kv-disk-blocks", args->engine.kv_disk_blocks,
                 "KV blocks each rank's disk tier holds (0 = no disk tier)")
      ->capture_default_str();
  app.add_option("--max-context", args->engine.max_context,
                 "positions one sequence may hold, prompt + max_tokens (0 = the pool's, capped by "
                 "max_position_embeddings)")
      ->capture_default_str();
  app.add_option("--default-max-tokens", args->engine.default_max_tokens,
                 "max_tokens of a request that leaves it unset")
      ->capture_default_str();
  app.add_option("--step-token-budget", args->engine.step_token_budget,
                 "new tokens per forward at most (decode rows + chunked prefill)")
      ->capture_default_str();
  app.add_option("--max-state-sequences", args->engine.max_state_sequences,
                 "models with a recurrent state per sequence (Qwen3-Next, Qwen3.5): sequences "
                 "holding one at a time at most, more wait (0 = --max-running)")
      ->capture_default_str();
  app.add_option("--state-snapshots", args->engine.state_snapshots,
                 "models with a recurrent state: snapshots of it at block boundaries that the "
                 "prefix cache keeps (each the state bytes of one sequence; 0 = no prefix hits)")
      ->capture_default_str();
  app.add_option("--state-snapshot-interval", args->engine.state_snapshot_interval,
                 "... taken at each prompt's last full block and every this many blocks (0 = "
                 "only there)")
      ->capture_default_str();
  app.add_option("--max-running", args->engine.max_running, "sequences decoded together at most")
      ->capture_default_str();
  app.add_flag("--no-prefix-cache{false}", args->engine.enable_prefix_caching,
               "compute every prompt token (default: reuse the KV blocks of cached prompt "
               "prefixes)");
  app.add_option("--speculative", args->speculative,
                 "speculative decoding: none; ngram (draft tokens by prompt lookup over each "
                 "sequence's own tokens); or draft (a smaller model with the same tokenizer, "
                 "--draft-model). Drafts are verified on the ranks: the output is identical")
      ->capture_default_str();
  app.add_flag("--no-draft-governor{false}", args->engine.draft_governor,
               "speculative decoding: draft whenever the windows say so (default: time decode "
               "steps with and without drafts and draft only while it costs less per token)");
  app.add_option("--draft-model", args->engine.draft_model_dir,
                 "speculative decoding by a draft model: its directory (EXL3 or Hugging Face; "
                 "the same vocabulary), run in this process");
  app.add_option("--draft-tokens", args->engine.draft_tokens,
                 "speculative decoding: draft tokens per sequence per step at most (1..15; "
                 "each sequence's window adapts to its acceptance)")
      ->capture_default_str();
  app.add_option("--draft-token-budget", args->engine.draft_token_budget,
                 "speculative decoding: draft tokens per step at most, over all sequences")
      ->capture_default_str();
  app.add_option("--max-queue", args->engine.max_queue,
                 "requests waiting at most (beyond: RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  app.add_option("--shutdown-grace-ms", args->shutdown_grace_ms,
                 "on SIGINT/SIGTERM, how long streams in flight may still run")
      ->capture_default_str();
  app.add_option("--ready-timeout-ms", args->ready_timeout_ms,
                 "give up when the ranks are not ready within this")
      ->capture_default_str();
  app.add_option("--metrics-port", args->metrics_port,
                 "Prometheus /metrics of the coordinator on this port, rank r's on port+1+r "
                 "(0 = off)")
      ->capture_default_str();
  app.add_option("--metrics-host", args->metrics_host, "address of the /metrics endpoints")
      ->capture_default_str();
  AddSpillFlags(app, &args->spill);
  AddPrecisionFlags(app, &args->precision);
  AddHttpFlags(app, &args->http);
  return [args]() -> absl::Status {
    EXL3_RETURN_IF_ERROR(InstallStopSignals());
    EXL3_RETURN_IF_ERROR(coordinator::CheckListenPolicy(args->server));
    // Declared before the engine, which reports to it; `attached` (after
    // the engine) stops the scrape-time refresh before the engine goes.
    std::unique_ptr<coordinator::ServingMetrics> metrics;
    coordinator::EngineOptions engine_options = args->engine;
    EXL3_ASSIGN_OR_RETURN(engine_options.speculative,
                          coordinator::ParseSpeculativeMethod(args->speculative));
    engine_options.spill = args->spill.Policy();
    engine_options.prefill_precision = args->precision.Prefill();
    engine_options.decode_precision = args->precision.Decode();
    // As CreateLocalEngine: tp ranks, or ep ranks for expert parallelism alone.
    const int ranks = engine_options.tensor_parallel > 1 ? engine_options.tensor_parallel
                                                         : std::max(1, engine_options.expert_parallel);
    EXL3_ASSIGN_OR_RETURN(engine_options.rank_capacities,
                          ParseCapacitiesFlag(args->capacities, ranks));
    if (args->metrics_port > 0) {
      if (ranks > 1 && args->metrics_port + ranks > 65535) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--metrics-port ", args->metrics_port, ": ranks need ports up to ",
            args->metrics_port + ranks, ", above 65535"));
      }
      EXL3_ASSIGN_OR_RETURN(metrics, coordinator::ServingMetrics::Start(
                                         args->metrics_host, args->metrics_port, ranks,
                                         &engine_options));
      if (ranks > 1) {
        engine_options.rank_metrics_port = args->metrics_port + 1;
        engine_options.rank_metrics_host = args->metrics_host;
      }
      std::printf("metrics: coordinator %s\n", metrics->url().c_str());
      std::fflush(stdout);
    } else if (args->http.enabled()) {
      // No /metrics port of its own: the HTTP API serves the registry.
      EXL3_ASSIGN_OR_RETURN(metrics, coordinator::ServingMetrics::Start(args->metrics_host, -1, ranks,
                                                                        &engine_options));
    }
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::Engine> engine,
                          coordinator::CreateLocalEngine(engine_options));
    std::unique_ptr<coordinator::ServingMetrics::Attachment> attached;
    if (metrics != nullptr) {
      attached = metrics->Attach(*engine);
      for (int r = 0; ranks > 1 && args->metrics_port > 0 && r < ranks; ++r) {
        std::printf("metrics: rank %d http://%s:%d/metrics\n", r, args->metrics_host.c_str(),
                    args->metrics_port + 1 + r);
      }
      std::fflush(stdout);
    }
    auto server_or = coordinator::GrpcServer::Start(*engine, args->server);
    if (!server_or.ok()) {
      engine->Shutdown();
      return server_or.status();
    }
    std::unique_ptr<coordinator::GrpcServer> server = std::move(*server_or);
    std::printf("listening on %s\n", server->address().c_str());
    std::fflush(stdout);
    auto http_or = StartHttpServer(*engine, args->http, args->server, metrics.get(),
                                   args->engine.model_dir);
    if (!http_or.ok()) {
      server->Shutdown(absl::ZeroDuration());
      engine->Shutdown();
      return http_or.status();
    }
    std::unique_ptr<coordinator::http::HttpServer> http = std::move(*http_or);

    auto stop = [&](int signal) {
      if (signal != 0) EXL3_LOG(kInfo) << "serve: signal " << signal << ", shutting down";
      const absl::Duration grace = absl::Milliseconds(args->shutdown_grace_ms);
      // Both APIs drain at once, each with the whole grace period.
      std::thread http_drain([&] {
        if (http != nullptr) http->Shutdown(grace);
      });
      server->Shutdown(grace);
      http_drain.join();
      engine->Shutdown();
    };
    const absl::Time ready_by = absl::Now() + absl::Milliseconds(args->ready_timeout_ms);
    while (!engine->ready()) {
      if (absl::Now() > ready_by) {
        stop(0);
        return absl::DeadlineExceededError(absl::StrCat(
            "serve: the ranks were not ready within ", args->ready_timeout_ms,
            " ms (--ready-timeout-ms)"));
      }
      if (const int signal = WaitStopSignal(absl::Milliseconds(100)); signal != 0) {
        stop(signal);
        return absl::OkStatus();
      }
    }
    std::printf("serving %s on %s (tp=%d)\n", args->engine.model_dir.c_str(),
                server->address().c_str(), args->engine.tensor_parallel);
    std::fflush(stdout);
    bool ready = true;
    for (;;) {
      if (const int signal = WaitStopSignal(absl::Seconds(1)); signal != 0) {
        stop(signal);
        break;
      }
      if (engine->ready() != ready) {
        ready = !ready;
        EXL3_LOG(kWarning) << "serve: " << (ready ? "ready again" : "not ready (rank group down)");
      }
    }
    std::printf("stopped\n");
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
