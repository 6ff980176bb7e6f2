// Known-answer tests for kernels/trellis_decode.h and kernels/trellis_lut.h:
// the anchors of exl3-format.md §1, §3.2, §3.4, §4.4 and §11. Everything here
// is bit-exact by definition (§1), so every comparison is exact except the RMS
// values, which the spec prints to 8 decimals.
#include <immintrin.h>
#include <openssl/sha.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels {
namespace {

// The spec prints RMS to 8 decimals; allow half a unit in the last place plus
// the double summation error (far smaller).
constexpr double kRmsTolerance = 5e-9 + 1e-12;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20240611u : static_cast<uint32_t>(seed);
}

std::string Sha256Hex(const std::vector<uint8_t>& bytes) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(bytes.data(), bytes.size(), digest);
  std::string hex;
  char buf[3];
  for (unsigned char b : digest) {
    std::snprintf(buf, sizeof buf, "%02x", b);
    hex += buf;
  }
  return hex;
}

struct LutAnchor {
  Codebook codebook;
  const char* sha256;
  double rms;
  float min_value;
  float max_value;
  size_t distinct_values;
  int positive_zero_states;  // exact cancellations (§4.1)
};

// exl3-format.md §1 table (min/max are the printed 6-digit values' fp16 originals).
const LutAnchor kLutAnchors[] = {
    {Codebook::k3Inst, "ad88de2dcff5bb05fff2faec37cceceb43aa1c2e8203f9d81a6fbd6dd3393eea",
     1.24371092, -3.95703125f, 3.97265625f, 10598, 9},
    {Codebook::kMcg, "95383563929baa9d1ae5de0be22490284382673620bdd85929feea7bdbef04a9",
     1.24411185, -3.94921875f, 3.94921875f, 10746, 12},
    {Codebook::kMul1, "bc48d02cb1c14939dc47b90f870dd689d63e3b1ab69a157e65538db68677a6c8",
     1.00031207, -3.453125f, 3.34765625f, 913, -1},
};

TEST(TrellisLutTest, Sha256OfEachTableMatchesSpecAnchor) {
  for (const LutAnchor& anchor : kLutAnchors) {
    SCOPED_TRACE(std::string(CodebookName(anchor.codebook)));
    const CodebookTable& table = GetCodebookTable(anchor.codebook);
    std::vector<uint8_t> bytes;
    bytes.reserve(2 * kNumStates);
    for (int s = 0; s < kNumStates; ++s) {  // little-endian uint16, indexed by state
      bytes.push_back(static_cast<uint8_t>(table.half_bits[s] & 0xFF));
      bytes.push_back(static_cast<uint8_t>(table.half_bits[s] >> 8));
    }
    EXPECT_EQ(Sha256Hex(bytes), anchor.sha256);
  }
}

TEST(TrellisLutTest, RmsRangeAndDistinctValuesMatchSpec) {
  for (const LutAnchor& anchor : kLutAnchors) {
    SCOPED_TRACE(std::string(CodebookName(anchor.codebook)));
    const CodebookTable& table = GetCodebookTable(anchor.codebook);
    EXPECT_NEAR(table.rms, anchor.rms, kRmsTolerance);
    float lo = table.value[0];
    float hi = table.value[0];
    std::set<uint16_t> distinct;
    for (int s = 0; s < kNumStates; ++s) {
      lo = std::min(lo, table.value[s]);
      hi = std::max(hi, table.value[s]);
      distinct.insert(table.half_bits[s]);
      EXPECT_EQ(table.value[s], HalfBitsToFloat(table.half_bits[s]));
    }
    EXPECT_EQ(lo, anchor.min_value);
    EXPECT_EQ(hi, anchor.max_value);
    EXPECT_EQ(distinct.size(), anchor.distinct_values);
  }
}

TEST(TrellisLutTest, CancellationsGivePositiveZeroNeverNegativeZero) {
  for (const LutAnchor& anchor : kLutAnchors) {
    if (anchor.positive_zero_states < 0) continue;  // mul1 never sums two halves
    SCOPED_TRACE(std::string(CodebookName(anchor.codebook)));
    const CodebookTable& table = GetCodebookTable(anchor.codebook);
    int positive_zero = 0;
    for (int s = 0; s < kNumStates; ++s) {
      EXPECT_NE(table.half_bits[s], 0x8000) << "state " << s;
      if (table.half_bits[s] == 0x0000) ++positive_zero;
    }
    EXPECT_EQ(positive_zero, anchor.positive_zero_states);
  }
}

