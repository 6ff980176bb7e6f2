// kernels/cpu/dense16_gemm_avx512.cc — AVX-512 variant of
// Dense16GemmTransposed (contract and summation order: dense16_gemm.h).
// Compiled with AVX-512 flags by file name; never included elsewhere.
// One zmm accumulator per (row, output) = the 16 lanes of the contract;
// register block 4 rows x 4 outputs (16 accumulators): per 16 weights of an
// output 1 load + convert (bf16: vpmovzxwd + vpslld; fp16: vcvtph2ps), then
// one vfmadd per row with x from memory. The ragged end of k is a masked load.
#include <immintrin.h>

#include <algorithm>

#include "kernels/cpu/dense16_gemm.h"

// GCC 12 flags the intrinsics' internal _mm512_undefined_* as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace exl3serve::kernels::cpu::avx512 {
namespace {

constexpr int kMr = 4;
constexpr int kNr = 4;

template <Dense16Type T>
inline __m512 Widen(__m256i h) {
  if constexpr (T == Dense16Type::kBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

// s8[l] = a[l] + a[l+8], s4 = s8[l] + s8[l+4], s2 = s4[l] + s4[l+2], s2[0] + s2[1].
inline float Reduce(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
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
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = Widen<T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + j)));
      for (int i = 0; i < MR; ++i) {
        acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * k + j), wv, acc[i][r]);
      }
    }
  }
  if (j < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - j)) - 1u);
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = Widen<T>(_mm256_maskz_loadu_epi16(mask, w + r * k + j));
      for (int i = 0; i < MR; ++i) {
        acc[i][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + i * k + j), wv, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* y = p.y + (i0 + i) * p.n + o0;
    for (int r = 0; r < NR; ++r) {
      const float s = Reduce(acc[i][r]);
      y[r] = p.bias != nullptr ? s + p.bias[o0 + r] : s;
    }
  }
}

template <Dense16Type T, int MR>
void BlockOutputs(const internal::Dense16Problem& p, int64_t i0, int64_t o0, int64_t nr) {
  switch (nr) {
    case 1: Block<T, MR, 1>(p, i0, o0); break;
    case 2: Block<T, MR, 2>(p, i0, o0); break;
    case 3: Block<T, MR, 3>(p, i0, o0); break;
    default: Block<T, MR, kNr>(p, i0, o0); break;
  }
}

template <Dense16Type T>
void Columns(const internal::Dense16Problem& p, int64_t o0, int64_t o1) {
  for (int64_t i0 = 0; i0 < p.m; i0 += kMr) {
    const int64_t mr = std::min<int64_t>(kMr, p.m - i0);
    for (int64_t o = o0; o < o1; o += kNr) {
      const int64_t nr = std::min<int64_t>(kNr, o1 - o);
      switch (mr) {
        case 1: BlockOutputs<T, 1>(p, i0, o, nr); break;
        case 2: BlockOutputs<T, 2>(p, i0, o, nr); break;
        case 3: BlockOutputs<T, 3>(p, i0, o, nr); break;
        default: BlockOutputs<T, kMr>(p, i0, o, nr); break;
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

}  // namespace exl3serve::kernels::cpu::avx512
