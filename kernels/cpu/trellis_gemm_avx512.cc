// kernels/cpu/trellis_gemm_avx512.cc — AVX-512 (F/BW/VL/DQ, +VNNI when the
// CPU has it) column-block kernel of TrellisGemm. Compiled with AVX-512 flags
// (kernels/CMakeLists.txt); never included elsewhere.
//
// Two paths per 128-column block (crossover kGemvMaxRows, measured below):
//
// mul1 K <= 4 on VBMI2 CPUs uses the column-sliced GEMV of
// trellis_gemm_gemv_avx512icl.cc instead (3 cycles / 16 weights for kInt8);
// the GEMV below serves the other codebooks, K >= 5 and CPUs without VBMI2.
//
// GEMV (m small): the trellis is decoded in registers, 16 positions per zmm,
// and multiplied straight into position-order accumulators. Positions
// 32p..32p+31 of a tile are all 16 rows of columns p and p+8 (§3.2), so the
// activation pattern of a row of tiles is two zmm (x_pos) shared by all eight
// groups p and all tiles of that row; the accumulator of group p is reduced
// to its two columns once, after the last row of tiles.
//   Per 16 weights (any K; uops on Intel, zmm; the full breakdown sits at
//   each inner loop below):
//     window:  vpermi2d (p5) + vpsrlvd (p0) + vpandd                  3
//              (+ (K+1)/16 per vector to build the tile's H registers)
//     mul1 fp32: vpmulld (2) + vpdpbusd into a 2^23 bias (1) + FMA +
//              Veltkamp RNE to fp16 precision (3)                      7
//     3inst/mcg: vpmulld (2) [+ vpaddd] + vpternlogd + 2x(vpmovdw 2 +
//              vcvtph2ps 2) [+ vpsrld] + vaddps + RNE 4 (cvt pair)   ~18
//     product: 1 vfmadd per activation row (x_pos as memory operand)   1
//   => mul1 fp32 11 uops / 16 weights at m = 1 (was ~16).
//   kInt8 (mul1): window 3 + vpmulld 2 + vpdpbusd against the replicated
//   int8 activation 1 = 6 uops / 16 weights (was 9), 4 of them on p0.
//
// Tile GEMM (m large): decode KC rows x 128 columns of W_h once into an
// L1/L2-resident fp32 panel buffer (same decode as above, then a scalar
// scatter through the §3.2 permutation, ~2 memory ops per weight amortised
// over all m rows), then a 6 x 64 register-blocked FMA micro-kernel:
//   per k step: 4 zmm loads of W + 6 broadcasts + 24 vfmadd (768 FLOP per
//   10 loads: FMA-bound when the panel is in L1).
// Accumulation over k is in ascending KC chunks, identical for every thread.
#include <immintrin.h>

