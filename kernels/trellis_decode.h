// kernels/trellis_decode.h — the per-weight arithmetic of the EXL3 trellis
// format, compiled by both g++ and nvcc (__host__ __device__), so the CUDA
// kernels reuse exactly the code the CPU tests prove bit-exact.
//
// What it defines (exl3-format.md section in brackets):
//   - fp16 <-> fp32 conversion in software, RNE                       [§4.4]
//   - Codebook and DecodeState(cb, s): 16-bit state -> fp16 bits       [§4.1-4.3]
//   - TilePermutation(j): trellis position -> (row, col) in a tile     [§3.2]
//   - TileWord / ReadTileState: the sliding 16-bit window of position
//     i over a packed tile of 16*K int16 values                        [§3.3-3.4]
//
// Usage sketch:
//   uint16_t s = ReadTileState(tile_int16, K, i);    // tile = 16*K values
//   uint16_t w = DecodeState(Codebook::kMul1, s);    // fp16 bits of W_h
//   int rc = TilePermutation(i);                     // 16*r + c inside the tile
//
// Everything here is a pure function of its arguments; no tables, no state.
// The decode is bit-exact by definition (§1): any change must keep the LUT
// SHA-256 anchors in tests/kernels/trellis_decode_test.cc green.
#ifndef EXL3SERVE_KERNELS_TRELLIS_DECODE_H_
#define EXL3SERVE_KERNELS_TRELLIS_DECODE_H_

#include <cstdint>
#include <cstring>  // std::memcpy in the host pass of nvcc too

#if defined(__CUDACC__)
#define EXL3_HD __host__ __device__ __forceinline__
#else
#define EXL3_HD inline
#endif

