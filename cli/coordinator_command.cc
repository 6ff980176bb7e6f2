// `exl3serve coordinator --config FILE`: the cluster's coordinator. Runs the
// rank endpoint (coordinator/rank_group.h) where `exl3serve worker
// --coordinator HOST:PORT --rank R` processes on any box register, the
// serving engine (coordinator/local_engine.h: scheduler, KV block tables,
// tokenizer) over that RemoteRankGroup, and the public gRPC API
// (exl3serve.v1.Generation + grpc.health.v1.Health) on `api_address`.
//
// Prints "listening on HOST:PORT" once the public port is bound (port 0
// picks one), "coordinator: waiting for N ranks on port P ..." for the rank
// endpoint, then "serving MODEL on HOST:PORT (world_size=N)" the first time
// the group is ready, and a line at every later change ("coordinator: ready
// (group generation G ...)" / "coordinator: not ready (...)"). Health is
// SERVING only while the group is ready. When a rank dies, in-flight
// requests wait up to timeouts.reform_ms for the group to re-form and are
// then replayed; past it they end with UNAVAILABLE, the coordinator keeps
// running and is ready again once the ranks are back.
// SIGINT/SIGTERM: NOT_SERVING, streams get shutdown_grace_ms, the ranks get
// Shutdown, exit 0. Example: deploy/cluster/local-2-ranks.yaml.
//
// The config (YAML; every key optional except model_dir and world_size; an
// unknown key is an error naming it):
//   model_dir: /models/llama-exl3      # as the ranks see it
//   local_model_dir: ""                # where this process reads config.json and
//                                      # tokenizer.json ("" = model_dir)
//   world_size: 2
//   expert_parallel: 0
//   capacities: [1, 1, 0.5]            # relative share per rank (none = all equal);
//                                      # a rank with less gets less of every layer
//   listen_address: 127.0.0.1:50061    # for ranks; an address other than loopback
//                                      # needs tls.rank_cert + tls.rank_key with
//                                      # rank_token_file and/or tls.rank_client_cert
//   api_address: 127.0.0.1:50051       # the public gRPC API (port 0 = any); an
//                                      # address other than loopback needs tls +
//                                      # auth_token_file (or tls.client_ca)
//   http_address: ""                   # the OpenAI HTTP API, e.g. 127.0.0.1:8000 ("" = off;
//                                      # same TLS and token as api_address)
//   http: {served_model_names: [name], tool_call_parser: auto, reasoning_parser: auto,
//          threads: 512}
//   tls:
//     cert: server.pem                 # the public API's TLS
//     key: server.key
//     client_ca: ""                    # set: clients need a certificate of it (mutual TLS)
//     rank_cert: rank-endpoint.pem     # TLS on the rank endpoint (listen_address)
//     rank_key: rank-endpoint.key
//     rank_ca: cluster-ca.pem          # ranks check rank_cert against it; with
//                                      # rank_client_cert the coordinator accepts only
//                                      # ranks whose client certificate it signed
//     rank_client_cert: rank.pem       # each rank's certificate (mutual TLS; `launch`
//     rank_client_key: rank.key        # passes these paths to its workers)
//     rank_server_name: ""             # the name ranks expect in rank_cert ("" = host)
//   auth_token_file: ""                # clients send `authorization: Bearer <token>`
//   rank_token_file: ""                # ranks send it (worker --rank-token-file)
//   insecure_listen_any: false         # allow a non-loopback api_address without them
//   insecure_rank_listen_any: false    # allow a non-loopback listen_address without them
//   shutdown_grace_ms: 5000            # on SIGINT/SIGTERM, for streams in flight
//   threads_per_rank: 0                # 0 = each rank's --threads
//   comm: {backend: shm|ucx, shm_name: "", bootstrap_address: "host:port",
//          ucx: {tls: tcp},              # UCX transports (ucx_tls: the same, older spelling)
//          nccl: {net: IB, ib_hca: "mlx5_0:1", ib_gid_index: 3, socket_ifname: eth0}}
//                                      # GPU ranks; `launch` passes them as worker
//                                      # --nccl-* flags (boxes[].nccl overrides per box)
//   kv: {bits: 16, num_pages: 256, page_size_tokens: 16,
//        disk: {path: /var/cache/exl3serve/kv-{rank}.bin, blocks: 0}}
//                                      # the prefix cache's disk tier on every rank's
//                                      # machine (0 blocks = none)
//   precision: {prefill: fp32, decode: int8}   # EXL3 linears on every rank: prefill
//                                      # fp32|bf16, decode fp32|int8 (int8: mul1 linears;
//                                      # a rank's own worker --*-precision flag wins)
//   engine: {max_running: 64, max_queue: 256, step_token_budget: 512,
//            default_max_tokens: 256, max_context: 0,
//            prefix_cache: true,          # reuse cached prompt prefixes' KV blocks
//            speculative: none,           # none|ngram|draft: draft tokens verified on
//            draft_model: "",             # the ranks (output identical); draft: this
//                                         # model, run in the coordinator's process
//            draft_tokens: 4,             # per sequence per step at most,
//            draft_token_budget: 128}     # and per step in all
//   timeouts: {join_ms: 60000, collective_ms: 60000, load_ms: 300000, step_ms: 60000,
//              heartbeat_interval_ms: 1000, heartbeat_ms: 5000, reform_ms: 60000}
#include <signal.h>

