// `exl3serve plan --model DIR --ranks N [--ep M] [--boxes a:2,b:2]
// [--capacity 1,1,0.5] [--replicate-head]`: prints which rank would hold which
// heads, channels, experts and vocab rows of a model (EXL3 or Hugging Face),
// and the bytes each would read (sharding/shard_plan.h).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "sharding/exl3_model.h"
#include "sharding/shard_plan.h"

namespace exl3serve::cli {
namespace {

// "a:2,b:2" -> boxes a and b, ranks 0-1 on a, 2-3 on b.
absl::Status ParseBoxes(const std::string& text, int ranks, sharding::WorldSpec& world) {
  std::vector<std::string> names;
  std::vector<int> counts;
  absl::flat_hash_set<std::string> seen;
  int total = 0;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const std::vector<std::string> fields = absl::StrSplit(part, ':');
    int count = 0;
    if (fields.size() != 2 || fields[0].empty() || !absl::SimpleAtoi(fields[1], &count) ||
        count <= 0 || count > ranks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--boxes: `", part, "` is not NAME:COUNT with COUNT in 1..", ranks,
          " (e.g. --boxes a:2,b:2)"));
    }
    if (!seen.insert(fields[0]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--boxes: box `", fields[0], "` is named twice"));
    }
    names.push_back(fields[0]);
    counts.push_back(count);
    total += count;
  }
  if (total != ranks) {
    return absl::InvalidArgumentError(absl::StrCat("--boxes: the rank counts sum to ", total,
                                                   ", but --ranks is ", ranks));
  }
  world.boxes = names;
  world.ranks.clear();
  for (size_t box = 0; box < counts.size(); ++box) {
    for (int i = 0; i < counts[box]; ++i) {
      world.ranks.push_back(sharding::WorldSpec::Rank{.box = static_cast<int>(box)});
    }
  }
  return absl::OkStatus();
}

absl::Status ParseCapacities(const std::string& text, sharding::WorldSpec& world) {
  std::vector<double> values;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    double value = 0.0;
    if (!absl::SimpleAtod(part, &value) || !(value > 0.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--capacity: `", part, "` is not a number > 0 (e.g. --capacity 1,1,0.5)"));
    }
    values.push_back(value);
  }
  if (static_cast<int>(values.size()) != world.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("--capacity: ", values.size(),
                                                   " values for ", world.world_size(),
                                                   " ranks (give one per rank)"));
  }
  for (size_t r = 0; r < values.size(); ++r) world.ranks[r].capacity = values[r];
  return absl::OkStatus();
}

}  // namespace

CommandRunner RegisterPlanCommand(CLI::App& app) {
  struct Args {
    std::string model, boxes, capacity;
    int ranks = 0;
    sharding::ShardOptions options;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "model directory (EXL3 or Hugging Face)")->required();
  app.add_option("--ranks", args->ranks, "number of ranks (world size), >= 1")->required();
  app.add_option("--ep", args->options.expert_parallel,
                 "MoE expert groups (must divide --ranks; 0 = one group per rank)")
      ->capture_default_str();
  app.add_option("--boxes", args->boxes,
                 "NAME:COUNT,... consecutive ranks per box (default: all on `local`)");
  app.add_option("--capacity", args->capacity,
                 "relative capacity per rank, comma-separated (default: all 1)");
  app.add_flag("--replicate-head", args->options.replicate_head,
               "hold the whole output head on every rank instead of splitting the vocab");
  return [args]() -> absl::Status {
    if (args->ranks < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ranks must be >= 1, got ", args->ranks));
    }
    sharding::WorldSpec world = sharding::WorldSpec::Uniform(args->ranks);
    if (!args->boxes.empty()) EXL3_RETURN_IF_ERROR(ParseBoxes(args->boxes, args->ranks, world));
    if (!args->capacity.empty()) EXL3_RETURN_IF_ERROR(ParseCapacities(args->capacity, world));
    EXL3_ASSIGN_OR_RETURN(auto model, sharding::Exl3Model::Open(args->model));
    if (!model->arch()) {
      return absl::UnimplementedError(absl::StrCat(
          args->model, "/config.json: the planner needs a supported architecture "
                       "(see `exl3serve inspect`)"));
    }
    EXL3_ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                          sharding::PlanShards(*model->arch(), world, args->options, model.get()));
    std::printf("model: %s\n", args->model.c_str());
    std::fputs(plan.Describe().c_str(), stdout);
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