// GCC 12 flags the intrinsics' internal _mm512_undefined_* as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/trellis_gemm_avx512_inl.h"
#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels::cpu::avx512 {
namespace {

using internal::TrellisGemmProblem;

constexpr int kVectors = kTileWeights / 16;   // 16 zmm of positions per tile
constexpr int kTilesPerBlock = 8;             // 128 columns
// Rows up to which the register GEMV path beats the tile GEMM. Measured
// 2025 on the 2-core AVX-512 Xeon dev box, 4096x4096 mul1 K=4 (load ~4 from
// other jobs): GEMV 8 rows 5.6-9 ms, 16 rows ~15 ms; tile GEMM 8 rows ~15 ms,
// 16 rows ~17 ms. Recheck with tests/bench/trellis_gemv_bench.cc.
constexpr int64_t kGemvMaxRows = 16;
constexpr int kGemmKc = 128;                  // rows of W_h per decoded chunk
constexpr int kGemmPanel = 64;                // columns per micro-kernel panel
constexpr int kGemmMr = 6;                    // rows per micro-kernel call
constexpr int kPrefetchTiles = 4;             // GEMV: prefetch this many rows of tiles ahead

// State windows (§3.3-3.4), "half-word stream" form. Let u_q be the q-th
// 16-bit unit of the tile's bit stream (MSB first) and h_q = (u_q << 16) |
// u_{q+1} (indices mod 16K) the 32 stream bits starting at bit 16q. The
// window of position i starts at bit b = (i+1)K - 16 (mod 256K), inside h_q
// for q = b >> 4 at offset o = b & 15, so
//   state_i = (h_q >> (16 - o)) & 0xFFFF.
// The K zmm H_r = h[16r .. 16r+15] are built once per tile (K masked loads,
// K-1 vpermw + 1 vpermt2w: ~K+1 uops per 256 weights). A vector of 16
// consecutive positions needs only h[vK-1 .. vK+K-1] (K+1 <= 16 entries), all
// inside the register pair (H_r, H_r+1), r = (vK-1) >> 4 (v = 0 wraps to
// (H_K-1, H_0)), so one vpermi2d picks every lane's h_q; the offset o depends
// only on the lane, not on v. Per 16 states: vpermi2d (p5) + vpsrlvd (p0) +
// vpandd (p05) = 3 uops (was 2 vpermi2d + 2 variable shifts + or + shift).
template <int K>
struct WindowTables {
  alignas(64) int16_t build_a[32];  // H_r from the loaded units (single source)
  alignas(64) int16_t build_b[32];  // last H_r: units 16K, 16K+1 wrap to 0, 1
  alignas(64) int32_t pick[kVectors][16];
  alignas(64) int32_t shift[16];
  static constexpr int PairLo(int v) { return v == 0 ? K - 1 : (v * K - 1) >> 4; }
  static constexpr int PairHi(int v) { return (PairLo(v) + 1) % K; }
};

template <int K>
WindowTables<K> MakeWindowTables() {
  WindowTables<K> t;
  // Raw tile element e (int16) holds stream unit e ^ 1 (§3.4: low half first).
  // Lane word 2q' (low half of h_q') = u_{q'+1}, word 2q'+1 (high) = u_q'.
  for (int lane = 0; lane < 16; ++lane) {
    const int q = lane;  // relative to 16r
    const int lo = (q + 1) ^ 1, hi = q ^ 1;  // element offsets from 16r
    t.build_a[2 * lane] = static_cast<int16_t>(lo);
    t.build_a[2 * lane + 1] = static_cast<int16_t>(hi);
    t.build_b[2 * lane] = static_cast<int16_t>(lo < 16 ? lo : 32 + lo - 16);
    t.build_b[2 * lane + 1] = static_cast<int16_t>(hi < 16 ? hi : 32 + hi - 16);
  }
  for (int i = 0; i < kTileWeights; ++i) {
    int b = (i + 1) * K - 16;
    if (b < 0) b += 256 * K;
    const int q = b >> 4, v = i / 16, l = i % 16;
    const int lo = WindowTables<K>::PairLo(v), hi = WindowTables<K>::PairHi(v);
    int idx;
    if (q >= 16 * lo && q < 16 * lo + 16) {
      idx = q - 16 * lo;
    } else {
      idx = 16 + q - 16 * hi;
      if (idx < 16 || idx >= 32) std::abort();  // cannot happen for K <= 15
    }
    t.pick[v][l] = idx;
    t.shift[l] = 16 - (b & 15);  // the same for every v (16vK = 0 mod 16)
  }
  return t;
}

template <int K>
const WindowTables<K>& GetWindowTables() {
  static const WindowTables<K> tables = MakeWindowTables<K>();
  return tables;
}

// The K registers H_r of one tile.
template <int K>
struct TileRegs {
  __m512i h[K];
};

// Loads stay inside the tile: a (masked) load that reaches into the next
// tile's cache line costs an extra DRAM miss per tile (measured: -30 %).
template <int K>
inline TileRegs<K> LoadTile(const uint16_t* tile, const WindowTables<K>& wt) {
  TileRegs<K> t;
  // Elements 0..31 (K >= 2) or 0..15 (K = 1): the wrap source for units 16K, 16K+1.
  const __m512i first =
      K >= 2 ? _mm512_loadu_si512(tile)
             : _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile)));
  for (int r = 0; r + 1 < K; ++r) {
    const __m512i units = r == 0 ? first : _mm512_loadu_si512(tile + 16 * r);  // 16r .. 16r+31
    t.h[r] = _mm512_permutexvar_epi16(_mm512_load_si512(wt.build_a), units);
  }
  const __m512i last = _mm512_castsi256_si512(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 16 * (K - 1))));
  t.h[K - 1] = _mm512_permutex2var_epi16(last, _mm512_load_si512(wt.build_b), first);
  return t;
}

// The 16 states of positions 16v .. 16v+15, one per 32-bit lane.
template <int K, int V>
inline __m512i States(const TileRegs<K>& t, const WindowTables<K>& wt, __m512i shift) {
  constexpr int lo = WindowTables<K>::PairLo(V), hi = WindowTables<K>::PairHi(V);
  const __m512i h = _mm512_permutex2var_epi32(t.h[lo], _mm512_load_si512(wt.pick[V]), t.h[hi]);
  return _mm512_and_si512(_mm512_srlv_epi32(h, shift), _mm512_set1_epi32(0xFFFF));
}

// Calls f.template operator()<P>() for P = 0 .. N-1 (compile-time unrolling,
// so the register pair of every vector is a constant).
template <int N, typename F>
inline void Unroll(F&& f) {
  [&]<int... P>(std::integer_sequence<int, P...>) { (f.template operator()<P>(), ...); }
  (std::make_integer_sequence<int, N>());
}

inline __m512 RoundToHalf(__m512 f) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// mul1 byte sum t of the product (§4.3).
template <bool kVnni>
inline __m512i ByteSum(__m512i x) {
  if constexpr (kVnni) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_set1_epi32(0x01010101));
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(x, _mm512_set1_epi8(1)), _mm512_set1_epi16(1));
  }
}

// fp16 halves of a 3inst/mcg word (exponent field 0b011??, always normal).
inline __m512 HalfPairSum(__m512i x) {
  x = _mm512_ternarylogic_epi32(x, _mm512_set1_epi32(static_cast<int>(kHalfPairMask)),
                                _mm512_set1_epi32(static_cast<int>(kHalfPairXor)), 0x6A);
  const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
  const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
  return _mm512_add_ps(lo, hi);  // exact (§4.4)
}

using avx512_inl::Mul1WeightFromMagic;  // exact fp16-rounded mul1 weight (see there)

