// Exl3Model: recognition of quantized linears by their tensors, and a clear
// DataLoss (naming file, tensor and rule) for every malformed layout.
#include "sharding/exl3_model.h"

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using ::exl3serve::testing::ScratchDir;

// Tensors of one EXL3 linear `P` (k x n, K bits), valid unless edited.
std::map<std::string, TensorToWrite> ValidLinear(const std::string& p, int64_t k, int64_t n,
                                                 int bits) {
  std::map<std::string, TensorToWrite> t;
  std::mt19937 rng(7);
  std::vector<int16_t> trellis(static_cast<size_t>(k / 16 * n / 16 * 16 * bits));
  for (auto& v : trellis) v = static_cast<int16_t>(rng());
  t[p + ".trellis"] = TensorFromInt16(p + ".trellis", {k / 16, n / 16, 16 * bits}, trellis);
  t[p + ".suh"] = TensorFromHalfBits(p + ".suh", DType::kF16, {k}, std::vector<uint16_t>(k, 0x3C00));
  t[p + ".svh"] = TensorFromHalfBits(p + ".svh", DType::kF16, {n}, std::vector<uint16_t>(n, 0xBC00));
  t[p + ".mul1"] = TensorScalarInt32(p + ".mul1", kMul1MarkerValue);
  return t;
}

void WriteModel(const std::string& dir, std::map<std::string, TensorToWrite> tensors,
                const nlohmann::json& config = {{"architectures", {"TestOnly"}}}) {
  std::vector<TensorToWrite> list;
  for (auto& [name, t] : tensors) list.push_back(std::move(t));
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model.safetensors", std::move(list), {}).ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/config.json", config.dump()).ok());
}

TEST(Exl3ModelTest, RecognisesLinearKCodebookAndBias) {
  ScratchDir dir;
  auto t = ValidLinear("a.proj", 256, 128, 5);
  t["a.proj.bias"] = TensorFromHalfBits("a.proj.bias", DType::kF16, {128}, std::vector<uint16_t>(128));
  t["norm.weight"] = TensorFromHalfBits("norm.weight", DType::kBF16, {256}, std::vector<uint16_t>(256));
  WriteModel(dir.path(), std::move(t));
  auto model = Exl3Model::Open(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  const Exl3LinearInfo* l = (*model)->FindLinear("a.proj");
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->k, 256);
  EXPECT_EQ(l->n, 128);
  EXPECT_EQ(l->bits, 5);
  EXPECT_EQ(l->codebook, Codebook::kMul1);
  EXPECT_TRUE(l->has_bias);
  EXPECT_FALSE(l->legacy_signs);
  ASSERT_EQ((*model)->plain_tensors().size(), 1u);
  EXPECT_EQ((*model)->plain_tensors()[0].name, "norm.weight");
  EXPECT_DOUBLE_EQ((*model)->AverageBitsPerWeight(true), 5.0);
  auto data = (*model)->LoadLinear("a.proj");
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(data->suh[0], 1.0f);
  EXPECT_EQ(data->svh[0], -1.0f);
}

