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
//   kv: {bits: 16, num_pages: 256, page_size_tokens: 16}
//   precision: {prefill: fp32, decode: int8}   # EXL3 linears on every rank: prefill
//                                      # fp32|bf16, decode fp32|int8 (int8: mul1 linears;
//                                      # a rank's own worker --*-precision flag wins)
//   engine: {max_running: 64, max_queue: 256, step_token_budget: 512,
//            default_max_tokens: 256, max_context: 0}
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

// Rejects keys of `node` outside `known`, naming the path.
absl::Status CheckKeys(const YAML::Node& node, const std::string& path,
                       const std::set<std::string>& known) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.empty() ? "the config" : path, " must be a mapping"));
  }
  for (const auto& entry : node) {
    const std::string key = entry.first.as<std::string>();
    if (known.count(key) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown config key `", path.empty() ? "" : path + ".", key, "`"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Read(const YAML::Node& parent, const std::string& path, const std::string& key,
                  T* out) {
  const YAML::Node node = parent[key];
  if (!node.IsDefined() || node.IsNull()) return absl::OkStatus();
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return absl::InvalidArgumentError(absl::StrCat("config key `", path.empty() ? "" : path + ".",
                                                   key, "` has a value of the wrong type: ",
                                                   YAML::Dump(node)));
  }
  return absl::OkStatus();
}

absl::Status ReadMs(const YAML::Node& parent, const std::string& key, absl::Duration* out) {
  int64_t ms = absl::ToInt64Milliseconds(*out);
  EXL3_RETURN_IF_ERROR(Read(parent, "timeouts", key, &ms));
  if (ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key `timeouts.", key, "` must be > 0, got ", ms));
  }
  *out = absl::Milliseconds(ms);
  return absl::OkStatus();
}

// What the config file sets: the rank group, the engine and the public API.
struct CoordinatorConfig {
  coordinator::RankGroupOptions group;
  coordinator::EngineOptions engine;
  coordinator::GrpcServerOptions server;
  HttpFlags http;  // port -1: off
  int64_t shutdown_grace_ms = 5000;
};

// "host:port", "[v6]:port" -> host, port (0..65535); errors name `key`.
absl::Status ParseAddress(const std::string& key, const std::string& address, std::string* host,
                          int* port) {
  const size_t colon = address.rfind(':');
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat("config key `", key,
                                                   "` must be HOST:PORT, got \"", address, "\""));
  };
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) return bad();
  std::string h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int p = 0;
  for (char c : address.substr(colon + 1)) {
    if (c < '0' || c > '9' || p > 65535) return bad();
    p = p * 10 + (c - '0');
  }
  if (p > 65535 || h.empty()) return bad();
  *host = h;
  *port = p;
  return absl::OkStatus();
}