// mul1 weight of the product x = s·0x83DCD12D.
template <bool kVnni>
inline __m512 Mul1WeightOfProduct(__m512i x) {
  __m512i tbits;
  if constexpr (kVnni) {
    tbits = _mm512_dpbusd_epi32(_mm512_set1_epi32(internal::kFloatMagicBits), x,
                                _mm512_set1_epi32(0x01010101));
  } else {
    tbits = _mm512_add_epi32(ByteSum<false>(x), _mm512_set1_epi32(internal::kFloatMagicBits));
  }
  return Mul1WeightFromMagic(_mm512_castsi512_ps(tbits));
}

// State -> the fp32 value of the fp16 weight, bit-exact with DecodeState.
template <Codebook kCb, bool kVnni>
inline __m512 DecodeStates(__m512i s) {
  if constexpr (kCb == Codebook::kMul1) {
    return Mul1WeightOfProduct<kVnni>(_mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(kMul1Mul))));
  } else if constexpr (kCb == Codebook::kMcg) {
    return RoundToHalf(HalfPairSum(_mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(kMcgMul)))));
  } else {
    const __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(k3InstMul)),
                                       _mm512_set1_epi32(k3InstAdd));
    return RoundToHalf(HalfPairSum(x));
  }
}

inline void PrefetchTile(const uint16_t* tile, int bits) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int off = 0; off < 32 * bits; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// Sums of a group accumulator: column p (lanes with bit 2 clear), column p+8.
template <typename T>
inline void ReduceGroup(const T lanes[16], T* col_p, T* col_p8) {
  T a = 0, b = 0;
  for (int e = 0; e < 16; ++e) {
    if (e & 4) b += lanes[e]; else a += lanes[e];
  }
  *col_p = a;
  *col_p8 = b;
}

// GEMV path, fp32: rows [row0, row0 + R) of the block.
//   Per 16 weights, mul1 (uops on Intel, zmm; p0 = the only port for 512-bit
//   shifts and integer multiplies, p05 = both vector ports):
//     window   vpermi2d (p5) + vpsrlvd (p0) + vpandd (p05)            3
//     product  vpmulld (2 x p0)                                       2
//     t        vpdpbusd into a 2^23 float bias (p0)                   1
//     weight   fma + Veltkamp RNE (mul, sub, sub) (p05)               4
//     MAC      1 vfmadd per activation row, x_pos as memory operand   R
//   = 10 + R uops (4 on p0): ~5.5 cycles / 16 weights at R = 1 (was ~16
//   uops); + ~(K+1)/16 uops per vector to build the tile's H registers.
//   3inst/mcg: window 3 + vpmulld 2 [+ vpaddd] + vpternlogd + 2 x (vpmovdw 2
//   + vcvtph2ps 2) + vpsrld + vaddps + RNE 4 (vcvtps2ph/vcvtph2ps) ~ 21.
template <int K, Codebook kCb, bool kVnni, int R>
void GemvRows(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;  // uint16 between rows of tiles
  const WindowTables<K>& wt = GetWindowTables<K>();
  const __m512i shift = _mm512_load_si512(wt.shift);
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m512 acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm512_setzero_ps();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * K;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, K);
      const TileRegs<K> regs = LoadTile<K>(tile, wt);
      const float* xp[R];
      for (int b = 0; b < R; ++b) xp[b] = pr.x_pos + ((row0 + b) * groups + tk) * 32;
      Unroll<8>([&]<int P>() {
        const __m512 w0 = DecodeStates<kCb, kVnni>(States<K, 2 * P>(regs, wt, shift));
        const __m512 w1 = DecodeStates<kCb, kVnni>(States<K, 2 * P + 1>(regs, wt, shift));
        for (int b = 0; b < R; ++b) {
          acc[b][P] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp[b]), acc[b][P]);
          acc[b][P] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp[b] + 16), acc[b][P]);
        }
      });
    }
    for (int b = 0; b < R; ++b) {
      float* out = pr.y + (row0 + b) * view.n + n0 + tn * kTileDim;
      for (int p = 0; p < 8; ++p) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc[b][p]);
        ReduceGroup(lanes, out + p, out + p + 8);
      }
    }
  }
}