TEST(TrellisDecodeTest, KnownAnswerTableOfSpecSection44) {
  struct Row {
    uint16_t state;
    uint16_t inst3, mcg, mul1;
  };
  const Row kRows[] = {
      {0x0000, 0x3A25, 0x3F60, 0xC2E8}, {0x0001, 0xBB5B, 0x304E, 0x3921},
      {0x0002, 0x3B74, 0xBA13, 0xB72D}, {0x0003, 0x34B6, 0x3AB8, 0x3239},
      {0x00FF, 0x3CD1, 0xBD26, 0x3AB3}, {0x1234, 0xC066, 0x3E0F, 0xB89E},
      {0x5555, 0xC139, 0xBCE6, 0x35B6}, {0x7FFF, 0xBA96, 0x4172, 0x3FCA},
      {0x8000, 0xB7F8, 0xB915, 0xBAF2}, {0xABCD, 0xB98E, 0x35E7, 0xBD42},
      {0xBEEF, 0x424B, 0xC293, 0x3124}, {0xFFFF, 0xB110, 0x3ACD, 0xB936},
  };
  for (const Row& row : kRows) {
    SCOPED_TRACE(testing::Message() << "state 0x" << std::hex << row.state);
    EXPECT_EQ(DecodeState(Codebook::k3Inst, row.state), row.inst3);
    EXPECT_EQ(DecodeState(Codebook::kMcg, row.state), row.mcg);
    EXPECT_EQ(DecodeState(Codebook::kMul1, row.state), row.mul1);
    EXPECT_EQ(GetCodebookTable(Codebook::k3Inst).half_bits[row.state], row.inst3);
    EXPECT_EQ(GetCodebookTable(Codebook::kMcg).half_bits[row.state], row.mcg);
    EXPECT_EQ(GetCodebookTable(Codebook::kMul1).half_bits[row.state], row.mul1);
  }
}

TEST(TrellisDecodeTest, Mul1MatchesItsExactRationalFormula) {
  // §4.3: w = RNE_fp16((1774 t - 905216) 2^-18), checked in double.
  for (int s = 0; s < kNumStates; ++s) {
    const uint32_t t = Mul1ByteSum(static_cast<uint16_t>(s));
    const double exact = (1774.0 * t - 905216.0) / 262144.0;
    ASSERT_EQ(DecodeMul1(static_cast<uint16_t>(s)), FloatToHalfBits(static_cast<float>(exact)))
        << "state " << s;
  }
}

// --- fp16 conversion against the hardware (F16C), §4.4 ---------------------

__attribute__((target("f16c"))) uint16_t F16cFloatToHalf(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("f16c"))) float F16cHalfToFloat(uint16_t h) { return _cvtsh_ss(h); }

bool HalfIsNan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

void ExpectSameHalf(float f, uint16_t want) {
  const uint16_t got = FloatToHalfBits(f);
  if (std::isnan(f)) {
    // Our conversion returns the canonical quiet NaN; F16C keeps payload bits.
    EXPECT_TRUE(HalfIsNan(got)) << std::hex << FloatBits(f);
    return;
  }
  EXPECT_EQ(got, want) << "float bits 0x" << std::hex << FloatBits(f) << " (" << f << ")";
}

TEST(HalfConversionTest, FloatToHalfMatchesF16cOnRandomFloats) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU lacks F16C; nothing to compare with";
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_int_distribution<uint32_t> half_range_bits(0x33000000u, 0x47800000u);  // 2^-25..2^16
  std::uniform_int_distribution<uint32_t> half_pattern(0, 0x7BFE);
  for (int i = 0; i < 1000000; ++i) {
    // Any float bit pattern (mostly out of fp16 range: overflow, underflow, NaN).
    const float a = BitsToFloat(any_bits(rng));
    ExpectSameHalf(a, F16cFloatToHalf(a));
    // Floats within and at the edges of the fp16 range, both signs.
    const float b = BitsToFloat(half_range_bits(rng) | (i & 1 ? 0x80000000u : 0u));
    ExpectSameHalf(b, F16cFloatToHalf(b));
    // Exact ties: halfway between two adjacent fp16 values (normal or subnormal).
    const uint16_t h = static_cast<uint16_t>(half_pattern(rng));
    const double mid = 0.5 * (static_cast<double>(HalfBitsToFloat(h)) +
                              static_cast<double>(HalfBitsToFloat(static_cast<uint16_t>(h + 1))));
    const float tie = static_cast<float>(mid);  // exact: fp16 ties need 12 bits
    ASSERT_EQ(static_cast<double>(tie), mid);
    ExpectSameHalf(tie, F16cFloatToHalf(tie));
    ExpectSameHalf(-tie, F16cFloatToHalf(-tie));
    if (HasFailure()) return;
  }
}

