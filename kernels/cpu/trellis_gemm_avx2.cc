// kernels/cpu/trellis_gemm_avx2.cc — AVX2+FMA+F16C column-block kernel of
// TrellisGemm (the floor every x86 host runs). Compiled with AVX2 flags
// (kernels/CMakeLists.txt); never included elsewhere. Same structure as the
// AVX-512 file (read its header comment first), at 8 lanes:
//
// GEMV (m small): a 32-position group p (all 16 rows of columns p, p+8,
// §3.2) is four ymm; the activation pattern of a row of tiles is four ymm.
//   Per 8 weights: window = 2 vpgatherdd (the tile's 8K words do not fit one
//   vpermd table) + vpsllvd + vpsrlvd + vpor + vpsrld; mul1 = vpmulld +
//   vpmaddubsw + vpmaddwd + vcvtdq2ps + vfmadd + RNE (vcvtps2ph + vcvtph2ps);
//   + 1 vfmadd per activation row. The gathers dominate (~4-8 cycles each).
//   kInt8: window + vpmulld + vpmaddubsw + vpmaddwd (t) + vpmaddwd (t·x) + add.
// Tile GEMM (m large): decode 128 rows x 128 columns into fp32 panels, then a
// 6 x 16 micro-kernel (12 ymm accumulators, 2 loads + 6 broadcasts per 12 FMAs).
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "kernels/cpu/trellis_gemm_internal.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels::cpu::avx2 {
namespace {

using internal::TrellisGemmProblem;

constexpr int kVectors = kTileWeights / 8;  // 32 ymm of positions per tile
constexpr int kTilesPerBlock = 8;
// Register GEMV up to this many rows, tile GEMM above (same measurement as
// the AVX-512 crossover; see kernels/cpu/README.md).
constexpr int64_t kGemvMaxRows = 16;
constexpr int kGemmKc = 128;
constexpr int kGemmPanel = 16;  // columns per micro-kernel panel (2 ymm)
constexpr int kGemmMr = 6;
constexpr int kPrefetchTiles = 4;

struct alignas(32) WindowTable {
  int32_t idx0[kVectors][8];
  int32_t idx1[kVectors][8];
  int32_t shl[kVectors][8];
  int32_t shr[kVectors][8];
};

WindowTable MakeWindowTable(int bits) {
  WindowTable t;
  for (int i = 0; i < kTileWeights; ++i) {
    int first = (i + 1) * bits - 16;
    if (first < 0) first += 256 * bits;
    const int j0 = first >> 5;
    t.idx0[i / 8][i % 8] = j0;
    t.idx1[i / 8][i % 8] = (j0 + 1) % (8 * bits);
    t.shl[i / 8][i % 8] = first & 31;
    t.shr[i / 8][i % 8] = 32 - (first & 31);
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

// States of positions 8v .. 8v+7 (§3.3-3.4); `words` is the tile as LE words.
inline __m256i States(const int* words, const WindowTable& wt, int v) {
  const __m256i a = _mm256_i32gather_epi32(words, _mm256_load_si256(reinterpret_cast<const __m256i*>(wt.idx0[v])), 4);
  const __m256i b = _mm256_i32gather_epi32(words, _mm256_load_si256(reinterpret_cast<const __m256i*>(wt.idx1[v])), 4);
  const __m256i win = _mm256_or_si256(
      _mm256_sllv_epi32(a, _mm256_load_si256(reinterpret_cast<const __m256i*>(wt.shl[v]))),
      _mm256_srlv_epi32(b, _mm256_load_si256(reinterpret_cast<const __m256i*>(wt.shr[v]))));
  return _mm256_srli_epi32(win, 16);
}

inline __m256 RoundToHalf(__m256 f) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline __m256i ByteSum(__m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(x, _mm256_set1_epi8(1)), _mm256_set1_epi16(1));
}

// fp16 halves of a 3inst/mcg word -> exact fp32 sum (§4.1, §4.4).
inline __m256 HalfPairSum(__m256i x) {
  x = _mm256_xor_si256(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(kHalfPairMask))),
                       _mm256_set1_epi32(static_cast<int>(kHalfPairXor)));
  // Low halves to the low 16 bits of each word, packed: vpshufb per 128-bit lane.
  const __m256i lo_shuf = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i hi_shuf = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                           2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, lo_shuf), 0x08);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, hi_shuf), 0x08);
  return _mm256_add_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(lo)),
                       _mm256_cvtph_ps(_mm256_castsi256_si128(hi)));
}

