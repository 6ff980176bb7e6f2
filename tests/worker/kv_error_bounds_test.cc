// The quantized KV cache formats end to end (issue 4: "8-bit and 4-bit KV
// caches stay within stated error bounds"): a 16-token prompt, then 64 greedy
// decode steps, teacher-forced on the fp32-cache run's tokens so every format
// sees the same sequence; per step, the relative L2 error of the logits row
// (over the vocab) against the fp32 cache (kFp32, exact) and against the fp16
// cache (the default), and whether the format's own greedy choice equals the
// fp32 one. The measured figures print as one table (docs/BENCHMARKS.md,
// "KV cache formats"); the bounds below are those figures with headroom.
//
// Two models: the demo model (`make-demo-model --arch qwen3 --no-tokenizer`:
// vocab 151 936, peaked logits, so K/V errors barely move the argmax), and a
// plain random Llama test model (no logit margins: attention errors show
// fully in the logits — the worst case for the bound).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "sharding/test_model.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

constexpr int kPromptTokens = 16;
constexpr int kDecodeSteps = 64;

struct Bounds {
  // Worst step's relative L2 error of the logits against the fp32 cache.
  double int8_max, int4_max, fp16_max;
  // Mean over the steps.
  double int8_mean, int4_mean;
  // Steps whose argmax equals the fp32 run's (out of kDecodeSteps), at least.
  int int8_agree, int4_agree;
};

struct Case {
  std::string name;
  sharding::TestModelOptions model;
  Bounds bounds;
};

// gtest prints the parameter in test listings: its name, not its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

