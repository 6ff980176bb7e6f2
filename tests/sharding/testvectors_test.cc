// The shared EXL3 test vectors (shared/testdata/exl3): every checkpoint is
// loaded through Exl3Model and decoded; states and the fp16 inner matrix must
// be identical, the effective weight and the forward within fp32 rounding.
#include <cmath>
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/shared_data.h"
#include "gtest/gtest.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"
#include "sharding/exl3_model.h"
#include "sharding/safetensors.h"

namespace exl3serve::sharding {
namespace {

namespace fs = std::filesystem;

// W_eff and y are fp32 results of the same math with other operation orders:
// allow a few fp32 ulps of the largest magnitude involved.
constexpr double kWeightRelTolerance = 2e-6;
constexpr double kForwardRelTolerance = 2e-5;  // sums over k=128..384 terms

std::vector<std::string> TestVectorDirs() {
  std::vector<std::string> dirs;
  const fs::path root = fs::path(testing::SharedDir()) / "testdata" / "exl3";
  std::error_code ec;  // a missing shared/ must fail the coverage test, not abort discovery
  for (const auto& entry : fs::recursive_directory_iterator(root, ec)) {
    if (entry.is_regular_file() && entry.path().filename() == "expected.safetensors") {
      dirs.push_back(entry.path().parent_path().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

class TestVectorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TestVectorTest, DecodesBitExactlyAndReconstructsWithinRounding) {
  const std::string dir = GetParam();
  SCOPED_TRACE(dir);
  auto model = Exl3Model::Open(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->linears().size(), 1u);
  const Exl3LinearInfo& info = (*model)->linears()[0];
  EXPECT_EQ(info.key, "layer.proj");
  EXPECT_TRUE(info.has_bias);

  auto expected = SafetensorsFile::Open(dir + "/expected.safetensors");
  ASSERT_TRUE(expected.ok()) << expected.status();
  const auto& meta = (*expected)->metadata();
  // The legacy-signs vector records no K in its metadata; its name does (k4_...).
  const int want_bits = meta.count("K") ? std::stoi(meta.at("K"))
                                        : fs::path(dir).filename().string()[1] - '0';
  EXPECT_EQ(info.bits, want_bits);
  EXPECT_EQ(kernels::CodebookName(info.codebook), meta.at("codebook"));
  EXPECT_EQ(info.legacy_signs, dir.find("legacy_su_sv") != std::string::npos);

  auto data = (*model)->LoadLinear("layer.proj");
  ASSERT_TRUE(data.ok()) << data.status();
  const int64_t k = data->k, n = data->n;

  // States: identical.
  auto want_states = (*expected)->ReadAsUint16(*(*expected)->Find("states"));
  ASSERT_TRUE(want_states.ok());
  std::vector<uint16_t> states(static_cast<size_t>(k * n), 0xDEAD);
  ASSERT_TRUE(kernels::UnpackTensorStates(data->trellis.data(), k, n, data->bits, states.data()).ok());
  EXPECT_EQ(states, *want_states);

  // Inner matrix: identical fp16 bits.
  auto want_inner = (*expected)->ReadAsUint16(*(*expected)->Find("inner_f16"));
  ASSERT_TRUE(want_inner.ok());
  std::vector<uint16_t> inner(static_cast<size_t>(k * n), 0xDEAD);
  ASSERT_TRUE(kernels::DecodeInnerMatrix(data->view(), inner.data()).ok());
  EXPECT_EQ(inner, *want_inner);

  // Effective weight within fp32 rounding.
  auto want_weff = (*expected)->ReadAsFloat(*(*expected)->Find("weight_eff_in_out"));
  ASSERT_TRUE(want_weff.ok());
  std::vector<float> weff(static_cast<size_t>(k * n), NAN);
  ASSERT_TRUE(kernels::ReconstructEffectiveWeight(data->view(), weff.data()).ok());
  double max_abs = 0.0, max_diff = 0.0;
  for (size_t i = 0; i < weff.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(static_cast<double>((*want_weff)[i])));
    max_diff = std::max(max_diff, std::abs(static_cast<double>(weff[i]) - (*want_weff)[i]));
  }
  EXPECT_LE(max_diff, kWeightRelTolerance * max_abs) << "max |diff| " << max_diff;

  // Forward y = x·W + b within fp32 rounding.
  auto x = (*expected)->ReadAsFloat(*(*expected)->Find("x"));
  auto want_y = (*expected)->ReadAsFloat(*(*expected)->Find("y"));
  ASSERT_TRUE(x.ok() && want_y.ok());
  const int64_t m = static_cast<int64_t>(x->size()) / k;
  std::vector<float> y(static_cast<size_t>(m * n), NAN);
  ASSERT_TRUE(kernels::ReferenceForward(data->view(), x->data(), m, y.data()).ok());
  double y_abs = 0.0, y_diff = 0.0;
  for (size_t i = 0; i < y.size(); ++i) {
    y_abs = std::max(y_abs, std::abs(static_cast<double>((*want_y)[i])));
    y_diff = std::max(y_diff, std::abs(static_cast<double>(y[i]) - (*want_y)[i]));
  }
  EXPECT_LE(y_diff, kForwardRelTolerance * y_abs) << "max |diff| " << y_diff;
}

INSTANTIATE_TEST_SUITE_P(SharedVectors, TestVectorTest, ::testing::ValuesIn(TestVectorDirs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = fs::path(info.param).parent_path().filename().string() +
                                              "_" + fs::path(info.param).filename().string();
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

// Without ../shared (a user's clone) SharedVectors has no instances.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TestVectorTest);

TEST(TestVectorSetTest, CoversEveryKAndCodebook) {
  EXL3_REQUIRE_SHARED(vectors, "testdata/exl3");
  std::set<std::string> seen;
  const std::vector<std::string> dirs = TestVectorDirs();
  for (const std::string& dir : dirs) seen.insert(fs::path(dir).filename().string());
  for (int k = 1; k <= 8; ++k) EXPECT_TRUE(seen.count("k" + std::to_string(k) + "_mul1")) << k;
  EXPECT_TRUE(seen.count("k2_mcg") && seen.count("k4_3inst"));
  EXPECT_GE(dirs.size(), 16u) << "shared test vectors not found under " << testing::SharedDir()
                              << "/testdata/exl3 (../shared beside the checkout)";
}

}  // namespace
}  // namespace exl3serve::sharding
