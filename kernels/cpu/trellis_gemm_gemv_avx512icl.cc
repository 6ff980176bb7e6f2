// kernels/cpu/trellis_gemm_gemv_avx512icl.cc — the mul1 GEMV path of the
// AVX-512 TrellisGemm variant for K <= 4 on CPUs with AVX512-VBMI/VBMI2
// (Ice Lake and later, Zen 4). Compiled with those flags (file name suffix
// `_avx512icl.cc`, kernels/CMakeLists.txt); called from trellis_gemm_avx512.cc
// only after a runtime check (Supported()), never included elsewhere.
//
// Idea: a K <= 4 tile is at most 64 int16 = two zmm, so two byte permutes
// (vpermb after a vpermt2d gather, see SliceTables) can put ANY trellis unit into any 16-bit lane. The 32
// states of a vector are then chosen freely, in 16-bit lanes:
//   state = vpshldvw(u_q, u_{q+1}, o)   (unit pair of the window, §3.3-3.4)
// We choose them in output-column order ("slices"): slice s (0..7) holds rows
// 2s and 2s+1 of all 16 columns of the tile, so one accumulator per tile has
// lane = column and no group reduction is needed, and the walk can go
// tk-major over the block's 8 tiles of a row of tiles, which lie back to back
// in memory (1 KB at K = 4): the trellis is read sequentially in 32·K·8-byte
// runs (was: one 32K-byte tile per 16·K KB stride down a tile column), and a
// software prefetch runs kPrefetchRows rows of tiles ahead.
//
// mul1 in 16-bit lanes: x = s·0x83DCD12D mod 2^32 is
//   LO = lo16(s·0xD12D)                      vpmullw
//   HI = hi16(s·0xD12D) + lo16(s·0x83DC)     vpmulhuw + vpmullw + vpaddw
// and the byte sum t of x is the four bytes of (LO, HI) of that lane.
//
// kInt8, per 32 weights (uops, Intel ICL/SPR; p0 = the only 512-bit port for
// shifts/multiplies/VNNI, p5 = shuffles, p05 = either):
//   window   2 vpermb (p5) + vpshldvw (p0)                             3
//            (K = 3, 4: + 1 vpermt2d (p5) gathering the slice's dwords)
//   product  vpmullw + vpmulhuw + vpmullw (p0) + vpaddw (p05)          4
//   MAC      2 vpdpbusd (p0) per activation row, the activation dword
//            [a_2s a_2s a_2s+1 a_2s+1] as an {1to16} broadcast operand  2R
//   = 7 + 2R uops / 32 weights, 4 + 2R on p0: 6 cycles / 32 at R = 1 =
//   3 cycles / 16 (the 32-bit-lane form was 6 uops / 16, 4 on p0).
// kInt8 passes of >= 3 rows (verify steps, batched decode): t once per slice
//   (2 vpmaddubsw + vpaddw, as kFloat below), then ONE vpdpwssd per row
//   against the int16 pair [a_2s a_2s+1] ({1to16} from x_pair_i16):
//   10 + R uops, 6 + R on p0; a pass holds up to 16 rows (R·C <= 16
//   accumulators), so 5..16 rows decode each tile once instead of 2..4 times.
// kFloat (exact mul1 weights), per 32 weights:
//   window 3 + product 4 (as above)
//   t        2 vpmaddubsw (p0) + vpaddw (p05)                          3
//   to fp32  2 vpunpck{l,h}wd with 0x4B00 (p5): 2^23 + t as float      2
//   weight   2 x (fma + Veltkamp mul, sub, sub) (p05)                  8
//   MAC      2 vfmadd per row, activation broadcast from x' ({1to16})  2R
//   = 20 + 2R uops / 32, 6 on p0, 4 on p5: ~11 cycles / 32 at R = 1
//   (5.5 / 16, as the 32-bit form, but no H-register build, no group
//   reduction, one accumulator pair per tile and a sequential walk).
#include <immintrin.h>

