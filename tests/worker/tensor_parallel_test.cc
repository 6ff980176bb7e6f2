// Tensor and expert parallelism end to end: N rank processes (exl3serve
// worker, shm collectives) driven by LocalGroup against the same model run
// in this process (TP = 1) — logits within 1e-4 relative, identical greedy
// tokens over 64 steps; a killed rank fails the step within its deadline and
// leaves no process behind; each rank reads only its part of the checkpoint.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "sharding/converter.h"
#include "sharding/exl3_model.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/generator.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve::worker {
namespace {

using rank::LocalGroup;
using rank::LocalGroupOptions;

struct Models {
  testing::ScratchDir dir;
  std::string llama, llama_exl3, qwen3, qwen3_moe, mixtral;
};
Models* models = nullptr;

class TensorParallelTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    models = new Models();
    sharding::TestModelOptions llama;  // hidden 256, 4 heads of 64, 2 kv heads, mlp 640
    llama.seed = 11;
    models->llama = models->dir.File("llama");
    ASSERT_TRUE(sharding::WriteTestModel(models->llama, llama).ok());


    sharding::TestModelOptions qwen3;  // 8 heads of 64 over 4 kv heads, tied embeddings
    qwen3.arch = "qwen3";
    qwen3.hidden_size = 512;
    qwen3.num_attention_heads = 8;
    qwen3.num_key_value_heads = 4;
    qwen3.intermediate_size = 384;
    qwen3.tie_word_embeddings = true;
    qwen3.seed = 12;
    models->qwen3 = models->dir.File("qwen3");
    ASSERT_TRUE(sharding::WriteTestModel(models->qwen3, qwen3).ok());

    sharding::TestModelOptions moe;
    moe.arch = "qwen3-moe";
    moe.num_experts = 6;
    moe.seed = 13;
    models->qwen3_moe = models->dir.File("qwen3-moe");
    ASSERT_TRUE(sharding::WriteTestModel(models->qwen3_moe, moe).ok());

    sharding::TestModelOptions mixtral;
    mixtral.arch = "mixtral";
    mixtral.num_experts = 4;
    mixtral.seed = 14;
    models->mixtral = models->dir.File("mixtral");
    ASSERT_TRUE(sharding::WriteTestModel(models->mixtral, mixtral).ok());
  }
  // The EXL3 conversion of the Llama model, made on first use (ctest runs
  // each test in its own process; only some need it).
  static const std::string& Exl3Llama() {
    if (models->llama_exl3.empty()) {
      sharding::ConvertOptions convert;
      convert.in_dir = models->llama;
      convert.out_dir = models->dir.File("llama-exl3");
      convert.bits = 3.0;
      convert.show_progress = false;
      absl::StatusOr<sharding::ConvertReport> report = sharding::ConvertModel(convert);
      EXPECT_TRUE(report.ok()) << report.status();
      models->llama_exl3 = convert.out_dir;
    }
    return models->llama_exl3;
  }
  static void TearDownTestSuite() {
    delete models;
    models = nullptr;
  }

  static LocalGroupOptions GroupOptions(const std::string& dir, int tp, int ep) {
    LocalGroupOptions options;
    options.model_dir = dir;
    options.world_size = tp;
    options.expert_parallel = ep;
    options.executable = EXL3_EXE;
    options.kv.dtype = KvCacheDtype::kFp32;
    options.kv.num_pages = 64;
    options.step_timeout = absl::Seconds(60);
    return options;
  }
};

// Prompt-sized random ids, deterministic.
std::vector<int32_t> Prompt(int n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids(n);
  uint32_t x = seed;
  for (int32_t& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % vocab);
  }
  return ids;
}

// Logits of every prompt position, then 64 greedy tokens.
struct Run {
  std::vector<float> prefill_logits;
  std::vector<int32_t> tokens;
};

Run RunOn(StepExecutor& executor, const std::vector<int32_t>& prompt) {
  Run run;
  EXPECT_TRUE(executor.AddSequence(5).ok());
  const SequenceTokens entry{5, prompt};
  absl::Status s = executor.Forward({&entry, 1}, LogitsRows::kAllTokens, &run.prefill_logits);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(executor.RemoveSequence(5).ok());
  GenerationOptions options;
  options.sampling.temperature = 0.0f;
  options.max_new_tokens = 64;
  absl::StatusOr<FinishReason> finish =
      Generate(executor, 9, prompt, options, [&](const GeneratedStep& step) {
        run.tokens.push_back(step.token.id);
        return true;
      });
  EXPECT_TRUE(finish.ok()) << finish.status();
  return run;
}

Run RunLocal(const std::string& dir, const std::vector<int32_t>& prompt) {
  absl::StatusOr<std::unique_ptr<Transformer>> model = Transformer::Load(dir);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  KvCacheOptions kv;
  kv.dtype = KvCacheDtype::kFp32;
  kv.num_pages = 64;
  absl::StatusOr<PagedKvCache> cache = (*model)->CreateKvCache(kv);
  EXPECT_TRUE(cache.ok());
  LocalStepExecutor local(model->get(), std::move(*cache));
  return RunOn(local, prompt);
}

// max |a - b| / max |b|.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