// mul1 weight of byte sums t: exact value by one FMA, then the fp16 RNE
// round trip (vcvtps2ph + vcvtph2ps). The Veltkamp form of the AVX-512 file
// (3 fp uops instead of the 4-uop round trip) measured 13 % slower here
// (it needs an asm barrier against FMA contraction), so AVX2 keeps F16C.
inline __m256 Mul1WeightOfByteSum(__m256i t) {
  return RoundToHalf(_mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(internal::kMul1Slope),
                                     _mm256_set1_ps(internal::kMul1Offset)));
}

template <Codebook kCb>
inline __m256 DecodeStates(__m256i s) {
  if constexpr (kCb == Codebook::kMul1) {
    const __m256i t = ByteSum(_mm256_mullo_epi32(s, _mm256_set1_epi32(static_cast<int>(kMul1Mul))));
    return Mul1WeightOfByteSum(t);
  } else if constexpr (kCb == Codebook::kMcg) {
    return RoundToHalf(HalfPairSum(_mm256_mullo_epi32(s, _mm256_set1_epi32(static_cast<int>(kMcgMul)))));
  } else {
    return RoundToHalf(HalfPairSum(_mm256_add_epi32(
        _mm256_mullo_epi32(s, _mm256_set1_epi32(k3InstMul)), _mm256_set1_epi32(k3InstAdd))));
  }
}

inline void PrefetchTile(const uint16_t* tile, int bits) {
  const char* p = reinterpret_cast<const char*>(tile);
  for (int off = 0; off < 32 * bits; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

template <typename T>
inline void ReduceGroup(const T lanes[8], T* col_p, T* col_p8) {
  *col_p = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  *col_p8 = (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]);
}

template <Codebook kCb, int R>
void GemvRows(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int bits = view.bits;
  const int64_t groups = view.k / kTileDim;
  const int64_t row_stride = (view.n / kTileDim) * 16 * bits;
  const WindowTable& wt = GetWindowTable(bits);
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m256 acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm256_setzero_ps();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * bits;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, bits);
      const int* words = reinterpret_cast<const int*>(tile);
      for (int p = 0; p < 8; ++p) {
        for (int q = 0; q < 4; ++q) {
          const __m256 w = DecodeStates<kCb>(States(words, wt, 4 * p + q));
          for (int b = 0; b < R; ++b) {
            const float* xp = pr.x_pos + ((row0 + b) * groups + tk) * 32 + 8 * q;
            acc[b][p] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp), acc[b][p]);
          }
        }
      }
    }
    for (int b = 0; b < R; ++b) {
      float* out = pr.y + (row0 + b) * view.n + n0 + tn * kTileDim;
      for (int p = 0; p < 8; ++p) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[b][p]);
        ReduceGroup(lanes, out + p, out + p + 8);
      }
    }
  }
}

template <int R>
void GemvRowsInt8(const TrellisGemmProblem& pr, int64_t n0, int64_t row0) {
  const Exl3LinearView& view = *pr.view;
  const int bits = view.bits;
  const int64_t groups = view.k / kTileDim;
  const int64_t row_stride = (view.n / kTileDim) * 16 * bits;
  const WindowTable& wt = GetWindowTable(bits);
  const __m256i mul = _mm256_set1_epi32(static_cast<int>(kMul1Mul));
  for (int tn = 0; tn < kTilesPerBlock; ++tn) {
    __m256i acc[R][8];
    for (int b = 0; b < R; ++b)
      for (int p = 0; p < 8; ++p) acc[b][p] = _mm256_setzero_si256();
    const uint16_t* tile = view.trellis + (n0 / kTileDim + tn) * 16 * bits;
    for (int64_t tk = 0; tk < groups; ++tk, tile += row_stride) {
      if (tk + kPrefetchTiles < groups) PrefetchTile(tile + kPrefetchTiles * row_stride, bits);
      const int* words = reinterpret_cast<const int*>(tile);
      for (int p = 0; p < 8; ++p) {
        for (int q = 0; q < 4; ++q) {
          const __m256i t = ByteSum(_mm256_mullo_epi32(States(words, wt, 4 * p + q), mul));
          for (int b = 0; b < R; ++b) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                pr.x_pos_i8 + ((row0 + b) * groups + tk) * 32 + 8 * q));
            const __m256i s = _mm256_srai_epi32(_mm256_slli_epi32(a, 24), 24);
            acc[b][p] = _mm256_add_epi32(acc[b][p], _mm256_madd_epi16(t, s));  // t < 2^10
          }
        }
      }
    }
    for (int b = 0; b < R; ++b) {
      const int64_t row = row0 + b;
      int32_t* out = pr.y_int + row * view.n + n0 + tn * kTileDim;
      for (int p = 0; p < 8; ++p) {
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[b][p]);
        ReduceGroup(lanes, &out[p], &out[p + 8]);
      }
    }
  }
}

