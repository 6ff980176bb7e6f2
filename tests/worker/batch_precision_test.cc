// worker::Transformer row plans (linear.h RowKind) at serve's default int8
// decode activations: every batch entry runs at the precision it would get
// alone, so a sequence's logits are bit for bit those of the same sequence
// run alone, whatever shares its steps: 21 decode sequences in one step
// (more rows than kPrefillMinRows), decode-sized prompts batched together,
// and decode rows sharing steps with a prefill chunk of 23 tokens (placed
// mid-batch, so the plan has three runs); for a dense Llama and a Qwen3-MoE
// model (experts get rows of both kinds through their gathered rows), with
// fp32 and bf16 prefill. Before row plans, any step of 17+ rows ran every
// row at the prefill precision, so these comparisons failed.
#include <filesystem>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_gemm.h"
#include "sharding/converter.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/linear.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

using Precision = kernels::TrellisGemmPrecision;

constexpr int kSequences = 21;    // decode entries in one step: > kPrefillMinRows rows
constexpr int kDecodeSteps = 4;   // greedy steps after the prompts
constexpr int64_t kChunk = 23;    // the prefill chunk sharing the decode steps
constexpr int64_t kChunks = 3;

// (model "llama" | "qwen3-moe" | "qwen3.5-moe" (the Gated DeltaNet hybrid
// test shape: each sequence's recurrent state is its own), prefill precision).
class BatchPrecisionTest : public ::testing::TestWithParam<std::tuple<std::string, Precision>> {
 public:
  static void SetUpTestSuite() { dir_ = new exl3serve::testing::ScratchDir(); }
  // The EXL3 model of `arch`, written and converted on first use (ctest runs
  // each test in its own process: only the model it needs).
  static void MakeModel(const std::string& arch) {
    if (std::filesystem::exists(dir_->File(arch) + "/config.json")) return;
    {
      sharding::TestModelOptions options;
      if (arch == "qwen3.5-moe") options = sharding::Qwen3NextTestDefaults(arch);
      options.arch = arch;
      options.seed = 31;
      options.hidden_size = 128;
      options.intermediate_size = 192;  // padded to 256: padded linears
      options.vocab_size = 300;
      const std::string hf = dir_->File(arch + "-hf");
      ASSERT_TRUE(sharding::WriteTestModel(hf, options).ok());
      sharding::ConvertOptions convert;  // mul1 (int8-capable), 4 bpw
      convert.in_dir = hf;
      convert.out_dir = dir_->File(arch);
      convert.bits = 4.0;
      convert.threads = 2;
      convert.show_progress = false;
      auto report = sharding::ConvertModel(convert);
      ASSERT_TRUE(report.ok()) << report.status();
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    MakeModel(std::get<0>(GetParam()));
    auto loaded = Transformer::Load(dir_->File(std::get<0>(GetParam())));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model_ = std::move(*loaded);
    ASSERT_TRUE(SetDecodePrecision(Precision::kInt8).ok());
    ASSERT_TRUE(SetPrefillPrecision(std::get<1>(GetParam())).ok());
  }
  void TearDown() override {
    ASSERT_TRUE(SetDecodePrecision(Precision::kFloat).ok());
    ASSERT_TRUE(SetPrefillPrecision(Precision::kFloat).ok());
  }

 protected:
  PagedKvCache Cache() const {
    KvCacheOptions kv;
    kv.num_pages = 256;
    kv.page_size_tokens = 8;
    auto cache = model_->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return *std::move(cache);
  }
  static int32_t Argmax(const float* row, int64_t vocab) {
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; ++i) best = row[i] > row[best] ? i : best;
    return best;
  }

  static exl3serve::testing::ScratchDir* dir_;
  std::unique_ptr<Transformer> model_;
};
exl3serve::testing::ScratchDir* BatchPrecisionTest::dir_ = nullptr;

