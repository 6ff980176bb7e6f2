// sharding::WriteDemoModel and DemoTargetTokens on a synthetic byte-level
// tokenizer (no network: the real Qwen3 files are checked end to end by
// tests/cli/demo_model_test.sh): which tokens become peaked targets, the
// files copied, the errors, and that the weights really are peaked — in
// float64, straight from the written safetensors, every token's embedding
// picks exactly one target as its successor through lm_head, with a large
// margin, and the successor map over the targets is a permutation.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "sharding/safetensors_json.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding {
namespace {

const std::string kSpace = "\xC4\xA0";  // byte-level "Ġ"

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A tokenizer.json with `words` lowercase word tokens at odd random ids, plus
// decoys (too short, upper case, no space marker, too long) and one added token.
struct FakeTokenizer {
  std::vector<int32_t> word_ids;  // sorted
  int64_t max_id = 0;
};

FakeTokenizer WriteFakeTokenizer(const std::string& dir, int words, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(vocab - 1);
  for (int64_t i = 0; i < vocab - 1; ++i) ids[i] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  nlohmann::json vocab_json = nlohmann::json::object();
  FakeTokenizer fake;
  size_t next = 0;
  for (int w = 0; w < words; ++w) {
    std::string word;
    for (int c = 0; c < 3 + w % 8; ++c) word += static_cast<char>('a' + rng() % 26);
    word += static_cast<char>('a' + w % 26);  // 4..11 letters; > 10 are decoys
    const int32_t id = ids[next++];
    vocab_json[kSpace + word] = id;
    if (word.size() <= 10) fake.word_ids.push_back(id);
  }
  vocab_json[kSpace + "ab"] = ids[next++];           // too short
  vocab_json[kSpace + "Hello"] = ids[next++];        // upper case
  vocab_json["hello"] = ids[next++];                 // no space marker
  vocab_json[kSpace + "caf\xC3\xA9"] = ids[next++];  // not ASCII
  std::sort(fake.word_ids.begin(), fake.word_ids.end());
  // Duplicate words may have collapsed in the JSON object: keep what it holds.
  std::set<int32_t> present;
  for (const auto& [k, v] : vocab_json.items()) present.insert(v.get<int32_t>());
  std::erase_if(fake.word_ids, [&](int32_t id) { return !present.contains(id); });
  fake.max_id = vocab - 1;
  nlohmann::json tok = {
      {"model", {{"type", "BPE"}, {"vocab", vocab_json}, {"merges", nlohmann::json::array()}}},
      {"added_tokens", {{{"id", vocab - 1}, {"content", "<|end|>"}, {"special", true}}}}};
  EXPECT_TRUE(WriteFileAtomically(dir + "/tokenizer.json", tok.dump()).ok());
  EXPECT_TRUE(WriteFileAtomically(dir + "/tokenizer_config.json", "{\"eos_token\": \"<|end|>\"}").ok());
  return fake;
}

TEST(DemoModelTest, TargetsAreThePlainLowercaseWordTokens) {
  testing::ScratchDir dir;
  const FakeTokenizer fake = WriteFakeTokenizer(dir.path(), 300, 2000, 11);
  int64_t max_id = -1;
  auto targets = DemoTargetTokens(dir.File("tokenizer.json"), &max_id);
  ASSERT_TRUE(targets.ok()) << targets.status();
  EXPECT_EQ(*targets, fake.word_ids);
  EXPECT_EQ(max_id, fake.max_id);
}

TEST(DemoModelTest, WritesPeakedWeightsAndCopiesTheTokenizerFiles) {
  testing::ScratchDir tok, out;
  const int64_t vocab = 1999;  // odd on purpose
  const FakeTokenizer fake = WriteFakeTokenizer(tok.path(), 400, vocab, 5);
  auto options = DemoModelDefaults("qwen3");
  ASSERT_TRUE(options.ok());
  options->vocab_size = vocab;
  options->hidden_size = 192;
  options->num_attention_heads = 3;
  options->num_key_value_heads = 1;
  options->intermediate_size = 200;
  ASSERT_TRUE(WriteDemoModel(out.path(), *options, tok.path()).ok());
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(ReadFile(out.File(f)), ReadFile(tok.File(f))) << f;
  }
  const nlohmann::json config = nlohmann::json::parse(ReadFile(out.File("config.json")));
  EXPECT_EQ(config["vocab_size"], vocab);
  EXPECT_EQ(config["eos_token_id"], 151645);
  EXPECT_EQ(nlohmann::json::parse(ReadFile(out.File("generation_config.json")))["eos_token_id"],
            nlohmann::json::array({151645, 151643}));

