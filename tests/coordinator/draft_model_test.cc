// DraftModel (coordinator/draft_model.h) over an in-process model whose
// cache takes its own pages: every proposal equals the model's greedy
// continuation computed from scratch (worker::Generate in a fresh cache),
// also after the sequence's tokens diverge from what the draft cache holds
// (rejected drafts: the cache is rolled back), for many sequences batched in
// one Propose, with random accept/reject histories; a full pool is an error
// that frees everything, after which drafting works again.
#include "coordinator/draft_model.h"

#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/generator.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::coordinator {
namespace {

class DraftModelTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir();
    sharding::TestModelOptions options;  // llama, vocab 1000
    options.peaked_logits = true;
    options.seed = 5;
    ASSERT_TRUE(sharding::WriteTestModel(dir_->File("m"), options).ok());
    auto loaded = worker::Transformer::Load(dir_->File("m"));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model_ = loaded->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }

 protected:
  // A draft executor whose cache allocates its own pages.
  static std::unique_ptr<worker::StepExecutor> Executor(int64_t pages) {
    worker::KvCacheOptions kv;
    kv.dtype = worker::KvCacheDtype::kFp32;
    kv.num_pages = pages;
    kv.page_size_tokens = 8;
    auto cache = model_->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    return std::make_unique<worker::LocalStepExecutor>(model_, std::move(*cache));
  }
  // The greedy continuation of `tokens` (k tokens), from scratch.
  static std::vector<int32_t> Greedy(const std::vector<int32_t>& tokens, int k) {
    worker::KvCacheOptions kv;
    kv.dtype = worker::KvCacheDtype::kFp32;
    kv.num_pages = 64;
    auto cache = model_->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    worker::GenerationOptions options;
    options.sampling.temperature = 0;
    options.max_new_tokens = k;
    std::vector<int32_t> out;
    auto done = worker::Generate(*model_, &*cache, 0, tokens, options,
                                 [&](const worker::GeneratedStep& s) {
                                   out.push_back(s.token.id);
                                   return true;
                                 });
    EXPECT_TRUE(done.ok()) << done.status();
    return out;
  }

  static testing::ScratchDir* dir_;
  static worker::Transformer* model_;
};
testing::ScratchDir* DraftModelTest::dir_ = nullptr;
worker::Transformer* DraftModelTest::model_ = nullptr;

TEST_F(DraftModelTest, ProposalsFollowTheSequencesThroughAcceptsAndRejects) {
  DraftModel draft(Executor(256));
  std::mt19937 rng(::testing::UnitTest::GetInstance()->random_seed());
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  constexpr int kSequences = 5;
  std::vector<std::vector<int32_t>> seqs(kSequences);
  for (auto& s : seqs) {
    for (int i = uniform(1, 19); i > 0; --i) s.push_back(uniform(0, 999));
  }
  uint64_t checked = 0;
  for (int round = 0; round < 12; ++round) {
    std::vector<DraftRequest> requests;
    for (int i = 0; i < kSequences; ++i) {
      if (uniform(0, 4) == 0) continue;  // this sequence does not draft this round
      requests.push_back({.seq_id = i, .tokens = seqs[i], .k = uniform(0, 5)});
    }
    std::vector<std::vector<int32_t>> drafts;
    ASSERT_TRUE(draft.Propose(requests, &drafts).ok());
    ASSERT_EQ(drafts.size(), requests.size());
    for (size_t j = 0; j < requests.size(); ++j) {
      const int i = static_cast<int>(requests[j].seq_id);
      const std::vector<int32_t> want =
          requests[j].k > 0 ? Greedy(seqs[i], requests[j].k) : std::vector<int32_t>();
      EXPECT_EQ(drafts[j], want)
          << "sequence " << i << ", round " << round;
      ++checked;
    }
    // "Verification": a random number of the drafts accepted, then a token
    // that may or may not be the draft model's own next token.
    for (size_t j = 0; j < requests.size(); ++j) {
      std::vector<int32_t>& s = seqs[requests[j].seq_id];
      const int accepted = uniform(0, static_cast<int>(drafts[j].size()));
      s.insert(s.end(), drafts[j].begin(), drafts[j].begin() + accepted);
      s.push_back(uniform(0, 999));
    }
  }
  EXPECT_GT(checked, 30u);
  EXPECT_GT(draft.stats().rolled_back, 0u);
  EXPECT_GT(draft.stats().catch_up_tokens, 0u);
  // Forgotten sequences start again from nothing.
  draft.Forget(0);
  EXPECT_TRUE(draft.cached(0).empty());
  std::vector<std::vector<int32_t>> drafts;
  const DraftRequest again{.seq_id = 0, .tokens = seqs[0], .k = 3};
  ASSERT_TRUE(draft.Propose({&again, 1}, &drafts).ok());
  EXPECT_EQ(drafts[0], Greedy(seqs[0], 3));
}

TEST_F(DraftModelTest, AFullPoolIsAnErrorThatFreesEverySequence) {
  DraftModel draft(Executor(4));  // 32 positions
  std::vector<int32_t> a(20, 7), b(20, 9);
  const DraftRequest both[] = {{.seq_id = 1, .tokens = a, .k = 2}, {.seq_id = 2, .tokens = b, .k = 2}};
  std::vector<std::vector<int32_t>> drafts;
  const absl::Status full = draft.Propose(both, &drafts);
  EXPECT_FALSE(full.ok());
  EXPECT_TRUE(drafts.empty());
  EXPECT_TRUE(draft.cached(1).empty());
  // The pool is whole again: one sequence fits.
  ASSERT_TRUE(draft.Propose({&both[0], 1}, &drafts).ok()) << "after the failure";
  EXPECT_EQ(drafts[0], Greedy(a, 2));
}

TEST_F(DraftModelTest, RejectsEmptyTokensAndDuplicates) {
  DraftModel draft(Executor(16));
  std::vector<int32_t> t = {1, 2, 3};
  std::vector<std::vector<int32_t>> drafts;
  const DraftRequest empty{.seq_id = 1, .tokens = {}, .k = 2};
  EXPECT_EQ(draft.Propose({&empty, 1}, &drafts).code(), absl::StatusCode::kInvalidArgument);
  const DraftRequest twice[] = {{.seq_id = 1, .tokens = t, .k = 1}, {.seq_id = 1, .tokens = t, .k = 1}};
  EXPECT_EQ(draft.Propose(twice, &drafts).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::coordinator
