// ConvertModel end to end on small random HF models: the output loads as an
// EXL3 model with every linear at its allocated K, reproduces the source
// within the quantizer's error, resumes after an interruption to the same
// bytes, and refuses bad input with a clear message.
#include "sharding/converter.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/scratch_dir.h"
#include "nlohmann/json.hpp"
#include "sharding/exl3_model.h"
#include "sharding/inspect.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"
#include "sharding/test_model.h"

namespace exl3serve::sharding {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using ::exl3serve::testing::ScratchDir;

TestModelOptions SmallLlama() {
  TestModelOptions o;
  o.arch = "llama";
  o.num_layers = 1;
  o.hidden_size = 128;
  o.intermediate_size = 320;  // pads to 384
  o.vocab_size = 200;         // pads to 256
  o.num_attention_heads = 2;
  o.num_key_value_heads = 1;
  o.seed = 11;
  return o;
}

ConvertOptions Options(const std::string& in, const std::string& out, double bits) {
  ConvertOptions c;
  c.in_dir = in;
  c.out_dir = out;
  c.bits = bits;
  c.threads = 2;
  c.show_progress = false;
  return c;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// ||A - B|| / ||B|| of the dequantized layer against the source weight.
double RelativeErrorAgainstSource(const Exl3Model& model, const SafetensorsCheckpoint& source,
                                  const std::string& key) {
  auto deq = DequantizeWeight(model, key);
  EXPECT_TRUE(deq.ok()) << deq.status();
  auto src = source.Find(key + ".weight");
  EXPECT_TRUE(src.has_value());
  auto w = src->file->ReadAsFloat(*src->info);
  EXPECT_TRUE(w.ok());
  EXPECT_EQ(deq->values.size(), w->size());
  double err = 0, ref = 0;
  for (size_t i = 0; i < w->size(); ++i) {
    err += std::pow(static_cast<double>(deq->values[i]) - (*w)[i], 2);
    ref += std::pow(static_cast<double>((*w)[i]), 2);
  }
  return std::sqrt(err / ref);
}

TEST(ConverterTest, ConvertsALlamaThatLoadsBackAtTheAllocatedBits) {
  ScratchDir tmp;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), SmallLlama()).ok());
  auto report = ConvertModel(Options(tmp.File("hf"), tmp.File("out"), 3.5));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_NEAR(report->bits_achieved, 3.5, 0.26);
  EXPECT_LE(report->bits_achieved, 3.5);
  EXPECT_EQ(report->shards, 1);

  auto model = Exl3Model::Open(tmp.File("out"));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->arch().has_value());
  EXPECT_EQ((*model)->linears().size(), 7u + 1);
  for (const ConvertedLinear& r : report->linears) {
    const Exl3LinearInfo* info = (*model)->FindLinear(r.key);
    ASSERT_NE(info, nullptr) << r.key;
    EXPECT_EQ(info->bits, r.bits) << r.key;
    EXPECT_EQ(info->codebook, Codebook::kMul1);
    // The error stays in the band of the Gaussian distortion-rate bound:
    // MSE·4^K ≈ 1 means relative error ≈ 2^-K; allow outliers/fp16 slack.
    EXPECT_LT(r.relative_error, 1.6 * std::pow(2.0, -r.bits)) << r.key << " K=" << r.bits;
    EXPECT_GT(r.relative_error, 0.0);
  }
  const Exl3LinearInfo* head = (*model)->FindLinear("lm_head");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->bits, kDefaultHeadBits);
  EXPECT_EQ(head->n, 256);  // vocab 200 padded
  EXPECT_EQ((*model)->FindLinear(0, LinearRole::kGate)->n, 384);

  // quantization_config (§2.2) and the copied files.
  auto config = ReadJsonFile(tmp.File("out/config.json"));
  ASSERT_TRUE(config.ok());
  const auto& qc = (*config)["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "exl3");
  EXPECT_EQ(qc["codebook"], "mul1");
  EXPECT_EQ(qc["head_bits"], 6);
  EXPECT_NEAR(qc["bits"].get<double>(), report->bits_achieved, 0.005);
  EXPECT_TRUE(fs::exists(tmp.File("out/generation_config.json")));
  EXPECT_TRUE(fs::exists(tmp.File("out/quantization_config.json")));
  EXPECT_FALSE(fs::exists(tmp.File("out/.exl3-work")));

  // Embedding and norms carried over in bf16 (§2.5).
  const PlainTensorInfo* embed = (*model)->FindPlain("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->dtype, DType::kBF16);
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{200, 128}));
  EXPECT_NE((*model)->FindPlain("model.layers.0.post_attention_layernorm.weight"), nullptr);

  // inspect --dequant round trip: error against the source matches the report.
  auto source = SafetensorsCheckpoint::Open(tmp.File("hf"));
  ASSERT_TRUE(source.ok());
  for (const char* key : {"model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"}) {
    const ConvertedLinear* r = nullptr;
    for (const auto& l : report->linears) {
      if (l.key == key) r = &l;
    }
    ASSERT_NE(r, nullptr);
    EXPECT_NEAR(RelativeErrorAgainstSource(**model, **source, key), r->relative_error, 1e-4)
        << key;
  }
}

