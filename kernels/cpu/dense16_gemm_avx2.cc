// kernels/cpu/dense16_gemm_avx2.cc — AVX2+FMA+F16C variant of
// Dense16GemmTransposed (contract and summation order: dense16_gemm.h).
// Compiled with AVX2 flags by file name; never included elsewhere.
// The contract's 16 lanes are two ymm (lanes 0-7, 8-15) per (row, output);
// register block 2 rows x 3 outputs (12 ymm accumulators). The ragged end of
// k goes through zero-padded 16-element copies (same lanes as the scalar
// reference's zero padding).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/dense16_gemm.h"

namespace exl3serve::kernels::cpu::avx2 {
namespace {

constexpr int kMr = 2;
constexpr int kNr = 3;

template <Dense16Type T>
inline __m256 Widen(__m128i h) {
  if constexpr (T == Dense16Type::kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

inline float Reduce(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

template <Dense16Type T, int MR, int NR>
void Block(const internal::Dense16Problem& p, int64_t i0, int64_t o0) {
  const int64_t k = p.k;
  const float* x = p.x + i0 * k;
  const uint16_t* w = p.w + o0 * k;
  __m256 lo[MR][NR], hi[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int r = 0; r < NR; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
  }
  auto step = [&](const uint16_t* const* wp, const float* const* xp) {
    for (int r = 0; r < NR; ++r) {
      const __m256 w0 = Widen<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp[r])));
      const __m256 w1 = Widen<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp[r] + 8)));
      for (int i = 0; i < MR; ++i) {
        lo[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xp[i]), w0, lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xp[i] + 8), w1, hi[i][r]);
      }
    }
  };
  int64_t j = 0;
  const uint16_t* wp[NR];
  const float* xp[MR];
  for (; j + 16 <= k; j += 16) {
    for (int r = 0; r < NR; ++r) wp[r] = w + r * k + j;
    for (int i = 0; i < MR; ++i) xp[i] = x + i * k + j;
    step(wp, xp);
  }
  if (j < k) {
    const int64_t len = k - j;
    alignas(32) uint16_t wt[NR][16] = {};
    alignas(32) float xt[MR][16] = {};
    for (int r = 0; r < NR; ++r) {
      std::memcpy(wt[r], w + r * k + j, sizeof(uint16_t) * len);
      wp[r] = wt[r];
    }
    for (int i = 0; i < MR; ++i) {
      std::memcpy(xt[i], x + i * k + j, sizeof(float) * len);
      xp[i] = xt[i];
    }
    step(wp, xp);
  }
  for (int i = 0; i < MR; ++i) {
    float* y = p.y + (i0 + i) * p.n + o0;
    for (int r = 0; r < NR; ++r) {
      const float s = Reduce(lo[i][r], hi[i][r]);
      y[r] = p.bias != nullptr ? s + p.bias[o0 + r] : s;
    }
  }
}

template <Dense16Type T, int MR>
void BlockOutputs(const internal::Dense16Problem& p, int64_t i0, int64_t o0, int64_t nr) {
  switch (nr) {
    case 1: Block<T, MR, 1>(p, i0, o0); break;
    case 2: Block<T, MR, 2>(p, i0, o0); break;
    default: Block<T, MR, kNr>(p, i0, o0); break;
  }
}

template <Dense16Type T>
void Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1) {
  for (int64_t i0 = 0; i0 < p.m; i0 += kMr) {
    const int64_t mr = std::min<int64_t>(kMr, p.m - i0);
    for (int64_t o = o0; o < o1; o += kNr) {
      const int64_t nr = std::min<int64_t>(kNr, o1 - o);
      if (mr == 1) {
        BlockOutputs<T, 1>(p, i0, o, nr);
      } else {
        BlockOutputs<T, kMr>(p, i0, o, nr);
      }
    }
  }
}

}  // namespace

void Dense16Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1) {
  if (p.type == Dense16Type::kBf16) {
    Columns<Dense16Type::kBf16>(p, o0, o1);
  } else {
    Columns<Dense16Type::kF16>(p, o0, o1);
  }
}

// fp16 -> float with integer ops (not vcvtph2ps, which quiets signalling
// NaNs): the exponent and mantissa move up 13 bits and the exponent is
// rebased (+112, or +224 for Inf/NaN: 31 -> 255); zero and subnormal halves
// are mantissa x 2^-24, exact in float; the sign moves to bit 31.
static inline __m256i HalfToFloatBits(__m128i h8) {
  const __m256i h = _mm256_cvtepu16_epi32(h8);
  const __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi32(0x7FFF));
  const __m256i shifted = _mm256_slli_epi32(magnitude, 13);
  const __m256i exponent = _mm256_and_si256(h, _mm256_set1_epi32(0x7C00));
  const __m256i is_max = _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7C00));
  const __m256i is_min = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
  const __m256i rebase = _mm256_blendv_epi8(_mm256_set1_epi32(112 << 23),
                                            _mm256_set1_epi32(224 << 23), is_max);
  const __m256i normal = _mm256_add_epi32(shifted, rebase);
  const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude),
                                    _mm256_set1_ps(5.9604644775390625e-8f));  // 2^-24
  const __m256i value = _mm256_blendv_epi8(normal, _mm256_castps_si256(tiny), is_min);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
  return _mm256_or_si256(value, sign);
}

void Dense16ToFloat(const uint16_t* src, Dense16Type type, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i bits = type == Dense16Type::kBf16
                             ? _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)
                             : HalfToFloatBits(h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bits);
  }
  if (i < count) internal::Dense16ToFloatScalar(src + i, type, count - i, dst + i);
}

}  // namespace exl3serve::kernels::cpu::avx2