// GEMV path, kInt8 (mul1 only): integer byte-sum dot products.
//   Per 16 weights with VNNI: window 3 (vpermi2d p5, vpsrlvd p0, vpandd p05)
//   + vpmulld 2 (p0) + 1 vpdpbusd (p0) per activation row against the
//   replicated int8 activation (memory operand) = 5 + R uops, 3 + R of them
//   on p0: ~4 cycles / 16 weights at R = 1 (was 9 uops, 7 on p0), plus
//   ~(K+1)/16 per vector for the H registers.
template <int K, bool kVnni, int R>
void GemvRowsInt8(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;
  const WindowTables<K>& wt = GetWindowTables<K>();
  const __m512i shift = _mm512_load_si512(wt.shift);
  const __m512i mul = _mm512_set1_epi32(static_cast<int>(kMul1Mul));
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m512i acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm512_setzero_si512();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * K;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, K);
      const TileRegs<K> regs = LoadTile<K>(tile, wt);
      const uint32_t* xq[R];
      for (int b = 0; b < R; ++b) xq[b] = pr.x_pos_i8 + ((row0 + b) * groups + tk) * 32;
      Unroll<8>([&]<int P>() {
        const __m512i x0 = _mm512_mullo_epi32(States<K, 2 * P>(regs, wt, shift), mul);
        const __m512i x1 = _mm512_mullo_epi32(States<K, 2 * P + 1>(regs, wt, shift), mul);
        for (int b = 0; b < R; ++b) {
          const __m512i a0 = _mm512_loadu_si512(xq[b]);
          const __m512i a1 = _mm512_loadu_si512(xq[b] + 16);
          if constexpr (kVnni) {
            acc[b][P] = _mm512_dpbusd_epi32(acc[b][P], x0, a0);
            acc[b][P] = _mm512_dpbusd_epi32(acc[b][P], x1, a1);
          } else {
            // t (< 2^10) in the low half of each word times the sign-extended
            // activation: one vpmaddwd each (the high halves multiply 0).
            const __m512i t0 = ByteSum<false>(x0);
            const __m512i t1 = ByteSum<false>(x1);
            const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(a0, 24), 24);
            const __m512i s1 = _mm512_srai_epi32(_mm512_slli_epi32(a1, 24), 24);
            acc[b][P] = _mm512_add_epi32(acc[b][P], _mm512_madd_epi16(t0, s0));
            acc[b][P] = _mm512_add_epi32(acc[b][P], _mm512_madd_epi16(t1, s1));
          }
        }
      });
    }
    for (int b = 0; b < R; ++b) {
      const int64_t row = row0 + b;
      int32_t* out = pr.y_int + row * view.n + n0 + tn * kTileDim;
      for (int p = 0; p < 8; ++p) {
        alignas(64) int32_t lanes[16];
        _mm512_store_si512(lanes, acc[b][p]);
        ReduceGroup(lanes, &out[p], &out[p + 8]);
      }
    }
  }
}

// GEMV path, kInt8 with VNNI, kStripMinRows or more rows (verify steps and
// batched decode; the 6- and 8-bit heads of real checkpoints and CPUs
// without VBMI2 take this path). GemvRowsInt8 keeps 8 accumulators per row,
// so rows ran in passes of 4, each decoding every tile again (13 rows: 4
// decodes of the whole weight), and paid 2 vpdpbusd per row and 32 weights.
// Here, per strip of kStripGroups rows of tiles:
//   - each row's activation pair vector is built once, A[i][tk] lane l =
//     int16 q(row l) | int16 q(row 16 + l) << 16 (q: the int8 activation of
//     x_pos_i8's a0 / a1 lanes), and reused by the block's 8 column tiles;
//   - each tile is decoded once per pass into its 8 byte-sum vectors, T[P]
//     lane l = t(product 2P, l) | t(product 2P + 1, l) << 16 (t < 2^10);
//   - every row then runs over them in groups of up to 8, two output
//     positions P at a time: ONE vpdpwssd per row and 32 weights, T·A =
//     t0·q0 + t1·q1, exactly GemvRowsInt8's two vpdpbusd (t·q is the dot of
//     the product's 4 unsigned bytes with q replicated).
// p0 uops per 32 weights: ~9 for the decode once + 1 per row (16 rows: 25,
// where four 4-row passes took 56). Partial sums wait in `sums` between
// strips. int32 sums are exact (wrapping adds, any order), so the outputs
// are bit for bit GemvRowsInt8's (kernels.TrellisGemmRowsTest).
constexpr int64_t kStripGroups = 64;  // rows of tiles per strip
constexpr int64_t kStripMinRows = 5;  // fewer rows: GemvRowsInt8 (one pass; equal at 4)
constexpr int kStripRowGroup = 8;     // rows per walk over a strip's tiles

// Rows [0, R) of a group over one column tile's strip: t_vectors [strip][8
// P], pairs[b] [strip] (row b's A vectors), sums [R][8 P][16 lanes] in and out.
template <int R>
void StripRowsInt8(const __m512i* t_vectors, int64_t strip, const __m512i* const* pairs,
                   int32_t* sums) {
  for (int P = 0; P < 8; P += 2) {
    __m512i acc[R][2];
    for (int b = 0; b < R; ++b) {
      acc[b][0] = _mm512_load_si512(sums + (b * 8 + P) * 16);
      acc[b][1] = _mm512_load_si512(sums + (b * 8 + P + 1) * 16);
    }
    const __m512i* tv = t_vectors + P;
    for (int64_t t = 0; t < strip; ++t, tv += 8) {
      const __m512i t0 = _mm512_load_si512(tv);
      const __m512i t1 = _mm512_load_si512(tv + 1);
      for (int b = 0; b < R; ++b) {
        const __m512i a = _mm512_load_si512(pairs[b] + t);
        acc[b][0] = _mm512_dpwssd_epi32(acc[b][0], t0, a);
        acc[b][1] = _mm512_dpwssd_epi32(acc[b][1], t1, a);
      }
    }
    for (int b = 0; b < R; ++b) {
      _mm512_store_si512(sums + (b * 8 + P) * 16, acc[b][0]);
      _mm512_store_si512(sums + (b * 8 + P + 1) * 16, acc[b][1]);
    }
  }
}

