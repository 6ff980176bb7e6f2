// Exl3Model rank-local loading: LoadLinearSlice must equal
// kernels::SliceRows + kernels::SliceColumns of the whole linear bit for bit
// (modern suh/svh and legacy su/sv signs, with and without bias),
// LoadTensorSliceAsFloat the sub-block of LoadTensorAsFloat, and bytes_read()
// must grow by exactly the bytes of the slice — on a checkpoint written with
// exllamav3's unpadded header (unaligned data, §2.6) across two files.
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::testing::ScratchDir;
using ::testing::HasSubstr;

// A finite fp16 bit pattern (exponent not all ones).
uint16_t RandomHalf(std::mt19937& rng) {
  uint16_t bits;
  do {
    bits = static_cast<uint16_t>(rng());
  } while ((bits & 0x7C00u) == 0x7C00u);
  return bits;
}

std::vector<uint16_t> RandomHalves(std::mt19937& rng, int64_t count) {
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (auto& v : out) v = RandomHalf(rng);
  return out;
}

struct LinearShape {
  std::string key;
  int64_t k, n;
  int bits;
  bool legacy;  // su/sv packed signs instead of suh/svh
  bool bias;
};

// The tensors of one EXL3 linear with random contents.
void AddLinear(std::mt19937& rng, const LinearShape& s, std::vector<TensorToWrite>& out) {
  std::vector<int16_t> trellis(static_cast<size_t>(s.k / 16 * s.n / 16 * 16 * s.bits));
  for (auto& v : trellis) v = static_cast<int16_t>(rng());
  out.push_back(TensorFromInt16(s.key + ".trellis", {s.k / 16, s.n / 16, 16 * s.bits}, trellis));
  if (s.legacy) {
    std::vector<int16_t> su(static_cast<size_t>(s.k / 16)), sv(static_cast<size_t>(s.n / 16));
    for (auto& v : su) v = static_cast<int16_t>(rng());
    for (auto& v : sv) v = static_cast<int16_t>(rng());
    out.push_back(TensorFromInt16(s.key + ".su", {s.k / 16}, su));
    out.push_back(TensorFromInt16(s.key + ".sv", {s.n / 16}, sv));
  } else {
    out.push_back(TensorFromHalfBits(s.key + ".suh", DType::kF16, {s.k}, RandomHalves(rng, s.k)));
    out.push_back(TensorFromHalfBits(s.key + ".svh", DType::kF16, {s.n}, RandomHalves(rng, s.n)));
    out.push_back(TensorScalarInt32(s.key + ".mcg", kMcgMarkerValue));
  }
  if (s.bias) {
    out.push_back(TensorFromHalfBits(s.key + ".bias", DType::kF16, {s.n}, RandomHalves(rng, s.n)));
  }
}

const LinearShape kModern{"blk.0.attn.q_proj", 512, 384, 3, false, true};
const LinearShape kLegacy{"blk.0.mlp.down_proj", 256, 640, 2, true, false};
const LinearShape kWide{"blk.1.up_proj", 384, 256, 5, false, false};

// Plain tensors: BF16 2-d, F16 1-d, F32 2-d with odd sizes.
constexpr int64_t kEmbedRows = 301, kEmbedCols = 200;
constexpr int64_t kNormSize = 200;
constexpr int64_t kTableRows = 7, kTableCols = 9;

// Two files (no index: every *.safetensors of the directory), exllamav3's
// unpadded header so no tensor is aligned.
void WriteCheckpoint(const std::string& dir) {
  std::mt19937 rng(20260711);
  const SafetensorsWriteOptions unpadded{.pad_header_to_8 = false};
  std::vector<TensorToWrite> first, second;
  AddLinear(rng, kModern, first);
  first.push_back(TensorFromHalfBits("embed.weight", DType::kBF16, {kEmbedRows, kEmbedCols},
                                     RandomHalves(rng, kEmbedRows * kEmbedCols)));
  first.push_back(TensorFromHalfBits("norm.weight", DType::kF16, {kNormSize},
                                     RandomHalves(rng, kNormSize)));
  AddLinear(rng, kLegacy, second);
  AddLinear(rng, kWide, second);
  std::vector<float> table(kTableRows * kTableCols);
  for (auto& v : table) v = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
  second.push_back(TensorFromFloats("table", {kTableRows, kTableCols}, table));
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model-00001-of-00002.safetensors", std::move(first),
                                   {}, unpadded)
                  .ok());
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model-00002-of-00002.safetensors", std::move(second),
                                   {}, unpadded)
                  .ok());
  const nlohmann::json config = {{"architectures", {"TestOnly"}}};
  ASSERT_TRUE(WriteFileAtomically(dir + "/config.json", config.dump()).ok());
}