TEST(ConverterTest, TiedEmbeddingIsClonedIntoAQuantizedHead) {
  ScratchDir tmp;
  TestModelOptions o = SmallLlama();
  o.tie_word_embeddings = true;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), o).ok());
  auto report = ConvertModel(Options(tmp.File("hf"), tmp.File("out"), 4.0));
  ASSERT_TRUE(report.ok()) << report.status();
  auto model = Exl3Model::Open(tmp.File("out"));
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_NE((*model)->FindLinear("lm_head"), nullptr);
  auto source = SafetensorsCheckpoint::Open(tmp.File("hf"));
  auto deq = DequantizeWeight(**model, "lm_head");
  ASSERT_TRUE(deq.ok());
  EXPECT_EQ(deq->shape, (std::vector<int64_t>{200, 128}));
  auto embed = (*source)->Find("model.embed_tokens.weight");
  auto w = embed->file->ReadAsFloat(*embed->info);
  double err = 0, ref = 0;
  for (size_t i = 0; i < w->size(); ++i) {
    err += std::pow(deq->values[i] - (*w)[i], 2);
    ref += std::pow((*w)[i], 2);
  }
  EXPECT_LT(std::sqrt(err / ref), 0.05);  // K = 6
}

TEST(ConverterTest, HeadBits16KeepsAnFp16HeadAndMoeRouterStaysFp16) {
  ScratchDir tmp;
  TestModelOptions o = SmallLlama();
  o.arch = "qwen3-moe";
  o.num_experts = 3;
  o.moe_intermediate_size = 128;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), o).ok());
  ConvertOptions c = Options(tmp.File("hf"), tmp.File("out"), 2.0);
  c.head_bits = 16;
  c.codebook = Codebook::kMcg;
  auto report = ConvertModel(c);
  ASSERT_TRUE(report.ok()) << report.status();
  auto model = Exl3Model::Open(tmp.File("out"));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->FindLinear("lm_head"), nullptr);
  const PlainTensorInfo* head = (*model)->FindPlain("lm_head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->dtype, DType::kF16);
  EXPECT_EQ(head->shape, (std::vector<int64_t>{256, 128}));
  const PlainTensorInfo* router = (*model)->FindPlain("model.layers.0.mlp.gate.weight");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->dtype, DType::kF16);
  EXPECT_EQ(router->shape, (std::vector<int64_t>{3, 128}));  // unpadded
  const Exl3LinearInfo* expert = (*model)->FindLinear(0, LinearRole::kDown, 2);
  ASSERT_NE(expert, nullptr);
  EXPECT_EQ(expert->codebook, Codebook::kMcg);
  EXPECT_EQ(expert->bits, 2);
  EXPECT_NE((*model)->FindPlain("model.layers.0.self_attn.q_norm.weight"), nullptr);
}

TEST(ConverterTest, ShardedInputAndOutputWithIndex) {
  ScratchDir tmp;
  TestModelOptions o = SmallLlama();
  o.num_shards = 3;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), o).ok());
  ConvertOptions c = Options(tmp.File("hf"), tmp.File("out"), 2.5);
  c.max_shard_bytes = 0;  // invalid
  auto bad = ConvertModel(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  c.max_shard_bytes = 100 << 10;  // ~0.1-0.2 MiB per layer: several shards
  auto report = ConvertModel(c);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_GT(report->shards, 1);
  EXPECT_TRUE(fs::exists(tmp.File("out/model.safetensors.index.json")));
  EXPECT_TRUE(fs::exists(tmp.File("out/model-00001-of-0000") + std::to_string(report->shards) +
                         ".safetensors"));
  auto model = Exl3Model::Open(tmp.File("out"));
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->linears().size(), 7u + 1);
}

