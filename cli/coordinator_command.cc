// `exl3serve coordinator --config FILE`: the cluster's coordinator. Runs the
// rank endpoint (coordinator/rank_group.h) where `exl3serve worker
// --coordinator HOST:PORT --rank R` processes on any box register, and
// reports the group's readiness and every re-formation.
//
// The config (YAML; every key optional except model_dir and world_size; an
// unknown key is an error naming it):
//   model_dir: /models/llama-exl3      # as the ranks see it
//   world_size: 2
//   expert_parallel: 0
//   listen_address: 0.0.0.0:50061      # for ranks
//   threads_per_rank: 0                # 0 = each rank's --threads
//   comm: {backend: shm|ucx, shm_name: "", bootstrap_address: "host:port", ucx_tls: tcp}
//   kv: {bits: 16, num_pages: 256, page_size_tokens: 16}
//   timeouts: {join_ms: 60000, collective_ms: 60000, load_ms: 300000, step_ms: 60000,
//              heartbeat_interval_ms: 1000, heartbeat_ms: 5000, reform_ms: 60000}
//
// TODO(issue 6): once coordinator/local_engine.h offers an engine constructor
// that takes an injected worker::StepExecutor, plug the RemoteRankGroup into
// it and serve exl3serve.v1.Generation (coordinator/generation_service.h) on
// a public `api_address`; until then this command runs the rank group only.
#include <signal.h>

#include <cstdio>
#include <memory>
#include <set>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "coordinator/rank_group.h"
#include "yaml-cpp/yaml.h"

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

absl::StatusOr<coordinator::RankGroupOptions> LoadConfig(const std::string& file) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(file);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", e.what()));
  }
  coordinator::RankGroupOptions o;
  EXL3_RETURN_IF_ERROR(CheckKeys(root, "",
                                 {"model_dir", "world_size", "expert_parallel", "listen_address",
                                  "threads_per_rank", "comm", "kv", "timeouts"}));
  EXL3_RETURN_IF_ERROR(Read(root, "", "model_dir", &o.model_dir));
  EXL3_RETURN_IF_ERROR(Read(root, "", "world_size", &o.world_size));
  EXL3_RETURN_IF_ERROR(Read(root, "", "expert_parallel", &o.expert_parallel));
  EXL3_RETURN_IF_ERROR(Read(root, "", "listen_address", &o.listen_address));
  EXL3_RETURN_IF_ERROR(Read(root, "", "threads_per_rank", &o.threads_per_rank));
  if (o.model_dir.empty()) return absl::InvalidArgumentError("config key `model_dir` is required");
  if (!root["world_size"].IsDefined() || o.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config key `world_size` must be >= 1, got ", o.world_size));
  }
  if (const YAML::Node comm = root["comm"]; comm.IsDefined()) {
    EXL3_RETURN_IF_ERROR(
        CheckKeys(comm, "comm", {"backend", "shm_name", "bootstrap_address", "ucx_tls"}));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "backend", &o.comm.backend));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "shm_name", &o.comm.shm_name));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "bootstrap_address", &o.comm.bootstrap_address));
    EXL3_RETURN_IF_ERROR(Read(comm, "comm", "ucx_tls", &o.comm.ucx_tls));
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
  return o;
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
  app.add_option("--config", *config, "cluster config (YAML)")->required();
  app.add_option("--port-file", *port_file,
                 "write the bound rank port here (for scripts using listen_address port 0)");
  return [config, port_file]() -> absl::Status {
    EXL3_ASSIGN_OR_RETURN(coordinator::RankGroupOptions options, LoadConfig(*config));
    StopSignal stop;  // before any thread starts, so they inherit the mask
    EXL3_ASSIGN_OR_RETURN(std::unique_ptr<coordinator::RemoteRankGroup> group,
                          coordinator::RemoteRankGroup::Start(options));
    std::printf("coordinator: waiting for %d ranks on port %d (model %s)\n", options.world_size,
                group->port(), options.model_dir.c_str());
    std::fflush(stdout);
    if (!port_file->empty()) {
      FILE* f = std::fopen(port_file->c_str(), "w");
      if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot write ", *port_file));
      std::fprintf(f, "%d\n", group->port());
      std::fclose(f);
    }
    // TODO(issue 6): hand `group` to the engine (see the file comment).
    bool was_ready = false;
    uint64_t generation = 0;
    while (!stop.Wait(absl::Milliseconds(250))) {
      const coordinator::RankGroupStatus status = group->status();
      const bool ready = status.state == coordinator::GroupState::kReady;
      if (ready != was_ready || (ready && status.generation != generation)) {
        if (ready) {
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
    group->Shutdown("the coordinator was stopped");
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
