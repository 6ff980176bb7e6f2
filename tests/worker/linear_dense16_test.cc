// worker/model/linear.h with a plain BF16 / F16 checkpoint weight: held in
// its own 16 bits (weight_bytes = 2 per weight), Forward close to the fp32
// path (DenseGemmTransposed on the same values), tensor-parallel windows
// (column pieces bit-identical to the whole, row pieces summing to it), and a
// whole bf16 model's logits within fp32 rounding of the same model stored as
// F32 (which is held and run as fp32: the previous path).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dense16_gemm.h"
#include "sharding/exl3_model.h"
#include "sharding/safetensors.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/linear.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {
namespace {

constexpr int64_t kHidden = 128, kInter = 192, kVocab = 301;

sharding::TestModelOptions SmallModel(bool tied) {
  sharding::TestModelOptions model;
  model.num_layers = 2;
  model.hidden_size = kHidden;
  model.intermediate_size = kInter;
  model.vocab_size = kVocab;
  model.tie_word_embeddings = tied;
  return model;
}

// `to`: the same model with every tensor stored as F32 (same values).
void WriteAsF32(const std::string& from, const std::string& to) {
  std::filesystem::create_directories(to);
  for (const char* f : {"config.json", "generation_config.json"}) {
    if (std::filesystem::exists(from + "/" + f)) {
      std::filesystem::copy_file(from + "/" + f, to + "/" + f);
    }
  }
  auto model = sharding::Exl3Model::Open(from);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<sharding::TensorToWrite> tensors;
  for (const sharding::PlainTensorInfo& t : (*model)->plain_tensors()) {
    auto values = (*model)->LoadTensorAsFloat(t.name);
    ASSERT_TRUE(values.ok()) << values.status();
    tensors.push_back(sharding::TensorFromFloats(t.name, t.shape, std::move(*values)));
  }
  ASSERT_TRUE(sharding::WriteSafetensorsFile(to + "/model.safetensors", std::move(tensors), {}).ok());
}

std::vector<float> RandomRows(int64_t m, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(m * k);
  for (float& v : x) v = normal(rng);
  return x;
}

// |a - b| <= tol · (|b| + scale) elementwise, scale = the RMS of b.
void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  double rms = 0.0;
  for (float v : b) rms += double{v} * v;
  rms = std::sqrt(rms / std::max<size_t>(1, b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a[i])) << i;
    ASSERT_LE(std::abs(double{a[i]} - b[i]), tol * (std::abs(double{b[i]}) + rms)) << i;
  }
}

TEST(LinearDense16Test, Bf16WeightHeldIn16BitsAndMatchesFp32Path) {
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.path() + "/hf", SmallModel(false)).ok());
  auto model = sharding::Exl3Model::Open(dir.path() + "/hf");
  ASSERT_TRUE(model.ok()) << model.status();
  for (const char* key : {"lm_head", "model.layers.0.mlp.down_proj"}) {
    const bool head = std::string(key) == "lm_head";
    const int64_t in = head ? kHidden : kInter, out = head ? kVocab : kHidden;
    const uint64_t read_before = (*model)->bytes_read();
    auto linear = Linear::Load(**model, key, in, out);
    ASSERT_TRUE(linear.ok()) << linear.status();
    EXPECT_EQ((*model)->bytes_read() - read_before, static_cast<uint64_t>(2 * in * out));
    EXPECT_EQ(linear->plain_dtype(), Linear::PlainDType::kBf16);
    EXPECT_EQ(linear->weight_bytes(), 2 * in * out);
    EXPECT_EQ(linear->dense_weight(), nullptr);
    auto w = (*model)->LoadTensorAsFloat(std::string(key) + ".weight");
    ASSERT_TRUE(w.ok());
    std::vector<float> rows(w->size());
    linear->DenseRowsToFloat(0, out, rows.data());
    EXPECT_EQ(rows, *w);  // exact
    const Linear f32 = Linear::FromDense(*w, in, out, {});
    EXPECT_EQ(f32.weight_bytes(), 4 * in * out);
    for (int64_t m : {1, 3, 17, 40}) {
      const std::vector<float> x = RandomRows(m, in, static_cast<uint32_t>(m));
      std::vector<float> y(m * out, std::nanf("")), want(m * out);
      ASSERT_TRUE(linear->Forward(x.data(), m, y.data()).ok());
      ASSERT_TRUE(f32.Forward(x.data(), m, want.data()).ok());
      ExpectClose(y, want, 1e-5);
    }
  }
}