// Found by the model-folder fuzzer (30-minute run): a quantization_config
// with a field of the wrong type ("quant_method": 3) threw out of Open (an
// abort). The advisory block is read leniently: wrong types are ignored.
TEST(Exl3ModelTest, AQuantizationConfigOfWrongTypesIsIgnoredNotACrash) {
  ScratchDir dir;
  WriteModel(dir.path(), ValidLinear("a.proj", 128, 128, 2),
             {{"architectures", {"TestOnly"}},
              {"quantization_config",
               {{"quant_method", 3}, {"version", {1, 2}}, {"codebook", nullptr},
                {"bits", 1e300}, {"head_bits", -1e300}}}});
  auto model = Exl3Model::Open(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  const QuantizationConfigSummary& q = (*model)->quantization_config();
  EXPECT_TRUE(q.present);
  EXPECT_EQ(q.quant_method, "");
  EXPECT_EQ(q.codebook, "");
  EXPECT_EQ(q.bits, 0.0);
  EXPECT_EQ(q.head_bits, 0);
}

TEST(Exl3ModelTest, NoMarkerMeans3InstAndMcgMarkerMeansMcg) {
  ScratchDir a, b;
  auto t = ValidLinear("x", 128, 128, 2);
  t.erase("x.mul1");
  WriteModel(a.path(), std::move(t));
  auto m = Exl3Model::Open(a.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->FindLinear("x")->codebook, Codebook::k3Inst);
  auto u = ValidLinear("x", 128, 128, 2);
  u.erase("x.mul1");
  u["x.mcg"] = TensorScalarInt32("x.mcg", kMcgMarkerValue);
  WriteModel(b.path(), std::move(u));
  m = Exl3Model::Open(b.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->FindLinear("x")->codebook, Codebook::kMcg);
}

struct BadCase {
  const char* name;
  std::function<void(std::map<std::string, TensorToWrite>&)> edit;
  const char* message;
};

class Exl3ModelBadTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(Exl3ModelBadTest, RejectsWithDataLossNamingTheProblem) {
  ScratchDir dir;
  auto t = ValidLinear("m.proj", 128, 256, 3);
  GetParam().edit(t);
  WriteModel(dir.path(), std::move(t));
  auto model = Exl3Model::Open(dir.path());
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kDataLoss) << model.status();
  EXPECT_THAT(std::string(model.status().message()), HasSubstr(GetParam().message));
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("model.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, Exl3ModelBadTest,
    ::testing::Values(
        BadCase{"BothMarkers",
                [](auto& t) { t["m.proj.mcg"] = TensorScalarInt32("m.proj.mcg", kMcgMarkerValue); },
                "both the mcg and the mul1 marker"},
        BadCase{"WrongMarkerValue",
                [](auto& t) { t["m.proj.mul1"] = TensorScalarInt32("m.proj.mul1", 12345); },
                "codebook marker holds 12345"},
        BadCase{"MarkerNotScalar",
                [](auto& t) {
                  t["m.proj.mul1"] = TensorFromInt32("m.proj.mul1", {1}, {kMul1MarkerValue});
                },
                "0-d I32"},
        BadCase{"TrellisNotI16",
                [](auto& t) {
                  t["m.proj.trellis"] = TensorFromHalfBits("m.proj.trellis", DType::kF16,
                                                           {8, 16, 48},
                                                           std::vector<uint16_t>(8 * 16 * 48));
                },
                "trellis must be I16"},
        BadCase{"KOutOfRange",
                [](auto& t) {
                  t["m.proj.trellis"] = TensorFromInt16("m.proj.trellis", {8, 16, 144},
                                                        std::vector<int16_t>(8 * 16 * 144));
                },
                "not 16*K for K in 1..8"},
        BadCase{"DimsNotMultipleOf128",
                [](auto& t) {
                  t["m.proj.trellis"] = TensorFromInt16("m.proj.trellis", {4, 16, 48},
                                                        std::vector<int16_t>(4 * 16 * 48));
                  t["m.proj.suh"] = TensorFromHalfBits("m.proj.suh", DType::kF16, {64},
                                                       std::vector<uint16_t>(64));
                },
                "multiples of 128"},
        BadCase{"SuhWrongLength",
                [](auto& t) {
                  t["m.proj.suh"] = TensorFromHalfBits("m.proj.suh", DType::kF16, {256},
                                                       std::vector<uint16_t>(256));
                },
                "expected F16 [128]"},
        BadCase{"MissingSvh", [](auto& t) { t.erase("m.proj.svh"); }, "has no `m.proj.svh`"},
        BadCase{"SignsWithoutTrellis",
                [](auto& t) {
                  t["other.suh"] = TensorFromHalfBits("other.suh", DType::kF16, {128},
                                                      std::vector<uint16_t>(128));
                },
                "`other.trellis` is missing"},
        BadCase{"BiasWrongLength",
                [](auto& t) {
                  t["m.proj.bias"] = TensorFromHalfBits("m.proj.bias", DType::kF16, {128},
                                                        std::vector<uint16_t>(128));
                },
                "bias must be F16 [256]"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(Exl3ModelTest, LegacySignBitsBecomePlusMinusOne) {
  ScratchDir dir;
  auto t = ValidLinear("s", 128, 128, 4);
  t.erase("s.suh");
  t.erase("s.svh");
  std::vector<int16_t> su(8, 0), sv(8, 0);
  su[0] = 0b101;                         // channels 0 and 2 negative
  sv[7] = static_cast<int16_t>(0x8000);  // channel 127 negative
  t["s.su"] = TensorFromInt16("s.su", {8}, su);
  t["s.sv"] = TensorFromInt16("s.sv", {8}, sv);
  WriteModel(dir.path(), std::move(t));
  auto model = Exl3Model::Open(dir.path());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE((*model)->FindLinear("s")->legacy_signs);
  auto data = (*model)->LoadLinear("s");
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(data->suh[0], -1.0f);
  EXPECT_EQ(data->suh[1], 1.0f);
  EXPECT_EQ(data->suh[2], -1.0f);
  EXPECT_EQ(data->svh[126], 1.0f);
  EXPECT_EQ(data->svh[127], -1.0f);
}

TEST(Exl3ModelTest, ChecksShapesAgainstTheArchitecture) {
  ScratchDir dir;
  nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                           {"hidden_size", 128},
                           {"intermediate_size", 256},
                           {"num_hidden_layers", 1},
                           {"num_attention_heads", 2},
                           {"vocab_size", 100}};
  std::map<std::string, TensorToWrite> t;
  auto add = [&](const std::string& p, int64_t k, int64_t n) {
    for (auto& [name, tensor] : ValidLinear(p, k, n, 2)) t[name] = std::move(tensor);
  };
  add("model.layers.0.self_attn.q_proj", 128, 128);
  add("model.layers.0.self_attn.k_proj", 128, 128);
  add("model.layers.0.self_attn.v_proj", 128, 128);
  add("model.layers.0.self_attn.o_proj", 128, 128);
  add("model.layers.0.mlp.gate_proj", 128, 256);
  add("model.layers.0.mlp.up_proj", 128, 256);
  add("model.layers.0.mlp.down_proj", 256, 128);
  add("lm_head", 128, 128);  // vocab 100 pads to 128
  t["model.embed_tokens.weight"] = TensorFromHalfBits("model.embed_tokens.weight", DType::kF16,
                                                      {100, 128}, std::vector<uint16_t>(12800));
  {
    ScratchDir ok_dir;
    std::map<std::string, TensorToWrite> copy;
    for (auto& [name, tensor] : t) copy[name] = tensor;
    WriteModel(ok_dir.path(), std::move(copy), config);
    auto model = Exl3Model::Open(ok_dir.path());
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_NE((*model)->FindLinear(0, LinearRole::kDown), nullptr);
    EXPECT_EQ((*model)->FindLinear(0, LinearRole::kDown)->k, 256);
    EXPECT_NE((*model)->FindLinear(-1, LinearRole::kHead), nullptr);
  }
  // down_proj stored transposed: config says 256 -> 128.
  for (auto& [name, tensor] : ValidLinear("model.layers.0.mlp.down_proj", 128, 256, 2)) {
    t[name] = std::move(tensor);
  }
  WriteModel(dir.path(), std::move(t), config);
  auto model = Exl3Model::Open(dir.path());
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("config.json implies 256 x 128"));
}

TEST(Exl3ModelTest, MissingConfigIsNotFound) {
  ScratchDir dir;
  auto model = Exl3Model::Open(dir.path());
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("config.json"));
}

}  // namespace
}  // namespace exl3serve::sharding
