// worker/model/linear.h SetPrefillPrecision: an EXL3 linear runs kBf16 for
// m >= kPrefillMinRows and stays exact fp32 below; kInt8 is rejected.
// SetDecodePrecision(kInt8): mul1 linears with m < kPrefillMinRows run int8
// activations (close to exact, at linear and model level, greedy tokens of a
// peaked-logits model unchanged); 3inst / mcg linears fall back to fp32 bit
// for bit; kBf16 is rejected. Row plans: each run of a Forward's rows at
// its kind's precision, bit for bit the kernel on that run alone.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_gemm.h"
#include "sharding/converter.h"
#include "sharding/exl3_model.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/generator.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"
#include "worker/model/linear.h"

namespace exl3serve::worker {
namespace {

// Bound on the relative L2 error of a model's logits under int8 decode
// against fp32 (Int8DecodeLogitsCloseToExactOnMul1Model).
constexpr double kInt8DecodeLogitsBound = 6e-2;

// A 4-bit EXL3 conversion of a 1-layer test model (down_proj: 192 -> 128,
// padded to k = 256, so Forward also exercises the zero-padded input).
class LinearPrefillTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string pattern = ::testing::TempDir() + "/exl3_linear_prefill_XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    root_ = new std::string(::mkdtemp(buf.data()));
    sharding::TestModelOptions model;
    model.num_layers = 1;
    model.hidden_size = 128;
    model.intermediate_size = 192;
    model.vocab_size = 300;
    ASSERT_TRUE(sharding::WriteTestModel(*root_ + "/hf", model).ok());
    sharding::ConvertOptions options;
    options.in_dir = *root_ + "/hf";
    options.out_dir = *root_ + "/exl3";
    options.bits = 4.0;
    options.threads = 2;
    options.show_progress = false;
    auto report = sharding::ConvertModel(options);
    ASSERT_TRUE(report.ok()) << report.status();
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*root_, ec);
    delete root_;
  }
  void TearDown() override {
    ASSERT_TRUE(SetPrefillPrecision(kernels::TrellisGemmPrecision::kFloat).ok());
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
  }
  static std::string* root_;
};
std::string* LinearPrefillTest::root_ = nullptr;

std::vector<float> Forward(const Linear& linear, const std::vector<float>& x, int64_t m) {
  std::vector<float> y(static_cast<size_t>(m * linear.out_features()),
                       std::numeric_limits<float>::quiet_NaN());
  const absl::Status s = linear.Forward(x.data(), m, y.data());
  EXPECT_TRUE(s.ok()) << s;
  return y;
}

TEST_F(LinearPrefillTest, Bf16PrefillIsCloseAndDecodeStaysExact) {
  auto model = sharding::Exl3Model::Open(*root_ + "/exl3");
  ASSERT_TRUE(model.ok()) << model.status();
  auto linear = Linear::Load(**model, "model.layers.0.mlp.down_proj", 192, 128);
  ASSERT_TRUE(linear.ok()) << linear.status();
  ASSERT_TRUE(linear->quantized());
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int64_t m : {int64_t{5}, kPrefillMinRows - 1, kPrefillMinRows, int64_t{45}}) {
    std::vector<float> x(static_cast<size_t>(m * 192));
    for (float& v : x) v = g(rng);
    ASSERT_TRUE(SetPrefillPrecision(kernels::TrellisGemmPrecision::kFloat).ok());
    const std::vector<float> exact = Forward(*linear, x, m);
    ASSERT_TRUE(SetPrefillPrecision(kernels::TrellisGemmPrecision::kBf16).ok());
    const std::vector<float> got = Forward(*linear, x, m);
    double err2 = 0, norm2 = 0;
    bool identical = true;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "m=" << m << " index " << i;
      const double e = double(got[i]) - exact[i];
      err2 += e * e;
      norm2 += double(exact[i]) * exact[i];
      identical = identical && got[i] == exact[i];
    }
    if (m < kPrefillMinRows) {
      EXPECT_TRUE(identical) << "m=" << m << ": decode-sized calls must stay fp32";
    } else {
      EXPECT_FALSE(identical) << "m=" << m << ": bf16 prefill did not take effect";
      // bf16 rounding of both factors: ~0.3 % of the output RMS (trellis_gemm.h).
      EXPECT_LE(std::sqrt(err2 / norm2), 1e-2) << "m=" << m;
    }
  }
}