TEST(LinearDense16Test, F16WeightViaFromDense16) {
  const int64_t in = 77, out = 45;
  const std::vector<float> wf = RandomRows(out, in, 5);
  std::vector<uint16_t> bits(wf.size());
  kernels::cpu::FloatToDense16(wf.data(), kernels::cpu::Dense16Type::kF16, in * out, bits.data());
  std::vector<float> exact(wf.size());
  kernels::cpu::Dense16ToFloat(bits.data(), kernels::cpu::Dense16Type::kF16, in * out, exact.data());
  std::vector<float> bias = RandomRows(1, out, 6);
  const Linear h = Linear::FromDense16(bits, kernels::cpu::Dense16Type::kF16, in, out, bias);
  const Linear f = Linear::FromDense(exact, in, out, bias);
  EXPECT_EQ(h.plain_dtype(), Linear::PlainDType::kF16);
  EXPECT_EQ(h.weight_bytes(), 2 * in * out);
  const std::vector<float> x = RandomRows(3, in, 7);
  std::vector<float> y(3 * out), want(3 * out);
  ASSERT_TRUE(h.Forward(x.data(), 3, y.data()).ok());
  ASSERT_TRUE(f.Forward(x.data(), 3, want.data()).ok());
  ExpectClose(y, want, 1e-5);
}

TEST(LinearDense16Test, TensorParallelWindowsOfA16BitWeight) {
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.path() + "/hf", SmallModel(false)).ok());
  auto model = sharding::Exl3Model::Open(dir.path() + "/hf");
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string key = "model.layers.1.mlp.down_proj";
  auto whole = Linear::Load(**model, key, kInter, kHidden);
  ASSERT_TRUE(whole.ok());
  const int64_t m = 5;
  const std::vector<float> x = RandomRows(m, kInter, 9);
  std::vector<float> y(m * kHidden);
  ASSERT_TRUE(whole->Forward(x.data(), m, y.data()).ok());
  // Column-parallel: output columns [37, 101), full input — bit-identical.
  auto col = Linear::LoadWindow(**model, key, kInter, kHidden, 0, kInter, 37, 101, true);
  ASSERT_TRUE(col.ok()) << col.status();
  EXPECT_EQ(col->plain_dtype(), Linear::PlainDType::kBf16);
  EXPECT_EQ(col->weight_bytes(), 2 * kInter * 64);
  std::vector<float> yc(m * 64);
  ASSERT_TRUE(col->Forward(x.data(), m, yc.data()).ok());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t o = 0; o < 64; ++o) ASSERT_EQ(yc[i * 64 + o], y[i * kHidden + 37 + o]);
  }
  // Row-parallel: input [0, 83) and [83, 192), partial sums add up.
  std::vector<float> sum(m * kHidden, 0.0f);
  for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 83}, {83, kInter}}) {
    auto row = Linear::LoadWindow(**model, key, kInter, kHidden, b, e, 0, kHidden, b == 0);
    ASSERT_TRUE(row.ok()) << row.status();
    EXPECT_EQ(row->weight_bytes(), 2 * (e - b) * kHidden);
    std::vector<float> xs(m * (e - b)), part(m * kHidden);
    for (int64_t i = 0; i < m; ++i) {
      std::copy(&x[i * kInter + b], &x[i * kInter + e], &xs[i * (e - b)]);
    }
    ASSERT_TRUE(row->Forward(xs.data(), m, part.data()).ok());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  ExpectClose(sum, y, 1e-5);
}

