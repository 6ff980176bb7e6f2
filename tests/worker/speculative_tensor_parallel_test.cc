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


// ---------------------------------------------------------------- allowed-token masks

// Structured output's masks cross the control wire with sampled and verified
// forwards: greedy and seeded draws under random masks (none, dense, a few
// ids, one id) at TP 2 equal this process's, every drawn token is allowed,
// and masks of the wrong size are refused before anything is sent.
using MaskedSamplingTensorParallelTest = SpeculativeTpBase;

TEST_F(MaskedSamplingTensorParallelTest, MaskedDrawsAtTp2EqualOneProcessAndAreAllowed) {
  absl::StatusOr<std::unique_ptr<Transformer>> model = Transformer::Load(ModelDir());
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<PagedKvCache> cache = (*model)->CreateKvCache(Kv());
  ASSERT_TRUE(cache.ok()) << cache.status();
  LocalStepExecutor reference(model->get(), std::move(*cache));
  std::unique_ptr<LocalGroup> group = StartGroup(2);
  ASSERT_NE(group, nullptr);
  constexpr int64_t kVocab = 1000;
  constexpr int64_t kWords = (kVocab + 31) / 32;
  std::mt19937 rng(GtestSeed() + 17);
  auto random_mask = [&](int kind) {
    std::vector<uint32_t> m(kWords, 0);
    if (kind == 0) return std::vector<uint32_t>();  // unconstrained
    for (int64_t id = 0; id < kVocab; ++id) {
      const bool on = kind == 1 ? rng() % 3 == 0 : kind == 2 ? rng() % 200 == 0 : false;
      if (on) m[id / 32] |= 1u << (id % 32);
    }
    const int64_t one = static_cast<int64_t>(rng() % kVocab);
    m[one / 32] |= 1u << (one % 32);  // never empty; kind 3: only this id
    return m;
  };
  auto allowed = [&](const std::vector<uint32_t>& m, int64_t row, int32_t id) {
    return m.empty() || ((m[row * kWords + id / 32] >> (id % 32)) & 1u) != 0;
  };
  constexpr int kSeqs = 6;
  std::vector<std::vector<int32_t>> next(kSeqs);
  int32_t page = 0;
  for (int s = 0; s < kSeqs; ++s) {
    SequenceSampling sampling;
    sampling.params.seed = 40 + s;
    sampling.params.temperature = s % 2 == 0 ? 0.0f : 1.0f;
    sampling.params.top_k = s == 3 ? 20 : 0;
    sampling.prompt_len = 5;
    ASSERT_TRUE(reference.AddSampledSequence(s, sampling).ok());
    ASSERT_TRUE(group->AddSampledSequence(s, sampling).ok());
    const std::vector<int32_t> pages = {page, page + 1};
    page += 2;
    ASSERT_TRUE(reference.AssignPages(s, pages).ok());
    ASSERT_TRUE(group->AssignPages(s, pages).ok());
    for (int t = 0; t < 5; ++t) next[s].push_back(static_cast<int32_t>(rng() % kVocab));
  }
  int64_t drawn = 0;
  for (int step = 0; step < 10; ++step) {
    const bool verified = step % 3 == 2;
    std::vector<std::vector<uint32_t>> masks(kSeqs);
    std::vector<std::vector<int32_t>> tokens(kSeqs);
    std::vector<int32_t> drafts(kSeqs, 0);
    std::vector<SequenceTokens> batch;
    for (int s = 0; s < kSeqs; ++s) {
      tokens[s] = next[s];
      if (verified && step > 0) {  // two random drafts after the last token
        drafts[s] = 2;
        for (int d = 0; d < 2; ++d) tokens[s].push_back(static_cast<int32_t>(rng() % kVocab));
      }
      const int kind = static_cast<int>((s + step) % 4);
      for (int r = 0; r <= drafts[s]; ++r) {
        std::vector<uint32_t> row = random_mask(kind);
        masks[s].insert(masks[s].end(), row.begin(), row.end());
      }
      batch.push_back({s, tokens[s], masks[s]});
    }
    const std::vector<uint8_t> sample(kSeqs, 1);
    std::vector<std::vector<SampledToken>> ref_runs, got_runs;
    if (verified) {
      ASSERT_TRUE(reference.ForwardVerified(batch, sample, drafts, &ref_runs).ok());
      absl::Status s = group->ForwardVerified(batch, sample, drafts, &got_runs);
      ASSERT_TRUE(s.ok()) << s;
    } else {
      std::vector<SampledToken> a, b;
      ASSERT_TRUE(reference.ForwardSampled(batch, sample, &a).ok());
      absl::Status s = group->ForwardSampled(batch, sample, &b);
      ASSERT_TRUE(s.ok()) << s;
      for (int i = 0; i < kSeqs; ++i) {
        ref_runs.push_back({a[i]});
        got_runs.push_back({b[i]});
      }
    }
    for (int s = 0; s < kSeqs; ++s) {
      ASSERT_EQ(got_runs[s].size(), ref_runs[s].size()) << "step " << step << " seq " << s;
      for (size_t j = 0; j < ref_runs[s].size(); ++j) {
        EXPECT_EQ(got_runs[s][j].id, ref_runs[s][j].id) << "step " << step << " seq " << s;
        EXPECT_TRUE(allowed(masks[s], static_cast<int64_t>(j), got_runs[s][j].id))
            << "step " << step << " seq " << s << " drew masked token " << got_runs[s][j].id;
        ++drawn;
      }
      next[s] = {ref_runs[s].back().id};
    }
  }
  EXPECT_GE(drawn, 60);
  // Wrong sizes: refused, nothing sent, the group stays healthy.
  const std::vector<int32_t> one = {next[0][0]};
  const std::vector<uint32_t> short_mask(kWords - 1, ~0u), two_rows(2 * kWords, ~0u);
  std::vector<SampledToken> tokens;
  for (const std::vector<uint32_t>* m : {&short_mask, &two_rows}) {
    const std::vector<SequenceTokens> batch = {{0, one, *m}};
    const std::vector<uint8_t> sample = {1};
    EXPECT_EQ(group->ForwardSampled(batch, sample, &tokens).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(group->health().ok()) << group->health();
}

}  // namespace
}  // namespace exl3serve::worker
