// cli/launch_plan.h — the `boxes` part of the cluster YAML that `exl3serve
// launch --config FILE --box NAME` reads (keys in cli/launch_command.cc):
// which box runs the coordinator, which ranks each box starts and with what
// devices, NICs, NCCL settings and metrics ports. Reading checks every
// coordinator key the coordinator's way first (cli/coordinator_config.h).
// Errors: InvalidArgument naming the key (`boxes[1].ranks[0]`) or the limit
// (cli/cluster_keys.h). Pure: nothing is started or opened but the file.
#ifndef EXL3SERVE_CLI_LAUNCH_PLAN_H_
#define EXL3SERVE_CLI_LAUNCH_PLAN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/cluster_keys.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {

struct Box {
  std::string name;
  std::string address;
  bool coordinator = false;
  int metrics_port = 0;
  std::vector<int> devices;
  std::vector<std::string> nics;
  NcclKeys nccl;  // comm.nccl with this box's overrides
  std::vector<int> ranks;
  std::vector<int> rank_devices;
  std::vector<int> rank_metrics_ports;
};

struct LaunchPlan {
  int world_size = 0;
  std::string coordinator_address;  // HOST:PORT of the rank endpoint
  std::string coordinator_host;     // the coordinator box's address
  std::vector<Box> boxes;
  RankTlsPaths rank_tls;
  std::string rank_token_file;
};

// `root`: a document of LoadClusterYaml / ParseClusterYaml. Every rank in
// [0, world_size) is on exactly one box, exactly one box is the coordinator.
absl::StatusOr<LaunchPlan> ReadLaunchPlan(const YAML::Node& root);
absl::StatusOr<LaunchPlan> LoadLaunchPlan(const std::string& file);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_LAUNCH_PLAN_H_
