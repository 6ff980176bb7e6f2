// cli/coordinator_config.h — the coordinator's part of the cluster YAML
// (`exl3serve coordinator --config FILE`, `exl3serve launch`): the rank
// group, the engine over it and the public APIs. The keys, their defaults and
// meaning are listed in cli/coordinator_command.cc; every key is optional
// except model_dir and world_size, and an unknown key is an error naming it.
//
// Errors: InvalidArgument naming the key (`engine.max_queue must be >= 1`),
// the file (unreadable, not YAML, over a limit of cli/cluster_keys.h).
// Reading is pure: no file named inside the config is opened here.
#ifndef EXL3SERVE_CLI_COORDINATOR_CONFIG_H_
#define EXL3SERVE_CLI_COORDINATOR_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "cli/http_flags.h"
#include "coordinator/grpc_server.h"
#include "coordinator/local_engine.h"
#include "coordinator/rank_group.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {

// What the config file sets: the rank group, the engine and the public API.
struct CoordinatorConfig {
  coordinator::RankGroupOptions group;
  coordinator::EngineOptions engine;
  coordinator::GrpcServerOptions server;
  HttpFlags http;  // port -1: off
  int64_t shutdown_grace_ms = 5000;
};

// `root`: a document of LoadClusterYaml / ParseClusterYaml (cli/cluster_keys.h).
absl::StatusOr<CoordinatorConfig> ReadCoordinatorConfig(const YAML::Node& root);

// LoadClusterYaml(file), then ReadCoordinatorConfig.
absl::StatusOr<CoordinatorConfig> LoadCoordinatorConfig(const std::string& file);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_COORDINATOR_CONFIG_H_