// GCC 12 flags the intrinsics' internal _mm512_undefined_* as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "kernels/cpu/trellis_gemm_avx512_inl.h"
#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/trellis_decode.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels::cpu::avx512icl {
namespace {

using internal::TrellisGemmProblem;

constexpr int kSlices = 8;          // 8 vectors of 32 positions per tile
constexpr int kTilesPerBlock = 8;   // 128 columns
// Rows of tiles prefetched ahead of the walk (1 KB each at K = 4). Measured
// 2026-11-30 on a quiet box, batch 1, 2 threads, K = 4 int8, median of 3:
// 1 row 23.3, 2 rows 25.7, 3 rows 25.0, 4 rows 20.6-21.5, 8 rows 18.7-19.0
// G weights/s (deeper prefetch evicts the rows being decoded); K = 2, 3 are
// within noise for 2..4 rows.
constexpr int kPrefetchRows = 2;
// kInt8 passes of this many rows or more take the word form (PassInt8Words:
// 6 + R p0 uops per 32 weights) over the byte form (PassInt8: 4 + 2R).
// Measured 2026-12-03, 1 thread, hot cache, CPU time, K = 2 and 4: equal at
// 2..4 rows, the word form 1.4-1.7x faster from 5 rows (one decode per pass).
constexpr int kWordsMinRows = 3;

// Word w of slice s holds tile element (Row, Column):
//   kInt8:  dword lane j = words 2j, 2j+1 = rows 2s, 2s+1 of column j
//           (vpdpbusd sums one column per lane);
//   kFloat: vpunpcklwd takes words 8L+0..3 -> dword lanes 4L+0..3 and
//           vpunpckhwd words 8L+4..7 -> the same lanes, so words 8L+i
//           (i < 4) are row 2s, words 8L+4+i row 2s+1, column 4L+i.
constexpr int SliceRow(bool int8, int s, int w) {
  return int8 ? 2 * s + (w & 1) : 2 * s + ((w >> 2) & 1);
}
constexpr int SliceColumn(bool int8, int w) { return int8 ? w >> 1 : 4 * (w >> 3) + (w & 3); }

// K <= 2: the tile is one zmm; unit_a/unit_b index it directly (vpermb).
// K = 3, 4: the tile is two zmm and a two-source vpermt2b costs 2 cycles of
// p5 (measured: vpermb/vpermt2d 1.0, vpermt2b/vpermt2w 1.9 cycles per zmm),
// so first one vpermt2d gathers the <= 16 dwords the slice needs (`dwords`,
// checked in MakeSliceTables) into one zmm, then two vpermb pick from it:
// 3 p5 cycles per 32 states instead of 4.
struct SliceTables {
  alignas(64) uint8_t unit_a[kSlices][64];   // vpermb byte indices of u_q (window start)
  alignas(64) uint8_t unit_b[kSlices][64];   // ... of u_{q+1}
  alignas(64) uint16_t offset[kSlices][32];  // o = window start mod 16
  alignas(64) int32_t dwords[kSlices][16];   // K >= 3: vpermt2d dword picks (tile dword d)
};

SliceTables MakeSliceTables(int bits, bool int8) {
  SliceTables t;
  int position_of[kTileWeights];
  for (int j = 0; j < kTileWeights; ++j) position_of[TilePermutation(j)] = j;
  const int units = kTileDim * bits;  // 16K int16 per tile
  const bool compact = bits >= 3;
  for (int s = 0; s < kSlices; ++s) {
    int used = 0;  // compact: dwords gathered so far
    int slot_of[64];
    for (int d = 0; d < 64; ++d) slot_of[d] = -1;
    auto byte_of = [&](int e) {  // byte index of raw element e in the permute source
      if (!compact) return 2 * e;
      const int d = e >> 1;
      if (slot_of[d] < 0) {
        if (used == 16) std::abort();  // a slice needs <= 16 dwords for K <= 4
        slot_of[d] = used;
        t.dwords[s][used++] = d;
      }
      return 4 * slot_of[d] + 2 * (e & 1);
    };
    for (int w = 0; w < 32; ++w) {
      const int pos = position_of[kTileDim * SliceRow(int8, s, w) + SliceColumn(int8, w)];
      int b = (pos + 1) * bits - 16;  // first stream bit of the window (§3.4)
      if (b < 0) b += kTileWeights * bits;
      const int q = b >> 4;
      // Raw tile element e holds stream unit e ^ 1 (low half of each word first).
      const int ea = q ^ 1, eb = ((q + 1) % units) ^ 1;
      const int ba = byte_of(ea);
      // o = 0: u_{q+1} is shifted out entirely; reuse u_q (no extra dword).
      const int bb = (b & 15) == 0 ? ba : byte_of(eb);
      t.unit_a[s][2 * w] = static_cast<uint8_t>(ba);
      t.unit_a[s][2 * w + 1] = static_cast<uint8_t>(ba + 1);
      t.unit_b[s][2 * w] = static_cast<uint8_t>(bb);
      t.unit_b[s][2 * w + 1] = static_cast<uint8_t>(bb + 1);
      t.offset[s][w] = static_cast<uint16_t>(b & 15);
    }
    for (int d = used; d < 16; ++d) t.dwords[s][d] = 0;
  }
  return t;
}

template <int K, bool kInt8>
const SliceTables& GetSliceTables() {
  static const SliceTables tables = MakeSliceTables(K, kInt8);
  return tables;
}

// The raw tile (16K int16, K <= 4) as a 128-byte permute table pair. Loads
// stay inside the tile (a load into the next tile's line costs a DRAM miss).
template <int K>
struct RawTile {
  __m512i lo, hi;
};
template <int K>
inline RawTile<K> LoadRaw(const uint16_t* tile) {
  RawTile<K> r;
  if constexpr (K == 1) {
    r.lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile)));
  } else {
    r.lo = _mm512_loadu_si512(tile);
  }
  if constexpr (K == 3) {
    r.hi = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32)));
  } else if constexpr (K == 4) {
    r.hi = _mm512_loadu_si512(tile + 32);
  } else {
    r.hi = r.lo;  // indices < 64 never read it
  }
  return r;
}

