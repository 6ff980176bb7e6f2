// Round trips and invariants of kernels/trellis_pack.h (exl3-format.md
// §3.3-3.4, §11): symbols -> tail-biting states -> packed tile -> states.
// All comparisons are exact: packing is pure bit manipulation.
#include "kernels/trellis_pack.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {
namespace {

constexpr int kTilesPerBitWidth = 500;

uint32_t TestSeed() {
  const int seed = ::testing::UnitTest::GetInstance()->random_seed();
  return seed == 0 ? 20240611u : static_cast<uint32_t>(seed);
}

void RandomSymbols(std::mt19937& rng, int bits, uint8_t symbols[kTileWeights]) {
  std::uniform_int_distribution<int> symbol(0, (1 << bits) - 1);
  for (int i = 0; i < kTileWeights; ++i) symbols[i] = static_cast<uint8_t>(symbol(rng));
}

TEST(TrellisPackTest, RandomSymbolsRoundTripThroughPackedTilesForEveryK) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    SCOPED_TRACE(testing::Message() << "K=" << bits);
    for (int t = 0; t < kTilesPerBitWidth; ++t) {
      uint8_t symbols[kTileWeights];
      RandomSymbols(rng, bits, symbols);
      uint16_t states[kTileWeights];
      StatesFromSymbols(symbols, bits, states);
      ASSERT_TRUE(IsTailBiting(states, bits));

      std::vector<uint16_t> tile(TileInt16Count(bits));
      PackTile(symbols, bits, tile.data());
      uint16_t unpacked[kTileWeights];
      UnpackTileStates(tile.data(), bits, unpacked);
      for (int i = 0; i < kTileWeights; ++i) ASSERT_EQ(unpacked[i], states[i]) << "tile " << t << " s_" << i;

      uint8_t symbols_back[kTileWeights];
      ASSERT_TRUE(SymbolsFromStates(unpacked, bits, symbols_back));
      for (int i = 0; i < kTileWeights; ++i) ASSERT_EQ(symbols_back[i], symbols[i]);

      std::vector<uint16_t> tile_from_states(TileInt16Count(bits));
      ASSERT_TRUE(PackTileStates(states, bits, tile_from_states.data()));
      ASSERT_EQ(tile_from_states, tile);
    }
  }
}

TEST(TrellisPackTest, StateIsTheSixteenStreamBitsEndingWithItsSymbol) {
  // Independent bit-level model of §3.4: build the stream bit by bit and read
  // each state's window directly, for every K.
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    SCOPED_TRACE(testing::Message() << "K=" << bits);
    uint8_t symbols[kTileWeights];
    RandomSymbols(rng, bits, symbols);
    const int stream_bits = kTileWeights * bits;
    std::vector<int> stream(stream_bits);
    for (int b = 0; b < stream_bits; ++b) stream[b] = (symbols[b / bits] >> (bits - 1 - b % bits)) & 1;
    std::vector<uint16_t> tile(TileInt16Count(bits));
    PackTile(symbols, bits, tile.data());
    for (int j = 0; j < 8 * bits; ++j) {  // word j: stream bits 32j.. MSB first, low half first
      uint32_t word = 0;
      for (int b = 0; b < 32; ++b) word = (word << 1) | static_cast<uint32_t>(stream[32 * j + b]);
      ASSERT_EQ(tile[2 * j], word & 0xFFFFu) << "word " << j;
      ASSERT_EQ(tile[2 * j + 1], word >> 16) << "word " << j;
    }
    uint16_t states[kTileWeights];
    StatesFromSymbols(symbols, bits, states);
    for (int i = 0; i < kTileWeights; ++i) {
      const int first = (((i + 1) * bits - 16) % stream_bits + stream_bits) % stream_bits;
      uint32_t window = 0;
      for (int b = 0; b < 16; ++b) window = (window << 1) | static_cast<uint32_t>(stream[(first + b) % stream_bits]);
      ASSERT_EQ(states[i], window) << "s_" << i;
    }
  }
}

TEST(TrellisPackTest, TailBitingInvariantHoldsIncludingTheWrap) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    uint8_t symbols[kTileWeights];
    RandomSymbols(rng, bits, symbols);
    uint16_t states[kTileWeights];
    StatesFromSymbols(symbols, bits, states);
    const uint32_t low_mask = (1u << (16 - bits)) - 1u;
    EXPECT_EQ(states[0] >> bits, states[255] & low_mask) << "K=" << bits;
    for (int i = 1; i < kTileWeights; ++i) {
      ASSERT_EQ(states[i] >> bits, states[i - 1] & low_mask) << "K=" << bits << " i=" << i;
      ASSERT_EQ(states[i] & ((1u << bits) - 1u), symbols[i]);
    }
  }
}

