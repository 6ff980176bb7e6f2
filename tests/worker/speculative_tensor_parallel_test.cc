// Speculative verification across rank processes: LocalGroup::ForwardVerified
// (control wire kForwardVerified, worker::RunVerifiedForward on every rank)
// at TP 2 and 3 against the same model in this process (LocalStepExecutor,
// TP 1), through the shared script of tests/testing/verified_script.h:
// drafts fully right, partly right and wrong beside plain decodes and a
// prefill chunk, greedy and seeded with penalties and logprobs; runs equal
// token for token and equal to serial decoding, and a plain step after the
// last rollback equal too (every rank dropped the rejected positions).
// Also: malformed draft counts are refused before anything is sent (the
// group stays healthy and keeps the staged pages).
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/verified_script.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/rank/local_group.h"

namespace exl3serve::worker {
namespace {

using rank::LocalGroup;
using rank::LocalGroupOptions;

constexpr int kPageTokens = 16;
constexpr int64_t kPages = 64;

uint32_t GtestSeed() {
  return static_cast<uint32_t>(::testing::UnitTest::GetInstance()->random_seed());
}

class SpeculativeTpBase : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir();
    sharding::TestModelOptions options;  // llama, hidden 256, 4 heads / 2 kv, vocab 1000
    options.seed = 300 + GtestSeed() % 1000;
    ASSERT_TRUE(sharding::WriteTestModel(dir_->File("llama"), options).ok());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

 protected:
  static std::string ModelDir() { return dir_->File("llama"); }
  static KvCacheOptions Kv() {
    KvCacheOptions kv;
    kv.dtype = KvCacheDtype::kFp32;
    kv.num_pages = kPages;
    kv.page_size_tokens = kPageTokens;
    kv.caller_assigns_pages = true;  // as every coordinator runs its ranks
    return kv;
  }
  static std::unique_ptr<LocalGroup> StartGroup(int tp) {
    LocalGroupOptions options;
    options.model_dir = ModelDir();
    options.world_size = tp;
    options.executable = EXL3_EXE;
    options.kv = Kv();
    options.step_timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<LocalGroup>> group = LocalGroup::Start(options);
    EXPECT_TRUE(group.ok()) << group.status();
    return group.ok() ? std::move(*group) : nullptr;
  }
  static testing::ScratchDir* dir_;
};
testing::ScratchDir* SpeculativeTpBase::dir_ = nullptr;

class SpeculativeTensorParallelTest : public SpeculativeTpBase,
                                      public ::testing::WithParamInterface<int> {};
using SpeculativeTensorParallelErrorsTest = SpeculativeTpBase;

TEST_P(SpeculativeTensorParallelTest, VerifiedRunsEqualOneProcessAndSerialDecoding) {
  const int tp = GetParam();
  absl::StatusOr<std::unique_ptr<Transformer>> model = Transformer::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<PagedKvCache> cache = (*model)->CreateKvCache(Kv());
  ASSERT_TRUE(cache.ok()) << cache.status();
  LocalStepExecutor reference(model->get(), std::move(*cache));
  std::unique_ptr<LocalGroup> group = StartGroup(tp);
  ASSERT_NE(group, nullptr);
  for (uint32_t round = 0; round < 2; ++round) {
    const uint32_t seed = GtestSeed() * 31u + static_cast<uint32_t>(tp) * 7u + round;
    SCOPED_TRACE(::testing::Message() << "tp " << tp << ", script seed " << seed);
    const testing::VerifiedScriptResult r = testing::RunVerifiedScript(
        reference, *group,
        {.seed = seed, .vocab_size = 1000, .page_size_tokens = kPageTokens, .num_pages = kPages,
         .seeded = false});  // TP 2/3 vs one process: see VerifiedScriptOptions::seeded
    ASSERT_FALSE(HasFailure());
    // The script reached every case it is meant to.
    EXPECT_GT(r.full_accepts, 0);
    EXPECT_GT(r.partial_accepts + r.rejections, 0);
    EXPECT_GT(r.accepted, 0);
    EXPECT_LT(r.accepted, r.drafted);
    std::printf("tp=%d seed %u: %lld steps, %lld of %lld drafts accepted (%lld full, %lld partial, "
                "%lld rejected)\n",
                tp, seed, (long long)r.steps, (long long)r.accepted, (long long)r.drafted,
                (long long)r.full_accepts, (long long)r.partial_accepts, (long long)r.rejections);
  }
  EXPECT_TRUE(group->health().ok()) << group->health();
  EXPECT_GT(group->result_bytes_received(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Tp, SpeculativeTensorParallelTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "Tp" + std::to_string(info.param);
                         });

// Bad draft counts never reach a rank: InvalidArgument, the group stays
// healthy, and the pages staged for the sequence are still sent with its
// next forward (with caller-assigned pages, the forward fails without them).
TEST_F(SpeculativeTensorParallelErrorsTest, MalformedDraftCountsAreRefusedBeforeAnythingIsSent) {
  std::unique_ptr<LocalGroup> group = StartGroup(2);
  ASSERT_NE(group, nullptr);
  SequenceSampling sampling;
  sampling.params.seed = 3;
  sampling.params.temperature = 0.0f;
  sampling.prompt_len = 5;
  ASSERT_TRUE(group->AddSampledSequence(1, sampling).ok());
  ASSERT_TRUE(group->AddSequence(2).ok());
  const std::vector<int32_t> pages1 = {9}, pages2 = {4};
  ASSERT_TRUE(group->AssignPages(1, pages1).ok());
  ASSERT_TRUE(group->AssignPages(2, pages2).ok());
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15};
  const std::vector<int32_t> chunk = {21, 22, 23};
  const std::vector<SequenceTokens> batch = {{1, prompt}, {2, chunk}};
  const std::vector<uint8_t> sample = {1, 0};
  std::vector<std::vector<SampledToken>> runs;
  struct Case {
    std::vector<int32_t> drafts;
    std::vector<uint8_t> sample;
  };
  const std::vector<Case> cases = {
      {{-1, 0}, sample}, {{5, 0}, sample}, {{9, 0}, sample},  // < 0, = tokens, > tokens
      {{2, 1}, sample},                                       // a draft on an unsampled entry
      {{0}, sample},                                          // one count for two entries
      {{0, 0}, {1}},                                          // one flag for two entries
  };
  for (const Case& c : cases) {
    const absl::Status s = group->ForwardVerified(batch, c.sample, c.drafts, &runs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_FALSE(s.message().empty());
  }
  EXPECT_EQ(group->ForwardVerified({}, {}, {}, &runs).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(group->health().ok()) << group->health();
  // The staged pages went with this forward: it succeeds.
  const std::vector<int32_t> none = {0, 0};
  const absl::Status ok = group->ForwardVerified(batch, sample, none, &runs);
  ASSERT_TRUE(ok.ok()) << ok;
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].size(), 1u);
  EXPECT_TRUE(runs[1].empty());
}

}  // namespace
}  // namespace exl3serve::worker