#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cli/cluster_keys.h"
#include "cli/commands.h"
#include "cli/coordinator_config.h"
#include "cli/coordinator_run.h"
#include "cli/http_flags.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/grpc_server.h"
#include "coordinator/local_engine.h"
#include "coordinator/metrics.h"
#include "coordinator/rank_group.h"
#include "worker/rank/rank_executor.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {
namespace {

namespace v1 = ::exl3serve::v1;

// GetServerInfo's ranks from the group's membership.
std::vector<v1::RankInfo> RankInfos(const coordinator::RemoteRankGroup& group) {
  std::vector<v1::RankInfo> ranks;
  for (const coordinator::RankSlotInfo& slot : group.status().ranks) {
    v1::RankInfo& info = ranks.emplace_back();
    info.set_rank(static_cast<uint32_t>(slot.rank));
    info.set_up(slot.up);  // registered, its stream open
    info.set_address(slot.up && !slot.loaded ? absl::StrCat(slot.address, " (loading)")
                                             : slot.address);
    info.set_last_heartbeat_age_seconds(slot.up ? absl::ToDoubleSeconds(slot.last_heartbeat_age)
                                                : 0.0);
    info.set_checkpoint_read_bytes(slot.loaded ? slot.bytes_read : 0);
  }
  return ranks;
}

// Blocks SIGINT/SIGTERM in every thread and waits for one on a thread of its
// own, so the command shuts the group down cleanly on Ctrl-C.
class StopSignal {
 public:
  StopSignal() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  // Waits up to `timeout`; true when a stop signal arrived.
  bool Wait(absl::Duration timeout) {
    const timespec ts = absl::ToTimespec(timeout);
    return sigtimedwait(&set_, nullptr, &ts) > 0;
  }

 private:
  sigset_t set_;
};

}  // namespace

