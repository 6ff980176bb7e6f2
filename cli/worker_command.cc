// `exl3serve worker ...`: one rank of a tensor/expert-parallel group. Two
// ways to drive it:
//   --coordinator HOST:PORT --rank R [--world-size N] [--reconnect]
//       dial a coordinator (`exl3serve coordinator`), which sends the model,
//       group and communicator settings (worker/rank/rank_client.h);
//   --control-fd FD --model DIR --rank R --world-size N ...
//       started by a local driver (`generate --tp N`) with one end of a
//       socketpair (worker/rank/rank_server.h); not meant to be typed.
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "worker/metrics.h"
#include "worker/rank/rank_client.h"
#include "worker/rank/rank_server.h"

namespace exl3serve::cli {

CommandRunner RegisterWorkerCommand(CLI::App& app) {
  struct Args {
    worker::rank::RankServerOptions options;
    int kv_bits = 16;
    int64_t collective_timeout_ms = 60'000, join_timeout_ms = 60'000;
    std::string coordinator;
    bool reconnect = false;
    int64_t connect_timeout_ms = 60'000;
    uint32_t protocol_version = worker::rank::kRankProtocolVersion;
    int metrics_port = 0;
    std::string metrics_host = "127.0.0.1";
  };
  auto args = std::make_shared<Args>();
  worker::rank::RankServerOptions& o = args->options;
  app.add_option("--coordinator", args->coordinator,
                 "dial this coordinator (host:port of its rank endpoint)");
  app.add_flag("--reconnect", args->reconnect,
               "coordinator mode: register again when the group is torn down or the "
               "coordinator goes away");
  app.add_option("--connect-timeout-ms", args->connect_timeout_ms,
                 "coordinator mode: how long to wait for the coordinator, per attempt")
      ->capture_default_str();
  app.add_option("--protocol-version-for-testing", args->protocol_version)->group("");
  app.add_option("--model", o.model_dir, "model directory (control-fd mode; informational "
                                         "with --coordinator)");
  app.add_option("--rank", o.rank, "this rank")->required();
  app.add_option("--world-size", o.world_size,
                 "ranks in the group (with --coordinator: optional, checked)");
  app.add_option("--ep", o.expert_parallel, "expert-parallel groups (0 = one per rank)");
  app.add_option("--comm", o.comm.backend, "collective backend: shm or ucx")->capture_default_str();
  app.add_option("--shm-name", o.comm.shm_name, "shm: the group's shared-memory segment");
  app.add_option("--bootstrap", o.comm.bootstrap_address, "ucx: rank 0's host:port");
  app.add_option("--ucx-tls", o.comm.ucx_tls, "ucx: transports, e.g. tcp");
  app.add_option("--control-fd", o.control_fd, "the local driver's control socket");
  app.add_option("--threads", o.threads, "kernel threads")->capture_default_str();
  app.add_option("--kv-bits", args->kv_bits, "KV cache: 32, 16, 8 or 4")->capture_default_str();
  app.add_option("--kv-pages", o.kv.num_pages, "KV cache pages")->capture_default_str();
  app.add_option("--kv-page-size", o.kv.page_size_tokens, "positions per page")
      ->capture_default_str();
  app.add_option("--collective-timeout-ms", args->collective_timeout_ms)->capture_default_str();
  app.add_option("--join-timeout-ms", args->join_timeout_ms)->capture_default_str();
  app.add_option("--metrics-port", args->metrics_port,
                 "serve this rank's Prometheus /metrics on this port (0 = off)")
      ->capture_default_str();
  app.add_option("--metrics-host", args->metrics_host, "address of the /metrics endpoint")
      ->capture_default_str();
  return [args, &app]() -> absl::Status {
    // The rank's /metrics endpoint lives as long as the rank.
    std::unique_ptr<MetricsEndpoint> endpoint;
    std::unique_ptr<worker::RankMetrics> metrics;
    if (args->metrics_port > 0) {
      EXL3_ASSIGN_OR_RETURN(endpoint,
                            MetricsEndpoint::Start(args->metrics_host, args->metrics_port));
      metrics = std::make_unique<worker::RankMetrics>(
          endpoint->registry(),
          worker::RankMetricsOptions{.model_name = ModelNameLabel(args->options.model_dir),
                                     .rank = args->options.rank,
                                     .world_size = args->options.world_size});
    }
    if (!args->coordinator.empty()) {
      worker::rank::RankClientOptions client;
      client.coordinator_address = args->coordinator;
      client.rank = args->options.rank;
      client.world_size = app.count("--world-size") > 0 ? args->options.world_size : 0;
      client.model_dir = args->options.model_dir;
      client.threads = args->options.threads;
      client.reconnect = args->reconnect;
      client.connect_timeout = absl::Milliseconds(args->connect_timeout_ms);
      client.protocol_version = args->protocol_version;
      client.observer = metrics.get();
      return worker::rank::RunRankClient(client);
    }
    if (args->options.control_fd < 0 || args->options.model_dir.empty()) {
      return absl::InvalidArgumentError(
          "worker: give --coordinator HOST:PORT, or --control-fd with --model and --world-size");
    }
    worker::rank::RankServerOptions options = args->options;
    EXL3_ASSIGN_OR_RETURN(options.kv.dtype, worker::KvCacheDtypeFromBits(args->kv_bits));
    options.collective_timeout = absl::Milliseconds(args->collective_timeout_ms);
    options.join_timeout = absl::Milliseconds(args->join_timeout_ms);
    options.observer = metrics.get();
    return worker::rank::RunRankServer(options);
  };
}

}  // namespace exl3serve::cli
