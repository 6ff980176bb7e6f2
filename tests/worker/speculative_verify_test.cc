// worker::RunVerifiedForward, speculative verification on a rank: for a
// random (not peaked) test model, plain bf16 and EXL3 4 bpw, greedy and seeded sampling with penalties,
// drafts that are partly right and partly wrong (random lengths 0..5,
// random cut points), alone and in a batch with other drafting sequences,
// decoding sequences and a prefill chunk, every run of tokens equals what
// one-token-at-a-time decoding of the same sequence draws; the KV length
// after each step is exactly the accepted positions, and a later step
// overwrites the rejected ones. The same for a Gated DeltaNet hybrid
// (qwen3.5-moe test model, bf16 and EXL3 at int8 decode), whose recurrent
// state cannot be shortened: each rejection rolls it back to the state kept
// after the last accepted token (PagedKvCache::RollbackWithState). Also the
// argument checks.
#include <algorithm>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/converter.h"
#include "sharding/test_model.h"
#include "worker/model/linear.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

// The model by name: "bf16" (the plain checkpoint), "exl3" (converted at
// 4 bpw; EXL3 linears at the library's default fp32 activations) or
// "exl3-int8" (the same with int8 decode activations, serve's default);
// "hybrid-bf16" / "hybrid-exl3-int8": the qwen3.5-moe test model likewise.
class SpeculativeVerifyTest : public ::testing::TestWithParam<std::string> {
 public:
  static void SetUpTestSuite() { dir_ = new exl3serve::testing::ScratchDir(); }
  // The model of GetParam(), written (and converted) on first use: ctest
  // runs each test in its own process, so only the model it needs.
  static void MakeModel(const std::string& param) {
    const bool hybrid = param.rfind("hybrid", 0) == 0;
    const std::string bf16 = hybrid ? "hybrid-bf16" : "bf16";
    const std::string exl3 = hybrid ? "hybrid-exl3" : "exl3";
    if (!std::filesystem::exists(dir_->File(bf16) + "/config.json")) {
      sharding::TestModelOptions options;  // llama, vocab 1000: random weights
      options.seed = 5;
      options.hidden_size = 128;
      options.intermediate_size = 192;
      if (hybrid) {
        options = sharding::Qwen3NextTestDefaults("qwen3.5-moe");
        options.seed = 5;
      }
      ASSERT_TRUE(sharding::WriteTestModel(dir_->File(bf16), options).ok());
    }
    if (param.find("exl3") != std::string::npos &&
        !std::filesystem::exists(dir_->File(exl3) + "/config.json")) {
      sharding::ConvertOptions convert;
      convert.in_dir = dir_->File(bf16);
      convert.out_dir = dir_->File(exl3);
      convert.bits = 4.0;
      convert.threads = 2;
      convert.show_progress = false;
      ASSERT_TRUE(sharding::ConvertModel(convert).ok());
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    const std::string& p = GetParam();
    MakeModel(p);
    auto loaded = Transformer::Load(dir_->File(p == "exl3-int8"          ? "exl3"
                                               : p == "hybrid-exl3-int8" ? "hybrid-exl3"
                                                                         : p));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    owned_ = std::move(*loaded);
    model_ = owned_.get();
    if (int8()) {
      ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
    }
  }
  void TearDown() override {
    if (int8()) {
      ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
    }
  }
  // int8 decode activations: the int8 kernels have no row crossover and
  // Transformer runs each entry at the precision it gets alone (linear.h
  // RowKind), so verify steps of any size are exact: that variant batches 4
  // drafting sequences (up to 24 rows a step) next to a prefill chunk of 19
  // tokens (prefill-kind, fp32). Its prompts stay decode-kind (< 17 tokens)
  // so that the first step's prompts share one int8 call instead of several
  // prefill-kind prompts sharing an fp32 one (fp32 sums depend on a call's
  // row count: close, not bit-equal, to the serial run's).
  bool int8() const {
    return GetParam() == "exl3-int8" || GetParam() == "hybrid-exl3-int8";
  }

 protected:
  struct Seq {
    int64_t id = 0;
    std::vector<int32_t> tokens;  // prompt + drawn so far
    std::vector<int32_t> want;    // the serial output
    size_t out = 0;               // how much of want is drawn
    int64_t prompt_len = 0;
  };

  static PagedKvCache Cache() {
    KvCacheOptions kv;
    kv.dtype = KvCacheDtype::kFp32;
    kv.num_pages = 256;
    kv.page_size_tokens = 8;
    auto cache = model_->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return *std::move(cache);
  }

  static SequenceSampling Sampling(int kind, int64_t prompt_len, uint64_t seed) {
    SequenceSampling s;
    s.prompt_len = prompt_len;
    s.params.seed = seed;
    if (kind == 0) {
      s.params.temperature = 0.0f;
    } else {
      s.params.temperature = 1.0f;
      s.params.top_k = kind == 1 ? 0 : 40;
      s.params.repetition_penalty = 1.15f;
      s.params.presence_penalty = 0.4f;
      s.params.frequency_penalty = 0.2f;
    }
    return s;
  }

  // One token at a time: prompt, then `n` single-token steps.
  static std::vector<int32_t> Serial(const std::vector<int32_t>& prompt, int kind, uint64_t seed,
                                     int n) {
    PagedKvCache cache = Cache();
    VocabSampler sampler = MakeVocabSampler(*model_);
    EXPECT_TRUE(cache.AddSequence(1).ok());
    EXPECT_TRUE(sampler.AddSequence(1, Sampling(kind, prompt.size(), seed)).ok());
    std::vector<int32_t> out;
    std::vector<float> slice;
    std::vector<int32_t> feed = prompt;
    for (int i = 0; i < n; ++i) {
      const SequenceTokens entry{1, feed};
      const uint8_t one = 1;
      std::vector<SampledToken> tokens;
      EXPECT_TRUE(RunSampledForward(*model_, &cache, &sampler, {&entry, 1}, {&one, 1}, &slice,
                                    &tokens)
                      .ok());
      out.push_back(tokens[0].id);
      feed = {tokens[0].id};
    }
    return out;
  }

  static exl3serve::testing::ScratchDir* dir_;
  static inline Transformer* model_ = nullptr;  // the current test's
  std::unique_ptr<Transformer> owned_;
};

exl3serve::testing::ScratchDir* SpeculativeVerifyTest::dir_ = nullptr;

TEST_P(SpeculativeVerifyTest, DraftedRunsEqualSerialDecodingAloneAndInABatch) {
  constexpr int kTokens = 40;
  std::mt19937 rng(11);
  for (int batch_size : int8() ? std::vector<int>{1, 4} : std::vector<int>{1, 3}) {
    for (int kind = 0; kind < 3; ++kind) {
      SCOPED_TRACE(::testing::Message() << "batch " << batch_size << " sampling kind " << kind);
      PagedKvCache cache = Cache();
      VocabSampler sampler = MakeVocabSampler(*model_);
      std::vector<Seq> seqs(static_cast<size_t>(batch_size));
      for (int b = 0; b < batch_size; ++b) {
        Seq& s = seqs[b];
        s.id = 10 + b;
        const int len = 3 + static_cast<int>(rng() % (int8() ? 8 : 17));
        for (int j = 0; j < len; ++j) s.tokens.push_back(static_cast<int32_t>(rng() % 1000));
        s.prompt_len = len;
        s.want = Serial(s.tokens, kind, 100 + b, kTokens);
        ASSERT_TRUE(cache.AddSequence(s.id).ok());
        ASSERT_TRUE(sampler.AddSequence(s.id, Sampling(kind, len, 100 + b)).ok());
      }
      // A sequence being prefilled in the same steps (chunks of 5, or of 19
      // for int8: prefill-kind; never sampled).
      const size_t chunk = int8() ? 19 : 5;
      std::vector<int32_t> long_prompt(chunk * (int8() ? 4 : 12));
      for (int32_t& t : long_prompt) t = static_cast<int32_t>(rng() % 1000);
      ASSERT_TRUE(cache.AddSequence(99).ok());
      size_t prefilled = 0;
      bool first = true;
      int64_t accepted_drafts = 0, drafted = 0;
      int64_t most_drafting_rows = 0;  // the largest step's rows of drafting entries
      while (true) {
        bool all_done = true;
        for (const Seq& s : seqs) all_done &= s.out >= s.want.size();
        if (all_done) break;
        // Feeds and drafts for this step; each draft's storage lives in `feeds`.
        std::vector<std::vector<int32_t>> feeds;
        std::vector<int32_t> drafts;
        std::vector<Seq*> in_batch;
        for (Seq& s : seqs) {
          if (s.out >= s.want.size()) continue;
          std::vector<int32_t> feed;
          if (first) {
            feed = s.tokens;  // the prompt: no draft before the first token
            drafts.push_back(0);
          } else {
            feed = {s.tokens.back()};
            // Up to 5 draft tokens: the right ones up to a random cut, then wrong ones.
            const int k = static_cast<int>(rng() % 6);
            const int right = static_cast<int>(rng() % (k + 1));
            for (int j = 0; j < k; ++j) {
              const size_t at = s.out + static_cast<size_t>(j);
              const int32_t truth = at < s.want.size() ? s.want[at] : 0;
              feed.push_back(j < right ? truth : (truth + 1 + static_cast<int32_t>(rng() % 998)) % 1000);
            }
            drafts.push_back(k);
          }
          feeds.push_back(std::move(feed));
          in_batch.push_back(&s);
        }
        std::vector<SequenceTokens> batch;
        std::vector<uint8_t> sample;
        for (size_t i = 0; i < feeds.size(); ++i) {
          batch.push_back({in_batch[i]->id, feeds[i]});
          sample.push_back(1);
        }
        int64_t drafting_rows = 0;
        for (const SequenceTokens& entry : batch) drafting_rows += entry.tokens.size();
        most_drafting_rows = std::max(most_drafting_rows, drafting_rows);
        if (prefilled < long_prompt.size()) {
          batch.push_back({99, std::span<const int32_t>(long_prompt).subspan(prefilled, chunk)});
          sample.push_back(0);
          drafts.push_back(0);
          prefilled += chunk;
        }
        std::vector<float> slice;
        std::vector<std::vector<SampledToken>> runs;
        ASSERT_TRUE(RunVerifiedForward(*model_, &cache, &sampler, batch, sample, drafts, &slice,
                                       &runs)
                        .ok());
        for (size_t i = 0; i < in_batch.size(); ++i) {
          Seq& s = *in_batch[i];
          ASSERT_GE(runs[i].size(), 1u);
          ASSERT_LE(runs[i].size(), static_cast<size_t>(drafts[i]) + 1);
          drafted += drafts[i];
          accepted_drafts += static_cast<int64_t>(runs[i].size()) - 1;
          for (const SampledToken& t : runs[i]) {
            if (s.out >= s.want.size()) break;  // past the serial run's end
            ASSERT_EQ(t.id, s.want[s.out]) << "sequence " << s.id << " token " << s.out;
            s.tokens.push_back(t.id);
            ++s.out;
          }
          // Exactly the fed, accepted positions are in the cache (the last
          // drawn token is fed next step).
          if (s.out < s.want.size()) {
            ASSERT_EQ(cache.Length(s.id), static_cast<int64_t>(s.tokens.size()) - 1);
          }
        }
        first = false;
        if (prefilled >= long_prompt.size() &&
            cache.Length(99) != static_cast<int64_t>(long_prompt.size())) {
          FAIL() << "the prefill sequence's length is " << cache.Length(99);
        }
      }
      if (batch_size > 1) {  // steps past the old 17-row precision switch
        EXPECT_GE(most_drafting_rows, kPrefillMinRows);
      }
      EXPECT_GT(accepted_drafts, 0);
      EXPECT_LT(accepted_drafts, drafted);  // some drafts were rejected
    }
  }
}

TEST_P(SpeculativeVerifyTest, BadDraftCountsAreRefused) {
  PagedKvCache cache = Cache();
  VocabSampler sampler = MakeVocabSampler(*model_);
  ASSERT_TRUE(cache.AddSequence(1).ok());
  ASSERT_TRUE(sampler.AddSequence(1, Sampling(0, 2, 1)).ok());
  const std::vector<int32_t> feed = {5, 6, 7};
  const SequenceTokens entry{1, feed};
  std::vector<float> slice;
  std::vector<std::vector<SampledToken>> runs;
  const uint8_t yes = 1, no = 0;
  for (int32_t d : {-1, 3, 4}) {
    EXPECT_EQ(RunVerifiedForward(*model_, &cache, &sampler, {&entry, 1}, {&yes, 1}, {&d, 1},
                                 &slice, &runs)
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << d;
  }
  const int32_t two = 2;
  EXPECT_EQ(RunVerifiedForward(*model_, &cache, &sampler, {&entry, 1}, {&no, 1}, {&two, 1}, &slice,
                               &runs)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Length(1), 0);  // nothing ran
}

// The chosen logits rows are exactly the matching rows of an all-token
// forward of the same batch on the same cache state.
TEST_P(SpeculativeVerifyTest, LastRowsPerEntryAreTheMatchingAllTokenRows) {
  const std::vector<std::vector<int32_t>> tokens = {{5, 6, 7, 8, 9}, {10, 11}, {12, 13, 14}};
  const std::vector<int32_t> last_rows = {3, 0, 1};
  std::vector<float> all, chosen;
  for (int pass = 0; pass < 2; ++pass) {
    PagedKvCache cache = Cache();
    std::vector<SequenceTokens> batch;
    for (size_t i = 0; i < tokens.size(); ++i) {
      ASSERT_TRUE(cache.AddSequence(static_cast<int64_t>(i)).ok());
      batch.push_back({static_cast<int64_t>(i), tokens[i]});
    }
    if (pass == 0) {
      ASSERT_TRUE(model_->ForwardVocabSlice(batch, LogitsRows::kAllTokens, &cache, &all).ok());
    } else {
      ASSERT_TRUE(model_->ForwardVocabSliceLastRows(batch, last_rows, &cache, &chosen).ok());
      const std::vector<int32_t> too_many = {6, 0, 0}, short_list = {1, 1};
      EXPECT_EQ(model_->ForwardVocabSliceLastRows(batch, too_many, &cache, &chosen).code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(model_->ForwardVocabSliceLastRows(batch, short_list, &cache, &chosen).code(),
                absl::StatusCode::kInvalidArgument);
    }
  }
  const int64_t width = model_->vocab_slice().second - model_->vocab_slice().first;
  // All-token rows 2,3,4 (entry 0's last three) and 9 (entry 2's last).
  std::vector<float> want;
  for (int64_t r : {2, 3, 4, 9}) want.insert(want.end(), all.begin() + r * width, all.begin() + (r + 1) * width);
  ASSERT_EQ(chosen.size(), want.size());
  EXPECT_EQ(chosen, want);
}

// The seam: LocalStepExecutor::ForwardVerified is RunVerifiedForward on its
// own cache and sampler (what the engine will call); an executor that cannot
// verify says Unimplemented.
TEST_P(SpeculativeVerifyTest, TheInProcessExecutorVerifiesThroughTheSeam) {
  const std::vector<int32_t> prompt = {3, 141, 59, 265, 358, 979};
  const std::vector<int32_t> want = Serial(prompt, 2, 42, 12);
  LocalStepExecutor executor(model_, Cache());
  ASSERT_TRUE(executor.AddSampledSequence(5, Sampling(2, prompt.size(), 42)).ok());
  std::vector<int32_t> got;
  std::vector<int32_t> feed = prompt;
  int32_t drafts = 0;
  while (got.size() < want.size()) {
    const SequenceTokens entry{5, feed};
    const uint8_t one = 1;
    std::vector<std::vector<SampledToken>> runs;
    ASSERT_TRUE(executor.ForwardVerified({&entry, 1}, {&one, 1}, {&drafts, 1}, &runs).ok());
    for (const SampledToken& t : runs[0]) got.push_back(t.id);
    // Next: the last token and a draft of the next three serial tokens, the
    // third one wrong (two accepted, then the target's own token).
    feed = {got.back()};
    drafts = 0;
    for (size_t j = got.size(); j < want.size() && j < got.size() + 3; ++j, ++drafts) {
      feed.push_back(drafts == 2 ? (want[j] + 1) % 1000 : want[j]);
    }
  }
  got.resize(want.size());
  EXPECT_EQ(got, want);

  struct NoDrafts final : StepExecutor {
    int64_t vocab_size() const override { return 1; }
    absl::Status AddSequence(int64_t) override { return absl::OkStatus(); }
    absl::Status RemoveSequence(int64_t) override { return absl::OkStatus(); }
    absl::Status Forward(std::span<const SequenceTokens>, LogitsRows, std::vector<float>*) override {
      return absl::OkStatus();
    }
  } none;
  std::vector<std::vector<SampledToken>> runs;
  EXPECT_EQ(none.ForwardVerified({}, {}, {}, &runs).code(), absl::StatusCode::kUnimplemented);
}

INSTANTIATE_TEST_SUITE_P(Models, SpeculativeVerifyTest,
                         ::testing::Values("bf16", "exl3", "exl3-int8", "hybrid-bf16",
                                           "hybrid-exl3-int8"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace exl3serve::worker