// Product halves (LO, HI) of the 32 states of slice s.
template <int K>
inline void SliceProduct(const RawTile<K>& raw, const SliceTables& t, int s, __m512i* lo,
                         __m512i* hi) {
  __m512i ua, ub;
  if constexpr (K <= 2) {
    ua = _mm512_permutexvar_epi8(_mm512_load_si512(t.unit_a[s]), raw.lo);
    ub = _mm512_permutexvar_epi8(_mm512_load_si512(t.unit_b[s]), raw.lo);
  } else {
    const __m512i c = _mm512_permutex2var_epi32(raw.lo, _mm512_load_si512(t.dwords[s]), raw.hi);
    ua = _mm512_permutexvar_epi8(_mm512_load_si512(t.unit_a[s]), c);
    ub = _mm512_permutexvar_epi8(_mm512_load_si512(t.unit_b[s]), c);
  }
  const __m512i state = _mm512_shldv_epi16(ua, ub, _mm512_load_si512(t.offset[s]));
  const __m512i mul_lo = _mm512_set1_epi16(static_cast<int16_t>(kMul1Mul & 0xFFFF));
  const __m512i mul_hi = _mm512_set1_epi16(static_cast<int16_t>(kMul1Mul >> 16));
  *lo = _mm512_mullo_epi16(state, mul_lo);
  *hi = _mm512_add_epi16(_mm512_mulhi_epu16(state, mul_lo), _mm512_mullo_epi16(state, mul_hi));
}

