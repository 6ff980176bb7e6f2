// AVX-512 variants of worker/comm/reduce_sum.h (compiled with AVX-512
// F/BW/VL/DQ flags; only called after the runtime CPU check in SumInOrder).
// The bf16 rounding is done with integer operations rather than
// VCVTNEPS2BF16, which treats subnormal inputs as zero (the scalar reference
// keeps them).
#include <immintrin.h>

// GCC 12 flags the intrinsics' internal _mm512_undefined_* as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "worker/comm/reduce_sum.h"

namespace exl3serve::worker::comm::avx512 {
namespace {

inline __m512 LoadBF16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Same rounding as F32ToBF16: nearest even, NaN -> quiet NaN.
inline void StoreBF16(uint16_t* p, __m512 acc) {
  const __m512i bits = _mm512_castps_si512(acc);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

}  // namespace

void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count) {
  constexpr size_t kStep = 64;  // four registers in flight
  size_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const float* s0 = srcs[0] + i;
    __m512 a0 = _mm512_loadu_ps(s0);
    __m512 a1 = _mm512_loadu_ps(s0 + 16);
    __m512 a2 = _mm512_loadu_ps(s0 + 32);
    __m512 a3 = _mm512_loadu_ps(s0 + 48);
    for (int s = 1; s < num_srcs; ++s) {
      const float* p = srcs[s] + i;
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + 48));
    }
    _mm512_storeu_ps(dst + i, a0);
    _mm512_storeu_ps(dst + i + 16, a1);
    _mm512_storeu_ps(dst + i + 32, a2);
    _mm512_storeu_ps(dst + i + 48, a3);
  }
  if (i < count) {
    const float* tail[kMaxSumSources];
    for (int s = 0; s < num_srcs; ++s) tail[s] = srcs[s] + i;
    scalar::SumF32(tail, num_srcs, dst + i, count - i);
  }
}

void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count) {
  constexpr size_t kStep = 64;
  size_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const uint16_t* s0 = srcs[0] + i;
    __m512 a0 = LoadBF16(s0);
    __m512 a1 = LoadBF16(s0 + 16);
    __m512 a2 = LoadBF16(s0 + 32);
    __m512 a3 = LoadBF16(s0 + 48);
    for (int s = 1; s < num_srcs; ++s) {
      const uint16_t* p = srcs[s] + i;
      a0 = _mm512_add_ps(a0, LoadBF16(p));
      a1 = _mm512_add_ps(a1, LoadBF16(p + 16));
      a2 = _mm512_add_ps(a2, LoadBF16(p + 32));
      a3 = _mm512_add_ps(a3, LoadBF16(p + 48));
    }
    StoreBF16(dst + i, a0);
    StoreBF16(dst + i + 16, a1);
    StoreBF16(dst + i + 32, a2);
    StoreBF16(dst + i + 48, a3);
  }
  if (i < count) {
    const uint16_t* tail[kMaxSumSources];
    for (int s = 0; s < num_srcs; ++s) tail[s] = srcs[s] + i;
    scalar::SumBF16(tail, num_srcs, dst + i, count - i);
  }
}

}  // namespace exl3serve::worker::comm::avx512