TEST(LinearDense16Test, LoadTensorSlice16GivesTheStoredBits) {
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.path() + "/bf16", SmallModel(false)).ok());
  WriteAsF32(dir.path() + "/bf16", dir.path() + "/f32");
  auto model = sharding::Exl3Model::Open(dir.path() + "/bf16");
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string name = "model.layers.0.mlp.up_proj.weight";  // [192, 128]
  auto bits = (*model)->LoadTensorSlice16(name, 5, 77, 3, 101);
  auto floats = (*model)->LoadTensorSliceAsFloat(name, 5, 77, 3, 101);
  ASSERT_TRUE(bits.ok()) << bits.status();
  ASSERT_TRUE(floats.ok());
  ASSERT_EQ(bits->size(), size_t{72 * 98});
  std::vector<float> widened(bits->size());
  kernels::cpu::Dense16ToFloat(bits->data(), kernels::cpu::Dense16Type::kBf16,
                               static_cast<int64_t>(bits->size()), widened.data());
  EXPECT_EQ(widened, *floats);
  EXPECT_EQ((*model)->LoadTensorSlice16(name, 0, 193, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->LoadTensorSlice16("nope", 0, 1, 0, 1).status().code(),
            absl::StatusCode::kNotFound);
  auto f32 = sharding::Exl3Model::Open(dir.path() + "/f32");
  ASSERT_TRUE(f32.ok());
  EXPECT_EQ((*f32)->LoadTensorSlice16(name, 0, 1, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The F32 copy is held as fp32.
  auto linear = Linear::Load(**f32, "lm_head", kHidden, kVocab);
  ASSERT_TRUE(linear.ok());
  EXPECT_EQ(linear->plain_dtype(), Linear::PlainDType::kF32);
  EXPECT_EQ(linear->weight_bytes(), 4 * kHidden * kVocab);
}

// The whole model: bf16 weights held in 16 bits vs the same values as F32
// (held as fp32, the previous path), untied and tied (the head's rows are
// also the embedding).
TEST(LinearDense16Test, Bf16ModelLogitsMatchFp32HeldModel) {
  for (bool tied : {false, true}) {
    testing::ScratchDir dir;
    ASSERT_TRUE(sharding::WriteTestModel(dir.path() + "/bf16", SmallModel(tied)).ok());
    WriteAsF32(dir.path() + "/bf16", dir.path() + "/f32");
    auto a = Transformer::Load(dir.path() + "/bf16");
    auto b = Transformer::Load(dir.path() + "/f32");
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<int32_t> prompt;
    for (int i = 0; i < 23; ++i) prompt.push_back((i * 37 + 5) % kVocab);
    std::vector<float> la, lb;
    for (int which = 0; which < 2; ++which) {
      Transformer& model = which == 0 ? **a : **b;
      auto cache = model.CreateKvCache(KvCacheOptions{});
      ASSERT_TRUE(cache.ok());
      ASSERT_TRUE(cache->AddSequence(0).ok());
      const SequenceTokens entry{0, prompt};
      std::vector<float>& out = which == 0 ? la : lb;
      ASSERT_TRUE(model.Forward({&entry, 1}, LogitsRows::kAllTokens, &*cache, &out).ok());
      // Then one decode step (m = 1).
      std::vector<float> step;
      const std::vector<int32_t> next = {7};
      const SequenceTokens one{0, next};
      ASSERT_TRUE(model.Forward({&one, 1}, LogitsRows::kLastToken, &*cache, &step).ok());
      out.insert(out.end(), step.begin(), step.end());
    }
    ASSERT_EQ(la.size(), (prompt.size() + 1) * kVocab);
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < la.size(); ++i) {
      num += (double{la[i]} - lb[i]) * (double{la[i]} - lb[i]);
      den += double{lb[i]} * lb[i];
    }
    std::printf("tied=%d: relative L2 difference of the logits %.3g\n", tied, std::sqrt(num / den));
    ExpectClose(la, lb, 1e-4);
  }
}

}  // namespace
}  // namespace exl3serve::worker
