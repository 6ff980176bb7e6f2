// `exl3serve plan --model DIR --ranks N [--ep M] [--boxes a:2,b:2 | a,a,b]
// [--capacities 1,1,0.5] [--replicate-head] [--bits B [--head-bits H]]`:
// prints which rank would hold which heads, channels, experts and vocab rows
// of a model (EXL3 or Hugging Face), and the bytes each would read
// (sharding/shard_plan.h). A directory with a config.json and no
// *.safetensors (a published model's config alone) is planned from the
// config: bytes at fp16, or with --bits as `convert --bits B` would store
// them; --bits also plans a directory with weights from its config alone.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/capacity_flags.h"
#include "cli/commands.h"
#include "cli/spill_flags.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "sharding/model_arch.h"
#include "sharding/safetensors_json.h"
#include "sharding/shard_plan.h"

namespace exl3serve::cli {
namespace {

// "a:2,b:2" -> boxes a and b, ranks 0-1 on a, 2-3 on b. Or one name per
// rank: "a,a,b" -> ranks 0-1 on a, 2 on b (boxes in order of appearance).
absl::Status ParseBoxes(const std::string& text, int ranks, sharding::WorldSpec& world) {
  std::vector<std::string> names;
  std::vector<int> counts;
  absl::flat_hash_set<std::string> seen;
  int total = 0;
  if (text.find(':') == std::string::npos) {
    const std::vector<std::string> per_rank = absl::StrSplit(text, ',', absl::SkipWhitespace());
    if (static_cast<int>(per_rank.size()) != ranks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--boxes: `", text, "` is not NAME:COUNT,... nor one box name per rank (",
          per_rank.size(), " names for ", ranks, " ranks; e.g. --boxes a:2,b:1 or a,a,b)"));
    }
    world.boxes.clear();
    world.ranks.clear();
    for (const std::string& name : per_rank) {
      auto it = std::find(world.boxes.begin(), world.boxes.end(), name);
      if (it == world.boxes.end()) it = world.boxes.insert(world.boxes.end(), name);
      world.ranks.push_back(
          sharding::WorldSpec::Rank{.box = static_cast<int>(it - world.boxes.begin())});
    }
    return absl::OkStatus();
  }
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

// True when `dir` holds no *.safetensors file (a config.json alone).
bool HasNoWeights(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") return false;
  }
  return !ec;  // unreadable: let Exl3Model::Open report it
}

}  // namespace

CommandRunner RegisterPlanCommand(CLI::App& app) {
  struct Args {
    std::string model, boxes, capacity;
    int ranks = 0;
    sharding::ShardOptions options;
    SpillFlags spill;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--model", args->model, "model directory (EXL3 or Hugging Face)")->required();
  app.add_option("--ranks", args->ranks, "number of ranks (world size), >= 1")->required();
  app.add_option("--ep", args->options.expert_parallel,
                 "MoE expert groups (must divide --ranks; 0 = one group per rank)")
      ->capture_default_str();
  app.add_option("--boxes", args->boxes,
                 "NAME:COUNT,... consecutive ranks per box, or one box name per rank "
                 "(a,a,b); default: all on `local`");
  app.add_option("--capacities,--capacity", args->capacity,
                 "relative capacity per rank, comma-separated, e.g. 1,1,0.5: a rank with "
                 "less gets proportionally less (default: all 1)");
  app.add_flag("--replicate-head", args->options.replicate_head,
               "hold the whole output head on every rank instead of splitting the vocab");
  app.add_option("--bits", args->options.estimate_bits,
                 "plan from config.json alone, bytes as `convert --bits B` would store them "
                 "(the converter's bit allocation; 1..8); default for a directory without "
                 "*.safetensors: fp16");
  app.add_option("--head-bits", args->options.estimate_head_bits,
                 "with --bits: K of lm_head (1..8, 16 = fp16)")
      ->capture_default_str();
  // Which row tables each rank reads from its box's disk (as generate/serve/worker).
  AddSpillFlags(app, &args->spill);
  return [args, &app]() -> absl::Status {
    if (app.count("--head-bits") > 0 && app.count("--bits") == 0) {
      return absl::InvalidArgumentError("--head-bits needs --bits (it sizes a conversion)");
    }
    if (args->ranks < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ranks must be >= 1, got ", args->ranks));
    }
    sharding::WorldSpec world = sharding::WorldSpec::Uniform(args->ranks);
    if (!args->boxes.empty()) EXL3_RETURN_IF_ERROR(ParseBoxes(args->boxes, args->ranks, world));
    // The parser generate/serve/worker share (cli/capacity_flags.h); its
    // errors name --capacities (--capacity is the same option).
    EXL3_ASSIGN_OR_RETURN(const std::vector<double> capacities,
                          ParseCapacitiesFlag(args->capacity, args->ranks));
    for (size_t r = 0; r < capacities.size(); ++r) world.ranks[r].capacity = capacities[r];
    std::unique_ptr<sharding::Exl3Model> model;
    sharding::ModelArch arch;
    std::string bytes_from;
    if (args->options.estimate_bits > 0.0 || HasNoWeights(args->model)) {
      // From the config alone: no weights are opened.
      EXL3_ASSIGN_OR_RETURN(nlohmann::json config,
                            sharding::ReadJsonFile(args->model + "/config.json"));
      absl::StatusOr<sharding::ModelArch> parsed = sharding::ModelArchFromConfig(config);
      if (!parsed.ok()) {
        return absl::Status(parsed.status().code(),
                            absl::StrCat(args->model, "/config.json: ", parsed.status().message()));
      }
      arch = *std::move(parsed);
      bytes_from = args->options.estimate_bits > 0.0
                       ? absl::StrCat("config.json, as EXL3 at ", args->options.estimate_bits,
                                      " bpw (convert's bit allocation), head ",
                                      args->options.estimate_head_bits == 16
                                          ? std::string("fp16")
                                          : absl::StrCat(args->options.estimate_head_bits, " bits"),
                                      ", embedding, norms and router fp16")
                       : "config.json, every tensor fp16 (no weights in the directory)";
    } else {
      EXL3_ASSIGN_OR_RETURN(model, sharding::Exl3Model::Open(args->model));
      if (!model->arch()) {
        return absl::UnimplementedError(absl::StrCat(
            args->model, "/config.json: the planner needs a supported architecture "
                         "(see `exl3serve inspect`)"));
      }
      arch = *model->arch();
      bytes_from = "the stored tensors";
    }
    EXL3_ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                          sharding::PlanShards(arch, world, args->options, model.get()));
    std::printf("model: %s\n", args->model.c_str());
    std::printf("bytes from: %s\n", bytes_from.c_str());
    EXL3_RETURN_IF_ERROR(sharding::PlanRowTables(args->spill.Policy(), &plan));
    std::fputs(plan.Describe().c_str(), stdout);
    std::fputs(sharding::DescribeRowTables(plan).c_str(), stdout);
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
