// Calibration: the captured Hessians are the model's real layer inputs, and
// converting with them lowers a layer's output error against identity
// (no-Hessian) quantization on held-out inputs (exl3-format.md §6.2, §6.4).
#include "worker/model/calibration.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "sharding/converter.h"
#include "sharding/exl3_model.h"
#include "sharding/safetensors.h"
#include "sharding/test_model.h"
#include "worker/model/transformer.h"
#include "tests/testing/scratch_dir.h"

namespace exl3serve::worker {
namespace {

using ::exl3serve::testing::ScratchDir;

sharding::TestModelOptions Model() {
  sharding::TestModelOptions o;
  o.arch = "llama";
  o.num_layers = 1;
  o.hidden_size = 128;
  o.intermediate_size = 256;
  o.vocab_size = 300;
  o.num_attention_heads = 2;
  o.num_key_value_heads = 1;
  o.seed = 5;
  return o;
}

std::vector<std::vector<int32_t>> RandomSequences(int count, int length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> out(count);
  for (auto& seq : out) {
    for (int i = 0; i < length; ++i) seq.push_back(static_cast<int32_t>(rng() % 300));
  }
  return out;
}

// Layer 0's attention input for `tokens`: RMSNorm(embedding) (float64),
// computed here from the checkpoint, independently of the runtime.
std::vector<double> Layer0Inputs(const std::string& dir, const std::vector<int32_t>& tokens) {
  auto ckpt = sharding::SafetensorsCheckpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok());
  auto read = [&](const char* name) {
    auto t = (*ckpt)->Find(name);
    return *t->file->ReadAsFloat(*t->info);
  };
  const std::vector<float> embed = read("model.embed_tokens.weight");
  const std::vector<float> norm = read("model.layers.0.input_layernorm.weight");
  const int64_t hidden = 128;
  std::vector<double> x(tokens.size() * hidden);
  for (size_t t = 0; t < tokens.size(); ++t) {
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += std::pow(embed[tokens[t] * hidden + i], 2);
    const double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
    for (int64_t i = 0; i < hidden; ++i) {
      x[t * hidden + i] = embed[tokens[t] * hidden + i] * inv * norm[i];
    }
  }
  return x;
}

TEST(CalibrationTest, CapturedHessianIsTheLayerInputGram) {
  ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("hf"), Model()).ok());
  const auto sequences = RandomSequences(3, 37, 1);
  auto hessians = CalibrationHessians::Collect(dir.File("hf"), sequences);
  ASSERT_TRUE(hessians.ok()) << hessians.status();
  EXPECT_EQ((*hessians)->tokens(), 3 * 37);

  sharding::LinearSpec q, k;
  q.key = "model.layers.0.self_attn.q_proj";
  k.key = "model.layers.0.self_attn.k_proj";
  auto hq = (*hessians)->InputHessian(q);
  auto hk = (*hessians)->InputHessian(k);
  ASSERT_TRUE(hq.ok() && hk.ok() && hq->has_value() && hk->has_value());
  EXPECT_EQ((*hq)->count, 3 * 37);
  EXPECT_EQ((*hq)->h, (*hk)->h);  // q/k/v read the same input

  std::vector<int32_t> all;
  for (const auto& s : sequences) all.insert(all.end(), s.begin(), s.end());
  const std::vector<double> x = Layer0Inputs(dir.File("hf"), all);
  double max_err = 0, max_abs = 0;
  for (int64_t i = 0; i < 128; ++i) {
    for (int64_t j = 0; j < 128; ++j) {
      double want = 0;
      for (size_t t = 0; t < all.size(); ++t) want += x[t * 128 + i] * x[t * 128 + j];
      want /= static_cast<double>(all.size());
      max_err = std::max(max_err, std::abs(want - (*hq)->h[i * 128 + j]));
      max_abs = std::max(max_abs, std::abs(want));
    }
  }
  EXPECT_LT(max_err, 1e-5 * max_abs) << "max |H - XᵀX/n| = " << max_err;
}

// GLM-4 MoE and DeepSeek-V3 (MLA): every quantized linear that every token
// runs — attention (q_a, q_b, kv_a, o for MLA), dense MLP, shared expert —
// gets a Hessian of all calibration tokens (the head: of each sequence's
// last); kv_a shares q_a's input.
// (Routed experts see only the tokens routed to them.)
TEST(CalibrationTest, MoeAndMlaModelsObserveSharedExpertsAndMlaProjections) {
  for (const sharding::TestModelOptions& o :
       {sharding::Glm4MoeTestDefaults(), sharding::DeepseekV3TestDefaults()}) {
    ScratchDir dir;
    ASSERT_TRUE(sharding::WriteTestModel(dir.File("hf"), o).ok());
    const auto sequences = RandomSequences(2, 21, 3);
    auto hessians = CalibrationHessians::Collect(dir.File("hf"), sequences);
    ASSERT_TRUE(hessians.ok()) << hessians.status();
    auto config = ReadModelConfig(dir.File("hf"));
    ASSERT_TRUE(config.ok());
    int checked = 0;
    for (const sharding::LinearSpec& l : config->arch.linears) {
      if (!l.quantized || l.expert >= 0) continue;
      auto h = (*hessians)->InputHessian(l);
      ASSERT_TRUE(h.ok()) << l.key << ": " << h.status();
      ASSERT_TRUE(h->has_value()) << o.arch << ": no Hessian for " << l.key;
      EXPECT_EQ((*h)->count, l.is_head ? 2 : 2 * 21) << l.key;  // the head: last rows only
      ++checked;
    }
    EXPECT_GT(checked, 10) << o.arch;
    if (o.arch == "deepseek-v3") {
      const sharding::LinearSpec* q_a = config->arch.Find(1, sharding::LinearRole::kQA);
      const sharding::LinearSpec* kv_a = config->arch.Find(1, sharding::LinearRole::kKVA);
      EXPECT_EQ((*(*hessians)->InputHessian(*q_a))->h, (*(*hessians)->InputHessian(*kv_a))->h);
    }
  }
}

