// kernels/cpu/trellis_gemm_avx512_inl.h — inline AVX-512 helpers shared by the
// AVX-512 TrellisGemm translation units (trellis_gemm_avx512.cc,
// trellis_gemm_gemv_avx512icl.cc). Include ONLY from files compiled with
// AVX-512 flags (named *_avx512*.cc, kernels/CMakeLists.txt).
#ifndef EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_AVX512_INL_H_
#define EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_AVX512_INL_H_

#include <immintrin.h>

#include "kernels/cpu/trellis_gemm_internal.h"

namespace exl3serve::kernels::cpu::avx512_inl {
// Internal linkage: each ISA's translation unit keeps its own copy (an inline
// function shared by name would be merged across them by the linker, and a
// variant would run another ISA's code).
namespace {

// mul1 weight from t: exact v = (1774 t - 905216)·2^-18, then RNE to fp16
// precision without leaving fp32 (Veltkamp split with 2^13 + 1: c = 8193·v,
// hi = c - (c - v) keeps the top 11 significant bits, round-to-nearest-even;
// |v| >= 476·2^-18 so no fp16 subnormal is reachable). Verified for all 1021
// t against vcvtps2ph (Mul1WeightsForTest, trellis_gemm_test.cc). Embedded
// rounding forms so the compiler can never contract them into an FMA.
// `tbits` holds the float with bit pattern 0x4B000000 + t (= 2^23 + t);
// v = (2^23 + t)·A + kMul1MagicOffset is exact (-3.453125 - 2^23·A = -7266746·2^-7).
// 4 uops (fma, mul, sub, sub; all p05) vs cvtdq2ps + fma + vcvtps2ph (2) +
// vcvtph2ps (2) = 6 uops, 3 of them on p0.
inline __m512 Mul1WeightFromMagic(__m512 tbits) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 v = _mm512_fmadd_round_ps(tbits, _mm512_set1_ps(internal::kMul1Slope),
                                         _mm512_set1_ps(internal::kMul1MagicOffset), kRound);
  const __m512 c = _mm512_mul_round_ps(v, _mm512_set1_ps(8193.0f), kRound);
  return _mm512_sub_round_ps(c, _mm512_sub_round_ps(c, v, kRound), kRound);
}

}  // namespace
}  // namespace exl3serve::kernels::cpu::avx512_inl

#endif  // EXL3SERVE_KERNELS_CPU_TRELLIS_GEMM_AVX512_INL_H_