TEST_P(BatchPrecisionTest, EveryEntryGetsTheLogitsItGetsAlone) {
  const int64_t vocab = model_->vocab_size();
  std::mt19937 rng(17);
  // Prompts of 1..30 tokens: some decode-kind (< 17), some prefill-kind.
  std::vector<std::vector<int32_t>> prompts(kSequences);
  for (auto& prompt : prompts) {
    prompt.resize(1 + rng() % 30);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  }
  std::vector<int32_t> long_prompt(kChunk * kChunks);
  for (int32_t& t : long_prompt) t = static_cast<int32_t>(rng() % vocab);
  const int64_t long_id = 1000;

  // Alone: each sequence in its own cache, one entry per forward; logits of
  // the prompt's last token and of each greedy step.
  std::vector<std::vector<float>> want(kSequences);
  for (int s = 0; s < kSequences; ++s) {
    PagedKvCache cache = Cache();
    ASSERT_TRUE(cache.AddSequence(s).ok());
    std::vector<int32_t> feed = prompts[s];
    for (int step = 0; step <= kDecodeSteps; ++step) {
      const SequenceTokens entry{s, feed};
      std::vector<float> logits;
      ASSERT_TRUE(model_->Forward({&entry, 1}, LogitsRows::kLastToken, &cache, &logits).ok());
      want[s].insert(want[s].end(), logits.begin(), logits.end());
      feed = {Argmax(logits.data(), vocab)};
    }
  }
  std::vector<float> want_long;  // the chunked prompt alone: every chunk's rows
  {
    PagedKvCache cache = Cache();
    ASSERT_TRUE(cache.AddSequence(long_id).ok());
    for (int64_t c = 0; c < kChunks; ++c) {
      const SequenceTokens entry{long_id, std::span(long_prompt).subspan(c * kChunk, kChunk)};
      std::vector<float> logits;
      ASSERT_TRUE(model_->Forward({&entry, 1}, LogitsRows::kAllTokens, &cache, &logits).ok());
      want_long.insert(want_long.end(), logits.begin(), logits.end());
    }
  }

  // Batched, one cache. Step 0: every decode-kind prompt in one forward
  // (more than kPrefillMinRows rows in all) plus the first prefill-kind
  // one; the other prefill-kind prompts alone (two prefill entries in one
  // call would share an fp32/bf16 call, whose sums depend on its rows).
  // Then kDecodeSteps steps of all kSequences, the first kChunks of which
  // carry a chunk of the long prompt in the middle of the batch.
  PagedKvCache cache = Cache();
  for (int s = 0; s < kSequences; ++s) ASSERT_TRUE(cache.AddSequence(s).ok());
  ASSERT_TRUE(cache.AddSequence(long_id).ok());
  std::vector<std::vector<float>> got(kSequences);
  {
    std::vector<std::vector<SequenceTokens>> forwards(1);
    int64_t decode_rows = 0;
    bool prefill_in_first = false;
    for (int s = 0; s < kSequences; ++s) {
      const bool decode_kind = static_cast<int64_t>(prompts[s].size()) < kPrefillMinRows;
      if (decode_kind) decode_rows += static_cast<int64_t>(prompts[s].size());
      if (decode_kind || !prefill_in_first) {
        prefill_in_first |= !decode_kind;
        forwards[0].push_back({s, prompts[s]});
      } else {
        forwards.push_back({{s, prompts[s]}});
      }
    }
    ASSERT_GE(decode_rows, kPrefillMinRows) << "the test needs a decode-kind batch of 17+ rows";
    ASSERT_TRUE(prefill_in_first);
    for (const auto& batch : forwards) {
      std::vector<float> logits;
      ASSERT_TRUE(model_->Forward(batch, LogitsRows::kLastToken, &cache, &logits).ok());
      for (size_t i = 0; i < batch.size(); ++i) {
        got[batch[i].seq_id].assign(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
      }
    }
  }
  std::vector<float> got_long;
  for (int step = 1; step <= kDecodeSteps; ++step) {
    std::vector<int32_t> next(kSequences);
    std::vector<SequenceTokens> batch;
    std::vector<int64_t> row_of(kSequences);  // sequence -> first logits row
    int64_t rows = 0;
    for (int s = 0; s < kSequences; ++s) {
      next[s] = Argmax(got[s].data() + (got[s].size() - vocab), vocab);
      if (s == kSequences / 2 && step <= kChunks) {
        batch.push_back({long_id, std::span(long_prompt).subspan((step - 1) * kChunk, kChunk)});
        rows += kChunk;
      }
      batch.push_back({s, {&next[s], 1}});
      row_of[s] = rows++;
    }
    std::vector<float> logits;
    ASSERT_TRUE(model_->Forward(batch, LogitsRows::kAllTokens, &cache, &logits).ok());
    ASSERT_EQ(static_cast<int64_t>(logits.size()), rows * vocab);
    for (int s = 0; s < kSequences; ++s) {
      got[s].insert(got[s].end(), logits.begin() + row_of[s] * vocab,
                    logits.begin() + (row_of[s] + 1) * vocab);
    }
    if (step <= kChunks) {
      const int64_t first = row_of[kSequences / 2] - kChunk;
      got_long.insert(got_long.end(), logits.begin() + first * vocab,
                      logits.begin() + (first + kChunk) * vocab);
    }
  }

  for (int s = 0; s < kSequences; ++s) {
    ASSERT_EQ(got[s].size(), want[s].size());
    for (int step = 0; step <= kDecodeSteps; ++step) {
      EXPECT_EQ(0, std::memcmp(got[s].data() + step * vocab, want[s].data() + step * vocab,
                               sizeof(float) * vocab))
          << "sequence " << s << " (prompt of " << prompts[s].size() << ") step " << step;
    }
  }
  ASSERT_EQ(got_long.size(), want_long.size());
  for (int64_t c = 0; c < kChunks; ++c) {
    EXPECT_EQ(0, std::memcmp(got_long.data() + c * kChunk * vocab,
                             want_long.data() + c * kChunk * vocab,
                             sizeof(float) * kChunk * vocab))
        << "prefill chunk " << c;
  }

  // The comparison is not vacuous: at fp32 decode a decode-kind prompt
  // alone gives other logits, so int8 took effect.
  int d = 0;
  while (static_cast<int64_t>(prompts[d].size()) >= kPrefillMinRows) ++d;
  ASSERT_TRUE(SetDecodePrecision(Precision::kFloat).ok());
  PagedKvCache fp32_cache = Cache();
  ASSERT_TRUE(fp32_cache.AddSequence(d).ok());
  const SequenceTokens entry{d, prompts[d]};
  std::vector<float> logits;
  ASSERT_TRUE(model_->Forward({&entry, 1}, LogitsRows::kLastToken, &fp32_cache, &logits).ok());
  EXPECT_NE(0, std::memcmp(logits.data(), want[d].data(), sizeof(float) * vocab));
}

INSTANTIATE_TEST_SUITE_P(
    Models, BatchPrecisionTest,
    ::testing::Combine(::testing::Values("llama", "qwen3-moe", "qwen3.5-moe"),
                       ::testing::Values(Precision::kFloat, Precision::kBf16)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, Precision>>& info) {
      std::string name = std::get<0>(info.param) + "_prefill_" +
                         GemmPrecisionName(std::get<1>(info.param));
      for (char& c : name) c = c == '-' || c == '.' ? '_' : c;
      return name;
    });

}  // namespace
}  // namespace exl3serve::worker