inline void PrefetchRun(const uint16_t* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// kInt8 epilogue of a pass: acc[b][c] lane j = the exact int32 dot of row
// row0 + b with column tn0·16 + 16c + j of the block.
template <int R, int C>
inline void StoreInt8(const TrellisGemmProblem& pr, int64_t n0, int64_t row0, int tn0,
                      const __m512i (&acc)[R][C]) {
  for (int b = 0; b < R; ++b) {
    const int64_t row = row0 + b;
    int32_t* out = pr.y_int + row * pr.view->n + n0 + tn0 * kTileDim;
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_si512(out + c * kTileDim, acc[b][c]);
    }
  }
}

// kInt8, bytes: rows [row0, row0 + R) x tiles [tn0, tn0 + C) of the block at
// n0; 2 vpdpbusd per row and slice against the product bytes (LO, HI).
template <int K, int R, int C>
void PassInt8(const TrellisGemmProblem& pr, int64_t n0, int64_t row0, int tn0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;  // int16 between rows of tiles
  const SliceTables& st = GetSliceTables<K, true>();
  __m512i acc[R][C];
  for (int b = 0; b < R; ++b)
    for (int c = 0; c < C; ++c) acc[b][c] = _mm512_setzero_si512();
  const uint16_t* run = view.trellis + (n0 / kTileDim + tn0) * 16 * K;
  for (int64_t tk = 0; tk < groups; ++tk, run += row_stride) {
    if (tk + kPrefetchRows < groups) PrefetchRun(run + kPrefetchRows * row_stride, C * 32 * K);
    const int32_t* act[R];
    for (int b = 0; b < R; ++b) {
      act[b] = reinterpret_cast<const int32_t*>(pr.x_pair_i8) + ((row0 + b) * groups + tk) * 8;
    }
    for (int c = 0; c < C; ++c) {
      const RawTile<K> raw = LoadRaw<K>(run + c * 16 * K);
#pragma GCC unroll 8
      for (int s = 0; s < kSlices; ++s) {
        __m512i lo, hi;
        SliceProduct<K>(raw, st, s, &lo, &hi);
#pragma GCC unroll 16
        for (int b = 0; b < R; ++b) {
          const __m512i a = _mm512_set1_epi32(act[b][s]);
          acc[b][c] = _mm512_dpbusd_epi32(acc[b][c], lo, a);
          acc[b][c] = _mm512_dpbusd_epi32(acc[b][c], hi, a);
        }
      }
    }
  }
  StoreInt8<R, C>(pr, n0, row0, tn0, acc);
}