// ||X·(W_eff - W)ᵀ|| / ||X·Wᵀ|| of q_proj on held-out layer-0 inputs X.
double OutputError(const std::string& hf, const std::string& exl3,
                   const std::vector<double>& x, int64_t rows) {
  auto model = sharding::Exl3Model::Open(exl3);
  EXPECT_TRUE(model.ok()) << model.status();
  auto data = (*model)->LoadLinear("model.layers.0.self_attn.q_proj");
  EXPECT_TRUE(data.ok());
  std::vector<double> w_eff(static_cast<size_t>(data->k * data->n));
  EXPECT_TRUE(kernels::ReconstructEffectiveWeight(data->view(), w_eff.data()).ok());
  auto ckpt = sharding::SafetensorsCheckpoint::Open(hf);
  auto t = (*ckpt)->Find("model.layers.0.self_attn.q_proj.weight");
  const std::vector<float> w = *t->file->ReadAsFloat(*t->info);  // (out=128, in=128)
  double err = 0, ref = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < 128; ++o) {
      double yq = 0, y = 0;
      for (int64_t i = 0; i < 128; ++i) {
        yq += x[r * 128 + i] * w_eff[i * data->n + o];
        y += x[r * 128 + i] * w[o * 128 + i];
      }
      err += (yq - y) * (yq - y);
      ref += y * y;
    }
  }
  return std::sqrt(err / ref);
}

TEST(CalibrationTest, CalibratedConversionLowersOutputError) {
  ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("hf"), Model()).ok());
  auto hessians = CalibrationHessians::Collect(dir.File("hf"), RandomSequences(8, 64, 2));
  ASSERT_TRUE(hessians.ok()) << hessians.status();

  sharding::ConvertOptions plain;
  plain.in_dir = dir.File("hf");
  plain.out_dir = dir.File("plain");
  plain.bits = 2.0;
  plain.threads = 2;
  plain.show_progress = false;
  sharding::ConvertOptions calibrated = plain;
  calibrated.out_dir = dir.File("calibrated");
  calibrated.hessians = hessians->get();
  calibrated.calibration_rows = 8;
  calibrated.calibration_cols = 64;
  ASSERT_TRUE(sharding::ConvertModel(plain).ok());
  auto report = sharding::ConvertModel(calibrated);
  ASSERT_TRUE(report.ok()) << report.status();
  // quantization_config.json records the calibration (rows = sequences,
  // cols = tokens per sequence), and 0 x 0 without it.
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string with_calib = read(dir.File("calibrated") + "/quantization_config.json");
  const std::string without_calib = read(dir.File("plain") + "/quantization_config.json");
  EXPECT_NE(with_calib.find("\"calibration\": {\n        \"rows\": 8,\n        \"cols\": 64"),
            std::string::npos) << with_calib;
  EXPECT_NE(without_calib.find("\"rows\": 0,\n        \"cols\": 0"), std::string::npos)
      << without_calib;

  const auto held_out = RandomSequences(1, 200, 99)[0];
  const std::vector<double> x = Layer0Inputs(dir.File("hf"), held_out);
  const double without = OutputError(dir.File("hf"), dir.File("plain"), x, 200);
  const double with = OutputError(dir.File("hf"), dir.File("calibrated"), x, 200);
  std::printf("q_proj output error on held-out inputs, K=2: identity Hessian %.4f, "
              "calibrated %.4f (%.1f %% lower)\n",
              without, with, 100.0 * (1.0 - with / without));
  EXPECT_LT(with, 0.95 * without);
}

TEST(CalibrationTest, RejectsTokensOutsideTheVocabulary) {
  ScratchDir dir;
  ASSERT_TRUE(sharding::WriteTestModel(dir.File("hf"), Model()).ok());
  auto hessians = CalibrationHessians::Collect(dir.File("hf"), {{1, 2, 300}});
  ASSERT_FALSE(hessians.ok());
  EXPECT_EQ(hessians.status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = CalibrationHessians::Collect(dir.File("hf"), {});
  EXPECT_FALSE(empty.ok());
}

}  // namespace
}  // namespace exl3serve::worker