using StripRowsFn = void (*)(const __m512i*, int64_t, const __m512i* const*, int32_t*);
constexpr StripRowsFn kStripRows[kStripRowGroup + 1] = {
    nullptr,          StripRowsInt8<1>, StripRowsInt8<2>, StripRowsInt8<3>, StripRowsInt8<4>,
    StripRowsInt8<5>, StripRowsInt8<6>, StripRowsInt8<7>, StripRowsInt8<8>};

template <int K>
void GemvStripsInt8(const TrellisGemmProblem& pr, int64_t n0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;
  const int64_t m = pr.m;
  const WindowTables<K>& wt = GetWindowTables<K>();
  const __m512i shift = _mm512_load_si512(wt.shift);
  const __m512i mul = _mm512_set1_epi32(static_cast<int>(kMul1Mul));
  const __m512i ones = _mm512_set1_epi32(0x01010101);
  // Per thread, grown only: a strip's t vectors [strip][8], the rows' pair
  // vectors [m][strip], the sums [8 tiles][m][8 P] (x 16 int32 each).
  const int64_t t_count = kStripGroups * 8;
  const int64_t pair_count = m * kStripGroups;
  const int64_t sum_count = kTilesPerBlock * m * 8;
  struct Scratch {
    std::unique_ptr<int32_t[], decltype(&std::free)> data{nullptr, &std::free};
    int64_t vectors = 0;
  };
  thread_local Scratch scratch;
  const int64_t need = t_count + pair_count + sum_count;
  if (scratch.vectors < need) {
    scratch.data.reset(static_cast<int32_t*>(std::aligned_alloc(64, need * sizeof(__m512i))));
    EXL3_CHECK(scratch.data != nullptr);
    scratch.vectors = need;
  }
  __m512i* t_vectors = reinterpret_cast<__m512i*>(scratch.data.get());
  __m512i* pairs = t_vectors + t_count;
  int32_t* sums = reinterpret_cast<int32_t*>(pairs + pair_count);
  std::memset(sums, 0, static_cast<size_t>(sum_count) * sizeof(__m512i));
  for (int64_t g0 = 0; g0 < groups; g0 += kStripGroups) {
    const int64_t strip = std::min(kStripGroups, groups - g0);
    // A[i][t]: words 2l, 2l + 1 of lane l = sign-extended q of a0[l], a1[l]
    // (each dword of x_pos_i8 holds its q in all four bytes).
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t* x = pr.x_pos_i8 + (i * groups + g0) * 32;
      for (int64_t t = 0; t < strip; ++t, x += 32) {
        const __m512i q0 = _mm512_srai_epi16(_mm512_loadu_si512(x), 8);
        const __m512i q1 = _mm512_srai_epi16(_mm512_loadu_si512(x + 16), 8);
        _mm512_store_si512(pairs + i * kStripGroups + t,
                           _mm512_mask_blend_epi16(0xAAAAAAAAu, q0, q1));
      }
    }
    for (int tn = 0; tn < kTilesPerBlock; ++tn) {
      const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * K + g0 * row_stride;
      for (int64_t t = 0; t < strip; ++t, tile += row_stride) {
        if (g0 + t + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, K);
        const TileRegs<K> regs = LoadTile<K>(tile, wt);
        __m512i* out = t_vectors + t * 8;
        Unroll<8>([&]<int P>() {
          const __m512i x0 = _mm512_mullo_epi32(States<K, 2 * P>(regs, wt, shift), mul);
          const __m512i x1 = _mm512_mullo_epi32(States<K, 2 * P + 1>(regs, wt, shift), mul);
          const __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x0, ones);
          const __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x1, ones);
          _mm512_store_si512(out + P, _mm512_or_si512(t0, _mm512_slli_epi32(t1, 16)));
        });
      }
      int32_t* tile_sums = sums + tn * m * 8 * 16;
      for (int64_t row0 = 0; row0 < m; row0 += kStripRowGroup) {
        const int rows = static_cast<int>(std::min<int64_t>(kStripRowGroup, m - row0));
        const __m512i* row_pairs[kStripRowGroup];
        for (int b = 0; b < rows; ++b) row_pairs[b] = pairs + (row0 + b) * kStripGroups;
        kStripRows[rows](t_vectors, strip, row_pairs, tile_sums + row0 * 8 * 16);
      }
    }
  }
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    for (int64_t row = 0; row < m; ++row) {
      int32_t* out = pr.y_int + row * view.n + n0 + tn * kTileDim;
      const int32_t* lanes = sums + ((tn * m + row) * 8) * 16;
      for (int p = 0; p < 8; ++p, lanes += 16) {
        ReduceGroup(lanes, &out[p], &out[p + 8]);
      }
    }
  }
}

// Offsets of trellis position j inside a 16-row x 64-column panel slice:
// 64·row + column (§3.2).
struct ScatterTable {
  int16_t offset[kTileWeights];
};
const ScatterTable& GetScatterTable() {
  static const ScatterTable table = [] {
    ScatterTable t;
    for (int j = 0; j < kTileWeights; ++j) {
      const int rc = TilePermutation(j);
      t.offset[j] = static_cast<int16_t>((rc / kTileDim) * kGemmPanel + rc % kTileDim);
    }
    return t;
  }();
  return table;
}