namespace exl3serve::kernels {

// The three computed codebooks of EXL3 (§4). Values are ours (not stored in
// files); a file selects one with marker tensors (§2.4).
enum class Codebook : uint8_t { k3Inst = 0, kMcg = 1, kMul1 = 2 };

inline constexpr int kTileDim = 16;          // tiles are 16x16 weights (§3.1)
inline constexpr int kTileWeights = 256;     // positions per tile
inline constexpr int kMinBits = 1;           // K range (§2.4)
inline constexpr int kMaxBits = 8;

// Codebook constants (§4.1-4.3), fixed by the format.
inline constexpr uint32_t k3InstMul = 89226354u;
inline constexpr uint32_t k3InstAdd = 64248484u;
inline constexpr uint32_t kMcgMul = 0xCBAC1FEDu;
inline constexpr uint32_t kMul1Mul = 0x83DCD12Du;
inline constexpr uint32_t kHalfPairMask = 0x8FFF8FFFu;
inline constexpr uint32_t kHalfPairXor = 0x3B603B60u;

EXL3_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

EXL3_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// fp16 bit pattern -> float, exact for every input (Inf/NaN preserved).
EXL3_HD float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7F800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> fp16 bit pattern with one round-to-nearest-even (what
// __float2half_rn and _mm_cvtps_ph(.., _MM_FROUND_TO_NEAREST_INT) compute).
// Overflow gives Inf, NaN stays NaN (quiet), subnormals are rounded correctly.
EXL3_HD uint16_t FloatToHalfBits(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs_bits = x & 0x7FFFFFFFu;
  if (abs_bits >= 0x7F800000u) {
    return static_cast<uint16_t>(sign | (abs_bits > 0x7F800000u ? 0x7E00u : 0x7C00u));
  }
  if (abs_bits >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520
  if (abs_bits < 0x38800000u) {                                              // < 2^-14
    if (abs_bits < 0x33000000u) return static_cast<uint16_t>(sign);           // < 2^-25
    const uint32_t mantissa = (abs_bits & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs_bits >> 23);                // 14..24
    uint32_t q = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t q = (abs_bits - 0x38000000u) >> 13;  // rebias exponent 127 -> 15
  const uint32_t rem = abs_bits & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;  // carry into exponent is right
  return static_cast<uint16_t>(sign | q);
}

// 3inst / mcg tail (§4.1): keep sign + low 12 bits of each half, force the
// exponent into 0b011??, add the two fp16 halves with one RNE rounding. The
// float sum is exact (multiple of 2^-13 below 4), so one conversion suffices.
EXL3_HD uint16_t DecodeHalfPair(uint32_t x) {
  x = (x & kHalfPairMask) ^ kHalfPairXor;
  const float lo = HalfBitsToFloat(static_cast<uint16_t>(x & 0xFFFFu));
  const float hi = HalfBitsToFloat(static_cast<uint16_t>(x >> 16));
  return FloatToHalfBits(lo + hi);
}

// mul1 (§4.3): byte sum t of s*0x83DCD12D, w = RNE((1774 t - 905216) 2^-18).
EXL3_HD uint32_t Mul1ByteSum(uint16_t state) {
  const uint32_t x = static_cast<uint32_t>(state) * kMul1Mul;
  return (x & 0xFFu) + ((x >> 8) & 0xFFu) + ((x >> 16) & 0xFFu) + (x >> 24);
}

EXL3_HD uint16_t DecodeMul1(uint16_t state) {
  const int32_t numerator = 1774 * static_cast<int32_t>(Mul1ByteSum(state)) - 905216;
  return FloatToHalfBits(static_cast<float>(numerator) * 3.814697265625e-6f);  // 2^-18, exact
}

EXL3_HD uint16_t Decode3Inst(uint16_t state) {
  return DecodeHalfPair(static_cast<uint32_t>(state) * k3InstMul + k3InstAdd);
}

EXL3_HD uint16_t DecodeMcg(uint16_t state) {
  return DecodeHalfPair(static_cast<uint32_t>(state) * kMcgMul);
}

// State -> fp16 bits of the weight, for any codebook.
EXL3_HD uint16_t DecodeState(Codebook codebook, uint16_t state) {
  switch (codebook) {
    case Codebook::kMcg:
      return DecodeMcg(state);
    case Codebook::kMul1:
      return DecodeMul1(state);
    case Codebook::k3Inst:
    default:
      return Decode3Inst(state);
  }
}

// Trellis position j (0..255) -> flat index 16*r + c inside the 16x16 tile,
// r = input row, c = output column (§3.2, the tensor-core B-fragment order).
EXL3_HD int TilePermutation(int j) {
  const int lane = j >> 3;
  const int u = j & 7;
  const int r = 2 * (lane & 3) + (u & 1) + 8 * ((u >> 1) & 1);
  const int c = (lane >> 2) + 8 * (u >> 2);
  return 16 * r + c;
}

// 32-bit word j (0..8K-1) of a packed tile; the tile holds 16*K int16 values,
// low half first (§3.4). Works on any host endianness.
EXL3_HD uint32_t TileWord(const uint16_t* tile, int j) {
  return static_cast<uint32_t>(tile[2 * j]) | (static_cast<uint32_t>(tile[2 * j + 1]) << 16);
}

// The 16-bit state of position i (0..255) in a packed tile with K bits per
// symbol: the 16 stream bits ending with symbol i, wrapping around the tile
// (tail-biting, §3.3-3.4). Requires: 1 <= K <= 8, 0 <= i < 256.
EXL3_HD uint16_t ReadTileState(const uint16_t* tile, int bits, int i) {
  const int stream_bits = 256 * bits;
  int first = (i + 1) * bits - 16;
  if (first < 0) first += stream_bits;
  const int j0 = first >> 5;
  const int j1 = (j0 + 1 == 8 * bits) ? 0 : j0 + 1;
  const int offset = first & 31;
  const uint64_t window =
      (static_cast<uint64_t>(TileWord(tile, j0)) << 32) | static_cast<uint64_t>(TileWord(tile, j1));
  return static_cast<uint16_t>((window >> (48 - offset)) & 0xFFFFu);
}

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_TRELLIS_DECODE_H_