TEST(HalfConversionTest, EveryHalfRoundTripsThroughFloatAndMatchesF16c) {
  const bool have_f16c = __builtin_cpu_supports("f16c");
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t half = static_cast<uint16_t>(h);
    const float f = HalfBitsToFloat(half);
    if (HalfIsNan(half)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      EXPECT_TRUE(HalfIsNan(FloatToHalfBits(f))) << std::hex << h;
      continue;
    }
    EXPECT_EQ(FloatToHalfBits(f), half) << std::hex << h;
    if (have_f16c) {
      EXPECT_EQ(FloatBits(f), FloatBits(F16cHalfToFloat(half))) << std::hex << h;
    }
  }
}

// --- tile permutation, §3.2 and §11 ---------------------------------------

TEST(TilePermutationTest, MatchesSpecAnchors) {
  const int kFirst[16] = {0, 16, 128, 144, 8, 24, 136, 152, 32, 48, 160, 176, 40, 56, 168, 184};
  for (int j = 0; j < 16; ++j) EXPECT_EQ(TilePermutation(j), kFirst[j]) << "j=" << j;
  // Lane table of §3.2: (r, c) for u = 0..7.
  const std::pair<int, int> kLane0[8] = {{0, 0}, {1, 0}, {8, 0}, {9, 0},
                                         {0, 8}, {1, 8}, {8, 8}, {9, 8}};
  const std::pair<int, int> kLane3[8] = {{6, 0}, {7, 0}, {14, 0}, {15, 0},
                                         {6, 8}, {7, 8}, {14, 8}, {15, 8}};
  const std::pair<int, int> kLane31[8] = {{6, 7}, {7, 7}, {14, 7}, {15, 7},
                                          {6, 15}, {7, 15}, {14, 15}, {15, 15}};
  for (int u = 0; u < 8; ++u) {
    EXPECT_EQ(TilePermutation(u), 16 * kLane0[u].first + kLane0[u].second);
    EXPECT_EQ(TilePermutation(3 * 8 + u), 16 * kLane3[u].first + kLane3[u].second);
    EXPECT_EQ(TilePermutation(31 * 8 + u), 16 * kLane31[u].first + kLane31[u].second);
    // "lane + 4 repeats lane with c + 1"
    for (int lane = 0; lane + 4 < 32; ++lane) {
      EXPECT_EQ(TilePermutation((lane + 4) * 8 + u), TilePermutation(lane * 8 + u) + 1);
    }
  }
}

TEST(TilePermutationTest, IsABijectionOnTheTile) {
  std::array<int, kTileWeights> hits{};
  for (int j = 0; j < kTileWeights; ++j) {
    const int p = TilePermutation(j);
    ASSERT_GE(p, 0);
    ASSERT_LT(p, kTileWeights);
    ++hits[p];
  }
  for (int p = 0; p < kTileWeights; ++p) EXPECT_EQ(hits[p], 1) << "flat index " << p;
}

// --- packing worked examples, §3.4 -----------------------------------------

TEST(TrellisPackingTest, WorkedExampleK2) {
  uint8_t symbols[kTileWeights];
  for (int i = 0; i < kTileWeights; ++i) symbols[i] = static_cast<uint8_t>(i % 4);
  uint16_t tile[TileInt16Count(2)];
  PackTile(symbols, 2, tile);
  for (int v = 0; v < TileInt16Count(2); ++v) EXPECT_EQ(tile[v], 0x1B1B) << "int16 " << v;
  const uint16_t kStates[4] = {0x6C6C, 0xB1B1, 0xC6C6, 0x1B1B};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ReadTileState(tile, 2, i), kStates[i]) << "s_" << i;
  uint16_t states[kTileWeights];
  StatesFromSymbols(symbols, 2, states);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(states[i], kStates[i]) << "s_" << i;
}

TEST(TrellisPackingTest, WorkedExampleK3) {
  uint8_t symbols[kTileWeights];
  for (int i = 0; i < kTileWeights; ++i) symbols[i] = static_cast<uint8_t>(i % 8);
  uint16_t tile[TileInt16Count(3)];
  PackTile(symbols, 3, tile);
  const uint16_t kFirst[6] = {0x7705, 0x0539, 0x0539, 0x3977, 0x3977, 0x7705};
  for (int v = 0; v < 6; ++v) EXPECT_EQ(tile[v], kFirst[v]) << "int16 " << v;
  EXPECT_EQ(ReadTileState(tile, 3, 0), 0xCBB8);
  EXPECT_EQ(ReadTileState(tile, 3, 1), 0x5DC1);
  EXPECT_EQ(ReadTileState(tile, 3, 2), 0xEE0A);
  EXPECT_EQ(ReadTileState(tile, 3, 255), 0x3977);
  uint16_t states[kTileWeights];
  StatesFromSymbols(symbols, 3, states);
  EXPECT_EQ(states[0], 0xCBB8);
  EXPECT_EQ(states[1], 0x5DC1);
  EXPECT_EQ(states[2], 0xEE0A);
  EXPECT_EQ(states[255], 0x3977);
}

}  // namespace
}  // namespace exl3serve::kernels