// acc += vpdpwssd(t, {1to16} broadcast of the dword at words + kOffset
// bytes): one micro-fused uop, its address a base register + displacement.
// In asm because with the intrinsic GCC hoists every row's broadcast out of
// the tile loop into stack copies, and with an "m" operand it keeps one
// pointer per (row, slice) on the stack. No memory operand is declared: the
// activations are written before the kernel is called and never during it.
template <int kOffset>
inline void DpwssdBroadcast(__m512i& acc, __m512i t, const int32_t* words) {
  asm("vpdpwssd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(t), "r"(words), "i"(kOffset));
}

// Slice s of the tile in column c of the pass: decoded once, its byte sums t
// meet every row b in Bs. Expanded at compile time (s, b, c all constants) so
// acc stays in registers.
template <int K, int R, int C, int c, int s, int... Bs>
inline void SliceWords(const RawTile<K>& raw, const SliceTables& st, __m512i ones,
                       const int32_t* words, __m512i (&acc)[R][C],
                       std::integer_sequence<int, Bs...>) {
  __m512i lo, hi;
  SliceProduct<K>(raw, st, s, &lo, &hi);
  const __m512i t =
      _mm512_add_epi16(_mm512_maddubs_epi16(lo, ones), _mm512_maddubs_epi16(hi, ones));
  (DpwssdBroadcast<4 * (Bs * kSlices + s)>(acc[Bs][c], t, words), ...);
}

template <int K, int R, int C, int c, int... Ss>
inline void TileWords(const uint16_t* run, const SliceTables& st, __m512i ones,
                      const int32_t* words, __m512i (&acc)[R][C],
                      std::integer_sequence<int, Ss...>) {
  const RawTile<K> raw = LoadRaw<K>(run + c * 16 * K);
  (SliceWords<K, R, C, c, Ss>(raw, st, ones, words, acc, std::make_integer_sequence<int, R>()),
   ...);
}

template <int K, int R, int C, int... Cs>
inline void RowOfTilesWords(const uint16_t* run, const SliceTables& st, __m512i ones,
                            const int32_t* words, __m512i (&acc)[R][C],
                            std::integer_sequence<int, Cs...>) {
  (TileWords<K, R, C, Cs>(run, st, ones, words, acc, std::make_integer_sequence<int, kSlices>()),
   ...);
}

// kInt8, words: as PassInt8, but the slice's byte sums t (< 1021) are formed
// once per decode (2 vpmaddubsw + vpaddw) and each row costs ONE vpdpwssd
// against the broadcast int16 pair [a_2s a_2s+1] (x_pair_i16): 4 + 2 + R p0
// uops per 32 weights instead of 4 + 2R. Same int32 sums (exact, and any
// wrap-around alike).
template <int K, int R, int C>
void PassInt8Words(const TrellisGemmProblem& pr, int64_t n0, int64_t row0, int tn0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;
  const SliceTables& st = GetSliceTables<K, true>();
  __m512i acc[R][C];
  for (int b = 0; b < R; ++b)
    for (int c = 0; c < C; ++c) acc[b][c] = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  const uint16_t* run = view.trellis + (n0 / kTileDim + tn0) * 16 * K;
  const int32_t* words = reinterpret_cast<const int32_t*>(pr.x_pair_i16) + row0 * kSlices;
  const int64_t words_stride = pr.m * kSlices;  // x_pair_i16 is tk-major
  for (int64_t tk = 0; tk < groups; ++tk, run += row_stride, words += words_stride) {
    if (tk + kPrefetchRows < groups) PrefetchRun(run + kPrefetchRows * row_stride, C * 32 * K);
    RowOfTilesWords<K, R, C>(run, st, ones, words, acc, std::make_integer_sequence<int, C>());
  }
  StoreInt8<R, C>(pr, n0, row0, tn0, acc);
}

// kFloat: same walk; two accumulators per (row, tile): rows 2s and 2s+1.
template <int K, int R, int C>
void PassFloat(const TrellisGemmProblem& pr, int64_t n0, int64_t row0, int tn0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t k = view.k;
  const int64_t groups = k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;
  const SliceTables& st = GetSliceTables<K, false>();
  __m512 acc[R][C][2];
  for (int b = 0; b < R; ++b)
    for (int c = 0; c < C; ++c) acc[b][c][0] = acc[b][c][1] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i magic = _mm512_set1_epi16(static_cast<int16_t>(internal::kFloatMagicBits >> 16));
  const uint16_t* run = view.trellis + (n0 / kTileDim + tn0) * 16 * K;
  for (int64_t tk = 0; tk < groups; ++tk, run += row_stride) {
    if (tk + kPrefetchRows < groups) PrefetchRun(run + kPrefetchRows * row_stride, C * 32 * K);
    const float* xr[R];
    for (int b = 0; b < R; ++b) xr[b] = pr.x_had + (row0 + b) * k + tk * kTileDim;
    for (int c = 0; c < C; ++c) {
      const RawTile<K> raw = LoadRaw<K>(run + c * 16 * K);
#pragma GCC unroll 8
      for (int s = 0; s < kSlices; ++s) {
        __m512i lo, hi;
        SliceProduct<K>(raw, st, s, &lo, &hi);
        const __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(lo, ones),
                                           _mm512_maddubs_epi16(hi, ones));
        const __m512 w0 = avx512_inl::Mul1WeightFromMagic(
            _mm512_castsi512_ps(_mm512_unpacklo_epi16(t, magic)));
        const __m512 w1 = avx512_inl::Mul1WeightFromMagic(
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(t, magic)));
#pragma GCC unroll 16
        for (int b = 0; b < R; ++b) {
          acc[b][c][0] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[b][2 * s]), acc[b][c][0]);
          acc[b][c][1] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[b][2 * s + 1]), acc[b][c][1]);
        }
      }
    }
  }
  for (int b = 0; b < R; ++b) {
    float* out = pr.y + (row0 + b) * view.n + n0 + tn0 * kTileDim;
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(out + c * kTileDim, _mm512_add_ps(acc[b][c][0], acc[b][c][1]));
    }
  }
}

