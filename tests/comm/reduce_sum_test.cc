// Every SIMD variant of worker/comm/reduce_sum.h against the scalar
// reference (bit-exact), and the scalar bf16 rounding against an independent
// round-to-nearest-even written with doubles.
#include "worker/comm/reduce_sum.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"

namespace exl3serve::worker::comm {
namespace {

using kernels::cpu::CpuIsa;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// Independent RNE to bf16 for finite values below FLT_MAX / 2: pick the
// nearer of the two bf16 neighbours in double arithmetic, ties to the even one.
uint16_t ReferenceBF16(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((Bits(f) >> 16) | 0x40);
  const uint32_t lower = Bits(f) & 0xffff0000u;  // towards zero
  if (lower == Bits(f)) return static_cast<uint16_t>(lower >> 16);
  const uint32_t upper = lower + 0x10000u;  // next magnitude away from zero (finite here)
  const double d_lower = std::fabs(static_cast<double>(f) - static_cast<double>(FromBits(lower)));
  const double d_upper = std::fabs(static_cast<double>(f) - static_cast<double>(FromBits(upper)));
  if (d_lower < d_upper) return static_cast<uint16_t>(lower >> 16);
  if (d_upper < d_lower) return static_cast<uint16_t>(upper >> 16);
  return static_cast<uint16_t>(((lower >> 16) & 1) ? upper >> 16 : lower >> 16);
}

std::vector<float> Values(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::uniform_int_distribution<int> special(0, 63);
  std::vector<float> v(n);
  for (float& x : v) {
    switch (special(rng)) {
      case 0:
        x = std::numeric_limits<float>::quiet_NaN();
        break;
      case 1:
        x = -std::numeric_limits<float>::infinity();
        break;
      case 2:
        x = std::numeric_limits<float>::denorm_min() * static_cast<float>(special(rng) + 1);
        break;
      case 3:
        x = FromBits((static_cast<uint32_t>(special(rng)) << 16) | 0x3f808000u);  // a tie
        break;
      case 4:
        x = std::numeric_limits<float>::max();
        break;
      default:
        x = std::ldexp(unit(rng), exponent(rng));
    }
  }
  return v;
}

std::vector<CpuIsa> SupportedIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (kernels::cpu::CpuSupportsIsa(isa)) isas.push_back(isa);
  }
  return isas;
}

TEST(ReduceSumTest, ScalarBF16RoundingMatchesIndependentReference) {
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  for (float f : Values(rng, 200000)) {
    if (std::fabs(f) >= std::numeric_limits<float>::max() / 2) continue;  // reference is finite-only
    ASSERT_EQ(F32ToBF16(f), ReferenceBF16(f)) << "value bits 0x" << std::hex << Bits(f);
  }
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808000u)), 0x3f80);              // tie to even (down)
  EXPECT_EQ(F32ToBF16(FromBits(0x3f818000u)), 0x3f82);              // tie to even (up)
  EXPECT_EQ(F32ToBF16(FromBits(0x00000001u)), 0x0000);              // subnormal kept, rounds
  EXPECT_EQ(F32ToBF16(FromBits(0x00018000u)), 0x0002);
}

TEST(ReduceSumTest, SimdVariantsMatchScalarBitForBit) {
  const std::vector<CpuIsa> isas = SupportedIsas();
  if (isas.empty()) GTEST_SKIP() << "the CPU has neither AVX2 nor AVX-512";
  const uint64_t seed = ::testing::UnitTest::GetInstance()->random_seed();
  std::mt19937_64 rng(seed);
  for (int sources : {1, 2, 3, 4, 7, 8}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{31}, size_t{64},
                         size_t{65}, size_t{127}, size_t{1000}, size_t{4099}}) {
      std::vector<std::vector<float>> f32(sources);
      std::vector<std::vector<uint16_t>> bf16(sources);
      std::vector<const float*> f32_ptrs;
      std::vector<const uint16_t*> bf16_ptrs;
      for (int s = 0; s < sources; ++s) {
        f32[s] = Values(rng, count);
        for (float x : f32[s]) bf16[s].push_back(F32ToBF16(x));
        f32_ptrs.push_back(f32[s].data());
        bf16_ptrs.push_back(bf16[s].data());
      }
      std::vector<float> want_f32(count);
      std::vector<uint16_t> want_bf16(count);
      scalar::SumF32(f32_ptrs.data(), sources, want_f32.data(), count);
      scalar::SumBF16(bf16_ptrs.data(), sources, want_bf16.data(), count);
      for (CpuIsa isa : isas) {
        std::vector<float> got_f32(count, -1.0f);
        std::vector<uint16_t> got_bf16(count, 0xffff);
        if (isa == CpuIsa::kAvx2) {
          avx2::SumF32(f32_ptrs.data(), sources, got_f32.data(), count);
          avx2::SumBF16(bf16_ptrs.data(), sources, got_bf16.data(), count);
        } else {
          avx512::SumF32(f32_ptrs.data(), sources, got_f32.data(), count);
          avx512::SumBF16(bf16_ptrs.data(), sources, got_bf16.data(), count);
        }
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(Bits(got_f32[i]), Bits(want_f32[i]))
              << kernels::cpu::CpuIsaName(isa) << " f32, sources " << sources << ", count "
              << count << ", i " << i << ", seed " << seed;
          ASSERT_EQ(got_bf16[i], want_bf16[i])
              << kernels::cpu::CpuIsaName(isa) << " bf16, sources " << sources << ", count "
              << count << ", i " << i << ", seed " << seed;
        }
      }
    }
  }
}

TEST(ReduceSumTest, InPlaceIntoOneSourceMatchesOutOfPlace) {
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  const size_t count = 1031;
  std::vector<float> a = Values(rng, count), b = Values(rng, count), c = Values(rng, count);
  const float* srcs[] = {a.data(), b.data(), c.data()};
  std::vector<float> want(count);
  scalar::SumF32(srcs, 3, want.data(), count);
  SumInOrder(CommDataType::kF32, reinterpret_cast<const void* const*>(srcs), 3, b.data(), count);
  for (size_t i = 0; i < count; ++i) ASSERT_EQ(Bits(b[i]), Bits(want[i])) << i;
}

}  // namespace
}  // namespace exl3serve::worker::comm