// Micro-kernel: y[i][c0 .. c0+64) (+)= Σ_{kk < kc} x'[i][k0 + kk] · panel[kk][..]
// for kMr rows; `first` starts from zero instead of y.
template <int kMr>
void MicroKernel(const float* x, int64_t ldx, const float* panel, int kc, float* y, int64_t ldy,
                 bool first) {
  __m512 acc[kMr][4];
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy + 16 * j);
    }
  }
  for (int kk = 0; kk < kc; ++kk) {
    const float* w = panel + kk * kGemmPanel;
    const __m512 b0 = _mm512_load_ps(w);
    const __m512 b1 = _mm512_load_ps(w + 16);
    const __m512 b2 = _mm512_load_ps(w + 32);
    const __m512 b3 = _mm512_load_ps(w + 48);
    for (int i = 0; i < kMr; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
      acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(a, b2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(a, b3, acc[i][3]);
    }
  }
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int, float*, int64_t, bool);
constexpr MicroFn kMicro[kGemmMr + 1] = {nullptr, MicroKernel<1>, MicroKernel<2>, MicroKernel<3>,
                                         MicroKernel<4>, MicroKernel<5>, MicroKernel<6>};

template <int K, Codebook kCb, bool kVnni>
void GemmBlock(const TrellisGemmProblem& pr, int64_t n0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t k = view.k;
  const int64_t n = view.n;
  const int64_t m = pr.m;
  const int64_t tiles_n = n / kTileDim;
  const WindowTables<K>& wt = GetWindowTables<K>();
  const __m512i shift = _mm512_load_si512(wt.shift);
  const ScatterTable& st = GetScatterTable();
  // Two panels of kGemmKc x 64 floats, reused by this thread across calls.
  thread_local std::unique_ptr<float[], decltype(&std::free)> buffer(
      static_cast<float*>(std::aligned_alloc(64, 2 * kGemmKc * kGemmPanel * sizeof(float))),
      &std::free);
  float* panels = buffer.get();
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::fill_n(pr.y + i * n + n0, internal::kColumnBlock, 0.0f);
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kGemmKc) {
    const int kc = static_cast<int>(std::min<int64_t>(kGemmKc, k - k0));
    for (int tkl = 0; tkl < kc / kTileDim; ++tkl) {
      const int64_t tk = k0 / kTileDim + tkl;
      for (int tn = 0; tn < kTilesPerBlock; ++tn) {
        const TileRegs<K> regs =
            LoadTile<K>(view.trellis + (tk * tiles_n + n0 / kTileDim + tn) * 16 * K, wt);
        float* dst = panels + (tn / 4) * kGemmKc * kGemmPanel + tkl * kTileDim * kGemmPanel +
                     (tn % 4) * kTileDim;
        alignas(64) float decoded[kTileWeights];
        Unroll<kVectors>([&]<int V>() {
          _mm512_store_ps(decoded + 16 * V, DecodeStates<kCb, kVnni>(States<K, V>(regs, wt, shift)));
        });
        for (int j = 0; j < kTileWeights; ++j) dst[st.offset[j]] = decoded[j];
      }
    }
    for (int panel = 0; panel < 2; ++panel) {
      const float* w = panels + panel * kGemmKc * kGemmPanel;
      for (int64_t i = 0; i < m; i += kGemmMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kGemmMr, m - i));
        kMicro[rows](pr.x_had + i * k + k0, k, w, kc, pr.y + i * n + n0 + panel * kGemmPanel, n,
                     k0 == 0);
      }
    }
  }
}

// kBf16 emulation micro-kernel (AVX-512 CPUs without BF16): the same
// arithmetic as vdpbf16ps lane by lane. A bf16 pair word splits into two
// floats (<< 16, & 0xFFFF0000); the product of two bf16 values is exact in
// fp32, so fma(x_hi, w_hi, acc) then fma(x_lo, w_lo, acc) rounds exactly
// like vdpbf16ps's two adds; MXCSR FTZ/DAZ (set by the caller) flush tiny
// partial sums like it does. Per k pair: 4 loads + 4 vpslld + 4 vpandd +
// 6 x (2 broadcasts + 8 FMA): ~2x the fp32 kernel's FMA count.
template <int kMr>
void Bf16EmuMicroKernel(const uint32_t* x, const uint32_t* panel, int kc, float* y, int64_t ldy,
                        bool first) {
  __m512 acc[kMr][4];
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy + 16 * j);
    }
  }
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < kc / 2; ++p) {
    __m512 wlo[4], whi[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_load_si512(panel + p * kGemmPanel + 16 * j);
      wlo[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      whi[j] = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
    }
    const uint32_t* xp = x + p * internal::kBf16RowGroup;
    for (int i = 0; i < kMr; ++i) {
      const __m512 xhi = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp[i] & 0xFFFF0000u)));
      const __m512 xlo = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(xp[i] << 16)));
      for (int j = 0; j < 4; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xhi, whi[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xlo, wlo[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
  }
}

using Bf16MicroFn = void (*)(const uint32_t*, const uint32_t*, int, float*, int64_t, bool);
constexpr Bf16MicroFn kBf16EmuMicro[internal::kBf16RowGroup + 1] = {
    nullptr, Bf16EmuMicroKernel<1>, Bf16EmuMicroKernel<2>, Bf16EmuMicroKernel<3>,
    Bf16EmuMicroKernel<4>, Bf16EmuMicroKernel<5>, Bf16EmuMicroKernel<6>};

// fp32 rows 2q, 2q+1 of a 64-column panel -> bf16 pair words (RNE; fp16
// weights are never NaN or below 2^-126, so no flush is needed here).
inline void PackBf16Pairs(const float* lo_row, const float* hi_row, uint32_t* dst) {
  const __m512i half = _mm512_set1_epi32(0x7FFF);
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < kGemmPanel / 16; ++j) {
    __m512i lo = _mm512_castps_si512(_mm512_load_ps(lo_row + 16 * j));
    __m512i hi = _mm512_castps_si512(_mm512_load_ps(hi_row + 16 * j));
    lo = _mm512_add_epi32(lo, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(lo, 16), one)));
    hi = _mm512_add_epi32(hi, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(hi, 16), one)));
    // (lo >> 16) | (hi & 0xFFFF0000): vpternlogd with the mask as third operand.
    _mm512_store_si512(dst + 16 * j,
                       _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 16), hi,
                                                 _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)),
                                                 0xF8));  // a | (b & c)
  }
}

