// kernels/cpu/trellis_gemm_avx512.cc — AVX-512 (F/BW/VL/DQ, +VNNI when the
// CPU has it) column-block kernel of TrellisGemm. Compiled with AVX-512 flags
// (kernels/CMakeLists.txt); never included elsewhere.
//
// Two paths per 128-column block (crossover kGemvMaxRows, measured below):
//
// GEMV (m small): the trellis is decoded in registers, 16 positions per zmm,
// and multiplied straight into position-order accumulators. Positions
// 32p..32p+31 of a tile are all 16 rows of columns p and p+8 (§3.2), so the
// activation pattern of a row of tiles is two zmm (x_pos) shared by all eight
// groups p and all tiles of that row; the accumulator of group p is reduced
// to its two columns once, after the last row of tiles.
//   Per 16 weights (K <= 4; uops on Intel, zmm):
//     window:  2 vpermi2d (p5) + vpsllvd + vpsrlvd + vpord + vpsrld   6
//     mul1:    vpmulld (2) + vpdpbusd (1) + vcvtdq2ps + vfmadd        5
//              fp16 RNE of the weight: vcvtps2ph + vcvtph2ps (2+2)     4
//     3inst/mcg: vpmulld (2) [+ vpaddd] + vpternlogd + 2x(vpmovdw 2 +
//              vcvtph2ps 2) [+ vpsrld] + vaddps + 4 (RNE)             ~15
//     product: 1 vfmadd per activation row (x_pos as memory operand)   1
//   => mul1 about 16 uops / 16 weights at m = 1 (~2 weights per cycle on
//   two vector ports); K = 5..8 add 2 permutes and a blend per vector.
//   kInt8 (mul1): window 6 + vpmulld 2 + vpdpbusd against the replicated
//   int8 activation 1 = 9 uops / 16 weights, no conversion at all.
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
#include <memory>

#include "kernels/cpu/cpu_features.h"
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

// Window tables of one K (§3.4): for vector v (positions 16v .. 16v+15) the
// tile words holding the start of each 16-bit window (idx0, wrapped mod 8K)
// and the next one (idx1), and the bit offset o of the window in idx0's word.
// state = ((w[idx0] << o) | (w[idx1] >> (32 - o))) >> 16.
struct alignas(64) WindowTable {
  int32_t idx0[kVectors][16];
  int32_t idx1[kVectors][16];
  int32_t shl[kVectors][16];
  int32_t shr[kVectors][16];
};

WindowTable MakeWindowTable(int bits) {
  WindowTable t;
  const int words = 8 * bits;
  for (int i = 0; i < kTileWeights; ++i) {
    int first = (i + 1) * bits - 16;
    if (first < 0) first += 256 * bits;
    const int j0 = first >> 5;
    t.idx0[i / 16][i % 16] = j0;
    t.idx1[i / 16][i % 16] = (j0 + 1) % words;
    t.shl[i / 16][i % 16] = first & 31;
    t.shr[i / 16][i % 16] = 32 - (first & 31);
  }
  return t;
}

const WindowTable& GetWindowTable(int bits) {
  static const WindowTable* tables = [] {
    auto* t = new WindowTable[kMaxBits + 1];
    for (int b = kMinBits; b <= kMaxBits; ++b) t[b] = MakeWindowTable(b);
    return t;
  }();
  return tables[bits];
}

// The 8K words of one tile in up to four zmm (words past the tile are zero).
template <int K>
struct TileRegs {
  __m512i r[(8 * K + 15) / 16];
};

template <int K>
inline TileRegs<K> LoadTile(const uint16_t* tile) {
  TileRegs<K> t;
  const int32_t* w = reinterpret_cast<const int32_t*>(tile);  // §3.4: LE words
  constexpr int kWords = 8 * K;
  for (int q = 0; q < (kWords + 15) / 16; ++q) {
    const int left = kWords - 16 * q;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    t.r[q] = _mm512_maskz_loadu_epi32(mask, w + 16 * q);
  }
  return t;
}

template <int K>
inline __m512i PickWords(const TileRegs<K>& t, __m512i idx) {
  if constexpr (K <= 2) {
    return _mm512_permutexvar_epi32(idx, t.r[0]);
  } else if constexpr (K <= 4) {
    return _mm512_permutex2var_epi32(t.r[0], idx, t.r[1]);
  } else {
    const __m512i lo = _mm512_permutex2var_epi32(t.r[0], idx, t.r[1]);
    const __m512i hi = _mm512_permutex2var_epi32(t.r[2], idx, t.r[K > 6 ? 3 : 2]);
    const __mmask16 upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    return _mm512_mask_blend_epi32(upper, lo, hi);
  }
}

