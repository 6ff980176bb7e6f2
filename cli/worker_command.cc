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
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "cli/capacity_flags.h"
#include "cli/precision_flags.h"
#include "cli/spill_flags.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "worker/comm/comm_factory.h"
#include "worker/metrics.h"
#include "worker/rank/rank_client.h"
#include "worker/rank/rank_server.h"

namespace exl3serve::cli {
namespace {

// The box-local collective settings from the --nccl-* / --ucx-tls flags.
absl::Status ParseLocalCommFlags(const std::vector<std::string>& nccl_env,
                                 worker::comm::LocalCommDefaults* local) {
  for (const std::string& entry : nccl_env) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0 || entry.compare(0, 5, "NCCL_") != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker: --nccl-env wants NCCL_NAME=VALUE, got `", entry, "`"));
    }
    local->nccl.extra_env.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return absl::OkStatus();
}

std::string DescribeLocalComm(const worker::comm::LocalCommDefaults& local) {
  std::vector<std::string> parts;
  const worker::comm::NcclOptions& n = local.nccl;
  if (!local.ucx_tls.empty()) parts.push_back(absl::StrCat("ucx_tls=", local.ucx_tls));
  if (!n.net_name.empty()) parts.push_back(absl::StrCat("nccl.net=", n.net_name));
  if (!n.net_plugin.empty()) parts.push_back(absl::StrCat("nccl.net_plugin=", n.net_plugin));
  if (!n.ib_hca.empty()) parts.push_back(absl::StrCat("nccl.ib_hca=", n.ib_hca));
  if (n.ib_gid_index >= 0) parts.push_back(absl::StrCat("nccl.ib_gid_index=", n.ib_gid_index));
  if (!n.socket_ifname.empty()) {
    parts.push_back(absl::StrCat("nccl.socket_ifname=", n.socket_ifname));
  }
  if (!n.enable_ib) parts.push_back("nccl.ib_disable=1");
  for (const auto& [name, value] : n.extra_env) parts.push_back(absl::StrCat(name, "=", value));
  return absl::StrJoin(parts, " ");
}

}  // namespace