// kBf16 tile GEMM for one 128-column block: decode kc rows x 128 columns to
// fp32 (as GemmBlock), round to bf16 pair panels (2 x kc/2 x 64 words), then
//  - AMX (AmxEnabled): kc = kBf16AmxKc; TDPBF16PS over 32x32 output tiles
//    into an fp32 accumulator block (rows padded to 32), copied to y at the end;
//  - else kc = kGemmKc (32 KB of panels, L1): the vdpbf16ps micro-kernel, or
//    its FMA emulation, per row group: the scalar reference's order.
// Ascending k chunks either way; nothing depends on the thread.
constexpr int kBf16AmxKc = 512;

template <int K, Codebook kCb, bool kVnni>
void GemmBlockBf16(const TrellisGemmProblem& pr, int64_t n0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t k = view.k;
  const int64_t n = view.n;
  const int64_t m = pr.m;
  const int64_t tiles_n = n / kTileDim;
  const WindowTables<K>& wt = GetWindowTables<K>();
  const __m512i shift = _mm512_load_si512(wt.shift);
  const ScatterTable& st = GetScatterTable();
  struct Buffers {
    float* f32 =
        static_cast<float*>(std::aligned_alloc(64, 2 * kBf16AmxKc * kGemmPanel * sizeof(float)));
    uint32_t* bf16 =
        static_cast<uint32_t*>(std::aligned_alloc(64, kBf16AmxKc * kGemmPanel * sizeof(uint32_t)));
    std::vector<float> amx_acc;
    ~Buffers() {
      std::free(f32);
      std::free(bf16);
    }
  };
  thread_local Buffers buffers;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::fill_n(pr.y + i * n + n0, internal::kColumnBlock, 0.0f);
    return;
  }
  const bool amx = avx512bf16::AmxEnabled();
  const int chunk = amx ? kBf16AmxKc : kGemmKc;
  const int64_t rows_pad = (m + internal::kBf16AmxRows - 1) / internal::kBf16AmxRows *
                           internal::kBf16AmxRows;
  if (amx) buffers.amx_acc.assign(static_cast<size_t>(rows_pad * internal::kColumnBlock), 0.0f);
  const bool native = avx512bf16::Enabled();
  unsigned saved_csr = 0;
  if (!native && !amx) {
    saved_csr = _mm_getcsr();
    _mm_setcsr(saved_csr | 0x8040u);  // FTZ | DAZ, restored below
  }
  const int64_t pairs = k / 2;
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int kc = static_cast<int>(std::min<int64_t>(chunk, k - k0));
    for (int tkl = 0; tkl < kc / kTileDim; ++tkl) {
      const int64_t tk = k0 / kTileDim + tkl;
      for (int tn = 0; tn < kTilesPerBlock; ++tn) {
        const TileRegs<K> regs =
            LoadTile<K>(view.trellis + (tk * tiles_n + n0 / kTileDim + tn) * 16 * K, wt);
        float* dst = buffers.f32 + (tn / 4) * chunk * kGemmPanel + tkl * kTileDim * kGemmPanel +
                     (tn % 4) * kTileDim;
        alignas(64) float decoded[kTileWeights];
        Unroll<kVectors>([&]<int V>() {
          _mm512_store_ps(decoded + 16 * V, DecodeStates<kCb, kVnni>(States<K, V>(regs, wt, shift)));
        });
        for (int j = 0; j < kTileWeights; ++j) dst[st.offset[j]] = decoded[j];
      }
    }
    for (int panel = 0; panel < 2; ++panel) {
      const float* src = buffers.f32 + panel * chunk * kGemmPanel;
      uint32_t* dst = buffers.bf16 + panel * (chunk / 2) * kGemmPanel;
      for (int q = 0; q < kc / 2; ++q) {
        PackBf16Pairs(src + 2 * q * kGemmPanel, src + (2 * q + 1) * kGemmPanel, dst + q * kGemmPanel);
      }
    }
    if (amx) {
      avx512bf16::AmxChunk(pr.x_bf16_tiles + k0 * 16, k, rows_pad, buffers.bf16, (chunk / 2) * kGemmPanel,
                           kc, buffers.amx_acc.data());
      continue;
    }
    for (int64_t i = 0; i < m; i += internal::kBf16RowGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(internal::kBf16RowGroup, m - i));
      const uint32_t* xg = pr.x_bf16 + (i / internal::kBf16RowGroup) * pairs * internal::kBf16RowGroup +
                           (k0 / 2) * internal::kBf16RowGroup;
      for (int panel = 0; panel < 2; ++panel) {
        const uint32_t* w = buffers.bf16 + panel * (chunk / 2) * kGemmPanel;
        float* yp = pr.y + i * n + n0 + panel * kGemmPanel;
        if (native) {
          avx512bf16::MicroKernel(rows, xg, w, kc, yp, n, k0 == 0);
        } else {
          kBf16EmuMicro[rows](xg, w, kc, yp, n, k0 == 0);
        }
      }
    }
  }
  if (!native && !amx) _mm_setcsr(saved_csr);
  if (amx) {
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(pr.y + i * n + n0, buffers.amx_acc.data() + i * internal::kColumnBlock,
                  internal::kColumnBlock * sizeof(float));
    }
  }
}

