#include "cli/coordinator_config.h"

#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/cluster_keys.h"
#include "common/status_macros.h"
#include "worker/rank/capacities.h"

namespace exl3serve::cli {
namespace {

// Rejects keys of `node` outside `known`, naming the path.
absl::Status CheckKeys(const YAML::Node& node, const std::string& path,
                       const std::set<std::string>& known) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.empty() ? "the config" : path, " must be a mapping"));
  }
  for (const auto& entry : node) {
    if (!entry.first.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path.empty() ? "the config" : path, " has a key that is not a string: ",
          DumpForError(entry.first)));
    }
    const std::string key = entry.first.Scalar();
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
                                                   DumpForError(node)));
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

absl::StatusOr<CoordinatorConfig> ReadCoordinatorConfigOrThrow(const YAML::Node& root) {
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
  if (!root["world_size"].IsDefined() || o.world_size < 1 || o.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("config key `world_size` must be 1..",
                                                   kMaxWorldSize, " (kMaxWorldSize), got ",
                                                   o.world_size));
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
    EXL3_RETURN_IF_ERROR(
        CheckKeys(kv, "kv", {"bits", "num_pages", "page_size_tokens", "disk"}));
    if (const YAML::Node disk = kv["disk"]; disk.IsDefined()) {
      EXL3_RETURN_IF_ERROR(CheckKeys(disk, "kv.disk", {"path", "blocks"}));
      EXL3_RETURN_IF_ERROR(Read(disk, "kv.disk", "path", &o.kv_disk_path));
      EXL3_RETURN_IF_ERROR(Read(disk, "kv.disk", "blocks", &o.kv_disk_slots));
      if (o.kv_disk_slots < 0 || (o.kv_disk_slots > 0 && o.kv_disk_path.empty())) {
        return absl::InvalidArgumentError(
            "config key `kv.disk` needs `path` and `blocks` >= 0 (0 = no disk tier)");
      }
    }
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
  e.kv_disk_path = o.kv_disk_path;
  e.kv_disk_blocks = o.kv_disk_slots;
  e.rank_step_timeout = o.step_timeout;
  e.reform_timeout = o.reform_timeout;
  if (const YAML::Node en = root["engine"]; en.IsDefined()) {
    EXL3_RETURN_IF_ERROR(CheckKeys(en, "engine",
                                   {"max_running", "max_queue", "step_token_budget",
                                    "default_max_tokens", "max_context", "prefix_cache",
                                    "speculative", "draft_tokens", "draft_token_budget",
                                    "draft_model"}));
    EXL3_RETURN_IF_ERROR(Read(en, "engine", "draft_model", &e.draft_model_dir));
    EXL3_RETURN_IF_ERROR(Read(en, "engine", "prefix_cache", &e.enable_prefix_caching));
    std::string speculative = coordinator::SpeculativeMethodName(e.speculative);
    EXL3_RETURN_IF_ERROR(Read(en, "engine", "speculative", &speculative));
    absl::StatusOr<coordinator::SpeculativeMethod> method =
        coordinator::ParseSpeculativeMethod(speculative);
    if (!method.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config key `engine.speculative`: ", method.status().message()));
    }
    e.speculative = *method;
    int64_t draft_tokens = e.draft_tokens;
    EXL3_RETURN_IF_ERROR(Read(en, "engine", "draft_tokens", &draft_tokens));
    if (draft_tokens < 1 || draft_tokens > coordinator::kMaxDraftTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("config key `engine.draft_tokens` must be in [1, ",
                       coordinator::kMaxDraftTokens, "], got ", draft_tokens));
    }
    e.draft_tokens = static_cast<int>(draft_tokens);
    struct Field {
      const char* key;
      int64_t* value;
      int64_t min;
    };
    for (const Field& f : {Field{"max_running", &e.max_running, 1},
                           Field{"max_queue", &e.max_queue, 1},
                           Field{"step_token_budget", &e.step_token_budget, 1},
                           Field{"draft_token_budget", &e.draft_token_budget, 1},
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

}  // namespace

absl::StatusOr<CoordinatorConfig> ReadCoordinatorConfig(const YAML::Node& root) {
  // yaml-cpp throws on misuse the checks above do not foresee (a scalar
  // indexed as a map, say): such a document is an error, never a crash.
  try {
    return ReadCoordinatorConfigOrThrow(root);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("malformed config: ", e.what()));
  }
}

absl::StatusOr<CoordinatorConfig> LoadCoordinatorConfig(const std::string& file) {
  EXL3_ASSIGN_OR_RETURN(YAML::Node root, LoadClusterYaml(file));
  return ReadCoordinatorConfig(root);
}

}  // namespace exl3serve::cli
