// Our quantizer against exllamav3 on the same source layers: the shared test
// vectors record, for each source layer, the relative Frobenius error of the
// EXL3 checkpoint exllamav3's quantizer produced (index.json rel_frob_err).
// Quantizing the same bf16 source with our converter pipeline (regularise,
// Viterbi, pack, decode from the stored tensors) must reach that quality.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/testing/shared_data.h"
#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"
#include "nlohmann/json.hpp"
#include "sharding/quant/quantize_linear.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

namespace fs = std::filesystem;

// exllamav3 quantized these vectors with a Hessian (it minimises output error,
// not weight error); ours runs without one here and minimises weight error
// directly, so it should not be worse. 3 % slack covers seed-to-seed noise of
// the random sign vectors on layers of only 64-384 tiles.
constexpr double kAllowedRatio = 1.03;

struct Case {
  std::string set;
  std::string dir;
  int bits;
  std::string codebook;
  double exllamav3_error;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const fs::path root = fs::path(testing::SharedDir()) / "testdata" / "exl3";
  std::error_code ec;  // a missing shared/ is reported by testvectors_test
  for (const auto& set : fs::directory_iterator(root, ec)) {
    const fs::path index = set.path() / "index.json";
    if (!fs::exists(index)) continue;
    auto json = ReadJsonFile(index.string());
    if (!json.ok()) continue;
    for (const auto& entry : *json) {
      cases.push_back(Case{set.path().string(), entry["dir"].get<std::string>(),
                           entry["K"].get<int>(), entry["codebook"].get<std::string>(),
                           entry["rel_frob_err"].get<double>()});
    }
  }
  return cases;
}

class QualityVsExllamav3Test : public ::testing::TestWithParam<Case> {};
// Without ../shared (a user's clone) SharedVectors has no instances.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(QualityVsExllamav3Test);

TEST_P(QualityVsExllamav3Test, RelativeErrorIsNoWorse) {
  const Case& c = GetParam();
  auto source = SafetensorsFile::Open(c.set + "/source.safetensors");
  ASSERT_TRUE(source.ok()) << source.status();
  const TensorInfo* info = (*source)->Find("layer.proj.weight");
  ASSERT_NE(info, nullptr);
  auto w = (*source)->ReadAsFloat(*info);
  ASSERT_TRUE(w.ok());
  const int64_t out = info->shape[0], in = info->shape[1];

  quant::QuantizeLinearOptions opt;
  opt.bits = c.bits;
  ASSERT_TRUE(kernels::ParseCodebookName(c.codebook, &opt.codebook));
  opt.seed = 0;
  opt.threads = 2;
  auto q = quant::QuantizeLinear(w->data(), out, in, opt, nullptr);
  ASSERT_TRUE(q.ok()) << q.status();

  // Error of what would be stored: pack, then rebuild W_eff from the trellis.
  std::vector<uint16_t> trellis(static_cast<size_t>(in * out / 256 * 16 * c.bits));
  ASSERT_TRUE(kernels::PackTensorStates(q->states.data(), in, out, c.bits, trellis.data()).ok());
  std::vector<float> suh(in), svh(out);
  for (int64_t i = 0; i < in; ++i) suh[i] = kernels::HalfBitsToFloat(q->suh[i]);
  for (int64_t i = 0; i < out; ++i) svh[i] = kernels::HalfBitsToFloat(q->svh[i]);
  kernels::Exl3LinearView view{trellis.data(), in, out, c.bits, opt.codebook,
                               suh.data(), svh.data(), nullptr};
  std::vector<float> w_eff(static_cast<size_t>(in * out));
  ASSERT_TRUE(kernels::ReconstructEffectiveWeight(view, w_eff.data()).ok());
  double err = 0, ref = 0;
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      const double d = static_cast<double>(w_eff[i * out + o]) - (*w)[o * in + i];
      err += d * d;
      ref += static_cast<double>((*w)[o * in + i]) * (*w)[o * in + i];
    }
  }
  const double ours = std::sqrt(err / ref);
  std::printf("%-22s K=%d %-5s  exllamav3 %.5f  ours %.5f  ratio %.3f\n", c.dir.c_str(), c.bits,
              c.codebook.c_str(), c.exllamav3_error, ours, ours / c.exllamav3_error);
  EXPECT_LE(ours, kAllowedRatio * c.exllamav3_error);
  EXPECT_NEAR(ours, q->relative_frobenius_error, 0.02 * ours + 1e-4);
}

INSTANTIATE_TEST_SUITE_P(SharedVectors, QualityVsExllamav3Test, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name =
                               fs::path(info.param.set).filename().string() + "_" + info.param.dir;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace exl3serve::sharding