TEST_F(LinearPrefillTest, RejectsInt8) {
  EXPECT_EQ(SetPrefillPrecision(kernels::TrellisGemmPrecision::kInt8).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrefillPrecision(), kernels::TrellisGemmPrecision::kFloat);
}

// Relative L2 error of `got` against `exact` (float64 sums).
double RelativeL2(const std::vector<float>& got, const std::vector<float>& exact) {
  double err2 = 0, norm2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = double(got[i]) - exact[i];
    err2 += e * e;
    norm2 += double(exact[i]) * exact[i];
  }
  return std::sqrt(err2 / std::max(norm2, 1e-300));
}

TEST_F(LinearPrefillTest, Int8DecodeIsCloseAndPrefillStaysExact) {
  auto model = sharding::Exl3Model::Open(*root_ + "/exl3");
  ASSERT_TRUE(model.ok()) << model.status();
  auto linear = Linear::Load(**model, "model.layers.0.mlp.down_proj", 192, 128);
  ASSERT_TRUE(linear.ok()) << linear.status();
  std::mt19937 rng(9);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int64_t m : {int64_t{1}, int64_t{3}, kPrefillMinRows - 1, kPrefillMinRows, int64_t{31}}) {
    std::vector<float> x(static_cast<size_t>(m * 192));
    for (float& v : x) v = g(rng);
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
    const std::vector<float> exact = Forward(*linear, x, m);
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
    const std::vector<float> got = Forward(*linear, x, m);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "m=" << m << " index " << i;
    }
    if (m >= kPrefillMinRows) {
      EXPECT_EQ(got, exact) << "m=" << m << ": prefill-sized calls must not use the decode mode";
    } else {
      const double error = RelativeL2(got, exact);
      EXPECT_NE(got, exact) << "m=" << m << ": int8 decode did not take effect";
      // int8 activations: ~0.8-0.9 % RMS of the output (trellis_gemm.h);
      // measured 0.65-0.72 % here.
      EXPECT_LE(error, 1.5e-2) << "m=" << m;
      std::printf("linear m=%d: int8 decode relative L2 error %.3g\n", static_cast<int>(m), error);
    }
  }
}

TEST_F(LinearPrefillTest, DecodeRejectsBf16) {
  const absl::Status s = SetDecodePrecision(kernels::TrellisGemmPrecision::kBf16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prefill"), std::string::npos) << s;
  EXPECT_EQ(DecodePrecision(), kernels::TrellisGemmPrecision::kFloat);
  EXPECT_STREQ(GemmPrecisionName(kernels::TrellisGemmPrecision::kInt8), "int8");
}

// The reference for a run of rows: kernels::TrellisGemm straight on the
// stored linear (its own copy, zero-padded input, trimmed output), rows
// [row0, row0 + rows) of x at `precision`.
std::vector<float> DirectRows(const kernels::Exl3LinearData& data, const std::vector<float>& x,
                              int64_t in, int64_t out, int64_t row0, int64_t rows,
                              kernels::TrellisGemmPrecision precision) {
  std::vector<float> xp(static_cast<size_t>(rows * data.k), 0.0f), yp(rows * data.n);
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(&xp[i * data.k], &x[(row0 + i) * in], sizeof(float) * in);
  }
  kernels::TrellisGemmOptions options;
  options.precision = precision;
  const absl::Status s = kernels::TrellisGemm(data.view(), xp.data(), rows, yp.data(), options);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<float> y(static_cast<size_t>(rows * out));
  for (int64_t i = 0; i < rows; ++i) std::memcpy(&y[i * out], &yp[i * data.n], sizeof(float) * out);
  return y;
}