// The 16 states of positions 16v .. 16v+15, one per 32-bit lane (§3.3-3.4).
template <int K>
inline __m512i States(const TileRegs<K>& t, const WindowTable& wt, int v) {
  const __m512i a = PickWords<K>(t, _mm512_load_si512(wt.idx0[v]));
  const __m512i b = PickWords<K>(t, _mm512_load_si512(wt.idx1[v]));
  const __m512i win = _mm512_or_si512(_mm512_sllv_epi32(a, _mm512_load_si512(wt.shl[v])),
                                      _mm512_srlv_epi32(b, _mm512_load_si512(wt.shr[v])));
  return _mm512_srli_epi32(win, 16);
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

// State -> the fp32 value of the fp16 weight, bit-exact with DecodeState.
template <Codebook kCb, bool kVnni>
inline __m512 DecodeStates(__m512i s) {
  if constexpr (kCb == Codebook::kMul1) {
    const __m512i t = ByteSum<kVnni>(_mm512_mullo_epi32(s, _mm512_set1_epi32(static_cast<int>(kMul1Mul))));
    const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(internal::kMul1Slope),
                                     _mm512_set1_ps(internal::kMul1Offset));  // exact
    return RoundToHalf(f);
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
template <int K, Codebook kCb, bool kVnni, int R>
void GemvRows(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;  // uint16 between rows of tiles
  const WindowTable& wt = GetWindowTable(K);
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m512 acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm512_setzero_ps();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * K;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, K);
      const TileRegs<K> regs = LoadTile<K>(tile);
      const float* xp[R];
      for (int b = 0; b < R; ++b) xp[b] = pr.x_pos + ((row0 + b) * groups + tk) * 32;
      for (int p = 0; p < 8; ++p) {
        const __m512 w0 = DecodeStates<kCb, kVnni>(States<K>(regs, wt, 2 * p));
        const __m512 w1 = DecodeStates<kCb, kVnni>(States<K>(regs, wt, 2 * p + 1));
        for (int b = 0; b < R; ++b) {
          acc[b][p] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp[b]), acc[b][p]);
          acc[b][p] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp[b] + 16), acc[b][p]);
        }
      }
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
template <int K, bool kVnni, int R>
void GemvRowsInt8(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int64_t groups = view.k / kTileDim;
  const int64_t tiles_n = view.n / kTileDim;
  const int64_t row_stride = tiles_n * 16 * K;
  const WindowTable& wt = GetWindowTable(K);
  const __m512i mul = _mm512_set1_epi32(static_cast<int>(kMul1Mul));
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m512i acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm512_setzero_si512();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * K;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, K);
      const TileRegs<K> regs = LoadTile<K>(tile);
      const uint32_t* xq[R];
      for (int b = 0; b < R; ++b) xq[b] = pr.x_pos_i8 + ((row0 + b) * groups + tk) * 32;
      for (int p = 0; p < 8; ++p) {
        const __m512i x0 = _mm512_mullo_epi32(States<K>(regs, wt, 2 * p), mul);
        const __m512i x1 = _mm512_mullo_epi32(States<K>(regs, wt, 2 * p + 1), mul);
        for (int b = 0; b < R; ++b) {
          const __m512i a0 = _mm512_loadu_si512(xq[b]);
          const __m512i a1 = _mm512_loadu_si512(xq[b] + 16);
          if constexpr (kVnni) {
            acc[b][p] = _mm512_dpbusd_epi32(acc[b][p], x0, a0);
            acc[b][p] = _mm512_dpbusd_epi32(acc[b][p], x1, a1);
          } else {
            // t (< 2^10) in the low half of each word times the sign-extended
            // activation: one vpmaddwd each (the high halves multiply 0).
            const __m512i t0 = ByteSum<false>(x0);
            const __m512i t1 = ByteSum<false>(x1);
            const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(a0, 24), 24);
            const __m512i s1 = _mm512_srai_epi32(_mm512_slli_epi32(a1, 24), 24);
            acc[b][p] = _mm512_add_epi32(acc[b][p], _mm512_madd_epi16(t0, s0));
            acc[b][p] = _mm512_add_epi32(acc[b][p], _mm512_madd_epi16(t1, s1));
          }
        }
      }
    }
    for (int b = 0; b < R; ++b) {
      const int64_t row = row0 + b;
      float* out = pr.y + row * view.n + n0 + tn * kTileDim;
      for (int p = 0; p < 8; ++p) {
        alignas(64) int32_t lanes[16];
        _mm512_store_si512(lanes, acc[b][p]);
        int32_t cp, cp8;
        ReduceGroup(lanes, &cp, &cp8);
        out[p] = internal::Int8Epilogue(cp, pr.x_int_sum[row], pr.x_scale[row]);
        out[p + 8] = internal::Int8Epilogue(cp8, pr.x_int_sum[row], pr.x_scale[row]);
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
  const WindowTable& wt = GetWindowTable(K);
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
            LoadTile<K>(view.trellis + (tk * tiles_n + n0 / kTileDim + tn) * 16 * K);
        float* dst = panels + (tn / 4) * kGemmKc * kGemmPanel + tkl * kTileDim * kGemmPanel +
                     (tn % 4) * kTileDim;
        alignas(64) float decoded[kTileWeights];
        for (int v = 0; v < kVectors; ++v) {
          _mm512_store_ps(decoded + 16 * v, DecodeStates<kCb, kVnni>(States<K>(regs, wt, v)));
        }
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

template <int K, Codebook kCb, bool kVnni>
void ColumnBlockFor(const TrellisGemmProblem& pr, int64_t block) {
  const int64_t n0 = block * internal::kColumnBlock;
  const int64_t m = pr.m;
  if constexpr (kCb == Codebook::kMul1) {
    if (pr.precision == TrellisGemmPrecision::kInt8) {
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

void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block) {
  const bool vnni = GetCpuFeatures().avx512vnni;
  const BlockFn fn = vnni ? Pick<true>(problem.view->codebook, problem.view->bits)
                          : Pick<false>(problem.view->codebook, problem.view->bits);
  fn(problem, block);
}

}  // namespace exl3serve::kernels::cpu::avx512