CommandRunner RegisterCoordinatorCommand(CLI::App& app) {
  auto config = std::make_shared<std::string>();
  auto port_file = std::make_shared<std::string>();
  app.add_option("--config", *config,
                 "cluster config (YAML; keys in cli/coordinator_command.cc; example: "
                 "deploy/cluster/local-2-ranks.yaml)")
      ->required();
  app.add_option("--port-file", *port_file,
                 "write the bound rank port here (for scripts using listen_address port 0)");
  // Prometheus /metrics of the coordinator (coordinator/metrics.h); ranks
  // serve their own (`worker --metrics-port`).
  auto metrics_port = std::make_shared<int>(0);
  auto metrics_host = std::make_shared<std::string>("127.0.0.1");
  app.add_option("--metrics-port", *metrics_port, "Prometheus /metrics on this port (0 = off)")
      ->capture_default_str();
  app.add_option("--metrics-host", *metrics_host, "address of the /metrics endpoint")
      ->capture_default_str();
  auto no_prefix_cache = std::make_shared<bool>(false);
  app.add_flag("--no-prefix-cache", *no_prefix_cache,
               "compute every prompt token (overrides engine.prefix_cache)");
  auto http_port = std::make_shared<int>(-1);
  app.add_option("--http-port", *http_port,
                 "the OpenAI HTTP API on http_address's host at this port (overrides the config's "
                 "port; 0 = any free port; -1 = as the config says)");
  app.footer(
      "Serves exl3serve.v1.Generation + grpc.health.v1 on api_address (SERVING while every rank\n"
      "is loaded); ranks join with `exl3serve worker --coordinator HOST:PORT --rank R --reconnect`.\n"
      "Example config: deploy/cluster/local-2-ranks.yaml");
  return [config, port_file, metrics_port, metrics_host, http_port,
          no_prefix_cache]() -> absl::Status {
    return RunCoordinator(CoordinatorRunOptions{.config = *config,
                                                .port_file = *port_file,
                                                .metrics_port = *metrics_port,
                                                .metrics_host = *metrics_host,
                                                .http_port = *http_port,
                                                .no_prefix_cache = *no_prefix_cache});
  };
}

absl::Status CheckCoordinatorConfig(const std::string& file) {
  return LoadCoordinatorConfig(file).status();
}

