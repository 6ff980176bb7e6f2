// worker/model/linear.h SetPrefillPrecision: an EXL3 linear runs kBf16 for
// m >= kPrefillMinRows and stays exact fp32 below; kInt8 is rejected.
#include <cmath>
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
#include "worker/model/linear.h"

namespace exl3serve::worker {
namespace {

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

}  // namespace
}  // namespace exl3serve::worker
