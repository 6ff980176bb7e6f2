// AVX-512 forward step of the tile Viterbi for a batch of tiles (see
// tile_viterbi_step.h for the contract). Compiled with -mavx512f/bw/vl/dq;
// only called when kernels::cpu::CpuSupportsIsa(kAvx512).
// GCC 12 warns about _mm512_undefined_ps inside its own intrinsic headers
// (GCC PR105593, false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>

#include "sharding/quant/tile_viterbi_step.h"

namespace exl3serve::sharding::quant::internal::avx512 {
namespace {

// Inner-loop cost model (per trellis position and tile; E = 2^(16-K),
// P = 2^K, B = tiles in the batch, 16-lane vectors over e):
//   every one of the 65 536 states s = (p << (16-K)) | e is evaluated once per
//   tile: 4096 candidate vectors per tile, each
//     1 fma, 1 add, 1 min                         (3 FP ops, ports 0 and 5)
//     + 1 load of prev (broadcast, no shuffle uop)
//   plus, shared by the B tiles, 1 load of cb and 1 mul (cb² is exact, so it
//   is not read from a second table): 3 + 1/B FP ops per candidate vector.
//   Table traffic: the interleaved cb table (256 KiB, read front to back, one
//   stream) once per position per batch. Unbatched (B = 1) the old step
//   streamed 512 KiB (cb + cb2, 2^K strided streams) from L2 per tile and
//   position and ran at ~2x the FP bound; with B = 4 the table costs 64 KiB
//   per tile-position.
//   FP bound: (3 + 1/4)·4096 / 2 ports = 6.7 k cycles per position per tile,
//   3.4 M cycles per tile (512 positions), 0.93 ms at the 3.65 GHz this CPU
//   sustains with 512-bit FMAs: ~0.27 M weights/s per core. The 3-op part
//   alone bounds any variant of this formulation at ~0.30 M.
//   Measured (quant_speed_bench, K = 4, 1 thread, best of runs, B = 4):
//   kernel alone ~2.05 µs per tile-position (~1.1x the bound); whole tile
//   quantizer see docs/design/sharding-quant.md (history writes and traceback add
//   ~15-20 %).
//   Predecessor costs prev[(p << (16-2K)) | (e >> K)]: for K >= 4 all 16 lanes
//   share one value (one vbroadcastss folded into the add). For K < 4 a vector
//   spans D = 16 >> K predecessors, each repeated 2^K times; the lanes are
//   ordered l -> e0 + ((l mod D) << K) + (l div D) so the vector is one
//   broadcast load of D consecutive floats (f32x8 / f32x4 / sd, pure loads),
//   with cb read from a table stored in that lane order, and the result is put
//   back in natural order with one vpermps per output vector (1/2^K per
//   candidate vector).
//   Arg-min: none for K >= 4 (the driver keeps the cost rows and re-evaluates
//   the 2^K candidates of the one edge on the path at traceback). For K < 4
//   (rows too large to keep) the driver asks for decisions: candidate p > 0
//   adds one compare into a mask register (p5) and a 2-byte mask store, and
//   candidate 0 needs no min: +0 / +0.5 / +0.75 ops per candidate vector at
//   K = 1 / 2 / 3, instead of recomputing 15 of every 16 rows (+~70 %).
//   Registers: B x kU = 8 accumulators (each updated every 8 candidate
//   vectors, well past the 4-cycle min latency), kU cb + kU cb², B w's: ~22 of
//   32 zmm, no spills up to B = 6 (B = 8 spills and is slower).
template <int K>
inline __m512 LoadPrev(const float* p) {
  if constexpr (K >= 4) {
    return _mm512_set1_ps(*p);
  } else if constexpr (K == 3) {
    return _mm512_castpd_ps(_mm512_broadcastsd_pd(
        _mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  } else if constexpr (K == 2) {
    return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
  } else {
    return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
  }
}

template <int K, int B, bool kRecord>
void StepK(const BatchStep& a) {
  constexpr int kE = 1 << (16 - K);
  constexpr int kP = 1 << K;
  constexpr int kU = 2;
  constexpr int kPrefetchFloats = 2048;
  constexpr int kD = K >= 4 ? 1 : 16 >> K;
  const float* table = a.interleaved;
  __m512 wv[B], vvv[B];
  for (int b = 0; b < B; ++b) {
    wv[b] = _mm512_set1_ps(a.w[b]);
    vvv[b] = _mm512_set1_ps(a.vv[b]);
  }
  const __m512 inf = _mm512_set1_ps(INFINITY);
  // Natural edge j of a 16-block sits in lane (j mod 2^K)·D + (j >> K).
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i to_natural = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_and_si512(iota, _mm512_set1_epi32((1 << K) - 1)),
                         _mm512_set1_epi32(kD)),
      _mm512_srli_epi32(iota, K < 4 ? K : 0));
  for (int e0 = 0; e0 < kE; e0 += 16 * kU) {
    __m512 acc[B][kU];
    for (int b = 0; b < B; ++b) {
      for (int u = 0; u < kU; ++u) acc[b][u] = inf;
    }
    for (int p = 0; p < kP; ++p) {
      const float* cbp = table;  // this block's cb for p
      table += 16 * kU;
      for (int line = 0; line < kU; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(cbp + kPrefetchFloats + 16 * line), _MM_HINT_T0);
      }
      // cb² is exact in fp32 (fp16 values have 11-bit significands), so it is
      // recomputed here instead of read from a second table (halves the L2
      // traffic; one mul per vector per batch).
      __m512 c1[kU], c2[kU];
      for (int u = 0; u < kU; ++u) {
        c1[u] = _mm512_load_ps(cbp + 16 * u);
        c2[u] = _mm512_mul_ps(c1[u], c1[u]);
      }
      for (int b = 0; b < B; ++b) {
        const float* prevp = a.prev[b] + (p << (16 - 2 * K));
        for (int u = 0; u < kU; ++u) {
          const __m512 pv = LoadPrev<K>(prevp + ((e0 + 16 * u) >> K));
          const __m512 q = _mm512_fmadd_ps(c1[u], wv[b], c2[u]);
          const __m512 c = _mm512_add_ps(pv, q);
          if constexpr (kRecord) {
            // Decision bit of candidate p: strictly below all earlier p (so
            // the winner is the largest p with its bit set: the smallest p
            // among equal costs). min(inf, c0) = c0, so acc = c0 is the same.
            if (p == 0) {
              acc[b][u] = c;
            } else {
              _store_mask16(reinterpret_cast<__mmask16*>(a.decisions[b]) +
                                ((e0 >> 4) + u) * (kP - 1) + (p - 1),
                            _mm512_cmp_ps_mask(c, acc[b][u], _CMP_LT_OQ));
              acc[b][u] = _mm512_min_ps(acc[b][u], c);
            }
          } else {
            acc[b][u] = _mm512_min_ps(acc[b][u], c);
          }
        }
      }
    }
    for (int b = 0; b < B; ++b) {
      for (int u = 0; u < kU; ++u) {
        __m512 r = _mm512_add_ps(acc[b][u], vvv[b]);
        if constexpr (K < 4) r = _mm512_permutexvar_ps(to_natural, r);
        _mm512_store_ps(a.out[b] + e0 + 16 * u, r);
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

}  // namespace exl3serve::sharding::quant::internal::avx512
