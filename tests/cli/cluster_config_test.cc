// The cluster YAML readers (cli/cluster_keys.h, cli/coordinator_config.h,
// cli/launch_plan.h) on hostile and malformed documents: every one is an
// InvalidArgument naming the key or the limit, never a crash or an
// exception; the deploy example is accepted. Regression cases for what the
// fuzzer (tests/fuzz/cluster_config_fuzz.cc) looks for.
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/cluster_keys.h"
#include "cli/coordinator_config.h"
#include "cli/launch_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace exl3serve::cli {
namespace {

using ::testing::HasSubstr;

absl::Status ReadConfig(const std::string& text) {
  absl::StatusOr<YAML::Node> root = ParseClusterYaml(text, "test.yaml");
  if (!root.ok()) return root.status();
  return ReadCoordinatorConfig(*root).status();
}

absl::Status ReadPlan(const std::string& text) {
  absl::StatusOr<YAML::Node> root = ParseClusterYaml(text, "test.yaml");
  if (!root.ok()) return root.status();
  return ReadLaunchPlan(*root).status();
}

void ExpectRefused(const absl::Status& status, const std::string& says) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(says));
}

TEST(ClusterConfigTest, TheDeployExampleIsAccepted) {
  absl::StatusOr<CoordinatorConfig> config =
      LoadCoordinatorConfig(std::string(EXL3_SOURCE_DIR) + "/deploy/cluster/local-2-ranks.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->group.world_size, 2);
}

TEST(ClusterConfigTest, SpeculativeDecodingKeysAreReadAndChecked) {
  const std::string base = "model_dir: /m\nworld_size: 2\n";
  absl::StatusOr<YAML::Node> root = ParseClusterYaml(
      base + "engine: {speculative: draft, draft_model: /d, draft_tokens: 5, draft_token_budget: 40}\n",
      "test.yaml");
  ASSERT_TRUE(root.ok()) << root.status();
  absl::StatusOr<CoordinatorConfig> config = ReadCoordinatorConfig(*root);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->engine.speculative, coordinator::SpeculativeMethod::kDraftModel);
  EXPECT_EQ(config->engine.draft_model_dir, "/d");
  EXPECT_EQ(config->engine.draft_tokens, 5);
  EXPECT_EQ(config->engine.draft_token_budget, 40);
  ExpectRefused(ReadConfig(base + "engine: {speculative: medusa}\n"), "engine.speculative");
  ExpectRefused(ReadConfig(base + "engine: {speculative: ngram, draft_tokens: 16}\n"),
                "engine.draft_tokens");
  ExpectRefused(ReadConfig(base + "engine: {draft_token_budget: 0}\n"), "engine.draft_token_budget");
}

TEST(ClusterConfigTest, AKeyThatIsNotAStringIsAnErrorNotACrash) {
  // yaml-cpp's as<std::string>() throws on a non-scalar key; it used to escape.
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 1\n? [a, b]\n: 1\n"), "not a string");
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 1\nkv: {{a: 1}: 2}\n"), "not a string");
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 1\ncomm: {nccl: {[x]: 1}}\n"),
                "not a string");
  ExpectRefused(ReadPlan("model_dir: m\nworld_size: 1\nboxes:\n  - {[n]: 1}\n"), "not a string");
}

TEST(ClusterConfigTest, AliasBombIsRefusedByTheNodeLimit) {
  std::string text = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    text += absl::StrCat("a", i, ": &a", i, " [");
    for (int j = 0; j < 10; ++j) text += absl::StrCat(j ? ", " : "", "*a", i - 1);
    text += "]\n";
  }
  text += "model_dir: m\nworld_size: 1\n";
  ExpectRefused(ReadConfig(text), "kMaxClusterYamlNodes");
}

TEST(ClusterConfigTest, DeepNestingIsRefusedByTheDepthLimit) {
  const std::string deep = std::string(kMaxClusterYamlDepth + 5, '[') + "1" +
                           std::string(kMaxClusterYamlDepth + 5, ']');
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 1\nx: " + deep + "\n"),
                "kMaxClusterYamlDepth");
  // Far past yaml-cpp's own recursion guard: an error from the parser, no stack overflow.
  const std::string deeper = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(ReadConfig(deeper).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClusterConfigTest, OversizedFileIsRefusedByTheByteLimit) {
  const std::string big = "model_dir: m\nworld_size: 1\n#" + std::string(kMaxClusterYamlBytes, 'x');
  ExpectRefused(ReadConfig(big), "kMaxClusterYamlBytes");
  const std::string path = ::testing::TempDir() + "/big.yaml";
  std::ofstream(path) << big;
  ExpectRefused(LoadCoordinatorConfig(path).status(), "kMaxClusterYamlBytes");
}

TEST(ClusterConfigTest, WorldSizeIsBounded) {
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 2000000000\n"), "kMaxWorldSize");
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 0\n"), "world_size");
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: x\n"), "world_size");
}

TEST(ClusterConfigTest, ShapesOtherThanAMappingAreErrors) {
  for (const char* text : {"", "42", "[1, 2]", "~", "!!binary aGk=", "model_dir: m\nworld_size: 1\nkv: 3\n",
                           "model_dir: m\nworld_size: 1\ncomm: [a]\n",
                           "model_dir: [m]\nworld_size: 1\n", "model_dir: m\nworld_size: 1\nboxes: 7\n"}) {
    const absl::Status status = ReadConfig(text);
    const absl::Status plan = ReadPlan(text);
    EXPECT_FALSE(status.ok() && plan.ok()) << text;
    if (!status.ok()) EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
    if (!plan.ok()) EXPECT_EQ(plan.code(), absl::StatusCode::kInvalidArgument) << text;
  }
  ExpectRefused(ReadConfig("model_dir: m\nworld_size: 1\nbad: [unclosed\n"), "test.yaml");
}

TEST(ClusterConfigTest, LaunchPlanPlacesEveryRankOnce) {
  const std::string base =
      "model_dir: /m\nworld_size: 3\nlisten_address: 10.0.0.1:50061\nrank_token_file: /t\n"
      "tls: {rank_cert: c, rank_key: k, rank_ca: ca}\n";
  const std::string boxes =
      "boxes:\n  - {name: lead, address: 10.0.0.1, coordinator: true, ranks: [0]}\n"
      "  - {name: a, address: 10.0.0.2, ranks: [1, 2], rank_devices: [0, 1]}\n";
  absl::StatusOr<YAML::Node> root = ParseClusterYaml(base + boxes, "ok.yaml");
  ASSERT_TRUE(root.ok()) << root.status();
  absl::StatusOr<LaunchPlan> plan = ReadLaunchPlan(*root);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->coordinator_address, "10.0.0.1:50061");
  ASSERT_EQ(plan->boxes.size(), 2u);
  EXPECT_EQ(plan->boxes[1].ranks, (std::vector<int>{1, 2}));
  ExpectRefused(ReadPlan(base + "boxes:\n  - {name: lead, address: h, coordinator: true, ranks: [0, 1]}\n"),
                "rank 2 is on no box");
  ExpectRefused(ReadPlan(base + "boxes:\n  - {name: lead, address: h, coordinator: true, ranks: [0, 1, 1, 2]}\n"),
                "boxes[0].ranks[2]");
  ExpectRefused(ReadPlan(base + "boxes:\n  - {name: lead, address: h, ranks: [0, 1, 2]}\n"),
                "must be true on one box");
}

}  // namespace
}  // namespace exl3serve::cli