// A provider that fails on its Nth call: an interruption half-way through.
class InterruptingProvider : public HessianProvider {
 public:
  explicit InterruptingProvider(int fail_at) : fail_at_(fail_at) {}
  absl::StatusOr<std::optional<MeanHessian>> InputHessian(const LinearSpec&) override {
    if (++calls_ == fail_at_) return absl::CancelledError("interrupted for the test");
    return std::optional<MeanHessian>();
  }

 private:
  int fail_at_;
  int calls_ = 0;
};

TEST(ConverterTest, ResumeAfterInterruptionGivesIdenticalFiles) {
  ScratchDir tmp;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), SmallLlama()).ok());
  InterruptingProvider never(-1);
  ConvertOptions straight = Options(tmp.File("hf"), tmp.File("straight"), 3.0);
  straight.hessians = &never;
  ASSERT_TRUE(ConvertModel(straight).ok());

  InterruptingProvider interrupt(6);  // in layer 0's MLP group (q, k, v, o, gate, up...)
  ConvertOptions c = Options(tmp.File("hf"), tmp.File("resumed"), 3.0);
  c.hessians = &interrupt;
  auto first = ConvertModel(c);
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(fs::exists(tmp.File("resumed/config.json")));

  // Without --resume the half-done directory is refused.
  InterruptingProvider fine(-1);
  c.hessians = &fine;
  auto refused = ConvertModel(c);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--resume"));

  // Other options are refused on resume.
  c.resume = true;
  c.bits = 4.0;
  auto mismatch = ConvertModel(c);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("other options"));

  c.bits = 3.0;
  auto resumed = ConvertModel(c);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->resumed_groups, 1);  // layer 0 attention
  EXPECT_EQ(ReadAll(tmp.File("straight/model.safetensors")),
            ReadAll(tmp.File("resumed/model.safetensors")));
}

TEST(ConverterTest, RefusesBadInputWithClearErrors) {
  ScratchDir tmp;
  ASSERT_TRUE(WriteTestModel(tmp.File("hf"), SmallLlama()).ok());

  auto missing_dir = ConvertModel(Options(tmp.File("nope"), tmp.File("out"), 4));
  EXPECT_EQ(missing_dir.status().code(), absl::StatusCode::kNotFound);

  auto bad_bits = ConvertModel(Options(tmp.File("hf"), tmp.File("out"), 9));
  EXPECT_EQ(bad_bits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_bits.status().message()), HasSubstr("--bits"));

  // A tensor missing from the checkpoint.
  auto ckpt = SafetensorsCheckpoint::Open(tmp.File("hf"));
  ASSERT_TRUE(ckpt.ok());
  std::vector<TensorToWrite> kept;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    if (name == "model.layers.0.mlp.up_proj.weight") continue;
    auto t = (*ckpt)->Find(name);
    std::vector<uint8_t> bytes(t->info->ByteSize());
    t->file->ReadTensorBytes(*t->info, bytes.data());
    kept.push_back(TensorFromBytes(name, t->info->dtype, t->info->shape, std::move(bytes)));
  }
  fs::create_directories(tmp.File("broken"));
  ASSERT_TRUE(WriteSafetensorsFile(tmp.File("broken/model.safetensors"), std::move(kept), {}).ok());
  fs::copy_file(tmp.File("hf/config.json"), tmp.File("broken/config.json"));
  auto missing = ConvertModel(Options(tmp.File("broken"), tmp.File("out2"), 4));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("model.layers.0.mlp.up_proj.weight"));
  EXPECT_FALSE(fs::exists(tmp.File("out2/config.json")));

  // A config that disagrees with the tensors.
  auto config = ReadJsonFile(tmp.File("hf/config.json"));
  (*config)["intermediate_size"] = 256;
  fs::create_directories(tmp.File("misshaped"));
  fs::copy_file(tmp.File("hf/model.safetensors"), tmp.File("misshaped/model.safetensors"));
  ASSERT_TRUE(WriteFileAtomically(tmp.File("misshaped/config.json"), config->dump()).ok());
  auto misshaped = ConvertModel(Options(tmp.File("misshaped"), tmp.File("out3"), 4));
  ASSERT_FALSE(misshaped.ok());
  EXPECT_EQ(misshaped.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(misshaped.status().message()), HasSubstr("config.json implies"));

  // An existing, non-empty output directory.
  fs::create_directories(tmp.File("busy"));
  std::ofstream(tmp.File("busy/something")) << "x";
  auto busy = ConvertModel(Options(tmp.File("hf"), tmp.File("busy"), 4));
  ASSERT_FALSE(busy.ok());
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(busy.status().message()), HasSubstr("not empty"));
}

}  // namespace
}  // namespace exl3serve::sharding
