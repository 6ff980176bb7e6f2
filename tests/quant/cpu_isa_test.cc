// Tests of kernels/cpu/cpu_features.h (parsing, override, consistency).
#include "kernels/cpu/cpu_features.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace exl3serve::kernels::cpu {
namespace {

TEST(CpuIsaTest, ParsesTheFourSettings) {
  EXPECT_FALSE(ParseCpuIsa("auto")->has_value());
  EXPECT_EQ(**ParseCpuIsa("scalar"), CpuIsa::kScalar);
  EXPECT_EQ(**ParseCpuIsa("avx2"), CpuIsa::kAvx2);
  EXPECT_EQ(**ParseCpuIsa("avx512"), CpuIsa::kAvx512);
  auto bad = ParseCpuIsa("sse4");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("sse4"), std::string::npos);
}

TEST(CpuIsaTest, BestIsaIsSupportedAndImpliesLowerLevels) {
  const CpuIsa best = BestCpuIsa();
  EXPECT_TRUE(CpuSupportsIsa(best));
  EXPECT_TRUE(CpuSupportsIsa(CpuIsa::kScalar));
  if (CpuSupportsIsa(CpuIsa::kAvx512)) {
    EXPECT_TRUE(CpuSupportsIsa(CpuIsa::kAvx2));
  }
  const CpuFeatures& f = GetCpuFeatures();
  if (f.avx512f) {
    EXPECT_TRUE(f.os_saves_zmm);
  }
  std::printf("best ISA: %s\n", std::string(CpuIsaName(best)).c_str());
}

TEST(CpuIsaTest, OverridePinsAndResets) {
  const uint64_t g0 = CpuIsaOverrideGeneration();
  ASSERT_TRUE(SetCpuIsaOverride(CpuIsa::kScalar).ok());
  EXPECT_EQ(ActiveCpuIsa(), CpuIsa::kScalar);
  EXPECT_GT(CpuIsaOverrideGeneration(), g0);
  if (!CpuSupportsIsa(CpuIsa::kAvx512)) {
    EXPECT_EQ(SetCpuIsaOverride(CpuIsa::kAvx512).code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(ActiveCpuIsa(), CpuIsa::kScalar);
  }
  ASSERT_TRUE(SetCpuIsaOverride(std::nullopt).ok());
  EXPECT_EQ(ActiveCpuIsa(), BestCpuIsa());
}

}  // namespace
}  // namespace exl3serve::kernels::cpu
