// LocalStepExecutor::TruncateSequence: dropping a sequence's last positions
// (a draft model's rollback) leaves it exactly as if they had never been
// fed — the next seeded draw with repetition/presence/frequency penalties
// and its logprob equal those of a sequence that never saw the dropped
// tokens — and bad calls are clear errors.
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

TEST(TruncateSequenceTest, ATruncatedSequenceDrawsAsIfTheDroppedTokensWereNeverFed) {
  testing::ScratchDir dir;
  sharding::TestModelOptions options;
  options.seed = 17;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("m"), options).ok());
  auto model = Transformer::Load(dir.File("m"));
  ASSERT_TRUE(model.ok()) << model.status();
  auto executor = [&] {
    KvCacheOptions kv;
    kv.dtype = KvCacheDtype::kFp32;
    kv.num_pages = 32;
    auto cache = (*model)->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    return std::make_unique<LocalStepExecutor>(model->get(), std::move(*cache));
  };
  SequenceSampling sampling;
  sampling.params.temperature = 1.3f;
  sampling.params.top_k = 50;
  sampling.params.repetition_penalty = 1.4f;
  sampling.params.presence_penalty = 0.7f;
  sampling.params.frequency_penalty = 0.3f;
  sampling.params.logprobs = true;
  sampling.params.seed = 4242;
  const std::vector<int32_t> prompt = {11, 23, 5, 77, 301, 9, 11};
  sampling.prompt_len = static_cast<int64_t>(prompt.size());
  const uint8_t one = 1;
  auto step = [&](LocalStepExecutor& e, std::vector<int32_t> tokens) {
    const SequenceTokens entry{.seq_id = 3, .tokens = tokens};
    std::vector<SampledToken> out;
    EXPECT_TRUE(e.ForwardSampled({&entry, 1}, {&one, 1}, &out).ok());
    return out.at(0);
  };
  // a: the prompt, then its token and two tokens that are later dropped.
  auto a = executor();
  ASSERT_TRUE(a->AddSampledSequence(3, sampling).ok());
  const SampledToken first = step(*a, prompt);
  step(*a, {first.id, 23, 900});  // 23 repeats a prompt token: penalties see it
  const std::vector<int32_t> dropped = {23, 900};
  ASSERT_TRUE(a->TruncateSequence(3, dropped).ok());
  EXPECT_EQ(a->cache().Length(3), static_cast<int64_t>(prompt.size()) + 1);
  // b: never saw them.
  auto b = executor();
  ASSERT_TRUE(b->AddSampledSequence(3, sampling).ok());
  EXPECT_EQ(step(*b, prompt).id, first.id);
  step(*b, {first.id});
  for (int32_t next : {23, 42, 900}) {
    const SampledToken x = step(*a, {next});
    const SampledToken y = step(*b, {next});
    EXPECT_EQ(x.id, y.id) << "after feeding " << next;
    EXPECT_EQ(x.logprob, y.logprob) << "after feeding " << next;
  }
  EXPECT_EQ(a->TruncateSequence(4, dropped).code(), absl::StatusCode::kNotFound);
  const std::vector<int32_t> too_many(100, 1);
  EXPECT_EQ(a->TruncateSequence(3, too_many).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::worker