template <int K, Codebook kCb, bool kVnni>
void ColumnBlockFor(const TrellisGemmProblem& pr, int64_t block) {
  const int64_t n0 = block * internal::kColumnBlock;
  const int64_t m = pr.m;
  if (pr.precision == TrellisGemmPrecision::kBf16) {
    GemmBlockBf16<K, kCb, kVnni>(pr, n0);
    return;
  }
  if constexpr (kCb == Codebook::kMul1 && K <= 4 && kVnni) {
    // VBMI/VBMI2 CPUs: the column-sliced GEMV (trellis_gemm_gemv_avx512icl.cc).
    if (avx512icl::Enabled()) {
      if (pr.precision == TrellisGemmPrecision::kInt8) {
        avx512icl::Mul1GemvBlockFn(K, true)(pr, block);
        return;
      }
      if (m <= kGemvMaxRows) {
        avx512icl::Mul1GemvBlockFn(K, false)(pr, block);
        return;
      }
    }
  }
  if constexpr (kCb == Codebook::kMul1) {
    if (pr.precision == TrellisGemmPrecision::kInt8) {
      if constexpr (kVnni) {
        if (m >= kStripMinRows) {
          GemvStripsInt8<K>(pr, n0);
          return;
        }
      }
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) GemvRowsInt8<K, kVnni, 4>(pr, n0, i);
      switch (m - i) {
        case 3: GemvRowsInt8<K, kVnni, 3>(pr, n0, i); break;
        case 2: GemvRowsInt8<K, kVnni, 2>(pr, n0, i); break;
        case 1: GemvRowsInt8<K, kVnni, 1>(pr, n0, i); break;
        default: break;
      }
      return;
    }
  }
  if (m <= kGemvMaxRows && pr.x_pos != nullptr) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) GemvRows<K, kCb, kVnni, 4>(pr, n0, i);
    switch (m - i) {
      case 3: GemvRows<K, kCb, kVnni, 3>(pr, n0, i); break;
      case 2: GemvRows<K, kCb, kVnni, 2>(pr, n0, i); break;
      case 1: GemvRows<K, kCb, kVnni, 1>(pr, n0, i); break;
      default: break;
    }
    return;
  }
  GemmBlock<K, kCb, kVnni>(pr, n0);
}

using BlockFn = void (*)(const TrellisGemmProblem&, int64_t);

template <Codebook kCb, bool kVnni>
BlockFn PickK(int bits) {
  switch (bits) {
    case 1: return &ColumnBlockFor<1, kCb, kVnni>;
    case 2: return &ColumnBlockFor<2, kCb, kVnni>;
    case 3: return &ColumnBlockFor<3, kCb, kVnni>;
    case 4: return &ColumnBlockFor<4, kCb, kVnni>;
    case 5: return &ColumnBlockFor<5, kCb, kVnni>;
    case 6: return &ColumnBlockFor<6, kCb, kVnni>;
    case 7: return &ColumnBlockFor<7, kCb, kVnni>;
    default: return &ColumnBlockFor<8, kCb, kVnni>;
  }
}

template <bool kVnni>
BlockFn Pick(Codebook cb, int bits) {
  switch (cb) {
    case Codebook::kMul1: return PickK<Codebook::kMul1, kVnni>(bits);
    case Codebook::kMcg: return PickK<Codebook::kMcg, kVnni>(bits);
    default: return PickK<Codebook::k3Inst, kVnni>(bits);
  }
}

}  // namespace

void Mul1WeightsForTest(const int32_t* t, int64_t count, float* w) {
  for (int64_t i = 0; i + 16 <= count; i += 16) {
    const __m512i tv = _mm512_loadu_si512(t + i);
    _mm512_storeu_ps(w + i, Mul1WeightFromMagic(_mm512_castsi512_ps(
                                _mm512_add_epi32(tv, _mm512_set1_epi32(internal::kFloatMagicBits)))));
  }
}

void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block) {
  const bool vnni = GetCpuFeatures().avx512vnni;
  const BlockFn fn = vnni ? Pick<true>(problem.view->codebook, problem.view->bits)
                          : Pick<false>(problem.view->codebook, problem.view->bits);
  fn(problem, block);
}

}  // namespace exl3serve::kernels::cpu::avx512
