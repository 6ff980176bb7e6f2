// libFuzzer target: a cluster YAML through the readers of `coordinator
// --config` and `launch` (cli/cluster_keys.h ParseClusterYaml,
// cli/coordinator_config.h ReadCoordinatorConfig, cli/launch_plan.h
// ReadLaunchPlan). Contract: no crash, uncaught exception, UB or runaway
// time/memory (the limits kMaxClusterYaml*, kMaxWorldSize); every refusal is
// InvalidArgument with a message; an accepted config is one the coordinator
// can start from (world size in range, capacities per rank, ports valid,
// engine minimums); an accepted launch plan places every rank on exactly one
// box and has exactly one coordinator box.
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "cli/cluster_keys.h"
#include "cli/coordinator_config.h"
#include "cli/launch_plan.h"

namespace cli = exl3serve::cli;

namespace {

void CheckRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument || status.message().empty()) std::abort();
  // The readers' safety net for a yaml-cpp exception no check foresaw: each
  // such input is a missing check (it used to be an uncaught exception).
  if (status.message().rfind("malformed config: ", 0) == 0) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<YAML::Node> root = cli::ParseClusterYaml(text, "fuzz.yaml");
  if (!root.ok()) {
    CheckRefusal(root.status());
    return 0;
  }
  absl::StatusOr<cli::CoordinatorConfig> config = cli::ReadCoordinatorConfig(*root);
  if (!config.ok()) {
    CheckRefusal(config.status());
  } else {
    const auto& g = config->group;
    if (g.world_size < 1 || g.world_size > cli::kMaxWorldSize || g.model_dir.empty()) std::abort();
    if (!g.capacities.empty() && static_cast<int>(g.capacities.size()) != g.world_size) std::abort();
    for (double c : g.capacities) {
      if (!(c > 0.0) || c == 1.0 / 0.0) std::abort();
    }
    const auto& e = config->engine;
    if (e.max_running < 1 || e.max_queue < 1 || e.step_token_budget < 1 ||
        e.default_max_tokens < 1 || e.max_context < 0) {
      std::abort();
    }
    if (config->server.port < 0 || config->server.port > 65535) std::abort();
    if (config->http.enabled() && config->http.port > 65535) std::abort();
    if (config->shutdown_grace_ms < 0) std::abort();
  }
  absl::StatusOr<cli::LaunchPlan> plan = cli::ReadLaunchPlan(*root);
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return 0;
  }
  if (!config.ok()) std::abort();  // launch checks every coordinator key first
  std::set<int> placed;
  int coordinators = 0;
  for (const cli::Box& box : plan->boxes) {
    coordinators += box.coordinator ? 1 : 0;
    if (box.name.empty() || box.address.empty()) std::abort();
    if (!box.rank_devices.empty() && box.rank_devices.size() != box.ranks.size()) std::abort();
    for (int r : box.ranks) {
      if (r < 0 || r >= plan->world_size || !placed.insert(r).second) std::abort();
    }
  }
  if (coordinators != 1 || static_cast<int>(placed.size()) != plan->world_size) std::abort();
  if (plan->coordinator_address.empty()) std::abort();
  return 0;
}