double RelativeL2(const float* got, const float* want, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

int32_t Argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// Logits rows of the prompt's last token and of each fed token: rows[s] is
// the distribution of decode step s. `feed` empty: greedy, and the chosen
// tokens are returned in *chosen; otherwise feed[s] is fed after step s.
std::vector<std::vector<float>> RunSteps(const Transformer& model, KvCacheDtype dtype,
                                    const std::vector<int32_t>& prompt,
                                    const std::vector<int32_t>& feed,
                                    std::vector<int32_t>* chosen) {
  KvCacheOptions options;
  options.dtype = dtype;
  options.num_pages = (kPromptTokens + kDecodeSteps) / options.page_size_tokens + 1;
  auto cache = model.CreateKvCache(options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  EXPECT_TRUE(cache->AddSequence(0).ok());
  const int64_t vocab = model.vocab_size();
  std::vector<std::vector<float>> rows;
  std::vector<int32_t> next = prompt;
  for (int step = 0; step < kDecodeSteps; ++step) {
    std::vector<float> logits(vocab, std::nanf(""));  // poisoned
    const SequenceTokens entry{0, next};
    const absl::Status status = model.Forward({&entry, 1}, LogitsRows::kLastToken, &*cache, &logits);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) break;
    const int32_t token = feed.empty() ? Argmax(logits.data(), vocab) : feed[step];
    if (chosen != nullptr) chosen->push_back(token);
    rows.push_back(std::move(logits));
    next = {token};
  }
  return rows;
}

class KvErrorBoundsTest : public ::testing::TestWithParam<Case> {};

TEST_P(KvErrorBoundsTest, QuantizedCachesStayWithinTheStatedBoundsOver64DecodeSteps) {
  const Case& c = GetParam();
  const std::string dir = ::testing::TempDir() + "/kv_error_bounds_" + c.name + "_" +
                          std::to_string(::getpid());
  ASSERT_TRUE(sharding::WriteTestModel(dir, c.model).ok());
  auto model = Transformer::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->vocab_size();

  std::mt19937 rng(1234);
  std::vector<int32_t> prompt(kPromptTokens);
  for (int32_t& id : prompt) id = static_cast<int32_t>(rng() % vocab);

  std::vector<int32_t> tokens;  // the fp32 run's greedy choices
  const auto fp32 = RunSteps(**model, KvCacheDtype::kFp32, prompt, {}, &tokens);
  ASSERT_EQ(fp32.size(), static_cast<size_t>(kDecodeSteps));
  struct Measured {
    double max_vs32 = 0, mean_vs32 = 0, max_vs16 = 0, mean_vs16 = 0;
    int agree = 0;
  };
  const auto fp16 = RunSteps(**model, KvCacheDtype::kFp16, prompt, tokens, nullptr);
  auto measure = [&](KvCacheDtype dtype) {
    const auto rows = dtype == KvCacheDtype::kFp16 ? fp16 : RunSteps(**model, dtype, prompt, tokens, nullptr);
    Measured m;
    for (int s = 0; s < kDecodeSteps; ++s) {
      for (float x : rows[s]) EXPECT_TRUE(std::isfinite(x)) << "step " << s;
      const double e32 = RelativeL2(rows[s].data(), fp32[s].data(), vocab);
      const double e16 = RelativeL2(rows[s].data(), fp16[s].data(), vocab);
      m.max_vs32 = std::max(m.max_vs32, e32);
      m.max_vs16 = std::max(m.max_vs16, e16);
      m.mean_vs32 += e32 / kDecodeSteps;
      m.mean_vs16 += e16 / kDecodeSteps;
      m.agree += Argmax(rows[s].data(), vocab) == tokens[s];
    }
    return m;
  };
  const Measured m16 = measure(KvCacheDtype::kFp16);
  const Measured m8 = measure(KvCacheDtype::kInt8);
  const Measured m4 = measure(KvCacheDtype::kInt4);
  std::printf("%s: logits relative L2 over %d decode steps (max / mean), greedy agreement\n",
              c.name.c_str(), kDecodeSteps);
  std::printf("  %-5s vs fp32 %.2e / %.2e   vs fp16 %.2e / %.2e   argmax = fp32's %d/%d\n",
              "fp16", m16.max_vs32, m16.mean_vs32, 0.0, 0.0, m16.agree, kDecodeSteps);
  std::printf("  %-5s vs fp32 %.2e / %.2e   vs fp16 %.2e / %.2e   argmax = fp32's %d/%d\n",
              "int8", m8.max_vs32, m8.mean_vs32, m8.max_vs16, m8.mean_vs16, m8.agree, kDecodeSteps);
  std::printf("  %-5s vs fp32 %.2e / %.2e   vs fp16 %.2e / %.2e   argmax = fp32's %d/%d\n",
              "int4", m4.max_vs32, m4.mean_vs32, m4.max_vs16, m4.mean_vs16, m4.agree, kDecodeSteps);

  const Bounds& b = c.bounds;
  EXPECT_LT(m16.max_vs32, b.fp16_max);
  EXPECT_LT(m8.max_vs32, b.int8_max);
  EXPECT_LT(m4.max_vs32, b.int4_max);
  EXPECT_LT(m8.mean_vs32, b.int8_mean);
  EXPECT_LT(m4.mean_vs32, b.int4_mean);
  EXPECT_GE(m8.agree, b.int8_agree);
  EXPECT_GE(m4.agree, b.int4_agree);
  // Coarser storage, larger error: the formats are ordered.
  EXPECT_LT(m16.mean_vs32, m8.mean_vs32);
  EXPECT_LT(m8.mean_vs32, m4.mean_vs32);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  {
    Case c;
    c.name = "demo_qwen3";
    c.model = *sharding::DemoModelDefaults("qwen3");  // without the tokenizer files
    // Measured (2026-11-29): max 7.7e-4 / 1.2e-2 / 1.7e-5 (int8 / int4 / fp16),
    // mean 2.7e-4 / 5.1e-3, greedy 64/64 for both.
    c.bounds = {.int8_max = 3e-3, .int4_max = 5e-2, .fp16_max = 1e-4, .int8_mean = 1e-3,
                .int4_mean = 2e-2, .int8_agree = 64, .int4_agree = 60};
    cases.push_back(c);
  }
  {
    Case c;
    c.name = "random_llama";
    c.model.arch = "llama";  // no logit margins: the sensitive case
    // Measured: max 6.2e-2 / 1.04 / 2.3e-3, mean 3.0e-2 / 0.48, greedy 61/64 and
    // 28/64: int4 K/V (steps of 1/14 of a head's range) is noise to a model
    // without margins; int8 stays within a few percent.
    c.bounds = {.int8_max = 0.15, .int4_max = 2.0, .fp16_max = 1e-2, .int8_mean = 0.06,
                .int4_mean = 1.0, .int8_agree = 56, .int4_agree = 16};
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, KvErrorBoundsTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace exl3serve::worker