absl::Status RunCoordinator(const CoordinatorRunOptions& options) {
  const std::string* config = &options.config;
  const std::string* port_file = &options.port_file;
  const int* metrics_port = &options.metrics_port;
  const std::string* metrics_host = &options.metrics_host;
  {
    EXL3_ASSIGN_OR_RETURN(CoordinatorConfig cfg, LoadCoordinatorConfig(*config));
    if (options.no_prefix_cache) cfg.engine.enable_prefix_caching = false;
    StopSignal stop;  // before any thread starts, so they inherit the mask
    EXL3_ASSIGN_OR_RETURN(coordinator::EngineModel model, coordinator::LoadEngineModel(&cfg.engine));
    // grpc.health.v1 follows the group at once (a lost rank -> NOT_SERVING
    // without waiting for the health poll): the group's state-change hook
    // pokes the server while one is attached.
    struct HealthHook {
      absl::Mutex mu;
      coordinator::GrpcServer* server ABSL_GUARDED_BY(mu) = nullptr;
    };
    auto hook = std::make_shared<HealthHook>();
    cfg.group.on_change = [hook] {
      absl::MutexLock lock(&hook->mu);
      if (hook->server != nullptr) hook->server->ReadinessMayHaveChanged();
    };
    auto detach_health = [hook] {
      absl::MutexLock lock(&hook->mu);
      hook->server = nullptr;
    };
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::RemoteRankGroup> owned_group,
                          coordinator::RemoteRankGroup::Start(cfg.group));
    // The engine owns the group (its executor); `group` stays valid while it lives.
    coordinator::RemoteRankGroup* group = owned_group.get();
    cfg.engine.executor_ready = [group] { return group->ready(); };
    cfg.engine.rank_info = [group] { return RankInfos(*group); };
    if (options.http_port >= 0) cfg.http.port = options.http_port;
    std::unique_ptr<coordinator::ServingMetrics> metrics;  // outlives the engine
    if (*metrics_port > 0 || cfg.http.enabled()) {
      // Without --metrics-port the HTTP API's /metrics serves the registry.
      EXL3_ASSIGN_OR_RETURN(metrics, coordinator::ServingMetrics::Start(
                                         *metrics_host, *metrics_port > 0 ? *metrics_port : -1,
                                         cfg.group.world_size, &cfg.engine));
      if (*metrics_port > 0) std::printf("metrics: coordinator %s\n", metrics->url().c_str());
    }
    absl::StatusOr<std::unique_ptr<coordinator::DraftModel>> draft =
        coordinator::LoadDraftModel(cfg.engine, model);
    if (!draft.ok()) {
      group->Shutdown("the coordinator could not load its draft model");
      return draft.status();
    }
    auto engine = std::make_unique<coordinator::LocalEngine>(cfg.engine, std::move(model),
                                                             std::move(owned_group),
                                                             std::move(*draft));
    auto metrics_attached = metrics ? metrics->Attach(*engine) : nullptr;  // goes before engine
    auto server_or = coordinator::GrpcServer::Start(*engine, cfg.server);
    if (!server_or.ok()) {
      group->Shutdown("the coordinator could not start its public API");
      engine->Shutdown();
      return absl::Status(server_or.status().code(),
                          absl::StrCat(server_or.status().message(), " (api_address)"));
    }
    std::unique_ptr<coordinator::GrpcServer> server = std::move(*server_or);
    {
      absl::MutexLock lock(&hook->mu);
      hook->server = server.get();
    }
    std::printf("listening on %s\n", server->address().c_str());
    auto http_or = StartHttpServer(*engine, cfg.http, cfg.server, metrics.get(), cfg.engine.model_dir);
    if (!http_or.ok()) {
      detach_health();
      server->Shutdown(absl::ZeroDuration());
      group->Shutdown("the coordinator could not start its HTTP API");
      engine->Shutdown();
      return absl::Status(http_or.status().code(),
                          absl::StrCat(http_or.status().message(), " (http_address)"));
    }
    std::unique_ptr<coordinator::http::HttpServer> http = std::move(*http_or);
    std::printf("coordinator: waiting for %d ranks on port %d (model %s)\n", cfg.group.world_size,
                group->port(), cfg.group.model_dir.c_str());
    std::fflush(stdout);
    if (!port_file->empty()) {
      FILE* f = std::fopen(port_file->c_str(), "w");
      if (f == nullptr) {
        detach_health();
        server->Shutdown(absl::ZeroDuration());
        group->Shutdown("the coordinator could not write --port-file");
        engine->Shutdown();
        return absl::InvalidArgumentError(absl::StrCat("cannot write ", *port_file));
      }
      std::fprintf(f, "%d\n", group->port());
      std::fclose(f);
    }
    bool was_ready = false, served = false;
    uint64_t generation = 0;
    while (!stop.Wait(absl::Milliseconds(250))) {
      const coordinator::RankGroupStatus status = group->status();
      const bool ready = status.state == coordinator::GroupState::kReady;
      if (ready != was_ready || (ready && status.generation != generation)) {
        if (ready) {
          const int64_t vocab = group->vocab_size();
          if (vocab != static_cast<int64_t>(engine->GetModelInfo().vocab_size())) {
            EXL3_LOG(kError) << "the ranks report a vocabulary of " << vocab << " but "
                             << cfg.engine.model_dir << "/config.json says "
                             << engine->GetModelInfo().vocab_size()
                             << " (model_dir / local_model_dir differ?)";
          }
          if (!served) {
            std::printf("serving %s on %s (world_size=%d)\n", cfg.engine.model_dir.c_str(),
                        server->address().c_str(), status.world_size);
            served = true;
          }
          std::printf("coordinator: ready (group generation %llu, %d ranks)\n",
                      static_cast<unsigned long long>(status.generation), status.world_size);
        } else {
          std::printf("coordinator: not ready (%s): %s\n",
                      coordinator::GroupStateName(status.state), status.last_error.c_str());
        }
        std::fflush(stdout);
        was_ready = ready;
        generation = status.generation;
      }
    }
    std::printf("coordinator: stopping\n");
    std::fflush(stdout);
    // Streams get the grace period; then the group stops (a step or a wait
    // for re-formation in flight ends at once) and the engine aborts the rest.
    {
      const absl::Duration grace = absl::Milliseconds(cfg.shutdown_grace_ms);
      std::thread http_drain([&] {
        if (http != nullptr) http->Shutdown(grace);
      });
      server->Shutdown(grace);
      http_drain.join();
    }
    group->Shutdown("the coordinator was stopped");
    detach_health();  // before the server goes away
    engine->Shutdown();
    std::printf("stopped\n");
    return absl::OkStatus();
  }
}

}  // namespace exl3serve::cli
