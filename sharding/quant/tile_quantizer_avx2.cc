// AVX2 forward step of the tile Viterbi for a batch of tiles (see
// tile_viterbi_step.h for the contract). Compiled with -mavx2 -mfma; only
// called when kernels::cpu::CpuSupportsIsa(kAvx2).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "sharding/quant/tile_viterbi_step.h"

namespace exl3serve::sharding::quant::internal::avx2 {
namespace {

// Inner-loop cost model: as the AVX-512 step (tile_quantizer_avx512.cc) with
// 8-lane vectors: 8192 candidate vectors per position and tile, each
// fma + add + min (3 FP ops) + a prev broadcast load, plus, shared by the B
// tiles of the batch, one load of the interleaved cb table and one mul (cb²).
// The predecessor prev[(p << (16-2K)) | (e >> K)] is one broadcast per vector
// for K >= 3 (8 consecutive e share it); for K < 3 the lanes are ordered
// l -> ((l mod D) << K) + (l div D), D = 8 >> K, so it is one broadcast load
// of D floats (vbroadcastf128 / vbroadcastsd) and one vpermps per output
// vector restores natural order. For K < 4 the decisions for the traceback
// cost one vcmpps + vmovmskps + byte store per candidate vector with p > 0.
// 256-bit FMA/min issue on 2 ports (adds also on a third): the bound is
// ~1.3-1.5 cycles per vector, ~11-12 k cycles per position and tile, about
// twice the AVX-512 step.
// Registers: B x kU = 4 x 2 accumulators + 2 cb + 2 cb² + temporaries; the
// per-tile w is re-broadcast from memory (16 ymm registers only).
template <int K>
inline __m256 LoadPrev(const float* p) {
  if constexpr (K >= 3) {
    return _mm256_broadcast_ss(p);
  } else if constexpr (K == 2) {
    return _mm256_castpd_ps(_mm256_broadcastsd_pd(
        _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  } else {
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  }
}

template <int K, int B, bool kRecord>
void StepK(const BatchStep& a) {
  constexpr int kE = 1 << (16 - K);
  constexpr int kP = 1 << K;
  constexpr int kU = 2;
  constexpr int kD = K >= 3 ? 1 : 8 >> K;
  const float* table = a.interleaved;
  const __m256 inf = _mm256_set1_ps(INFINITY);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i to_natural = _mm256_add_epi32(
      _mm256_mullo_epi32(_mm256_and_si256(iota, _mm256_set1_epi32((1 << K) - 1)),
                         _mm256_set1_epi32(kD)),
      _mm256_srli_epi32(iota, K < 3 ? K : 0));
  for (int e0 = 0; e0 < kE; e0 += 8 * kU) {
    __m256 acc[B][kU];
    for (int b = 0; b < B; ++b) {
      for (int u = 0; u < kU; ++u) acc[b][u] = inf;
    }
    for (int p = 0; p < kP; ++p) {
      const float* cbp = table;  // this block's cb for p
      table += 8 * kU;
      __m256 c1[kU], c2[kU];
      for (int u = 0; u < kU; ++u) {
        c1[u] = _mm256_load_ps(cbp + 8 * u);
        c2[u] = _mm256_mul_ps(c1[u], c1[u]);  // exact: cb is an fp16 value
      }
      for (int b = 0; b < B; ++b) {
        const float* prevp = a.prev[b] + (p << (16 - 2 * K));
        const __m256 wv = _mm256_broadcast_ss(&a.w[b]);
        for (int u = 0; u < kU; ++u) {
          const __m256 pv = LoadPrev<K>(prevp + ((e0 + 8 * u) >> K));
          const __m256 q = _mm256_fmadd_ps(c1[u], wv, c2[u]);
          const __m256 c = _mm256_add_ps(pv, q);
          if constexpr (kRecord) {
            // As the AVX-512 step: bit set = strictly below all earlier p.
            if (p == 0) {
              acc[b][u] = c;
            } else {
              a.decisions[b][((e0 >> 3) + u) * (kP - 1) + (p - 1)] = static_cast<uint8_t>(
                  _mm256_movemask_ps(_mm256_cmp_ps(c, acc[b][u], _CMP_LT_OQ)));
              acc[b][u] = _mm256_min_ps(acc[b][u], c);
            }
          } else {
            acc[b][u] = _mm256_min_ps(acc[b][u], c);
          }
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      const __m256 vvv = _mm256_broadcast_ss(&a.vv[b]);
      for (int u = 0; u < kU; ++u) {
        __m256 r = _mm256_add_ps(acc[b][u], vvv);
        if constexpr (K < 3) r = _mm256_permutevar8x32_ps(r, to_natural);
        _mm256_store_ps(a.out[b] + e0 + 8 * u, r);
      }
    }
  }
}

template <int K, bool kRecord>
void StepCountRecord(const BatchStep& a) {
  switch (a.count) {
    case 1: return StepK<K, 1, kRecord>(a);
    case 2: return StepK<K, 2, kRecord>(a);
    case 3: return StepK<K, 3, kRecord>(a);
    case 4: return StepK<K, 4, kRecord>(a);
    case 5: return StepK<K, 5, kRecord>(a);
    case 6: return StepK<K, 6, kRecord>(a);
    case 7: return StepK<K, 7, kRecord>(a);
    default: return StepK<K, 8, kRecord>(a);
  }
}

template <int K>
void StepCount(const BatchStep& a) {
  if constexpr (K < 4) {
    if (a.decisions[0] != nullptr) return StepCountRecord<K, true>(a);
  }
  return StepCountRecord<K, false>(a);
}

}  // namespace

void ViterbiStepBatch(const BatchStep& a) {
  static_assert(kMaxBatch == 8);
  switch (a.bits) {
    case 1: return StepCount<1>(a);
    case 2: return StepCount<2>(a);
    case 3: return StepCount<3>(a);
    case 4: return StepCount<4>(a);
    case 5: return StepCount<5>(a);
    case 6: return StepCount<6>(a);
    case 7: return StepCount<7>(a);
    default: return StepCount<8>(a);
  }
}

}  // namespace exl3serve::sharding::quant::internal::avx2