// Forward with a row plan of mixed runs (odd sizes, a zero-row run between
// two prefill runs) equals, row for row and bit for bit, separate kernel
// calls per group of consecutive same-precision runs: int8 for decode runs,
// fp32 or bf16 for prefill runs; on a linear with padded input (down_proj
// 192 -> 128, k = 256) and one with padded output (gate_proj 128 -> 192,
// n = 256). With equal precisions the plan is one call of all rows.
TEST_F(LinearPrefillTest, RowPlanRunsEachRunAtItsKindsPrecision) {
  auto model = sharding::Exl3Model::Open(*root_ + "/exl3");
  ASSERT_TRUE(model.ok()) << model.status();
  using P = kernels::TrellisGemmPrecision;
  const std::vector<RowRun> plan = {{3, RowKind::kDecode},  {21, RowKind::kPrefill},
                                    {5, RowKind::kDecode},  {1, RowKind::kPrefill},
                                    {0, RowKind::kDecode},  {18, RowKind::kPrefill},
                                    {7, RowKind::kDecode}};
  const int64_t m = 55;
  // The kernel calls the plan must make: {first row, rows, decode?}.
  struct Group {
    int64_t row0, rows;
    bool decode;
  };
  const std::vector<Group> groups = {{0, 3, true}, {3, 21, false}, {24, 5, true},
                                     {29, 19, false}, {48, 7, true}};
  struct Shape {
    const char* key;
    int64_t in, out;
  };
  std::mt19937 rng(13);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (const Shape& shape : {Shape{"model.layers.0.mlp.down_proj", 192, 128},
                             Shape{"model.layers.0.mlp.gate_proj", 128, 192}}) {
    SCOPED_TRACE(shape.key);
    auto linear = Linear::Load(**model, shape.key, shape.in, shape.out);
    ASSERT_TRUE(linear.ok()) << linear.status();
    auto data = (*model)->LoadLinear(shape.key);
    ASSERT_TRUE(data.ok()) << data.status();
    ASSERT_EQ(data->codebook, kernels::Codebook::kMul1);
    std::vector<float> x(static_cast<size_t>(m * shape.in));
    for (float& v : x) v = g(rng);
    for (P prefill : {P::kFloat, P::kBf16}) {
      SCOPED_TRACE(GemmPrecisionName(prefill));
      ASSERT_TRUE(SetDecodePrecision(P::kInt8).ok());
      ASSERT_TRUE(SetPrefillPrecision(prefill).ok());
      std::vector<float> got(static_cast<size_t>(m * shape.out),
                             std::numeric_limits<float>::quiet_NaN());
      ASSERT_TRUE(linear->Forward(x.data(), m, got.data(), plan).ok());
      for (const Group& group : groups) {
        const std::vector<float> want = DirectRows(*data, x, shape.in, shape.out, group.row0,
                                                   group.rows, group.decode ? P::kInt8 : prefill);
        EXPECT_EQ(0, std::memcmp(want.data(), &got[group.row0 * shape.out],
                                 sizeof(float) * want.size()))
            << "rows " << group.row0 << " + " << group.rows;
        if (group.decode) {  // int8 took effect: not the fp32 rows
          const std::vector<float> fp32 = DirectRows(*data, x, shape.in, shape.out, group.row0,
                                                     group.rows, P::kFloat);
          EXPECT_NE(0, std::memcmp(fp32.data(), &got[group.row0 * shape.out],
                                   sizeof(float) * fp32.size()));
        }
      }
    }
    // Decode and prefill both fp32: one call of all m rows, as the m-based Forward.
    ASSERT_TRUE(SetDecodePrecision(P::kFloat).ok());
    ASSERT_TRUE(SetPrefillPrecision(P::kFloat).ok());
    std::vector<float> got(static_cast<size_t>(m * shape.out));
    ASSERT_TRUE(linear->Forward(x.data(), m, got.data(), plan).ok());
    EXPECT_EQ(got, DirectRows(*data, x, shape.in, shape.out, 0, m, P::kFloat));
    EXPECT_EQ(got, Forward(*linear, x, m));
  }
}