TEST(TrellisPackTest, CorruptedStateSequenceIsRejected) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> position(0, kTileWeights - 1);
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    SCOPED_TRACE(testing::Message() << "K=" << bits);
    for (int t = 0; t < 50; ++t) {
      uint8_t symbols[kTileWeights];
      RandomSymbols(rng, bits, symbols);
      uint16_t states[kTileWeights];
      StatesFromSymbols(symbols, bits, states);
      // Flip one bit above the symbol: the state no longer continues its
      // predecessor's window.
      const int i = position(rng);
      std::uniform_int_distribution<int> high_bit(bits, 15);
      states[i] ^= static_cast<uint16_t>(1u << high_bit(rng));
      EXPECT_FALSE(IsTailBiting(states, bits)) << "position " << i;
      uint8_t untouched[kTileWeights];
      for (int p = 0; p < kTileWeights; ++p) untouched[p] = 0xAB;
      EXPECT_FALSE(SymbolsFromStates(states, bits, untouched));
      for (int p = 0; p < kTileWeights; ++p) ASSERT_EQ(untouched[p], 0xAB);
      std::vector<uint16_t> tile(TileInt16Count(bits), 0x5A5A);
      EXPECT_FALSE(PackTileStates(states, bits, tile.data()));
      for (uint16_t v : tile) ASSERT_EQ(v, 0x5A5A);
    }
  }
}

TEST(TrellisPackTest, ChangedSymbolBitsAloneAreAlsoRejected) {
  // Changing only the low K bits of s_i breaks s_{i+1}'s window (K < 16).
  uint8_t symbols[kTileWeights] = {};
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    uint16_t states[kTileWeights];
    StatesFromSymbols(symbols, bits, states);
    states[255] ^= 1u;  // the wrap: breaks s_0
    EXPECT_FALSE(IsTailBiting(states, bits)) << "K=" << bits;
  }
}

TEST(TrellisPackTest, TensorPackAndUnpackRoundTrip) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const int64_t k = 64;
  const int64_t n = 48;
  const int64_t tiles = (k / 16) * (n / 16);
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    SCOPED_TRACE(testing::Message() << "K=" << bits);
    // Any trellis bits are valid: states read from a circular stream always tail-bite.
    std::vector<uint16_t> trellis(tiles * TileInt16Count(bits));
    std::uniform_int_distribution<int> word(0, 0xFFFF);
    for (uint16_t& v : trellis) v = static_cast<uint16_t>(word(rng));
    std::vector<uint16_t> states(tiles * kTileWeights);
    ASSERT_TRUE(UnpackTensorStates(trellis.data(), k, n, bits, states.data()).ok());
    for (int64_t t = 0; t < tiles; ++t) {
      ASSERT_TRUE(IsTailBiting(states.data() + t * kTileWeights, bits)) << "tile " << t;
      for (int i = 0; i < kTileWeights; ++i) {
        ASSERT_EQ(states[t * kTileWeights + i],
                  ReadTileState(trellis.data() + t * TileInt16Count(bits), bits, i));
      }
    }
    std::vector<uint16_t> repacked(trellis.size());
    ASSERT_TRUE(PackTensorStates(states.data(), k, n, bits, repacked.data()).ok());
    EXPECT_EQ(repacked, trellis);
  }
}

TEST(TrellisPackTest, TensorPackNamesTheTilesThatAreNotTailBiting) {
  const int64_t k = 32;
  const int64_t n = 48;  // 2 x 3 tiles
  const int bits = 4;
  std::vector<uint16_t> states(6 * kTileWeights);
  uint8_t symbols[kTileWeights] = {};
  for (int t = 0; t < 6; ++t) StatesFromSymbols(symbols, bits, states.data() + t * kTileWeights);
  states[(1 * 3 + 2) * kTileWeights + 7] ^= 0x0100;  // tile [1, 2], position 7
  std::vector<uint16_t> trellis(6 * TileInt16Count(bits));
  const absl::Status status = PackTensorStates(states.data(), k, n, bits, trellis.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("[1, 2] at position 7"), std::string::npos)
      << status.message();
  EXPECT_NE(std::string(status.message()).find("1 of 6 tiles"), std::string::npos)
      << status.message();
}

TEST(TrellisPackTest, TensorFunctionsRejectBadShapesAndBitWidths) {
  std::vector<uint16_t> buffer(16 * 8 * 4, 0);
  std::vector<uint16_t> states(4 * kTileWeights, 0);
  EXPECT_EQ(UnpackTensorStates(buffer.data(), 16, 24, 4, states.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnpackTensorStates(buffer.data(), -16, 16, 4, states.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnpackTensorStates(buffer.data(), 16, 16, 0, states.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackTensorStates(states.data(), 16, 16, 9, buffer.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(UnpackTensorStates(nullptr, 0, 0, 4, nullptr).ok());
}

}  // namespace
}  // namespace exl3serve::kernels
