// A Transformer whose token embedding is spilled to disk (read through
// sharding::SpillStore) computes bit-identical logits to the same model with
// the embedding resident: Llama (separate lm_head) and a tied-embedding Qwen3
// (the head stays resident, the lookup goes through the store), in place and
// extracted, with a cache far smaller than the table so rows are read from
// disk during the forward. Logit buffers are poisoned before each forward.
#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/safetensors.h"
#include "sharding/spill_store.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

// Two prefilled sequences, then one decode step each; all logits rows.
std::vector<float> RunSteps(const Transformer& model) {
  KvCacheOptions kv;
  kv.dtype = KvCacheDtype::kFp32;
  auto cache = model.CreateKvCache(kv);
  EXPECT_TRUE(cache.ok()) << cache.status();
  EXPECT_TRUE(cache->AddSequence(0).ok());
  EXPECT_TRUE(cache->AddSequence(1).ok());
  const std::vector<int32_t> a = {1, 17, 999, 17, 500, 3}, b = {998, 0, 42};
  const std::vector<int32_t> a2 = {7}, b2 = {999};
  std::vector<float> all;
  for (const auto& [ta, tb] : {std::pair{&a, &b}, std::pair{&a2, &b2}}) {
    const SequenceTokens batch[] = {{0, *ta}, {1, *tb}};
    std::vector<float> logits(10, std::nanf(""));
    const absl::Status s = model.Forward(batch, LogitsRows::kAllTokens, &*cache, &logits);
    EXPECT_TRUE(s.ok()) << s;
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

struct Case {
  const char* arch;
  bool tied;
  bool extract;
};

class SpillEmbeddingTest : public ::testing::TestWithParam<Case> {};

TEST_P(SpillEmbeddingTest, LogitsAreBitIdenticalToTheResidentEmbedding) {
  const Case c = GetParam();
  testing::ScratchDir dir;
  sharding::TestModelOptions opt;
  opt.arch = c.arch;
  opt.tie_word_embeddings = c.tied;
  opt.vocab_size = 1000;
  opt.hidden_size = 256;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("model"), opt).ok());

  auto resident = Transformer::Load(dir.File("model"));
  ASSERT_TRUE(resident.ok()) << resident.status();
  TransformerLoadOptions options;
  options.spill.spill = {"model.embed_tokens.weight"};
  options.spill.cache_budget_bytes = 64 << 10;  // ~100 of 1000 bf16 rows of 256
  if (c.extract) {
    options.spill.extract = true;
    options.spill.cache_dir = dir.File("spill-cache");
  }
  auto spilled = Transformer::Load(dir.File("model"), options);
  ASSERT_TRUE(spilled.ok()) << spilled.status();

  const std::vector<float> want = RunSteps(**resident);
  const std::vector<float> got = RunSteps(**spilled);
  ASSERT_EQ(want.size(), got.size());
  ASSERT_EQ(want.size(), size_t{(6 + 3 + 1 + 1) * 1000});
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
      << "spilled-embedding logits differ from resident ones";
  bool finite = true;
  for (float v : got) finite = finite && std::isfinite(v);
  EXPECT_TRUE(finite);
}

INSTANTIATE_TEST_SUITE_P(Models, SpillEmbeddingTest,
                         ::testing::Values(Case{"llama", false, false}, Case{"llama", false, true},
                                           Case{"qwen3", true, false}, Case{"qwen3", true, true}),
                         [](const auto& info) {
                           return std::string(info.param.arch) + (info.param.tied ? "_tied" : "") +
                                  (info.param.extract ? "_extracted" : "_in_place");
                         });

// Proof that the spilled model really reads rows from disk: a flipped byte in
// the checkpoint's embedding makes Forward fail with DataLoss (a resident
// embedding would not notice).
TEST(SpillEmbeddingTest, SpilledEmbeddingReadsTheCheckpointAndReportsCorruption) {
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("model"), {}).ok());
  TransformerLoadOptions options;
  options.spill.spill = {"model.embed_tokens.weight"};
  auto model = Transformer::Load(dir.File("model"), options);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string path = dir.File("model/model.safetensors");
  {
    auto file = sharding::SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok());
    const sharding::TensorInfo* info = (*file)->Find("model.embed_tokens.weight");
    ASSERT_NE(info, nullptr);
    const uint64_t offset = (*file)->data_section_offset() + info->begin + 999 * 256 * 2 + 1;
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, offset), 1);
    b ^= 1;
    ASSERT_EQ(::pwrite(fd, &b, 1, offset), 1);
    ::close(fd);
  }
  auto cache = (*model)->CreateKvCache({});
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(cache->AddSequence(0).ok());
  const std::vector<int32_t> tokens = {5, 999};
  const SequenceTokens batch[] = {{0, tokens}};
  std::vector<float> logits;
  const absl::Status s = (*model)->Forward(batch, LogitsRows::kLastToken, &*cache, &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("model.embed_tokens.weight"));
}

TEST(SpillEmbeddingTest, SpillingAnUnknownTensorIsAnError) {
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("model"), {}).ok());
  TransformerLoadOptions options;
  options.spill.spill = {"model.layers.0.mlp.up_proj.weight"};
  EXPECT_EQ(Transformer::Load(dir.File("model"), options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::worker
