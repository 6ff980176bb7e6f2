// AVX2 variants of worker/comm/reduce_sum.h (compiled with -mavx2 -mfma -mf16c
// -mbmi2; only called after the runtime CPU check in SumInOrder).
#include <immintrin.h>

#include "worker/comm/reduce_sum.h"

namespace exl3serve::worker::comm::avx2 {
namespace {

// fp32 -> bf16 bits in the low half of each 32-bit lane, exactly as
// F32ToBF16: round to nearest even, quiet NaN.
inline __m256i RoundToBF16(__m256 acc) {
  const __m256i bits = _mm256_castps_si256(acc);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256 is_nan = _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), is_nan));
}

inline __m256 LoadBF16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void StoreBF16(uint16_t* p, __m256 acc) {
  const __m256i r = RoundToBF16(acc);  // every lane <= 0xffff: packus does not saturate
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

}  // namespace

void SumF32(const float* const* srcs, int num_srcs, float* dst, size_t count) {
  constexpr size_t kStep = 32;  // four registers in flight
  size_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const float* s0 = srcs[0] + i;
    __m256 a0 = _mm256_loadu_ps(s0);
    __m256 a1 = _mm256_loadu_ps(s0 + 8);
    __m256 a2 = _mm256_loadu_ps(s0 + 16);
    __m256 a3 = _mm256_loadu_ps(s0 + 24);
    for (int s = 1; s < num_srcs; ++s) {
      const float* p = srcs[s] + i;
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + 24));
    }
    _mm256_storeu_ps(dst + i, a0);
    _mm256_storeu_ps(dst + i + 8, a1);
    _mm256_storeu_ps(dst + i + 16, a2);
    _mm256_storeu_ps(dst + i + 24, a3);
  }
  if (i < count) {
    const float* tail[kMaxSumSources];
    for (int s = 0; s < num_srcs; ++s) tail[s] = srcs[s] + i;
    scalar::SumF32(tail, num_srcs, dst + i, count - i);
  }
}

void SumBF16(const uint16_t* const* srcs, int num_srcs, uint16_t* dst, size_t count) {
  constexpr size_t kStep = 32;
  size_t i = 0;
  for (; i + kStep <= count; i += kStep) {
    const uint16_t* s0 = srcs[0] + i;
    __m256 a0 = LoadBF16(s0);
    __m256 a1 = LoadBF16(s0 + 8);
    __m256 a2 = LoadBF16(s0 + 16);
    __m256 a3 = LoadBF16(s0 + 24);
    for (int s = 1; s < num_srcs; ++s) {
      const uint16_t* p = srcs[s] + i;
      a0 = _mm256_add_ps(a0, LoadBF16(p));
      a1 = _mm256_add_ps(a1, LoadBF16(p + 8));
      a2 = _mm256_add_ps(a2, LoadBF16(p + 16));
      a3 = _mm256_add_ps(a3, LoadBF16(p + 24));
    }
    StoreBF16(dst + i, a0);
    StoreBF16(dst + i + 8, a1);
    StoreBF16(dst + i + 16, a2);
    StoreBF16(dst + i + 24, a3);
  }
  if (i < count) {
    const uint16_t* tail[kMaxSumSources];
    for (int s = 0; s < num_srcs; ++s) tail[s] = srcs[s] + i;
    scalar::SumBF16(tail, num_srcs, dst + i, count - i);
  }
}

}  // namespace exl3serve::worker::comm::avx2
