// FP8 sources (DeepSeek-V3/R1 and Kimi K2 are published with F8_E4M3 linears
// and per-block fp32 `weight_scale_inv`, architectures.md §2.4): `convert`
// dequantizes them on read. A deepseek-v3 test model is re-encoded here as
// FP8 with power-of-two block scales (blocks of 32 x 64 from
// quantization_config.weight_block_size, partial blocks at the edges), and a
// bf16 twin is written with exactly the dequantized values (e4m3 x 2^k is
// exact in bf16); converting both must write byte-identical tensors, and no
// scale tensor. Missing or misshapen scales and NaN bytes are DataLoss
// errors naming the tensor.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sharding/converter.h"
#include "sharding/model_arch.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::testing::ScratchDir;
using ::testing::HasSubstr;

constexpr int64_t kBlockOut = 32, kBlockIn = 64;

// The OCP E4M3 (e4m3fn) value of a byte, written from the format's
// definition: bias 7, 3 mantissa bits, subnormals at exponent 0; 0x7F/0xFF NaN.
double E4M3Value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double v = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (code & 0x80) ? -v : v;
}

uint8_t NearestE4M3(double x) {
  int best = 0;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    if (std::fabs(E4M3Value(code) - x) < std::fabs(E4M3Value(best) - x)) best = code;
  }
  return static_cast<uint8_t>(best);
}

uint16_t Bf16Bits(float f) {  // exact for the values used here
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

struct Pair {
  std::string fp8, bf16;
};

// Writes the FP8 source and its dequantized bf16 twin from `src`.
Pair WriteFp8Pair(const ScratchDir& dir, const std::string& src) {
  Pair out{dir.File("fp8"), dir.File("twin")};
  std::filesystem::create_directories(out.fp8);
  std::filesystem::create_directories(out.bf16);
  std::ifstream in(src + "/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  absl::StatusOr<ModelArch> arch = ModelArchFromConfig(config);
  EXPECT_TRUE(arch.ok());
  auto ckpt = SafetensorsCheckpoint::Open(src);
  EXPECT_TRUE(ckpt.ok());
  std::vector<TensorToWrite> fp8, twin;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    auto t = (*ckpt)->Find(name);
    const LinearSpec* l = nullptr;
    if (absl::EndsWith(name, ".weight")) l = arch->FindByKey(name.substr(0, name.size() - 7));
    const bool to_fp8 = l != nullptr && l->role != LinearRole::kRouter && !l->is_head;
    std::vector<uint8_t> raw(t->info->ByteSize());
    t->file->ReadTensorBytes(*t->info, raw.data());
    if (!to_fp8) {
      fp8.push_back(TensorFromBytes(name, t->info->dtype, t->info->shape, raw));
      twin.push_back(TensorFromBytes(name, t->info->dtype, t->info->shape, raw));
      continue;
    }
    const std::vector<float> w = *t->file->ReadAsFloat(*t->info);
    const int64_t rows = l->out_features, cols = l->in_features;
    const int64_t br = (rows + kBlockOut - 1) / kBlockOut, bc = (cols + kBlockIn - 1) / kBlockIn;
    std::vector<float> scales(br * bc);
    for (int64_t i = 0; i < br; ++i) {
      for (int64_t j = 0; j < bc; ++j) {
        double absmax = 0.0;
        for (int64_t r = i * kBlockOut; r < std::min(rows, (i + 1) * kBlockOut); ++r) {
          for (int64_t c = j * kBlockIn; c < std::min(cols, (j + 1) * kBlockIn); ++c) {
            absmax = std::max(absmax, std::fabs(static_cast<double>(w[r * cols + c])));
          }
        }
        scales[i * bc + j] = static_cast<float>(std::pow(2.0, std::ceil(std::log2(absmax / 448.0))));
      }
    }
    std::vector<uint8_t> codes(rows * cols);
    std::vector<uint16_t> dequantized(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const double s = scales[(r / kBlockOut) * bc + c / kBlockIn];
        codes[r * cols + c] = NearestE4M3(w[r * cols + c] / s);
        dequantized[r * cols + c] = Bf16Bits(static_cast<float>(E4M3Value(codes[r * cols + c]) * s));
      }
    }
    fp8.push_back(TensorFromBytes(name, DType::kF8E4M3, {rows, cols}, std::move(codes)));
    fp8.push_back(TensorFromFloats(l->key + ".weight_scale_inv", {br, bc}, scales));
    twin.push_back(TensorFromHalfBits(name, DType::kBF16, {rows, cols}, std::move(dequantized)));
  }
  EXPECT_TRUE(WriteSafetensorsFile(out.fp8 + "/model.safetensors", std::move(fp8), {}).ok());
  EXPECT_TRUE(WriteSafetensorsFile(out.bf16 + "/model.safetensors", std::move(twin), {}).ok());
  EXPECT_TRUE(WriteFileAtomically(out.bf16 + "/config.json", config.dump(2)).ok());
  config["quantization_config"] = {{"quant_method", "fp8"},
                                   {"fmt", "e4m3"},
                                   {"activation_scheme", "dynamic"},
                                   {"weight_block_size", {kBlockOut, kBlockIn}}};
  EXPECT_TRUE(WriteFileAtomically(out.fp8 + "/config.json", config.dump(2)).ok());
  return out;
}