class Exl3ModelSliceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(dir_.path()));
    auto model = Exl3Model::Open(dir_.path());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
  }

  ScratchDir dir_;
  std::unique_ptr<Exl3Model> model_;
};

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Bytes the slice occupies in the file, computed from the format (§2.4, §5.4).
uint64_t SliceBytes(const LinearShape& s, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    bool with_bias) {
  uint64_t bytes = static_cast<uint64_t>((r1 - r0) / 16 * (c1 - c0) / 16 * 16 * s.bits * 2);
  if (s.legacy) {
    bytes += static_cast<uint64_t>((r1 - r0) / 16 * 2 + (c1 - c0) / 16 * 2);
  } else {
    bytes += static_cast<uint64_t>((r1 - r0) * 2 + (c1 - c0) * 2);
  }
  if (with_bias && s.bias) bytes += static_cast<uint64_t>((c1 - c0) * 2);
  return bytes;
}

// A random 128-aligned range [a, b) within [0, limit], empty ranges included.
std::pair<int64_t, int64_t> RandomRange(std::mt19937& rng, int64_t limit) {
  std::uniform_int_distribution<int64_t> pick(0, limit / 128);
  int64_t a = pick(rng) * 128, b = pick(rng) * 128;
  if (a > b) std::swap(a, b);
  return {a, b};
}

TEST_F(Exl3ModelSliceTest, LinearSliceEqualsSlicingTheWholeLinearBitForBit) {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (const LinearShape& s : {kModern, kLegacy, kWide}) {
    auto whole = model_->LoadLinear(s.key);
    ASSERT_TRUE(whole.ok()) << whole.status();
    for (int trial = 0; trial < 25; ++trial) {
      auto [r0, r1] = RandomRange(rng, s.k);
      auto [c0, c1] = RandomRange(rng, s.n);
      if (trial == 0) r0 = 0, r1 = s.k;  // whole rows: one contiguous read
      if (trial == 1) c0 = 0, c1 = s.n;
      SCOPED_TRACE(::testing::Message() << s.key << " rows [" << r0 << "," << r1 << ") cols ["
                                        << c0 << "," << c1 << ")");
      // SliceRows keeps the bias only for the shard that starts at row 0.
      const bool with_bias = r0 == 0;
      auto rows = kernels::SliceRows(whole->view(), r0, r1);
      ASSERT_TRUE(rows.ok()) << rows.status();
      auto expected = kernels::SliceColumns(rows->view(), c0, c1);
      ASSERT_TRUE(expected.ok()) << expected.status();

      const uint64_t before = model_->bytes_read();
      auto slice = model_->LoadLinearSlice(s.key, r0, r1, c0, c1, with_bias);
      ASSERT_TRUE(slice.ok()) << slice.status();
      EXPECT_EQ(model_->bytes_read() - before, SliceBytes(s, r0, r1, c0, c1, with_bias));

      EXPECT_EQ(slice->k, expected->k);
      EXPECT_EQ(slice->n, expected->n);
      EXPECT_EQ(slice->bits, s.bits);
      EXPECT_EQ(slice->codebook, whole->codebook);
      EXPECT_TRUE(SameBits(slice->trellis, expected->trellis));
      EXPECT_TRUE(SameBits(slice->suh, expected->suh));
      EXPECT_TRUE(SameBits(slice->svh, expected->svh));
      EXPECT_TRUE(SameBits(slice->bias, expected->bias));
      EXPECT_TRUE(kernels::ValidateExl3LinearView(slice->view()).ok());
    }
  }
}

TEST_F(Exl3ModelSliceTest, BiasFollowsWithBiasNotTheRowRange) {
  auto whole = model_->LoadLinear(kModern.key);
  ASSERT_TRUE(whole.ok());
  auto with = model_->LoadLinearSlice(kModern.key, 256, 512, 128, 384, true);
  ASSERT_TRUE(with.ok()) << with.status();
  const std::vector<float> expected(whole->bias.begin() + 128, whole->bias.begin() + 384);
  EXPECT_TRUE(SameBits(with->bias, expected));
  auto without = model_->LoadLinearSlice(kModern.key, 0, 512, 0, 384, false);
  ASSERT_TRUE(without.ok());
  EXPECT_TRUE(without->bias.empty());
  // No bias tensor: nothing to add even when asked.
  auto none = model_->LoadLinearSlice(kLegacy.key, 0, 128, 0, 128, true);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->bias.empty());
}

TEST_F(Exl3ModelSliceTest, WholeLoadsCountTheirBytesToo) {
  uint64_t before = model_->bytes_read();
  EXPECT_EQ(before, 0u);
  ASSERT_TRUE(model_->LoadLinear(kModern.key).ok());
  EXPECT_EQ(model_->bytes_read() - before, SliceBytes(kModern, 0, kModern.k, 0, kModern.n, true));
  before = model_->bytes_read();
  ASSERT_TRUE(model_->LoadLinear(kLegacy.key).ok());
  EXPECT_EQ(model_->bytes_read() - before, SliceBytes(kLegacy, 0, kLegacy.k, 0, kLegacy.n, true));
  before = model_->bytes_read();
  ASSERT_TRUE(model_->LoadTensorAsFloat("embed.weight").ok());
  EXPECT_EQ(model_->bytes_read() - before, static_cast<uint64_t>(kEmbedRows * kEmbedCols * 2));
}