absl::StatusOr<CoordinatorConfig> LoadConfig(const std::string& file) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(file);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", e.what()));
  }
  CoordinatorConfig config;
  coordinator::RankGroupOptions& o = config.group;
  EXL3_RETURN_IF_ERROR(CheckKeys(root, "",
                                 {"model_dir", "local_model_dir", "world_size", "expert_parallel",
                                  "listen_address", "api_address", "shutdown_grace_ms",
                                  "threads_per_rank", "comm", "kv", "engine", "timeouts", "tls",
                                  "auth_token_file", "insecure_listen_any", "rank_token_file",
                                  "insecure_rank_listen_any", "capacities", "precision",
                                  "http_address", "http",
                                  "boxes"}));  // boxes: `exl3serve launch` (cli/launch_command.cc)
  EXL3_RETURN_IF_ERROR(Read(root, "", "model_dir", &o.model_dir));
  EXL3_RETURN_IF_ERROR(Read(root, "", "world_size", &o.world_size));
  EXL3_RETURN_IF_ERROR(Read(root, "", "expert_parallel", &o.expert_parallel));
  EXL3_RETURN_IF_ERROR(Read(root, "", "capacities", &o.capacities));
  EXL3_RETURN_IF_ERROR(Read(root, "", "listen_address", &o.listen_address));
  EXL3_RETURN_IF_ERROR(Read(root, "", "threads_per_rank", &o.threads_per_rank));
  if (o.model_dir.empty()) return absl::InvalidArgumentError("config key `model_dir` is required");
  if (!root["world_size"].IsDefined() || o.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key `world_size` must be >= 1, got ", o.world_size));
  }
  if (absl::Status s = worker::rank::CheckCapacities(o.capacities, o.world_size); !s.ok()) {
    // s: "capacities: ..."; name the key as the other config errors do.
    return absl::InvalidArgumentError(absl::StrCat("config key `capacities`",
                                                   std::string(s.message()).substr(10)));
  }
  if (const YAML::Node comm = root["comm"]; comm.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(
        comm, "comm", {"backend", "shm_name", "bootstrap_address", "ucx_tls", "ucx", "nccl"}));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "backend", &o.comm.backend));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "shm_name", &o.comm.shm_name));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "bootstrap_address", &o.comm.bootstrap_address));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "ucx_tls", &o.comm.ucx_tls));
    if (const YAML::Node ucx = comm["ucx"]; ucx.IsDefined()) {
      EXL3_RETURN_IF_ERROR(CheckKeys(ucx, "comm.ucx", {"tls"}));
      std::string tls;
      EXL3_RETURN_IF_ERROR(Read(ucx, "comm.ucx", "tls", &tls));
      if (!tls.empty() && !o.comm.ucx_tls.empty() && tls != o.comm.ucx_tls) {
        return absl::InvalidArgumentError(absl::StrCat(
            "config keys `comm.ucx.tls` (\"", tls, "\") and `comm.ucx_tls` (\"", o.comm.ucx_tls,
            "\") disagree; give one"));
      }
      if (!tls.empty()) o.comm.ucx_tls = tls;
    }
    // comm.nccl is for `launch` (worker flags); checked here so that every
    // reader of the file rejects the same mistakes.
    if (const YAML::Node nccl = comm["nccl"]; nccl.IsDefined()) {
      NcclKeys keys;
      EXL3_RETURN_IF_ERROR(ReadNcclKeys(nccl, "comm.nccl", &keys));
    }
    if (o.comm.backend != "shm" && o.comm.backend != "ucx") {
      return absl::InvalidArgumentError(
          absl::StrCat("config key `comm.backend` must be shm or ucx, got \"", o.comm.backend,
                       "\""));
    }
  }
  if (const YAML::Node kv = root["kv"]; kv.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(kv, "kv", {"bits", "num_pages", "page_size_tokens"}));
    int bits = 16;
    EXL3_RETURN_IF_ERROR(Read(kv, "kv", "bits", &bits));
    absl::StatusOr<worker::KvCacheDtype> dtype = worker::KvCacheDtypeFromBits(bits);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config key `kv.bits` must be 32, 16, 8 or 4, got ", bits));
    }
    o.kv.dtype = *dtype;
    EXL3_RETURN_IF_ERROR(Read(kv, "kv", "num_pages", &o.kv.num_pages));
    EXL3_RETURN_IF_ERROR(Read(kv, "kv", "page_size_tokens", &o.kv.page_size_tokens));
  }
  // The CLI's defaults (cli/precision_flags.h): fp32 prefill, int8 decode.
  o.decode_precision = kernels::TrellisGemmPrecision::kInt8;
  if (const YAML::Node p = root["precision"]; p.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(p, "precision", {"prefill", "decode"}));
    struct Field {
      const char* key;
      kernels::TrellisGemmPrecision* value;
      const char* allowed;
    };
    for (const Field& f : {Field{"prefill", &o.prefill_precision, "fp32 or bf16"},
                           Field{"decode", &o.decode_precision, "fp32 or int8"}}) {
      std::string name = *f.value == kernels::TrellisGemmPrecision::kInt8   ? "int8"
                         : *f.value == kernels::TrellisGemmPrecision::kBf16 ? "bf16"
                                                                            : "fp32";
      EXL3_RETURN_IF_ERROR(Read(p, "precision", f.key, &name));
      if (name == "fp32") {
        *f.value = kernels::TrellisGemmPrecision::kFloat;
      } else if (name == "bf16" && std::string(f.key) == "prefill") {
        *f.value = kernels::TrellisGemmPrecision::kBf16;
      } else if (name == "int8" && std::string(f.key) == "decode") {
        *f.value = kernels::TrellisGemmPrecision::kInt8;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("config key `precision.", f.key,
                                                       "` must be ", f.allowed, ", got \"",
                                                       name, "\""));
      }
    }
  }
  if (const YAML::Node t = root["timeouts"]; t.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(t, "timeouts",
                                   {"join_ms", "collective_ms", "load_ms", "step_ms",
                                    "heartbeat_interval_ms", "heartbeat_ms", "reform_ms"}));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "join_ms", &o.join_timeout));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "collective_ms", &o.collective_timeout));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "load_ms", &o.load_timeout));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "step_ms", &o.step_timeout));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "heartbeat_interval_ms", &o.heartbeat_interval));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "heartbeat_ms", &o.heartbeat_timeout));
    EXL3_RETURN_IF_ERROR(ReadMs(t, "reform_ms", &o.reform_timeout));
  }

  // The engine over the group, and the public API.
  coordinator::EngineOptions& e = config.engine;
  e.model_dir = o.model_dir;
  EXL3_RETURN_IF_ERROR(Read(root, "", "local_model_dir", &e.model_dir));
  if (e.model_dir.empty()) e.model_dir = o.model_dir;
  e.tensor_parallel = o.world_size;
  e.expert_parallel = o.expert_parallel;
  e.threads_per_rank = o.threads_per_rank;
  e.kv = o.kv;
  e.rank_step_timeout = o.step_timeout;
  e.reform_timeout = o.reform_timeout;
  if (const YAML::Node en = root["engine"]; en.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(en, "engine",
                                   {"max_running", "max_queue", "step_token_budget",
                                    "default_max_tokens", "max_context"}));
    struct Field {
      const char* key;
      int64_t* value;
      int64_t min;
    };
    for (const Field& f : {Field{"max_running", &e.max_running, 1},
                           Field{"max_queue", &e.max_queue, 1},
                           Field{"step_token_budget", &e.step_token_budget, 1},
                           Field{"default_max_tokens", &e.default_max_tokens, 1},
                           Field{"max_context", &e.max_context, 0}}) {
      EXL3_RETURN_IF_ERROR(Read(en, "engine", f.key, f.value));
      if (*f.value < f.min) {
        return absl::InvalidArgumentError(absl::StrCat("config key `engine.", f.key,
                                                       "` must be >= ", f.min, ", got ", *f.value));
      }
    }
  }
  std::string api_address = "127.0.0.1:50051";
  EXL3_RETURN_IF_ERROR(Read(root, "", "api_address", &api_address));
  EXL3_RETURN_IF_ERROR(
      ParseAddress("api_address", api_address, &config.server.host, &config.server.port));
  std::string http_address;
  EXL3_RETURN_IF_ERROR(Read(root, "", "http_address", &http_address));
  if (!http_address.empty()) {
    EXL3_RETURN_IF_ERROR(
        ParseAddress("http_address", http_address, &config.http.host, &config.http.port));
  }
  if (const YAML::Node http = root["http"]; http.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(http, "http", {"served_model_names", "tool_call_parser",
                                                  "reasoning_parser", "threads"}));
    EXL3_RETURN_IF_ERROR(Read(http, "http", "served_model_names", &config.http.served_model_names));
    EXL3_RETURN_IF_ERROR(Read(http, "http", "tool_call_parser", &config.http.tool_call_parser));
    EXL3_RETURN_IF_ERROR(Read(http, "http", "reasoning_parser", &config.http.reasoning_parser));
    EXL3_RETURN_IF_ERROR(Read(http, "http", "threads", &config.http.threads));
  }
  coordinator::RankEndpointSecurity& rank_security = o.security;
  if (const YAML::Node tls = root["tls"]; tls.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(tls, "tls",
                                   {"cert", "key", "client_ca", "rank_cert", "rank_key", "rank_ca",
                                    "rank_client_cert", "rank_client_key", "rank_server_name"}));
    EXL3_RETURN_IF_ERROR(Read(tls, "tls", "cert", &config.server.tls.cert_file));
    EXL3_RETURN_IF_ERROR(Read(tls, "tls", "key", &config.server.tls.key_file));
    EXL3_RETURN_IF_ERROR(Read(tls, "tls", "client_ca", &config.server.tls.client_ca_file));
    if (config.server.tls.cert_file.empty() != config.server.tls.key_file.empty()) {
      return absl::InvalidArgumentError("config keys `tls.cert` and `tls.key` go together");
    }
    // The rank endpoint: the coordinator uses rank_cert/rank_key/rank_ca;
    // the rank_client_* paths and rank_server_name are for the ranks (launch).
    RankTlsPaths rank;
    EXL3_RETURN_IF_ERROR(ReadRankTls(tls, &rank));
    rank_security.cert_file = rank.cert;
    rank_security.key_file = rank.key;
    if (!rank.client_cert.empty()) rank_security.client_ca_file = rank.ca;
  }
  EXL3_RETURN_IF_ERROR(Read(root, "", "rank_token_file", &rank_security.token_file));
  EXL3_RETURN_IF_ERROR(
      Read(root, "", "insecure_rank_listen_any", &rank_security.insecure_listen_any));
  if (absl::Status policy = coordinator::CheckRankListenPolicy(
          o.listen_address, rank_security,
          "config keys tls.rank_cert, tls.rank_key and tls.rank_ca, with rank_token_file and/or "
          "tls.rank_client_cert");
      !policy.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key `listen_address`: ", policy.message()));
  }
  EXL3_RETURN_IF_ERROR(Read(root, "", "auth_token_file", &config.server.auth_token_file));
  EXL3_RETURN_IF_ERROR(Read(root, "", "insecure_listen_any", &config.server.insecure_listen_any));
  config.server.credentials_hint =
      "config keys tls.cert and tls.key, with auth_token_file and/or tls.client_ca";
  if (absl::Status policy = coordinator::CheckListenPolicy(config.server); !policy.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("config key `api_address`: ", policy.message(),
                                                   " (config key insecure_listen_any)"));
  }
  EXL3_RETURN_IF_ERROR(Read(root, "", "shutdown_grace_ms", &config.shutdown_grace_ms));
  if (config.shutdown_grace_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config key `shutdown_grace_ms` must be >= 0, got ", config.shutdown_grace_ms));
  }
  return config;
}

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
  auto http_port = std::make_shared<int>(-1);
  app.add_option("--http-port", *http_port,
                 "the OpenAI HTTP API on http_address's host at this port (overrides the config's "
                 "port; 0 = any free port; -1 = as the config says)");
  app.footer(
      "Serves exl3serve.v1.Generation + grpc.health.v1 on api_address (SERVING while every rank\n"
      "is loaded); ranks join with `exl3serve worker --coordinator HOST:PORT --rank R --reconnect`.\n"
      "Example config: deploy/cluster/local-2-ranks.yaml");
  return [config, port_file, metrics_port, metrics_host, http_port]() -> absl::Status {
    return RunCoordinator(CoordinatorRunOptions{.config = *config,
                                                .port_file = *port_file,
                                                .metrics_port = *metrics_port,
                                                .metrics_host = *metrics_host,
                                                .http_port = *http_port});
  };
}

absl::Status CheckCoordinatorConfig(const std::string& file) {
  return LoadConfig(file).status();
}

absl::Status RunCoordinator(const CoordinatorRunOptions& options) {
  const std::string* config = &options.config;
  const std::string* port_file = &options.port_file;
  const int* metrics_port = &options.metrics_port;
  const std::string* metrics_host = &options.metrics_host;
  {
    EXL3_ASSIGN_OR_RETURN(CoordinatorConfig cfg, LoadConfig(*config));
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
    auto engine = std::make_unique<coordinator::LocalEngine>(cfg.engine, std::move(model),
                                                             std::move(owned_group));
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