template <int kMr>
void MicroKernel(const float* x, int64_t ldx, const float* panel, int kc, float* y, int64_t ldy,
                 bool first) {
  __m256 acc[kMr][2];
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 2; ++j) {
      acc[i][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * ldy + 8 * j);
    }
  }
  for (int kk = 0; kk < kc; ++kk) {
    const __m256 b0 = _mm256_load_ps(panel + kk * kGemmPanel);
    const __m256 b1 = _mm256_load_ps(panel + kk * kGemmPanel + 8);
    for (int i = 0; i < kMr; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + kk);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < kMr; ++i) {
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + i * ldy + 8 * j, acc[i][j]);
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int, float*, int64_t, bool);
constexpr MicroFn kMicro[kGemmMr + 1] = {nullptr, MicroKernel<1>, MicroKernel<2>, MicroKernel<3>,
                                         MicroKernel<4>, MicroKernel<5>, MicroKernel<6>};

template <Codebook kCb>
void GemmBlock(const TrellisGemmProblem& pr, int64_t n0) {
  const Exl3LinearView& view = *pr.view;
  const int bits = view.bits;
  const int64_t k = view.k;
  const int64_t n = view.n;
  const int64_t m = pr.m;
  const int64_t tiles_n = n / kTileDim;
  const WindowTable& wt = GetWindowTable(bits);
  constexpr int kPanels = internal::kColumnBlock / kGemmPanel;  // 8: one per tile column
  thread_local std::unique_ptr<float[], decltype(&std::free)> buffer(
      static_cast<float*>(std::aligned_alloc(32, kPanels * kGemmKc * kGemmPanel * sizeof(float))),
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
        const int* words =
            reinterpret_cast<const int*>(view.trellis + (tk * tiles_n + n0 / kTileDim + tn) * 16 * bits);
        float* dst = panels + tn * kGemmKc * kGemmPanel + tkl * kTileDim * kGemmPanel;
        alignas(32) float decoded[kTileWeights];
        for (int v = 0; v < kVectors; ++v) {
          _mm256_store_ps(decoded + 8 * v, DecodeStates<kCb>(States(words, wt, v)));
        }
        for (int j = 0; j < kTileWeights; ++j) {
          const int rc = TilePermutation(j);  // §3.2; panel = one tile column
          dst[(rc / kTileDim) * kGemmPanel + rc % kTileDim] = decoded[j];
        }
      }
    }
    for (int panel = 0; panel < kPanels; ++panel) {
      const float* w = panels + panel * kGemmKc * kGemmPanel;
      for (int64_t i = 0; i < m; i += kGemmMr) {
        const int rows = static_cast<int>(std::min<int64_t>(kGemmMr, m - i));
        kMicro[rows](pr.x_had + i * k + k0, k, w, kc, pr.y + i * n + n0 + panel * kGemmPanel, n,
                     k0 == 0);
      }
    }
  }
}


template <Codebook kCb>
void ColumnBlockFor(const TrellisGemmProblem& pr, int64_t block) {
  const int64_t n0 = block * internal::kColumnBlock;
  const int64_t m = pr.m;
  if (kCb == Codebook::kMul1 && pr.precision == TrellisGemmPrecision::kInt8) {
    int64_t i = 0;
    for (; i + 2 <= m; i += 2) GemvRowsInt8<2>(pr, n0, i);
    if (i < m) GemvRowsInt8<1>(pr, n0, i);
    return;
  }
  if (m <= kGemvMaxRows && pr.x_pos != nullptr) {
    int64_t i = 0;
    for (; i + 2 <= m; i += 2) GemvRows<kCb, 2>(pr, n0, i);
    if (i < m) GemvRows<kCb, 1>(pr, n0, i);
    return;
  }
  GemmBlock<kCb>(pr, n0);
}

}  // namespace

void Mul1WeightsForTest(const int32_t* t, int64_t count, float* w) {
  for (int64_t i = 0; i + 8 <= count; i += 8) {
    const __m256i tv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + i));
    _mm256_storeu_ps(w + i, Mul1WeightOfByteSum(tv));
  }
}

void TrellisGemmColumnBlock(const internal::TrellisGemmProblem& problem, int64_t block) {
  if (problem.precision == TrellisGemmPrecision::kBf16) {
    // No AVX2 kernel yet: the scalar reference is the bit-exact emulation.
    scalar::TrellisGemmColumnBlock(problem, block);
    return;
  }
  switch (problem.view->codebook) {
    case Codebook::kMul1: ColumnBlockFor<Codebook::kMul1>(problem, block); break;
    case Codebook::kMcg: ColumnBlockFor<Codebook::kMcg>(problem, block); break;
    default: ColumnBlockFor<Codebook::k3Inst>(problem, block); break;
  }
}

}  // namespace exl3serve::kernels::cpu::avx2