TEST_F(Exl3ModelSliceTest, ASliceReadsOnlyItsShareOfTheLinear) {
  const uint64_t before = model_->bytes_read();
  // Column-parallel quarter of a 384-column linear's 128-column shard.
  ASSERT_TRUE(model_->LoadLinearSlice(kModern.key, 0, kModern.k, 128, 256, false).ok());
  const uint64_t slice = model_->bytes_read() - before;
  const Exl3LinearInfo* info = model_->FindLinear(kModern.key);
  ASSERT_NE(info, nullptr);
  EXPECT_LT(slice, info->stored_bytes / 2);
}

TEST_F(Exl3ModelSliceTest, PlainTensorSliceEqualsTheSubBlock) {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed) + 1);
  struct Plain {
    const char* name;
    int64_t rows, cols, elem;
  };
  for (const Plain& p : {Plain{"embed.weight", kEmbedRows, kEmbedCols, 2},
                         Plain{"norm.weight", kNormSize, 1, 2},
                         Plain{"table", kTableRows, kTableCols, 4}}) {
    auto whole = model_->LoadTensorAsFloat(p.name);
    ASSERT_TRUE(whole.ok()) << whole.status();
    for (int trial = 0; trial < 20; ++trial) {
      std::uniform_int_distribution<int64_t> row(0, p.rows), col(0, p.cols);
      int64_t a0 = row(rng), a1 = row(rng), b0 = col(rng), b1 = col(rng);
      if (a0 > a1) std::swap(a0, a1);
      if (b0 > b1) std::swap(b0, b1);
      if (trial == 0) b0 = 0, b1 = p.cols;
      SCOPED_TRACE(::testing::Message() << p.name << " [" << a0 << "," << a1 << ") x [" << b0
                                        << "," << b1 << ")");
      std::vector<float> expected;
      for (int64_t r = a0; r < a1; ++r) {
        for (int64_t c = b0; c < b1; ++c) expected.push_back((*whole)[r * p.cols + c]);
      }
      const uint64_t before = model_->bytes_read();
      auto slice = model_->LoadTensorSliceAsFloat(p.name, a0, a1, b0, b1);
      ASSERT_TRUE(slice.ok()) << slice.status();
      EXPECT_TRUE(SameBits(*slice, expected));
      EXPECT_EQ(model_->bytes_read() - before,
                static_cast<uint64_t>((a1 - a0) * (b1 - b0) * p.elem));
    }
  }
}

TEST_F(Exl3ModelSliceTest, BadRangesAreInvalidArgumentNamingKeyAndRange) {
  struct Bad {
    int64_t r0, r1, c0, c1;
    const char* message;
  };
  const std::vector<Bad> cases = {
      {64, 128, 0, 128, "row (input channel) range [64, 128)"},
      {0, 640, 0, 128, "row (input channel) range [0, 640)"},
      {256, 128, 0, 128, "row (input channel) range [256, 128)"},
      {-128, 0, 0, 128, "row (input channel) range [-128, 0)"},
      {0, 128, 0, 512, "column (output channel) range [0, 512)"},
      {0, 128, 128, 200, "column (output channel) range [128, 200)"},
  };
  const uint64_t before = model_->bytes_read();
  for (const Bad& c : cases) {
    auto slice = model_->LoadLinearSlice(kModern.key, c.r0, c.r1, c.c0, c.c1, true);
    ASSERT_FALSE(slice.ok()) << c.message;
    EXPECT_EQ(slice.status().code(), absl::StatusCode::kInvalidArgument) << slice.status();
    EXPECT_THAT(std::string(slice.status().message()), HasSubstr(kModern.key));
    EXPECT_THAT(std::string(slice.status().message()), HasSubstr(c.message));
  }
  auto unknown = model_->LoadLinearSlice("no.such.proj", 0, 128, 0, 128, false);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);

  auto outside = model_->LoadTensorSliceAsFloat("embed.weight", 0, kEmbedRows + 1, 0, 1);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("embed.weight"));
  auto reversed = model_->LoadTensorSliceAsFloat("table", 0, 1, 5, 4);
  EXPECT_EQ(reversed.status().code(), absl::StatusCode::kInvalidArgument);
  auto one_d = model_->LoadTensorSliceAsFloat("norm.weight", 0, 10, 0, 2);
  EXPECT_EQ(one_d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(one_d.status().message()), HasSubstr("[0, 1)"));
  auto not_float = model_->LoadTensorSliceAsFloat(kModern.key + ".trellis", 0, 1, 0, 1);
  EXPECT_EQ(not_float.status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = model_->LoadTensorSliceAsFloat("nope", 0, 1, 0, 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(model_->bytes_read(), before) << "failed loads must not count bytes";
}

TEST_F(Exl3ModelSliceTest, BytesReadCountsLoadsFromAllThreads) {
  constexpr int kThreads = 4, kLoadsPerThread = 8;
  const uint64_t per_load = SliceBytes(kWide, 128, 384, 0, 128, false);
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kLoadsPerThread; ++i) {
        if (!model_->LoadLinearSlice(kWide.key, 128, 384, 0, 128, false).ok()) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  EXPECT_EQ(model_->bytes_read(), per_load * kThreads * kLoadsPerThread);
}

}  // namespace
}  // namespace exl3serve::sharding