void ExpectSameAsOneRank(const std::string& dir, int tp, int ep) {
  SCOPED_TRACE(::testing::Message() << dir << " tp=" << tp << " ep=" << ep);
  absl::StatusOr<ModelConfig> config = ReadModelConfig(dir);
  ASSERT_TRUE(config.ok());
  const std::vector<int32_t> prompt = Prompt(23, config->arch.vocab_size, 7 * tp + ep);
  const Run reference = RunLocal(dir, prompt);
  absl::StatusOr<std::unique_ptr<LocalGroup>> group =
      LocalGroup::Start(TensorParallelTest::GroupOptions(dir, tp, ep));
  ASSERT_TRUE(group.ok()) << group.status();
  const Run parallel = RunOn(**group, prompt);
  ASSERT_EQ(parallel.prefill_logits.size(), reference.prefill_logits.size());
  const double error = RelativeError(parallel.prefill_logits, reference.prefill_logits);
  EXPECT_LE(error, 1e-4);
  EXPECT_GT(error, -1.0);  // not NaN
  EXPECT_EQ(parallel.tokens, reference.tokens);
  EXPECT_EQ(parallel.tokens.size(), 64u);
  std::printf("%s tp=%d ep=%d: relative logits error %.3g, %zu greedy tokens equal\n",
              dir.substr(dir.rfind('/') + 1).c_str(), tp, ep, error, parallel.tokens.size());
}

TEST_F(TensorParallelTest, DenseLlamaTp2To4MatchesOneRank) {
  for (int tp : {2, 3, 4}) ExpectSameAsOneRank(models->llama, tp, 0);
}

TEST_F(TensorParallelTest, Exl3LlamaTp2To4MatchesOneRank) {
  for (int tp : {2, 3, 4}) ExpectSameAsOneRank(Exl3Llama(), tp, 0);
}

TEST_F(TensorParallelTest, Qwen3TiedTp3MatchesOneRank) {
  ExpectSameAsOneRank(models->qwen3, 3, 0);
}

TEST_F(TensorParallelTest, MoeExpertParallelMatchesOneRank) {
  ExpectSameAsOneRank(models->qwen3_moe, 2, 2);
  ExpectSameAsOneRank(models->qwen3_moe, 3, 3);
  ExpectSameAsOneRank(models->mixtral, 4, 2);  // 2 expert groups, experts split over 2 ranks
}

TEST_F(TensorParallelTest, EachRankReadsItsShare) {
  absl::StatusOr<std::unique_ptr<sharding::Exl3Model>> model =
      sharding::Exl3Model::Open(Exl3Llama());
  ASSERT_TRUE(model.ok());
  const uint64_t total = (*model)->TotalStoredBytes();
  absl::StatusOr<std::unique_ptr<LocalGroup>> group =
      LocalGroup::Start(GroupOptions(Exl3Llama(), 2, 0));
  ASSERT_TRUE(group.ok()) << group.status();
  uint64_t sum = 0;
  for (int r = 0; r < 2; ++r) {
    const uint64_t read = (*group)->bytes_read(r);
    std::printf("rank %d read %llu of %llu checkpoint bytes (plan: %llu)\n", r,
                static_cast<unsigned long long>(read), static_cast<unsigned long long>(total),
                static_cast<unsigned long long>((*group)->planned_bytes(r)));
    EXPECT_GT(read, 0u);
    EXPECT_LT(read, total);  // never the whole checkpoint
    sum += read;
  }
  EXPECT_GE(sum, total);  // replicated tensors are read by both
}

TEST_F(TensorParallelTest, KilledRankFailsTheStepWithinTheDeadline) {
  LocalGroupOptions options = GroupOptions(models->llama, 3, 0);
  options.step_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<LocalGroup>> group = LocalGroup::Start(options);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r) pids.push_back((*group)->rank_pid(r));
  ASSERT_TRUE((*group)->AddSequence(1).ok());
  ASSERT_EQ(kill(pids[1], SIGKILL), 0);
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  const SequenceTokens entry{1, prompt};
  std::vector<float> logits;
  const absl::Time start = absl::Now();
  const absl::Status status = (*group)->Forward({&entry, 1}, LogitsRows::kLastToken, &logits);
  const absl::Duration took = absl::Now() - start;
  EXPECT_FALSE(status.ok());
  EXPECT_LT(took, options.step_timeout + absl::Seconds(2)) << status;
  std::printf("step with a killed rank: %s after %s\n", status.ToString().c_str(),
              absl::FormatDuration(took).c_str());
  // Later calls fail at once, naming the broken group.
  EXPECT_FALSE((*group)->AddSequence(2).ok());
  group->reset();  // shuts down what is left
  for (pid_t pid : pids) {
    EXPECT_EQ(kill(pid, 0), -1) << "rank pid " << pid << " still exists";
  }
}

TEST_F(TensorParallelTest, LoadErrorIsReportedNotHung) {
  LocalGroupOptions options = GroupOptions(models->dir.File("no-such-model"), 2, 0);
  options.load_timeout = absl::Seconds(20);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<LocalGroup>> group = LocalGroup::Start(options);
  EXPECT_FALSE(group.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_NE(group.status().message().find("no-such-model"), std::string::npos) << group.status();
}

}  // namespace
}  // namespace exl3serve::worker