std::map<std::string, std::vector<uint8_t>> AllTensors(const std::string& dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  for (const std::string& name : (*ckpt)->TensorNames()) {
    auto t = (*ckpt)->Find(name);
    std::vector<uint8_t> raw(t->info->ByteSize());
    t->file->ReadTensorBytes(*t->info, raw.data());
    out[name] = std::move(raw);
  }
  return out;
}

ConvertOptions Options(const std::string& in, const std::string& out) {
  ConvertOptions o;
  o.in_dir = in;
  o.out_dir = out;
  o.bits = 3.0;
  o.head_bits = 16;  // the head is bf16 in the FP8 sources too; keeps the test short
  o.threads = 2;
  o.show_progress = false;
  return o;
}

TEST(ConverterFp8Test, Fp8BlockScaledSourceConvertsAsItsDequantizedTwin) {
  ScratchDir dir;
  TestModelOptions o = DeepseekV3TestDefaults();
  o.hidden_size = 128;
  o.intermediate_size = 160;
  o.num_layers = 2;
  o.num_experts = 4;
  ASSERT_TRUE(WriteTestModel(dir.File("src"), o).ok());
  const Pair pair = WriteFp8Pair(dir, dir.File("src"));
  absl::StatusOr<ConvertReport> a = ConvertModel(Options(pair.fp8, dir.File("fp8-exl3")));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ConvertReport> b = ConvertModel(Options(pair.bf16, dir.File("twin-exl3")));
  ASSERT_TRUE(b.ok()) << b.status();
  const auto from_fp8 = AllTensors(dir.File("fp8-exl3"));
  const auto from_twin = AllTensors(dir.File("twin-exl3"));
  ASSERT_EQ(from_fp8.size(), from_twin.size());
  int compared = 0;
  for (const auto& [name, bytes] : from_twin) {
    auto it = from_fp8.find(name);
    ASSERT_NE(it, from_fp8.end()) << name;
    EXPECT_EQ(it->second, bytes) << name;
    ++compared;
  }
  for (const auto& [name, bytes] : from_fp8) {
    EXPECT_FALSE(absl::EndsWith(name, "weight_scale_inv")) << name << " was copied";
  }
  EXPECT_TRUE(from_fp8.count("model.layers.1.self_attn.kv_b_proj.weight"));  // fp16, dequantized
  EXPECT_TRUE(from_fp8.count("model.layers.1.self_attn.q_b_proj.trellis"));
  std::printf("%d tensors byte-identical\n", compared);
}

TEST(ConverterFp8Test, MissingMisshapenOrNaNScalesAreDataLoss) {
  ScratchDir dir;
  TestModelOptions o = DeepseekV3TestDefaults();
  o.hidden_size = 128;
  o.num_layers = 1;
  o.num_experts = 4;
  o.first_k_dense_replace = 1;
  ASSERT_TRUE(WriteTestModel(dir.File("src"), o).ok());
  const Pair pair = WriteFp8Pair(dir, dir.File("src"));
  const std::string target = "model.layers.0.self_attn.q_b_proj";
  auto rewrite = [&](const std::string& out, auto edit) {
    std::filesystem::create_directories(out);
    std::filesystem::copy_file(pair.fp8 + "/config.json", out + "/config.json");
    auto ckpt = SafetensorsCheckpoint::Open(pair.fp8);
    std::vector<TensorToWrite> tensors;
    for (const std::string& name : (*ckpt)->TensorNames()) {
      auto t = (*ckpt)->Find(name);
      std::vector<uint8_t> raw(t->info->ByteSize());
      t->file->ReadTensorBytes(*t->info, raw.data());
      std::vector<int64_t> shape = t->info->shape;
      if (!edit(name, shape, raw)) continue;
      tensors.push_back(TensorFromBytes(name, t->info->dtype, shape, std::move(raw)));
    }
    EXPECT_TRUE(WriteSafetensorsFile(out + "/model.safetensors", std::move(tensors), {}).ok());
  };
  rewrite(dir.File("no-scale"), [&](const std::string& name, std::vector<int64_t>&,
                                     std::vector<uint8_t>&) {
    return name != target + ".weight_scale_inv";
  });
  rewrite(dir.File("bad-scale"), [&](const std::string& name, std::vector<int64_t>& shape,
                                      std::vector<uint8_t>& raw) {
    if (name == target + ".weight_scale_inv") {
      shape = {shape[0] * shape[1]};  // flattened
    }
    return true;
  });
  rewrite(dir.File("nan"), [&](const std::string& name, std::vector<int64_t>&,
                                std::vector<uint8_t>& raw) {
    if (name == target + ".weight") raw[5] = 0x7F;
    return true;
  });
  for (const auto& [which, needle] : {std::pair{"no-scale", "weight_scale_inv` (its block scales) is missing"},
                                      std::pair{"bad-scale", "weight_block_size"},
                                      std::pair{"nan", "NaN"}}) {
    absl::StatusOr<ConvertReport> r = ConvertModel(Options(dir.File(which), dir.File(std::string(which) + "-out")));
    ASSERT_FALSE(r.ok()) << which;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << which << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(needle)) << which;
    EXPECT_THAT(r.status().message(), HasSubstr(target)) << which;
  }
}

}  // namespace
}  // namespace exl3serve::sharding
