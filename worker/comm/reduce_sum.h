// worker/comm/reduce_sum.h — the element-wise sum every reducing collective
// ends in: dst[i] = src[0][i] + src[1][i] + ... + src[n-1][i], always in that
// order, so the same inputs give the same bits on every rank and every ISA.
//
//   const void* srcs[] = {slot0, slot1, slot2};
//   SumInOrder(CommDataType::kBF16, srcs, 3, out, count);
//
// kF32: IEEE fp32 additions left to right (no FMA, no reassociation).
// kBF16: each input widened to fp32 exactly, fp32 additions left to right,
// the total rounded once to bf16 (round to nearest, ties to even; NaN stays a
// quiet NaN with its sign and top payload bits; overflow rounds to ±inf;
// subnormals are kept, never flushed).
//
// The variants (scalar::, avx2::, avx512::) have the same signature and give
// bit-identical results; SumInOrder dispatches on kernels::cpu::ActiveCpuIsa()
// (so SetCpuIsaOverride pins a path). The SIMD loops cover whole vectors, the
// tail goes to the scalar loop.
//
// Aliasing: dst may be exactly equal to any src (each element is read from
// every source before it is written); partial overlaps are not allowed.
// Thread safety: pure functions.
#ifndef EXL3SERVE_WORKER_COMM_REDUCE_SUM_H_
#define EXL3SERVE_WORKER_COMM_REDUCE_SUM_H_

#include <cstddef>
#include <cstdint>

#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

// The most sources one call takes (the largest group on one box).
inline constexpr int kMaxSumSources = 64;

// Requires: 1 <= num_srcs <= kMaxSumSources; every src and dst hold `count` elements of `type`.
void SumInOrder(CommDataType type, const void* const* srcs, int num_srcs, void* dst,
                size_t count);

// One variant per ISA; the avx2/avx512 ones must only be called when
// kernels::cpu::CpuSupportsIsa says so.
namespace scalar {
void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count);
void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count);
}  // namespace scalar
namespace avx2 {
void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count);
void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count);
}  // namespace avx2
namespace avx512 {
void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count);
void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count);
}  // namespace avx512

// bf16 <-> fp32 as the sums use them (exposed for the tests and benchmarks).
inline float BF16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t F32ToBF16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_REDUCE_SUM_H_