TEST_F(LinearPrefillTest, RowPlanMustCoverTheCallsRows) {
  auto model = sharding::Exl3Model::Open(*root_ + "/exl3");
  ASSERT_TRUE(model.ok()) << model.status();
  auto linear = Linear::Load(**model, "model.layers.0.mlp.down_proj", 192, 128);
  ASSERT_TRUE(linear.ok()) << linear.status();
  std::vector<float> x(5 * 192, 1.0f), y(5 * 128, 7.0f);
  const std::vector<RowRun> short_plan = {{2, RowKind::kDecode}, {2, RowKind::kPrefill}};
  const std::vector<RowRun> negative = {{6, RowKind::kDecode}, {-1, RowKind::kPrefill}};
  EXPECT_EQ(linear->Forward(x.data(), 5, y.data(), short_plan).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(linear->Forward(x.data(), 5, y.data(), negative).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(y, std::vector<float>(5 * 128, 7.0f));  // nothing written
  std::vector<RowRun> built;
  AppendRowRun(&built, 2, RowKind::kDecode);
  AppendRowRun(&built, 0, RowKind::kPrefill);
  AppendRowRun(&built, 1, RowKind::kDecode);
  AppendRowRun(&built, 17, RowKind::kPrefill);
  ASSERT_EQ(built.size(), 2u);
  EXPECT_EQ(built[0].rows, 3);
  EXPECT_EQ(built[1].rows, 17);
  EXPECT_EQ(built[1].kind, RowKind::kPrefill);
  EXPECT_EQ(RowKindForRows(kPrefillMinRows - 1), RowKind::kDecode);
  EXPECT_EQ(RowKindForRows(kPrefillMinRows), RowKind::kPrefill);
  // Size rule (no prompt length): all or nothing by the entry's size.
  EXPECT_EQ(PrefillRowsOfEntry(40, 16, -1), 0);
  EXPECT_EQ(PrefillRowsOfEntry(40, 17, -1), 17);
  // Position rule: rows below the prompt's end, if the prompt is long enough.
  EXPECT_EQ(PrefillRowsOfEntry(16, 9, 25), 9);   // a cache hit's tail
  EXPECT_EQ(PrefillRowsOfEntry(0, 30, 25), 25);  // a replay: prompt, then output
  EXPECT_EQ(PrefillRowsOfEntry(25, 19, 25), 0);  // a long verify chunk
  EXPECT_EQ(PrefillRowsOfEntry(30, 1, 25), 0);
  EXPECT_EQ(PrefillRowsOfEntry(0, 16, 16), 0);  // a short prompt is decode kind
  EXPECT_EQ(PrefillRowsOfEntry(0, 17, 17), 17);
  std::vector<RowRun> head;
  AppendEntryRows(&head, 25, 23, 4);  // rows 23..26 of a replay entry
  ASSERT_EQ(head.size(), 2u);
  EXPECT_EQ(head[0].rows, 2);
  EXPECT_EQ(head[0].kind, RowKind::kPrefill);
  EXPECT_EQ(head[1].rows, 2);
  EXPECT_EQ(head[1].kind, RowKind::kDecode);
}

// Model level: whole EXL3 models converted with one codebook.
class DecodePrecisionModelTest : public ::testing::Test {
 protected:
  void TearDown() override {
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
  }
  // A 2-layer Llama test model (hidden 128, MLP 320, vocab 1000) converted at 3 bits.
  std::string Convert(kernels::Codebook codebook, bool peaked, const std::string& name) {
    sharding::TestModelOptions model;
    model.hidden_size = 128;
    model.intermediate_size = 320;
    model.seed = 23;
    model.peaked_logits = peaked;
    const std::string hf = dir_.File(name + "-hf");
    EXPECT_TRUE(sharding::WriteTestModel(hf, model).ok());
    sharding::ConvertOptions options;
    options.in_dir = hf;
    options.out_dir = dir_.File(name);
    options.bits = 3.0;
    options.codebook = codebook;
    options.threads = 2;
    options.show_progress = false;
    auto report = sharding::ConvertModel(options);
    EXPECT_TRUE(report.ok()) << report.status();
    return options.out_dir;
  }
  testing::ScratchDir dir_;
};

// The logits of every position of `prompt`, fed one token per forward
// (decode-sized: m = 1 in every linear).
// An fp32 cache of 16 pages holding sequence `seq_id`.
absl::StatusOr<PagedKvCache> Fp32CacheWith(const Transformer& model, int64_t seq_id) {
  KvCacheOptions kv;
  kv.dtype = KvCacheDtype::kFp32;
  kv.num_pages = 16;
  absl::StatusOr<PagedKvCache> cache = model.CreateKvCache(kv);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (cache.ok()) EXPECT_TRUE(cache->AddSequence(seq_id).ok());
  return cache;
}

std::vector<float> TokenByTokenLogits(const Transformer& model, const std::vector<int32_t>& prompt) {
  absl::StatusOr<PagedKvCache> cache = Fp32CacheWith(model, 3);
  if (!cache.ok()) return {};
  std::vector<float> all;
  for (int32_t token : prompt) {
    const SequenceTokens entry{3, {&token, 1}};
    std::vector<float> logits(static_cast<size_t>(model.vocab_size()),
                              std::numeric_limits<float>::quiet_NaN());
    const absl::Status s = model.Forward({&entry, 1}, LogitsRows::kLastToken, &*cache, &logits);
    EXPECT_TRUE(s.ok()) << s;
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

std::vector<int32_t> Ids(int n, int64_t vocab, uint32_t seed) {
  std::vector<int32_t> ids(n);
  uint32_t x = seed;
  for (int32_t& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<int32_t>((x >> 8) % vocab);
  }
  return ids;
}

TEST_F(DecodePrecisionModelTest, Int8DecodeLogitsCloseToExactOnMul1Model) {
  const std::string dir = Convert(kernels::Codebook::kMul1, false, "mul1");
  auto model = Transformer::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> prompt = Ids(24, (*model)->vocab_size(), 5);
  ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
  const std::vector<float> exact = TokenByTokenLogits(**model, prompt);
  ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
  const std::vector<float> got = TokenByTokenLogits(**model, prompt);
  ASSERT_EQ(got.size(), exact.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << i;
  const double error = RelativeL2(got, exact);
  std::printf("mul1 K=3 model, 24 decode steps: int8 logits relative L2 error %.3g\n", error);
  EXPECT_NE(got, exact) << "int8 decode did not take effect";
  // Measured 3.2e-2 (2 random layers + a 6-bit lm_head, each linear ~0.7 % of
  // its output; the errors compound through the residual stream).
  EXPECT_LE(error, kInt8DecodeLogitsBound);
}

TEST_F(DecodePrecisionModelTest, Int8DecodeKeepsGreedyTokensOfPeakedModel) {
  const std::string dir = Convert(kernels::Codebook::kMul1, true, "peaked");
  auto model = Transformer::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  auto greedy = [&]() {
    KvCacheOptions kv;
    kv.num_pages = 16;
    absl::StatusOr<PagedKvCache> cache = (*model)->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    LocalStepExecutor executor(model->get(), std::move(*cache));
    GenerationOptions options;
    options.sampling.temperature = 0.0f;
    options.max_new_tokens = 48;
    std::vector<int32_t> tokens;
    const std::vector<int32_t> prompt = {17, 401, 93};
    absl::StatusOr<FinishReason> finish =
        Generate(executor, 1, prompt, options, [&](const GeneratedStep& step) {
          tokens.push_back(step.token.id);
          return true;
        });
    EXPECT_TRUE(finish.ok()) << finish.status();
    return tokens;
  };
  ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
  const std::vector<int32_t> exact = greedy();
  ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
  const std::vector<int32_t> got = greedy();
  EXPECT_EQ(exact.size(), 48u);
  EXPECT_EQ(got, exact);
}

TEST_F(DecodePrecisionModelTest, Int8DecodeLeaves3InstAndMcgModelsBitExact) {
  for (kernels::Codebook codebook : {kernels::Codebook::k3Inst, kernels::Codebook::kMcg}) {
    const std::string dir =
        Convert(codebook, false, codebook == kernels::Codebook::kMcg ? "mcg" : "3inst");
    auto model = Transformer::Load(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::vector<int32_t> prompt = Ids(6, (*model)->vocab_size(), 8);
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kFloat).ok());
    const std::vector<float> exact = TokenByTokenLogits(**model, prompt);
    ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
    const std::vector<float> got = TokenByTokenLogits(**model, prompt);
    ASSERT_EQ(got.size(), exact.size());
    EXPECT_EQ(0, std::memcmp(got.data(), exact.data(), sizeof(float) * got.size()))
        << "codebook " << static_cast<int>(codebook) << " must fall back to fp32 bit for bit";
  }
}

// The logits of the last forward after feeding `cuts` (consecutive pieces
// of one sequence's tokens, one forward each) whose prompt is prompt_len
// tokens long (-1: the forwards carry no prompt length, the size rule).
std::vector<float> LastLogitsAfterCuts(const Transformer& model,
                                       const std::vector<std::vector<int32_t>>& cuts,
                                       int64_t prompt_len) {
  absl::StatusOr<PagedKvCache> cache = Fp32CacheWith(model, 5);
  if (!cache.ok()) return {};
  std::vector<float> logits;
  for (const std::vector<int32_t>& cut : cuts) {
    SequenceTokens entry{5, cut};
    entry.prompt_len = prompt_len;
    logits.assign(static_cast<size_t>(model.vocab_size()), std::numeric_limits<float>::quiet_NaN());
    const absl::Status s = model.Forward({&entry, 1}, LogitsRows::kLastToken, &*cache, &logits);
    EXPECT_TRUE(s.ok()) << s;
  }
  return logits;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, size_t begin, size_t end) {
  return std::vector<int32_t>(v.begin() + begin, v.begin() + end);
}

// At the default int8 decode, a row's precision follows its position in
// the sequence (prompt rows at the prefill precision, output rows at the
// decode precision), so a prompt cut as a prefix-cache hit leaves it, or a
// replay of prompt + output in one forward, computes what the uncut run
// did — within fp32 summation order, where the size rule differs by the
// int8 error (~1e-2). The size-rule runs are the control: the test fails
// if the position rule does not take effect.
TEST_F(DecodePrecisionModelTest, RowKindByPositionMakesCutsAgreeAtInt8Decode) {
  const std::string dir = Convert(kernels::Codebook::kMul1, false, "mul1-cuts");
  auto model = Transformer::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE(SetDecodePrecision(kernels::TrellisGemmPrecision::kInt8).ok());
  const std::vector<int32_t> all = Ids(31, (*model)->vocab_size(), 11);
  const int64_t p = 25;  // prompt: all[0, 25); output: all[25, 31)
  const std::vector<int32_t> prompt = Slice(all, 0, p);
  // Uncut: the prompt in one forward, then one forward per output token.
  std::vector<std::vector<int32_t>> uncut = {prompt};
  for (size_t t = p; t < all.size(); ++t) uncut.push_back(Slice(all, t, t + 1));
  const std::vector<float> prefill = LastLogitsAfterCuts(**model, {prompt}, p);
  const std::vector<float> decoded = LastLogitsAfterCuts(**model, uncut, p);
  // A prefix-cache hit of 16 tokens leaves a 9-token tail.
  const std::vector<std::vector<int32_t>> hit = {Slice(all, 0, 16), Slice(all, 16, p)};
  // A replay: prompt and five output tokens in one forward, then the last.
  const std::vector<std::vector<int32_t>> replay = {Slice(all, 0, 30), Slice(all, 30, 31)};
  // A verify chunk of 18 drafts after the first output token (its rows are
  // output rows: decode precision even though the chunk is long).
  const std::vector<int32_t> long_all = Ids(p + 19, (*model)->vocab_size(), 11);
  std::vector<std::vector<int32_t>> long_uncut = {Slice(long_all, 0, p)};
  for (size_t t = p; t < long_all.size(); ++t) long_uncut.push_back(Slice(long_all, t, t + 1));
  const std::vector<std::vector<int32_t>> verify = {Slice(long_all, 0, p),
                                                    Slice(long_all, p, p + 19)};
  struct Case {
    const char* name;
    std::vector<float> expected;
    std::vector<std::vector<int32_t>> cuts;
  } cases[] = {{"cache-hit tail", prefill, hit},
               {"replay", decoded, replay},
               {"long verify chunk", LastLogitsAfterCuts(**model, long_uncut, p), verify}};
  for (const Case& c : cases) {
    const std::vector<float> by_position = LastLogitsAfterCuts(**model, c.cuts, p);
    const std::vector<float> by_size = LastLogitsAfterCuts(**model, c.cuts, -1);
    ASSERT_EQ(by_position.size(), c.expected.size()) << c.name;
    for (float v : by_position) ASSERT_TRUE(std::isfinite(v)) << c.name;
    const double position_error = RelativeL2(by_position, c.expected);
    const double size_error = RelativeL2(by_size, c.expected);
    std::printf("%-18s vs uncut: position rule %.3g, size rule %.3g\n", c.name, position_error,
                size_error);
    EXPECT_LE(position_error, 1e-5) << c.name;
    EXPECT_GE(size_error, 1e-3) << c.name << ": the control did not differ";
  }
}

}  // namespace
}  // namespace exl3serve::worker