  auto model = Exl3Model::Open(out.path());
  ASSERT_TRUE(model.ok()) << model.status();
  auto embed = (*model)->LoadTensorAsFloat("model.embed_tokens.weight");
  auto head = (*model)->LoadTensorAsFloat("lm_head.weight");
  ASSERT_TRUE(embed.ok() && head.ok());
  const int64_t h = options->hidden_size;
  const std::set<int32_t> targets(fake.word_ids.begin(), fake.word_ids.end());
  // For each token: float64 logits lm_head · embed[t] (the residual stream
  // of the peaked model is dominated by the embedding); the argmax must be a
  // target, clear of the runner-up by a large margin.
  std::vector<int> successor_of_target(vocab, -1);
  double worst_margin = 1e9;
  for (int64_t t = 0; t < vocab; ++t) {
    double best = -1e300, second = -1e300;
    int64_t arg = -1;
    for (int64_t v = 0; v < vocab; ++v) {
      double dot = 0;
      for (int64_t i = 0; i < h; ++i) dot += double((*head)[v * h + i]) * (*embed)[t * h + i];
      if (dot > best) {
        second = best;
        best = dot;
        arg = v;
      } else if (dot > second) {
        second = dot;
      }
    }
    ASSERT_TRUE(targets.contains(static_cast<int32_t>(arg))) << "token " << t << " -> " << arg;
    worst_margin = std::min(worst_margin, (best - second) / best);
    if (targets.contains(static_cast<int32_t>(t))) successor_of_target[t] = static_cast<int>(arg);
  }
  std::printf("worst relative margin top1-top2 over %lld tokens: %.3f\n",
              static_cast<long long>(vocab), worst_margin);
  EXPECT_GT(worst_margin, 0.3);
  // Over the targets the successor map is a permutation (no two targets
  // share a successor), so greedy text never collapses onto a short loop
  // unless the permutation's cycle is short.
  std::set<int> successors;
  for (int32_t t : fake.word_ids) successors.insert(successor_of_target[t]);
  EXPECT_EQ(successors.size(), fake.word_ids.size());
}

TEST(DemoModelTest, ErrorsNameTheWayOut) {
  testing::ScratchDir tok, out;
  auto options = DemoModelDefaults("llama");
  ASSERT_TRUE(options.ok());
  absl::Status missing = WriteDemoModel(out.File("m"), *options, tok.File("nope"));
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(missing.message().find("fetch-demo-tokenizer.sh"), std::string::npos) << missing;
  EXPECT_NE(missing.message().find("--no-tokenizer"), std::string::npos) << missing;

  WriteFakeTokenizer(tok.path(), 50, 500, 3);  // ids up to 499
  options->vocab_size = 400;
  options->hidden_size = 64;
  absl::Status small = WriteDemoModel(out.File("m"), *options, tok.path());
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument) << small;

  ASSERT_TRUE(WriteFileAtomically(tok.File("tokenizer.json"), "{\"model\": 3}").ok());
  EXPECT_EQ(DemoTargetTokens(tok.File("tokenizer.json")).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(DemoModelDefaults("mixtral").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace exl3serve::sharding