CommandRunner RegisterWorkerCommand(CLI::App& app) {
  struct Args {
    worker::rank::RankServerOptions options;
    int kv_bits = 16;
    int64_t collective_timeout_ms = 60'000, join_timeout_ms = 60'000;
    std::string coordinator;
    bool reconnect = false;
    int64_t connect_timeout_ms = 60'000;
    uint32_t protocol_version = worker::rank::kRankProtocolVersion;
    int64_t kv_pages_for_testing = 0;
    int metrics_port = 0;
    std::string metrics_host = "127.0.0.1";
    worker::comm::LocalCommDefaults local_comm;
    bool nccl_ib_disable = false;
    std::vector<std::string> nccl_env;
    SpillFlags spill;
    std::string capacities;
    PrecisionFlags precision;
  };
  auto args = std::make_shared<Args>();
  worker::rank::RankServerOptions& o = args->options;
  app.add_option("--coordinator", args->coordinator,
                 "dial this coordinator (host:port of its rank endpoint)");
  // The coordinator channel's security (worker/rank/rank_client.h): TLS, a
  // client certificate (mutual TLS) and the shared rank token. The rank dials
  // out and never listens for steps.
  auto rank_channel = std::make_shared<worker::rank::RankClientOptions>();
  app.add_option("--tls-ca", rank_channel->tls_ca_file,
                 "coordinator mode: TLS; the PEM CA of the coordinator's rank certificate");
  app.add_option("--tls-cert", rank_channel->tls_cert_file,
                 "coordinator mode: this rank's PEM client certificate (mutual TLS)");
  app.add_option("--tls-key", rank_channel->tls_key_file, "coordinator mode: its PEM private key");
  app.add_option("--tls-server-name", rank_channel->tls_server_name,
                 "coordinator mode: the name the coordinator's certificate must carry "
                 "(default: the --coordinator host)");
  app.add_option("--rank-token-file", rank_channel->token_file,
                 "coordinator mode: send this file's token (`authorization: Bearer ...`)");
  app.add_flag("--reconnect", args->reconnect,
               "coordinator mode: register again when the group is torn down or the "
               "coordinator goes away");
  app.add_option("--connect-timeout-ms", args->connect_timeout_ms,
                 "coordinator mode: how long to wait for the coordinator, per attempt")
      ->capture_default_str();
  app.add_option("--protocol-version-for-testing", args->protocol_version)->group("");
  app.add_option("--kv-pages-for-testing", args->kv_pages_for_testing)->group("");
  app.add_option("--model", o.model_dir, "model directory (control-fd mode; informational "
                                         "with --coordinator)");
  app.add_option("--rank", o.rank, "this rank")->required();
  app.add_option("--world-size", o.world_size,
                 "ranks in the group (with --coordinator: optional, checked)");
  app.add_option("--ep", o.expert_parallel, "expert-parallel groups (0 = one per rank)");
  app.add_option("--capacities", args->capacities,
                 "control-fd mode: relative capacity per rank, e.g. 1,1,0.5 (the same on "
                 "every rank; with --coordinator: the coordinator config's `capacities`)");
  app.add_option("--comm", o.comm.backend, "collective backend: shm or ucx")->capture_default_str();
  app.add_option("--shm-name", o.comm.shm_name, "shm: the group's shared-memory segment");
  app.add_option("--bootstrap", o.comm.bootstrap_address, "ucx: rank 0's host:port");
  app.add_option("--ucx-tls", args->local_comm.ucx_tls,
                 "ucx: transports, e.g. tcp (this box; the group's setting wins when given)");
  // NCCL network settings of this box (GPU ranks; docs/design/worker-comm.md).
  // NCCL takes them only from the environment: the nccl backend sets them
  // just before it initialises (NcclOptions), never from hidden env here.
  worker::comm::NcclOptions& nccl = args->local_comm.nccl;
  app.add_option("--nccl-net", nccl.net_name, "nccl: network (NCCL_NET), e.g. IB or Socket");
  app.add_option("--nccl-net-plugin", nccl.net_plugin,
                 "nccl: net plugin library suffix or path (NCCL_NET_PLUGIN)");
  app.add_option("--nccl-ib-hca", nccl.ib_hca, "nccl: HCAs and ports, e.g. mlx5_0:1 (NCCL_IB_HCA)");
  app.add_option("--nccl-ib-gid-index", nccl.ib_gid_index,
                 "nccl: RoCE GID index (NCCL_IB_GID_INDEX), 0..255")
      ->check(CLI::Range(0, 255));
  app.add_option("--nccl-socket-ifname", nccl.socket_ifname,
                 "nccl: interfaces for bootstrap and sockets (NCCL_SOCKET_IFNAME)");
  app.add_flag("--nccl-ib-disable", args->nccl_ib_disable,
               "nccl: never use InfiniBand/RoCE verbs (NCCL_IB_DISABLE=1)");
  app.add_option("--nccl-env", args->nccl_env,
                 "nccl: any other NCCL variable as NCCL_NAME=VALUE (repeatable)");
  app.add_option("--control-fd", o.control_fd, "the local driver's control socket");
  app.add_option("--threads", o.threads, "kernel threads")->capture_default_str();
  app.add_option("--kv-bits", args->kv_bits, "KV cache: 32, 16, 8 or 4")->capture_default_str();
  app.add_option("--kv-pages", o.kv.num_pages, "KV cache pages")->capture_default_str();
  app.add_option("--kv-page-size", o.kv.page_size_tokens, "positions per page")
      ->capture_default_str();
  app.add_flag("--kv-assigned", o.kv.caller_assigns_pages,
               "control-fd mode: the driver assigns every KV page (a coordinator's block "
               "tables); the rank never allocates one itself");
  app.add_option("--kv-disk-path", o.kv_disk_path,
                 "control-fd mode: the prefix cache's disk tier file ({rank} = the rank)");
  app.add_option("--kv-disk-blocks", o.kv_disk_slots,
                 "control-fd mode: KV blocks the disk tier holds (0 = none)")
      ->capture_default_str();
  app.add_option("--collective-timeout-ms", args->collective_timeout_ms)->capture_default_str();
  app.add_option("--join-timeout-ms", args->join_timeout_ms)->capture_default_str();
  app.add_option("--metrics-port", args->metrics_port,
                 "serve this rank's Prometheus /metrics on this port (0 = off)")
      ->capture_default_str();
  app.add_option("--metrics-host", args->metrics_host, "address of the /metrics endpoint")
      ->capture_default_str();
  // Row tables on this box's disk; with --coordinator they win over the
  // group's Setup.spill (cache dir and memory budget are this box's).
  AddSpillFlags(app, &args->spill);
  // EXL3 linear arithmetic; with --coordinator a given flag wins over Setup's.
  AddPrecisionFlags(app, &args->precision);
  return [args, rank_channel, &app]() -> absl::Status {
    // Box-local collective settings: every communicator of this process
    // fills what the group's settings leave unset from them.
    if (args->nccl_ib_disable) args->local_comm.nccl.enable_ib = false;
    EXL3_RETURN_IF_ERROR(ParseLocalCommFlags(args->nccl_env, &args->local_comm));
    worker::comm::SetLocalCommDefaults(args->local_comm);
    if (const std::string described = DescribeLocalComm(args->local_comm); !described.empty()) {
      EXL3_LOG(kInfo) << "rank " << args->options.rank << ": local comm settings " << described;
    }
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
      if (!args->capacities.empty()) {
        return absl::InvalidArgumentError(
            "--capacities is for --control-fd mode; with --coordinator the coordinator's "
            "config (`capacities`) sets them for the whole group");
      }
      worker::rank::RankClientOptions client;
      client.coordinator_address = args->coordinator;
      client.rank = args->options.rank;
      client.world_size = app.count("--world-size") > 0 ? args->options.world_size : 0;
      client.model_dir = args->options.model_dir;
      client.threads = args->options.threads;
      client.reconnect = args->reconnect;
      client.connect_timeout = absl::Milliseconds(args->connect_timeout_ms);
      client.protocol_version = args->protocol_version;
      client.kv_num_pages_for_testing = args->kv_pages_for_testing;
      client.observer = metrics.get();
      client.tls_ca_file = rank_channel->tls_ca_file;
      client.tls_cert_file = rank_channel->tls_cert_file;
      client.tls_key_file = rank_channel->tls_key_file;
      client.tls_server_name = rank_channel->tls_server_name;
      client.token_file = rank_channel->token_file;
      if (args->spill.any()) client.spill = args->spill.Policy();
      client.prefill_precision = args->precision.PrefillIfGiven();
      client.decode_precision = args->precision.DecodeIfGiven();
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
    options.spill = args->spill.Policy();
    options.prefill_precision = args->precision.Prefill();
    options.decode_precision = args->precision.Decode();
    EXL3_ASSIGN_OR_RETURN(options.capacities,
                          ParseCapacitiesFlag(args->capacities, options.world_size));
    return worker::rank::RunRankServer(options);
  };
}

}  // namespace exl3serve::cli
