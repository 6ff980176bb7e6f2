// The body of `exl3serve coordinator --config FILE` as a function, so that
// `exl3serve launch` (cli/launch_command.cc) runs the coordinator in-process.
#ifndef EXL3SERVE_CLI_COORDINATOR_RUN_H_
#define EXL3SERVE_CLI_COORDINATOR_RUN_H_

#include <string>

#include "absl/status/status.h"

namespace exl3serve::cli {

struct CoordinatorRunOptions {
  std::string config;     // the cluster YAML (keys: cli/coordinator_command.cc)
  std::string port_file;  // "" = none; else the bound rank port is written here
  int metrics_port = 0;   // coordinator /metrics (0 = off)
  std::string metrics_host = "127.0.0.1";
  int http_port = -1;     // >= 0: the HTTP API on this port (0 = any), over the config's
  bool no_prefix_cache = false;  // over the config's engine.prefix_cache
};

// Runs until SIGINT/SIGTERM (blocks both in the calling thread; threads the
// caller starts afterwards inherit the mask), then stops cleanly.
absl::Status RunCoordinator(const CoordinatorRunOptions& options);

// Parses and validates the config as the coordinator would (no I/O past the file).
absl::Status CheckCoordinatorConfig(const std::string& file);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_COORDINATOR_RUN_H_