// One pass of R rows over the whole block, C tiles at a time. Accumulators
// R·C (int8) or 2·R·C (fp32) stay <= 16 zmm, so nothing spills; C is the
// largest power of two that allows, so a tile is decoded once per pass of up
// to 16 (int8) / 8 (fp32) rows (was: once per 4 rows). C = 1 walks one tile
// column (a 32K-byte tile per row of tiles, prefetched); the per-tile work is
// then >= 9 rows' worth, far from the DRAM bound.
template <int K, bool kInt8, int R>
void RowsPass(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  constexpr int kAccPerTile = kInt8 ? R : 2 * R;
  constexpr int C = kAccPerTile <= 2 ? 8 : kAccPerTile <= 4 ? 4 : kAccPerTile <= 8 ? 2 : 1;
  static_assert(kAccPerTile * C <= 16);
  for (int tn0 = 0; tn0 < kTilesPerBlock; tn0 += C) {
    if constexpr (kInt8) {
      if constexpr (R >= kWordsMinRows) {
        PassInt8Words<K, R, C>(pr, n0, row0, tn0);
      } else {
        PassInt8<K, R, C>(pr, n0, row0, tn0);
      }
    } else {
      PassFloat<K, R, C>(pr, n0, row0, tn0);
    }
  }
}

using RowsPassFn = void (*)(const TrellisGemmProblem&, int64_t, int64_t);

template <int K, bool kInt8, int... Rs>
constexpr std::array<RowsPassFn, sizeof...(Rs)> MakeRowsPasses(std::integer_sequence<int, Rs...>) {
  return {&RowsPass<K, kInt8, Rs + 1>...};
}

// Rows of one pass at most: int8 16 (one accumulator per row and tile),
// fp32 8 (two).
template <bool kInt8>
constexpr int kMaxPassRows = kInt8 ? 16 : 8;

template <int K, bool kInt8>
void Block(const TrellisGemmProblem& pr, int64_t block) {
  static constexpr std::array<RowsPassFn, kMaxPassRows<kInt8>> passes =
      MakeRowsPasses<K, kInt8>(std::make_integer_sequence<int, kMaxPassRows<kInt8>>());
  const int64_t n0 = block * internal::kColumnBlock;
  const int64_t m = pr.m;
  for (int64_t i = 0; i < m;) {
    const int64_t rows = std::min<int64_t>(kMaxPassRows<kInt8>, m - i);
    passes[rows - 1](pr, n0, i);
    i += rows;
  }
}

}  // namespace

bool Supported() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512vbmi2") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

namespace {
std::atomic<bool> g_enabled{true};
}  // namespace

void SetEnabledForTest(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }
bool Enabled() { return g_enabled.load(std::memory_order_relaxed) && Supported(); }

internal::ColumnBlockFn Mul1GemvBlockFn(int bits, bool int8) {
  switch (bits) {
    case 1: return int8 ? &Block<1, true> : &Block<1, false>;
    case 2: return int8 ? &Block<2, true> : &Block<2, false>;
    case 3: return int8 ? &Block<3, true> : &Block<3, false>;
    case 4: return int8 ? &Block<4, true> : &Block<4, false>;
    default: return nullptr;
  }
}

}  // namespace exl3serve::kernels::cpu::avx512icl
